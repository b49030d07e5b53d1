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
    first_segment,
    per_node_us,
    replay_launches,
    unprofiled_launch,
    wait_us,
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


def test_the_wait_per_record_and_a_graph_s_wait():
    assert per_node_us(360.0, 720) == pytest.approx(0.5)
    assert per_node_us(None, 720) is None
    assert per_node_us(360.0, None) is None
    assert per_node_us(360.0, 0) is None
    assert wait_us(0.5, 191) == pytest.approx(95.5)


def test_a_schedule_is_charged_its_graph_s_first_segment():
    gpu = get_gpu("h200", graph_launch_us=360.0)
    ctx = Setup(gpu, 132, graph_launch_per_node_us=0.5)
    own = {"traceEvents": _replay(0.0, 100.0, _cats(20, (6, 12)), 3, 30.0)}
    got, rec = graph_wait(ctx, own)
    assert got.gpu.graph_launch_us == pytest.approx(3.0)  # 0.5 µs x 6 records
    assert rec["us"] == pytest.approx(3.0) and rec["first_segment"] == 6
    assert got.gpu == dataclasses.replace(gpu, graph_launch_us=3.0)  # nothing else changed
    # without the schedule's own profiled replay, or without a calibrated cost: the case's
    same, rec = graph_wait(ctx, None)
    assert same is ctx and rec["us"] == 360.0 and "no profiled replay" in rec["source"]
    same, rec = graph_wait(dataclasses.replace(ctx, graph_launch_per_node_us=None), own)
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
