"""The simulator bench flags its own regressions: a case more than 1.5x slower in CPU time than its
last committed line is named, with its ratio (``experiments/bench_sim.py``; no timing here: the
comparison is fed made-up lines)."""

from __future__ import annotations

import json

from overlap_lab.experiments.bench_sim import REGRESSION, last_results, regressions


def test_each_case_is_compared_with_its_last_line(tmp_path):
    path = tmp_path / "bench_sim.jsonl"  # outside any git checkout: the file as it is
    lines = [
        {"case": "a", "total_cpu_ms": 100.0, "date": "2026-11-20"},
        {"case": "b", "total_cpu_ms": 10.0},
        {"case": "a", "total_cpu_ms": 40.0, "date": "2026-11-24", "revision": "abc1234"},
        {"case": "sweep", "total_cpu_ms": 5000.0},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    last = last_results(path)
    assert last["a"]["total_cpu_ms"] == 40.0  # the last line of a case is its baseline
    new = [
        {"case": "a", "total_cpu_ms": 61.0},  # 1.525x: regressed
        {"case": "b", "total_cpu_ms": 15.0},  # 1.5x: not more than the limit
        {"case": "sweep", "total_cpu_ms": 2500.0},  # faster
        {"case": "new", "total_cpu_ms": 1.0},  # nothing to compare with
        {"case": "b", "error": "Traceback"},  # failed: nothing to compare
    ]
    slow = regressions(new, last)
    assert len(slow) == 1 and slow[0].startswith("REGRESSION a: 61.0 ms CPU, 1.52x")
    assert "40.0 ms (2026-11-24, abc1234; limit 1.5x)" in slow[0]
    assert [r.get("vs_last_cpu") for r in new] == [1.52, 1.5, 0.5, None, None]
    assert REGRESSION == 1.5


def test_no_results_yet(tmp_path):
    assert last_results(tmp_path / "missing.jsonl") == {}
