"""The ``torch`` backend: torch.distributed all_to_all_single (gloo on the CPU, NCCL on GPUs).

The row counts go first in a blocking all-to-all (DeepEP normal mode also blocks the host on
them), then every tensor moves in an async all_to_all_single whose ``wait()`` is the receive
half. There is no SM control beyond NCCL's own (``NCCL_MAX_CTAS``), and the low-latency layout is
built from variable-size exchanges, so ``ll_hook`` is emulated by splitting issue and wait.
"""

from __future__ import annotations

import torch

from overlap_lab.real.comm.base import EPBackend, Pending


class TorchDistBackend(EPBackend):
    name = "torch"
    capabilities = frozenset({"normal", "ll_hook", "cpu_blocking_dispatch"})

    def __init__(self, *, group=None, **kw):
        import torch.distributed as dist

        self.dist, self.group = dist, group
        kw.setdefault("rank", dist.get_rank(group))
        kw.setdefault("world", dist.get_world_size(group))
        super().__init__(**kw)

    def _exchange_start(self, chunks: list[list[torch.Tensor]], kind: str) -> Pending:
        dist, W = self.dist, self.world
        dev = chunks[0][0].device
        send_counts = torch.tensor([int(c[0].shape[0]) for c in chunks], dtype=torch.int64)
        recv_counts_t = torch.empty(W, dtype=torch.int64)
        if dev.type == "cuda":
            send_counts, recv_counts_t = send_counts.to(dev), recv_counts_t.to(dev)
        dist.all_to_all_single(recv_counts_t, send_counts, group=self.group)
        recv_counts = recv_counts_t.tolist()  # the host learns the counts (blocking)
        sc = send_counts.tolist()
        recv, waits = [], []
        for i in range(len(chunks[0])):
            inp = torch.cat([c[i] for c in chunks]).contiguous()
            out = inp.new_empty((sum(recv_counts),) + tuple(inp.shape[1:]))
            work = dist.all_to_all_single(
                out, inp, recv_counts, sc, group=self.group, async_op=True
            )
            recv.append(out)
            waits.append(work.wait)
        return Pending(recv, recv_counts, waits)

    def describe(self) -> dict:
        d = super().describe()
        d["dist_backend"] = str(self.dist.get_backend(self.group))
        d["numerics"] = "exact"
        return d
