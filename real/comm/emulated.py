"""The ``emulated`` backend: DeepEP on ONE GPU, for timing. Never labelled DeepEP.

Data path: the loopback mirror exchange (real/comm/loopback.py) over a virtual EP world of R
ranks, so shapes, row counts and per-rank bytes are those of an R-rank run.

Time and SMs (real_executor_notes.md §5.3): Triton kernels launch the CTAs DeepEP would launch
(normal mode: ``num_sms`` CTAs; low-latency: ``ceil(E / ceil(E / device_SMs))`` CTAs), move the
bytes this rank would send to peers through HBM (a copy of that many bytes), and hold their SMs
until the modelled arrival time ``t_start + α + bytes/β`` (real.comm.bytes.LinkParams) read from
``%globaltimer``, and a normal kernel at least until its channels on those CTAs have moved the
bytes (``bytes / channel rate``: ``shared.ir.links.channel_rates``, the simulator's rule). With a receive hook the send kernel only copies and stamps ``t_arrive``; the
hook launches a receive kernel on the current stream that spins until ``t_arrive`` (at once if
compute has already passed it), so nothing is resident in between, as with DeepEP's hook.
The byte counts reach the kernels as a device tensor ([local, nvlink, rdma, messages], from
``EPBackend._account``) and the delay is computed in the kernel, so no launch needs a host read;
``launches`` reads the records back after the run.

Byte counts: by default this rank's routing (``EPBackend._account``). With
:meth:`EmulatedBackend.plan_links` (the validation loop) each send takes the bytes the
Program's own flows carry, in issue order (``shared.ir.links.program_sends``), so the arrival is the
simulator's for the same bytes (``shared.ir.links.arrival_us``; its balanced expectation, without
DeepEP's 16-byte LL message header); the data path still moves this routing's rows.

Unverified on a GPU yet (see real/README.md): that 32-warp CTAs land one per SM, and the
resolution of %globaltimer. Fidelity limits: no link contention or incast, one rank's view.
"""

from __future__ import annotations

import math
import time

import torch

from overlap_lab.real.comm.base import Pending, _to_device
from overlap_lab.real.comm.bytes import ByteCount, message_bytes
from overlap_lab.real.comm.loopback import LoopbackBackend

_UNSET = -1  # t_arrive before the send kernel stamped it
RECV_LIMIT_NS = 100_000_000  # a receive waits at most 100 ms for its send's stamp (no hang)
#: int32 words a send kernel's CTA copies per loop iteration: 8 per thread of its 32 warps.
#: With 1,024 (one per thread) each iteration is one dependent 4 KB load-store: on the H200
#: (2026-11-27, prefill 4096) a normal dispatch's 20 CTAs copied its bytes at 177 GB/s and the
#: copy, 1,326 µs per layer, outlasted the modelled flight it emulates.
SEND_BLOCK = 8192


def _kernels():
    """(send_kernel, recv_kernel, stamp_kernel); triton imported on first use."""
    from overlap_lab.real.comm import _triton_emulated as K

    return K.send_kernel, K.recv_kernel, K.stamp_kernel


def _sbo_kernel():
    """SBO's signal-polling combine send, in the interpreter mode in force (see real/gemm.py)."""
    import importlib

    from overlap_lab.real.comm import _triton_emulated as K
    from overlap_lab.real.deps import interpreting

    if _SBO_MODE and _SBO_MODE[0] != interpreting():
        K = importlib.reload(K)
    _SBO_MODE[:] = [interpreting()]
    return K.sbo_combine_kernel


_SBO_MODE: list[bool] = []
SBO_MAX_SPINS = 1 << 24  # polls per block before it is sent unsignalled (counted as stale)


def ll_num_ctas(num_experts: int, device_sms: int) -> int:
    """DeepEP V1 low-latency grid: ceil(E / ceil(E / SMs)) CTAs (internode_ll.cu)."""
    return math.ceil(num_experts / math.ceil(num_experts / device_sms))


