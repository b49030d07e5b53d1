"""Per-op device time from a torch.profiler Chrome trace of the real executor.

Why: the executor times each op of its eager pass by two CUDA events around the op. Such a span
holds every launch gap between the op's kernels (a decode op is many small kernels), so a
profile built from it charges launch overhead that a replayed CUDA graph does not pay (on an
H200, decode 128: eager step 18.0 ms, graph replay of the same kernels 11.2 ms). The simulator's
profile rows must hold kernel time only; the simulator adds launch cost itself where a run is
eager. This module gives each op the sum of its kernels' device times (CUPTI records).

The mapping (:func:`map_kernels`, a pure function over the Chrome trace dict):

1. device records (``kernel``, ``gpu_memcpy``, ``gpu_memset``) are tied to their host launch by
   ``args.correlation``; a launch inside one of the executor's profiler ranges
   (``real.executor``: ``f"{op.name}.L{op.layer}.mb{op.mb}"``, :data:`RANGE_RE`) belongs to that op;
2. the host timeline is cut into runs: a run starts where an op range recurs within the current
   run, at each ``cudaGraphLaunch``, and where the first op range seen follows a replay; runs
   with a graph launch are replays (with the ops they ran outside the graph), the others eager
   runs (the warm-up's first run is eager too: the median over eager runs drops its JIT
   outliers);
3. a graph replay runs the kernels its capture recorded, in the same order: its kernels (those
   with the ``cudaGraphLaunch``'s correlation) are matched to the last eager run's kernels of
   the ops that were not launched by range in the replay run (the graph body), in order, each
   replay kernel to the first unmatched eager kernel of the same name (on one stream this is
   position by position; kernels interleaved across streams still find their op);
4. per op: the median over eager runs of its kernels' summed device time, and the median over
   replays of its matched kernels' time. :func:`op_device_us` prefers the replay (what the
   measured step runs) and falls back to eager device time for ops outside any graph.

Inside a replayed graph consecutive kernels are not back to back: each starts a fraction of a
microsecond after the previous one ends (:func:`graph_gap_us` measures it). The simulator charges
that gap once per op it runs from a graph (``GPU.graph_kernel_gap_us``, ``sim.engine``); an op of
the executor is often several kernels, so :func:`op_device_us` given the gap adds the gaps
between an op's own kernels to its time, ``(kernels - 1) x gap``: the op as the graph runs it.

No torch import here: the functions take dicts, so they run and are tested on the CPU against a
recorded trace; :func:`profile_device_time` (torch, CUDA) records one.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The executor's per-op profiler range name (real/executor.py, ``launch``).
RANGE_RE = re.compile(r"^(?P<op>.+)\.L(?P<layer>None|-?\d+)\.mb(?P<mb>None|-?\d+)$")
#: Chrome categories of device work: kernels and the copies/sets the device performs.
DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
GRAPH_LAUNCH = "cudaGraphLaunch"

OpId = tuple[str, int | None, int | None]  # op name, layer, micro-batch (the range's fields)


def _int_or_none(s: str) -> int | None:
    return None if s == "None" else int(s)


def parse_range(name: str) -> OpId | None:
    """``"experts.L1.mb0"`` -> ``("experts", 1, 0)``; None for any other range name."""
    m = RANGE_RE.match(name)
    if m is None:
        return None
    return m["op"], _int_or_none(m["layer"]), _int_or_none(m["mb"])


@dataclass(frozen=True)
class DeviceKernel:
    """One device record: its name, device start and duration (µs), stream, correlation id."""

    name: str
    ts: float
    dur: float
    stream: int
    correlation: int


@dataclass
class Run:
    """One pass over the Program on the host timeline: per op the kernels its range launched
    (launch order), and for a replay the graph's kernels (device order)."""

    replay: bool
    ops: dict[OpId, list[DeviceKernel]] = field(default_factory=dict)
    graph_kernels: list[DeviceKernel] = field(default_factory=list)


@dataclass(frozen=True)
class OpTime:
    """An op's device time (µs): the median over eager runs and over graph replays (None where
    the op never ran that way), with how many runs of each went into the median."""

    eager_us: float | None
    replay_us: float | None
    eager_runs: int
    replays: int
    kernels: int  # kernels per run (the last eager run's)
    in_graph: bool = False  # its replay time is kernels of a captured graph

    @property
    def us(self) -> float | None:
        """The calibrated duration: the replay's where the op ran inside a graph (that is the
        measured step), else its eager device time."""
        return self.replay_us if self.replay_us is not None else self.eager_us

    @property
    def source(self) -> str:
        return "graph replay" if self.replay_us is not None else "eager"


