"""Lowering pass: a symmetric one-rank Program -> every EP rank explicit, with its own work.

Schedules emit one rank and mark the Program symmetric: every rank is assumed to do the same,
and a flow with ``dst=None`` stands for the identical flow of the mirror peer. ``expand_ranks``
turns that into ``ep`` rank programs driven by the batch's actual routing (``shared.inputs.routing``):

- each rank gets the same instruction sequence (the schedule is the same on every rank);
- ``dispatch_*`` / ``combine_*`` issue halves get one flow per destination rank, from the routing
  and DeepEP's kernel family (``shared.ir.deepep``: low-latency sends a copy per (token, expert);
  normal kernels dedup per rank and, across nodes, send one RDMA copy per node then forward over
  NVLink); an op that the schedule split (SBO's pieces) keeps its share of the bytes;
- ``experts`` runs on the token copies the rank receives and reads the weights of its local
  experts that receive any, so a hot rank computes longer and every collective after it waits;
  the memory-bound passes around it (``experts.scatter``, ``experts.act``, ...) move bytes in
  proportion to those copies;
- DeepEP normal mode's notify kernels (``notify_dispatch``, ``cached_notify``: collectives whose
  key ends in ``_notify``) get a small flow to every other rank (NVLink inside the node, RDMA
  across nodes), so each completes only when every peer's notify has arrived: its span holds
  the skew between the ranks;
- under DP attention a rank with fewer real tokens than the padded size all ranks replay
  (``dp_tokens``) computes attention over its real tokens only, and dispatches only those; the
  GEMMs keep the padded shape (CUDA graphs replay one size on every rank).

Other collectives (PP send/recv) keep their mirror flows. The pass is pure: same inputs, same
Program. Balanced routing reproduces the symmetric Program's work and bytes on every rank.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.inputs.routing import Routing
from overlap_lab.shared.inputs.topology import Topology
from overlap_lab.shared.inputs.workload import Workload
from overlap_lab.shared.ir.deepep import LINKS, byte_matrices, expected_bytes
from overlap_lab.shared.ir.ops import (
    attn_work,
    combine_bytes_per_copy,
    dispatch_bytes_per_copy,
    experts_work,
    gqa_core,
    mla_core,
    routed_experts,
)
from overlap_lab.shared.ir.program import (
    Flow,
    Graph,
    HostThread,
    Launch,
    Op,
    Program,
    RankProgram,
)
from overlap_lab.shared.ir.symmetry import certify_alike, relabeling, same_flows
from overlap_lab.shared.outputs.trace import no_gc


def expand_ranks(program: Program, w: Workload, gpu: GPU, routing: Routing) -> Program:
    """The symmetric ``program`` replicated over ``w.parallel.ep`` ranks with per-rank work.

    Before (symmetric, one rank)::

        rank 0:  launch main dispatch_a coll=K:send flow=rdma:sym:B   ...  launch main experts W

    After (ep ranks, symmetric=False)::

        rank r:  launch main dispatch_a coll=K:send flow=nvlink:d:B_rd ... (one flow per peer d)
                 ...  launch main experts W_r   (from the copies rank r receives)
    """
    if not program.symmetric or len(program.ranks) != 1:
        raise ConfigError("expand_ranks takes a symmetric one-rank program")
    ep = w.parallel.ep
    if routing.cfg.ep != ep or len(routing.dp_tokens) != ep:
        raise ConfigError(f"routing is for ep {routing.cfg.ep}, the workload for ep {ep}")
    lw = _Lowering(program, w, gpu, routing)
    with no_gc():  # tens of thousands of acyclic objects (see shared.outputs.trace.no_gc)
        ranks = tuple(lw.rank(r) for r in range(ep))
        alike = lw.alike()
    meta = program.meta.merged(
        ranks="explicit",
        imbalance=str(routing.cfg.imbalance),
        routing_seed=routing.cfg.seed,
        dp_tokens=list(routing.dp_tokens),
    )
    out = Program(ranks, world=ep, symmetric=False, meta=meta)
    if alike:  # proven here: shared.ir.symmetry.reduce_program need not match every rank
        certify_alike(out, lw.topo.gpus_per_node)
    return out


def _evolve(obj, **changes):
    """``dataclasses.replace(obj, **changes)`` for the Program's frozen dataclasses without its
    per-call field walk and ``__init__`` (an EP-32 lowering makes thousands; Op, Coll and Launch
    have no ``__post_init__`` to run): a copy of ``obj``'s ``__dict__``, changed."""
    d = obj.__dict__.copy()
    d.update(changes)
    new = object.__new__(type(obj))
    object.__setattr__(new, "__dict__", d)
    return new


