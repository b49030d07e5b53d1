"""The ``emulated`` backend: DeepEP on ONE GPU, for timing. Never labelled DeepEP.

Data path: the loopback mirror exchange (real/comm/loopback.py) over a virtual EP world of R
ranks, so shapes, row counts and per-rank bytes are those of an R-rank run.

Time and SMs (real_executor_notes.md §5.3): Triton kernels launch the CTAs DeepEP would launch
(normal mode: ``num_sms`` CTAs; low-latency: ``ceil(E / ceil(E / device_SMs))`` CTAs), move the
bytes this rank would send to peers through HBM (a copy of that many bytes), and hold their SMs
until the modelled arrival time ``t_start + α + bytes/β`` (real.comm.bytes.LinkParams) read from
``%globaltimer``. With a receive hook the send kernel only copies and stamps ``t_arrive``; the
hook launches a receive kernel on the current stream that spins until ``t_arrive`` (at once if
compute has already passed it), so nothing is resident in between, as with DeepEP's hook.

Unverified on a GPU yet (see real/README.md): that 32-warp CTAs land one per SM, and the
resolution of %globaltimer. Fidelity limits: no link contention or incast, one rank's view.
"""

from __future__ import annotations

import math

import torch

from real.comm.base import Pending
from real.comm.loopback import LoopbackBackend

_KERNELS = None
_UNSET = -1  # t_arrive before the send kernel stamped it


def _kernels():
    """Compile the Triton kernels on first use (triton imported lazily)."""
    global _KERNELS
    if _KERNELS is not None:
        return _KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def _now():
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )

    @triton.jit
    def send_kernel(src, dst, n_words, t_arrive, delay_ns, SPIN: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        t0 = _now()
        if pid == 0:
            tl.store(t_arrive, t0 + delay_ns)
        for off in range(pid * BLOCK, n_words, nprog * BLOCK):
            idx = off + tl.arange(0, BLOCK)
            m = idx < n_words
            tl.store(dst + idx, tl.load(src + idx, mask=m), mask=m)
        if SPIN:
            while _now() < t0 + delay_ns:
                pass

    @triton.jit
    def recv_kernel(t_arrive, unset):
        # the send kernel may run on another stream: wait for its stamp, then for the arrival
        t = tl.load(t_arrive, volatile=True)
        while t == unset:
            t = tl.load(t_arrive, volatile=True)
        while _now() < t:
            pass

    _KERNELS = (send_kernel, recv_kernel)
    return _KERNELS


def ll_num_ctas(num_experts: int, device_sms: int) -> int:
    """DeepEP V1 low-latency grid: ceil(E / ceil(E / SMs)) CTAs (internode_ll.cu)."""
    return math.ceil(num_experts / math.ceil(num_experts / device_sms))


class EmulatedBackend(LoopbackBackend):
    name = "emulated"
    emulated = True
    capabilities = frozenset({"normal", "ll_hook", "sm_limit"})

    def __init__(self, *, device_sms: int | None = None, **kw):
        super().__init__(**kw)
        if device_sms is None and torch.cuda.is_available():
            device_sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.device_sms = device_sms or 132
        self._scratch: torch.Tensor | None = None
        self.launches: list[dict] = []

    def grid(self, kind: str) -> int:
        if kind.startswith("ll"):
            return ll_num_ctas(self.num_experts, self.device_sms)
        return max(1, min(self.num_sms, self.device_sms))

    def _buffers(self, words: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._scratch is None or self._scratch.numel() < 2 * words + 2:
            self._scratch = torch.zeros(2 * words + 2, dtype=torch.int32, device=device)
        return self._scratch[:words], self._scratch[words : 2 * words]

    def _exchange_start(self, chunks, kind: str) -> Pending:
        pend = super()._exchange_start(chunks, kind)
        dev = chunks[0][0].device
        b = self.last_bytes
        delay_us = self.link.arrival_us(b)
        rec = {
            "kind": kind,
            "ctas": self.grid(kind),
            "remote_bytes": b.remote,
            "delay_us": delay_us,
        }
        self.launches.append(rec)
        if dev.type != "cuda":  # the CPU runs the data path only
            return pend
        send_kernel, recv_kernel = _kernels()
        words = max(1, b.remote // 4)
        src, dst = self._buffers(words, dev)
        t_arrive = torch.full((1,), _UNSET, dtype=torch.int64, device=dev)
        hook_split = kind.startswith("ll")  # LL send/recv split at the hook; normal: one kernel
        send_kernel[(rec["ctas"],)](
            src,
            dst,
            words,
            t_arrive,
            int(delay_us * 1e3),
            SPIN=not hook_split,
            BLOCK=1024,
            num_warps=32,
        )
        if hook_split:
            pend.waits.insert(
                0, lambda: recv_kernel[(rec["ctas"],)](t_arrive, _UNSET, num_warps=32)
            )
        return pend

    def describe(self) -> dict:
        d = super().describe()
        d.update(
            emulated=True,
            numerics="mirror",
            device_sms=self.device_sms,
            note="single-GPU emulation of DeepEP (alpha-beta link model); not DeepEP",
        )
        return d
