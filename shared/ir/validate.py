"""Validation of a Program before any interpreter runs it.

Every rule is listed, with its reason, in ``docs/program.md`` ("Validation rules"). Each error
names the rank, host thread and instruction (and, inside a graph, the body position), and shows
the instruction marked ``<-- ERROR HERE``; an error in a declaration (the Program's header line,
a rank's or a thread's) shows that line marked.

The rules make every valid Program finish: the dependency graph of issue and completion halves
is acyclic (a collective's send half starts at the op's start, its completion half waits for the
data at the op's end), no op waiting for data can hold the SMs a same-rank send needs to start,
and all work is finite and bounded, so both interpreters can always make progress. The simulator
still reports a stall (and a run past its event budget) as a clear error rather than hanging.
"""

from __future__ import annotations

import weakref
from collections import Counter, defaultdict
from itertools import chain

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.ir.issue import Issued, issue_order
from overlap_lab.shared.ir.program import (
    DEFAULT_PRIORITY,
    DTYPES,
    GRIDS,
    MAX_HOST_US,
    MAX_RANKS,
    MAX_WORK,
    NET_LINK_KINDS,
    OP_CLASSES,
    Graph,
    Host,
    Instr,
    Launch,
    Op,
    Program,
    RankProgram,
    Record,
    Sync,
    Wait,
    WaitStream,
    _instr_text,
)
from overlap_lab.shared.ir.program_meta import ProgramMeta
from overlap_lab.shared.ir.starvation import (
    ValidationWork,
    coresident,
    per_sm,
    resident_sms,
    starvation_fault,
)
from overlap_lab.shared.outputs.trace import no_gc


class ProgramError(ConfigError):
    """A Program that no interpreter may run; the message points at the faulty instruction."""


class BuildBudgetExceeded(ConfigError):
    """A Program larger than building and simulating one may take (``check_build_budget``)."""


#: The most GPU items (launches, records, waits, inside graphs too) plus host instructions a
#: Program may hold by default. Validating and simulating cost about linearly in them (a run
#: takes a few to ~100 SimPy events and a few hundred bytes of trace each): the largest
#: Programs the schedules emit for realistic cases (DeepSeek-V3, 61 layers, TBO+SBO at 4,096
#: tokens per rank: ~61,500 instructions; explicit ranks: that per rank) stay well within it,
#: and SBO at 65,536 decode tokens (8,192 down-GEMM launches per layer, ~950,000 instructions,
#: minutes and gigabytes to simulate) is refused at once.
MAX_INSTRUCTIONS = 600_000


def count_instructions(program: Program) -> int:
    """Host instructions plus the GPU items of every graph body (``check_build_budget``)."""
    n = 0
    for rp in program.ranks:
        for th in rp.threads:
            for ins in th.instrs:
                n += len(ins.body) if isinstance(ins, Graph) else 1
    return n


def check_build_budget(program: Program, max_instructions: int | None = None) -> None:
    """Raise BuildBudgetExceeded (one line, as ``--max-events`` does) when ``program`` holds more
    than ``max_instructions`` instructions (default ``MAX_INSTRUCTIONS``): the budget of building
    a Program, checked before any rule that walks it."""
    budget = MAX_INSTRUCTIONS if max_instructions is None else max_instructions
    n = count_instructions(program)
    if n > budget:
        raise BuildBudgetExceeded(
            f"the Program has {n} instructions, more than its build budget of {budget}; "
            "simulate less (fewer layers, a smaller batch or fewer explicit ranks)"
        )


def _where(it: Issued, rp: RankProgram, why: str, part: int | None = None) -> str:
    """The error text: where, why, and the instruction (or graph body entry) marked."""
    th = next(t for t in rp.threads if t.name == it.thread)
    if part is not None and isinstance(it.instr, Graph):
        body = it.instr.body
        head = (
            f"rank {it.rank}, thread {it.thread}, instruction {it.index} "
            f"(graph {it.instr.name}, body instruction {part}): {why}"
        )
        lo = max(0, part - 2)
        lines = [f"    graph {it.instr.name} {{"]
        for k in range(lo, min(len(body), part + 2)):
            text = _instr_text(body[k], "      ")[0]
            lines.append(text + ("   <-- ERROR HERE" if k == part else ""))
        return head + "\n" + "\n".join(lines)
    lo = max(0, it.index - 2)
    lines = []
    for k in range(lo, min(len(th.instrs), it.index + 2)):
        text = _instr_text(th.instrs[k], "    ")[0]
        lines.append(text + ("   <-- ERROR HERE" if k == it.index else ""))
    head = f"rank {it.rank}, thread {it.thread}, instruction {it.index}: {why}"
    return head + "\n" + "\n".join(lines)


