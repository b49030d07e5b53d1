"""The wait before a replayed CUDA graph's first kernel, per graph, from profiler records.

Why: a graph-replayed decode step is timed by CUDA events around ``graph.replay()``
(``real.runner``, ``run_graph``). The device is idle when the start event fires, so the step
holds the time the host's ``cudaGraphLaunch`` takes before the device has a kernel to run.
How long that is depends on the graph: in the profiler records of the H200 run of 2026-11-27
the first kernel of a graph without memset nodes starts as its ``cudaGraphLaunch`` returns
(serial decode 32, 708 records: 1,122-1,448 µs under the profiler, 1.0 of the launch), while
a graph with memset nodes (cuBLAS split-K GEMMs at 16 tokens zero their output first) starts
it once the launch has gone past the first memset: serial decode 16, first memset at record
87 of 713, first kernel at 0.13-0.22 of its launch; serial decode 128, one memset at record
703 of 709, at 0.98; TBO decode 32, first memset at 191 of 1,310, at 0.18. The driver hands
the device the work before a memset node when its launch reaches that node (observed, not
documented), so the device waits for the launch of the graph's first segment only: the
records before its first memset (:func:`first_segment`), all of them where it has none.

The rule (:class:`LaunchWait`, :func:`fit_wait`): a replay's wait is a cost per record of the
graph's first segment (plus a fixed part where serial's wait was measured at two first
segments), measured on serial (its unprofiled replay step less its profiled replays' span,
``device_time.graph_launch_wait_us``). The profiler's
host costs are many times the unprofiled ones, so the profiled launch durations give the
shape (where the first kernel starts), never the time. The unprofiled step also holds the
host's work before the graph's start event and after its end event (under the profiler
70-190 µs a step); the per-record cost holds them too, as one measured number.

No torch here: the functions take the profiler's Chrome trace dicts and run on the CPU.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from overlap_lab.device_time import DEVICE_CATS, GRAPH_LAUNCH


@dataclass(frozen=True)
class ReplayLaunch:
    """One profiled graph replay: its device records, those before its first memset
    (``first_segment``), the ``cudaGraphLaunch``'s host time and where its first device record
    started from the launch's start (µs, under the profiler), and its streams."""

    records: int
    first_segment: int
    launch_us: float
    first_record_us: float
    streams: int

    @property
    def first_share(self) -> float:
        """Where the first record started, as a share of the launch's host time."""
        return self.first_record_us / self.launch_us if self.launch_us > 0 else 0.0


def replay_launches(trace: Mapping[str, Any] | list) -> list[ReplayLaunch]:
    """Every ``cudaGraphLaunch`` of a profiler trace with device records, in host order."""
    ev = list(trace["traceEvents"] if isinstance(trace, Mapping) else trace)
    device: dict[int, list[dict]] = defaultdict(list)
    for e in ev:
        c = (e.get("args") or {}).get("correlation")
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS and c is not None:
            device[int(c)].append(e)
    out = []
    launches = (e for e in ev if e.get("ph") == "X" and e.get("name") == GRAPH_LAUNCH)
    for g in sorted(launches, key=lambda e: float(e["ts"])):
        recs = sorted(device.get(int((g.get("args") or {}).get("correlation", -1)), ()),
                      key=lambda e: float(e["ts"]))  # fmt: skip
        if not recs:
            continue
        sets = [i for i, e in enumerate(recs) if e.get("cat") == "gpu_memset"]
        out.append(
            ReplayLaunch(
                len(recs),
                sets[0] if sets else len(recs),
                float(g.get("dur", 0.0)),
                float(recs[0]["ts"]) - float(g["ts"]),
                len({(e.get("args") or {}).get("stream") for e in recs}),
            )
        )
    return out


def first_segment(trace: Mapping[str, Any] | list | None) -> int | None:
    """The records before a graph's first memset (all where it has none): the median over the
    trace's profiled replays; None without a trace or replays."""
    got = replay_launches(trace) if trace is not None else []
    return int(statistics.median(r.first_segment for r in got)) if got else None


@dataclass(frozen=True)
class LaunchWait:
    """The wait before a replay's first kernel: ``fixed_us`` plus ``per_record_us`` per device
    record of the graph's first segment (:func:`first_segment`); ``source`` says from what."""

    fixed_us: float
    per_record_us: float
    source: str

    def us(self, segment: int) -> float:
        return self.fixed_us + self.per_record_us * segment


def fit_wait(points: list[tuple[int | None, float | None]]) -> LaunchWait | None:
    """The rule from serial's graphs whose wait was measured (unprofiled replay step less the
    profiled span, ``device_time.graph_launch_wait_us``), as (first segment, wait) pairs. One
    first segment: its wait spread over its records (the host's work outside the graph
    included). Several: the least-squares line, through 0 where its intercept would be
    negative; a wait that does not grow with the first segment is one wait per replay (the
    rule does not hold: the source says so). None without a measured pair."""
    pts = [(s, w) for s, w in points if s and w is not None]
    if not pts:
        return None
    xs, ys = [float(s) for s, _ in pts], [w for _, w in pts]
    said = ", ".join(f"{w:.1f} us at {s} records" for s, w in pts)
    if len(set(xs)) == 1:
        return LaunchWait(0.0, statistics.median(ys) / xs[0], f"{said}: one first segment")
    slope, fixed = statistics.linear_regression(xs, ys)
    if slope <= 0:
        w = statistics.median(ys)
        return LaunchWait(w, 0.0, f"{said}: not growing with the first segment, one wait")
    if fixed < 0:
        slope, fixed = statistics.linear_regression(xs, ys, proportional=True)[0], 0.0
    return LaunchWait(fixed, slope, f"{said}: least squares")


def unprofiled_launch(meta: Mapping[str, Any] | None) -> dict | None:
    """What an unprofiled graph-timed run recorded of its replays' launches (the executor's
    trace meta ``graph_launch_host_us``, ``graph_replay_spans_us``, from the GPU runs after
    2026-11-27 on), medians over its timed runs of each run's sums: the host's
    ``cudaGraphLaunch`` time and the graphs' CUDA-event spans (the step less these is host
    work outside the graphs). None where the run recorded neither. With the profiled replays'
    span and first segment it decides the rule: the wait in a graph's span (its span less the
    profiled one) against the launch's share up to the first memset."""
    if not meta:
        return None
    host = [sum(sum(v) for v in r.values()) for r in meta.get("graph_launch_host_us") or () if r]
    spans = [sum(r) for r in meta.get("graph_replay_spans_us") or () if r]
    if not host and not spans:
        return None
    return {
        "launch_host_us": statistics.median(host) if host else None,
        "graph_spans_us": statistics.median(spans) if spans else None,
    }