@dataclass(frozen=True)
class KernelMap:
    """The result of :func:`map_kernels`: per-op times, per-run totals, and what did not map."""

    ops: dict[OpId, OpTime]
    eager_step_device_us: tuple[float, ...]  # per eager run: its ops' kernel time summed
    replay_device_us: tuple[float, ...]  # per replay: the graph's kernel time summed
    replay_span_us: tuple[float, ...]  # per replay: first kernel start to last kernel end
    replay_matched: tuple[int, ...]  # per replay: graph kernels matched to an op
    replay_unmatched: tuple[int, ...]  # per replay: graph kernels no op claimed
    unattributed_kernels: int  # device records launched outside any op range or graph

    def as_dict(self) -> dict[str, Any]:
        return {
            "ops": {
                f"{o}.L{layer}.mb{m}": dataclasses.asdict(t) | {"us": t.us, "source": t.source}
                for (o, layer, m), t in sorted(self.ops.items(), key=lambda kv: str(kv[0]))
            },
            "eager_step_device_us": list(self.eager_step_device_us),
            "replay_device_us": list(self.replay_device_us),
            "replay_span_us": list(self.replay_span_us),
            "replay_matched": list(self.replay_matched),
            "replay_unmatched": list(self.replay_unmatched),
            "unattributed_kernels": self.unattributed_kernels,
        }


def _events(trace: Mapping[str, Any] | list) -> list[dict]:
    return list(trace["traceEvents"] if isinstance(trace, Mapping) else trace)


def split_runs(trace: Mapping[str, Any] | list) -> tuple[list[Run], int]:
    """Steps 1-2 of the module docstring: the runs of the trace, and how many device records
    were launched outside every op range and graph (setup, weight init, the profiler's own)."""
    ev = _events(trace)
    kernels: dict[int, list[DeviceKernel]] = defaultdict(list)
    for e in ev:
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS:
            a = e.get("args", {})
            c = a.get("correlation")
            if c is None:
                continue
            kernels[int(c)].append(
                DeviceKernel(str(e.get("name")), float(e["ts"]), float(e.get("dur", 0.0)),
                             int(a.get("stream", -1)), int(c))
            )  # fmt: skip
    ranges = []  # (start, end, op id)
    for e in ev:
        if e.get("ph") == "X" and e.get("cat") == "user_annotation":
            op = parse_range(str(e.get("name")))
            if op is not None:
                ranges.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), op))
    ranges.sort(key=lambda r: r[0])
    starts = [r[0] for r in ranges]
    launches = sorted(
        (
            (float(e["ts"]), e.get("name"), int(e["args"]["correlation"]))
            for e in ev
            if e.get("ph") == "X"
            and e.get("cat") in ("cuda_runtime", "cuda_driver")
            and "correlation" in e.get("args", {})
            and int(e["args"]["correlation"]) in kernels
        ),
        key=lambda x: x[0],
    )
    # timeline of boundaries: range starts and graph launches, in host order
    items: list[tuple[float, int, Any]] = [(s, 0, op) for s, _, op in ranges]
    items += [(ts, 1, (name, c)) for ts, name, c in launches]
    items.sort(key=lambda x: (x[0], x[1]))
    first = ranges[0][2] if ranges else None
    runs: list[Run] = []
    cur: Run | None = None
    unattributed = 0
    for ts, kind, payload in items:
        if kind == 0:
            if cur is None or payload in cur.ops or (cur.replay and payload == first):
                cur = Run(replay=False)
                runs.append(cur)
            cur.ops.setdefault(payload, [])
            continue
        name, c = payload
        if name == GRAPH_LAUNCH:
            cur = Run(replay=True)  # the replay run goes on until the next boundary
            runs.append(cur)
            cur.graph_kernels.extend(sorted(kernels[c], key=lambda k: k.ts))
            continue
        i = bisect.bisect_right(starts, ts) - 1
        if i >= 0 and ranges[i][0] <= ts <= ranges[i][1] and cur is not None:
            cur.ops.setdefault(ranges[i][2], []).extend(kernels[c])
        else:
            unattributed += len(kernels[c])
    return runs, unattributed


