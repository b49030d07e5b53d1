"""What a kernel sees: the batch layout, one step's state, and the kernel context.

A kernel reads and writes the named tensors of its micro-batch (``ctx.get`` / ``ctx.put``) and of
its step (the KV cache), so the executor can check on the CPU that every read is ordered after
its write by the Program's streams and events, not merely by host issue order
(``real.hazards``).

Per micro-batch tensors (rows = ``padded_tokens``; rows past the real tokens are padding, zero
at embedding and never mixed into real rows): hidden, residual, attn_in, q, mlp_in,
router_logits, topk_idx, topk_w, dispatch, recv, expert_out, combine, moe_out, shared_out,
final, logits, next_ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from overlap_lab.real import fp8
from overlap_lab.real import model as M
from overlap_lab.real.kernels.registry import split_piece
from overlap_lab.real.runlog import RunLog

ROW_KEYS = ("hidden", "residual")


class WouldBlock(Exception):
    """A receive whose data has not been sent yet (in-process multi-rank runs): retry later."""


@dataclass(frozen=True)
class BatchLayout:
    """Where each token of one rank's batch sits: sequence, position, cached prefix."""

    mode: str
    cached: tuple[int, ...]
    new: tuple[int, ...]

    @classmethod
    def of(cls, batch) -> BatchLayout:
        n = batch.num_seqs
        return cls(
            batch.mode,
            tuple(batch.seq_cached(i) for i in range(n)),
            tuple(batch.seq_tokens(i) for i in range(n)),
        )

    @property
    def offsets(self) -> list[int]:
        out = [0]
        for n in self.new:
            out.append(out[-1] + n)
        return out

    @property
    def num_tokens(self) -> int:
        return sum(self.new)

    def tokens(self, tok_lo: int, tok_hi: int) -> list[tuple[int, int, int, int]]:
        """(seq, first row in the slice, rows, first position) per sequence piece in
        [tok_lo, tok_hi)."""
        out, off = [], self.offsets
        for s in range(len(self.new)):
            a, b = max(tok_lo, off[s]), min(tok_hi, off[s + 1])
            if a < b:
                out.append((s, a - tok_lo, b - a, self.cached[s] + a - off[s]))
        return out

    def sampled(self) -> list[int]:
        """Tokens whose logits are computed: each sequence's last (prefill), all (decode)."""
        if self.mode == "prefill":
            return [o - 1 for o in self.offsets[1:]]
        return list(range(self.num_tokens))


@dataclass
class StepState:
    """One forward step of one rank: inputs, the KV cache, micro-batch tensors, outputs."""

    layout: BatchLayout
    token_ids: torch.Tensor
    kv: dict[int, torch.Tensor]
    mbs: dict[int, dict[str, Any]] = field(default_factory=dict)
    final: torch.Tensor | None = None  # [T, H] normed final hidden of real tokens
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # token -> row
    covered: set[int] = field(default_factory=set)
    # hidden/residual rows cross micro-batch boundaries (TBO runs dense layers on the whole
    # batch, MoE layers on its halves): every write is logged with its token range.
    rowlog: dict[str, list] = field(default_factory=dict)
    version: int = 0
    consts: dict = field(default_factory=dict)  # index tensors built once from the host layout
    keep: list = field(default_factory=list)  # every value put in this run (GPU: see put)

    def const(self, key, make):
        """A tensor that depends only on the layout, made once (an H2D copy cannot be captured
        in a CUDA graph; the first, eager run makes it)."""
        t = self.consts.get(key)
        if t is None:
            t = self.consts[key] = make()
        return t


def new_step_state(layout: BatchLayout, weights: M.ModelWeights, *, seed: int) -> StepState:
    """Seeded token ids and a KV cache whose prefix rows are seeded too (independent of how the
    batch is split), for the layers of ``weights``."""
    cfg, dev = weights.cfg, weights.device
    g = torch.Generator(device=dev)
    g.manual_seed(seed + 17)
    T = layout.num_tokens
    ids = torch.randint(0, cfg.vocab, (T,), generator=g, device=dev)
    lmax = max(c + n for c, n in zip(layout.cached, layout.new, strict=True))
    row = M.kv_row_shape(cfg)
    kv = {}
    for li in weights.layers:
        t = M._randn(
            (len(layout.new), lmax, *row), f"kv{li}", seed=seed, dtype=weights.dtype, device=dev
        )
        for s, c in enumerate(layout.cached):
            t[s, c:] = 0
        if cfg.attention == "mla" and lmax % M.FLASH_MLA_PAGE:  # whole pages (FlashMLA's)
            pad = M.FLASH_MLA_PAGE - lmax % M.FLASH_MLA_PAGE
            t = torch.cat([t, t.new_zeros(t.shape[0], pad, *row)], dim=1)
        kv[li] = t
    final = torch.zeros(T, cfg.hidden, dtype=weights.dtype, device=dev)
    return StepState(layout, ids, kv, final=final)


