"""Where a result's kernel durations come from, and whether results compared rest on the same.

A simulated kernel's duration comes from one of three sources (``sim.cost.duration_source``):
a calibration profile's measured rows (``profile``), the roofline with an assumed per-class
efficiency (``roofline``), or the link model for communication kernels and copies (``link``); a
plugged cost model is a source of its own, named as it is. Two schedules compare like for like
only where the same kind of kernel (op class and dtype) is timed by the same source in both: a
split expert GEMM timed from the roofline beside serial's whole one timed from the profile
ranks the schedules on the difference between the two sources, not between the schedules.

Everything here reads rank 0 of a result (the rank ``exposed comm`` is measured on): its
launched ops for counts, its stream spans for time.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from overlap_lab.shared.ir.program import Op, first_rank_ops

#: ``overlap_lab.api.Result`` (not imported: the API imports this module).
Result = Any

#: The built-in sources, in the order tables print them.
SOURCES: tuple[str, ...] = ("profile", "roofline", "link")

Kernel = tuple[str, str]  # (op class, dtype)


def _source(result: Result):
    from overlap_lab.sim.calibrate import source_of

    return source_of(result.gpu, result.profile, result.cost_model)


def kernel_sources(result: Result) -> dict[Kernel, dict[str, int]]:
    """Per (op class, dtype) of rank 0's launched ops, how many take their duration from
    where (each distinct op looked up once)."""
    source = _source(result)
    seen: dict[int, str] = {}
    out: dict[Kernel, Counter] = defaultdict(Counter)
    for op in first_rank_ops(result.program):
        src = seen.get(id(op))
        if src is None:
            src = seen[id(op)] = source(op)
        out[(op.op_class, op.dtype)][src] += 1
    return {k: dict(v) for k, v in sorted(out.items())}


def launches(result: Result) -> list[tuple[Op, float, float]]:
    """Rank 0's kernels as launched: (op, start, end), one per launch on a stream lane. The
    simulator may draw one kernel as several spans (cohorts of its CTAs on different SMs, a
    persistent kernel's late CTAs): consecutive spans of one op on one lane are one launch."""
    ops: dict[tuple, Op] = {}
    for op in first_rank_ops(result.program):
        ops.setdefault((op.name, op.layer, op.mb, op.step), op)
    trace = result.trace
    lanes: dict[str, list] = defaultdict(list)
    for s in trace.spans_of(trace.ranks[0]):
        if s.lane.startswith("stream:"):
            lanes[s.lane].append(s)
    out: list[list] = []
    for spans in lanes.values():
        last = None
        for s in sorted(spans, key=lambda s: (s.start, s.end)):
            key = (s.op, s.layer, s.mb, s.step)
            op = ops.get(key)
            if op is None:
                last = None
                continue
            if last is not None and last[0] is op and last[3] == key:
                last[2] = max(last[2], s.end)
                continue
            last = [op, s.start, s.end, key]
            out.append(last)
    return [(op, start, end) for op, start, end, _ in out]


def time_by_source(result: Result) -> dict[Kernel, dict[str, float]]:
    """Per (op class, dtype), rank 0's kernel time (µs over the window: each launch from its
    first CTA's start to its last CTA's end) by the source of each kernel's duration."""
    source = _source(result)
    cache: dict[int, str] = {}
    out: dict[Kernel, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for op, start, end in launches(result):
        src = cache.get(id(op))
        if src is None:
            src = cache[id(op)] = source(op)
        out[(op.op_class, op.dtype)][src] += end - start
    return {k: dict(v) for k, v in sorted(out.items())}


def slowed_us(result: Result) -> float:
    """Rank 0's compute time over the window beyond each kernel's time alone on its SMs
    (``sim.cost.solo_duration_us``): what sharing SMs and HBM with concurrent kernels cost it,
    as the model's sharing rules give it. 0 for a plugged cost model (no solo time to read)."""
    from overlap_lab.sim.cost import RooflineCostModel, cost_key, solo_duration_us
    from overlap_lab.sim.models import DEFAULT_COST_MODEL

    model = result.cost_model
    profile = result.profile
    if type(model) is RooflineCostModel:
        profile = model.profile
    elif model is not None and model != DEFAULT_COST_MODEL:
        return 0.0
    solo: dict[tuple, float] = {}  # by what the op costs: every layer's copy is one entry
    lost = 0.0
    for op, start, end in launches(result):
        if op.kind != "compute":
            continue
        k = cost_key(op)
        t = solo.get(k)
        if t is None:
            t = solo[k] = solo_duration_us(op, result.gpu, profile=profile)
        lost += max(0.0, end - start - t)
    return lost


def cost_share(result: Result) -> dict[str, float]:
    """Share of rank 0's kernel time whose durations come from each source (sums to 1)."""
    total: Counter = Counter()
    for by in time_by_source(result).values():
        total.update(by)
    t = sum(total.values())
    order = [s for s in SOURCES if s in total] + sorted(set(total) - set(SOURCES))
    return {s: total[s] / t for s in order} if t > 0 else {}


def share_text(share: dict[str, float]) -> str:
    """``profile/roofline/link`` percentages, as the comparison table prints them."""
    if not share or set(share) - set(SOURCES):  # a plugged model: its name
        return ",".join(sorted(share)) or "-"
    return "/".join(f"{100 * share.get(s, 0.0):.0f}" for s in SOURCES)


def profiled_share(counts: dict[str, int]) -> float:
    n = sum(counts.values())
    return counts.get("profile", 0) / n if n else 0.0


def unlike(
    baseline: tuple[str, Result], others: Sequence[tuple[str, Result]]
) -> list[tuple[Kernel, float, dict[float, list[str]]]]:
    """The kinds of kernel (op class, dtype) that the baseline and some other schedule time
    from the profile in different shares, compute kernels only (communication is the link
    model's everywhere): (kernel, the baseline's share, {another share: the schedules}). Empty:
    every kernel both run is timed as the baseline times it."""
    name, base = baseline
    ref = kernel_sources(base)
    mine = {n: kernel_sources(r) for n, r in others if n != name}
    out = []
    for k, counts in ref.items():
        if set(counts) <= {"link"}:
            continue
        p = profiled_share(counts)
        differ: dict[float, list[str]] = defaultdict(list)
        for n, ks in mine.items():
            if k in ks and abs(profiled_share(ks[k]) - p) > 1e-9:
                differ[profiled_share(ks[k])].append(n)
        if differ:
            out.append((k, p, dict(differ)))
    return out
