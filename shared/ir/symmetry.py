"""Exact symmetry reduction: explicit ranks that cannot differ are simulated once.

An explicit Program (``shared.ir.ranks.expand_ranks``) holds one RankProgram per EP rank. Ranks sit
on ``N`` full nodes of ``G`` GPUs (``shared.inputs.topology``); the relabelings

    σ_r(d) = ((node(d) + node(r)) mod N) · G + (local(d) + local(r)) mod G

form a group that acts transitively on the ranks (σ_r(0) = r) and preserves what the simulator
sees of the topology: same-node pairs stay same-node (NVLink), same-rail pairs stay same-rail
(DeepEP's RDMA peer), and every rank has the same GPU and the same egress and ingress port per
link kind (``sim.network``). If every rank r's program is rank 0's with each flow's destination
``d`` replaced by ``σ_r(d)`` (:func:`reduce_program` checks it, exactly), the whole run is
invariant under the group: each GPU evolves on its own, and the network's max-min fair rates are
unique, hence invariant too. Every rank then does exactly what rank 0 does, at the same times.

Rank 0's view of the network under that symmetry: every port of one link kind carries as many
flows as rank 0's egress (a rank's ingress receives the images of rank 0's flows), all ports fill
at the same level, so each live flow gets the port's bandwidth over the number of flows on it;
and a collective's data reaches rank r when the last of the images of rank 0's flows has arrived,
i.e. when rank 0's own flows have. That is what the engine does with a *symmetric* Program whose
flows have no destination (``dst=None``: each shares its rank's egress ``Link`` equally, with the
same bandwidth and latency per kind, ``GPU.link_bytes_per_us``/``link_latency_us``, as the
network's ports). So the quotient is rank 0's RankProgram with every flow's destination dropped
(each flow kept on its own: the Link splits per flow, as the ports do), simulated once, and its
Trace copied to every rank (:func:`expand_trace`). Where every op sending over a link kind sends
the same number n of equal flows over it (balanced routing: one per peer), the quotient sends them
as one flow of n times the bytes: the same progress with n times fewer flows to simulate, equal to
float round-off (``merge_flows=False`` keeps them apart, and the run bit for bit).

One difference in the Trace: the network draws one link span per op and link kind (from the send
to the last arrival of that kind), a symmetric Link one per flow. :func:`expand_trace` merges the
quotient's per-flow spans back into per-op spans, so the expanded Trace equals the explicit run's.
The explicit run may group network completions (``net_group_tol``, a few per cent of a flow's age,
on the slow side); the reduced run is exact.
"""

from __future__ import annotations

import operator
import weakref
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

from overlap_lab.shared.ir.program import (
    NET_LINK_KINDS,
    Coll,
    Flow,
    Graph,
    HostThread,
    Instr,
    Launch,
    Op,
    Program,
    RankProgram,
    iter_gpu_instrs,
)
from overlap_lab.shared.outputs.trace import Span, Trace, _canonical_key

__all__ = [
    "Reduction",
    "certify_alike",
    "expand_trace",
    "reduce_program",
    "relabeling",
    "same_flows",
]


@dataclass(frozen=True)
class Reduction:
    """An explicit Program's quotient: ``program`` (symmetric, rank 0, flows without
    destinations) stands for ``world`` ranks; ``bundles`` gives, per link span key (op, mb,
    layer, step), how many flows per link kind the explicit op sends (to merge link spans)."""

    program: Program
    world: int
    bundles: dict[tuple, dict[str, int]]
    why: str


