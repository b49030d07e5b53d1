"""The wait before a replayed graph's first kernel, per graph (overlap_lab.graph_launch;
experiments/gpu_validation/predict.py ``calibrate``, ``graph_wait``).

Hand-built profiler records of graph replays (a ``cudaGraphLaunch`` and the device records
with its correlation), so every number asserted is computed here: the records before the
graph's first memset, where its first record started in its launch, and the wait the
prediction charges a schedule's graph from serial's measured one."""

from __future__ import annotations

import dataclasses

import pytest

from overlap_lab.device_time import GRAPH_LAUNCH
from overlap_lab.experiments.gpu_validation.context import Setup
from overlap_lab.experiments.gpu_validation.predict import graph_wait
from overlap_lab.graph_launch import (
    LaunchWait,
    first_segment,
    fit_wait,
    replay_launches,
    unprofiled_launch,
)
from overlap_lab.shared.inputs.hardware import get_gpu


def _replay(at: float, launch_us: float, cats: list[str], corr: int, first_us: float,
            streams=(7,)) -> list[dict]:  # fmt: skip
    """One replay: its launch at ``at`` holding the host ``launch_us``, then one device
    record per entry of ``cats`` (2 µs apart from ``at + first_us``, round-robin over
    ``streams``), all with correlation ``corr``."""
    ev = [{"ph": "X", "cat": "cuda_runtime", "name": GRAPH_LAUNCH, "ts": at, "dur": launch_us,
           "args": {"correlation": corr}}]  # fmt: skip
    for i, cat in enumerate(cats):
        ev.append({"ph": "X", "cat": cat, "name": f"r{i}", "ts": at + first_us + 2.0 * i,
                   "dur": 1.0, "args": {"correlation": corr,
                                        "stream": streams[i % len(streams)]}})  # fmt: skip
    return ev


def _cats(n: int, memsets: tuple[int, ...] = ()) -> list[str]:
    return ["gpu_memset" if i in memsets else "kernel" for i in range(n)]


def test_a_replay_s_launch_first_segment_and_first_record():
    ev = _replay(1000.0, 400.0, _cats(10, (4, 7)), 5, 90.0, streams=(7, 8))
    ev += _replay(3000.0, 300.0, _cats(10), 6, 301.0)
    ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 10.0,
               "dur": 2.0, "args": {"correlation": 1}})  # fmt: skip
    a, b = replay_launches({"traceEvents": ev})
    assert (a.records, a.first_segment, a.launch_us, a.first_record_us, a.streams) == (
        10, 4, 400.0, 90.0, 2)  # fmt: skip
    assert a.first_share == pytest.approx(90.0 / 400.0)
    # no memset: the whole graph is its first segment, its first record as the launch returns
    assert (b.records, b.first_segment, b.streams) == (10, 10, 1)
    assert b.first_share == pytest.approx(301.0 / 300.0)


def test_first_segment_is_the_median_over_replays_and_none_without_one():
    ev = []
    for i, at in enumerate((3, 5, 9)):
        ev += _replay(1000.0 * (i + 1), 100.0, _cats(12, (at,)), 10 + i, 5.0)
    assert first_segment({"traceEvents": ev}) == 5
    assert first_segment(ev) == 5  # a list of events does as well
    assert first_segment(None) is None
    assert first_segment({"traceEvents": []}) is None
    # a launch whose records are absent (trimmed) is no replay
    assert replay_launches([ev[0] | {"args": {"correlation": 99}}]) == []


def test_the_rule_from_serial_s_measured_waits():
    # one first segment measured: its wait spread over its records
    one = fit_wait([(720, 360.0), (None, 50.0), (100, None)])
    assert (one.fixed_us, one.per_record_us) == (0.0, pytest.approx(0.5))
    assert one.us(191) == pytest.approx(95.5)
    # two: the line through them (here 40 µs + 0.4 µs a record)
    two = fit_wait([(700, 320.0), (100, 80.0)])
    assert (two.fixed_us, two.per_record_us) == (pytest.approx(40.0), pytest.approx(0.4))
    assert "least squares" in two.source
    # a negative intercept: through 0 (least squares of y = a x: sum xy / sum xx)
    zero = fit_wait([(700, 350.0), (100, 20.0)])
    a = (700 * 350.0 + 100 * 20.0) / (700**2 + 100**2)
    assert (zero.fixed_us, zero.per_record_us) == (0.0, pytest.approx(a))
    # a wait that does not grow with the first segment: the rule does not hold, one wait
    flat = fit_wait([(700, 100.0), (100, 300.0)])
    assert (flat.fixed_us, flat.per_record_us) == (200.0, 0.0) and "not growing" in flat.source
    assert fit_wait([]) is None and fit_wait([(0, 10.0), (None, 5.0)]) is None


