"""The ``local`` backend: one process, rows "exchanged" in place, bytes counted as DeepEP would.

With ``world=1`` it is the identity (every expert is local), which is what the CPU equivalence
check uses. With a virtual ``world=R`` it is the mirror exchange of the emulated backend: under
the symmetric assumption every peer p sends this rank what this rank sends p, so the rows this
rank receives from p are its own rows bound for p, relabelled to local experts. Shapes, row
counts and bytes are those of a real R-rank run; the numbers are those of a model whose rank-p
experts are this rank's (``meta["numerics"] = "mirror"``).

Low-latency mode uses DeepEP's fixed-size layout and never reads a count on the host: the
dispatch returns ``recv_x [E_local, max_tokens * world, H]`` (``torch.empty``; rows past an
expert's count are garbage, as in DeepEP) and ``recv_count [E_local]`` on the device, to be
consumed by a masked grouped GEMM; every index is computed by fixed-size device ops (argsort,
scatter, cumsum; no nonzero, bincount or boolean indexing), so the GPU path from dispatch to
combine runs without a host sync and can be captured in a CUDA graph. Normal mode keeps the
variable layout and its one named host wait (``EPBackend._host_wait``), as DeepEP's does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from overlap_lab.real.comm.base import EPBackend, EventOverlap, Pending, rank_counts
from overlap_lab.real.comm.bytes import message_bytes


class LoopbackBackend(EPBackend):
    name = "local"
    capabilities = frozenset({"normal", "ll_hook"})

    def _exchange_start(self, chunks: list[list[torch.Tensor]], kind: str) -> Pending:
        n = len(chunks[0])
        recv = [torch.cat([c[i] for c in chunks]) for i in range(n)]
        pend = Pending(recv, [int(c[0].shape[0]) for c in chunks])
        pend.waits.extend(self._send_done(recv[0].device))
        return pend

    @staticmethod
    def _send_done(device) -> list[Callable[[], None]]:
        """The receive half may run on another stream (SBO: send on alt, hook on main); the rows
        are there once the send stream passed this point, as DeepEP's flags say."""
        if device.type != "cuda":
            return []
        ev = torch.cuda.Event()
        ev.record()
        return [lambda: torch.cuda.current_stream().wait_event(ev)]

    def _link(
        self, kind: str, stats: torch.Tensor, max_bytes: int, device, *, hook_split: bool
    ) -> list[Callable[[], None]]:
        """Time and SMs of one transfer (the emulated backend launches its kernels here and
        returns the receive-side wait); the loopback moves data only."""
        return []

    # -- low-latency mode: DeepEP's fixed-size layout, no host sync -------------------------------

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        *,
        use_fp8: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ):
        """Returns (recv_x [E_local, max*world, H], recv_count [E_local] int32 on the device,
        handle, event, hook). Received rows of local expert e sit in arrival order (source
        rank, then token, then top-k slot); under the mirror, source rank p holds the pairs
        this rank sends to expert p * E_local + e."""
        assert not (async_finish and return_recv_hook), "DeepEP: async_finish xor recv hook"
        assert num_experts == self.num_experts
        self._op_start(x.device)
        N, k = topk_idx.shape
        if N > num_max_dispatch_tokens_per_rank:
            raise ValueError(
                f"{N} tokens exceed num_max_dispatch_tokens_per_rank="
                f"{num_max_dispatch_tokens_per_rank}"
            )
        per, W, H, dev = self.experts_per_rank, self.world, x.shape[1], x.device
        P, Mx = N * k, num_max_dispatch_tokens_per_rank * W
        flat = topk_idx.reshape(-1)
        valid = flat >= 0
        e = torch.where(valid, flat % per, torch.full_like(flat, per))  # per: no expert
        src = torch.where(valid, flat // per, torch.zeros_like(flat))
        ar = torch.arange(P, device=dev)
        order = torch.argsort((e * W + src) * P + ar)  # keys are unique: a total order
        cnt = torch.zeros(per + 1, dtype=torch.int64, device=dev)
        cnt.scatter_add_(0, e, torch.ones_like(e))
        start = cnt.cumsum(0) - cnt
        slot = torch.empty_like(ar).scatter_(0, order, ar - start[e[order]])
        dest = torch.where(valid, e * Mx + slot, torch.full_like(slot, per * Mx))  # + dump row
        counts_dev = rank_counts(topk_idx, self.num_experts, W, dedup=False)
        stats = self._account("ll_dispatch", counts_dev)
        # Send half (DeepEP's send kernel): one message per (token, expert) pair on the wire.
        wire = x.index_select(0, torch.div(ar, k, rounding_mode="floor"))
        max_bytes = P * message_bytes("ll_dispatch", H, use_fp8=use_fp8 or self.dispatch_fp8)
        waits = self._send_done(dev)
        waits += self._link("ll_dispatch", stats, max_bytes, dev, hook_split=return_recv_hook)
        buf = torch.empty(per * Mx + 1, H, dtype=x.dtype, device=dev)
        recv_x = buf[: per * Mx].view(per, Mx, H)
        recv_count = torch.empty(per, dtype=torch.int32, device=dev)
        handle = {
            "layout": "fixed",
            "dest": dest,
            "valid": valid,
            "n": N,
            "k": k,
            "send_counts_dev": counts_dev,
        }

        def finish():  # receive half (DeepEP's recv kernel): unpack into the per-expert layout
            buf.index_copy_(0, dest, wire)
            recv_count.copy_(cnt[:per])

        ev = EventOverlap(waits, finish)
        if not return_recv_hook and not async_finish:
            ev.current_stream_wait()
        return recv_x, recv_count, handle, ev, (ev if return_recv_hook else None)

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle,
        *,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ):
        """Returns (combined_x [N, H], event, hook): Σ_k w[t, k] · expert_k(x_t) per token; only
        the valid rows of ``x`` [E_local, max*world, H] are read."""
        if handle.get("layout") != "fixed":
            return super().low_latency_combine(
                x,
                topk_idx,
                topk_weights,
                handle,
                async_finish=async_finish,
                return_recv_hook=return_recv_hook,
            )
        assert not (async_finish and return_recv_hook), "DeepEP: async_finish xor recv hook"
        self._op_start(x.device)
        per, Mx, H = x.shape
        dest, valid, n, k = handle["dest"], handle["valid"], handle["n"], handle["k"]
        dev = x.device
        stats = self._account("ll_combine", handle["send_counts_dev"])
        # Send half: each pair's row goes back to its token's rank (the mirror: this one).
        wire = x.reshape(per * Mx, H).index_select(0, dest.clamp(max=per * Mx - 1))
        max_bytes = n * k * message_bytes("ll_combine", H)
        waits = self._send_done(dev)
        waits += self._link("ll_combine", stats, max_bytes, dev, hook_split=return_recv_hook)
        result = torch.empty(n, H, dtype=x.dtype, device=dev)

        def finish():  # receive half: weighted sum over the top-k slots
            w = torch.where(valid, topk_weights.reshape(-1).float(), 0.0)
            rows = torch.where(valid[:, None], wire.float(), 0.0) * w[:, None]
            result.copy_(rows.view(n, k, H).sum(1))

        ev = EventOverlap(waits, finish)
        if not return_recv_hook and not async_finish:
            ev.current_stream_wait()
        return result, ev, (ev if return_recv_hook else None)

    def describe(self) -> dict:
        d = super().describe()
        d["numerics"] = "exact" if self.world == 1 else "mirror"
        d["ll_layout"] = "fixed [E_local, max_tokens*world, H] + device counts (no host sync)"
        return d
