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


def _match(template: list[tuple[OpId, DeviceKernel]], replay: list[DeviceKernel]):
    """Step 3: each replay kernel (device order) to the first unmatched template kernel of the
    same name; returns (per-op time, matched, unmatched)."""
    queues: dict[str, list[int]] = defaultdict(list)
    for i, (_, k) in enumerate(template):
        queues[k.name].append(i)
    heads: dict[str, int] = defaultdict(int)
    per_op: dict[OpId, float] = defaultdict(float)
    matched = 0
    for k in replay:
        q, h = queues.get(k.name), heads[k.name]
        if not q or h >= len(q):
            continue
        heads[k.name] = h + 1
        per_op[template[q[h]][0]] += k.dur
        matched += 1
    return per_op, matched, len(replay) - matched


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
    matched, unmatched = [], []
    last = eager[-1] if eager else Run(replay=False)
    for r in replays:
        body = [op for op in last.ops if op not in r.ops]  # ops the graph ran, not by range
        template = sorted(
            ((op, k) for op in body for k in last.ops[op]), key=lambda x: x[1].correlation
        )
        per_op, m, u = _match(template, r.graph_kernels)
        matched.append(m)
        unmatched.append(u)
        for op in body:
            if last.ops[op]:
                replay_us[op].append(per_op.get(op, 0.0))
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


def op_device_us(km: KernelMap) -> dict[OpId, float]:
    """Per op the calibrated duration (:attr:`OpTime.us`), ops with no time left out."""
    return {op: t.us for op, t in km.ops.items() if t.us is not None}


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


def trim(trace: Mapping[str, Any], keep: Iterable[dict]) -> dict:
    """A Chrome trace holding only ``keep``'s events and the trace's header fields (fixtures)."""
    return {k: v for k, v in trace.items() if k != "traceEvents"} | {"traceEvents": list(keep)}