def _template(last: Run, r: Run) -> list[tuple[OpId, DeviceKernel]]:
    """The kernels a replay's graph runs, as ``last`` (an eager run) launched them: the ops
    the replay run did not launch by range, in launch order."""
    body = [op for op in last.ops if op not in r.ops]  # ops the graph ran, not by range
    return sorted(((op, k) for op in body for k in last.ops[op]), key=lambda x: x[1].correlation)


def _match(template: list[tuple[OpId, DeviceKernel]], replay: list[DeviceKernel]):
    """Step 3: each replay kernel (device order) to the first unmatched template kernel of the
    same name; returns (per-op time, [(op, replay kernel)] matched, unmatched)."""
    queues: dict[str, list[int]] = defaultdict(list)
    for i, (_, k) in enumerate(template):
        queues[k.name].append(i)
    heads: dict[str, int] = defaultdict(int)
    per_op: dict[OpId, float] = defaultdict(float)
    pairs = []
    for k in replay:
        q, h = queues.get(k.name), heads[k.name]
        if not q or h >= len(q):
            continue
        heads[k.name] = h + 1
        per_op[template[q[h]][0]] += k.dur
        pairs.append((template[q[h]][0], k))
    return per_op, pairs, len(replay) - len(pairs)


def map_kernels(trace: Mapping[str, Any] | list) -> KernelMap:
    """The per-op device times of a torch.profiler Chrome trace of the executor (the module
    docstring's steps 1-4)."""
    runs, unattributed = split_runs(trace)
    eager = [r for r in runs if not r.replay]
    replays = [r for r in runs if r.replay and r.graph_kernels]
    eager_us: dict[OpId, list[float]] = defaultdict(list)
    for r in eager:
        for op, ks in r.ops.items():
            eager_us[op].append(sum(k.dur for k in ks))
    replay_us: dict[OpId, list[float]] = defaultdict(list)
    in_graph: set[OpId] = set()
    matched, unmatched = [], []
    last = eager[-1] if eager else Run(replay=False)
    for r in replays:
        body = [op for op in last.ops if op not in r.ops]
        per_op, pairs, u = _match(_template(last, r), r.graph_kernels)
        matched.append(len(pairs))
        unmatched.append(u)
        for op in body:
            if last.ops[op]:
                replay_us[op].append(per_op.get(op, 0.0))
                in_graph.add(op)
        for op, ks in r.ops.items():  # ops of the replay run outside the graph (by range)
            eager_us.setdefault(op, [])  # keep: they are eager work of a replay run
            replay_us[op].append(sum(k.dur for k in ks))
    ops = {
        op: OpTime(
            eager_us=statistics.median(eager_us[op]) if eager_us.get(op) else None,
            replay_us=statistics.median(replay_us[op]) if replay_us.get(op) else None,
            eager_runs=len(eager_us.get(op, ())),
            replays=len(replay_us.get(op, ())),
            kernels=len(last.ops.get(op, ())),
            in_graph=op in in_graph,
        )
        for op in set(eager_us) | set(replay_us)
    }
    return KernelMap(
        ops=ops,
        eager_step_device_us=tuple(sum(k.dur for ks in r.ops.values() for k in ks) for r in eager),
        replay_device_us=tuple(sum(k.dur for k in r.graph_kernels) for r in replays),
        replay_span_us=tuple(
            max(k.ts + k.dur for k in r.graph_kernels) - min(k.ts for k in r.graph_kernels)
            for r in replays
        ),
        replay_matched=tuple(matched),
        replay_unmatched=tuple(unmatched),
        unattributed_kernels=unattributed,
    )


def op_device_us(km: KernelMap, gap_us: float = 0.0) -> dict[OpId, float]:
    """Per op the calibrated duration (:attr:`OpTime.us`), ops with no time left out; an op
    that ran inside a graph as several kernels also takes the ``gap_us`` between each two of
    them (the module docstring: the simulator charges the gap before each op, not inside it)."""
    return {
        op: t.us + (max(t.kernels - 1, 0) * gap_us if t.in_graph and t.replay_us else 0.0)
        for op, t in km.ops.items()
        if t.us is not None
    }


