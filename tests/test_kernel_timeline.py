"""The timeline a recorded run's exposed communication is measured on (kernel records), on
hand-built profiler traces: the prediction's definition (comm kernels with no compute kernel
running), not the executor's CUDA-event spans, which hold the stream's waits for the host."""

from __future__ import annotations

import pytest

from overlap_lab.experiments.gpu_validation.predict import comparison
from overlap_lab.kernel_timeline import eager_trace, replay_trace, run_timeline
from overlap_lab.shared.outputs.trace import Span, Trace


def _x(cat: str, name: str, ts: float, dur: float, corr: int | None = None, **args) -> dict:
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    if corr is not None:
        e["args"] = {"correlation": corr, **args}
    return e


def _eager_run(passes: int = 2) -> list[dict]:
    """``passes`` eager passes of: compute ``a`` (one 100 us kernel, stream 7) and comm ``c``
    (stream 8) launched beside it: a 10 us data-path kernel at +0, then, after the host read
    the split sizes, the 50 us link kernel at +150 (the stream idles 140 us waiting for the
    host). Passes 1000 us apart."""
    ev, corr = [], 1
    for p in range(passes):
        t = 1000.0 * p
        ev.append(_x("user_annotation", "a.L0.mbNone", t, 5.0))
        ev.append(_x("cuda_runtime", "cudaLaunchKernel", t + 1, 1.0, corr))
        ev.append(_x("kernel", "gemm", t + 10, 100.0, corr, stream=7))
        ev.append(_x("user_annotation", "c.L0.mbNone", t + 6, 150.0))
        ev.append(_x("cuda_runtime", "cudaLaunchKernel", t + 7, 1.0, corr + 1))
        ev.append(_x("kernel", "gather", t + 10, 10.0, corr + 1, stream=8))
        ev.append(_x("cuda_runtime", "cudaLaunchKernel", t + 150, 1.0, corr + 2))
        ev.append(_x("kernel", "send_kernel", t + 160, 50.0, corr + 2, stream=8))
        corr += 3
    return ev


def _executor_trace(comm_end: float = 210.0) -> Trace:
    """The executor's trace of that pass: one CUDA-event span per op (``c``'s holds the wait)."""
    return Trace(
        (
            Span(0, "stream:main", "a", "compute", 10.0, 110.0, 0, None, 0, 0),
            Span(0, "stream:comm", "c", "comm", 10.0, comm_end, 0, None, 0, 0),
        ),
        {},
    )


def test_the_eager_timeline_is_the_last_pass_kernels_without_the_host_waits():
    """c's span (10-210 us) overlaps a's compute (10-110) by 100 us: 100 us exposed from the
    spans, of which 90 us is the stream waiting for the host. From the kernels: the link
    kernel's 50 us alone (the data-path kernel runs under the GEMM)."""
    spans = _executor_trace()
    assert spans.exposed_comm_us(0) == pytest.approx(100.0)
    et = eager_trace(spans, {"traceEvents": _eager_run()})
    assert et.meta == {"spans_source": "eager run: kernel device times", "eager_runs": 1}
    assert sorted((s.op, s.lane, s.kind, s.start, s.end) for s in et.spans) == [
        ("a", "stream:main", "compute", 0.0, 100.0),
        ("c", "stream:comm", "comm", 0.0, 10.0),
        ("c", "stream:comm", "comm", 150.0, 200.0),
    ]  # the last pass, its first kernel at 0
    assert et.exposed_comm_us(0) == pytest.approx(50.0)
    assert run_timeline(spans, {"traceEvents": _eager_run()}, graphs=0) == et
    assert replay_trace(spans, {"traceEvents": _eager_run()}) is None


def test_an_eager_program_of_several_steps_takes_one_run_per_step():
    """A two-step Program's pass is two eager runs (c recurs): the timeline holds both, each
    on its step's spans; a run that replays graphs has no eager timeline."""
    two = Trace(tuple(Span(s.rank, s.lane, s.op, s.kind, s.start, s.end, 0, None, 0, step)
                      for step in (0, 1) for s in _executor_trace().spans), {})  # fmt: skip
    et = eager_trace(two, {"traceEvents": _eager_run(passes=3)})
    assert et.meta["eager_runs"] == 2
    assert sorted((s.step, s.op, s.start) for s in et.spans) == [
        (0, "a", 0.0), (0, "c", 0.0), (0, "c", 150.0),
        (1, "a", 1000.0), (1, "c", 1000.0), (1, "c", 1150.0),
    ]  # fmt: skip
    assert et.exposed_comm_us(0) == pytest.approx(100.0)
    ev = _eager_run() + [_x("cuda_runtime", "cudaGraphLaunch", 5000.0, 1.0, 99),
                         _x("kernel", "gemm", 5010.0, 100.0, 99, stream=7)]  # fmt: skip
    assert eager_trace(two, {"traceEvents": ev}) is None