class _Lowering:
    def __init__(self, program: Program, w: Workload, gpu: GPU, routing: Routing):
        self.rp, self.w, self.gpu, self.routing = program.ranks[0], w, gpu, routing
        p = w.parallel
        self.topo = Topology(p.ep, min(p.gpus_per_node, p.ep))
        n = w.batch.num_tokens
        self.mbs = {m["index"]: (m["tok_lo"], m["tok_hi"], m["padded_tokens"])
                    for m in program.meta.micro_batches or ()}  # fmt: skip
        self.whole = (0, n, n)
        self._bytes: dict[tuple, tuple] = {}
        self._flows: dict[tuple, tuple[Flow, ...]] = {}  # one rank's flows: shared by its ops
        self._experts_ops: dict[tuple, Op] = {}
        self._plans: dict[int, tuple | None] = {}  # id(op) -> _plan(op); the Program holds op
        self._recv: dict[int, tuple] = {}
        self._site_cache: dict[int, list] = {}  # id(instrs) -> _sites(instrs), likewise held
        self._by_op: dict[int, list[Op]] = {}  # id(op) -> op per rank, likewise held
        self._by_launch: dict[int, list[Launch]] = {}  # id(launch) -> launch per rank
        self._attn_ops: dict[tuple, Op] = {}

    # -- per op ---------------------------------------------------------------------------------

    def _range(self, op: Op) -> tuple[int, int, int]:
        lo, hi, padded = self.mbs.get(op.mb, self.whole)
        return lo, hi, max(padded, op.tokens)

    def _matrices(self, op: Op):
        lo, hi, _ = self._range(op)
        return self.routing.layer(op.layer).matrices(lo, hi)

    def op(self, op: Op, r: int) -> Op:
        """``op`` as rank ``r`` runs it (the same object when nothing of it is per rank)."""
        return self._versions(op)[r]

    def _versions(self, op: Op) -> list[Op]:
        """``op`` as each rank runs it, worked out once per op of the symmetric Program (its
        ops are shared by every rank); ranks that run it alike share one object."""
        versions = self._by_op.get(id(op))
        if versions is not None:
            return versions
        plan = self._plan_of(op)
        ep = len(self.routing.dp_tokens)
        if plan is None:
            versions = [op] * ep
        elif plan[0] == "comm":
            c = op.coll
            versions = [
                _evolve(op, coll=_evolve(c, flows=self._rank_flows(plan[1], plan[2], r)))
                for r in range(ep)
            ]
        elif plan[0] == "experts":
            versions = [self._experts(op, r) for r in range(ep)]
        else:
            versions = [
                self._attention(op, r) if self.routing.dp_tokens[r] < plan[1] else op
                for r in range(ep)
            ]
        self._by_op[id(op)] = versions
        return versions

    def _launches(self, ins: Launch) -> list[Launch]:
        """``ins`` as each rank issues it: itself where the rank runs its op as it is, one
        shared Launch per distinct version of the op otherwise."""
        launches = self._by_launch.get(id(ins))
        if launches is None:
            made: dict[int, Launch] = {id(ins.op): ins}
            launches = []
            for new in self._versions(ins.op):
                hit = made.get(id(new))
                if hit is None:
                    hit = made[id(new)] = _evolve(ins, op=new)
                launches.append(hit)
            self._by_launch[id(ins)] = launches
        return launches

    def _plan_of(self, op: Op) -> tuple | None:
        plan = self._plans.get(id(op), False)
        if plan is False:
            plan = self._plans[id(op)] = self._plan(op)
        return plan

    def _plan(self, op: Op) -> tuple | None:
        """What of ``op`` depends on the rank, worked out once per op of the symmetric Program
        (its ops are shared by every rank): None (nothing), ``("comm", bytes key, ratio)``,
        ``("experts",)`` or ``("attn", tokens a rank must hold to run it whole)``."""
        if op.layer is None:
            return None
        c = op.coll
        if c is not None and c.role != "recv" and c.flows and all(f.dst is None for f in c.flows):
            what = c.key.rsplit(".", 1)[-1]
            if what in ("dispatch", "combine"):
                key, expected = self._byte_key(op, what)
                ratio = sum(f.nbytes for f in c.flows) / expected if expected > 0 else 1.0
                return ("comm", key, ratio)
            if what.endswith("_notify"):
                return ("comm", self._notify_key(c.flows), 1.0)
        if op.name.split(".")[0] == "experts" and (op.flops > 0 or op.hbm_bytes > 0):
            return ("experts",)
        if op.name == "attn.core":
            return ("attn", self._range(op)[1])
        return None

    def _byte_key(self, op: Op, what: str) -> tuple[tuple, float]:
        """The key of ``op``'s byte matrices in ``_bytes`` (computed there once) and the bytes
        one rank sends under balanced routing (what the schedule's flows were sized for)."""
        mode = "low_latency" if op.coll.role == "send" else "normal"
        mats = self._matrices(op)
        padded = self._range(op)[2]
        # balanced routing shares one Matrices object over layers: key on it, not on the layer
        key = (id(mats), padded, what, mode)
        if key not in self._bytes:
            m, h = self.w.model, self.w.model.hidden
            per_copy = (
                dispatch_bytes_per_copy(h) if what == "dispatch" else combine_bytes_per_copy(h)
            )
            p = self.w.parallel
            exp = expected_bytes(padded, p.ep, p.gpus_per_node, m.top_k, mode, per_copy)
            self._bytes[key] = (
                byte_matrices(mats, self.topo, mode, what, per_copy),
                exp["nvlink"] + exp["rdma"],
                mats,  # keeps id(mats) from being reused while the key lives
            )
        return key, self._bytes[key][1]

    def _notify_key(self, flows: tuple[Flow, ...]) -> tuple:
        """The key of a notify kernel's per-peer byte matrices in ``_bytes``: its symmetric
        flows' bytes per link kind, spread over every other rank reached that way (the ranks of
        its node over NVLink, those of the other nodes over RDMA). DeepEP's notify kernels
        exchange over NVLink and the same rail, but a rank's counts (and its barrier) depend on
        every rank through the forwarding GPU of its rail, so it waits for all of them."""
        total = {str(f.link): f.nbytes for f in flows}
        key = ("notify", tuple(sorted(total.items())))
        if key not in self._bytes:
            ranks = np.arange(self.topo.world)
            node = ranks // self.topo.gpus_per_node
            same = node[:, None] == node[None, :]
            nvl = same & ~np.eye(len(ranks), dtype=bool)
            out = {}
            for link, mask in (("nvlink", nvl), ("rdma", ~same)):
                peers = mask.sum(axis=1, keepdims=True)
                per = np.divide(
                    total.get(link, 0.0),
                    peers,
                    where=peers > 0,
                    out=np.zeros_like(peers, dtype=float),
                )
                out[link] = np.where(mask, per, 0.0)
            self._bytes[key] = (out, 0.0, None)
        return key

    def _rank_flows(self, key: tuple, ratio: float, r: int) -> tuple[Flow, ...]:
        """Rank ``r``'s flows of byte matrices ``key`` scaled by ``ratio`` (one tuple shared by
        every op with the same): one per link kind (in ``LINKS`` order) and destination with
        bytes, destinations ascending; every rank's made at once, from each matrix's nonzeros
        (row-major: ranks, then destinations, ascending)."""
        flows = self._flows.get((key, r, ratio))
        if flows is None:
            bmats = self._bytes[key][0]
            per_rank: list[list[Flow]] = [[] for _ in range(self.topo.world)]
            new = object.__new__
            for link in LINKS:
                m = bmats[link]
                rows, cols = m.nonzero()
                for i, d, b in zip(rows.tolist(), cols.tolist(), m[rows, cols].tolist()):
                    # Flow(link, b * ratio, d) without its __init__ (a skewed EP-32 step makes
                    # ~350k flows; Flow has no __post_init__ to run)
                    f = new(Flow)
                    fd = f.__dict__
                    fd["link"], fd["nbytes"], fd["dst"] = link, b * ratio, d
                    per_rank[i].append(f)
            for i, out in enumerate(per_rank):
                self._flows[(key, i, ratio)] = tuple(out)
            flows = self._flows[(key, r, ratio)]
        return flows

    def _experts(self, op: Op, r: int) -> Op:
        m = self._matrices(op)
        per_rank = self._recv.get(id(m))
        if per_rank is None:  # (copies received, active experts) per rank; m keeps its id
            recv, active = m.recv_copies.tolist(), m.active.tolist()
            per_rank = self._recv[id(m)] = (list(zip(recv, active)), m)
        # ranks receiving the same copies get the same op object (balanced: every rank)
        key = (id(op), *per_rank[0][r])
        hit = self._experts_ops.get(key)
        if hit is not None:
            return hit
        _, _, padded = self._range(op)
        if op.op_class == "elementwise":  # a pass over the received copies: scales with them
            nominal = padded * self.w.model.top_k
            f = key[1] / nominal if nominal > 0 else 1.0
            new = _evolve(op, flops=op.flops * f, hbm_bytes=op.hbm_bytes * f)
            self._experts_ops[key] = new
            return new
        nominal = routed_experts(self.w, padded)
        ratio = op.flops / nominal.flops if nominal.flops > 0 else 1.0
        work = experts_work(self.w, key[1], key[2])
        new = _evolve(op, flops=work.flops * ratio, hbm_bytes=work.hbm_bytes * ratio)
        self._experts_ops[key] = new
        return new

    def _attention(self, op: Op, r: int) -> Op:
        lo, hi, _ = self._range(op)
        real_hi = max(lo, min(hi, self.routing.dp_tokens[r]))
        key = (id(op), real_hi)  # ranks holding as many real tokens share one op
        hit = self._attn_ops.get(key)
        if hit is not None:
            return hit
        core = mla_core if self.w.model.attention == "mla" else gqa_core
        b, rows = self.w.batch, op.tokens
        full = core(self.w, attn_work(b, lo, hi), rows)
        real = core(self.w, attn_work(b, lo, real_hi), rows)
        new = self._attn_ops[key] = replace(
            op,
            flops=max(0.0, op.flops - full.flops + real.flops),
            hbm_bytes=max(0.0, op.hbm_bytes - full.hbm_bytes + real.hbm_bytes),
        )
        return new

    # -- symmetry -------------------------------------------------------------------------------

    def alike(self) -> bool:
        """Whether every lowered rank r is rank 0 relabeled by σ_r (``shared.ir.symmetry``),
        decided from what the lowering made per rank rather than by matching every rank's
        instructions: the ranks share every instruction but the launches of ops with a plan,
        and of those, each op's version on rank r must be rank 0's object itself, or, for a
        collective (which differs from rank 0's in its flows alone, by construction), carry
        flows that are rank 0's with destinations mapped through σ_r."""
        ep = len(self.routing.dp_tokens)
        sigma = relabeling(ep, self.topo.gpus_per_node)
        if sigma is None:
            return False
        perms = [[sigma(r, d) for d in range(ep)] for r in range(ep)]
        checked: dict[tuple, bool] = {}
        for op_id, versions in self._by_op.items():
            v0 = versions[0]
            plan = self._plans[op_id]
            if plan is None or plan[0] != "comm":
                if any(v is not v0 for v in versions):
                    return False
                continue
            for r in range(1, ep):
                key = (plan[1], plan[2], r)
                ok = checked.get(key)
                if ok is None:
                    a, b = v0.coll.flows, versions[r].coll.flows
                    ok = checked[key] = same_flows(a, b, perms[r])
                if not ok:
                    return False
        return True

    # -- per rank -------------------------------------------------------------------------------

    def _sites(self, instrs: tuple) -> list[tuple]:
        """Where in ``instrs`` anything may depend on the rank: ``(i, launches, None)`` for a
        launch whose op has a plan (``launches``: it on each rank), ``(i, None, graph)`` for a
        graph with such launches (found once per sequence: every rank copies the rest as it
        is)."""
        key = id(instrs)
        sites = self._site_cache.get(key)
        if sites is None:
            sites = []
            for i, ins in enumerate(instrs):
                if isinstance(ins, Launch):
                    if self._plan_of(ins.op) is not None:
                        sites.append((i, self._launches(ins), None))
                elif isinstance(ins, Graph):
                    if self._sites(ins.body):
                        sites.append((i, None, ins))
            self._site_cache[key] = sites
        return sites

    def _instrs(self, instrs: tuple, r: int) -> tuple:
        sites = self._sites(instrs)
        if not sites:
            return instrs
        out = list(instrs)
        for i, launches, graph in sites:
            if launches is not None:
                out[i] = launches[r]
            else:
                body = self._instrs(graph.body, r)
                if body is not graph.body:
                    out[i] = Graph(graph.name, body)
        return tuple(out)

    def rank(self, r: int) -> RankProgram:
        threads = tuple(HostThread(th.name, self._instrs(th.instrs, r)) for th in self.rp.threads)
        return RankProgram(r, self.rp.streams, threads, self.rp.priorities)
