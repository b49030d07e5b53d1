"""Host-thread issue order: the one rule both interpreters and the validator walk a rank by.

One host thread of a rank runs at a time; ``Yield`` hands control to the next thread that has
instructions left (round robin), and a thread that runs out hands over too. The simulator
(``sim/engine.py``), the real executor (``real/runner.py``) and the validator
(``shared/ir/validate.py``) all take the order from :func:`issue_order`, so a rule about
"instructions before this one" means the same in each.
"""

from __future__ import annotations

from dataclasses import dataclass

from overlap_lab.shared.ir.program import Instr, RankProgram, Yield


@dataclass(frozen=True)
class Issued:
    """One instruction in issue order: where it comes from and what it is."""

    rank: int
    thread: str
    index: int  # position in the thread's instruction list
    instr: Instr


def issue_order(rp: RankProgram) -> list[Issued]:
    """The rank's host instructions in the order they are issued (``Yield`` included, where it
    hands over)."""
    pos = [0] * len(rp.threads)
    out: list[Issued] = []
    live = [i for i, th in enumerate(rp.threads) if th.instrs]
    cur = 0
    while live:
        ti = live[cur % len(live)]
        th = rp.threads[ti]
        yielded = False
        while pos[ti] < len(th.instrs):
            ins = th.instrs[pos[ti]]
            out.append(Issued(rp.rank, th.name, pos[ti], ins))
            pos[ti] += 1
            if isinstance(ins, Yield):
                yielded = True
                break
        if pos[ti] >= len(th.instrs):
            live.remove(ti)
            if live:
                cur = cur % len(live)
        elif yielded:
            cur = (live.index(ti) + 1) % len(live)
    return out
