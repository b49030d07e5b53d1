"""A recorded run's kernels as a Trace: the timeline its exposed communication is measured on.

Why: the simulator's trace holds device time only (an op's stream span is its kernels; a host
launch or a wait for the host is on the host lane or is a gap between the op's pieces), so
``Trace.exposed_comm_us`` of a prediction is communication kernels running with no compute
kernel on the rank. The executor's own trace times each op by two CUDA events on its stream;
such a span also holds the stream's idle time while the host launches the op's next kernel
(the emulated backend's dispatch is ~35 small kernels behind a host read of the split sizes:
~1,000 us of kernels in a ~2,000 us span at prefill 4096). Read from those spans, exposed
communication counts host waits as communication. Read from the run's device records (CUPTI,
``torch.profiler``), it is the prediction's definition: the one definition both sides use.

:func:`replay_trace` is the timeline of a graph-replayed run (its last replays: an op from its
first kernel to its last, the graph's gaps between them being the device's), and
:func:`eager_trace` that of an eager run (its last pass: each kernel, the waits for the host
between them left out, as the simulator leaves them on the host lane), both from the records
(``overlap_lab.device_time.split_runs``). No torch import: tested on the CPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from overlap_lab.device_time import DeviceKernel, OpId, _eager_pass, _match, _template, split_runs


def _timeline(trace, found: list[tuple[OpId, DeviceKernel, int | None]], meta: dict):
    """Each ``(op, kernel, step)`` a span of its op, on its op's lane and of its op's kind
    (read off ``trace``'s stream spans, the step's where it has several), at its device start
    and duration, the first kernel at 0. None when nothing is found."""
    from overlap_lab.shared.outputs.trace import Span, Trace

    if not found:
        return None
    like: dict[tuple, Any] = {}
    for s in trace.spans:
        if s.lane.startswith("stream:"):
            like.setdefault((s.op, s.layer, s.mb, s.step), s)
            like.setdefault((s.op, s.layer, s.mb, None), s)
    t0 = min(k.ts for _, k, _ in found)
    spans = [
        Span(
            s.rank, s.lane, s.op, s.kind, k.ts - t0, k.ts - t0 + k.dur, s.sms, s.mb, s.layer, s.step
        )  # fmt: skip
        for op, k, step in found
        if (s := like.get((*op, step)) or like.get((*op, None))) is not None
    ]
    return Trace(tuple(spans), meta)


def _step_of(trace, i: int, chosen: int) -> int | None:
    """The step of the ``i``-th of ``chosen`` runs: the k-th run takes the k-th step's spans
    where ``trace`` has several steps."""
    steps = sorted({s.step for s in trace.spans if s.step is not None})
    return steps[i - chosen + len(steps)] if len(steps) >= chosen > 1 else None


def replay_trace(trace, kernels: Mapping[str, Any] | list, last: int = 1):
    """The last ``last`` graph replays of ``kernels`` (a torch.profiler trace of the executor's
    run whose trace is ``trace``) as one Trace (:func:`_timeline`), one span per run of an
    op's consecutive kernels on a stream (:func:`_extents`): what a replayed run ran side by side, which the eager
    pass's spans do not show (they hold launch gaps). ``last``: the
    graphs one run of the Program replays (a Program of several steps replays one per step:
    sglang-overlap's four). None without a replay, or when none of its kernels maps to an op
    (pp's ranks in one process: the last eager run is not the replay's template)."""
    runs, _ = split_runs(kernels)
    replays = [r for r in runs if r.replay and r.graph_kernels]
    if not replays:
        return None
    chosen = replays[-max(1, last) :]
    template = _eager_pass(runs, runs.index(chosen[0]))
    if not template.ops:
        return None
    found = []
    for i, r in enumerate(chosen):
        _, pairs, _ = _match(_template(template, r), r.graph_kernels)
        pairs += [(op, k) for op, ks in r.ops.items() for k in ks]
        found += _extents(pairs, _step_of(trace, i, len(chosen)))
    meta = {"spans_source": "graph replay: each op's consecutive kernels, first start to last end",
            "replays": len(chosen)}  # fmt: skip
    return _timeline(trace, found, meta)


def _extents(pairs: list[tuple[OpId, DeviceKernel]], step: int | None):
    """The kernels of one replay, each run of consecutive kernels of one op on one stream as
    one record from the run's first start to its last end: the op as the simulator times it in
    a graph (its kernels and the ``(kernels - 1) x graph gap`` between them,
    ``device_time.op_device_us``). Inside a replay those gaps are the device's, not the host's.
    Runs, not an op's first-to-last kernel: a kernel matched by name to the wrong op
    (``device_time._match``) stays one kernel long instead of stretching its op's span."""
    out: list[tuple[OpId, DeviceKernel, int | None]] = []
    last: dict[int, int] = {}  # stream -> index in out of its latest record
    for op, k in sorted(pairs, key=lambda p: (p[1].stream, p[1].ts)):
        i = last.get(k.stream)
        if i is not None and out[i][0] == op:
            prev = out[i][1]
            end = max(prev.ts + prev.dur, k.ts + k.dur)
            out[i] = (op, dataclasses.replace(prev, dur=end - prev.ts), step)
            continue
        last[k.stream] = len(out)
        out.append((op, k, step))
    return out


def eager_trace(trace, kernels: Mapping[str, Any] | list):
    """The last eager pass of ``kernels`` (a torch.profiler trace of the executor's eager run
    whose trace is ``trace``) as one Trace (:func:`_timeline`): every kernel each op launched,
    without the stream's waits for the host between them. A pass of a Program of several steps
    is one eager run per step (``split_runs`` cuts where an op range recurs): the last runs,
    one per step of ``trace``. None where the run replays graphs (:func:`replay_trace` is its
    timeline) or has no eager run."""
    runs, _ = split_runs(kernels)
    if not runs or any(r.replay for r in runs):
        return None
    n = max(1, len({s.step for s in trace.spans if s.step is not None}))
    chosen = runs[-n:]
    found = [
        (op, k, _step_of(trace, i, len(chosen)))
        for i, r in enumerate(chosen)
        for op, ks in r.ops.items()
        for k in ks
    ]
    return _timeline(trace, found, {"spans_source": "eager run: kernel device times",
                                    "eager_runs": len(chosen)})  # fmt: skip


def run_timeline(trace, kernels: Mapping[str, Any] | list, graphs: int = 1):
    """The recorded run's timeline: its last ``graphs`` replays where it replayed graphs, else
    its last eager pass; None where neither maps to an op."""
    return replay_trace(trace, kernels, graphs) or eager_trace(trace, kernels)