#: The emulated backend's link kernels (``real/comm/_triton_emulated.py``): the send kernel
#: holds its CTAs until the modelled arrival (or only copies and stamps it, before a receive
#: hook), the receive kernel spins until the arrival, SBO's combine send polls the down GEMM's
#: signals. Their time is the link model's (and SBO's signals'); the rest of a comm op's
#: kernels is its data path, :func:`local_work_us`.
LINK_KERNELS = frozenset({"send_kernel", "recv_kernel", "sbo_combine_kernel"})


def local_work_us(
    trace: Mapping[str, Any] | list,
    ops: Iterable[OpId] | None = None,
    gap_us: float = 0.0,
    link: Iterable[str] = LINK_KERNELS,
) -> dict[OpId, float]:
    """Per communication op of the executor's emulated backend (``ops``: by default every op
    with a kernel in ``link``; a normal-mode combine's receive has none), the device time of
    its kernels outside ``link``: the mirror data path (index math, gathers,
    unpacking) that DeepEP's own kernels do while the data is in flight and the emulation runs
    as torch ops around its link kernels. The median over graph replays where the op ran in a
    graph (with ``gap_us`` between each two of its kernels, as :func:`op_device_us`), else over
    eager runs. Ops that launched no kernel are left out."""
    link = frozenset(link)
    runs, _ = split_runs(trace)
    eager = [r for r in runs if not r.replay]
    if not eager:
        return {}
    last = eager[-1]
    comm = (
        {op for op, ks in last.ops.items() if any(k.name in link for k in ks)}
        if ops is None
        else {op for op in ops if last.ops.get(op)}
    )
    replayed: dict[OpId, list[float]] = defaultdict(list)
    for r in runs:
        if not (r.replay and r.graph_kernels):
            continue
        _, pairs, _ = _match(_template(last, r), r.graph_kernels)
        got: dict[OpId, float] = {}
        for op, k in pairs:
            if op in comm:
                got[op] = got.get(op, 0.0) + (0.0 if k.name in link else k.dur)
        for op, us in got.items():
            replayed[op].append(us + (len(last.ops[op]) - 1) * gap_us)
    eager_us: dict[OpId, list[float]] = defaultdict(list)
    for r in eager:
        for op in comm & r.ops.keys():
            eager_us[op].append(sum(k.dur for k in r.ops[op] if k.name not in link))
    return {op: statistics.median(replayed.get(op) or eager_us[op]) for op in sorted(comm, key=str)
            if replayed.get(op) or eager_us.get(op)}  # fmt: skip


def graph_gap_us(km: KernelMap, replay_step_us: float | None) -> float | None:
    """The gap a CUDA-graph replay leaves between consecutive kernels, per kernel: the smaller
    of two upper bounds. (1) The replay's step time ``replay_step_us`` (measured by CUDA events,
    without the profiler) less its kernels' device time (this trace's median replay), over its
    kernels: it also holds the wait for the graph's launch before the first kernel. (2) The
    profiled replays' span less their kernel time, over the kernels: the profiler's activity
    records lengthen these gaps. None without replays or a step time.

    Why both: on the H200 recording of 2026-11-26 (decode 128 serial, 715 kernels) the
    profiled replays show 0.42 µs per kernel and the unprofiled step leaves 0.27 µs; on the
    recording of 2026-11-27 (decode 32 serial, 708 kernels: 4,000 µs of kernels, a profiled
    span of 4,302 µs) the unprofiled step, 4,662 µs, leaves 0.94 µs per kernel, of which the
    profiled span shows 0.43: the rest is a wait before the replay's first kernel, which is not
    per kernel (TBO's replay, 1,310 kernels on one stream, measured 6,641 µs unprofiled against
    a profiled span of 6,638: 0.94 µs per kernel would add 670 µs)."""
    if not km.replay_device_us or not replay_step_us:
        return None
    kernels = statistics.median(m + u for m, u in zip(km.replay_matched, km.replay_unmatched))
    if kernels <= 0:
        return None
    dev = statistics.median(km.replay_device_us)
    step = (replay_step_us - dev) / kernels
    span = (statistics.median(km.replay_span_us) - dev) / kernels
    return max(0.0, min(step, span))


