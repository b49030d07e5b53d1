"""The communication interface every backend implements: DeepEP V1's, reduced to what the
executor calls.

- ``dispatch`` / ``combine`` (normal mode): each token goes once to every rank holding one of its
  experts, with its top-k ids (local ids there, -1 elsewhere) and weights; the receiver reduces
  its experts' outputs with the weights; combine sums the rows coming back. ``async_finish=True``
  returns at once with an :class:`EventOverlap`; ``event.current_stream_wait()`` completes it.
- ``low_latency_dispatch`` / ``low_latency_combine``: one message per (token, expert) into the
  ``[E_local, max_tokens * world, H]`` layout with ``recv_count[E_local]``; combine returns the
  weighted sum. ``return_recv_hook=True`` returns a ``hook`` that completes the receive, called
  where the Program's recv op stands (DeepEP's "issue now, receive later").
- ``set_num_sms(k)``: the SM budget of the communication kernels.

Subclasses implement one primitive, the two halves of a variable all-to-all of rows
(``_exchange_start``, whose Pending carries the receive half); this module turns it into DeepEP's layouts, so the
torch, loopback and emulated backends share one data path and differ only in how rows move.
Tensors the finishing half fills are allocated when the send half runs, as DeepEP does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from overlap_lab.real.comm.bytes import ByteCount, LinkParams, message_bytes, rank_classes

CAPABILITIES = ("normal", "ll_hook", "sbo_signal", "sm_limit", "cpu_blocking_dispatch")


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A small host-built constant onto ``device`` without a synchronizing copy: on CUDA through
    pinned memory and ``non_blocking`` (a pageable host->device copy blocks the host, and torch's
    sync-debug mode raises on it)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def rank_counts(topk_idx: torch.Tensor, num_experts: int, world: int, *, dedup: bool):
    """Messages this rank sends to each rank, on the device ([world] int64, no host sync): one
    per (token, expert) pair, or per (token, rank) when ``dedup`` (normal mode)."""
    per = num_experts // world
    dst = torch.where(topk_idx >= 0, topk_idx // per, torch.full_like(topk_idx, world))
    if dedup:
        hit = torch.zeros(topk_idx.shape[0], world + 1, dtype=torch.int64, device=dst.device)
        hit.scatter_(1, dst, 1)
        return hit[:, :world].sum(0)
    out = torch.zeros(world + 1, dtype=torch.int64, device=dst.device)
    out.scatter_add_(0, dst.reshape(-1), torch.ones_like(dst.reshape(-1)))
    return out[:world]


def nonzero_known(mask: torch.Tensor, count: int) -> tuple[torch.Tensor, ...]:
    """``mask.nonzero(as_tuple=True)`` when the host already knows how many (no second sync)."""
    try:
        nz = torch.nonzero_static(mask, size=count)
    except (AttributeError, NotImplementedError, RuntimeError):
        nz = torch.nonzero(mask)
    return tuple(nz.t())


class EventOverlap:
    """DeepEP's EventOverlap: completion of an async half. ``current_stream_wait()`` makes the
    current stream (or, on the CPU, the host) wait for the transfer and runs the receive-side
    kernels (unpack, reduce) once. Calling it again does nothing."""

    def __init__(self, waits: list[Callable[[], None]] | None = None, finish=None):
        self._waits = list(waits or [])
        self._finish = finish
        self.done = False

    def current_stream_wait(self) -> None:
        if self.done:
            return
        for w in self._waits:
            w()
        if self._finish is not None:
            self._finish()
        self.done = True

    __call__ = current_stream_wait  # a hook is the same completion

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.current_stream_wait()


@dataclass
class Pending:
    """An all-to-all in flight: ``recv`` tensors are allocated, filled once ``waits`` ran."""

    recv: list[torch.Tensor]
    recv_counts: list[int]
    waits: list[Callable[[], None]] = field(default_factory=list)


@dataclass
class DispatchResult:
    """Normal-mode dispatch output (DeepEP returns these as a tuple)."""

    recv_x: torch.Tensor
    recv_topk_idx: torch.Tensor
    recv_topk_weights: torch.Tensor
    handle: Any
    event: EventOverlap


STAT_KEYS = ("local", "nvlink", "rdma", "messages")


class Traffic:
    """Bytes and messages sent so far, by kind (what a trace reports). Device-side counts
    (``add_tensor``: [local, nvlink, rdma, messages]) accumulate on the device and are read back
    only when ``by_kind`` is read, after the run, so accounting adds no host sync."""

    def __init__(self):
        self._host: dict[str, dict[str, int]] = {}
        self._dev: dict[str, torch.Tensor] = {}

    def add(self, kind: str, **counts: int) -> None:
        d = self._host.setdefault(kind, {})
        for k, v in counts.items():
            d[k] = d.get(k, 0) + int(v)

    def add_tensor(self, kind: str, stats: torch.Tensor) -> None:
        acc = self._dev.get(kind)
        self._dev[kind] = stats.clone() if acc is None else acc.add_(stats)

    @property
    def by_kind(self) -> dict[str, dict[str, int]]:
        for kind, t in self._dev.items():
            self.add(kind, **dict(zip(STAT_KEYS, t.tolist())))
        self._dev = {}
        return self._host


class EPBackend:
    """Expert-parallel all-to-all between ``world`` ranks; this process is ``rank``.

    ``num_experts`` is the global expert count; rank r holds experts [r*E/world, (r+1)*E/world).
    """

    name = "base"
    emulated = False
    capabilities: frozenset[str] = frozenset({"normal", "ll_hook"})

    def __init__(
        self,
        *,
        rank: int,
        world: int,
        num_experts: int,
        hidden: int,
        link: LinkParams | None = None,
        num_sms: int = 24,
    ):
        if num_experts % world:
            raise ValueError(f"{world} ranks do not divide {num_experts} experts")
        self.rank, self.world, self.num_experts, self.hidden = rank, world, num_experts, hidden
        self.experts_per_rank = num_experts // world
        self.link = link or LinkParams()
        self.num_sms = num_sms
        self.traffic = Traffic()
        self.host_waits: dict[str, int] = {}  # named host syncs taken, by reason
        self.sm_limits: dict[str, dict] = {}  # kind -> {"requested", "status"} (set_num_sms)
        self._stat_mats: dict[tuple, torch.Tensor] = {}
        self.last_stats: torch.Tensor | None = None

    # -- what subclasses implement -------------------------------------------------------------

    def _op_start(self, device) -> None:
        """Called first thing in every dispatch and combine, before its data path: the emulated
        backend stamps the time there, so its modelled arrival counts from the op's start
        (real.comm.emulated). Nothing here."""

    def _exchange_start(self, chunks: list[list[torch.Tensor]], kind: str) -> Pending:
        """Send ``chunks[p]`` (a list of row tensors, same row count) to rank p; returns the
        received rows per tensor (concatenated in source-rank order) once waited. ``kind`` is
        one of real.comm.bytes.KINDS; ``self.last_bytes`` holds its ByteCount."""
        raise NotImplementedError

    # dispatch bytes counted (and, by the emulated backend, timed) as FP8 + scales, as DeepEP's
    # FP8 dispatch sends and the simulator models, while the data move in the tensors' dtype
    dispatch_fp8: bool = False

    def _fp8(self, kind: str) -> bool:
        return self.dispatch_fp8 and kind.endswith("dispatch")

    # -- SM budget, info ------------------------------------------------------------------------

    def set_num_sms(self, k: int, *, kind: str = "normal_dispatch") -> None:
        """The SMs the Program gives the next ``kind`` all-to-all (``op.sms``). What the backend
        makes of it is recorded in ``sm_limits[kind]`` (trace meta): enforced, or why not."""
        self.num_sms = int(k)
        self.sm_limits[kind] = {"requested": int(k), "status": self.sm_limit_status(kind, int(k))}

    def sm_limit_status(self, kind: str, k: int) -> str:
        return f"not enforced: the {self.name} backend has no SM control"

    def describe(self) -> dict:
        """What a Trace records about this backend."""
        return {
            "backend": self.name,
            "emulated": self.emulated,
            "comm_world": self.world,
            "link": self.link.as_meta(),
            "capabilities": sorted(self.capabilities),
            "dispatch_bytes": "fp8 + scales (data moved in the tensors' dtype)"
            if self.dispatch_fp8
            else "tensors' dtype",
        }

    def capture(self) -> EventOverlap:
        return EventOverlap()

    # -- layout helpers ---------------------------------------------------------------------------

    def _account(self, kind: str, counts: torch.Tensor, num_topk: int = 0) -> torch.Tensor:
        """Bytes of one all-to-all from the messages per destination rank (a device tensor, from
        ``rank_counts``), on the device: [local, nvlink, rdma, messages] into ``last_stats`` and
        the traffic totals. No host sync (``last_bytes`` reads it back, for tests and logs)."""
        key = (kind, num_topk, counts.device)
        mat = self._stat_mats.get(key)
        if mat is None:
            mb = message_bytes(kind, self.hidden, num_topk=num_topk, use_fp8=self._fp8(kind))
            cls = rank_classes(self.rank, self.world, self.link.gpus_per_node)
            rows = [[mb * (c == 0), mb * (c == 1), mb * (c == 2), 1] for c in cls]
            mat = self._stat_mats[key] = _to_device(
                torch.tensor(rows, dtype=torch.int64), counts.device
            )
        stats = (counts.to(torch.int64)[:, None] * mat).sum(0)
        self.last_stats = stats
        self.traffic.add_tensor(kind, stats)
        return stats

    def reset_run(self) -> None:
        """Forget what one run recorded (traffic, stats, named host waits); the executor calls
        this before each run so a trace reports its own run only."""
        self.traffic = Traffic()
        self.host_waits = {}
        self.sm_limits = {}
        self.last_stats = None

    @property
    def last_bytes(self) -> ByteCount:
        return ByteCount(*(int(v) for v in self.last_stats.tolist()))

    def _host_wait(self, reason: str, counts: torch.Tensor) -> list[int]:
        """THE host sync of the normal path, named: the CPU waits for the row counts before it
        can size the receive buffers. DeepEP's non-cached normal dispatch does the same (the host
        busy-waits on the host-mapped ``moe_recv_counter``; real_executor_notes.md §2.2), and
        vLLM yields before launching it for that reason. The low-latency path never calls it
        (fixed-size buffers + a device tensor of counts; see real/comm/loopback.py)."""
        self.host_waits[reason] = self.host_waits.get(reason, 0) + 1
        return [int(v) for v in counts.tolist()]

    # -- normal mode ------------------------------------------------------------------------------

    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
    ) -> DispatchResult:
        if previous_event is not None:
            previous_event.current_stream_wait()
        self._op_start(x.device)
        per, W = self.experts_per_rank, self.world
        dst = torch.where(topk_idx >= 0, topk_idx // per, torch.full_like(topk_idx, W))
        hit = torch.zeros(x.shape[0], W + 1, dtype=torch.bool, device=x.device)
        hit.scatter_(1, dst, True)
        in_rank = hit[:, :W]
        counts_dev = in_rank.sum(0)
        self._account("normal_dispatch", counts_dev, topk_idx.shape[1])
        counts = self._host_wait("normal_dispatch: recv counts", counts_dev)
        rk, tok = nonzero_known(in_rank.t(), sum(counts))  # sorted by rank, then token
        ti = topk_idx[tok]
        mine = (ti >= 0) & (ti // per == rk[:, None])
        local = torch.where(mine, ti - rk[:, None] * per, torch.full_like(ti, -1))
        send_x, w_rows = x[tok], topk_weights[tok]
        chunks, lo = [], 0
        for n in counts:
            chunks.append([send_x[lo : lo + n], local[lo : lo + n], w_rows[lo : lo + n]])
            lo += n
        pend = self._exchange_start(chunks, "normal_dispatch")
        recv_x, recv_idx, recv_w = pend.recv
        handle = {
            "tok": tok,
            "send_counts": counts,
            "send_counts_dev": counts_dev,
            "recv_counts": pend.recv_counts,
            "n": len(x),
            "topk_idx": topk_idx,
        }
        ev = EventOverlap(pend.waits)
        if not async_finish:
            ev.current_stream_wait()
        return DispatchResult(recv_x, recv_idx, recv_w, handle, ev)

    def combine(
        self,
        x: torch.Tensor,
        handle,
        *,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
    ) -> tuple[torch.Tensor, None, EventOverlap]:
        """Rows back to their senders, summed per token (the receiver already weighted them)."""
        if previous_event is not None:
            previous_event.current_stream_wait()
        self._op_start(x.device)
        chunks, lo = [], 0
        for n in handle["recv_counts"]:
            chunks.append([x[lo : lo + n]])
            lo += n
        self._account("normal_combine", handle["send_counts_dev"])
        pend = self._exchange_start(chunks, "normal_combine")
        out = torch.zeros(handle["n"], x.shape[1], dtype=torch.float32, device=x.device)
        result = torch.empty(handle["n"], x.shape[1], dtype=x.dtype, device=x.device)

        def finish():
            out.index_add_(0, handle["tok"], pend.recv[0].float())
            result.copy_(out)

        ev = EventOverlap(pend.waits, finish)
        if not async_finish:
            ev.current_stream_wait()
        return result, None, ev

    # -- low-latency mode -------------------------------------------------------------------------

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
        """Returns (recv_x [E_local, max*world, H], recv_count [E_local], handle, event, hook)."""
        assert not (async_finish and return_recv_hook), "DeepEP: async_finish xor recv hook"
        assert num_experts == self.num_experts
        self._op_start(x.device)
        if x.shape[0] > num_max_dispatch_tokens_per_rank:
            raise ValueError(
                f"{x.shape[0]} tokens exceed num_max_dispatch_tokens_per_rank="
                f"{num_max_dispatch_tokens_per_rank}"
            )
        per, W, k = self.experts_per_rank, self.world, topk_idx.shape[1]
        counts_dev = rank_counts(topk_idx, self.num_experts, W, dedup=False)
        self._account("ll_dispatch", counts_dev)
        # Variable-size exchange (the torch backend): the host needs the row counts. The
        # loopback/emulated backends override this with DeepEP's fixed-size layout (no wait).
        counts = self._host_wait("ll_dispatch: variable all-to-all", counts_dev)
        flat = topk_idx.reshape(-1)
        (pairs,) = nonzero_known(flat >= 0, sum(counts))
        experts = flat[pairs]
        order = torch.argsort(experts // per, stable=True)  # by destination, then (token, slot)
        pairs, experts = pairs[order], experts[order]
        tok = pairs // k
        local = experts % per
        chunks, lo = [], 0
        send_x = x[tok]
        for n in counts:
            chunks.append([send_x[lo : lo + n], local[lo : lo + n]])
            lo += n
        pend = self._exchange_start(chunks, "ll_dispatch")
        M = num_max_dispatch_tokens_per_rank * W
        recv_x = torch.zeros(per, M, x.shape[1], dtype=x.dtype, device=x.device)
        recv_count = torch.zeros(per, dtype=torch.int32, device=x.device)
        handle: dict = {
            "pairs": pairs,
            "send_counts": counts,
            "send_counts_dev": counts_dev,
            "n": x.shape[0],
            "k": k,
        }

        def finish():
            rx, rl = pend.recv
            # slot of each received row inside its expert: arrival order (source rank, token)
            onehot = torch.nn.functional.one_hot(rl, per) if len(rl) else rl.new_zeros(0, per)
            pos = (onehot.cumsum(0) - 1).gather(1, rl[:, None])[:, 0] if len(rl) else rl
            recv_x[rl, pos] = rx
            recv_count.copy_(torch.bincount(rl, minlength=per).to(torch.int32))
            handle.update(recv_expert=rl, recv_pos=pos, recv_counts=pend.recv_counts)

        ev = EventOverlap(pend.waits, finish)
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
        """Returns (combined_x [N, H], event, hook): Σ_k w[t, k] · expert_k(x_t) per token."""
        assert not (async_finish and return_recv_hook), "DeepEP: async_finish xor recv hook"
        self._op_start(x.device)
        self._account("ll_combine", handle["send_counts_dev"])
        rows = x[handle["recv_expert"], handle["recv_pos"]]
        chunks, lo = [], 0
        for n in handle["recv_counts"]:
            chunks.append([rows[lo : lo + n]])
            lo += n
        pend = self._exchange_start(chunks, "ll_combine")
        n, k = handle["n"], handle["k"]
        result = torch.empty(n, x.shape[-1], dtype=x.dtype, device=x.device)

        def finish():
            back = pend.recv[0].float()
            pairs = handle["pairs"]
            w = topk_weights.reshape(-1)[pairs].float()
            out = torch.zeros(n, x.shape[-1], dtype=torch.float32, device=x.device)
            out.index_add_(0, pairs // k, back * w[:, None])
            result.copy_(out)

        ev = EventOverlap(pend.waits, finish)
        if not return_recv_hook and not async_finish:
            ev.current_stream_wait()
        return result, ev, (ev if return_recv_hook else None)
