"""The ``deepep`` backend: DeepEP V1 (``deep_ep.Buffer``), >= 2 GPUs, launched with torchrun.

deep_ep is imported when the backend is built (never at module import). The Buffer's own
signatures are used unchanged (real_executor_notes.md §2.2); results are adapted to the shapes of
real.comm.base so the kernels are written once. SBO's signal arguments are used only when
``inspect.signature(Buffer.low_latency_combine)`` has them (capability ``sbo_signal``).
Not yet run on a GPU: see real/README.md.
"""

from __future__ import annotations

import inspect

import torch

from overlap_lab.real.comm.base import DispatchResult, EPBackend, EventOverlap, rank_counts
from overlap_lab.real.deps import require


class DeepEPBackend(EPBackend):
    name = "deepep"

    def __init__(
        self,
        *,
        group=None,
        num_max_dispatch_tokens_per_rank: int = 128,
        low_latency: bool = True,
        **kw,
    ):
        import torch.distributed as dist

        deep_ep = require("deep_ep", why="--backend deepep")
        kw.setdefault("rank", dist.get_rank(group))
        kw.setdefault("world", dist.get_world_size(group))
        super().__init__(**kw)
        if self.world < 2:
            raise RuntimeError("--backend deepep needs >= 2 GPUs (torchrun); use emulated on one")
        self.deep_ep = deep_ep
        self.group = group if group is not None else dist.group.WORLD
        hidden_bytes = self.hidden * 2
        Buffer = deep_ep.Buffer
        num_nvl = max(
            Buffer.get_dispatch_config(self.world).get_nvl_buffer_size_hint(
                hidden_bytes, self.world
            ),
            Buffer.get_combine_config(self.world).get_nvl_buffer_size_hint(
                hidden_bytes, self.world
            ),
        )
        num_rdma = 0
        if low_latency:
            num_rdma = Buffer.get_low_latency_rdma_size_hint(
                num_max_dispatch_tokens_per_rank, self.hidden, self.world, self.num_experts
            )
        self.buffer = Buffer(
            self.group,
            num_nvl,
            num_rdma,
            low_latency_mode=low_latency,
            num_qps_per_rank=max(1, self.num_experts // self.world) if low_latency else 1,
        )
        params = inspect.signature(Buffer.low_latency_combine).parameters
        caps = {"normal", "ll_hook", "sm_limit", "cpu_blocking_dispatch"}
        if "comp_signal" in params or "src_signals" in params:
            caps.add("sbo_signal")
        self.capabilities = frozenset(caps)

    def set_num_sms(self, k: int) -> None:
        super().set_num_sms(k)
        self.deep_ep.Buffer.set_num_sms(int(k))

    def describe(self) -> dict:
        d = super().describe()
        from overlap_lab.real.deps import probe

        d.update(numerics="exact", package=probe().get("deep_ep", {}))
        return d

    def capture(self) -> EventOverlap:
        ev = self.buffer.capture()
        return EventOverlap([ev.current_stream_wait])

    def dispatch(self, x, topk_idx, topk_weights, *, previous_event=None, async_finish=False):
        prev = getattr(previous_event, "_deepep", None)
        n_rank, n_rdma, n_expert, in_rank, _ = self.buffer.get_dispatch_layout(
            topk_idx, self.num_experts, previous_event=prev
        )
        recv_x, recv_idx, recv_w, _counts, handle, ev = self.buffer.dispatch(
            x,
            topk_idx=topk_idx,
            topk_weights=topk_weights.float(),
            num_tokens_per_rank=n_rank,
            num_tokens_per_rdma_rank=n_rdma,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=n_expert,
            async_finish=async_finish,
        )
        self._account(
            "normal_dispatch",
            rank_counts(topk_idx, self.num_experts, self.world, dedup=True),
            topk_idx.shape[1],
        )
        out_ev = EventOverlap([ev.current_stream_wait] if async_finish else [])
        return DispatchResult(recv_x, recv_idx, recv_w, handle, out_ev)

    def combine(self, x, handle, *, previous_event=None, async_finish=False):
        combined, _w, ev = self.buffer.combine(x, handle, async_finish=async_finish)
        return combined, None, EventOverlap([ev.current_stream_wait] if async_finish else [])

    def low_latency_dispatch(
        self,
        x,
        topk_idx,
        num_max_dispatch_tokens_per_rank,
        num_experts,
        *,
        use_fp8=False,
        async_finish=False,
        return_recv_hook=False,
    ):
        self._account(
            "ll_dispatch", rank_counts(topk_idx, self.num_experts, self.world, dedup=False)
        )
        recv_x, count, handle, ev, hook = self.buffer.low_latency_dispatch(
            x,
            topk_idx,
            num_max_dispatch_tokens_per_rank,
            num_experts,
            use_fp8=use_fp8,
            async_finish=async_finish,
            return_recv_hook=return_recv_hook,
        )
        wrapped = EventOverlap([hook] if return_recv_hook else [ev.current_stream_wait])
        return recv_x, count, handle, wrapped, (wrapped if return_recv_hook else None)

    def low_latency_combine(
        self, x, topk_idx, topk_weights, handle, *, async_finish=False, return_recv_hook=False
    ):
        self._account(
            "ll_combine", rank_counts(topk_idx, self.num_experts, self.world, dedup=False)
        )
        out, ev, hook = self.buffer.low_latency_combine(
            x,
            topk_idx,
            topk_weights.float(),
            handle,
            async_finish=async_finish,
            return_recv_hook=return_recv_hook,
        )
        wrapped = EventOverlap([hook] if return_recv_hook else [ev.current_stream_wait])
        return out, wrapped, (wrapped if return_recv_hook else None)


def deepep_available() -> bool:
    try:
        require("deep_ep")
        return torch.cuda.is_available()
    except ImportError:
        return False