def test_a_schedule_is_charged_its_graph_s_first_segment():
    gpu = get_gpu("h200", graph_launch_us=360.0)
    ctx = Setup(gpu, 132, graph_wait=LaunchWait(10.0, 0.5, "by hand"))
    own = {"traceEvents": _replay(0.0, 100.0, _cats(20, (6, 12)), 3, 30.0)}
    got, rec = graph_wait(ctx, own)
    assert got.gpu.graph_launch_us == pytest.approx(13.0)  # 10 µs + 0.5 µs x 6 records
    assert rec["us"] == pytest.approx(13.0) and rec["first_segment"] == 6
    assert got.gpu == dataclasses.replace(gpu, graph_launch_us=13.0)  # nothing else changed
    # without the schedule's own profiled replay, or without a calibrated cost: the case's
    same, rec = graph_wait(ctx, None)
    assert same is ctx and rec["us"] == 360.0 and "no profiled replay" in rec["source"]
    same, rec = graph_wait(dataclasses.replace(ctx, graph_wait=None), own)
    assert same.gpu.graph_launch_us == 360.0 and rec["source"] == "the case's graph launch"


def test_an_unprofiled_run_s_replay_launches_are_summed_per_run_and_median_over_runs():
    meta = {
        "graph_launch_host_us": [{"forward": [300.0]}, {"forward": [280.0]}, {"a": [100.0, 90.0]}],
        "graph_replay_spans_us": [[4600.0], [4700.0], [2000.0, 2100.0]],
    }
    assert unprofiled_launch(meta) == {"launch_host_us": 280.0, "graph_spans_us": 4600.0}
    assert unprofiled_launch({"graph_launch_host_us": [{}, {}]}) is None  # runs before 11-28
    assert unprofiled_launch(None) is None
    assert unprofiled_launch({"graph_replay_spans_us": [[10.0]]}) == {
        "launch_host_us": None, "graph_spans_us": 10.0}  # fmt: skip


def test_the_loop_fits_the_rule_to_serial_s_waits_at_two_first_segments(tmp_path):
    """A replay of the small recorded archive (tests/data/README.md) whose two calibration runs
    are given unprofiled steps 300 and 500 µs over their profiled replays' span (computed here
    from the raw records): the case's rule is the line through (first segment, wait)."""
    import gzip
    import json
    import tarfile
    from pathlib import Path

    pytest.importorskip("simpy")
    from overlap_lab.experiments import gpu_validation as GV

    src = Path(__file__).parent / "data" / "h200_decode128_replay.tar.gz"
    with tarfile.open(src) as tar:
        tar.extractall(tmp_path, filter="data")
    root = tmp_path / "h200_decode128_replay"
    report = json.loads((root / "results.json").read_text())
    case = report["cases"]["decode_128"]
    points = []
    for run, extra in zip(case["calibration_runs"], (300.0, 500.0), strict=True):
        ev = json.load(gzip.open(root / run["files"]["kernels"]))["traceEvents"]
        spans, segments = [], []
        for g in (e for e in ev if e["name"] == GRAPH_LAUNCH):
            recs = sorted((e for e in ev if e["cat"] in ("kernel", "gpu_memcpy", "gpu_memset")
                           and e["args"]["correlation"] == g["args"]["correlation"]),
                          key=lambda e: e["ts"])  # fmt: skip
            spans.append(max(e["ts"] + e["dur"] for e in recs) - recs[0]["ts"])
            sets = [i for i, e in enumerate(recs) if e["cat"] == "gpu_memset"]
            segments.append(sets[0] if sets else len(recs))
        assert len(set(segments)) == 1  # one graph, replayed alike
        run["replay_step_us"] = sorted(spans)[len(spans) // 2] + extra  # (an odd count)
        points.append((segments[0], extra))
    (root / "results.json").write_text(json.dumps(report))
    archive = tmp_path / "edited.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(root, arcname="h200_decode128_replay")
    got = GV.replay(archive, out=tmp_path / "out")["cases"]["decode_128"]["graph_launch_us"]
    (x0, y0), (x1, y1) = points
    slope = (y1 - y0) / (x1 - x0)
    assert x0 != x1 and slope > 0
    assert got["per_record_us"] == pytest.approx(slope)
    assert y0 - slope * x0 > 0 and got["fixed_us"] == pytest.approx(y0 - slope * x0)
    assert got["us"] == pytest.approx(y0)  # the case's own wait: serial's, as measured
