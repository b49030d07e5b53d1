"""The per-run event budget (``--max-events``): no input can make a simulation run forever.

An event is one SimPy event the run processes (``env.step``). Streams are driven by callbacks and
timers of one instant share an event (``sim.resources.Timers``), so a run takes about 2-3 events
per instruction and flow on one symmetric rank, and fewer per instruction on explicit ranks in
lockstep, whose kernels end together; the network re-rating at every distinct flow completion
(explicit ranks with skewed routing and no grouping tolerance) takes the most (measured,
DeepSeek-V3 4 layers on H800, EP 8, every schedule: at most 6.3 events per instruction plus flow,
SBO decode with zipf:1.2 routing; 2.0-3.0 on symmetric ranks). One event's callbacks are bounded
by the resources that share it (a few per rank), so the count still bounds the run's work. The
default budget, ``PER_INSTR`` events per instruction plus ``PER_FLOW`` per flow plus
``MIN_EVENTS``, leaves a margin of 3.5 or more over any of those (about 10 over most) yet stops
one that makes no progress (a floating-point timer loop, say) within a bounded time.
"""

from __future__ import annotations

import simpy

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.program import Launch, Program, iter_gpu_instrs

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
    """``env.run()`` that raises SimulationBudgetExceeded after ``max_events`` events."""
    step, peek, end = env.step, env.peek, float("inf")
    for _ in range(max_events):
        if peek() == end:
            return
        step()
    if peek() != end:
        raise SimulationBudgetExceeded(
            f"the simulation needed more than {max_events} events (stopped at {env.now:.6g} µs); "
            "raise --max-events or simulate less"
        )