def relabeling(world: int, gpus_per_node: int) -> Callable[[int, int], int] | None:
    """σ(r, d): the rank rank 0's peer ``d`` is to rank ``r`` (None when the last node is
    partial: the ranks are then not all alike)."""
    g = min(gpus_per_node, world)
    if world % g:
        return None
    n = world // g

    def sigma(r: int, d: int) -> int:
        return ((d // g + r // g) % n) * g + (d % g + r % g) % g

    return sigma


#: Op fields compared as they are (``coll`` is compared with its flows relabeled).
_OP_FIELDS = tuple(f.name for f in fields(Op) if f.name != "coll")
_op_values = operator.itemgetter(*_OP_FIELDS)


def same_flows(a: tuple[Flow, ...], b: tuple[Flow, ...], perm: list[int]) -> bool:
    """Whether ``b`` is ``a`` with destinations mapped through ``perm``, as multisets (the
    order of an op's flows is no part of what the network does with them)."""
    if len(a) != len(b):
        return False
    if any(f.dst is not None and not 0 <= f.dst < len(perm) for f in a):
        return False  # not a rank: the full run's validation names it
    mapped = sorted((f.link, -1 if f.dst is None else perm[f.dst], f.nbytes) for f in a)
    return mapped == sorted((f.link, -1 if f.dst is None else f.dst, f.nbytes) for f in b)


class _Matcher:
    """Compares rank 0's instructions with rank r's under ``perm`` = σ_r, remembering flow
    tuples already compared (the lowering shares one tuple among a rank's ops)."""

    def __init__(self, perm: list[int]):
        self.perm = perm
        self.memo: dict[tuple[int, int], bool] = {}

    def op(self, a: Op, b: Op) -> bool:
        if a is b:
            return True
        if _op_values(a.__dict__) != _op_values(b.__dict__):  # in C, equal objects by `is`
            return False
        ca, cb = a.coll, b.coll
        if ca is None or cb is None:
            return ca is cb
        if ca.key != cb.key or ca.role != cb.role:
            return False
        k = (id(ca.flows), id(cb.flows))
        hit = self.memo.get(k)
        if hit is None:
            hit = self.memo[k] = same_flows(ca.flows, cb.flows, self.perm)
        return hit

    def instrs(self, xs: tuple[Instr, ...], ys: tuple[Instr, ...]) -> bool:
        if xs is ys:
            return True
        if len(xs) != len(ys):
            return False
        for x, y in zip(xs, ys):
            if x is y:
                continue
            if isinstance(x, Launch):
                if not (isinstance(y, Launch) and x.stream == y.stream and self.op(x.op, y.op)):
                    return False
            elif isinstance(x, Graph):
                if not (isinstance(y, Graph) and x.name == y.name and self.instrs(x.body, y.body)):
                    return False
            elif x != y:
                return False
        return True

    def rank(self, a: RankProgram, b: RankProgram) -> bool:
        if (a.streams, a.priorities, len(a.threads)) != (b.streams, b.priorities, len(b.threads)):
            return False
        return all(
            ta.name == tb.name and self.instrs(ta.instrs, tb.instrs)
            for ta, tb in zip(a.threads, b.threads)
        )


#: id(program) -> (weak reference to it, GPUs per node): explicit Programs whose builder proved
#: every rank rank 0 relabeled (``shared.ir.ranks.expand_ranks``, from what it made per rank)
_CERTIFIED: dict[int, tuple[weakref.ref, int]] = {}


def certify_alike(program: Program, gpus_per_node: int) -> None:
    """Record that every rank of ``program`` is rank 0 relabeled by σ_r for nodes of
    ``gpus_per_node`` GPUs, as proven by the pass that built it: :func:`reduce_program` then
    skips matching the ranks instruction by instruction. Held for the life of ``program`` (a
    Program is immutable; a rewritten one is a new object, matched as any other)."""
    key = id(program)

    def forget(ref: weakref.ref, key: int = key) -> None:
        if _CERTIFIED.get(key, (None,))[0] is ref:
            del _CERTIFIED[key]

    _CERTIFIED[key] = (weakref.ref(program, forget), gpus_per_node)


def _certified(program: Program, gpus_per_node: int) -> bool:
    hit = _CERTIFIED.get(id(program))
    return hit is not None and hit[0]() is program and hit[1] == gpus_per_node


def reduce_program(
    program: Program, gpus_per_node: int, *, merge_flows: bool = True
) -> Reduction | str:
    """The quotient of an explicit ``program`` when all its ranks are images of rank 0 under
    the node-preserving relabelings (module docstring), else the reason it is not."""
    world = program.world
    if program.symmetric:
        return "the program is symmetric already"
    if [rp.rank for rp in program.ranks] != list(range(world)):
        return "ranks are not 0..world-1"
    sigma = relabeling(world, gpus_per_node)
    if sigma is None:
        return f"{world} ranks do not fill nodes of {gpus_per_node} GPUs"
    r0 = program.ranks[0]
    if not _certified(program, min(gpus_per_node, world)):
        for rp in program.ranks[1:]:
            if not _Matcher([sigma(rp.rank, d) for d in range(world)]).rank(r0, rp):
                return f"rank {rp.rank} differs from rank 0 under the node-preserving relabeling"
    bundles: dict[tuple, dict[str, int]] = {}
    seen: dict[tuple, Op] = {}
    whole = _whole_kinds(r0) if merge_flows else frozenset()

    def strip(ins: Instr) -> Instr:
        if isinstance(ins, Graph):
            return Graph(ins.name, tuple(strip(b) for b in ins.body))
        if not isinstance(ins, Launch) or ins.op.coll is None:
            return ins
        op, c = ins.op, ins.op.coll
        if not any(f.dst is not None for f in c.flows):
            return ins
        if any(f.dst is not None and not 0 <= f.dst < world for f in c.flows):
            raise _Ambiguous("a flow to no rank")
        key = (op.name, op.mb, op.layer, op.step)
        if key in seen and seen[key] != op:
            raise _Ambiguous(f"two different ops share the link span key {key}")
        seen[key] = op
        counts = Counter(f.link for f in c.flows)
        bundles[key] = {k: 1 if k in whole else n for k, n in counts.items()}
        firsts: dict[str, int] = {}
        for i, f in enumerate(c.flows):
            firsts.setdefault(f.link, i)
        flows = tuple(
            Flow(f.link, f.nbytes * counts[f.link]) if f.link in whole else Flow(f.link, f.nbytes)
            for i, f in enumerate(c.flows)
            if f.link not in whole or i == firsts[f.link]
        )
        return Launch(replace(op, coll=Coll(c.key, c.role, flows)), ins.stream)

    try:
        threads = tuple(
            HostThread(th.name, tuple(strip(i) for i in th.instrs)) for th in r0.threads
        )
    except _Ambiguous as e:
        return str(e.args[0])
    meta = program.meta
    quotient = Program(
        (RankProgram(0, r0.streams, threads, r0.priorities),),
        world=world,
        symmetric=True,
        meta=meta,
    )
    why = (
        f"all {world} ranks are rank 0 relabeled (nodes of {min(gpus_per_node, world)} GPUs): "
        "simulated once"
    )
    return Reduction(quotient, world, bundles, why)


class _Ambiguous(Exception):
    """Rank 0's program cannot stand for the others (the message says why)."""


def _whole_kinds(rp: RankProgram) -> frozenset[str]:
    """Link kinds whose flows the quotient may send as one flow per op: every op sending over
    the kind sends the same number n of flows over it, all of one size. On a ``Link`` shared
    equally per flow, n such flows progress and end exactly as one of n times the bytes given n
    times the share, which is what one flow among ops of one flow each gets: the same run with
    n times fewer flows to simulate (to float round-off: n·b/(bw/J) for b/(bw/(n·J)))."""
    counts: dict[str, set[int]] = defaultdict(set)
    uneven: set[str] = set()
    for th in rp.threads:
        for ins in iter_gpu_instrs(th.instrs):
            if not isinstance(ins, Launch) or ins.op.coll is None or ins.op.coll.role == "recv":
                continue
            sizes: dict[str, set[float]] = defaultdict(set)
            per: Counter = Counter()
            for f in ins.op.coll.flows:
                sizes[f.link].add(f.nbytes)
                per[f.link] += 1
            for k, n in per.items():
                counts[k].add(n)
                if len(sizes[k]) > 1:
                    uneven.add(k)
    return frozenset(k for k, c in counts.items() if len(c) == 1 and k not in uneven)


def expand_trace(trace: Trace, red: Reduction) -> Trace:
    """The quotient run's ``trace`` as the explicit run's: rank 0's spans on every rank, with
    per-flow link spans merged into one span per op and link kind, as the network draws them.
    The other ranks' copies are made when read (:meth:`Trace.replicated`): the per-rank
    figures and the Chrome export read rank 0's spans alone."""
    spans: list[Span] = []
    groups: dict[tuple, list[Span]] = defaultdict(list)
    for s in trace.spans:
        kind = s.lane[5:] if s.lane.startswith("link:") else None
        if kind in NET_LINK_KINDS and (s.op, s.mb, s.layer, s.step) in red.bundles:
            groups[(s.lane, s.op, s.mb, s.layer, s.step, s.start)].append(s)
        else:
            spans.append(s)
    for (lane, *key, _), group in groups.items():
        n = red.bundles[tuple(key)].get(lane[5:], 0)
        if n == 0 or len(group) % n:
            raise AssertionError(f"link spans of {key} do not form bundles of {n}")
        first = group[0]
        merged = Span(first.rank, lane, first.op, "link", first.start, max(s.end for s in group),
                      0, *key[1:])  # fmt: skip
        spans += [merged] * (len(group) // n)
    spans.sort(key=_canonical_key)
    meta = dict(trace.meta)
    meta.update(symmetric=False, world=red.world, reduction=f"reduced: {red.why}")
    if not spans:
        return Trace((), meta)
    return Trace.replicated(tuple(spans), tuple(range(red.world)), meta)
