"""The per-run event budget (``--max-events``): no input can make a simulation run forever.

An event is one SimPy event the run processes (``env.step``). Streams are driven by callbacks,
timers of one instant share an event (``sim.resources.Timers``) and the block scheduler's passes
run here, between events, with none of their own (``run_budgeted``; each instant's round of passes
counts as one event), so a run takes about 1.1-2.3 events per instruction plus flow on symmetric
ranks, and fewer on explicit ranks in lockstep, whose kernels end together; the network re-rating
at every distinct flow completion (explicit ranks with skewed routing and no grouping tolerance)
takes the most (measured, DeepSeek-V3 4 layers on H800, EP 8, decode b128 and prefill 2x4096,
every schedule: at most 5.4 SimPy events per instruction plus flow, TBO+SBO decode with zipf:1.2
routing; with its rounds of passes the budget counts at most 5.7, what the run took when each pass
had its own event). One event's callbacks are bounded by the resources that share it (a few per rank), so
the count still bounds the run's work. Kernels beside other streams' kernels take more: their
CTAs are cut back to whole waves whenever SMs change hands, so a stream of small kernels beside
large waved ones can take ~130 events per launch, each wave ending at an instant of its own.
The default budget is derived from the Program's structure: ``PER_INSTR`` events per
instruction plus ``PER_FLOW`` per flow plus ``MIN_EVENTS``, which leaves a margin of 3.5 or more
over the schedules above (about 10 over most), plus, on ranks whose kernels run on more than one
stream, ``PER_COHORT`` for each cohort a kernel can run as (at most one per SM's worth of its
CTAs; ``default_max_events``). That bounds what a run can need, yet stops one that makes no
progress (a floating-point timer loop, say) within a bounded time. Programs too large to build
and simulate in reasonable time are refused before this, by their own budget
(``shared.ir.validate.check_build_budget``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import simpy

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.ir.program import Launch, Op, Program, iter_gpu_instrs
from overlap_lab.sim.cost import Grid
from overlap_lab.sim.resources import GRANT_PRIORITY, timers
from overlap_lab.sim.simpy_fast import run_steps

PER_INSTR = 25
PER_FLOW = 2
MIN_EVENTS = 100_000
#: Events per cohort a kernel may run as beside other streams' kernels (its end, and the pass
#: that re-dispatches its CTAs), and per signal it polls.
PER_COHORT = 2


class SimulationBudgetExceeded(ConfigError):
    """The run needed more SimPy events than its budget."""


def default_max_events(
    program: Program,
    num_sms: int | None = None,
    grid: Callable[[Op, int], Grid] | None = None,
    key: Callable[[Op], Hashable] | None = None,
) -> int:
    """The event budget of ``program`` when none is given (see the module docstring):
    ``PER_INSTR`` per instruction and ``PER_FLOW`` per flow, and, with the GPU's ``num_sms`` and
    the cost model's ``grid``, ``PER_COHORT`` per cohort each kernel may run as.

    A kernel alone on its rank's streams runs as one cohort (a run of uniform waves is one
    timer). Beside kernels of other streams its CTAs are cut back to whole waves whenever SMs
    change hands, each wave at least ``ctas_per_sm`` CTAs on one SM, so it runs as at most
    ``ceil(ctas / ctas_per_sm)`` cohorts (one for a coresident kernel), each ending once: the
    bound that lets a stream of small kernels run beside large waved ones, where each small
    kernel's waves (and the large kernel's) can end at instants of their own. ``key``: the cost
    model's ``key`` (ops of equal keys have equal grids: each is asked once)."""
    instrs = flows = cohorts = 0
    counted: dict[tuple, int] = {}  # (key or id of the op, limit) -> its cohorts (ops repeat)
    for rp in program.ranks:
        beside = grid is not None and num_sms is not None and _launching_streams(rp) > 1
        for th in rp.threads:
            for ins in iter_gpu_instrs(th.instrs):
                instrs += 1
                if not isinstance(ins, Launch):
                    continue
                op = ins.op
                if op.coll:
                    flows += len(op.coll.flows)
                if beside:
                    limit = num_sms if op.sms is None else op.sms
                    k = (id(op) if key is None else key(op), limit, len(op.waits))
                    n = counted.get(k)
                    if n is None:
                        g = grid(op, limit)
                        n = 1 if g.kind == "coresident" else -(-g.ctas // g.per_sm)
                        n = counted[k] = n + len(op.waits)
                    cohorts += n
    return MIN_EVENTS + PER_INSTR * instrs + PER_FLOW * flows + PER_COHORT * cohorts


def _launching_streams(rp) -> int:
    """How many streams of the rank launch kernels (one: no kernel ever runs beside another)."""
    streams = {
        ins.stream
        for th in rp.threads
        for ins in iter_gpu_instrs(th.instrs)
        if isinstance(ins, Launch)
    }
    return len(streams)


def run_budgeted(env: simpy.Environment, max_events: int) -> None:
    """``env.run()`` that raises SimulationBudgetExceeded after ``max_events`` events.

    It also runs the block scheduler's passes (``sim.resources.Timers.run_passes``) itself, with
    no SimPy event of their own: once the next queued event is at a later time (or of a lower
    SimPy priority than ``GRANT_PRIORITY``), which is exactly when the pass's event would have
    been processed. Each instant's round of passes counts against the budget as one event, so
    passes that keep requesting passes still stop."""
    t = timers(env)
    t.inline_passes = True
    try:
        done = run_steps(env, max_events, t, GRANT_PRIORITY)
    finally:
        t.inline_passes = False
        if t.passes is not None:  # left for a later ``env.run()``: back to their event
            t.schedule_passes()
    if not done:
        raise SimulationBudgetExceeded(
            f"the simulation needed more than {max_events} events (stopped at {env.now:.6g} µs); "
            "raise --max-events or simulate less"
        )
