"""A model cut to fewer layers (``--layers``) is labelled as such in every output: the ``sim``
summary, ``compare``'s header, the JSON, figure titles and the sweep CSV; an uncut model keeps its
plain name."""

from __future__ import annotations

import json

import pytest

from overlap_lab import api
from overlap_lab.cli.main import main
from overlap_lab.cli.sweep import run_sweep
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.workload import get_model, with_layers
from overlap_lab.sweep_csv import read_rows

CUT = "deepseek-v2-lite[3 of 27 layers]"
SMALL = ["--model", "deepseek-v2-lite", "--layers", "3", "--ep", "8", "--batch", "16"]


def test_with_layers_remembers_the_full_depth():
    full = get_model("deepseek-v3")
    cut = with_layers(full, 8)
    assert full.layers_total is None and full.label == "deepseek-v3"
    assert cut.layers_total == 61 and cut.label == "deepseek-v3[8 of 61 layers]"
    assert with_layers(cut, 4).label == "deepseek-v3[4 of 61 layers]"  # the first full count
    assert with_layers(full, 61) is full  # all layers: not cut
    with pytest.raises(ConfigError, match="layers_total"):
        get_model("deepseek-v3", num_layers=8, layers_total=4)


def test_sim_summary_and_json_say_the_layers(capsys, tmp_path):
    assert main(["sim", *SMALL, "--out", str(tmp_path / "a")]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert head.startswith(f"serial: {CUT} decode on h800")
    assert main(["sim", *SMALL, "--json", "--out", str(tmp_path / "b")]) == 0
    res = json.loads(capsys.readouterr().out)
    assert (res["model"], res["layers"], res["model_layers_total"]) == (CUT, 3, 27)


def test_an_uncut_model_keeps_its_name():
    w = api.workload("deepseek-v2-lite", ep=8, batch=16)
    res = api.simulate("serial", w).as_dict()
    assert (res["model"], res["layers"], res["model_layers_total"]) == ("deepseek-v2-lite", 27, 27)


def test_compare_header_and_figure_title_say_the_layers():
    from overlap_lab.figures import default_title

    w = api.workload("deepseek-v2-lite", layers=3, ep=8, batch=16)
    table = api.compare(["serial"], w)
    assert table.text().splitlines()[0].startswith(f"{CUT} decode on h800")
    assert CUT in default_title(table.baseline.trace)


def test_sweep_csv_names_the_cut_model(tmp_path):
    spec = {"base": {"model": "deepseek-v2-lite", "layers": 3, "ep": 8, "batch": 16}}
    out = tmp_path / "s.csv"
    run_sweep(spec, out, processes=1, progress=False)
    (row,) = read_rows(out)
    assert (row["model_name"], row["model_layers"]) == (CUT, "3")
