"""The executor's launch costs as the loop measures and predicts them (overlap_lab.device_time
``host_launch``, ``graph_launch_wait_us``; experiments/gpu_validation/predict.py).

Hand-built profiler records (the shape ``device_time.kernel_records`` keeps) with known host
times, so every number asserted is computed here from the records; then the rule the
prediction follows: an eager launch holds the host for the op's measured launch time, a graph's
launch for the measured wait before its first kernel, and the simulator charges them there.
"""

from __future__ import annotations

import dataclasses

import pytest

from overlap_lab.device_time import (
    GRAPH_LAUNCH,
    HostLaunch,
    KernelMap,
    OpHost,
    OpTime,
    graph_launch_wait_us,
    host_launch,
    idle_scale,
    kernels_per_op,
    op_host,
)
from overlap_lab.experiments.gpu_validation.predict import as_executed, own_host_steps
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.ir.program import (
    Graph,
    Host,
    HostThread,
    Launch,
    Op,
    Program,
    ProgramMeta,
    RankProgram,
    Record,
    Sync,
)
from overlap_lab.shared.outputs.trace import Span, Trace


def _records(ops: dict[str, tuple[float, list[float]]], graph_at: float | None = None) -> dict:
    """An op range per entry (name -> (range start, launch call starts)), each launch with a
    1 µs device kernel; ``graph_at``: a cudaGraphLaunch there (with a kernel of its own)."""
    ev, c = [], 0
    for name, (t0, calls) in ops.items():
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"{name}.L1.mb0", "ts": t0,
                   "dur": calls[-1] + 5.0 - t0})  # fmt: skip
        for t in calls:
            c += 1
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t,
                       "dur": 2.0, "args": {"correlation": c}})  # fmt: skip
            ev.append({"ph": "X", "cat": "kernel", "name": f"k{c}", "ts": t + 3.0, "dur": 1.0,
                       "args": {"correlation": c, "stream": 7}})  # fmt: skip
    if graph_at is not None:
        c += 1
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": GRAPH_LAUNCH, "ts": graph_at,
                   "dur": 3.0, "args": {"correlation": c}})  # fmt: skip
        ev.append({"ph": "X", "cat": "kernel", "name": "g", "ts": graph_at + 4.0, "dur": 1.0,
                   "args": {"correlation": c, "stream": 7}})  # fmt: skip
    # a launch call without a device record (a cudaStreamSynchronize, say) is not a launch
    ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 101.0,
               "dur": 50.0, "args": {"correlation": 999}})  # fmt: skip
    return {"traceEvents": ev}


def test_host_launch_is_the_median_time_before_and_between_an_ops_launches():
    rec = _records(
        {
            "a": (0.0, [10.0, 40.0, 70.0, 100.0]),  # 10 before, 30 between
            "b": (200.0, [220.0, 250.0]),  # 20 before, 30 between
            "c": (300.0, [340.0, 360.0, 460.0]),  # 40 before, 20 and 100 (a sync) between
        },
        graph_at=600.0,  # the graph's launch is no kernel launch of an op
    )
    h = host_launch(rec)
    assert (h.per_op, h.per_kernel, h.ranges, h.intervals) == (20.0, 30.0, 3, 6)
    # an op never measured: per_op + k x per_kernel, then its launch; scaled as a whole
    h = dataclasses.replace(h, kernels={"x": 4}, measured={}, scale=0.5)
    assert h.op("x").steps == (("host", (20.0 + 4 * 30.0) / 2), ("launch", 0.0))
    assert h.op("never-seen").steps == (("host", (20.0 + 30.0) / 2), ("launch", 0.0))
    assert host_launch({"traceEvents": []}) is None