def _gpu_parts(ins: Instr):
    return ins.body if isinstance(ins, Graph) else (ins,)


def _parts(it: Issued):
    """(body position or None, instruction) for the GPU parts of one issued instruction."""
    if isinstance(it.instr, Graph):
        return list(enumerate(it.instr.body))
    return [(None, it.instr)]


def validate(
    program: Program,
    num_sms: int | None = None,
    max_instructions: int | None = None,
    work: ValidationWork | None = None,
) -> None:
    """Raise ProgramError naming the first faulty instruction; return None if the Program is sound.
    A Program above its build budget (``max_instructions``, ``check_build_budget``) is refused
    first, with BuildBudgetExceeded.

    ``num_sms`` (the GPU's) enables the rules that need it: SM demands within the GPU and no
    receiving op starving a same-rank send of SMs.

    A Program found sound is remembered by identity (with ``num_sms``) while it lives: Programs
    and everything in them are frozen, so the verdict cannot go stale, and a Program validated
    by its builder and again by the simulator is walked once. ``work``, when given, counts what
    the walk visits (it is then walked even if remembered).
    """
    key = (id(program), num_sms)
    ref = _SOUND.get(key)
    if ref is not None and ref() is program and work is None:
        return
    check_build_budget(program, max_instructions)
    with no_gc():  # a few objects per node of the graph: collections would walk the Program
        _validate(program, num_sms, work)
    try:
        _SOUND[key] = weakref.ref(program, lambda _r, k=key: _SOUND.pop(k, None))
    except TypeError:  # not weakly referenceable (a Program subclass with slots): not cached
        pass


#: (id(program), num_sms) -> a weak reference to a Program ``validate`` found sound
_SOUND: dict[tuple[int, int | None], weakref.ref] = {}


def _validate(program: Program, num_sms: int | None, work: ValidationWork | None = None) -> None:
    _check_program(program)
    orders = {rp.rank: issue_order(rp) for rp in program.ranks}
    sends: dict[str, list[int]] = defaultdict(list)  # key -> ranks issuing it
    for rp in program.ranks:
        for it in orders[rp.rank]:
            for ins in _gpu_parts(it.instr):
                if isinstance(ins, Launch) and ins.op.coll and ins.op.coll.role != "recv":
                    sends[ins.op.coll.key].append(rp.rank)
    rank_ids = frozenset(rp.rank for rp in program.ranks)
    faults: dict[int, str | None] = {}  # id(op) -> _op_fault: explicit ranks share most ops
    flow_faults: dict[int, str | None] = {}  # id(flows) -> _flows_fault, likewise
    for rp in program.ranks:
        _check_rank(rp, orders[rp.rank], num_sms, sends, rank_ids, faults, flow_faults)
    _check_cycles(program, orders, num_sms, work)


def _declared(why: str, lines: list[str], marked: int) -> str:
    """The error text of a declaration (the Program's header, a rank's or a thread's line): why,
    and the lines as ``show`` prints them, ``marked`` marked."""
    shown = [t + ("   <-- ERROR HERE" if k == marked else "") for k, t in enumerate(lines)]
    return why + "\n" + "\n".join(shown)


def _header(program: Program) -> str:
    sym = program.symmetric
    shown = str(sym).lower() if isinstance(sym, bool) else repr(sym)
    return f"program world={program.world!r} symmetric={shown}"


def _rank_line(rp: RankProgram) -> str:
    prio = dict(rp.priorities)
    decl = ",".join(f"{s}@{prio[s]}" if prio.get(s, 0) != 0 else s for s in rp.streams)
    return f"rank {rp.rank!r} streams={decl}"


