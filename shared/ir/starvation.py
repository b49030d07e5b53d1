"""The validator's SM-starvation rule (rule 13 of ``docs/program.md``): no op waiting for data or
signals may hold the SMs that a same-rank launch it depends on needs to start.

``shared/ir/validate.py`` builds the dependency graph of a Program (its rule 12) and hands it
here. The rule is the one that graph defines; this module answers its questions in time linear
in the graph (``ValidationWork`` counts what it visits):

- *Ordered before* (a node's ancestors through its own rank's nodes) is read from a chain cover
  of each rank: its host instructions form one chain and each stream's items another (every
  item follows the previous one), so the ancestors on a chain are a prefix of it, and a node
  keeps, per chain, the last of its ancestors there: one pass over the rank in topological
  order, a few integers per node, instead of a set (or bitset) of ancestors per node.
- A blocker is a launch on another stream of the holder's rank (on its own stream, what is
  not ordered before the holder comes after its end), so a rank that launches on one stream
  has none, and the search for them goes back from the holder's senders, through other ranks'
  nodes, no lower than the *level* (longest path from a source) of the first launch on each of
  the rank's other streams not ordered before the holder: a blocker is such a launch or one
  after it on its stream, and every node it reaches lies above it. (Host instructions run
  ahead of the GPU, so they do not bound the search: a blocker is a launch.)
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property

from overlap_lab.shared.ir.program import Op, Record, Wait, WaitStream

#: A receiver or signal poller of the graph: (start node, end node, collective key, rank, op,
#: stream). The graph is ``shared.ir.validate``'s: ``succ[n]`` the successors of node ``n``,
#: ``info[n]`` (the issued instruction, its RankProgram, the graph body position or None).
Holder = tuple[int, int, str, int, Op, str]


@dataclass
class ValidationWork:
    """What a validation visited: nodes and edges of the dependency graph's passes (its
    construction and Kahn's algorithm in ``shared.ir.validate``, this module's), and nodes of
    the starvation rule's searches. Counted so that a test can hold the work linear in the
    Program (tests/test_counted_work.py); never read by the rules themselves."""

    nodes: int = 0
    edges: int = 0
    searched: int = 0

    def total(self) -> int:
        return self.nodes + self.edges + self.searched


def starvation_fault(
    holders: list[Holder],
    succ: list[list[int]],
    info: list,
    num_sms: int,
    launches: dict[int, list[tuple[tuple[int, int], Op]]],
    pos: list[int],
    work: ValidationWork | None = None,
) -> tuple[int, str] | None:
    """The holder node an SM starvation refuses and why, or None when no op can starve a sender.

    A receiving op holds its SMs until its data is there (a compute kernel up to its limit), and
    a kernel that polls signals holds them until its last signal. Such an op is *at risk* when
    its data or signals depend, on any rank and through any chain of collectives, on a launch of
    its own rank that is not ordered before it (that launch may find no free SMs), unless that
    launch precedes it in the block scheduler's order and everything the launch's start waits on
    is ordered before the holder's start (it is then pending, and served, first). For each
    at-risk receiver, the SMs it holds, plus the largest at-risk hold of each other stream of its
    rank (a stream runs one op at a time), plus the most that a competing launch needs to start
    must fit in the GPU. A launch competes with the sender when the block scheduler serves it
    first (SMs go to pending kernels by stream priority, then issue order, and a kernel whose
    CTAs must be co-resident keeps free SMs from those behind it) and it is not ordered before
    the receiver (those started before the hold began). ``pos`` is a topological order of the
    nodes; ``launches`` maps a rank to its (precedence, op) pairs, precedence being (stream
    priority, node): the block scheduler's order."""
    work = work if work is not None else ValidationWork()
    graph = _Graph(succ, info, pos, launches, work)
    risks: list[tuple[int, str, int, int, Op, tuple[int, int]]] = []
    for start, end, _key, rank, op, stream in holders:
        hold = _hold(op, num_sms)
        if hold == 0 or not graph.launches_beside(rank, stream):
            # no SMs held, or the rank launches on no other stream: a launch of the holder's
            # stream not ordered before it comes after its end, which cannot wait for it
            continue
        outside = [p for p in graph.pred[end] if p != start]  # its data's senders, its signals
        if not outside:
            continue
        anc = graph.ancestors(rank, start)
        own = graph.precedence(start)
        worst = None
        for b in graph.blockers(outside, rank, start, anc):
            prec = graph.precedence(b)
            if prec < own and graph.ready_by(b, anc):
                # whenever the holder can start, this launch is already pending ahead of it in
                # the block scheduler's order, and is served first: not at risk
                continue
            if worst is None or prec > worst:
                worst = prec
        if worst is not None:
            risks.append((rank, stream, hold, start, op, worst))
    return _fault(risks, graph, launches, num_sms)


