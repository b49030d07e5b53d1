"""Lowering passes every schedule's Program goes through: list-to-list functions.

``host_wait_for_counts``: DeepEP's normal dispatch without a cached handle first runs a notify
kernel that exchanges the received-token counts, and the CPU busy-waits on them
(``moe_recv_counter``) to size the receive buffers before it launches the dispatch kernel
(DeepEP ``Buffer.dispatch`` → ``get_dispatch_layout``/``notify_dispatch``). The host can thus not
run ahead of the GPU past such a dispatch: before each launch of a normal-kernel ``dispatch_a``
(role ``sendrecv``) outside a CUDA graph, the host records an event on the dispatch's stream and
syncs on it. Schedules that already emit that sync (LightLLM's ``normal_comm``) are left alone.
"""

from __future__ import annotations

from dataclasses import replace

from overlap_lab.shared.ir.program import Instr, Launch, Program, Record, Sync, Wait


def _needs_count_wait(ins: Instr) -> bool:
    return (
        isinstance(ins, Launch)
        and ins.op.name == "dispatch_a"
        and ins.op.coll is not None
        and ins.op.coll.role == "sendrecv"
    )


def host_wait_for_counts(program: Program) -> Program:
    """Insert ``record + sync`` before every uncaptured normal-mode ``dispatch_a`` (see module)."""
    ranks = []
    for rp in program.ranks:
        threads = []
        for th in rp.threads:
            out: list[Instr] = []
            for ins in th.instrs:
                if _needs_count_wait(ins) and not _synced_just_before(out, ins.stream):
                    ev = f"{ins.op.coll.key}.counts"
                    out += [Record(ev, ins.stream), Sync(ev)]
                out.append(ins)
            threads.append(replace(th, instrs=tuple(out)))
        ranks.append(replace(rp, threads=tuple(threads)))
    return replace(program, ranks=tuple(ranks))


def _synced_just_before(out: list[Instr], stream: str) -> bool:
    """Whether the schedule already synced the host just before this dispatch (only waits on
    ``stream`` may stand between the sync and the launch)."""
    for ins in reversed(out):
        if isinstance(ins, Sync):
            return True
        if not (isinstance(ins, Wait) and ins.stream == stream):
            return False
    return False
