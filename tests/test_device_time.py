"""Per-op device time from a recorded torch.profiler trace (overlap_lab.device_time).

The fixture is a real trace of the GPU validation loop (tests/data/README.md): layer 1 of a
decode-128 serial run, two eager runs and one graph replay. The numbers asserted here were read
off the whole trace by the same mapping; the structural checks (every replay kernel finds its op,
the per-op sums add up to the run totals, launch gaps excluded) would fail on a wrong mapping.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from overlap_lab.device_time import (
    GRAPH_LAUNCH,
    graph_gap_us,
    kernel_records,
    load_chrome,
    map_kernels,
    op_device_us,
    parse_range,
    split_runs,
    with_device_time,
)
from overlap_lab.kernel_timeline import replay_trace
from overlap_lab.shared.outputs.trace import Span, Trace

FIXTURE = Path(__file__).parent / "data" / "h200_decode128_serial_layer1.trace.json.gz"
LAYER1_OPS = {
    "attn.core", "attn.prepare", "combine_a", "combine_b", "comm_postprocess_layer",
    "comm_prepare_attn", "comm_prepare_mlp", "dispatch_a", "dispatch_b", "experts", "gate",
    "output", "select_experts", "shared_experts",
}  # fmt: skip


@pytest.fixture(scope="module")
def chrome() -> dict:
    return load_chrome(FIXTURE)


def test_range_names_are_the_executors():
    assert parse_range("experts.L1.mb0") == ("experts", 1, 0)
    assert parse_range("embed.LNone.mb0") == ("embed", None, 0)
    assert parse_range("experts.down.2.L3.mb-1") == ("experts.down.2", 3, -1)
    assert parse_range("ProfilerStep#3") is None
    assert parse_range("graph:decode") is None


def test_fixture_splits_into_two_eager_runs_and_one_replay(chrome):
    runs, unattributed = split_runs(chrome)
    assert [r.replay for r in runs] == [False, False, True]
    assert unattributed == 0
    for r in runs[:2]:
        assert {op for op, _, _ in r.ops} == LAYER1_OPS
    assert len(runs[2].graph_kernels) == 197


def test_every_replay_kernel_maps_to_an_op(chrome):
    km = map_kernels(chrome)
    assert km.replay_matched == (197,) and km.replay_unmatched == (0,)
    assert {op for op, _, _ in km.ops} == LAYER1_OPS
    # per-op sums add up to the run totals: nothing counted twice or lost
    assert sum(t.replay_us for t in km.ops.values()) == pytest.approx(km.replay_device_us[0])
    assert sum(t.eager_us for t in km.ops.values()) == pytest.approx(
        sum(km.eager_step_device_us) / 2, rel=2e-3
    )  # medians of 2 runs
    # read off the whole trace (replay 2 of 6; median of the last two eager runs)
    t = km.ops[("experts", 1, 0)]
    assert t.replay_us == pytest.approx(1080.542, abs=1e-3)
    assert t.eager_us == pytest.approx(1082.302, abs=1e-3)
    assert km.ops[("attn.core", 1, 0)].eager_us == pytest.approx(824.604, abs=1e-3)
    assert km.ops[("attn.core", 1, 0)].kernels == 16


def test_compute_ops_take_the_same_device_time_eager_and_replayed(chrome):
    """The same kernels: within 5 % per compute op. The emulated receive (dispatch_b) spins until
    the modelled arrival, so its device time is a wait, not work: it differs."""
    km = map_kernels(chrome)
    for (name, _, _), t in km.ops.items():
        if name in ("dispatch_b",):
            continue
        assert t.replay_us == pytest.approx(t.eager_us, rel=0.05, abs=1.0), name
    b = km.ops[("dispatch_b", 1, 0)]
    assert b.replay_us > 3 * b.eager_us


def test_launch_gaps_are_not_device_time(chrome):
    """An op's range on the host is longer than its kernels' device time (Python and launch
    overhead between small kernels): the CUDA-event span would include those gaps."""
    runs, _ = split_runs(chrome)
    km = map_kernels(chrome)
    ranges = {}
    for e in chrome["traceEvents"]:
        if e.get("cat") == "user_annotation":
            ranges.setdefault(parse_range(e["name"]), []).append(e["dur"])
    prep = km.ops[("attn.prepare", 1, 0)]  # 65 small kernels
    assert prep.kernels == 65
    assert min(ranges[("attn.prepare", 1, 0)]) > 2 * prep.eager_us
    assert len(runs) == 3


def test_replay_kernels_interleaved_across_streams_still_find_their_ops(chrome):
    """Device order of a multi-stream replay may interleave the ops' kernels: the same-name
    queue keeps every kernel with its op (moving the replay's first kernel to the end changes
    nothing)."""
    ch = copy.deepcopy(chrome)
    ev = ch["traceEvents"]
    graph = next(e for e in ev if e.get("name") == "cudaGraphLaunch")["args"]["correlation"]
    ks = sorted(
        (e for e in ev if e.get("cat") == "kernel" and e["args"]["correlation"] == graph),
        key=lambda e: e["ts"],
    )
    names = [k["name"] for k in ks]
    distinct = next(i for i in range(1, len(ks)) if names[i] not in names[:i])
    ks[0]["ts"], ks[distinct]["ts"] = ks[distinct]["ts"], ks[0]["ts"]
    a, b = map_kernels(chrome), map_kernels(ch)
    assert b.replay_unmatched == (0,)
    assert op_device_us(a) == pytest.approx(op_device_us(b))


def test_a_trace_without_replays_uses_eager_device_time():
    ev = [
        {"ph": "X", "cat": "user_annotation", "name": "gate.L0.mb0", "ts": 0, "dur": 50},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 10, "dur": 5,
         "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 100, "dur": 7.0,
         "args": {"correlation": 1, "stream": 7}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 60, "dur": 5,
         "args": {"correlation": 2}},  # outside every range
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 120, "dur": 3.0,
         "args": {"correlation": 2, "stream": 7}},
        {"ph": "X", "cat": "user_annotation", "name": "gate.L0.mb0", "ts": 200, "dur": 50},
        {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel", "ts": 210, "dur": 5,
         "args": {"correlation": 3}},  # Triton launches through the driver API
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 300, "dur": 9.0,
         "args": {"correlation": 3, "stream": 7}},
    ]  # fmt: skip
    km = map_kernels({"traceEvents": ev})
    t = km.ops[("gate", 0, 0)]
    assert (t.eager_runs, t.replays, t.source) == (2, 0, "eager")
    assert t.us == pytest.approx(8.0)  # median of 7 and 9
    assert km.unattributed_kernels == 1


def test_with_device_time_scales_an_ops_spans_to_its_kernel_time():
    spans = [
        Span(0, "stream:s", "gate", "compute", 0.0, 30.0, 0, 0, 0, 0),
        Span(0, "stream:s", "gate", "compute", 40.0, 50.0, 0, 0, 0, 0),
        Span(0, "stream:s", "mlp", "compute", 50.0, 90.0, 0, 0, 0, 0),
        Span(0, "host:main", "launch", "host", 0.0, 5.0),
    ]
    tr = with_device_time(Trace(spans, {}), {("gate", 0, 0): 20.0})
    got = {(s.op, s.start): s.duration for s in tr.spans}
    assert got[("gate", 0.0)] == pytest.approx(15.0)
    assert got[("gate", 40.0)] == pytest.approx(5.0)
    assert got[("mlp", 50.0)] == pytest.approx(40.0)  # no device time: kept
    assert got[("launch", 0.0)] == pytest.approx(5.0)
    assert "mlp" in tr.meta["spans_source"]


def test_calibration_runs_take_the_device_time_of_their_profile(chrome, monkeypatch):
    """overlap_lab.calibrate.device_timed: the run's trace (CUDA-event spans with launch gaps)
    comes back with each op's spans summing to its kernels' device time, from the profiler's
    trace (here the recorded one, standing in for torch.profiler)."""
    import overlap_lab.device_time as DT
    from overlap_lab.calibrate import device_timed

    km = map_kernels(chrome)
    ops = sorted(km.ops)
    spans = [Span(0, "stream:main", op, "compute", 1000.0 * i, 1000.0 * i + 900.0, 0, mb, layer, 0)
             for i, (op, layer, mb) in enumerate(ops)]  # fmt: skip
    run_trace = Trace(spans, {"spans_source": "eager pass"})
    monkeypatch.setattr(DT, "profile_device_time", lambda fn: (fn(), chrome))
    rec = device_timed(lambda: run_trace)
    out, summary = rec.trace, rec.summary
    got = {(s.op, s.layer, s.mb): s.duration for s in out.spans}
    for op in ops:
        assert got[op] == pytest.approx(km.ops[op].replay_us)
    assert summary["ops_timed"] == len(ops) == summary["ops_from_replay"]
    assert out.meta["device_time"]["replay_unmatched"] == [0]
    assert out.meta["spans_source"].startswith("device time")
    # what a replay needs is kept: the run as the executor returned it, and its kernel records
    assert rec.executor_trace is run_trace
    assert map_kernels(rec.kernels) == km
    # with a graph gap, an op of k replayed kernels also takes its k - 1 inner gaps
    gapped = device_timed(lambda: run_trace, gap_us=0.5).trace
    got = {(s.op, s.layer, s.mb): s.duration for s in gapped.spans}
    t = km.ops[("attn.prepare", 1, 0)]
    assert got[("attn.prepare", 1, 0)] == pytest.approx(t.replay_us + 64 * 0.5)
    assert got[("gate", 1, 0)] == pytest.approx(km.ops[("gate", 1, 0)].replay_us)  # 1 kernel


def test_kernel_records_keep_what_the_mapping_reads(chrome):
    """The archive's copy of a profiler trace: only ranges, launches and device records, args
    cut; mapped again it gives the same times, and ``last=1`` keeps one eager run and one
    replay of the recording (the last of each)."""
    full = map_kernels(chrome)
    kept = kernel_records(chrome)
    assert map_kernels(kept) == full
    assert all(set(e.get("args", {})) <= {"correlation", "stream"} for e in kept["traceEvents"])
    one = kernel_records(chrome, last=1)
    runs, _ = split_runs(one)
    assert [r.replay for r in runs] == [False, True]
    km = map_kernels(one)
    assert km.replay_device_us == full.replay_device_us[-1:]
    assert km.eager_step_device_us == full.eager_step_device_us[-1:]


def test_the_graph_gap_is_the_unprofiled_step_less_kernel_time_per_kernel(chrome):
    """graph_gap_us: (replay step - the replay's kernel time) / its kernels; None without a
    step or replays; never negative."""
    km = map_kernels(chrome)
    kernel_us = km.replay_device_us[0]
    assert graph_gap_us(km, kernel_us + 197 * 0.25) == pytest.approx(0.25)
    assert graph_gap_us(km, kernel_us - 10.0) == 0.0
    assert graph_gap_us(km, None) is None
    eager_only = kernel_records(chrome)
    eager_only["traceEvents"] = [
        e for e in eager_only["traceEvents"] if e.get("name") != "cudaGraphLaunch"
    ]
    assert graph_gap_us(map_kernels(eager_only), 1000.0) is None


def test_the_replay_trace_is_the_replayed_ops_on_their_lanes(chrome):
    """replay_trace: each op of the (last) replay one span from its first kernel to its last,
    on the lane and of the kind its op has in the executor's trace, at device time from the
    replay's first kernel: its kernels' time and the graph's gaps between them."""
    km = map_kernels(chrome)
    ops = sorted(km.ops)
    kind = {op: "comm" if op[0].startswith(("dispatch", "combine")) else "compute" for op in ops}
    spans = [Span(0, "stream:main", op, kind[(op, layer, mb)], 10.0 * i, 10.0 * i + 5.0, 0, mb,
                  layer, 0) for i, (op, layer, mb) in enumerate(ops)]  # fmt: skip
    rt = replay_trace(Trace(spans, {}), chrome)
    assert len(rt.spans) == len(ops) and min(s.start for s in rt.spans) == 0.0
    assert rt.step_time_us == pytest.approx(km.replay_span_us[-1])
    for s in rt.spans:
        assert s.kind == kind[(s.op, s.layer, s.mb)] and s.lane == "stream:main"
        op = km.ops[(s.op, s.layer, s.mb)]
        assert op.replay_us - 1e-3 <= s.duration <= op.replay_us + (op.kernels - 1) * 2.0 + 1e-3
    assert sum(s.duration for s in rt.spans) >= km.replay_device_us[-1]
    eager_only = {"traceEvents": [e for e in chrome["traceEvents"]
                                  if e.get("name") != "cudaGraphLaunch"]}  # fmt: skip
    assert replay_trace(Trace(spans, {}), eager_only) is None


def _x(cat: str, name: str, ts: float, dur: float, corr: int | None = None, **args) -> dict:
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    if corr is not None:
        e["args"] = {"correlation": corr, **args}
    return e


def test_replay_timeline_of_a_run_of_several_graphs():
    """Two steps, each one graph of a compute op ``a`` and a comm op ``c``: the eager pass is
    cut into runs where a range recurs ([a, c], [a, ...]), so its last run alone lacks ``c``;
    the template is the whole eager pass, and the timeline holds both replays."""
    ev = []
    t, corr = 0.0, 1
    for _ in range(2):  # the eager pass: a, c per step
        for op in ("a", "c"):
            ev.append(_x("user_annotation", f"{op}.L0.mbNone", t, 5.0))
            ev.append(_x("cuda_runtime", "cudaLaunchKernel", t + 1, 1.0, corr))
            ev.append(_x("kernel", f"k_{op}", t + 100, 10.0, corr, stream=7))
            t, corr = t + 10, corr + 1
    for i in range(2):  # the timed run: one graph per step
        ev.append(_x("cuda_runtime", GRAPH_LAUNCH, 1000.0 + 100 * i, 2.0, corr))
        ev.append(_x("kernel", "k_a", 1010.0 + 100 * i, 10.0, corr, stream=7))
        ev.append(_x("kernel", "k_c", 1020.0 + 100 * i, 30.0, corr, stream=7))
        corr += 1
    spans = tuple(
        Span(0, "stream:main", op, kind, 0.0, 1.0, 0, None, 0, step)
        for step in (0, 1)
        for op, kind in (("a", "compute"), ("c", "comm"))
    )
    one = replay_trace(Trace(spans, {}), {"traceEvents": ev})
    both = replay_trace(Trace(spans, {}), {"traceEvents": ev}, last=2)
    assert one.meta["replays"] == 1 and both.meta["replays"] == 2
    assert sorted((s.op, s.step, s.start) for s in both.spans) == [
        ("a", 0, 0.0), ("a", 1, 100.0), ("c", 0, 10.0), ("c", 1, 110.0)
    ]  # fmt: skip
    assert both.exposed_comm_us(0) == pytest.approx(60.0)
    assert one.exposed_comm_us(0) == pytest.approx(30.0)