def _fault(risks, graph: _Graph, launches, num_sms: int) -> tuple[int, str] | None:
    """The first at-risk holder whose hold, the other streams' widest holds and the largest
    competing need exceed the GPU, with the error's text."""
    widest: dict[tuple[int, str], int] = {}
    for rank, stream, hold, *_ in risks:
        widest[(rank, stream)] = max(widest.get((rank, stream), 0), hold)
    per_rank: dict[int, int] = defaultdict(int)
    for (rank, _s), h in widest.items():
        per_rank[rank] += h
    by_need: dict[int, list[tuple[int, list[tuple[int, int]]]]] = {}
    for rank, stream, hold, start, op, sender in risks:
        others = per_rank[rank] - widest[(rank, stream)]
        started = graph.ancestors(rank, start)
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


class _Graph:
    """The dependency graph's questions for the rule: predecessors, levels, each rank's chain
    cover and ancestor frontiers (built on first use, per rank), the blocker search."""

    def __init__(self, succ, info, pos, launches, work: ValidationWork):
        self.succ, self.info, self.pos, self.launches, self.work = succ, info, pos, launches, work
        self.level: list[int] = []
        self._by_rank: dict[int, list[int]] = {}
        self._ranks: dict[int, _RankChains] = {}
        self._streams: dict[int, frozenset[str]] = {}

    def launches_beside(self, rank: int, stream: str) -> bool:
        """Whether ``rank`` launches a kernel on a stream other than ``stream``."""
        streams = self._streams.get(rank)
        if streams is None:
            streams = self._streams[rank] = frozenset(
                self._stream_of(p[1]) for p, _o in self.launches[rank]
            )
            self.work.nodes += len(self.launches[rank])
        return len(streams) > 1 or stream not in streams

    def _stream_of(self, node: int) -> str:
        it, _rp, k = self.info[node]
        return (it.instr if k is None else it.instr.body[k]).stream

    @cached_property
    def starts(self) -> set[int]:
        """Every launch's start node."""
        return {p[1] for ls in self.launches.values() for p, _o in ls}

    @cached_property
    def rank_of(self) -> list[int]:
        self.work.nodes += len(self.info)
        return [rp.rank for _it, rp, _k in self.info]

    @cached_property
    def pred(self) -> list[list[int]]:
        """Each node's predecessors."""
        pred: list[list[int]] = [[] for _ in self.succ]
        for a, out in enumerate(self.succ):
            for b in out:
                pred[b].append(a)
        self.work.nodes += len(self.succ)
        self.work.edges += sum(map(len, self.succ))
        return pred

    def chains(self, rank: int) -> _RankChains:
        """The rank's chain cover (built on first use; the levels and each rank's nodes in
        topological order with the first)."""
        rc = self._ranks.get(rank)
        if rc is None:
            if not self.level:
                self._levels()
            rc = self._ranks[rank] = _RankChains(self, rank, self._by_rank.pop(rank))
        return rc

    def _levels(self) -> None:
        """Each node's level (its longest path from a source: every edge climbs at least one
        level) and each rank's nodes in topological order."""
        succ, rank_of = self.succ, self.rank_of
        order = [0] * len(succ)
        for a, p in enumerate(self.pos):
            order[p] = a
        level = [0] * len(succ)
        by_rank = self._by_rank
        for a in order:
            by_rank.setdefault(rank_of[a], []).append(a)
            up = level[a] + 1
            for b in succ[a]:
                if level[b] < up:
                    level[b] = up
        self.level = level
        self.work.nodes += 2 * len(succ)
        self.work.edges += sum(map(len, succ))

    def ancestors(self, rank: int, node: int) -> _Ancestors:
        return _Ancestors(self.chains(rank), node)

    def precedence(self, node: int) -> tuple[int, int]:
        """The block scheduler's order of a launch node: its stream's priority, then issue
        order."""
        it, rp, k = self.info[node]
        ins = it.instr if k is None else it.instr.body[k]
        return (rp.priority(ins.stream), node)

    def blockers(self, outside, rank: int, start: int, anc: _Ancestors) -> list[int]:
        """Launch starts of ``rank`` not ordered before the holder ``start`` (not in ``anc``)
        that the holder's end depends on through ``outside`` (its senders' and signals' nodes,
        on any rank). The search goes back through other ranks' nodes and its own rank's
        records, waits and host instructions; it stops at its own rank's nodes ordered before
        the holder (all they depend on is too) and at its own rank's launches (the first kernel
        met on a chain is the one that may find no SMs: a kernel behind it cannot start before
        it).

        Its own rank's nodes lead only to its own rank's nodes, and other ranks' nodes lead
        back to it only through launches that send it data (the sources of flows): so the
        search stays, on the holder's rank, no lower than the lowest level of a launch there
        not ordered before the holder, and on other ranks no lower than the lowest level of
        such a launch that sends flows (``_RankChains.bounds``): no path from a blocker passes
        below them."""
        near, far = anc.chains.bounds(anc)
        if near is None:
            return []
        level, pred, rank_of, starts = self.level, self.pred, self.rank_of, self.starts
        # outside nodes of other ranks lead back here only through flow sources
        stack = [p for p in outside if level[p] >= (near if rank_of[p] == rank else far or 0)]
        if far is None:
            stack = [p for p in stack if rank_of[p] == rank]
        seen = set(stack)
        out = []
        while stack:
            q = stack.pop()
            if rank_of[q] == rank:
                if q == start or q in anc:
                    continue
                if q in starts or q - 1 in starts:  # a launch's start, or its end (the next node)
                    out.append(q if q in starts else q - 1)
                    continue
                lo = near
            else:
                lo = far
            for p in pred[q]:
                if p not in seen and level[p] >= lo:
                    seen.add(p)
                    stack.append(p)
        self.work.searched += len(seen)
        return out

    def ready_by(self, node: int, anc: _Ancestors) -> bool:
        """Whether launch ``node`` can start once the nodes ``anc`` are done: everything it
        waits on is in ``anc``, looking through waits, records and wait_streams (they take no
        time)."""
        stack, seen = list(self.pred[node]), set()
        while stack:
            q = stack.pop()
            if q in anc or q in seen:
                continue
            seen.add(q)
            it, _rp, k = self.info[q]
            ins = it.instr if k is None else it.instr.body[k]
            if not isinstance(ins, (Wait, Record, WaitStream)):
                return False  # a kernel, or host work, not ordered before: may come later
            stack.extend(self.pred[q])
        self.work.searched += len(seen)
        return True


