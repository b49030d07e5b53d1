"""The SM-starvation check as ``shared/ir/validate.py`` had it before it was made linear
(commit 8150ba6, its ``_check_starvation`` and helpers, unchanged but for returning the fault
instead of raising it): the oracle that tests/test_starvation_linear.py holds the linear check
(``shared/ir/starvation.py``) to. Per-rank ancestor bitsets (quadratic in a rank's nodes), one
search per receiver bounded by a depth-first topological order; ranks above MAX_BITSET_NODES
fall back to the direct-sender rule."""

# ruff: noqa

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict

from overlap_lab.shared.ir.program import Op, Record, Wait, WaitStream


def _coresident(op: Op) -> bool:
    """Whether the op's CTAs must all be resident at once (``sim.cost.grid_kind``: its own
    ``grid``, else every communication kernel)."""
    return op.grid == "coresident" or (op.grid is None and op.kind == "comm")


def _per_sm(op: Op) -> int:
    """CTAs per SM of a coresident kernel (``sim.cost.grid``: 1 unless the op says)."""
    return op.ctas_per_sm or 1


def _resident_sms(op: Op) -> int:
    """SMs an op with an explicit ``ctas`` needs to hold all of them at once."""
    return -(-op.ctas // _per_sm(op))


def _hold(op: Op, num_sms: int) -> int:
    """SMs an op may hold while it waits for data: compute kernels grow up to their limit, and
    never past the SMs their explicit CTAs fill (the block scheduler gives no SM without a CTA
    for it; per-SM CTAs of a compute kernel are not known here, so one per SM, the most)."""
    limit = num_sms if op.sms is None else op.sms
    if op.ctas is not None and limit:
        limit = min(limit, _resident_sms(op) if _coresident(op) else op.ctas)
    return limit


def _need(op: Op, num_sms: int) -> int:
    """SMs an op needs free before it can start (coresident kernels: all of theirs)."""
    limit = num_sms if op.sms is None else op.sms
    if not _coresident(op):
        return min(1, limit)
    return min(limit, _resident_sms(op)) if op.ctas is not None and limit else limit


def starvation_fault(holders, succ, info, num_sms, launches, pos, work=None):
    """A receiving op holds its SMs until its data is there (a compute kernel up to its limit),
    and a kernel that polls signals holds them until its last signal. Such an op is *at risk*
    when its data or signals depend, on any rank and through any chain of collectives, on a
    launch of its own rank that is not ordered before it (that launch may find no free SMs),
    unless that launch precedes it in the block scheduler's order and everything the launch's
    start waits on is ordered before the holder's start (it is then pending, and served, first).
    For
    each at-risk receiver, the SMs it holds, plus the largest at-risk hold of each other stream of
    its rank (a stream runs one op at a time), plus the most that a competing launch needs to
    start must fit in the GPU. A launch competes with the sender when the block scheduler serves
    it first (SMs go to pending kernels by stream priority, then issue order, and a kernel whose
    CTAs must be co-resident keeps free SMs from those behind it) and it is not ordered before the
    receiver (those started before the hold began). ``pos`` is a topological order of the
    nodes: it bounds every search for ancestors."""
    pred: list[list[int]] | None = None
    ancestors: dict[int, set[int] | _RankAncestors] = {}
    by_rank: dict[int, tuple[dict[int, int], dict[int, int], list[int]] | None] = {}

    def anc_of(b: int, rank: int) -> set[int] | _RankAncestors:
        if b not in ancestors:
            if rank not in by_rank:
                by_rank[rank] = _rank_ancestor_bits(rank, pred, info, pos)
            bits = by_rank[rank]
            if bits is None:  # too many nodes for bitsets: one search per receiver
                ancestors[b] = _ancestors(b, pred, info, rank)
            else:
                ancestors[b] = _RankAncestors(bits, b)
        return ancestors[b]

    risks: list[tuple[int, str, int, int, Op, tuple[int, int]]] = []
    starts = {p[1] for ls in launches.values() for p, _o in ls}
    for start, end, _key, rank, op, stream in holders:
        hold = _hold(op, num_sms)
        if hold == 0:
            continue
        if pred is None:
            pred = [[] for _ in succ]
            for a, out in enumerate(succ):
                for b in out:
                    pred[b].append(a)
        outside = [p for p in pred[end] if p != start]  # its data's senders, its signals
        if not outside:
            continue
        if rank not in by_rank:
            by_rank[rank] = _rank_ancestor_bits(rank, pred, info, pos)
        if by_rank[rank] is None:
            # too many nodes for bitsets: only the holder's direct senders on its rank count
            # (each ancestor question is a search of its own)
            anc: set[int] | _RankAncestors | _Before = _Before(start, pred, pos)
            lo, deep = 0, False
        else:
            anc = anc_of(start, rank)
            lo, deep = anc.first_outside(start, pos), True
            if lo is None:
                continue
        own = _precedence(info, start)
        worst = None
        for b in _blockers(outside, rank, start, anc, pred, info, pos, lo, starts, deep):
            prec = _precedence(info, b)
            if prec < own and _ready_by(b, anc if deep else anc_of(start, rank), pred, info):
                # whenever the holder can start, this launch is already pending ahead of it in
                # the block scheduler's order, and is served first: not at risk
                continue
            if worst is None or prec > worst:
                worst = prec
        if worst is not None:
            risks.append((rank, stream, hold, start, op, worst))
    by_need: dict[int, list[tuple[int, list[tuple[int, int]]]]] = {}
    widest: dict[tuple[int, str], int] = {}
    for rank, stream, hold, *_ in risks:
        widest[(rank, stream)] = max(widest.get((rank, stream), 0), hold)
    for rank, stream, hold, start, op, sender in risks:
        others = sum(h for (r, s), h in widest.items() if r == rank and s != stream)
        started = anc_of(start, rank)
        if rank not in by_need:
            by_need[rank] = _launches_by_need(launches[rank], num_sms)
        need = _largest_need(by_need[rank], sender, started, start)
        held = hold + others
        if held + need > num_sms:
            need, needer = max(
                (
                    (_need(o, num_sms), o.name)
                    for p, o in launches[rank]
                    if p <= sender and p[1] not in started and p[1] != start
                ),
                default=(0, ""),
            )
            return start, (
                f"SM starvation: {op.name} and the other streams' receivers may hold {held} "
                f"of the {num_sms} SMs while waiting for data or signals that depend on a "
                f"same-rank op not ordered before them, and {needer} needs {need} SMs to "
                "start; order the sender first or leave it SMs"
            )
    return None


def _blockers(
    outside, rank, start, anc, pred, info, pos, lo: int, starts, deep: bool = True
) -> list[int]:
    """Launch starts of ``rank`` not ordered before the holder ``start`` (not in ``anc``) that
    the holder's end depends on through ``outside`` (its senders' and signals' nodes, on any
    rank). The search goes back through other ranks' nodes and its own rank's records, waits
    and host instructions; it stops at its own rank's nodes ordered before the holder (all they
    depend on is too) and at its own rank's launches (the first kernel met on a chain is the one
    that may find no SMs: a kernel behind it cannot start before it), and at any node earlier
    than ``lo`` in the topological order ``pos`` (the first node of ``rank`` not ordered before
    the holder): no path from a blocker passes through it. Not ``deep``: ``outside`` only."""
    stack = [p for p in outside if pos[p] >= lo]
    seen = set(stack)
    out = []
    while stack:
        q = stack.pop()
        if info[q][1].rank == rank:
            if q == start or q in anc:
                continue
            if q in starts or q - 1 in starts:  # a launch's start, or its end (the next node)
                out.append(q if q in starts else q - 1)
                continue
        if not deep:
            continue
        for p in pred[q]:
            if p not in seen and pos[p] >= lo:
                seen.add(p)
                stack.append(p)
    return out


def _launches_by_need(launches, num_sms: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """A rank's launches grouped by the SMs each needs to start, largest first, each group's
    precedences sorted (for ``_largest_need``)."""
    groups: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for p, o in launches:
        groups[_need(o, num_sms)].append(p)
    return [(n, sorted(groups[n])) for n in sorted(groups, reverse=True)]


def _largest_need(by_need, sender: tuple[int, int], started, start: int) -> int:
    """The most SMs a launch served before ``sender`` (precedence <= it), not ordered before the
    receiver ``start`` (not in ``started``) and not the receiver itself needs: 0 if none. Each
    group is searched from its last launch before the sender back, as the launches nearest the
    sender are the ones least likely to be ordered before the receiver."""
    for need, ps in by_need:
        for k in range(bisect_right(ps, sender) - 1, -1, -1):
            node = ps[k][1]
            if node != start and node not in started:
                return need
    return 0


def _ready_by(node: int, anc: set[int], pred, info) -> bool:
    """Whether launch ``node`` can start once the nodes ``anc`` are done: everything it waits on
    is in ``anc``, looking through waits, records and wait_streams (they take no time)."""
    stack, seen = list(pred[node]), set()
    while stack:
        q = stack.pop()
        if q in anc or q in seen:
            continue
        seen.add(q)
        it, _rp, k = info[q]
        ins = it.instr if k is None else it.instr.body[k]
        if not isinstance(ins, (Wait, Record, WaitStream)):
            return False  # a kernel, or host work, not ordered before: may come later
        stack.extend(pred[q])
    return True


def _precedence(info, node: int) -> tuple[int, int]:
    """The block scheduler's order of a launch node: its stream's priority, then issue order."""
    it, rp, k = info[node]
    ins = it.instr if k is None else it.instr.body[k]
    return (rp.priority(ins.stream), node)


#: Nodes of one rank up to which ``_check_starvation`` keeps every node's ancestors as a bitset
#: (about n^2/16 bytes); beyond it each receiver's ancestors are searched for alone.
MAX_BITSET_NODES = 20_000


def _rank_ancestor_bits(
    rank: int, pred, info, pos
) -> tuple[dict[int, int], dict[int, int], list[int]] | None:
    """For every node of ``rank``: the bitset of its ancestors through that rank's own nodes (the
    sets ``_ancestors`` finds), bit ``i`` standing for the rank's ``i``-th node in the
    topological order ``pos``, so one pass in that order builds them all: (node -> bit, node ->
    bitset, the nodes in that order), or None above MAX_BITSET_NODES."""
    nodes = [n for n, (_it, rp, _k) in enumerate(info) if rp.rank == rank]
    if len(nodes) > MAX_BITSET_NODES:
        return None
    nodes.sort(key=pos.__getitem__)
    local = {n: i for i, n in enumerate(nodes)}
    bits: dict[int, int] = {}
    for n in nodes:
        b = 0
        for p in pred[n]:
            i = local.get(p)
            if i is not None:
                b |= bits[p] | (1 << i)
        bits[n] = b
    return local, bits, nodes


class _RankAncestors:
    """The ancestors of one node as ``_ancestors`` returns them (``in`` only), read from the
    rank's bitsets."""

    __slots__ = ("_local", "_bits", "_nodes")

    def __init__(self, table, b: int):
        self._local, self._bits, self._nodes = table[0], table[1][b], table[2]

    def first_outside(self, b: int, pos) -> int | None:
        """The least topological position ``pos`` of a node of the rank that is neither ``b``
        nor one of its ancestors (None: there is none): the lowest clear bit."""
        full = self._bits | (1 << self._local[b])
        z = ((~full) & (full + 1)).bit_length() - 1
        return pos[self._nodes[z]] if z < len(self._nodes) else None

    def __contains__(self, q: int) -> bool:
        i = self._local.get(q)
        return i is not None and (self._bits >> i) & 1 == 1


class _Before:
    """The nodes ordered before node ``b`` (``in`` only), each found by a search of its own
    (``_reaches``, remembered): for ranks too large for ``_rank_ancestor_bits``, where most
    questions are about the few nodes near ``b``."""

    __slots__ = ("_b", "_pred", "_pos", "_memo")

    def __init__(self, b: int, pred, pos):
        self._b, self._pred, self._pos, self._memo = b, pred, pos, {}

    def __contains__(self, q: int) -> bool:
        r = self._memo.get(q)
        if r is None:
            r = self._memo[q] = q != self._b and _reaches(q, self._b, self._pred, self._pos)
        return r


def _ancestors(b: int, pred, info, rank: int) -> set[int]:
    """Every node of ``rank`` ordered before node ``b`` through that rank's own nodes."""
    stack, seen = [b], {b}
    while stack:
        for p in pred[stack.pop()]:
            if p not in seen and info[p][1].rank == rank:
                seen.add(p)
                stack.append(p)
    seen.discard(b)
    return seen


def _reaches(a: int, b: int, pred, pos) -> bool:
    """Whether node ``a`` is an ancestor of node ``b``. Only nodes after ``a`` in the topological
    order ``pos`` can descend from it, so the search stays between the two."""
    if pos[a] > pos[b]:
        return False
    lo = pos[a]
    stack, seen = [b], {b}
    while stack:
        n = stack.pop()
        if n == a:
            return True
        for p in pred[n]:
            if p not in seen and pos[p] >= lo:
                seen.add(p)
                stack.append(p)
    return False