class EmulatedBackend(LoopbackBackend):
    name = "emulated"
    emulated = True
    capabilities = frozenset({"normal", "ll_hook", "sm_limit", "sbo_signal"})

    def __init__(self, *, device_sms: int | None = None, **kw):
        super().__init__(**kw)
        if device_sms is None and torch.cuda.is_available():
            device_sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.device_sms = device_sms or 132
        self._scratch: torch.Tensor | None = None
        self._retired: list[torch.Tensor] = []
        self._launches: list[dict] = []
        self._sbo_records: list[dict] = []
        self._plan: dict[str, list[dict[str, float]]] = {}  # "dispatch"/"combine" -> bytes
        self._plan_pos: dict[str, int] = {}
        self._stats_cache: dict[tuple, torch.Tensor] = {}
        self.arrival_from_op_start = True  # see _op_start
        self._t_start: torch.Tensor | None = None

    def _op_start(self, device) -> None:
        """Stamp the op's start on the device (a one-thread kernel), once per op: the send
        kernel then counts the modelled flight from there, so the mirror data path (index math,
        the rows' gather: work DeepEP's own kernels do while sending) runs inside the modelled
        flight time instead of adding to it, and shows only where it is longer. Off
        (``arrival_from_op_start = False``): the flight starts at the send kernel."""
        if not self.arrival_from_op_start or self._t_start is not None:
            return
        if torch.device(device).type != "cuda":  # the CPU times nothing: bookkeeping only
            self._t_start = torch.tensor([time.perf_counter_ns()], dtype=torch.int64)
            return
        t = torch.empty(1, dtype=torch.int64, device=device)
        _kernels()[2][(1,)](t, num_warps=1)
        self._t_start = t

    def plan_links(self, program, rank: int | None = None) -> None:
        """Time each send by the bytes ``program``'s flows carry (``shared.ir.links``), the k-th
        dispatch (combine) of a run taking the k-th in the Program's issue order; every run
        (warm-up, eager, timed) starts over (``reset_run``). The data path is unchanged."""
        from overlap_lab.shared.ir.links import program_sends

        self._plan = {}
        for s in program_sends(program, rank):
            self._plan.setdefault(s.what, []).append(dict(s.nbytes))
        self._plan_pos = {}

    def reset_run(self) -> None:
        super().reset_run()
        self._plan_pos = {}
        self._t_start = None

    def _planned_stats(self, nb: dict[str, float], device) -> torch.Tensor:
        """The device tensor of planned bytes, made once per distinct count (first in an eager
        run, never under graph capture, which forbids host-to-device copies) and kept: a
        captured graph keeps reading its address."""
        key = (round(nb["nvlink"]), round(nb["rdma"]), str(device))
        t = self._stats_cache.get(key)
        if t is None:
            t = self._stats_cache[key] = _to_device(
                torch.tensor([0, key[0], key[1], 0], dtype=torch.int64), device
            )
        return t

    def _planned(self, kind: str) -> dict[str, float] | None:
        what = "dispatch" if "dispatch" in kind else "combine"
        plan = self._plan.get(what)
        if not plan:
            return None
        i = self._plan_pos.get(what, 0)
        self._plan_pos[what] = i + 1
        return plan[i % len(plan)]

    def default_grid(self, kind: str) -> int:
        """DeepEP's own CTA count: low-latency ``ceil(E / ceil(E / SMs))``, normal ``num_sms``."""
        if kind.startswith("ll"):
            return ll_num_ctas(self.num_experts, self.device_sms)
        return max(1, min(self.num_sms, self.device_sms))

    def grid(self, kind: str) -> int:
        """CTAs of the next ``kind`` send kernel: the Program's ``op.sms`` when it set one
        (SBO's combine: 3), DeepEP's own count otherwise."""
        lim = self.sm_limits.get(kind)
        if lim is not None:
            return max(1, min(lim["requested"], self.device_sms))
        return self.default_grid(kind)

    def sm_limit_status(self, kind: str, k: int) -> str:
        n = max(1, min(k, self.device_sms))
        return f"enforced (emulated): the send kernel launches {n} one-per-SM CTAs"

    def _buffers(self, words: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Scratch for the emulated byte movement. A larger one replaces it when needed, and the
        old one is kept for the backend's life: kernels on other streams may still use it, and a
        captured CUDA graph keeps its address (the caching allocator would hand it out again)."""
        if self._scratch is None or self._scratch.numel() < 2 * words + 2:
            if self._scratch is not None:
                self._retired.append(self._scratch)
            self._scratch = torch.zeros(2 * words + 2, dtype=torch.int32, device=device)
        return self._scratch[:words], self._scratch[words : 2 * words]

    @property
    def launches(self) -> list[dict]:
        """One record per emulated transfer: kind, CTAs, remote bytes and modelled delay (read
        back from the device here, after the run, never on the hot path)."""
        out = []
        for rec in self._launches:
            r = {k: v for k, v in rec.items() if k not in ("stats", "planned")}
            if rec.get("planned") is not None:  # the Program's bytes, as the simulator's
                nb = rec["planned"]
                r.update(remote_bytes=nb["nvlink"] + nb["rdma"], bytes=dict(nb),
                         delay_us=self.link.arrival_us(nb, self._channel_sms(rec)),
                         bytes_from="program")  # fmt: skip
                out.append(r)
                continue
            b = ByteCount(*(int(v) for v in rec["stats"].tolist()))
            r.update(remote_bytes=b.remote, bytes={"nvlink": b.nvlink, "rdma": b.rdma},
                     delay_us=self.link.arrival_us(b, self._channel_sms(rec)),
                     bytes_from="routing")  # fmt: skip
            out.append(r)
        return out

    @staticmethod
    def _channel_sms(rec: dict) -> int | None:
        """The SMs whose channels bound a send: a normal kernel's CTAs (one per SM); None for
        the low-latency kernels (no channel bound, as in the simulator)."""
        return rec["ctas"] if rec["kind"].startswith("normal") else None

    def _exchange_start(self, chunks, kind: str) -> Pending:
        """Normal mode (and the variable LL path): rows counted on the host already."""
        pend = super()._exchange_start(chunks, kind)
        dev = chunks[0][0].device
        rows = sum(int(c[0].shape[0]) for c in chunks)
        max_bytes = rows * message_bytes(
            kind, self.hidden, num_topk=self._topk_hint(chunks), use_fp8=self._fp8(kind)
        )
        hook_split = kind.startswith("ll")  # LL send/recv split at the hook; normal: one kernel
        waits = self._link(kind, self.last_stats, max_bytes, dev, hook_split=hook_split)
        pend.waits[:0] = waits
        return pend

    @staticmethod
    def _topk_hint(chunks) -> int:
        c = chunks[0]
        return int(c[1].shape[1]) if len(c) > 1 and c[1].dim() == 2 else 0

    def _link(self, kind, stats, max_bytes, device, *, hook_split):
        """Launch the send kernel now (grid = DeepEP's CTAs) with the byte counts as a device
        tensor; with ``hook_split`` return the receive kernel as the hook's wait."""
        planned = self._planned(kind)
        if planned is not None:  # [local, nvlink, rdma, messages] of the Program's flows
            stats = self._planned_stats(planned, device)
            max_bytes = max(max_bytes, math.ceil(planned["nvlink"]) + math.ceil(planned["rdma"]))
        t_start, self._t_start = self._t_start, None  # this op's stamp, used once
        rec = {"kind": kind, "ctas": self.grid(kind), "stats": stats, "planned": planned,
               "from": "op start" if t_start is not None else "send kernel"}  # fmt: skip
        self._launches.append(rec)
        if torch.device(device).type != "cuda":  # the CPU runs the data path only
            return []
        send_kernel, recv_kernel, _ = _kernels()
        words = max(1, max_bytes // 4)
        src, dst = self._buffers(words, device)
        t_arrive = torch.full((1,), _UNSET, dtype=torch.int64, device=device)
        L = self.link
        chan = L.channel_rates(self._channel_sms(rec))  # bytes/µs = 1e-3 bytes/ns
        send_kernel[(rec["ctas"],)](
            src,
            dst,
            stats,
            t_arrive,
            L.nvlink_lat_us * 1e3,
            1.0 / L.nvlink_gbps,
            L.rdma_lat_us * 1e3,
            1.0 / L.rdma_gbps,
            1e3 / chan["nvlink"] if "nvlink" in chan else 0.0,
            1e3 / chan["rdma"] if "rdma" in chan else 0.0,
            t_start if t_start is not None else t_arrive,
            SPIN=not hook_split,
            BLOCK=SEND_BLOCK,
            HAS_START=t_start is not None,
            num_warps=32,
        )
        if not hook_split:
            return []
        recv_ctas = self.default_grid(kind)  # the receive half: DeepEP's own grid
        return [lambda: recv_kernel[(recv_ctas,)](t_arrive, _UNSET, RECV_LIMIT_NS, num_warps=32)]

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, *, sbo=None, **kw):
        """``sbo`` (as for DeepEP: ``{"signal", "block_m", "threshold", "num_sms",
        "packed_recv_count"}``): SBO mode 1. The send half first runs
        ``sbo_combine_kernel`` on ``num_sms`` CTAs, which waits per (expert, 64-row block) for
        the down GEMM's signal and copies that block to the wire buffer; the data path then reads
        the wire buffer, so the combine's output is what the signalled GEMM wrote. On a GPU the
        kernel can run while the GEMM does; under the CPU interpreter it runs after it. Plain
        CPU (no interpreter): the signal cannot be polled; the data path runs as without SBO."""
        self._op_start(x.device)
        if sbo is not None and handle.get("layout") == "fixed":
            x = self._sbo_send(x, sbo)
        return super().low_latency_combine(x, topk_idx, topk_weights, handle, **kw)

    def _sbo_send(self, x: torch.Tensor, sbo: dict) -> torch.Tensor:
        from overlap_lab.real.deps import interpreting

        ctas = max(1, min(int(sbo["num_sms"]), self.device_sms))
        rec = {"kind": "ll_combine_sbo", "ctas": ctas, "polled": False}
        self._sbo_records.append(rec)
        if x.device.type != "cuda" and not interpreting():
            return x
        E, Mx, H = x.shape
        wire = torch.empty_like(x)
        stale = torch.zeros(1, dtype=torch.int32, device=x.device)
        bm = int(sbo["block_m"])
        assert sbo["signal"].numel() == E * -(-Mx // bm), "signal: [E_local, ceil(rows/block_m)]"
        _sbo_kernel()[(ctas,)](
            x, wire, sbo["packed_recv_count"], sbo["signal"], stale, E, Mx, H,
            int(sbo["threshold"]), SBO_MAX_SPINS, x.stride(0), x.stride(1),
            wire.stride(0), wire.stride(1), BM=bm, BH=min(128, 1 << (H - 1).bit_length()),
            num_warps=4,
        )  # fmt: skip
        rec.update(polled=True, stale=stale)
        return wire

    @property
    def sbo_sends(self) -> list[dict]:
        """One record per SBO combine send: CTAs, whether the signal was polled, and how many
        blocks were sent before their signal completed (read back here, after the run)."""
        return [
            {**r, "stale": int(r["stale"].item())} if "stale" in r else dict(r)
            for r in self._sbo_records
        ]

    def describe(self) -> dict:
        d = super().describe()
        d.update(
            emulated=True,
            numerics="mirror",
            device_sms=self.device_sms,
            note="single-GPU emulation of DeepEP (alpha-beta link model); not DeepEP",
        )
        return d
