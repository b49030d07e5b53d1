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
    "below_published_sms",
    "Release",
    "byte_matrices",
    "deepep_normal_fraction",
    "deepep_normal_rate",
    "expected_bytes",
]


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


RELEASES: dict[str, Release] = {
    "v1": Release(
        "v1",
        "2025-02",
        {"nvlink": 134.0, "rdma": 46.0},
        {"nvlink": 24, "rdma": 24},
        (
            "DeepEP docs/legacy.md (V1 README), 'Normal kernels with NVLink and RDMA forwarding': "
            "H800 + CX7, 4096 tokens, intranode EP 8 153 GB/s dispatch / 158 combine (NVLink), "
            "internode EP 16/32/64 43/58/51 GB/s dispatch (RDMA)",
            "153 GB/s counts the rank's own 1/8: 153 x 7/8 = 134 GB/s over the links; RDMA 46 GB/s "
            "within the 43-58 of the table (the h800 preset's rdma_eff_gbps)",
            "the V1 tables' SM count: Buffer.set_num_sms(24) in the V1 README's example and "
            "num_sms = 24 in V1's tests/test_intranode.py and tests/test_internode.py, whose "
            "tuning runs and prints 'SMs 24' only",
            "the V2 README: 'For V3-like legacy training, SM usage reduced from 24 to 4 - 6'",
        ),
        "V1 publishes no table below 24 SMs (its tuning runs at 24 only): below 24 the rate "
        "proportional to the SMs is this model's assumption.",
    ),
    "v2": Release(
        "v2",
        "2026-04",
        {"nvlink": 134.0, "rdma": 46.0},
        {"nvlink": 6, "rdma": 6},
        (
            "DeepEP README (EPv2, github.com/deepseek-ai/DeepEP PR #605 'Introducing EPv2', "
            "2026-04), Performance: SM90 CX7 EP 8 x 4: 61 GB/s dispatch / 61 combine (RDMA, "
            "logical: own node included) on 6 SMs, i.e. 61 x 3/4 = 46 GB/s over the NIC; EP 8 x 2: "
            "90 / 81 GB/s on 12 SMs (90 x 1/2 = 45 over the NIC)",
            "NVLink on SM90 has no V2 row; SM100 EP 8 reaches 643 GB/s (logical) on 24 SMs "
            "(its 'Min #SM' row), 643 x 7/8 / 24 = 23 GB/s per SM over the links, so H800's 134 "
            "GB/s needs 6 SMs at that rate (an estimate carried from SM100)",
        ),
        "the RDMA row's 6 SMs is V2's analytic choice at EP 32 (get_theoretical_num_sms); the "
        "NVLink figure is an estimate from the SM100 row.",
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


def byte_matrices(
    m: Matrices, topo: Topology, mode: str, what: str, per_copy: float
) -> dict[str, np.ndarray]:
    """Bytes from rank s (row) to rank d (column) over NVLink and RDMA, for dispatch or combine.

    Local copies (s == d) stay in HBM and appear in neither matrix."""
    r, g = topo.world, topo.gpus_per_node
    ranks = np.arange(r)
    node = ranks // g
    same_node = node[:, None] == node[None, :]
    off = ~np.eye(r, dtype=bool)
    if mode == "low_latency" or topo.num_nodes == 1:
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
