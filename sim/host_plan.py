"""The host's steps of one rank, in issue order, with the position of every instruction.

``sim.engine`` walks them (one host process per rank); ``sim.repeats`` and ``sim.fastforward``
read the positions: the block scheduler breaks ties between kernels by them, and the
fast-forward finds repeated blocks and cuts by them.
"""

from __future__ import annotations

from overlap_lab.shared.ir.program import Graph, Host, Launch, RankProgram, Sync, Yield
from overlap_lab.shared.ir.validate import issue_order

#: What a host step does (``host_plan``): launch a kernel or a graph (pays the launch cost, then
#: enqueues its parts), enqueue a record or wait, run host work, block on an event, or yield.
LAUNCH, ENQUEUE, HOST, SYNC, YIELD = range(5)


def host_plan(rp: RankProgram) -> list[tuple]:
    """The rank's host steps in issue order (``shared.ir.validate.issue_order``), each
    ``(code, instruction, lane, position, parts, (thread, index))``: ``parts`` are the
    ``(position, GPU instruction)`` pairs a launch enqueues. Positions number every instruction
    and every graph body entry in issue order (a graph's own position, then its body's): the
    rank's issue order, which the block scheduler's ties and the fast-forward read."""
    plan, pos = [], 0
    if len(rp.threads) == 1:  # one thread issues its instructions in order
        th = rp.threads[0]
        order = ((th.name, i, ins) for i, ins in enumerate(th.instrs))
    else:
        order = ((it.thread, it.index, it.instr) for it in issue_order(rp))
    lanes = {th.name: f"host:{th.name}" for th in rp.threads}
    for thread, index, ins in order:
        lane, where = lanes[thread], (thread, index)
        t = type(ins)
        if t is Launch:
            plan.append((LAUNCH, ins, lane, pos, ((pos, ins),), where))
        elif t is Graph:
            parts = tuple((pos + 1 + i, part) for i, part in enumerate(ins.body))
            plan.append((LAUNCH, ins, lane, pos, parts, where))
            pos += len(parts)
        elif t is Host:
            plan.append((HOST, ins, lane, pos, (), where))
        elif t is Sync:
            plan.append((SYNC, ins, lane, pos, (), where))
        elif t is Yield:
            plan.append((YIELD, ins, lane, pos, (), where))
        else:  # Record, Wait, WaitStream
            plan.append((ENQUEUE, ins, lane, pos, ((pos, ins),), where))
        pos += 1
    return plan