def _check_program(program: Program) -> None:
    head = _header(program)

    def program_fault(why: str) -> ProgramError:
        return ProgramError(_declared(why, [head], 0))

    if not isinstance(program.meta, ProgramMeta):
        raise program_fault(f"meta must be a ProgramMeta, got {type(program.meta).__name__}")
    if fault := program.meta.fault():
        raise program_fault(f"meta: {fault}")
    if not program.ranks:
        raise program_fault("the program has no ranks")
    w = program.world
    if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= MAX_RANKS:
        raise program_fault(f"world must be an integer in 1..{MAX_RANKS}, got {w!r}")
    if not isinstance(program.symmetric, bool):
        raise program_fault(f"symmetric must be true or false, got {program.symmetric!r}")
    seen: set[int] = set()
    for rp in program.ranks:

        def rank_fault(why: str, rp=rp) -> ProgramError:
            return ProgramError(_declared(why, [head, _rank_line(rp)], 1))

        if isinstance(rp.rank, bool) or not isinstance(rp.rank, int) or not 0 <= rp.rank < w:
            raise rank_fault(f"rank {rp.rank!r} outside 0..{w - 1} (world={w})")
        if rp.rank in seen:
            raise rank_fault(f"rank {rp.rank} appears twice")
        seen.add(rp.rank)
        if len(set(rp.streams)) != len(rp.streams):
            raise rank_fault(f"rank {rp.rank}: a stream is declared twice in {rp.streams}")
        for s, _ in rp.priorities:
            if s not in rp.streams:
                raise rank_fault(f"rank {rp.rank}: priority given for unknown stream {s!r}")
        names = [th.name for th in rp.threads]
        for i, n in enumerate(names):
            if n in names[:i]:
                why = f"rank {rp.rank}: thread {n!r} is declared twice"
                raise ProgramError(_declared(why, [_rank_line(rp), f"  thread {n}"], 1))


def _check_rank(rp: RankProgram, order, num_sms, sends, rank_ids, faults, flow_faults) -> None:
    streams = set(rp.streams)
    recorded: dict[str, Issued] = {}
    for it in order:
        if isinstance(it.instr, Graph):
            for k, ins in enumerate(it.instr.body):
                if not isinstance(ins, (Launch, Record, Wait, WaitStream)):
                    what = type(ins).__name__.lower()
                    raise ProgramError(
                        _where(
                            it,
                            rp,
                            f"{what} cannot be captured in a graph (launch, record, "
                            "wait and wait_stream only)",
                            k,
                        )
                    )
        for k, ins in _parts(it):
            if isinstance(ins, Record):
                if ins.event in recorded:
                    raise ProgramError(_where(it, rp, f"event {ins.event!r} recorded twice", k))
                recorded[ins.event] = it
    for it in order:
        for k, ins in _parts(it):
            for s in _streams_of(ins):
                if s not in streams:
                    raise ProgramError(_where(it, rp, f"unknown stream {s!r}", k))
            if isinstance(ins, (Wait, Sync)) and ins.event not in recorded:
                raise ProgramError(_where(it, rp, f"event {ins.event!r} is never recorded", k))
            if isinstance(ins, Launch):
                op = ins.op
                why = faults.get(id(op), False)
                if why is False:  # the program holds op, so its id stays its own
                    why = faults[id(op)] = _op_fault(op, num_sms, sends, rank_ids, flow_faults)
                if why:
                    raise ProgramError(_where(it, rp, why, k))
                for ev in ins.op.waits:
                    if ev not in recorded:
                        raise ProgramError(_where(it, rp, f"signal {ev!r} is never recorded", k))
        if isinstance(it.instr, Host):
            us = it.instr.us
            if not (isinstance(us, (int, float)) and 0 <= us <= MAX_HOST_US):
                raise ProgramError(
                    _where(
                        it, rp, f"host time must be a number in 0..{MAX_HOST_US:g} µs, got {us!r}"
                    )
                )


def _streams_of(ins: Instr) -> tuple[str, ...]:
    if isinstance(ins, (Launch, Record, Wait)):
        return (ins.stream,)
    if isinstance(ins, WaitStream):
        return (ins.stream, ins.other)
    return ()


def _finite_work(v) -> bool:
    return type(v) in (float, int) and 0 <= v <= MAX_WORK  # NaN fails both comparisons


