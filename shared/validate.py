"""Validation of a Program before any interpreter runs it.

Rules (each error names the rank, host thread and instruction, marked ``<-- ERROR HERE``):
unknown-stream, unknown-kind, bad-sms (SM demand above the GPU or negative), duplicate-record,
never-recorded (an event waited on or synced on but never recorded), orphan-completion (a
collective's completion half without its issue half), bad-flow, and cycle (a wait, sync or
collective that can never be satisfied because what it waits for comes after it).

The cycle rule makes every valid Program finish: the dependency graph below is acyclic, so both
interpreters can always make progress (the simulator still reports a stall, should resource
contention ever stop it, instead of hanging).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.program import (
    GRIDS,
    LINK_KINDS,
    OP_KINDS,
    ROLES,
    Graph,
    Host,
    Instr,
    Launch,
    Program,
    RankProgram,
    Record,
    Sync,
    Wait,
    WaitStream,
    Yield,
    _instr_text,
)


class ProgramError(ConfigError):
    """A Program that no interpreter may run; the message points at the faulty instruction."""


@dataclass(frozen=True)
class Issued:
    """One instruction in issue order: where it comes from and what it is."""

    rank: int
    thread: str
    index: int  # position in the thread's instruction list
    instr: Instr


def issue_order(rp: RankProgram) -> list[Issued]:
    """The rank's host instructions in the order they are issued.

    One host thread runs at a time; ``Yield`` hands control to the next thread that has
    instructions left (round robin); a finished thread hands over too.
    """
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


def _where(it: Issued, rp: RankProgram, why: str) -> str:
    th = next(t for t in rp.threads if t.name == it.thread)
    lo = max(0, it.index - 2)
    lines = []
    for k in range(lo, min(len(th.instrs), it.index + 2)):
        text = _instr_text(th.instrs[k], "    ")[0]
        lines.append(text + ("   <-- ERROR HERE" if k == it.index else ""))
    head = f"rank {it.rank}, thread {it.thread}, instruction {it.index}: {why}"
    return head + "\n" + "\n".join(lines)


def _gpu_parts(ins: Instr):
    return ins.body if isinstance(ins, Graph) else (ins,)


def validate(program: Program, num_sms: int | None = None) -> None:
    """Raise ProgramError naming the first faulty instruction; return None if the Program is sound."""
    if not program.ranks:
        raise ProgramError("the program has no ranks")
    sends: dict[str, list[int]] = defaultdict(list)  # key -> ranks issuing it
    for rp in program.ranks:
        for it in issue_order(rp):
            for ins in _gpu_parts(it.instr):
                if isinstance(ins, Launch) and ins.op.coll and ins.op.coll.role != "recv":
                    sends[ins.op.coll.key].append(rp.rank)
    for rp in program.ranks:
        _check_rank(program, rp, num_sms, sends)
    _check_cycles(program)


def _check_rank(program: Program, rp: RankProgram, num_sms, sends) -> None:
    streams = set(rp.streams)
    for s, _ in rp.priorities:
        if s not in streams:
            raise ProgramError(f"rank {rp.rank}: priority given for unknown stream {s!r}")
    order = issue_order(rp)
    recorded: dict[str, Issued] = {}
    for it in order:
        for ins in _gpu_parts(it.instr):
            if isinstance(ins, Record):
                if ins.event in recorded:
                    raise ProgramError(_where(it, rp, f"event {ins.event!r} recorded twice"))
                recorded[ins.event] = it
    for it in order:
        for ins in _gpu_parts(it.instr):
            for s in _streams_of(ins):
                if s not in streams:
                    raise ProgramError(_where(it, rp, f"unknown stream {s!r}"))
            if isinstance(ins, (Wait, Sync)) and ins.event not in recorded:
                raise ProgramError(_where(it, rp, f"event {ins.event!r} is never recorded"))
            if isinstance(ins, Launch):
                for ev in ins.op.waits:
                    if ev not in recorded:
                        raise ProgramError(_where(it, rp, f"signal {ev!r} is never recorded"))
            if isinstance(ins, Launch):
                _check_op(it, rp, ins, num_sms, sends, program)
        if isinstance(it.instr, Host) and it.instr.us < 0:
            raise ProgramError(_where(it, rp, "negative host time"))


def _streams_of(ins: Instr) -> tuple[str, ...]:
    if isinstance(ins, (Launch, Record, Wait)):
        return (ins.stream,)
    if isinstance(ins, WaitStream):
        return (ins.stream, ins.other)
    return ()


def _check_op(it: Issued, rp: RankProgram, ins: Launch, num_sms, sends, program) -> None:
    op = ins.op
    if op.kind not in OP_KINDS:
        raise ProgramError(_where(it, rp, f"unknown op kind {op.kind!r}"))
    if op.sms is not None and op.sms < 0:
        raise ProgramError(_where(it, rp, f"negative SM demand {op.sms}"))
    if num_sms is not None and op.sms is not None and op.sms > num_sms:
        raise ProgramError(
            _where(it, rp, f"{op.name} asks for {op.sms} SMs but the GPU has {num_sms}")
        )
    if op.flops < 0 or op.hbm_bytes < 0:
        raise ProgramError(_where(it, rp, "negative work"))
    if op.grid is not None and op.grid not in GRIDS:
        raise ProgramError(_where(it, rp, f"unknown grid {op.grid!r}; expected one of {GRIDS}"))
    for f in ("ctas", "ctas_per_sm"):
        if getattr(op, f) is not None and getattr(op, f) < 1:
            raise ProgramError(_where(it, rp, f"{f} must be at least 1, got {getattr(op, f)}"))
    c = op.coll
    if c is None:
        return
    if c.role not in ROLES:
        raise ProgramError(_where(it, rp, f"unknown collective role {c.role!r}"))
    for f in c.flows:
        if f.link not in LINK_KINDS or f.nbytes < 0:
            raise ProgramError(_where(it, rp, f"bad flow {f}"))
        if f.dst is not None and f.dst not in {r.rank for r in program.ranks}:
            raise ProgramError(_where(it, rp, f"flow to unknown rank {f.dst}"))
    if c.role == "recv" and c.key not in sends:
        raise ProgramError(
            _where(it, rp, f"completion of collective {c.key!r} without its issue half")
        )


def _check_cycles(program: Program) -> None:
    """Kahn's algorithm over the dependency graph of issue and completion nodes."""
    succ: dict[tuple, list[tuple]] = defaultdict(list)
    indeg: dict[tuple, int] = defaultdict(int)
    info: dict[tuple, tuple[Issued, RankProgram]] = {}

    def edge(a, b):
        succ[a].append(b)
        indeg[b] += 1
        indeg.setdefault(a, 0)

    completions_of_key: dict[str, list[tuple]] = defaultdict(list)
    recvs: list[tuple[tuple, str, int]] = []
    flow_srcs: dict[tuple[str, int], list[tuple]] = defaultdict(list)
    for rp in program.ranks:
        record_node: dict[str, tuple] = {}
        last_on: dict[str, tuple] = {}
        prev_host = None
        pending: list[tuple[tuple, str]] = []  # (node, event) waits resolved after the pass
        for n, it in enumerate(issue_order(rp)):
            h = ("h", rp.rank, n)
            info[h] = (it, rp)
            indeg.setdefault(h, 0)
            if prev_host is not None:
                edge(prev_host, h)
            prev_host = h
            if isinstance(it.instr, Sync):
                pending.append((h, it.instr.event))
            for k, ins in enumerate(_gpu_parts(it.instr)):
                g = ("g", rp.rank, n, k)
                info[g] = (it, rp)
                edge(h, g)
                if isinstance(ins, WaitStream):
                    if ins.other in last_on:
                        edge(last_on[ins.other], g)
                    stream = ins.stream
                else:
                    stream = getattr(ins, "stream", None)
                if stream is None:
                    continue
                if stream in last_on:
                    edge(last_on[stream], g)
                last_on[stream] = g
                if isinstance(ins, Record):
                    record_node[ins.event] = g
                elif isinstance(ins, Wait):
                    pending.append((g, ins.event))
                if isinstance(ins, Launch):
                    pending += [(g, ev) for ev in ins.op.waits]
                if isinstance(ins, Launch) and ins.op.coll is not None:
                    c = ins.op.coll
                    if c.role != "recv":
                        completions_of_key[c.key].append(g)
                        for f in c.flows:
                            dst = rp.rank if f.dst is None else f.dst
                            flow_srcs[(c.key, dst)].append(g)
                    if c.role != "send":
                        recvs.append((g, c.key, rp.rank))
        for node, ev in pending:
            if ev in record_node:
                edge(record_node[ev], node)
    for g, key, rank in recvs:
        for src in flow_srcs.get((key, rank), []):
            if src != g:
                edge(src, g)
    queue = [n for n, d in indeg.items() if d == 0]
    seen = 0
    while queue:
        n = queue.pop()
        seen += 1
        for m in succ.get(n, ()):
            indeg[m] -= 1
            if indeg[m] == 0:
                queue.append(m)
    if seen < len(indeg):
        stuck = sorted((n for n, d in indeg.items() if d > 0), key=lambda n: (n[1], n[2]))
        it, rp = info[stuck[0]]
        raise ProgramError(
            _where(it, rp, "wait cycle: this instruction waits on work that can only come after it")
        )
