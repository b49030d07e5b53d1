"""The per-run event budget (``--max-events``): no input can make a simulation run forever.

A run takes about 6 SimPy events per instruction and up to 1.5 per flow (measured: TBO, 8 layers,
EP 32 explicit with zipf routing, 41K events for 6.7K instructions and 28K flows; sglang-overlap
at EP 64, 181K for 32K and 222K). The default budget, ``PER_INSTR`` events per instruction plus
``PER_FLOW`` per flow plus ``MIN_EVENTS``, leaves a margin of about 7 over any sound Program yet
stops one that makes no progress (a floating-point timer loop, say) within a bounded time.
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
