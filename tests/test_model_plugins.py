"""A cost model and a network in a separate package: installed for real (pip, no network) from
the blocks docs/architecture.md shows, found through the ``overlap_lab.cost_models`` and
``overlap_lab.networks`` entry point groups, and chosen by name on the command line, in-process."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

import overlap_lab as ol
from overlap_lab.cli.main import main
from overlap_lab.sim import models
from tests.test_models import doc_blocks

PYPROJECT = """\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "overlap-lab-my-models"
version = "0.1.0"

[tool.setuptools]
py-modules = ["my_models"]

"""


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """docs/architecture.md's package, pip-installed into a folder on ``sys.path``, with the
    registries discovering afresh (and forgetting it after the test)."""
    tomls, code = doc_blocks()
    toml_text = (  # the doc's entry points, as the doc writes them
        "\n".join(
            f'[project.entry-points."{g}"]\n' + "".join(f'"{n}" = "{t}"\n' for n, t in eps.items())
            for g, eps in tomls["project"]["entry-points"].items()
        )
    )
    src, site = tmp_path / "src", tmp_path / "site"
    src.mkdir()
    (src / "pyproject.toml").write_text(PYPROJECT + toml_text)
    (src / "my_models.py").write_text("\n\n".join(code))
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip, "--target", str(site), str(src)], check=True, capture_output=True)
    monkeypatch.syspath_prepend(str(site))
    for reg in (models.COST_MODELS, models.NETWORKS):
        monkeypatch.setattr(reg, "_entries", None)
        monkeypatch.setattr(reg, "_loaded", {})
    yield importlib.import_module("my_models")
    sys.modules.pop("my_models", None)


ARGS = ("--layers", "3", "--batch", "16", "--ranks", "explicit", "--imbalance", "zipf:1.2")


def test_sim_picks_the_models_an_installed_package_registers(installed, capsys):
    assert models.COST_MODELS.names() == ["roofline", "table"]
    assert models.NETWORKS.names() == ["max-min", "contention-free"]
    with pytest.raises(SystemExit):
        main(["sim", "--help"])
    assert "one of roofline, table" in " ".join(capsys.readouterr().out.split())

    cli = ["sim", "--schedule", "tbo", *ARGS, "--json", "--out", ""]
    rc = main([*cli, "--cost-model", "table", "--network", "contention-free"])
    res = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert res["provenance"]["inputs"]["cost_model"] == "table"
    assert res["provenance"]["inputs"]["network"] == "contention-free"
    assert {s for by in res["cost_sources"].values() for s in by} == {"table"}

    # the same run through the API, with the package's objects: the same numbers
    w = ol.workload("deepseek-v3", layers=3, batch=16)
    api = ol.simulate(
        "tbo",
        w,
        ranks="explicit",
        imbalance="zipf:1.2",
        cost_model=installed.table_predictor(None),
        network=installed.ContentionFreeNetwork,
    )
    assert res["step_time_us"] == api.metrics.iteration_us
    named = ol.simulate(
        "tbo", w, ranks="explicit", imbalance="zipf:1.2", cost_model="table",
        network="contention-free",
    )  # fmt: skip
    assert named.trace.meta["cost_model"] == "table"
    assert named.trace.step_time_us == api.trace.step_time_us

    rc = main(["sim", "--schedule", "tbo", *ARGS, "--json", "--out", ""])
    default = json.loads(capsys.readouterr().out)
    assert rc == 0 and default["step_time_us"] != res["step_time_us"]
    assert default["provenance"]["inputs"]["cost_model"] == "roofline"


def test_compare_picks_them_too(installed, capsys):
    rc = main(
        ["compare", "--schedules", "serial,tbo", *ARGS, "--json", "--out", "",
         "--cost-model", "table", "--network", "contention-free"]
    )  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert (out["provenance"]["inputs"]["cost_model"], out["provenance"]["inputs"]["network"]) == (
        "table",
        "contention-free",
    )
    for row in out["results"]:
        assert {s for by in row["cost_sources"].values() for s in by} == {"table"}
