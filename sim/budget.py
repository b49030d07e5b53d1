"""The per-run event budget (``--max-events``): no input can make a simulation run forever.

A run takes about 5 SimPy events per launch and flow (a full DeepSeek-V3 decode step with all 32
EP ranks explicit: 276K events), so the default budget, ``EVENTS_PER_ITEM`` events per
instruction and flow of the Program plus ``MIN_EVENTS``, leaves a wide margin for any sound
Program yet stops one that makes no progress (a floating-point timer loop, say) soon after.
"""

from __future__ import annotations

import simpy

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.program import Launch, Program, iter_gpu_instrs

EVENTS_PER_ITEM = 50
MIN_EVENTS = 100_000


class SimulationBudgetExceeded(ConfigError):
    """The run needed more SimPy events than its budget."""


def default_max_events(program: Program) -> int:
    """The event budget of ``program`` when none is given (see the module docstring)."""
    items = 0
    for rp in program.ranks:
        for th in rp.threads:
            for ins in iter_gpu_instrs(th.instrs):
                coll = ins.op.coll if isinstance(ins, Launch) else None
                items += 1 + (len(coll.flows) if coll else 0)
    return MIN_EVENTS + EVENTS_PER_ITEM * items


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
