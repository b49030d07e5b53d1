"""The experiment runner: a tiny declared experiment runs through it, writes its results file and
a figure drawn from that file; rows are deterministic and the same serial or in parallel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overlap_lab.experiments.runner import (
    Case,
    Experiment,
    declared,
    kept_traces,
    md_table,
    run,
    speedup,
)
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model


def tiny_cases():
    w = Workload(get_model("deepseek-v2-lite", num_layers=2), Batch.decode(16), Parallel(ep=8))
    yield Case({"tokens": 16}, "serial", w, "h100", keep="serial")
    yield Case({"tokens": 16}, "tbo", w, "h100")


def tiny_derive(rows: list[dict]) -> list[dict]:
    return speedup(rows, over={"schedule": "serial"}, by=("tokens",))


def tiny_figure(doc: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    from overlap_lab.figures import save_figure, timeline

    fig = Figure(figsize=(6, 4), layout="constrained")
    ax, ax2 = fig.subplots(2, 1)
    ax.bar([r["schedule"] for r in doc["rows"]], [r["step_time_us"] for r in doc["rows"]])
    timeline(kept_traces(doc)["serial"], ax2, legend=False)
    save_figure(fig, path, suffixes=(".png",))


def tiny_notes(doc: dict) -> str:
    return md_table(["schedule", "step (µs)"], [[r["schedule"], 1] for r in doc["rows"]])


TINY = Experiment(
    name="tiny",
    title="two cases",
    cases=tiny_cases,
    derive=tiny_derive,
    figure=tiny_figure,
    notes=tiny_notes,
    meta={"note": "test"},
)


def rows_of(path: Path) -> list[dict]:
    return json.loads(path.read_text())["rows"]


def test_run_writes_json_figure_and_notes(tmp_path: Path) -> None:
    path = run(TINY, processes=1, out=tmp_path)
    doc = json.loads(path.read_text())
    assert path == tmp_path / "tiny.json"
    assert [r["schedule"] for r in doc["rows"]] == ["serial", "tbo"]
    serial, tbo = doc["rows"]
    assert serial["speedup"] == 1.0
    assert tbo["speedup"] == pytest.approx(serial["step_time_us"] / tbo["step_time_us"])
    for k in ("step_time_us", "exposed_comm_us", "comm_only_us", "compute_kernel_us"):
        assert tbo[k] >= 0
    assert (
        doc["command"] == "python -m overlap_lab.experiments tiny"
        and doc["date"]
        and doc["note"] == "test"
    )
    assert doc["presets"]["models"]["deepseek-v2-lite"]["num_layers"] == 2
    assert doc["presets"]["gpus"]["h100"]["num_sms"] > 0
    assert list(doc["traces"]) == ["serial"]
    kept = kept_traces(doc)["serial"]
    assert kept.step_time_us == serial["step_time_us"]
    assert (tmp_path / "tiny.png").stat().st_size > 0
    assert (tmp_path / "tiny.md").read_text().startswith("| schedule | step (µs) |\n|---|---|")


def test_rows_deterministic_and_parallel_equals_serial(tmp_path: Path) -> None:
    a = rows_of(run(TINY, processes=1, out=tmp_path / "a"))
    b = rows_of(run(TINY, processes=1, out=tmp_path / "b"))
    c = rows_of(run(TINY, processes=2, out=tmp_path / "c"))
    assert a == b == c
    assert (tmp_path / "a" / "tiny.json").read_text().split('"rows"')[1] == (
        tmp_path / "c" / "tiny.json"
    ).read_text().split('"rows"')[1]


def test_duplicate_keep_labels_rejected(tmp_path: Path) -> None:
    def cases():
        return [c.__class__(**{**c.__dict__, "keep": "x"}) for c in tiny_cases()]

    with pytest.raises(ConfigError, match="same label"):
        run(Experiment("dup", "dup", cases), processes=1, out=tmp_path)


def test_md_table() -> None:
    assert md_table(["a", "b"], [[1, "x"]], align="---:") == "| a | b |\n|---:|---:|\n| 1 | x |"


def test_declared_experiments() -> None:
    exps = declared()
    for name in ("tbo_decode", "tbo_prefill", "sbo_comm_sms", "pp_bubbles", "cpu_overlap"):
        assert name in exps and exps[name].figure is not None
    assert "lightllm_vs_deepseek" in exps


def test_results_go_where_the_user_says_never_inside_the_install(tmp_path, monkeypatch, capsys):
    """Issue 11, item 2: results were written into site-packages and --draw died with a
    FileNotFoundError traceback."""
    import overlap_lab
    from overlap_lab.experiments import runner

    assert not runner.RESULTS.is_absolute()  # ./overlap-lab-results, in the working directory
    assert runner.RESULTS == Path("overlap-lab-results")
    monkeypatch.chdir(tmp_path)
    assert runner.main(["--draw", "pp_bubbles"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--out overlap-lab-results" in err[0]
    # a run writes into --out, and nothing under the package
    pkg = Path(overlap_lab.__file__).resolve().parent
    before = {p for p in pkg.parent.rglob("*.json")}
    exp = Experiment("tiny_out", "t", tiny_cases, derive=tiny_derive)
    path = run(exp, processes=1, out=tmp_path / "mine")
    assert path == tmp_path / "mine" / "tiny_out.json" and path.exists()
    assert {p for p in pkg.parent.rglob("*.json")} == before
