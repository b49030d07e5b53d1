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
the count still bounds the run's work. The default budget, ``PER_INSTR`` events per instruction
plus ``PER_FLOW`` per flow plus ``MIN_EVENTS``, leaves a margin of 3.5 or more over any of those
(about 10 over most) yet stops one that makes no progress (a floating-point timer loop, say)
within a bounded time.
"""

from __future__ import annotations

import simpy

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.program import Launch, Program, iter_gpu_instrs
from overlap_lab.sim.resources import GRANT_PRIORITY, timers
from overlap_lab.sim.simpy_fast import run_steps

PER_INSTR = 25
PER_FLOW = 2
MIN_EVENTS = 100_000


class SimulationBudgetExceeded(ConfigError):
    """The run needed more SimPy events than its budget."""


def default_max_events(program: Program) -> int:
    """The event budget of ``program`` when none is given (see the module docstring)."""
    instrs = flows = 0
    for rp in program.ranks:
        for th in rp.threads:
            for ins in iter_gpu_instrs(th.instrs):
                instrs += 1
                if isinstance(ins, Launch) and ins.op.coll:
                    flows += len(ins.op.coll.flows)
    return MIN_EVENTS + PER_INSTR * instrs + PER_FLOW * flows


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