def test_an_ops_host_steps_leave_out_its_waits_for_read_backs():
    """One op range opened at 0: kernels launched at 10 and 30 (1 µs each), a device-to-host
    copy called at 50 whose copy ends on the device at 250 (the host waited 200 µs), then the
    op's big kernel (launched at 260, 100 µs: half of its device time from there) and one more
    at 300, the last call ending at 302."""
    ev = [{"ph": "X", "cat": "user_annotation", "name": "experts.L1.mb0", "ts": 0.0, "dur": 310.0}]
    for c, (t, kind, dev_ts, dur) in enumerate(
        [
            (10.0, "kernel", 12.0, 1.0),
            (30.0, "kernel", 32.0, 1.0),
            (50.0, "gpu_memcpy", 249.0, 1.0),
            (260.0, "kernel", 262.0, 100.0),
            (300.0, "kernel", 362.0, 1.0),
        ]  # fmt: skip
    ):
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "call", "ts": t, "dur": 2.0,
                   "args": {"correlation": c}})  # fmt: skip
        name = "Memcpy DtoH (Device -> Pageable)" if kind == "gpu_memcpy" else f"k{c}"
        ev.append({"ph": "X", "cat": kind, "name": name, "ts": dev_ts, "dur": dur,
                   "args": {"correlation": c, "stream": 7}})  # fmt: skip
    h = op_host({"traceEvents": ev})["experts"]
    # 50 µs of work, the read-back (its wait 50 -> 250 not counted), 10 µs to the big kernel's
    # launch, then 42 µs to the end of the last call
    assert h == OpHost((("host", 50.0), ("sync", 0.0), ("host", 10.0), ("launch", 0.0),
                        ("host", 42.0)))  # fmt: skip
    assert (h.us, h.syncs) == (102.0, 1)
    # the same op name with a copy the host did not wait for (the range ends at 70, the copy
    # at 250): its copies do not block, in this range nor the other
    late = [dict(e, ts=e["ts"] + 1000.0) for e in ev]
    late[0]["dur"] = 70.0
    both = op_host({"traceEvents": ev + late})["experts"]
    assert both.syncs == 0
    assert own_host_steps(None, _program(), {"traceEvents": ev}) == (None, [])


def test_ops_the_calibration_never_ran_take_their_host_steps_from_the_schedules_own_run():
    ev = _records({"b": (0.0, [10.0, 40.0])})["traceEvents"]
    h = HostLaunch(per_op=20.0, per_kernel=30.0, measured={"a": OpHost((("host", 5.0),))})
    got, names = own_host_steps(h, _program(), {"traceEvents": ev})
    assert names == ["b"] and got.measured["a"] == h.measured["a"]  # the calibration's wins
    assert got.measured["b"] == op_host({"traceEvents": ev})["b"]


def _km(spans: tuple[float, ...], ops: dict | None = None) -> KernelMap:
    return KernelMap(ops or {}, (), (100.0,) * len(spans), spans, (10,) * len(spans),
                     (0,) * len(spans), 0)  # fmt: skip


def test_the_graph_launch_wait_is_the_unprofiled_step_less_the_profiled_span():
    km = _km((4300.0, 4310.0, 4290.0))
    assert graph_launch_wait_us(km, 4662.3) == pytest.approx(4662.3 - 4300.0)
    assert graph_launch_wait_us(km, 4000.0) == 0.0  # never negative
    assert graph_launch_wait_us(km, None) is None
    assert graph_launch_wait_us(_km(()), 4662.3) is None


def test_kernels_per_op_is_the_median_over_its_layers():
    t = OpTime(1.0, None, 1, 0, kernels=3)
    km = _km((), {("x", 1, 0): t, ("x", 2, 0): dataclasses.replace(t, kernels=5),
                  ("x", 3, 0): dataclasses.replace(t, kernels=4), ("y", 1, 0): t})  # fmt: skip
    assert kernels_per_op(km) == {"x": 4, "y": 3}


def _program() -> Program:
    ops = [Op("a", layer=1, mb=0, hbm_bytes=1e6), Op("b", layer=1, mb=0, hbm_bytes=1e6),
           Op("c", layer=1, mb=0, hbm_bytes=1e6)]  # fmt: skip
    body = (Launch(ops[1], "main"), Launch(ops[2], "main"))
    th = HostThread("main", (Launch(ops[0], "main"), Graph("g", body)))
    return Program((RankProgram(0, ("main",), (th,)),), meta=ProgramMeta(schedule="t"))


def _measured() -> Trace:
    return Trace(tuple(Span(0, "stream:main", n, "compute", i, i + 1.0, 0, 0, 1)
                       for i, n in enumerate("abc")), {})  # fmt: skip