class _RankChains:
    """One rank's chain cover and the ancestor frontier of each of its nodes.

    Chain 0 holds the rank's host instructions in issue order, chain ``1 + i`` the items of its
    ``i``-th stream (a launch's start and end both): consecutive nodes of a chain are joined by
    an edge and numbered in increasing order, so a node's ancestors on its own chain are the
    chain's nodes before it, and on any other chain a prefix: ``front[n][c]`` is the last of
    them (-1: none; the entry of the node's own chain is not used)."""

    def __init__(self, g: _Graph, rank: int, nodes: list[int]):
        """``nodes``: the rank's nodes in topological order."""
        info, pred = g.info, g.pred
        rp = info[nodes[0]][1]
        lanes = {s: i + 1 for i, s in enumerate(rp.streams)}
        chain: dict[int, int] = {}
        prev_it = None
        created = sorted(nodes)
        for n in created:  # creation order: a host node comes before its items
            it, _rp, k = info[n]
            if it is not prev_it:
                chain[n] = 0
                prev_it = it
            else:
                ins = it.instr if k is None else it.instr.body[k]
                chain[n] = lanes[ins.stream]
        width = len(rp.streams) + 1
        none = (-1,) * width
        front: dict[int, tuple[int, ...]] = {}
        edges = 0
        for n in nodes:
            c = chain[n]
            merged = None
            for p in pred[n]:
                cp = chain.get(p)
                if cp is None:
                    continue  # another rank's node: "ordered before" counts the rank's own
                edges += 1
                fp = front[p]
                if cp == c and merged is None:
                    merged = fp  # the chain's previous node: its frontier, shared
                    continue
                cur = list(merged) if merged is not None else list(none)
                for i, v in enumerate(fp):
                    if v > cur[i]:
                        cur[i] = v
                if p > cur[cp]:
                    cur[cp] = p
                merged = tuple(cur)
            front[n] = merged if merged is not None else none
        self.chain, self.front = chain, front
        self.rank = rank
        # each stream's launch nodes (starts and ends) in chain order, and those with a
        # successor on another rank (flow sources), for the search's bounds
        starts, rank_of, succ = g.starts, g.rank_of, g.succ
        self.launch_nodes: list[list[int]] = [[] for _ in range(width)]
        self.sources: list[list[int]] = [[] for _ in range(width)]
        for n in created:
            c = chain[n]
            if c and (n in starts or n - 1 in starts):
                self.launch_nodes[c].append(n)
                out = succ[n]
                edges += len(out)
                if any(rank_of[b] != rank for b in out):
                    self.sources[c].append(n)
        self.level = g.level
        g.work.nodes += 3 * len(nodes)
        g.work.edges += edges

    def bounds(self, anc: _Ancestors) -> tuple[int | None, int | None]:
        """The lowest level of a launch node of the rank that is neither the holder
        ``anc.node`` nor ordered before it, on a stream other than the holder's, and the lowest
        of such a node that sends flows to another rank (None: there is none). On the holder's
        own stream only its end and what follows it are not ordered before it, and they come
        after everything its end waits for."""
        node = anc.node
        own, f = self.chain[node], self.front[node]
        near = far = None
        for c in range(1, len(f)):
            if c == own:
                continue
            for ls, is_far in ((self.launch_nodes[c], False), (self.sources[c], True)):
                i = bisect_right(ls, f[c])
                if i < len(ls):
                    lv = self.level[ls[i]]
                    if is_far:
                        far = lv if far is None or lv < far else far
                    else:
                        near = lv if near is None or lv < near else near
        return near, far


