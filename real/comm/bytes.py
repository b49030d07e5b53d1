"""Byte accounting of DeepEP's all-to-alls, as pure functions (no torch), so the emulated
backend's link time and the CPU tests use one formula.

Message sizes follow DeepEP V1.2.1:
- low-latency dispatch sends one message per (token, expert) pair:
  ``sizeof(int4)`` header + hidden FP8 bytes + hidden/128 float scales (``use_fp8``), or
  hidden BF16 bytes (csrc/kernels/internode_ll.cu, ``num_bytes_per_msg``);
- low-latency combine sends one BF16 hidden row back per (token, expert) pair;
- normal dispatch sends each token once per destination *rank* (deduplicated), with its top-k
  indices (int64) and weights (float32) and, with FP8, the per-128 scales;
- normal combine sends one BF16 row back per (token, destination rank).
Traffic to the sender itself stays in HBM; traffic to a peer in the same node goes over NVLink,
to other nodes over RDMA.
"""

from __future__ import annotations

from dataclasses import dataclass

LL_HEADER_BYTES = 16  # sizeof(int4)
KINDS = ("ll_dispatch", "ll_combine", "normal_dispatch", "normal_combine")


def message_bytes(kind: str, hidden: int, *, use_fp8: bool = False, num_topk: int = 0) -> int:
    """Bytes of one message (one row) of ``kind``."""
    scales = (hidden // 128) * 4 if use_fp8 else 0
    payload = hidden + scales if use_fp8 else 2 * hidden
    if kind == "ll_dispatch":
        return LL_HEADER_BYTES + payload
    if kind == "ll_combine":
        return 2 * hidden
    if kind == "normal_dispatch":
        return payload + num_topk * (8 + 4)
    if kind == "normal_combine":
        return 2 * hidden
    raise ValueError(f"unknown all-to-all kind {kind!r}; choose from {KINDS}")


@dataclass(frozen=True)
class ByteCount:
    """Bytes one rank sends in one all-to-all, by where they go."""

    local: int  # to itself (HBM copy)
    nvlink: int
    rdma: int
    messages: int

    @property
    def remote(self) -> int:
        return self.nvlink + self.rdma


def rows_per_rank(
    topk_idx: list[list[int]], num_experts: int, world: int, *, dedup: bool
) -> list[int]:
    """Messages this rank sends to each rank: per (token, expert) pair, or per (token, rank)
    when ``dedup`` (normal mode). Negative expert ids (masked slots) send nothing."""
    per = num_experts // world
    out = [0] * world
    for row in topk_idx:
        dsts = [e // per for e in row if e >= 0]
        for d in set(dsts) if dedup else dsts:
            out[d] += 1
    return out


def all_to_all_bytes(
    kind: str,
    topk_idx: list[list[int]],
    *,
    num_experts: int,
    rank: int,
    world: int,
    hidden: int,
    gpus_per_node: int = 8,
    use_fp8: bool = False,
) -> ByteCount:
    """What ``rank`` sends in one dispatch/combine given its tokens' expert choices."""
    dedup = kind.startswith("normal")
    counts = rows_per_rank(topk_idx, num_experts, world, dedup=dedup)
    k = len(topk_idx[0]) if topk_idx else 0
    return bytes_from_rank_counts(
        kind, counts, rank=rank, hidden=hidden, gpus_per_node=gpus_per_node, num_topk=k,
        use_fp8=use_fp8,
    )  # fmt: skip


def rank_classes(rank: int, world: int, gpus_per_node: int = 8) -> list[int]:
    """Where each destination rank is from ``rank``: 0 itself (HBM), 1 NVLink, 2 RDMA."""
    node = rank // gpus_per_node
    return [0 if d == rank else 1 if d // gpus_per_node == node else 2 for d in range(world)]


def bytes_from_rank_counts(
    kind: str,
    counts: list[int],
    *,
    rank: int,
    hidden: int,
    gpus_per_node: int = 8,
    num_topk: int = 0,
    use_fp8: bool = False,
) -> ByteCount:
    """ByteCount from the messages sent to each rank (``rows_per_rank``), so a backend that
    counted rows on the device (one host read, or none) uses the same formula."""
    mb = message_bytes(kind, hidden, use_fp8=use_fp8, num_topk=num_topk)
    by = [0, 0, 0]
    for c, n in zip(rank_classes(rank, len(counts), gpus_per_node), counts):
        by[c] += int(n) * mb
    return ByteCount(by[0], by[1], by[2], int(sum(counts)))


@dataclass(frozen=True)
class LinkParams:
    """The α-β link model of one rank: bandwidth per direction in GB/s (1e9 B/s), latency µs,
    and the DeepEP release whose normal kernels' channel rate on few SMs bounds a send
    (``shared.ir.links.channel_rates``)."""

    name: str = "h100-nvlink-rdma"
    nvlink_gbps: float = 450.0
    nvlink_lat_us: float = 3.0
    rdma_gbps: float = 50.0
    rdma_lat_us: float = 5.0
    gpus_per_node: int = 8
    release: str = "v1"

    def arrival_us(self, b: ByteCount | dict, sms: int | None = None) -> float:
        """Modelled time from send to arrival of the last byte: the simulator's link model
        (``shared.ir.links.arrival_us``: links in parallel, each α + bytes/β; zero for purely
        local traffic), on a ByteCount or bytes per link kind; ``sms``: a normal kernel's SMs,
        whose channels may bound it below the links' rate (:meth:`channel_rates`)."""
        from overlap_lab.shared.ir.links import arrival_us

        nb = b if isinstance(b, dict) else {"nvlink": b.nvlink, "rdma": b.rdma}
        return arrival_us(nb, *self.links(), self.channel_rates(sms))

    def channel_rates(self, sms: int | None) -> dict[str, float]:
        """Bytes per µs per link kind a normal kernel on ``sms`` SMs moves where its channels
        bound it (``shared.ir.links.channel_rates``, the simulator's rule); {} for ``None`` (the
        low-latency kernels: no channel bound)."""
        from overlap_lab.shared.ir.links import channel_rates

        return {} if sms is None else channel_rates(self.links()[0], self.release, sms)

    def links(self) -> tuple[dict[str, float], dict[str, float]]:
        """(bytes per µs, latency µs) per link kind, as ``shared.ir.links.gpu_links`` gives them
        for a GPU preset (1 GB/s = 1e3 bytes/µs)."""
        return (
            {"nvlink": self.nvlink_gbps * 1e3, "rdma": self.rdma_gbps * 1e3},
            {"nvlink": self.nvlink_lat_us, "rdma": self.rdma_lat_us},
        )

    def as_meta(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_gpu(cls, gpu) -> LinkParams:
        """From a shared.inputs.hardware GPU preset (effective bandwidths where given)."""
        return cls(
            name=f"{gpu.name}-links",
            nvlink_gbps=gpu.nvlink_eff_gbps or gpu.nvlink_gbps,
            nvlink_lat_us=gpu.nvlink_lat_us,
            rdma_gbps=gpu.rdma_eff_gbps or gpu.rdma_gbps,
            rdma_lat_us=gpu.rdma_lat_us,
            release=gpu.deepep_release,
        )