def _host(**steps) -> HostLaunch:
    measured = {n: OpHost(tuple(v)) for n, v in steps.items()}
    return HostLaunch(per_op=20.0, per_kernel=30.0, kernels={"b": 9, "c": 9}, measured=measured)


def test_an_eager_launch_takes_its_ops_host_steps_a_graphs_takes_none():
    h = _host(a=[("host", 50.0), ("sync", 0.0), ("host", 70.0), ("launch", 0.0), ("host", 9.0)])
    prog = as_executed(_measured(), host_launch=h)(_program())
    instrs = prog.ranks[0].threads[0].instrs
    ev = "readback.0.a.L1.mb0"
    assert instrs[:4] == (Host("launch", 50.0, 0, 1, None), Record(ev, "main"), Sync(ev),
                          Host("launch", 70.0 - 30.0, 0, 1, None))  # fmt: skip
    assert isinstance(instrs[4], Launch) and instrs[4].op.name == "a"
    assert instrs[5] == Host("launch", 9.0, 0, 1, None)  # after its launch: it overlaps a
    assert isinstance(instrs[6], Graph)
    assert not any(isinstance(i, Host) for i in instrs[6].body)  # replayed: nothing per kernel
    assert as_executed(_measured())(_program()).ranks[0].threads[0].instrs[0].op.name == "a"


def test_the_simulator_charges_the_host_steps_and_the_graphs_wait_where_they_are():
    from overlap_lab.sim import simulate

    h = _host(a=[("host", 50.0), ("launch", 0.0), ("host", 500.0)])
    gpu = dataclasses.replace(get_gpu("h200"), launch_us=h.per_kernel, graph_launch_us=354.0,
                              graph_kernel_gap_us=0.0)  # fmt: skip
    tr = simulate(as_executed(_measured(), host_launch=h)(_program()), gpu)
    start = {s.op: s.start for s in tr.spans if s.lane.startswith("stream:")}
    end = {s.op: s.end for s in tr.spans if s.lane.startswith("stream:")}
    assert start["a"] == pytest.approx(50.0)  # its launch, at the host's 50 µs
    # the host's 500 µs after a's launch, then the graph's launch: its first kernel waits both
    assert start["b"] == pytest.approx(max(50.0 + 500.0 + 354.0, end["a"]))
    assert start["c"] == pytest.approx(end["b"])


def test_the_profilers_share_is_the_devices_waits_inside_ops_unprofiled_over_profiled():
    t = OpTime(100.0, None, 1, 0, kernels=3)
    km = _km((), {("a", 1, 0): t, ("b", 1, 0): t, ("c", 1, 0): t})

    def trace(a: float, b: float, c: float) -> Trace:
        return Trace(tuple(Span(0, "stream:main", n, "compute", 0.0, us, 0, 0, 1)
                           for n, us in (("a", a), ("b", b), ("c", c))), {})  # fmt: skip

    # a waited 60 profiled, 30 unprofiled; b 20 and 15; c never waited (left out)
    assert idle_scale(trace(160.0, 120.0, 100.0), trace(130.0, 115.0, 90.0), km) == (
        pytest.approx((30.0 + 15.0) / (60.0 + 20.0))
    )
    assert idle_scale(trace(100.0, 90.0, 100.0), trace(100.0, 90.0, 100.0), km) is None


def test_the_executor_records_each_ops_median_launch_time():
    """real.timing.run_meta: the host time of each eager launch of an op (``RunLog.launched``,
    timed around the launch in ``real.runner`` on a GPU) as its median, by op name."""
    pytest.importorskip("torch")
    from overlap_lab.real.fp8 import Precision
    from overlap_lab.real.runlog import RunLog
    from overlap_lab.real.timing import run_meta

    log = RunLog()
    for op, us in (("experts", 40.0), ("experts", 90.0), ("experts", 50.0), ("gate", 7.0)):
        log.launched(op, us)
    meta = run_meta([], object(), log, Precision("bf16", "bf16", ""))
    assert meta["host_launch_us"] == {"experts": 50.0, "gate": 7.0}
    assert "host_launch_us" not in run_meta([], object(), RunLog(), Precision("bf16", "bf16", ""))