class _Ancestors:
    """The nodes of a rank ordered before ``node`` through that rank's own nodes (``in``
    only), read from the rank's chain frontiers."""

    __slots__ = ("chains", "node", "_chain", "_front", "_own")

    def __init__(self, chains: _RankChains, node: int):
        self.chains, self.node = chains, node
        self._chain, self._front = chains.chain, chains.front[node]
        self._own = chains.chain[node]

    def __contains__(self, q: int) -> bool:
        c = self._chain.get(q)
        if c is None:
            return False
        if c == self._own:
            return q < self.node
        return q <= self._front[c]


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


def coresident(op: Op) -> bool:
    """Whether the op's CTAs must all be resident at once (``sim.cost.grid_kind``: its own
    ``grid``, else every communication kernel)."""
    return op.grid == "coresident" or (op.grid is None and op.kind == "comm")


def per_sm(op: Op) -> int:
    """CTAs per SM of a coresident kernel (``sim.cost.grid``: 1 unless the op says)."""
    return op.ctas_per_sm or 1


def resident_sms(op: Op) -> int:
    """SMs an op with an explicit ``ctas`` needs to hold all of them at once."""
    return -(-op.ctas // per_sm(op))


def _hold(op: Op, num_sms: int) -> int:
    """SMs an op may hold while it waits for data: compute kernels grow up to their limit, and
    never past the SMs their explicit CTAs fill (the block scheduler gives no SM without a CTA
    for it; per-SM CTAs of a compute kernel are not known here, so one per SM, the most)."""
    limit = num_sms if op.sms is None else op.sms
    if op.ctas is not None and limit:
        limit = min(limit, resident_sms(op) if coresident(op) else op.ctas)
    return limit


def _need(op: Op, num_sms: int) -> int:
    """SMs an op needs free before it can start (coresident kernels: all of theirs)."""
    limit = num_sms if op.sms is None else op.sms
    if not coresident(op):
        return min(1, limit)
    return min(limit, resident_sms(op)) if op.ctas is not None and limit else limit
