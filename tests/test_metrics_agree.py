"""One meaning per number: every time that ``sim --json``, the API, a sweep row, ``sim``'s printed
summary and ``compare``'s table report is per iteration unless its name ends in ``_window_us``,
and the four agree for every schedule (docs/metrics.md)."""

from __future__ import annotations

import json
import re

import pytest

import overlap_lab as ol
from overlap_lab.cli.main import main
from overlap_lab.cli.sweep import run_sweep
from overlap_lab.shared.schedules import SCHEDULES
from overlap_lab.sweep_csv import read_rows

WORKLOAD = ["--layers", "3", "--ep", "8", "--batch", "16"]


@pytest.fixture(scope="module")
def sweep_rows(tmp_path_factory) -> dict[str, dict[str, str]]:
    out = tmp_path_factory.mktemp("sweep") / "s.csv"
    spec = {
        "base": {"layers": 3, "ep": 8, "batch": 16},
        "grid": {"schedule": list(SCHEDULES)},
    }
    run_sweep(spec, out, processes=1, progress=False)
    return {r["schedule"]: r for r in read_rows(out)}


def _summary_ms(text: str, label: str) -> float:
    return float(re.search(rf"^  {label}\s+([\d.]+) ms", text, re.M).group(1))


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_json_api_csv_and_printed_numbers_agree(schedule, sweep_rows, capsys):
    assert main(["sim", "--schedule", schedule, *WORKLOAD, "--json", "--out", ""]) == 0
    js = json.loads(capsys.readouterr().out)
    assert main(["sim", "--schedule", schedule, *WORKLOAD, "--out", ""]) == 0
    text = capsys.readouterr().out
    w = ol.workload("deepseek-v3", batch=16, ep=8, layers=3)
    m = ol.simulate(schedule, w, "h800").metrics
    row = sweep_rows[schedule]
    it = m.iterations
    # per iteration: the window's times over its iterations, whatever the schedule's window
    assert m.exposed_comm_us == pytest.approx(m.exposed_comm_window_us / it)
    assert m.comm_us == pytest.approx(m.comm_window_us / it)
    assert m.exposed_comm_us <= m.comm_us <= m.iteration_us * (1 + 1e-9)
    for key in ("iteration_us", "window_us", "comm_us", "exposed_comm_us", "sm_compute"):
        assert js[key] == pytest.approx(getattr(m, key)), key
        assert float(row[key]) == pytest.approx(getattr(m, key)), key
    assert js["step_time_us"] == float(row["step_time_us"]) == pytest.approx(m.iteration_us)
    assert int(row["iterations"]) == js["iterations"] == it
    assert all(v <= m.iteration_us * (1 + 1e-9) for v in js["busy_us"].values())
    for k, v in js.get("report", {}).items():  # a schedule's own totals say they are the window's
        if k.endswith("_us") and not k.endswith("_window_us"):
            assert v <= m.iteration_us * (1 + 1e-9), k
    assert _summary_ms(text, "step time") == pytest.approx(m.iteration_us / 1e3, abs=1e-3)
    assert _summary_ms(text, "exposed comm") == pytest.approx(m.exposed_comm_us / 1e3, abs=1e-3)
    assert _summary_ms(text, "communication") == pytest.approx(m.comm_us / 1e3, abs=1e-3)


def test_compare_table_prints_the_apis_per_iteration_numbers():
    w = ol.workload("deepseek-v3", batch=16, ep=8, layers=3)
    table = ol.compare(["serial", "sglang-overlap", "pp"], w, "h800")
    rows = [ln.replace(" mb ", " ") for ln in table.text().splitlines()[2:5]]  # pp's "8 mb"
    lines = {ln.split()[0]: ln.split() for ln in rows}
    for row in table.rows:
        m = row.result.metrics
        cols = lines[row.schedule]
        assert float(cols[3]) == pytest.approx(m.iteration_us / 1e3, abs=1e-3)
        assert float(cols[7]) == pytest.approx(m.exposed_comm_us / 1e3, abs=1e-3)


def test_sweep_rows_say_what_produced_them(tmp_path):
    """A row names the GPU as simulated (overrides included), the model with its layers and the
    source of its op durations, and splits SM time instead of adding comm to compute."""
    out = tmp_path / "s.csv"
    spec = {
        "base": {"layers": 3, "ep": 8, "batch": 16, "schedule": "serial"},
        "grid": {"hbm_gbps": [None, 2000.0], "profile": ["auto", "roofline"]},
    }
    run_sweep(spec, out, processes=1, progress=False)
    rows = read_rows(out)
    assert "sm_utilisation" not in rows[0]
    assert [r["gpu_name"] for r in rows] == ["h800"] * 2 + ["h800+hbm-gbps=2000"] * 2
    assert {r["model_name"] for r in rows} == {"deepseek-v3[3 of 61 layers]"}
    assert {r["model_layers"] for r in rows} == {"3"}
    assert [r["profile_name"] for r in rows[:2]] == ["h800-published", "roofline"]
    assert all(re.fullmatch(r"(\w+=\d+;)*\w+=\d+", r["cost_sources"]) for r in rows)
    for r in rows:
        split = float(r["sm_compute"]) + float(r["sm_comm"]) + float(r["sm_idle"])
        assert split == pytest.approx(1.0)
