"""DeepEP's two kernel families as traffic: which bytes go from which rank to which, over what.

Low-latency kernels (``internode_ll.cu``): every rank writes each (token, expert) copy straight
into the receiving rank's buffer, one message per copy, no deduplication; peers inside the node
over NVLink (``allow_nvlink_for_low_latency_mode``, on by default), others over RDMA from the
sender's own NIC. The send kernel holds ``ll_num_sms`` SMs; the receive hook holds none while the
data flies (``shared.ir.ops``).

Normal (high-throughput) kernels: a token goes once to each rank that holds any of its experts
(deduplicated per rank). Inside one node (``intranode.cu``) that copy crosses NVLink. Across
nodes (``internode.cu``) a token crosses RDMA once per destination *node*, to the GPU of that node
with the sender's local index (same rail), which forwards it over NVLink to the GPUs of its node
that need it; RDMA and NVLink stages are pipelined in chunks, so both start with the kernel. The
kernel holds ``gpu.deepep_normal_sms`` SMs, and a dispatch without a cached handle makes the CPU
wait for the received-token counts (the schedules emit that host sync: ``normal_comm``).

Combine moves the same copies backwards (BF16 instead of FP8 + scales): its byte matrix is the
transpose of dispatch's, scaled by the per-copy size.

DeepEP's published rates are logical: its tests divide bytes that include the token's own rank
(intranode: every received byte, ``recv_x``) or its own node (internode: ``num_rdma_token_sent``
counts every (token, node) pair, the sender's node included; low-latency: every (token, expert)
selection) by the kernel's time. What crosses a link is less: the model's rates are those
figures converted to the bytes that cross it (:func:`link_share`) under the routing the tests
draw (:func:`readme_routing`), one README table at a time (:class:`Table`, ``Release.tables``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from overlap_lab.shared.inputs.routing import Matrices
from overlap_lab.shared.inputs.topology import Topology
from overlap_lab.shared.ir.ops import expected_bytes
from overlap_lab.shared.ir.program import DEEPEP_CLASS, LinkKind, Program, ops_of

LINKS = (LinkKind.NVLINK, LinkKind.RDMA)
__all__ = [
    "LINKS",
    "RELEASES",
    "Table",
    "ll_over_rdma",
    "link_share",
    "logical_bytes",
    "nic_gbps",
    "readme_routing",
    "below_published_sms",
    "Release",
    "byte_matrices",
    "deepep_normal_fraction",
    "deepep_normal_rate",
    "expected_bytes",
]


@dataclass(frozen=True)
class Table:
    """DeepEP's H800 + CX7 performance table as one README states it on its date.

    ``normal``: (EP, dispatch, combine) bottleneck bandwidths in GB/s, logical as the tests count
    them (module docstring), 4096 tokens per rank, FP8 dispatch and BF16 combine, on ``sms``
    SMs; EP 8 is intranode (NVLink), larger EPs internode. ``low_latency``: (EP, dispatch,
    combine) latencies in µs, 128 tokens per rank; ``ll_nvlink``: whether the low-latency
    kernels reached the peers of their node over NVLink (PR #173, 2025-06) or over RDMA."""

    date: str
    commit: str
    normal: tuple[tuple[int, float, float], ...]
    low_latency: tuple[tuple[int, float, float], ...]
    ll_nvlink: bool
    sms: int = 24
    #: tokens per rank of the normal rows, and whether their routing is group-limited to
    #: min(nodes, 4) nodes (V1's tests/test_internode.py; V2's tests/elastic/test_ep.py is not)
    tokens: int = 4096
    group_limited: bool = True
    #: the internode rows whose time the NIC bounds (by the model's byte accounting: at EP 16
    #: NVLink forwarding carries ~5.6 times the NIC's bytes, so that row bounds NVLink)
    nic_rows: tuple[int, ...] = (32, 64)

    @property
    def source(self) -> str:
        return f"DeepEP README at {self.commit} ({self.date})"


_LL_2025_02 = ((8, 163, 318), (16, 173, 329), (32, 182, 350), (64, 186, 353), (128, 192, 369),
               (256, 194, 360))  # fmt: skip
_NORMAL_2025_04 = ((8, 153, 158), (16, 43, 43), (32, 58, 57), (64, 51, 50))
#: The V1 line's tables, as each README states them: the first README (pure-RDMA low-latency
#: kernels), after the internode optimisation (IBGDA, a QP per channel; PR #130), and after the
#: low-latency kernels took NVLink for peers of their node (PR #173), which DeepEP's docs/legacy.md keeps.
V1_TABLES: tuple[Table, ...] = (
    Table("2025-02-24", "ebfe47e", ((8, 153, 158), (16, 43, 43), (32, 44, 47), (64, 46, 45)),
          _LL_2025_02, ll_nvlink=False),
    Table("2025-04-22", "3b1045d", _NORMAL_2025_04, _LL_2025_02, ll_nvlink=False),
    Table("2025-06-05", "de8cfca", _NORMAL_2025_04,
          ((8, 77, 114), (16, 118, 195), (32, 155, 273), (64, 173, 314), (128, 192, 369),
           (256, 194, 360)), ll_nvlink=True),
)  # fmt: skip


@dataclass(frozen=True)
class Release:
    """What one DeepEP release's normal (high-throughput) kernels reach, and on how many SMs.

    ``gbps``: the over-the-link rate per GPU and direction its published table shows on H800 +
    CX7 (the figure the h800 preset's ``*_eff_gbps`` carry). ``saturating_sms``: the fewest SMs
    that table (or README row) reached it with. Below that the kernel's channels, not the link,
    bound it: the model takes the rate proportional to the SMs (a channel is a fixed pair of SMs
    moving its share of the tokens), which is an assumption where the release publishes no row
    below that count (each ``notes`` says where)."""

    name: str
    date: str
    gbps: dict[str, float]
    saturating_sms: dict[str, int]
    sources: tuple[str, ...]
    notes: str = ""
    #: its published tables by README date, the last one what ``gbps`` is converted from
    tables: tuple[Table, ...] = ()


RELEASES: dict[str, Release] = {
    "v1": Release(
        "v1",
        "2025-02",
        {"nvlink": 134.0, "rdma": 44.0},
        {"nvlink": 24, "rdma": 24},
        (
            "DeepEP README of 2025-06-05 (de8cfca; docs/legacy.md keeps it), 'Normal kernels with "
            "NVLink and RDMA forwarding': H800 + CX7, 4096 tokens, intranode EP 8 153 GB/s "
            "dispatch / 158 combine (NVLink), internode EP 16/32/64 43/58/51 GB/s dispatch, "
            "43/57/50 combine (RDMA), figures of 2025-04-22 (3b1045d, after PR #130)",
            "153 GB/s counts the rank's own 1/8: 153 x 7/8 = 134 GB/s over the links. The RDMA "
            "figures count the sender's own node (num_rdma_token_sent in tests/test_internode.py): "
            "under the test's routing 3/4 of those bytes cross the NIC at EP 32 and 7/8 at EP 64, "
            "so 58/57 and 51/50 GB/s are 43.5/42.8 and 44.6/43.8 GB/s over the NIC, 44 GB/s (the "
            "h800 preset's rdma_eff_gbps; shared.ir.deepep.nic_gbps)",
            "the V1 tables' SM count: Buffer.set_num_sms(24) in the V1 README's example and "
            "num_sms = 24 in V1's tests/test_intranode.py and tests/test_internode.py, whose "
            "tuning runs and prints 'SMs 24' only",
            "the V2 README: 'For V3-like legacy training, SM usage reduced from 24 to 4 - 6'",
        ),
        "V1 publishes no table below 24 SMs (its tuning runs at 24 only): below 24 the rate "
        "proportional to the SMs is this model's assumption. Its first README (2025-02-24) "
        "published 44/46 GB/s at EP 32/64, 33-40 GB/s over the NIC (V1_TABLES).",
        V1_TABLES,
    ),
    "v2": Release(
        "v2",
        "2026-04",
        {"nvlink": 134.0, "rdma": 44.0},
        {"nvlink": 6, "rdma": 6},
        (
            "DeepEP README (EPv2, github.com/deepseek-ai/DeepEP PR #605 'Introducing EPv2', "
            "2026-04), Performance: SM90 CX7 EP 8 x 4: 61 GB/s dispatch / 61 combine (RDMA, "
            "logical: own node included) on 6 SMs, i.e. 61 x 3/4 = 46 GB/s over the NIC; EP 8 x 2: "
            "90 / 81 GB/s on 12 SMs (x 1/2: 45 / 40.5 over the NIC); 44 GB/s the mean of the four "
            "(shared.ir.deepep.nic_gbps, under uniform routing: its test limits no groups)",
            "NVLink on SM90 has no V2 row; SM100 EP 8 reaches 643 GB/s (logical) on 24 SMs "
            "(its 'Min #SM' row), 643 x 7/8 / 24 = 23 GB/s per SM over the links, so H800's 134 "
            "GB/s needs 6 SMs at that rate (an estimate carried from SM100)",
        ),
        "the RDMA row's 6 SMs is V2's analytic choice at EP 32 (get_theoretical_num_sms); the "
        "NVLink figure is an estimate from the SM100 row.",
        (
            Table(
                "2026-04-30",
                "b306af0",
                ((16, 90, 81), (32, 61, 61)),
                (),
                ll_nvlink=True,
                sms=6,
                tokens=8192,
                group_limited=False,
                nic_rows=(16, 32),
            ),
        ),  # fmt: skip
    ),
}


def deepep_normal_fraction(release: str, sms: int, link: str) -> float:
    """The share of the link rate a normal DeepEP kernel on ``sms`` SMs reaches (1 at or above
    the release's saturating SM count, proportional below it)."""
    r = RELEASES[release]
    return min(1.0, max(sms, 0) / r.saturating_sms[str(link)])


def below_published_sms(program: Program, release: str) -> str | None:
    """A note when ``program`` runs DeepEP normal kernels on fewer SMs than ``release``'s
    published rates were measured on: their rate there is this model's assumption (proportional
    to the SMs), and a result that depends on it must say so. None when every kernel holds
    enough."""
    r = RELEASES[release]
    low = sorted(
        {
            op.sms
            for _, op in ops_of(program)
            if op.kind == "comm"
            and op.op_class == DEEPEP_CLASS
            and op.coll is not None
            and op.coll.role == "sendrecv"
            and op.sms
            and any(op.sms < r.saturating_sms[str(f.link)] for f in op.coll.flows)
        }
    )
    if not low:
        return None
    published = ", ".join(f"{k} {v}" for k, v in r.saturating_sms.items())
    return (
        f"DeepEP {r.name} normal kernels on {', '.join(map(str, low))} SMs: below the SMs its "
        f"published rates were measured on ({published}), their rate is assumed proportional to "
        "the SMs"
    )


def deepep_normal_rate(release: str, sms: int, link: str, link_gbps: float | None = None) -> float:
    """GB/s per GPU and direction that DeepEP ``release``'s normal kernels move over ``link``
    (``nvlink`` or ``rdma``) holding ``sms`` SMs: the link's achievable rate (``link_gbps``,
    default the release's published H800 + CX7 figure) where the kernel holds enough SMs,
    proportionally less below. DeepSeek's prefill on V1 with 8 communication SMs thus moves RDMA
    traffic at 46 x 8/24 = 15 GB/s, a third of what its 24 SMs reach."""
    base = RELEASES[release].gbps[str(link)] if link_gbps is None else link_gbps
    return base * deepep_normal_fraction(release, sms, link)


def readme_routing(ep: int, tokens: int, normal: bool, seed: int = 0, group_limited: bool = True):
    """The routing DeepEP's V1 tests draw for its tables: uniform random scores (``randn().abs()
    + 1``), top-8 of 256 experts (DeepSeek-V3's; the low-latency test's 288 divide no EP above
    32), for the normal kernels limited to the experts of min(nodes, 4) nodes, the top-4 groups
    of tests/test_internode.py with a group per node. A ``shared.inputs.routing.Routing``."""
    from overlap_lab.shared.inputs.routing import Imbalance, Routing, RoutingConfig

    nodes = max(1, ep // 8)
    group = normal and group_limited and nodes > 1
    cfg = RoutingConfig(
        256, 8, ep, 8, Imbalance("zipf", 0.0), seed,
        group_limited=group, n_group=nodes if group else 1, topk_group=min(4, nodes),
    )  # fmt: skip
    return Routing(cfg, (tokens,) * ep)


def logical_bytes(m: Matrices, topo: Topology, mode: str, per_copy: float) -> np.ndarray:
    """Per source rank, the bytes DeepEP's tests divide by the kernel's time: normal intranode,
    every byte a rank receives (``recv_x``, its own included: per destination rank); normal
    internode, every (token, node) pair, the sender's node included (``num_rdma_token_sent``);
    low-latency, every (token, expert) selection (``num_selections``)."""
    if mode == "low_latency":
        return m.copies.sum(axis=1) * per_copy
    if topo.num_nodes == 1:
        return m.tokens.sum(axis=0) * per_copy
    return m.node_tokens.sum(axis=1) * per_copy


def link_share(m: Matrices, topo: Topology, mode: str, link: str, ll_nvlink: bool = True) -> float:
    """The share of the logical bytes (:func:`logical_bytes`) that cross ``link`` (all ranks
    together): what converts a published logical rate into the link's."""
    mats = byte_matrices(m, topo, mode, "dispatch", 1.0, ll_nvlink)
    crossed = float(mats[link].sum())
    return crossed / float(logical_bytes(m, topo, mode, 1.0).sum())


def nic_gbps(table: Table, seeds: tuple[int, ...] = (0, 1, 2)) -> dict[int, tuple[float, float]]:
    """Per NIC-bound internode row of ``table`` (``Table.nic_rows``): its dispatch and combine
    figures converted to GB/s over the NIC (:func:`link_share` under :func:`readme_routing`,
    the mean over ``seeds``)."""
    out = {}
    for ep, d, c in table.normal:
        if ep not in table.nic_rows:
            continue
        topo = Topology(ep, min(8, ep))
        shares = [
            link_share(
                readme_routing(ep, table.tokens, True, seed, table.group_limited)
                .layer(0)
                .matrices(),
                topo,
                "normal",
                "rdma",
            )
            for seed in seeds
        ]
        f = sum(shares) / len(shares)
        out[ep] = (d * f, c * f)
    return out


def ll_over_rdma(program: Program) -> Program:
    """``program`` with its low-latency kernels' NVLink flows sent over RDMA instead: DeepEP's
    low-latency kernels before PR #173 (2025-06), which reached the peers of their own node
    through the NIC too (:func:`byte_matrices` with ``ll_nvlink`` False gives the same bytes)."""
    from dataclasses import replace

    from overlap_lab.shared.ir.program import Flow, map_ops

    def over_rdma(op):
        c = op.coll
        if c is None or op.op_class != DEEPEP_CLASS or c.role != "send" or not c.flows:
            return op
        merged: dict = {}
        for f in c.flows:
            merged[f.dst] = merged.get(f.dst, 0.0) + f.nbytes
        flows = tuple(Flow(LinkKind.RDMA, b, d) for d, b in merged.items())
        return replace(op, coll=replace(c, flows=flows))

    return map_ops(program, over_rdma)


def byte_matrices(
    m: Matrices, topo: Topology, mode: str, what: str, per_copy: float, ll_nvlink: bool = True
) -> dict[str, np.ndarray]:
    """Bytes from rank s (row) to rank d (column) over NVLink and RDMA, for dispatch or combine.

    Local copies (s == d) stay in HBM and appear in neither matrix. ``ll_nvlink`` False: the
    low-latency kernels before DeepEP PR #173 (2025-06), which reached every peer over RDMA."""
    r, g = topo.world, topo.gpus_per_node
    ranks = np.arange(r)
    node = ranks // g
    same_node = node[:, None] == node[None, :]
    off = ~np.eye(r, dtype=bool)
    if mode == "low_latency" and not ll_nvlink:
        nvl = np.zeros((r, r))
        rdma = np.where(off, m.copies, 0.0)
    elif mode == "low_latency" or topo.num_nodes == 1:
        units = m.copies if mode == "low_latency" else m.tokens
        nvl = np.where(same_node & off, units, 0.0)
        rdma = np.where(~same_node, units, 0.0)
    else:
        local = ranks % g
        # tokens each local index's sources send to each rank: what that rail's GPU forwards
        per_rail = np.zeros((g, r))
        np.add.at(per_rail, local, m.tokens)
        nvl = np.where(same_node & off, per_rail[local], 0.0)
        rdma = np.zeros((r, r))
        for n in range(topo.num_nodes):
            peers = n * g + local  # same-rail GPU on node n of every source
            ok = (node != n) & (peers < r)
            rdma[ranks[ok], peers[ok]] = m.node_tokens[ok, n]
    if what == "combine":
        nvl, rdma = nvl.T, rdma.T
    return {"nvlink": nvl * per_copy, "rdma": rdma * per_copy}
