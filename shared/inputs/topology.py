"""Where ranks sit and which link a transfer between two of them takes.

Ranks are placed on nodes in order (rank r on node r // gpus_per_node, local index
r % gpus_per_node), as torchrun and DeepEP number them. Inside a node every pair of GPUs is
connected by NVLink (an NVSwitch: full bandwidth between any pair); across nodes a GPU reaches
another through its own NIC (one RDMA NIC per GPU, a rail-optimised fabric without core
congestion). A transfer to oneself stays in HBM ("local"). Bandwidth and latency per link kind
come from the GPU preset (``GPU.link_bytes_per_us``); the simulator gives every rank one
egress and one ingress port per link kind (``sim.network``).
"""

from __future__ import annotations

from dataclasses import dataclass

from overlap_lab.shared.errors import ConfigError

PATH_KINDS = ("local", "nvlink", "rdma")


@dataclass(frozen=True)
class Topology:
    """``world`` ranks on nodes of ``gpus_per_node`` GPUs (the last node may be partial)."""

    world: int
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        for k in ("world", "gpus_per_node"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"topology: {k} must be a positive integer, got {v!r}")

    @property
    def num_nodes(self) -> int:
        return -(-self.world // self.gpus_per_node)

    def node(self, rank: int) -> int:
        self._check(rank)
        return rank // self.gpus_per_node

    def local_index(self, rank: int) -> int:
        self._check(rank)
        return rank % self.gpus_per_node

    def ranks_of_node(self, node: int) -> range:
        lo = node * self.gpus_per_node
        return range(lo, min(lo + self.gpus_per_node, self.world))

    def path(self, src: int, dst: int) -> str:
        """The link kind a transfer from ``src`` to ``dst`` crosses: local, nvlink or rdma."""
        if src == dst:
            self._check(src)
            return "local"
        return "nvlink" if self.node(src) == self.node(dst) else "rdma"

    def peer_on_node(self, rank: int, node: int) -> int:
        """The GPU of ``node`` with ``rank``'s local index: DeepEP's RDMA peer (same rail)."""
        r = node * self.gpus_per_node + self.local_index(rank)
        if r >= self.world:
            raise ConfigError(f"topology: node {node} has no GPU with local index of rank {rank}")
        return r

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise ConfigError(f"topology: rank {rank} outside 0..{self.world - 1}")