@dataclass
class KernelCtx:
    """What a kernel sees: its op, micro-batch, step state, weights, comm backend, tracker."""

    op: Any
    mb: dict  # MicroBatch.as_meta()
    step: StepState
    weights: M.ModelWeights
    backend: Any
    deepep_mode: str
    max_dispatch_tokens: int
    tracker: Any = None  # real.hazards.HazardTracker or None
    world: Any = None  # the in-process mailbox for send/recv between ranks
    keep_alive: bool = False  # GPU runs: values live until the run's end (several streams)
    rank: int = 0
    piece: tuple[int, int] = (0, 1)  # (k, n) for the slices "<op>.<k>" of one op
    steps: dict[int, StepState] | None = None  # every step of this rank (PP's relay reads back)
    # (name, step, layer, mb) of every op the rank's Program launches, and the number of slices
    # "<base>.<k>" per (base, step, layer, mb): how a kernel learns what the Program split off
    program_ops: frozenset = frozenset()
    piece_counts: dict | None = None
    # SBO mode 1 where the combine polls signals in-kernel (the executor decides): the down GEMM
    # pieces write one output and one signal tensor, which the combine reads (see combine_a)
    sbo_signal: bool = False
    # the run's: its log (kernels, notes), GEMM precision and FP8 weights (quantised at load)
    log: RunLog = field(default_factory=RunLog)
    precision: fp8.Precision = fp8.BF16
    fp8_weights: fp8.WeightCache | None = None

    def launched(self, name: str) -> bool:
        """Does the Program launch op ``name`` for this op's step, layer and micro-batch?"""
        return (name, self.op.step, self.op.layer, self.op.mb) in self.program_ops

    def pieces(self, base: str) -> int:
        """How many slices "<base>.<k>" the Program launches here (1: the op is whole)."""
        key = (base, self.op.step, self.op.layer, self.op.mb)
        return (self.piece_counts or {}).get(key, 1)

    @property
    def cfg(self) -> M.RealModelConfig:
        return self.weights.cfg

    @property
    def lw(self) -> dict:
        return self.weights.layers[self.op.layer]

    @property
    def state(self) -> dict:
        return self.step.mbs.setdefault(self.mb["index"], {})

    def get(self, key: str, default=KeyError):
        if key in ROW_KEYS:
            return self._get_rows(key)
        if self.tracker is not None:
            self.tracker.read(("mb", self.op.step, self.mb["index"], key), self.op)
        st = self.state
        if key not in st:
            if default is KeyError:
                raise KeyError(
                    f"op {self.op.name} (layer {self.op.layer}, mb {self.mb['index']}) reads "
                    f"{key!r}, which no earlier op of this micro-batch wrote"
                )
            return default
        return st[key]

    def put(self, key: str, value) -> None:
        if self.tracker is not None:
            self.tracker.write(("mb", self.op.step, self.mb["index"], key), self.op)
        self.state[key] = value
        if value is not None and self.keep_alive:
            # Every value stays referenced until the run ends (the executor synchronizes, then
            # resets): a tensor made on one stream and read on another is never freed while
            # that stream may still read it, so the caching allocator cannot hand its memory
            # to the next allocation (what record_stream would otherwise have to say per use).
            self.step.keep.append(value)
        if key in ROW_KEYS:
            st = self.step
            st.version += 1
            self.state[key + "@v"] = st.version
            lo, hi = self.mb["tok_lo"], self.mb["tok_hi"]
            stamp = self.tracker.current if self.tracker is not None else None
            log = [e for e in st.rowlog.get(key, []) if not (e[1] == lo and e[2] == hi)]
            log.append((st.version, lo, hi, value, stamp))
            st.rowlog[key] = log

    def _get_rows(self, key: str):
        """This micro-batch's rows of ``key``, rebuilt from other micro-batches' writes when
        those are newer (the whole batch after its halves, or the halves after the whole)."""
        st, lo, hi = self.state, self.mb["tok_lo"], self.mb["tok_hi"]
        lv = st.get(key + "@v", -1)
        newer = [e for e in self.step.rowlog.get(key, []) if e[0] > lv and e[1] < hi and e[2] > lo]
        if not newer:
            if key not in st:
                raise KeyError(
                    f"op {self.op.name} (layer {self.op.layer}, mb {self.mb['index']}) reads "
                    f"{key!r}, which no earlier op wrote for its tokens"
                )
            if self.tracker is not None:
                self.tracker.read(("mb", self.op.step, self.mb["index"], key), self.op)
            return st[key]
        base = st.get(key)
        if all(e[3] is None for e in newer) and (base is None or lv < 0):
            return None
        ref = next(e[3] for e in newer if e[3] is not None)
        out = torch.zeros(
            self.mb["padded_tokens"], *ref.shape[1:], dtype=ref.dtype, device=ref.device
        )
        if base is not None:
            out.copy_(base)
        for _ver, wlo, whi, val, stamp in sorted(newer, key=lambda e: e[0]):
            a, b = max(lo, wlo), min(hi, whi)
            out[a - lo : b - lo] = 0 if val is None else val[a - wlo : b - wlo]
            if self.tracker is not None and stamp is not None:
                self.tracker.check(stamp, key)
        return out

    def get_at(self, step: int, index: int, key: str):
        """``key`` of micro-batch ``index`` in another step of this rank (not a row key)."""
        if self.tracker is not None:
            self.tracker.read(("mb", step, index, key), self.op)
        return self.steps[step].mbs[index][key]

    def kv_access(self, seq: int, write: bool) -> None:
        if self.tracker is not None:
            k = ("kv", self.op.step, self.op.layer, seq)
            (self.tracker.write if write else self.tracker.read)(k, self.op)

    def gather_mbs(self, key: str) -> torch.Tensor:
        """(rows, values) pairs of ``key`` from every micro-batch inside this op's token range
        (one d2h copy after both halves sampled), concatenated in token order."""
        if key in self.state:
            return self.get(key)[1]
        lo, hi, parts = self.mb["tok_lo"], self.mb["tok_hi"], []
        for idx, st in sorted(self.step.mbs.items()):
            if key in st and idx != self.mb["index"]:
                rows, vals = st[key]
                if len(rows) and lo <= int(rows.min()) and int(rows.max()) < hi:
                    if self.tracker is not None:
                        self.tracker.read(("mb", self.op.step, idx, key), self.op)
                    parts.append((int(rows.min()), vals))
        if not parts:
            raise KeyError(f"op {self.op.name}: no micro-batch wrote {key!r} for its tokens")
        return torch.cat([v for _, v in sorted(parts, key=lambda p: p[0])])

    def real_rows(self) -> int:
        return self.mb["tok_hi"] - self.mb["tok_lo"]

    def ll_mode(self, phase: str) -> bool:
        """Low-latency layout? From the op's collective role (send: LL, sendrecv: normal)."""
        coll = self.op.coll
        if coll is not None:
            return coll.role == "send" if phase == "a" else self.get("dispatch")["ll"]
        return self.deepep_mode == "low_latency"

    def note(self, text: str) -> None:
        """What this op could not do as it says on this backend, into the run's log (trace meta
        ``kernel_notes``), as SM limits that are not enforced are reported: never silently a
        no-op."""
        self.log.note(split_piece(self.op.name)[0], text)

    def sm_budget(self, device=None):
        """Scope the op's SM limit (``op.sms``) around its GEMMs: ``with ctx.sm_budget(device)
        as g`` then ``g.mm`` (None: plain torch), ``g.grouped_masked``, ``g.grouped_contiguous``
        (real.gemm.ComputeBudget: BF16 on every SM by cuBLAS; FP8, or an SM limit below the
        device's, by DeepGEMM with set_num_sms scoped or persistent Triton GEMMs whose grid is
        the budget), in the op's GEMM dtype and the run's precision. Kernels used are counted in the run's
        log."""
        from overlap_lab.real.gemm import ComputeBudget

        return ComputeBudget(
            self.op.sms,
            device,
            dtype=self.op.dtype,
            log=self.log,
            precision=self.precision,
            fp8_weights=self.fp8_weights,
        )