def graph_launch_wait_us(km: KernelMap, replay_step_us: float | None) -> float | None:
    """The wait before a replayed graph's first kernel in one run (serial's): the replay's step
    time ``replay_step_us`` (CUDA events around ``graph.replay()``, without the profiler) less
    the profiled replays' span (median, first kernel's start to last kernel's end), at least 0.
    None without replays or a step time.

    Why: the start event fires on an idle stream, then ``cudaGraphLaunch`` holds the host
    before the graph's first kernel runs. How long depends on the graph: the first kernel
    waits for the launch of the records before the graph's first memset
    (``overlap_lab.graph_launch``, which spreads this wait, measured on serial, over them)."""
    if not km.replay_span_us or not replay_step_us:
        return None
    return max(0.0, replay_step_us - statistics.median(km.replay_span_us))


@dataclass(frozen=True)
class OpHost:
    """One op's host side in the executor's eager runs (µs): ``steps`` in host order, each
    ``("host", µs)`` of its host work, ``("sync", 0.0)`` where it reads device data back (a
    device-to-host copy the host waits for: ``.item()``, ``.tolist()``, ``nonzero``'s count:
    the work issued so far must be done, a wait not counted as work) and one ``("launch", 0.0)`` where the
    launches so far hold half of the op's device time (from there the op runs on the device
    while the host goes on)."""

    steps: tuple[tuple[str, float], ...]

    @property
    def us(self) -> float:
        return sum(us for kind, us in self.steps if kind == "host")

    @property
    def syncs(self) -> int:
        return sum(1 for kind, _ in self.steps if kind == "sync")

    def scaled(self, f: float) -> OpHost:
        return OpHost(tuple((k, us * f) for k, us in self.steps))


@dataclass(frozen=True)
class HostLaunch:
    """The executor's host time to launch an op in an eager run (µs), from a calibration
    run's profiler records: ``per_op`` from the op's range opening to its first launch call
    (the executor's Python around the op) and ``per_kernel`` from one launch call to the next
    inside the range (PyTorch's dispatch, the CUDA launch, the Python between two kernels),
    medians over ``intervals`` intervals of ``ranges`` op ranges; ``kernels``: per op name the
    kernels one launch runs (:func:`kernels_per_op`); ``measured``: per op name its host work
    and read-backs (:func:`op_host`), which win over ``per_op + kernels x per_kernel``.
    ``scale``: the unprofiled host time over the profiled one (the profiler's records lengthen
    every launch), where the loop measured both."""

    per_op: float
    per_kernel: float
    ranges: int = 0
    intervals: int = 0
    kernels: Mapping[str, int] = field(default_factory=dict)
    measured: Mapping[str, OpHost] = field(default_factory=dict)
    scale: float = 1.0

    def op(self, name: str) -> OpHost:
        """What an eager launch of op ``name`` holds its host thread for (an op never seen:
        ``per_op + kernels x per_kernel``, then the launch; one kernel where not counted)."""
        us = self.per_op + max(self.kernels.get(name, 1), 1) * self.per_kernel
        h = self.measured.get(name) or OpHost((("host", us), ("launch", 0.0)))
        return h.scaled(self.scale)


def host_calls(trace: Mapping[str, Any] | list):
    """(op ranges [(start, end, op id)], launch calls [(start, end, device records)]) of a
    profiler trace, both sorted: a call is a CUDA runtime or driver call with device records,
    graph launches left out."""
    ev = _events(trace)
    ranges = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), op)
        for e in ev
        if e.get("ph") == "X"
        and e.get("cat") == "user_annotation"
        and (op := parse_range(str(e.get("name")))) is not None
    )
    dev: dict[int, list[dict]] = defaultdict(list)
    for e in ev:
        if e.get("cat") in DEVICE_CATS and "correlation" in e.get("args", {}):
            dev[int(e["args"]["correlation"])].append(e)
    calls = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)),
         tuple(dev[int(e["args"]["correlation"])]))
        for e in ev
        if e.get("ph") == "X"
        and e.get("cat") in ("cuda_runtime", "cuda_driver")
        and e.get("name") != GRAPH_LAUNCH
        and int(e.get("args", {}).get("correlation", -1)) in dev
    )  # fmt: skip
    return ranges, calls


