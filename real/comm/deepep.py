"""The ``deepep`` backend: DeepEP V1 (``deep_ep.Buffer``), >= 2 GPUs, launched with torchrun.

deep_ep is imported when the backend is built (never at module import). The Buffer's own
signatures are used unchanged; results are adapted to the shapes of real.comm.base so the
kernels are written once. What this wrapper guarantees against DeepEP's own preconditions
(checked on the CPU against a fake Buffer in tests/test_real_deepep.py):

- a process group exists: :func:`ensure_process_group` initialises NCCL from torchrun's
  environment (RANK, WORLD_SIZE, LOCAL_RANK) when nothing did, and says how to launch otherwise;
- ``Buffer.set_num_sms`` gets an even count (DeepEP asserts it: even CTAs send, odd receive):
  an odd request is rounded up and the rounding reported in ``sm_limits``; the low-latency
  kernels take no SM count (their grid is ``ceil(E / ceil(E / SMs))``), so a limit on them is
  reported as not enforced unless SBO's ``num_sms`` argument carries it;
- the low-latency buffer is sized for ``num_max_dispatch_tokens_per_rank`` (the largest batch
  this rank dispatches, from the workload) and every call passes that same value (DeepEP needs
  it identical across calls and ranks); a larger batch is refused with a clear error;
- normal-mode calls pass ``previous_event`` (the caller's, or ``Buffer.capture()`` on the current
  stream); ``allocate_on_comm_stream`` only together with ``async_finish`` (DeepEP asserts a
  previous event and an async call for it), as DeepEP's README example does;
- ``clean_low_latency_buffer`` runs before a low-latency call that follows normal-mode use of the
  same Buffer (DeepEP requires it: the normal kernels dirty the shared RDMA buffer);
- SBO's signal arguments (``overlap``, ``packed_recv_count``, ``comp_signal``, ``block_m``,
  ``threshold``, ``num_sms``; or the Blackwell ``src_signals``) are passed when the caller gives
  a signal AND ``Buffer.low_latency_combine`` has them (capability ``sbo_signal``).
Not yet run on a GPU.
"""

from __future__ import annotations

import inspect
import os

import torch

from overlap_lab.real.comm.base import DispatchResult, EPBackend, EventOverlap, rank_counts
from overlap_lab.real.deps import require

SBO_HOPPER_ARGS = ("overlap", "packed_recv_count", "comp_signal", "block_m", "threshold", "num_sms")
SBO_BLACKWELL_ARGS = ("overlap", "src_signals", "src_signal_expect_value")
LL_MAX_TOKENS = 1024  # SGLang's bound on num_max_dispatch_tokens_per_rank


def ensure_process_group(backend: str = "nccl"):
    """The default process group, initialised from torchrun's environment when nothing did.
    Raises ConfigError (one line, how to launch) when there is no group and no environment."""
    import torch.distributed as dist

    from overlap_lab.shared.errors import ConfigError

    if not dist.is_available():
        raise ConfigError("--backend deepep needs torch.distributed")
    if dist.is_initialized():
        return dist.group.WORLD
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ConfigError(
            "--backend deepep runs one process per GPU: launch with "
            "`torchrun --nproc-per-node N -m overlap_lab.cli run --backend deepep ...`"
        )
    local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(local)
    dist.init_process_group(backend)
    return dist.group.WORLD


def even_sms(k: int) -> int:
    """DeepEP's normal kernels need an even SM count (pairs of send/receive CTAs)."""
    k = max(2, int(k))
    return k + (k % 2)