def _op_fault(op: Op, num_sms, sends, rank_ids, flow_faults: dict | None = None) -> str | None:
    """Why the op cannot run, or None."""
    if op.dtype not in DTYPES:
        return f"unknown dtype {op.dtype!r}; expected one of {', '.join(DTYPES)}"
    if op.op_class not in OP_CLASSES:
        return f"unknown op class {op.op_class!r}; expected one of {', '.join(OP_CLASSES)}"
    if op.sms is not None and op.sms < 0:
        return f"negative SM demand {op.sms}"
    if num_sms is not None and op.sms is not None and op.sms > num_sms:
        return f"{op.name} asks for {op.sms} SMs but the GPU has {num_sms}"
    if op.tokens < 0:
        return f"negative token count {op.tokens}"
    if not (_finite_work(op.flops) and _finite_work(op.hbm_bytes)):
        return f"work (flops, hbm_bytes) must be finite numbers in 0..{MAX_WORK:g}"
    if op.grid is not None and op.grid not in GRIDS:
        return f"unknown grid {op.grid!r}; expected one of {', '.join(GRIDS)}"
    for f in ("ctas", "ctas_per_sm"):
        v = getattr(op, f)
        if v is not None and v < 1:
            return f"{f} must be at least 1, got {v}"
    if coresident(op) and op.ctas is not None:
        # all CTAs of a coresident kernel are resident at once, on at most ``sms`` SMs
        need = resident_sms(op)
        if op.sms == 0:
            return f"{op.name} has ctas={op.ctas} but sms=0 (a hook runs no CTAs)"
        if op.sms is not None and need > op.sms:
            return (
                f"{op.name} needs {need} SMs for its {op.ctas} coresident CTAs "
                f"({per_sm(op)} per SM) but sms={op.sms}"
            )
        if num_sms is not None and need > num_sms:
            return (
                f"{op.name} needs {need} SMs for its {op.ctas} coresident CTAs "
                f"({per_sm(op)} per SM) but the GPU has {num_sms}"
            )
    c = op.coll
    if c is None:
        return None
    if op.kind == "copy":
        return "a copy op cannot take part in a collective (copies move bytes over PCIe only)"
    if c.role == "recv" and c.flows:
        return "a recv op carries no flows (its senders do)"
    why = _flows_fault(c.flows, rank_ids, flow_faults)
    if why:
        return why
    if c.role == "recv" and c.key not in sends:
        return f"completion of collective {c.key!r} without its issue half"
    return None


def _flows_fault(flows: tuple, rank_ids, memo: dict | None) -> str | None:
    """Why these flows of one op cannot be sent, or None (``memo``: by id of the tuple, which
    explicit ranks share among their ops)."""
    if memo is not None:
        why = memo.get(id(flows), False)
        if why is False:  # the op holds flows, so the id stays theirs
            why = memo[id(flows)] = _flows_fault(flows, rank_ids, None)
        return why
    explicit = any(f.dst is not None for f in flows)
    for f in flows:
        if not _finite_work(f.nbytes):
            return f"bad flow {f}: bytes must be a finite number in 0..{MAX_WORK:g}"
        if f.dst is not None and f.dst not in rank_ids:
            return f"flow to unknown rank {f.dst}"
        if explicit and f.link not in NET_LINK_KINDS:
            return (
                f"bad flow {f}: an op with explicit-destination flows may use only "
                f"{' and '.join(NET_LINK_KINDS)} links"
            )
    return None