def host_launch(trace: Mapping[str, Any] | list) -> HostLaunch | None:
    """:class:`HostLaunch` of the executor's eager runs in ``trace`` (its profiler records:
    op ranges and the launch calls of device records, as :func:`kernel_records` keeps them),
    with each op's :func:`op_host`; graph launches are not counted (a replay's kernels cost
    the host nothing each). None without an op range that launched two kernels. The medians
    leave out the few intervals that hold a read-back (a ``.item()`` inside an op)."""
    ranges, calls = host_calls(trace)
    starts = [c[0] for c in calls]
    first, between = [], []
    for a, b, _ in ranges:
        inside = starts[bisect.bisect_left(starts, a) : bisect.bisect_right(starts, b)]
        if inside:
            first.append(inside[0] - a)
            between += [y - x for x, y in zip(inside, inside[1:])]
    if not between:
        return None
    return HostLaunch(statistics.median(first), statistics.median(between), len(first),
                      len(between), measured=op_host(trace))  # fmt: skip


def _is_readback(records: tuple) -> bool:
    return any(str(r.get("name", "")).startswith("Memcpy DtoH") for r in records)


def op_host(trace: Mapping[str, Any] | list) -> dict[str, OpHost]:
    """Per op name its :class:`OpHost` in the eager runs of ``trace`` (the executor's profiler
    records): the steps of its op range whose host work is the median of the name's ranges.
    Why the read-backs apart: while the host waits for one the device runs what was issued
    before it (device time, which the prediction has), and after it the device waits for the
    host; why the launch point: an op's kernels run as they are launched, so the host's work
    after its big kernels overlaps them."""
    ranges, calls = host_calls(trace)
    starts = [c[0] for c in calls]
    found = [(a, b, op[0], calls[bisect.bisect_left(starts, a) : bisect.bisect_right(starts, b)])
             for a, b, op in ranges]  # fmt: skip
    found = [f for f in found if f[3]]
    # an op whose host ever went on before its copy was done does not wait for its copies
    blocking: dict[str, bool] = {}
    for _, b, name, inside in found:
        blocking[name] = blocking.get(name, True) and all(_waited(b, inside))
    got: dict[str, list[OpHost]] = defaultdict(list)
    for a, b, name, inside in found:
        got[name].append(_op_steps(a, b, inside, blocking[name]))
    return {n: sorted(hs, key=lambda h: h.us)[(len(hs) - 1) // 2] for n, hs in sorted(got.items())}


def _waited(end: float, calls: list) -> list[bool]:
    """Per device-to-host copy among ``calls`` (an op range's, ending at ``end``): whether
    the host went on (its next call, or the range's end) only once the copy was done."""
    out = []
    for i, (_, _, recs) in enumerate(calls):
        if _is_readback(recs):
            done = max(float(r["ts"]) + float(r.get("dur", 0.0)) for r in recs)
            out.append((calls[i + 1][0] if i + 1 < len(calls) else end) >= done)
    return out


def _op_steps(start: float, end: float, calls: list, blocking: bool = True) -> OpHost:
    """:class:`OpHost` of one op range from ``start`` to ``end`` with its launch ``calls``. A
    device-to-host copy is a read-back where the op's copies block (``blocking``: in no range
    of the op did the host go on before its copy was done) and the host went on only once this
    one was done; a ``non_blocking`` copy is a launch like any other."""
    kernel = [sum(float(r.get("dur", 0.0)) for r in c[2] if r.get("cat") == "kernel")
              for c in calls]  # fmt: skip
    total, acc, point = sum(kernel), 0.0, len(calls) - 1
    for i, k in enumerate(kernel):
        acc += k
        if total > 0 and acc >= total / 2:
            point = i
            break
    steps: list[tuple[str, float]] = []
    work, cursor = 0.0, start
    for i, (t0, _, recs) in enumerate(calls):
        work += max(0.0, t0 - cursor)
        cursor = max(cursor, t0)
        if i == point:
            steps += [("host", work), ("launch", 0.0)]
            work = 0.0
        if not _is_readback(recs):
            continue
        done = max(float(r["ts"]) + float(r.get("dur", 0.0)) for r in recs)
        resumed = calls[i + 1][0] if i + 1 < len(calls) else end
        if blocking and resumed >= done:  # the host waited for it: not its work
            steps += [("host", work), ("sync", 0.0)]
            work, cursor = 0.0, max(cursor, done)
    work += max(0.0, max(c[1] for c in calls) - cursor)
    steps.append(("host", work))
    return OpHost(tuple(s for s in steps if s[0] != "host" or s[1] > 0))


def idle_scale(profiled, unprofiled, km: KernelMap) -> float | None:
    """How much less the host holds the device up without the profiler: over the ops of an
    eager run, the time their CUDA-event spans exceed their kernels' device time (``km``'s
    eager medians), in ``unprofiled`` (a run of the executor without the profiler) over the
    same in ``profiled`` (a run of the same Program under it; both ``Trace``s). Inside an op
    the device waits for the host's launches and read-backs; the profiler's records lengthen
    the host's part (on the H200, 2026-11-27, BF16 prefill 4096 serial: 6,841 µs against
    12,055). None where no op waited in the profiled run."""

    def spans(tr) -> dict[OpId, float]:
        out: dict[OpId, float] = defaultdict(float)
        for sp in tr.spans:
            if sp.lane.startswith("stream:"):
                out[(sp.op, sp.layer, sp.mb)] += sp.duration
        return out

    p, u = spans(profiled), spans(unprofiled)
    waited = unwaited = 0.0
    for op, t in km.ops.items():
        if t.eager_us is None or op not in p or op not in u or p[op] <= t.eager_us:
            continue
        waited += p[op] - t.eager_us
        unwaited += max(u[op] - t.eager_us, 0.0)
    return unwaited / waited if waited > 0 else None


def kernels_per_op(km: KernelMap) -> dict[str, int]:
    """Per op name the kernels one launch of it runs (the median over its layers and
    micro-batches in the last eager run): what an eager launch of it costs the host
    (:class:`HostLaunch`)."""
    by: dict[str, list[int]] = defaultdict(list)
    for (name, _, _), t in km.ops.items():
        by[name].append(t.kernels)
    return {n: int(statistics.median(ks)) for n, ks in sorted(by.items())}


def with_device_time(trace, times: Mapping[OpId, float]):
    """``trace`` (a ``shared.outputs.trace.Trace`` of the executor) with each op's stream spans shrunk
    or stretched so that they sum to the op's device time: the spans keep their starts (the
    order and the overlap the eager pass saw), their durations become kernel time. Ops without a
    device time keep their spans; ``meta["spans_source"]`` says which is which."""
    from overlap_lab.shared.outputs.trace import Trace

    total: dict[OpId, float] = defaultdict(float)
    for s in trace.spans:
        if s.lane.startswith("stream:"):
            total[(s.op, s.layer, s.mb)] += s.duration
    spans, kept = [], set()
    for s in trace.spans:
        k = (s.op, s.layer, s.mb)
        if not s.lane.startswith("stream:") or k not in times or total[k] <= 0:
            if s.lane.startswith("stream:"):
                kept.add(s.op)
            spans.append(s)
            continue
        d = s.duration * times[k] / total[k]
        spans.append(dataclasses.replace(s, end=s.start + d))
    meta = dict(trace.meta)
    meta["spans_source"] = "device time (torch.profiler kernel records mapped to ops)" + (
        f"; CUDA-event spans kept for {sorted(kept)}" if kept else ""
    )
    return Trace(tuple(spans), meta)


def _eager_pass(runs: list[Run], before: int) -> Run:
    """The eager runs before ``runs[before]`` (and the replays right before it) back to the
    previous replay, as one run (an op's latest kernels win): the template of the replays
    that follow. A Program of several steps
    is cut into one eager run per step (its op ranges recur), so the last eager run alone
    would be one step's tail (sglang-overlap: its scheduler ops); the ranges name no step, so
    the steps' kernels of one op share its entry."""
    out = Run(replay=False)
    i = before - 1
    while i >= 0 and runs[i].replay:
        i -= 1
    end = i + 1
    while i >= 0 and not runs[i].replay:
        i -= 1
    for r in runs[i + 1 : end]:
        out.ops.update({op: ks for op, ks in r.ops.items() if ks})
    return out


def load_chrome(path: str | Path) -> dict:
    """A Chrome trace (``.json`` or ``.json.gz``) as a dict, read with a trace's bounds."""
    from overlap_lab.shared.files import MAX_TRACE_BYTES, read_json

    return read_json(path, "trace", MAX_TRACE_BYTES, gunzip=True)


def profile_device_time(fn: Callable[[], Any]) -> tuple[Any, dict]:
    """Run ``fn`` under torch.profiler with CUDA activity; (its result, the Chrome trace dict).
    Needs a CUDA device (the CPU records no kernels)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "trace.json"
        prof.export_chrome_trace(str(p))
        return out, load_chrome(p)


def kernel_records(trace: Mapping[str, Any] | list, *, last: int | None = None) -> dict:
    """A Chrome trace holding only what :func:`map_kernels` reads (the executor's op ranges,
    the launches with device records, the device records, each with ``args`` cut to
    ``correlation`` and ``stream``), so a loop's archive can keep its calibration runs' kernel
    records at a fraction of the profiler's size. ``last``: only the last ``last`` eager runs
    and the last ``last`` graph replays (a small fixture). Mapped again, the result gives the
    same times for the runs it keeps."""
    ev = [e for e in _events(trace) if e.get("ph") == "X"]
    dev = {
        int(e["args"]["correlation"])
        for e in ev
        if e.get("cat") in DEVICE_CATS and "correlation" in e.get("args", {})
    }
    keep = []
    for e in ev:
        cat, a = e.get("cat"), e.get("args", {})
        base = {"ph": "X", "cat": cat, "name": e.get("name"), "ts": e["ts"],
                "dur": e.get("dur", 0.0)}  # fmt: skip
        if cat == "user_annotation" and parse_range(str(e.get("name"))) is not None:
            keep.append(base)
        elif cat in ("cuda_runtime", "cuda_driver") and int(a.get("correlation", -1)) in dev:
            keep.append(base | {"args": {"correlation": int(a["correlation"])}})
        elif cat in DEVICE_CATS and "correlation" in a:
            keep.append(base | {"args": {"correlation": int(a["correlation"]),
                                         "stream": int(a.get("stream", -1))}})  # fmt: skip
    if last is not None:
        keep = _last_runs(keep, last)
    return {"traceEvents": keep}


def _last_runs(ev: list[dict], last: int) -> list[dict]:
    """``ev`` cut to the events of the last ``last`` eager runs and replays: a run spans on the
    host from its first boundary (an op range or a graph launch starting it, as
    :func:`split_runs` cuts) to the next run's; device records follow their launches."""
    runs = _run_starts(ev)
    bounds = [(t, runs[i + 1][0] if i + 1 < len(runs) else float("inf"))
              for i, (t, _) in enumerate(runs)]  # fmt: skip
    chosen = [b for kind in (False, True)
              for b in [b for b, (_, r) in zip(bounds, runs) if r == kind][-last:]]  # fmt: skip
    host = [e for e in ev if e.get("cat") not in DEVICE_CATS]
    kept = [e for e in host if any(a <= float(e["ts"]) < b for a, b in chosen)]
    corr = {e["args"]["correlation"] for e in kept if "args" in e}
    return kept + [
        e for e in ev if e.get("cat") in DEVICE_CATS and e["args"]["correlation"] in corr
    ]


def _run_starts(ev: list[dict]) -> list[tuple[float, bool]]:
    """(host start, is a replay) of each run of :func:`split_runs`, with its boundaries."""
    ranges = sorted(
        (float(e["ts"]), parse_range(str(e["name"])))
        for e in ev
        if e.get("cat") == "user_annotation" and parse_range(str(e["name"])) is not None
    )
    first = ranges[0][1] if ranges else None
    items: list[tuple[float, int, Any]] = [(ts, 0, op) for ts, op in ranges]
    items += [
        (float(e["ts"]), 1, None)
        for e in ev
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("name") == GRAPH_LAUNCH
    ]
    items.sort(key=lambda x: (x[0], x[1]))
    starts: list[tuple[float, bool]] = []
    seen: set = set()
    for ts, kind, op in items:
        if kind == 1:
            starts.append((ts, True))
            seen = set()
        elif not starts or op in seen or (starts[-1][1] and op == first):
            starts.append((ts, False))
            seen = {op}
        else:
            seen.add(op)
    return starts


def trim(trace: Mapping[str, Any], keep: Iterable[dict]) -> dict:
    """A Chrome trace holding only ``keep``'s events and the trace's header fields (fixtures)."""
    return {k: v for k, v in trace.items() if k != "traceEvents"} | {"traceEvents": list(keep)}