class DeepEPBackend(EPBackend):
    name = "deepep"

    def __init__(
        self,
        *,
        group=None,
        num_max_dispatch_tokens_per_rank: int = 128,
        low_latency: bool = True,
        deep_ep=None,
        **kw,
    ):
        import torch.distributed as dist

        from overlap_lab.shared.errors import ConfigError

        deep_ep = deep_ep if deep_ep is not None else require("deep_ep", why="--backend deepep")
        if group is None:
            group = ensure_process_group()
        if "rank" not in kw:
            kw["rank"] = dist.get_rank(group)
        if "world" not in kw:
            kw["world"] = dist.get_world_size(group)
        super().__init__(**kw)
        if self.world < 2:
            raise ConfigError("--backend deepep needs >= 2 GPUs (torchrun); use emulated on one")
        m = int(num_max_dispatch_tokens_per_rank)
        if not 0 < m <= LL_MAX_TOKENS:
            raise ConfigError(
                f"num_max_dispatch_tokens_per_rank={m}: DeepEP's low-latency mode takes 1.."
                f"{LL_MAX_TOKENS} tokens per rank (split larger batches into micro-batches)"
            )
        self.max_tokens = m
        self.deep_ep = deep_ep
        self.group = group
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
                m, self.hidden, self.world, self.num_experts
            )
        self.low_latency = low_latency
        self.buffer = Buffer(
            self.group,
            num_nvl,
            num_rdma,
            low_latency_mode=low_latency,
            num_qps_per_rank=max(1, self.num_experts // self.world) if low_latency else 1,
        )
        params = inspect.signature(Buffer.low_latency_combine).parameters
        self.sbo_args = tuple(
            a
            for a in (SBO_HOPPER_ARGS if "comp_signal" in params else SBO_BLACKWELL_ARGS)
            if a in params
        )
        caps = {"normal", "ll_hook", "sm_limit", "cpu_blocking_dispatch"}
        if "comp_signal" in params or "src_signals" in params:
            caps.add("sbo_signal")
        self.capabilities = frozenset(caps)
        self._normal_used = False  # normal kernels ran since the last clean of the LL buffer
        self.cleans = 0
        self.sbo_calls = 0

    # -- SM budget ------------------------------------------------------------------------------

    def set_num_sms(self, k: int, *, kind: str = "normal_dispatch") -> None:
        super().set_num_sms(k, kind=kind)
        if not kind.startswith("ll"):
            self.deep_ep.Buffer.set_num_sms(even_sms(k))

    def sm_limit_status(self, kind: str, k: int) -> str:
        if kind.startswith("ll"):
            if kind == "ll_combine" and "sbo_signal" in self.capabilities:
                return "enforced only for an SBO combine given a signal (num_sms argument)"
            return (
                "not enforced: DeepEP's low-latency kernels take ceil(E / ceil(E / SMs)) CTAs "
                "and no SM count"
            )
        e = even_sms(k)
        if e != k:
            return f"enforced, rounded up to {e} (DeepEP's normal kernels need an even count)"
        return "enforced (Buffer.set_num_sms)"

    def describe(self) -> dict:
        d = super().describe()
        from overlap_lab.real.deps import probe

        d.update(
            numerics="exact",
            package=probe().get("deep_ep", {}),
            num_max_dispatch_tokens_per_rank=self.max_tokens,
            sbo_signal_args=list(self.sbo_args),
        )
        return d

    # -- events ---------------------------------------------------------------------------------

    def capture(self) -> EventOverlap:
        ev = self.buffer.capture()
        out = EventOverlap([ev.current_stream_wait])
        out._deepep = ev
        return out

    def _prev(self, previous_event):
        """DeepEP's EventOverlap for ``previous_event``: the one inside ours, or a fresh capture
        on the current stream (the comm stream then waits for everything issued so far)."""
        ev = getattr(previous_event, "_deepep", None)
        return ev if ev is not None else self.buffer.capture()

    @staticmethod
    def _wrap(ev, async_finish: bool) -> EventOverlap:
        out = EventOverlap([ev.current_stream_wait] if async_finish else [])
        out._deepep = ev if async_finish else None
        return out

    def _before_ll(self) -> None:
        if self._normal_used:
            self.buffer.clean_low_latency_buffer(self.max_tokens, self.hidden, self.num_experts)
            self._normal_used = False
            self.cleans += 1

    # -- normal mode ----------------------------------------------------------------------------

    def dispatch(self, x, topk_idx, topk_weights, *, previous_event=None, async_finish=False):
        self._normal_used = True
        prev = self._prev(previous_event)
        n_rank, n_rdma, n_expert, in_rank, layout_ev = self.buffer.get_dispatch_layout(
            topk_idx,
            self.num_experts,
            previous_event=prev,
            async_finish=True,
            allocate_on_comm_stream=True,
        )
        recv_x, recv_idx, recv_w, _counts, handle, ev = self.buffer.dispatch(
            x,
            topk_idx=topk_idx,
            topk_weights=topk_weights.float(),
            num_tokens_per_rank=n_rank,
            num_tokens_per_rdma_rank=n_rdma,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=n_expert,
            previous_event=layout_ev,
            async_finish=async_finish,
            allocate_on_comm_stream=async_finish,  # DeepEP asserts: only with an async event
        )
        self._account(
            "normal_dispatch",
            rank_counts(topk_idx, self.num_experts, self.world, dedup=True),
            topk_idx.shape[1],
        )
        return DispatchResult(recv_x, recv_idx, recv_w, handle, self._wrap(ev, async_finish))

    def combine(self, x, handle, *, previous_event=None, async_finish=False):
        self._normal_used = True
        combined, _w, ev = self.buffer.combine(
            x,
            handle,
            previous_event=self._prev(previous_event),
            async_finish=async_finish,
            allocate_on_comm_stream=async_finish,
        )
        return combined, None, self._wrap(ev, async_finish)

    # -- low-latency mode -----------------------------------------------------------------------

    def _check_tokens(self, x, num_max_dispatch_tokens_per_rank) -> None:
        from overlap_lab.shared.errors import ConfigError

        n = max(int(x.shape[0]), int(num_max_dispatch_tokens_per_rank or 0))
        if n > self.max_tokens:
            raise ConfigError(
                f"{n} tokens per rank exceed the low-latency buffer's "
                f"num_max_dispatch_tokens_per_rank={self.max_tokens} (size it from the workload)"
            )

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
        self._check_tokens(x, num_max_dispatch_tokens_per_rank)
        self._before_ll()
        self._account(
            "ll_dispatch", rank_counts(topk_idx, self.num_experts, self.world, dedup=False)
        )
        recv_x, count, handle, ev, hook = self.buffer.low_latency_dispatch(
            x,
            topk_idx,
            self.max_tokens,  # the value the buffer was sized for, identical on every call
            num_experts,
            use_fp8=use_fp8,
            async_finish=async_finish,
            return_recv_hook=return_recv_hook,
        )
        wrapped = EventOverlap([hook] if return_recv_hook else [ev.current_stream_wait])
        return recv_x, count, handle, wrapped, (wrapped if return_recv_hook else None)

    def low_latency_combine(
        self,
        x,
        topk_idx,
        topk_weights,
        handle,
        *,
        async_finish=False,
        return_recv_hook=False,
        sbo: dict | None = None,
    ):
        """``sbo``: SBO's overlap arguments from a down GEMM that writes a signal
        (``{"signal", "block_m", "threshold", "num_sms", "packed_recv_count"}``), passed only
        when this DeepEP has them; otherwise the combine runs without overlap (recorded)."""
        self._before_ll()
        self._account(
            "ll_combine", rank_counts(topk_idx, self.num_experts, self.world, dedup=False)
        )
        extra = {}
        if sbo is not None:
            if "sbo_signal" not in self.capabilities:
                self.sm_limits["ll_combine_sbo"] = {
                    "requested": sbo.get("num_sms"),
                    "status": "not enforced: this DeepEP has no SBO signal arguments",
                }
            elif "comp_signal" in self.sbo_args:
                extra = dict(
                    overlap=True,
                    packed_recv_count=sbo["packed_recv_count"],
                    comp_signal=sbo["signal"],
                    block_m=int(sbo["block_m"]),
                    threshold=int(sbo["threshold"]),
                    num_sms=int(sbo["num_sms"]),
                )
            else:
                extra = dict(
                    overlap=True,
                    src_signals=sbo["signal"],
                    src_signal_expect_value=int(sbo["threshold"]),
                )
            if extra:
                self.sbo_calls += 1
        out, ev, hook = self.buffer.low_latency_combine(
            x,
            topk_idx,
            topk_weights.float(),
            handle,
            async_finish=async_finish,
            return_recv_hook=return_recv_hook,
            **extra,
        )
        wrapped = EventOverlap([hook] if return_recv_hook else [ev.current_stream_wait])
        return out, wrapped, (wrapped if return_recv_hook else None)


def deepep_available() -> bool:
    try:
        require("deep_ep")
        return torch.cuda.is_available()
    except ImportError:
        return False
