"""DeepEP's two kernel families as traffic: which bytes go from which rank to which, over what.

Low-latency kernels (``internode_ll.cu``): every rank writes each (token, expert) copy straight
into the receiving rank's buffer, one message per copy, no deduplication; peers inside the node
over NVLink (``allow_nvlink_for_low_latency_mode``, on by default), others over RDMA from the
sender's own NIC. The send kernel holds ``ll_num_sms`` SMs; the receive hook holds none while the
data flies (``shared.ops``).

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

import numpy as np

from overlap_lab.shared.ops import expected_bytes
from overlap_lab.shared.program import LinkKind
from overlap_lab.shared.routing import Matrices
from overlap_lab.shared.topology import Topology

LINKS = (LinkKind.NVLINK, LinkKind.RDMA)
__all__ = ["LINKS", "byte_matrices", "expected_bytes"]


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