def test_the_comparison_reads_exposed_comm_from_the_kernel_timeline():
    """The loop's comparison: with an eager timeline, the measured exposed communication is its
    kernels' (50 us), and the record says so; without one, the CUDA-event spans' (100 us)."""
    spans = _executor_trace()
    pred = Trace(
        (
            Span(0, "stream:main", "a", "compute", 0.0, 100.0, 0, None, 0, 0),
            Span(0, "stream:comm", "c", "comm", 0.0, 140.0, 0, None, 0, 0),
        ),
        {},
    )
    et = eager_trace(spans, {"traceEvents": _eager_run()})
    with_k = comparison(spans, pred, 210.0, et)
    without = comparison(spans, pred, 210.0)
    assert with_k["exposed_comm_us"]["measured"] == pytest.approx(50.0)
    assert with_k["exposed_comm_us"]["predicted"] == pytest.approx(40.0)
    assert with_k["exposed_comm_source"] == "an eager run's kernels (torch.profiler)"
    assert without["exposed_comm_us"]["measured"] == pytest.approx(100.0)
    assert without["exposed_comm_source"] == "the measured trace's spans"


def test_a_replayed_op_is_one_span_over_its_kernels_and_the_graph_gaps():
    """In a replay an op is timed as the simulator times it from a graph: its first kernel's
    start to its last one's end (comm ``c``: kernels at 10-20 and 20.5-30.5, the 0.5 us between
    them the graph's), so the gap is communication in flight too: exposed 20.5 us, not 20."""
    ev = [
        _x("user_annotation", "c.L0.mbNone", 0.0, 5.0),
        _x("cuda_runtime", "cudaLaunchKernel", 1.0, 1.0, 1),
        _x("kernel", "gather", 10.0, 10.0, 1, stream=8),
        _x("cuda_runtime", "cudaLaunchKernel", 2.0, 1.0, 2),
        _x("kernel", "send_kernel", 30.0, 10.0, 2, stream=8),
        _x("cuda_runtime", "cudaGraphLaunch", 100.0, 1.0, 3),
        _x("kernel", "gather", 110.0, 10.0, 3, stream=9),
        _x("kernel", "send_kernel", 120.5, 10.0, 3, stream=9),
    ]
    spans = Trace((Span(0, "stream:comm", "c", "comm", 0.0, 40.0, 0, None, 0, 0),), {})
    rt = replay_trace(spans, {"traceEvents": ev})
    assert [(s.op, s.start, s.end) for s in rt.spans] == [("c", 0.0, 20.5)]
    assert rt.exposed_comm_us(0) == pytest.approx(20.5)
    assert run_timeline(spans, {"traceEvents": ev}) == rt
    assert eager_trace(spans, {"traceEvents": ev}) is None


def test_a_kernel_of_an_op_elsewhere_in_the_replay_does_not_stretch_its_span():
    """Only consecutive kernels of one op on a stream are one span: ``c``'s kernel after ``a``'s
    (a kernel matched to ``c`` by name) stays its own 1 us span, so ``a``'s 9.5 us are not
    counted as communication."""
    ev = [
        _x("user_annotation", "c.L0.mbNone", 0.0, 3.0),
        _x("user_annotation", "a.L0.mbNone", 4.0, 2.0),
    ]
    ev += [_x("cuda_runtime", "cudaLaunchKernel", 1.0 + i, 0.5, i + 1) for i in range(2)]
    ev += [_x("cuda_runtime", "cudaLaunchKernel", 4.5, 0.5, 3)]
    ev += [
        _x("kernel", n, t, 1.0, i + 1, stream=8)
        for i, (n, t) in enumerate((("gather", 10.0), ("send_kernel", 11.0), ("gemm", 12.0)))
    ]
    ev += [_x("cuda_runtime", "cudaGraphLaunch", 100.0, 1.0, 4)]
    ev += [
        _x("kernel", n, t, d, 4, stream=9)
        for n, t, d in (("gather", 110.0, 10.0), ("gemm", 120.5, 9.5), ("send_kernel", 130.5, 1.0))
    ]
    spans = Trace(
        (
            Span(0, "stream:comm", "c", "comm", 0.0, 40.0, 0, None, 0, 0),
            Span(0, "stream:comm", "a", "compute", 0.0, 40.0, 0, None, 0, 0),
        ),
        {},
    )
    rt = replay_trace(spans, {"traceEvents": ev})
    assert sorted((s.op, s.start, s.end) for s in rt.spans) == [
        ("a", 10.5, 20.0),
        ("c", 0.0, 10.0),
        ("c", 20.5, 21.5),
    ]
    assert rt.exposed_comm_us(0) == pytest.approx(11.0)
