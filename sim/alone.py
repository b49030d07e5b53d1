"""A kernel alone on an idle GPU, timed in closed form: what ``sim.resources.Gpu`` gives it,
without the events it takes there.

On a rank whose kernels all run on one stream, each kernel reaches an idle GPU (the stream's
previous kernel has ended) and no other kernel comes while it runs. The block scheduler then
has nothing to decide: the kernel's CTAs take the SMs they can, run their whole waves, then the
last partial wave, and the kernel ends no earlier than its time alone (``Gpu.solo_us``). The
Gpu spends a pass, a timer per cohort and, on a replayed graph, the gap's timer on that; the
engine (``Engine(alone=True)``, the default) instead times such a *plain* kernel here, with no
collective, no signal it polls and SMs to hold, and spends one timer at its end.

Nothing is approximated: every float is computed as the Gpu computes it, from the same cached
rates (``Gpu.solo_rate``, ``Gpu.solo_us``), in the same order, including the instants SimPy
computes for the Gpu's timers (``now + delay``). ``tests/test_alone.py`` checks the timeline
against the Gpu's, bit for bit, over every grid kind, wave count and SM limit.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from overlap_lab.shared.ir.program import Op
from overlap_lab.sim.resources import _TIME_EPS, Gpu, Kernel

#: The grid kinds timed here (a dynamic persistent kernel's late CTAs and a hook's missing ones
#: stay with the Gpu).
KINDS = ("waved", "persistent", "coresident")


class Alone(NamedTuple):
    """What a plain kernel does alone, whenever it starts: a first cohort of ``waves`` whole
    waves on ``sms`` SMs at ``rate`` waves per µs, then, where CTAs are left, one partial wave on
    ``last_sms`` SMs at ``last_rate``; its time alone ``solo_us`` (None: it moves no work, so no
    floor holds it)."""

    sms: int
    waves: float
    rate: float
    last_sms: int
    last_rate: float
    solo_us: float | None


def plan(gpu: Gpu, op: Op, limit: int) -> Alone | None:
    """``op``'s cohorts alone on an idle ``gpu`` when it may hold ``limit`` SMs, as the Gpu's
    pass dispatches them (``Gpu._dispatch``); None where the Gpu must time it (not a plain
    kernel, or a grid kind not in ``KINDS``)."""
    if op.coll is not None or op.waits or op.kind == "copy":
        return None
    cache = gpu.cache
    k = Kernel(op, limit)
    numbers = cache.numbers
    k.ckey = ck = numbers.setdefault(gpu.model.key(op), len(numbers))  # as ``Gpu.acquire``
    g = cache.grids.get((ck, limit))
    if g is None:
        g = cache.grids[(ck, limit)] = gpu.model.grid(op, limit)
    k.grid = g
    free = gpu.gpu.num_sms
    if g.ctas == 0 or g.kind not in KINDS or min(limit, free) <= 0:
        return None
    last_sms = last_wave = 0
    if g.kind == "coresident":  # every CTA resident at once (the validator bounds its SMs)
        sms = g.sms_needed
        if sms > free:  # (never all resident: the Gpu reports the stall)
            return None
        per_wave, waves = g.ctas, 1
    else:
        sms = min(limit, math.ceil(g.ctas / g.per_sm), free)
        slots = sms * g.per_sm
        if g.ctas >= slots:
            per_wave, waves = slots, g.ctas // slots
            last_wave = g.ctas - waves * slots  # dispatched once the whole waves are done
            if last_wave:
                last_sms = min(limit, math.ceil(last_wave / g.per_sm), free)
        else:
            per_wave, waves = g.ctas, 1
    rate = gpu.solo_rate(k, sms, per_wave)
    last_rate = gpu.solo_rate(k, last_sms, last_wave) if last_wave else 0.0
    solo = gpu.solo_us(k) if op.flops or op.hbm_bytes else None
    return Alone(sms, float(waves), rate, last_sms, last_rate, solo)


def timeline(a: Alone, t0: float) -> tuple[list[tuple[float, int]], float]:
    """The kernel's segments (``Kernel.segments``: (start, SMs) each time its SMs change) and
    its end, when it reaches the idle GPU at ``t0``: the Gpu's arithmetic, step by step."""
    segs = [(t0, a.sms)]
    # the cohort's timer (``Fluid._settle``): its end, the delay to it, the instant SimPy makes
    delay = (t0 + a.waves / a.rate) - t0
    t = t0 + (delay if delay > 0.0 else 0.0)
    if a.last_sms:  # the pass at ``t`` dispatches the last wave (``Gpu._grant``)
        if segs[-1][0] == t:
            segs.pop()
        if not segs or segs[-1][1] != a.last_sms:
            segs.append((t, a.last_sms))
        delay = (t + 1.0 / a.last_rate) - t
        t = t + (delay if delay > 0.0 else 0.0)
    if a.solo_us is not None:  # held to its time alone (``Gpu._finish``)
        rest = t0 + a.solo_us - t
        if rest > _TIME_EPS:
            if segs and segs[-1][0] == t:
                segs.pop()
            segs.append((t, 0))
            t = t + rest
    return segs, t