def _check_cycles(program: Program, orders, num_sms, work: ValidationWork | None = None) -> None:
    """Kahn's algorithm over the dependency graph of issue and completion nodes.

    Every launch is two nodes: its start (it holds its SMs; a send half injects its flows) and
    its end (a completion half has all its data). The next item of a stream follows the end of
    the previous one; a receiving op's end follows the start of every op sending it data.
    Nodes are integers; ``info[n]`` says which instruction node ``n`` belongs to.
    """
    succ: list[list[int]] = []
    info: list[tuple[Issued, RankProgram, int | None]] = []
    new_succ, new_info = succ.append, info.append  # a node: its successors and where it is from

    # rank -> (precedence, op): precedence is (stream priority, node), the block scheduler's order
    launches: dict[int, list[tuple[tuple[int, int], Op]]] = defaultdict(list)
    recvs: list[tuple[int, int, str, int, Op, str]] = []  # (start, end, key, rank, op, stream)
    waiters: list[tuple[int, int, str, int, Op, str]] = []  # kernels polling signals, likewise
    flow_srcs: dict[tuple[str, int], list[tuple[int, Op, int]]] = defaultdict(list)
    gpu_types = (Launch, Record, Wait, WaitStream)
    for rp in program.ranks:
        prio = {s: rp.priority(s) for s in rp.streams}
        rank_launches = launches[rp.rank]
        record_node: dict[str, int] = {}
        last_on: dict[str, int] = {}
        prev_host = None
        pending: list[tuple[int, str]] = []  # (node, event) waits resolved after the pass
        for it in orders[rp.rank]:
            h = len(succ)
            new_succ([])
            new_info((it, rp, None))
            if prev_host is not None:
                succ[prev_host].append(h)
            prev_host = h
            ins = it.instr
            if type(ins) is Graph:
                parts = enumerate(ins.body)
            else:
                if isinstance(ins, Sync):
                    pending.append((h, ins.event))
                parts = ((None, ins),)
            for k, ins in parts:
                if not isinstance(ins, gpu_types):
                    continue
                g = len(succ)
                new_succ([])
                new_info((it, rp, k))
                succ[h].append(g)
                if isinstance(ins, WaitStream):
                    if ins.other in last_on:
                        succ[last_on[ins.other]].append(g)
                stream = ins.stream
                if stream in last_on:
                    succ[last_on[stream]].append(g)
                end = g
                if isinstance(ins, Record):
                    record_node[ins.event] = g
                elif isinstance(ins, Wait):
                    pending.append((g, ins.event))
                elif isinstance(ins, Launch):
                    op = ins.op
                    rank_launches.append(((prio.get(stream, DEFAULT_PRIORITY), g), op))
                    end = len(succ)
                    new_succ([])
                    new_info((it, rp, k))
                    succ[g].append(end)
                    # a kernel that consumes signals while it runs cannot end before they fire
                    if op.waits:
                        pending += [(end, ev) for ev in op.waits]
                        if not (op.coll and op.coll.role != "send"):
                            waiters.append((g, end, "", rp.rank, op, stream))
                    c = op.coll
                    if c is not None:
                        if c.role != "recv":
                            # data leaves as the kernel runs; one that consumes signals sends
                            # its last part only after the last of them: its end is the source
                            src = end if op.waits else g
                            for f in c.flows:
                                dst = rp.rank if f.dst is None else f.dst
                                flow_srcs[(c.key, dst)].append((src, op, g))
                        if c.role != "send":
                            recvs.append((g, end, c.key, rp.rank, op, stream))
                last_on[stream] = end
        for n, ev in pending:
            if ev in record_node:
                succ[record_node[ev]].append(n)
    for start, end, key, rank, _op, _s in recvs:
        for src, _sop, _g in flow_srcs.get((key, rank), ()):
            if src != start:
                succ[src].append(end)
    indeg = [0] * len(succ)
    for m, d in Counter(chain.from_iterable(succ)).items():
        indeg[m] = d
    queue = [n for n, d in enumerate(indeg) if d == 0]
    seen = 0
    pos = [0] * len(succ)  # each node's place in one topological order
    while queue:
        n = queue.pop()
        pos[n] = seen
        seen += 1
        for m in succ[n]:
            indeg[m] -= 1
            if indeg[m] == 0:
                queue.append(m)
    if seen < len(succ):
        first = next(n for n, d in enumerate(indeg) if d > 0)  # nodes are made in issue order
        it, rp, k = info[first]
        raise ProgramError(
            _where(
                it,
                rp,
                "wait cycle: this instruction waits on work that can only come after it",
                k,
            )
        )
    if work is not None:  # each node and edge made, then taken by Kahn's algorithm
        work.nodes += 2 * len(succ)
        work.edges += 2 * sum(map(len, succ))
    if num_sms is not None:
        fault = starvation_fault(recvs + waiters, succ, info, num_sms, launches, pos, work)
        if fault is not None:
            node, why = fault
            it, rp, k = info[node]
            raise ProgramError(_where(it, rp, why, k))
