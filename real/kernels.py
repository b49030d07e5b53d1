"""Op names bound to kernels: the IR names work ("attn.core", "dispatch_a"), never a kernel.

A kernel is ``fn(ctx: KernelCtx) -> None``: it reads and writes the named tensors of its
micro-batch (``ctx.get`` / ``ctx.put``) and of its step (the KV cache), so the executor can check
on the CPU that every read is ordered after its write by the Program's streams and events, not
merely by host issue order (see real/executor.py, "hazards").

Per micro-batch tensors (rows = ``padded_tokens``; rows past the real tokens are padding, zero
at embedding and never mixed into real rows): hidden, residual, attn_in, q, mlp_in,
router_logits, topk_idx, topk_w, dispatch, recv, expert_out, combine, moe_out, shared_out,
final, logits, next_ids.

Register more names with ``@register("name", ...)``; ``bind(name)`` raises KeyError naming the
op when nothing is bound, and ``unbound(names)`` lists the gaps (tests check every schedule).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from overlap_lab.real import fp8
from overlap_lab.real import model as M
from overlap_lab.real.moe_ep import ep_gather, ep_scatter, silu_and_mul
from overlap_lab.real.runlog import RunLog

Kernel = Callable[["KernelCtx"], None]
ROW_KEYS = ("hidden", "residual")
REGISTRY: dict[str, Kernel] = {}
PIECES: dict[str, Kernel] = {}


def note(ctx: KernelCtx, text: str) -> None:
    """What this op could not do as it says on this backend, into the run's log (trace meta
    ``kernel_notes``), as SM limits that are not enforced are reported: never silently a no-op."""
    ctx.log.note(split_piece(ctx.op.name)[0], text)


def flash_mla_module():
    """``flash_mla`` when it imports (a module already in sys.modules counts), else None."""
    import importlib
    import sys

    from overlap_lab.real.deps import available

    mod = sys.modules.get("flash_mla")
    if mod is not None:
        return mod
    return importlib.import_module("flash_mla") if available("flash_mla") else None


def register(*names: str):
    def deco(fn: Kernel) -> Kernel:
        for n in names:
            REGISTRY[n] = fn
        return fn

    return deco


def split_piece(name: str) -> tuple[str, int | None]:
    """ "experts.down.2" -> ("experts.down", 2): a schedule's slice of an op (SBO's chunks)."""
    base, _, k = name.rpartition(".")
    if base and k.isdigit() and base in PIECES:
        return base, int(k)
    return name, None


def bind(name: str) -> Kernel:
    base, k = split_piece(name)
    if k is not None:
        return PIECES[base]
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"op {name!r} has no kernel bound in real/kernels.py; register one with "
            f"@register({name!r})"
        ) from None


def unbound(names) -> list[str]:
    return sorted({n for n in names if n not in REGISTRY and split_piece(n)[1] is None})


def register_pieces(*bases: str):
    """Kernels for the numbered slices "<base>.<k>" of an op (ctx.piece = (k, n))."""

    def deco(fn: Kernel) -> Kernel:
        for b in bases:
            PIECES[b] = fn
        return fn

    return deco


class WouldBlock(Exception):
    """A receive whose data has not been sent yet (in-process multi-rank runs): retry later."""


# ----------------------------------------------------------------------------------------------
# Batch layout and state
# ----------------------------------------------------------------------------------------------


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
    tracker: Any = None  # real.executor.HazardTracker or None
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


# ----------------------------------------------------------------------------------------------
# Head: embed, logits, sample, d2h
# ----------------------------------------------------------------------------------------------


@register("embed")
def embed(ctx: KernelCtx) -> None:
    w, mb = ctx.weights, ctx.mb
    ids = ctx.step.token_ids[mb["tok_lo"] : mb["tok_hi"]]
    h = torch.zeros(mb["padded_tokens"], ctx.cfg.hidden, dtype=w.dtype, device=w.device)
    h[: len(ids)] = w.embed[ids]
    ctx.put("hidden", h)
    ctx.put("residual", None)


@register("logits")
def logits(ctx: KernelCtx) -> None:
    """Final norm (after the last residual add) and lm_head for the sampled tokens."""
    h, res = ctx.get("hidden"), ctx.get("residual")
    if res is not None:
        h = h + res
    n = ctx.real_rows()
    final = M.rms_norm(h[:n], ctx.weights.final_norm, ctx.cfg.eps)
    lo = ctx.mb["tok_lo"]
    sampled = [t - lo for t in ctx.step.layout.sampled() if lo <= t < ctx.mb["tok_hi"]]
    rows = ctx.step.const(
        ("sampled_rows", lo, ctx.mb["tok_hi"]),
        lambda: torch.tensor(sampled, dtype=torch.long, device=h.device),
    )
    # lm_head in the weights' dtype (a bf16 GEMM on a GPU), logits returned in fp32
    lg = (final[rows] @ ctx.weights.lm_head.t()).float()
    ctx.put("final", final)
    ctx.put("logits", (rows + lo, lg))
    hi = ctx.mb["tok_hi"]
    ctx.step.final[lo:hi] = final
    for i, t in enumerate(sampled):  # host indices: no device read
        ctx.step.logits[t + lo] = lg[i]
    ctx.step.covered.update(range(lo, hi))


@register("sample")
def sample(ctx: KernelCtx) -> None:
    rows, lg = ctx.get("logits")
    ctx.put("next_ids", (rows, lg.argmax(-1)))


@register("d2h", "d2h_next_token_ids")
def d2h(ctx: KernelCtx) -> None:
    """The non-blocking copy of the sampled ids to the host."""
    ids = ctx.gather_mbs("next_ids")
    ctx.put("next_ids_host", ids.to("cpu", non_blocking=ids.is_cuda))


@register("d2h_next_token_logprobs", "d2h_input_token_logprobs")
def d2h_logprobs(ctx: KernelCtx) -> None:
    """``--return-logprob``: the log-probabilities of the sampled ids, copied to the host. The
    executor computes logits only for the positions it samples, so the input-token variant
    covers those rows too (SGLang computes them for every prompt token: more rows, same op)."""
    rows, lg = ctx.get("logits")
    _, ids = ctx.get("next_ids")
    lp = torch.log_softmax(lg.float(), -1).gather(-1, ids[:, None])[:, 0]
    ctx.put(f"{ctx.op.name}_host", (rows, lp.to("cpu", non_blocking=lp.is_cuda)))


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------


@register("comm_prepare_attn")
def comm_prepare_attn(ctx: KernelCtx) -> None:
    """Input RMSNorm; the hidden state entering the layer becomes the residual."""
    h = ctx.get("hidden")
    ctx.put("residual", h)
    ctx.put("attn_in", M.rms_norm(h, ctx.lw["input_norm"], ctx.cfg.eps))


def _pieces(ctx: KernelCtx):
    return ctx.step.layout.tokens(ctx.mb["tok_lo"], ctx.mb["tok_hi"])


def _token_index(ctx: KernelCtx, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, position) of every real token of this micro-batch, as device tensors made
    once from the host layout (no per-sequence kernels on the hot path)."""
    pieces = _pieces(ctx)

    def make():
        seq = [s for s, _, r, _ in pieces for _ in range(r)]
        pos = [q for _, _, r, p in pieces for q in range(p, p + r)]
        return torch.tensor([seq, pos], dtype=torch.long).to(device)

    t = ctx.step.const(("token_index", ctx.mb["tok_lo"], ctx.mb["tok_hi"]), make)
    return t[0], t[1]


@register("attn.prepare")
def attn_prepare(ctx: KernelCtx) -> None:
    """q projections and the new KV rows (written into the cache at their positions)."""
    cfg, lw = ctx.cfg, ctx.lw
    n = ctx.real_rows()
    x = ctx.get("attn_in")[:n]
    seq_idx, pos = _token_index(ctx, x.device)
    if cfg.attention == "mla":
        q_nope, q_pe, rows = M.mla_prepare(cfg, lw, x, pos)
        ctx.put("q", (q_nope, q_pe))
    else:
        q, rows = M.gqa_prepare(cfg, lw, x, pos)
        ctx.put("q", (q,))
    cache = ctx.step.kv[ctx.op.layer]
    for s, *_ in _pieces(ctx):
        ctx.kv_access(s, write=True)
    cache[seq_idx, pos] = rows.to(cache.dtype)  # one scatter for every sequence


@register("attn.core")
def attn_core(ctx: KernelCtx) -> None:
    """Attention over the cache (prefix, earlier chunks and this micro-batch's tokens, causal),
    then o_proj. Decode uses MLA's absorbed form over padded caches; prefill the expanded form
    per sequence."""
    cfg, lw = ctx.cfg, ctx.lw
    q = ctx.get("q")
    cache = ctx.step.kv[ctx.op.layer]
    pieces = _pieces(ctx)
    for s, *_ in pieces:
        ctx.kv_access(s, write=False)
    n, P = ctx.real_rows(), ctx.mb["padded_tokens"]
    dev = cache.device
    if cfg.attention == "mla" and ctx.step.layout.mode == "decode":
        s0 = pieces[0][0]
        seq_idx, q_pos = _token_index(ctx, dev)
        lmax = max(p + r for _, _, r, p in pieces)  # from the host layout: no device read
        kv = cache[s0 : pieces[-1][0] + 1, :lmax]
        r0 = pieces[0][2]
        if all(r == r0 for _, _, r, _ in pieces) and len(pieces) == kv.shape[0]:
            # one query block per sequence: FlashMLA where it runs, else batched SDPA over the
            # latent cache (no gather); the run's meta counts which (attention_kernels)
            whole = cache[s0 : pieces[-1][0] + 1]
            fm = flash_mla_module()
            why = M.flash_mla_unusable(cfg, whole, fm)
            if why is None:
                S, pages = whole.shape[0], whole.shape[1] // M.FLASH_MLA_PAGE
                table = ctx.step.const(
                    ("flash_mla_pages", s0, S),
                    lambda: torch.arange(S * pages, dtype=torch.int32, device=dev).view(S, pages),
                )
                o = M.mla_attend_flash(cfg, lw, q[0], q[1], whole, q_pos.view(-1, r0), fm, table)
                ctx.log.count_kernel("attention", M.flash_mla_api(fm).label)
            else:
                o = M.mla_attend_absorbed_batched(cfg, lw, q[0], q[1], kv, q_pos.view(-1, r0))
                ctx.log.count_kernel("attention", f"sdpa ({why})")
        else:
            o = M.mla_attend_absorbed(cfg, lw, q[0], q[1], kv, seq_idx - s0, q_pos)
    else:
        outs = []
        for s, r0, r, p in pieces:  # this piece's r queries are the last of its p + r keys
            kv = cache[s, : p + r]
            if cfg.attention == "mla":
                outs.append(
                    M.mla_attend_expanded(cfg, lw, q[0][r0 : r0 + r], q[1][r0 : r0 + r], kv)
                )
            else:
                outs.append(M.gqa_attend(cfg, q[0][r0 : r0 + r], kv))
            ctx.log.count_kernel("attention", M.causal_variant(r, p + r))
        o = torch.cat(outs)
    out = torch.zeros(P, cfg.hidden, dtype=cache.dtype, device=dev)
    out[:n] = (o @ lw["o_proj"].t()).to(out.dtype)
    ctx.put("hidden", out)


# ----------------------------------------------------------------------------------------------
# MLP side
# ----------------------------------------------------------------------------------------------


@register("comm_prepare_mlp")
def comm_prepare_mlp(ctx: KernelCtx) -> None:
    h, res = ctx.get("hidden"), ctx.get("residual")
    normed, s = M.fused_add_rms_norm(h, res, ctx.lw["post_attn_norm"], ctx.cfg.eps)
    ctx.put("residual", s)
    ctx.put("mlp_in", normed)


@register("mlp")
def dense_mlp(ctx: KernelCtx) -> None:
    x = ctx.get("mlp_in")
    with sm_budget(ctx, x.device) as g:
        ctx.put("hidden", M.swiglu_mlp(x, ctx.lw["mlp_w13"], ctx.lw["mlp_w2"], mm=g.mm))


@register("gate")
def gate(ctx: KernelCtx) -> None:
    x = ctx.get("mlp_in")
    with sm_budget(ctx, x.device) as g:
        ctx.put("router_logits", g.linear(x, ctx.lw["gate"]))


@register("select_experts")
def select_experts(ctx: KernelCtx) -> None:
    idx, w = M.select_experts(ctx.cfg, ctx.get("router_logits"), ctx.lw.get("gate_bias"))
    ctx.put("topk_idx", idx)
    ctx.put("topk_w", w)


@register("dispatch_a")
def dispatch_a(ctx: KernelCtx) -> None:
    """Issue the dispatch: DeepEP low-latency with a receive hook (role send), or normal mode
    with async_finish (role sendrecv). Nothing is received here."""
    x, idx, w = ctx.get("mlp_in"), ctx.get("topk_idx"), ctx.get("topk_w")
    be = ctx.backend
    ll = ctx.ll_mode("a")
    if ctx.op.sms:
        be.set_num_sms(ctx.op.sms, kind="ll_dispatch" if ll else "normal_dispatch")
    if ll:
        rx, cnt, handle, _ev, hook = be.low_latency_dispatch(
            x, idx, ctx.max_dispatch_tokens, ctx.cfg.num_experts, return_recv_hook=True
        )
        ctx.put(
            "dispatch", {"ll": True, "recv_x": rx, "count": cnt, "handle": handle, "done": hook}
        )
    else:
        r = be.dispatch(x, idx, w, async_finish=True)
        ctx.put("dispatch", {"ll": False, "res": r, "done": r.event})


@register("dispatch_b")
def dispatch_b(ctx: KernelCtx) -> None:
    """Complete the dispatch: the hook (LL) or the event wait (normal)."""
    d = ctx.get("dispatch")
    d["done"]()
    ctx.put("recv", d)


@register("experts")
def experts(ctx: KernelCtx) -> None:
    d, lw = ctx.get("recv"), ctx.lw
    with sm_budget(ctx, lw["w13"].device) as g:
        if d["ll"]:
            rx = d["recv_x"]
            y = M.grouped_experts_masked(
                rx, d["count"], lw["w13"], lw["w2"], gemm=g, expected_m=_expected_m(ctx, rx)
            )
        else:
            r = d["res"]
            y = M.experts_weighted(
                r.recv_x, r.recv_topk_idx, r.recv_topk_weights, lw["w13"], lw["w2"], gemm=g
            )
    ctx.put("expert_out", y)


# SBO (shared/schedules/sbo.py, mode 1): the experts op split into the gate-up GEMM and slices
# of the down GEMM, each slice signalled (an event) to one slice of the combine on the alt stream.
# Slice k of the down GEMM covers local experts [k*E/n, (k+1)*E/n); combine slice k reads the
# rows of slice k (so the CPU check proves each is ordered after its signal) and the last slice
# issues the combine of all rows (DeepEP sends per signalled block; the data are the same).


def _expected_m(ctx: KernelCtx, rx: torch.Tensor) -> int:
    """DeepGEMM's ``expected_m`` for the low-latency layout: the routing's mean rows per local
    expert from host numbers (tokens of this micro-batch on every rank), not the padded rows."""
    from overlap_lab.real.gemm import expected_rows

    be = ctx.backend
    return expected_rows(ctx.real_rows(), ctx.cfg.top_k, ctx.cfg.num_experts, be.world, rx.shape[1])


def _expert_groups(num_local: int, n: int) -> list[range]:
    return [range(k * num_local // n, (k + 1) * num_local // n) for k in range(n)]


# LightLLM's grouped_fused_moe_ep kernels (shared/schedules/lightllm.py, expert_kernels): each
# op does its own part (real/moe_ep.py): scatter (normal layout: received rows -> expert-contiguous
# rows), the gate-up GEMM only, SiLU-and-mul (+ FP8 quantisation of the down GEMM's input when the
# GEMMs run in FP8), the down GEMM only, the weighted gather back to token order. A Program with
# no activation op of its own (SBO's gate-up + down slices) gets the activation in the gate-up op;
# one with no scatter takes the received rows through the unsplit path.


@register("experts.scatter")
def experts_scatter(ctx: KernelCtx) -> None:
    d = ctx.get("recv")
    if d["ll"]:  # the low-latency layout is already expert-major: nothing to permute
        note(ctx, "no-op: DeepEP's low-latency layout is already expert-contiguous")
        return
    r = d["res"]
    ctx.put("expert_scatter", ep_scatter(r.recv_x, r.recv_topk_idx, ctx.lw["w13"].shape[0]))


def _put_gate_up(ctx: KernelCtx, y: torch.Tensor) -> None:
    if ctx.launched("experts.act_quant"):
        ctx.put("expert_gate_up", y)
    else:
        ctx.put("expert_act", silu_and_mul(y))


@register("experts.gate_up")
def experts_gate_up(ctx: KernelCtx) -> None:
    d, lw = ctx.get("recv"), ctx.lw
    sc = None if d["ll"] else ctx.get("expert_scatter", None)
    with sm_budget(ctx, lw["w13"].device) as gm:
        if d["ll"]:
            rx = d["recv_x"]
            y = M.grouped_gemm_masked(rx, lw["w13"], d["count"], gm, _expected_m(ctx, rx))
        elif sc is not None:
            y = M.grouped_gemm_contiguous(sc.rows, lw["w13"], sc.counts, gm)
        else:  # normal layout, no scatter op: both GEMMs run per down slice (below)
            ctx.put("expert_act", None)
            return
    _put_gate_up(ctx, y)


@register("experts.act_quant")
def experts_act_quant(ctx: KernelCtx) -> None:
    """``silu_and_mul_masked_post_quant_fwd``: the activation; the FP8 quantisation only where
    the down GEMM runs in FP8 (else reported: the GEMMs take BF16 inputs)."""
    act = silu_and_mul(ctx.get("expert_gate_up"))
    if ctx.precision.fp8:  # the down GEMM takes FP8 + per-token scales
        ctx.put("expert_act", fp8.quant_tokens(act))
        return
    note(ctx, f"quantisation not run: the expert GEMMs run in BF16 ({ctx.precision.reason})")
    ctx.put("expert_act", act)


@register_pieces("experts.down")
def experts_down(ctx: KernelCtx) -> None:
    k, n = ctx.piece
    d, lw, act = ctx.get("recv"), ctx.lw, ctx.get("expert_act")
    grp = _expert_groups(lw["w13"].shape[0], n)[k]
    sl = slice(grp.start, grp.stop)
    sc = None if d["ll"] else ctx.get("expert_scatter", None)
    if d["ll"] and ctx.sbo_signal:
        ctx.put(f"expert_out.{k}", (grp, _signalled_down(ctx, act, sl)))
        return
    with sm_budget(ctx, lw["w2"].device) as g:
        if d["ll"]:
            em = _expected_m(ctx, _rows_of(act))
            y = M.grouped_gemm_masked(_rows(act, sl), lw["w2"][sl], d["count"][sl], g, em)
        elif sc is not None:  # expert-contiguous rows: this slice's experts are one row range
            lo, hi = sum(sc.counts[: grp.start]), sum(sc.counts[: grp.stop])
            y = M.grouped_gemm_contiguous(_rows(act, slice(lo, hi)), lw["w2"][sl], sc.counts[sl], g)
        else:
            r = d["res"]
            idx = r.recv_topk_idx
            mine = (idx >= grp.start) & (idx < grp.stop)
            y = M.experts_weighted(
                r.recv_x,
                torch.where(mine, idx, -1),
                r.recv_topk_weights,
                lw["w13"],
                lw["w2"],
                gemm=g,
            )
    ctx.put(f"expert_out.{k}", (grp, y))
    if sc is None and n == 1 and not ctx.op.waits:  # LightLLM's one down GEMM (no SBO signals)
        ctx.put("expert_out", _assemble_expert_out(ctx, 1))


def _signalled_down(ctx: KernelCtx, act, sl: slice) -> torch.Tensor:
    """SBO mode 1's down GEMM slice ``sl`` of local experts, through the Triton masked kernel
    that writes SBO's signal (DeepGEMM's BF16 masked kernel has none) within the op's SM
    budget, into the layer's one output and signal tensor (made by the first slice), so the
    combine can send each 64-row block as soon as its signal completes."""
    from overlap_lab.real import gemm as G

    d, w2 = ctx.get("recv"), ctx.lw["w2"]
    x = fp8.dequant(_rows(act, sl))
    rows = _rows_of(act).shape[1]
    down = ctx.get("sbo_down", None)
    if down is None or down["layer"] != ctx.op.layer:
        E = _rows_of(act).shape[0]
        y = torch.empty(E, rows, w2.shape[1], dtype=x.dtype, device=x.device)
        sig = torch.zeros(*G.signal_shape(E, rows), dtype=torch.int32, device=x.device)
        down = {"layer": ctx.op.layer, "y": y, "signal": sig, "block_m": G.BLOCK_M}
        down["threshold"] = G.signal_threshold(w2.shape[1])
        ctx.put("sbo_down", down)
    with sm_budget(ctx, w2.device) as g:
        sms = g.sms or ctx.op.sms or 1
        G.grouped_matmul_masked(
            x, w2[sl], d["count"][sl], num_sms=sms, out=down["y"][sl], signal=down["signal"][sl]
        )
        g.note("triton_persistent (SBO signal)")
    return down["y"][sl]


def _rows_of(act):
    """The activation tensor (an FP8 activation is a (values, scales) pair)."""
    return act[0] if isinstance(act, tuple) else act


def _rows(act, sl: slice):
    return tuple(t[sl] for t in act) if isinstance(act, tuple) else act[sl]


@register("experts.gather")
def experts_gather(ctx: KernelCtx) -> None:
    """``ep_gather``: each received row's expert outputs, weighted, summed in token order."""
    d = ctx.get("recv")
    if d["ll"]:  # the low-latency combine reduces; nothing to gather here
        note(ctx, "no-op: DeepEP's low-latency combine does the weighted reduction")
        return
    sc, r = ctx.get("expert_scatter"), d["res"]
    n = ctx.pieces("experts.down")
    y = torch.cat([ctx.get(f"expert_out.{j}")[1] for j in range(n)])
    ctx.put("expert_out", ep_gather(y, sc.output_index, r.recv_topk_weights, r.recv_x.dtype))


def _assemble_expert_out(ctx: KernelCtx, n: int) -> torch.Tensor:
    parts = [ctx.get(f"expert_out.{j}") for j in range(n)]
    if ctx.get("recv")["ll"]:
        return torch.cat([y for _, y in parts])
    return sum(y for _, y in parts)


@register_pieces("combine_a")
def combine_a_piece(ctx: KernelCtx) -> None:
    k, n = ctx.piece
    ctx.get(f"expert_out.{k}")  # this slice waits for its signal
    if k < n - 1:
        return
    ctx.put("expert_out", _assemble_expert_out(ctx, n))
    combine_a(ctx)


@register("combine_a")
def combine_a(ctx: KernelCtx) -> None:
    sbo = None
    if ctx.op.waits and ctx.sbo_signal:  # SBO mode 1, polling: see _signalled_down
        down = ctx.get("sbo_down")
        note(
            ctx,
            f"launched after the start event, not after the signals' events: the "
            f"{ctx.backend.name} combine polls the down GEMM's per-block signals in-kernel on "
            f"{ctx.op.sms} SMs (overlap possible on a GPU; the CPU interpreter runs it after)",
        )
        ctx.put("expert_out", down["y"])
        sbo = {k: down[k] for k in ("signal", "block_m", "threshold")}
        sbo.update(num_sms=ctx.op.sms, packed_recv_count=ctx.get("recv")["count"])
    elif ctx.op.waits:  # SBO mode 1: one combine over the signalled slices of the down GEMM
        note(
            ctx,
            "launched after the whole down GEMM: the executor does not poll SBO's per-block "
            "signals inside a kernel, so no down-GEMM/combine overlap is measured",
        )
        ctx.put("expert_out", _assemble_expert_out(ctx, len(ctx.op.waits)))
    y, d = ctx.get("expert_out"), ctx.get("dispatch")
    be = ctx.backend
    if ctx.op.sms:
        be.set_num_sms(ctx.op.sms, kind="ll_combine" if d["ll"] else "normal_combine")
    if d["ll"]:
        extra = {"sbo": sbo} if sbo is not None else {}
        out, _ev, hook = be.low_latency_combine(
            y, ctx.get("topk_idx"), ctx.get("topk_w"), d["handle"], return_recv_hook=True, **extra
        )
        ctx.put("combine", {"out": out, "done": hook})
    else:
        out, _, ev = be.combine(y, d["res"].handle, async_finish=True)
        ctx.put("combine", {"out": out, "done": ev})


@register("combine_b")
def combine_b(ctx: KernelCtx) -> None:
    c = ctx.get("combine")
    c["done"]()
    ctx.put("moe_out", c["out"])


@register("shared_experts")
def shared_experts(ctx: KernelCtx) -> None:
    lw = ctx.lw
    x = ctx.get("mlp_in")
    if "shared_w13" not in lw:  # Qwen3: no shared expert, the op carries no work
        ctx.put("shared_out", None)
        return
    with sm_budget(ctx, x.device) as g:
        ctx.put("shared_out", M.swiglu_mlp(x, lw["shared_w13"], lw["shared_w2"], mm=g.mm))


@register("output")
def output(ctx: KernelCtx) -> None:
    # A schedule may drop shared_experts when the model has none (its op carries no work);
    # dropping it for a model that has one shows up as a difference from serial.
    y, s = ctx.get("moe_out"), ctx.get("shared_out", None)
    ctx.put("hidden", y if s is None else y + s)


@register("comm_postprocess_layer")
def comm_postprocess_layer(ctx: KernelCtx) -> None:
    """The layer's residual add (shared/ir/ops.py's postprocess): hidden += residual."""
    h, res = ctx.get("hidden"), ctx.get("residual")
    ctx.put("hidden", h + res)
    ctx.put("residual", None)


# ----------------------------------------------------------------------------------------------
# Ops with no numerical effect: host-side scheduler work launched on the GPU, copies of inputs
# the executor already holds. Bound so every schedule's Program runs; extend as schedules grow.
# ----------------------------------------------------------------------------------------------

NOOP_OPS = (
    "noop",  # hand-written Programs and tests
    # SGLang's overlap scheduler (shared/ir/ops_sched.py): metadata kernels on the schedule stream
    # and the FutureMap's resolve/store. The executor's inputs and token ids are already on the
    # device, so these compute nothing here; on a GPU their (small) kernel time is therefore not
    # measured (real/README.md).
    "h2d_input_ids",
    "out_cache_loc_cast",
    "req_to_token_gather",
    "req_to_token_scatter",
    "resolve_future",
    "seq_lens_add",
    "seq_lens_clone",
    "seq_lens_next",
    "store_to_map",
    "write_req_to_token_pool_triton",
)


@register(*NOOP_OPS)
def noop(ctx: KernelCtx) -> None:
    return None


#: The attention half's own GEMMs and the quantisation kernels in front of FP8 GEMMs
#: (``shared.ir.ops.PARTS``): the simulator times each; this backend computes them inside the op of
#: their key (``attn.prepare``, ``attn.core``, ``shared_experts``, ``mlp``, whose FP8 GEMMs
#: quantise their own inputs: real/fp8.py), so here each is an empty kernel that says so.
FOLDED_OPS: dict[str, str] = {
    "attn.quant": "attn.prepare",
    "attn.uk_quant": "attn.prepare",
    "attn.absorb_k": "attn.prepare",
    "attn.uv_quant": "attn.core",
    "attn.absorb_v": "attn.core",
    "attn.o_quant": "attn.core",
    "attn.o_proj": "attn.core",
    "shared_experts.quant": "shared_experts",
    "mlp.quant": "mlp",
}


@register(*FOLDED_OPS)
def folded(ctx: KernelCtx) -> None:
    note(ctx, f"computed inside {FOLDED_OPS[ctx.op.name]} on this backend")


# ----------------------------------------------------------------------------------------------
# Point to point (pipeline parallelism, shared/schedules/pp.py): a micro-batch's tensors move
# between the in-process ranks of one Program through the mailbox, keyed by the collective's key
# (the send's Flow(dst=rank) and the recv on that rank share it). A receive whose send has not
# run yet raises WouldBlock and the executor retries it after the other ranks progressed.
# ----------------------------------------------------------------------------------------------

SEND_OPS = ("send",)  # a generic point-to-point pair (tests and hand-written Programs)
RECV_OPS = ("recv",)
PP_HIDDEN = ("hidden", "residual")  # DeepSeek's PPProxyTensors: what a stage hands on
PP_OUT = ("next_ids",)  # the last stage's sampled ids: back to rank 0, relayed round the ring


def _p2p_key(ctx: KernelCtx) -> str:
    return ctx.op.coll.key if ctx.op.coll is not None else ctx.op.name


def _post(ctx: KernelCtx, payload: dict) -> None:
    if ctx.world is None:
        raise RuntimeError(f"op {ctx.op.name}: point-to-point needs an in-process world")
    ts = [v for v in payload.values() if isinstance(v, torch.Tensor) and v.is_cuda]
    ts += [t for v in payload.values() if isinstance(v, tuple) for t in v if t.is_cuda]
    if ts:  # the receiving rank's stream waits for the sender's (ranks share one process)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(ts[0].device))
        payload = {**payload, "_event": ev}
    ctx.world.send(_p2p_key(ctx), ctx.rank, payload)


def _take(ctx: KernelCtx) -> dict:
    key = _p2p_key(ctx)
    payload = ctx.world.recv(key, ctx.rank) if ctx.world is not None else None
    if payload is None:
        raise WouldBlock(key)
    ev = payload.pop("_event", None)
    if ev is not None:
        torch.cuda.current_stream().wait_event(ev)
    return payload


@register(*SEND_OPS)
def p2p_send(ctx: KernelCtx) -> None:
    keys = [k for k in ("hidden", "residual", "next_ids") if k in ctx.state]
    _post(ctx, {k: ctx.get(k) for k in keys})


@register(*RECV_OPS, "pp_recv_hidden", "pp_recv_out")
def p2p_recv(ctx: KernelCtx) -> None:
    for k, v in _take(ctx).items():
        ctx.put(k, v)


@register("pp_send_hidden")
def pp_send_hidden(ctx: KernelCtx) -> None:
    """A non-last stage hands the micro-batch's hidden state and residual (after its last
    layer) to the next stage."""
    _post(ctx, {k: ctx.get(k) for k in PP_HIDDEN})


@register("pp_send_out")
def pp_send_out(ctx: KernelCtx) -> None:
    """The last stage sends the ids it sampled for this micro-batch to rank 0; a non-last stage
    relays the ids it received in an earlier iteration (SGLang's ``pp_outputs``: the latest
    ones, received in the previous micro-batch iteration) to the next stage."""
    if "next_ids" in ctx.state:  # sampled here (the last stage)
        _post(ctx, {k: ctx.get(k) for k in PP_OUT})
        return
    step, idx = _latest_received(ctx)
    _post(ctx, {k: ctx.get_at(step, idx, k) for k in PP_OUT})


def _latest_received(ctx: KernelCtx) -> tuple[int, int]:
    """(step, micro-batch) of the latest ids this rank received before the op's step."""
    steps = ctx.steps or {}
    here = ctx.op.step if ctx.op.step is not None else 0
    for s in sorted((s for s in steps if s < here), reverse=True):
        for idx, st in steps[s].mbs.items():
            if "next_ids" in st:
                return s, idx
    raise KeyError(
        f"op {ctx.op.name} (step {here}, mb {ctx.mb['index']}) relays next_ids, which this rank "
        "neither sampled nor received in an earlier iteration"
    )


@register("pp_allgather_hidden", "pp_allgather_out")
def pp_allgather(ctx: KernelCtx) -> None:
    """send-allgather inside attention TP: each rank got its 1/attn_tp slice over the PP link
    and gathers the rest; in-process the receive already holds the whole tensors (read here so
    the CPU check orders the gather after the receive)."""
    for k in PP_HIDDEN if ctx.op.name.endswith("hidden") else PP_OUT:
        ctx.get(k)


# ----------------------------------------------------------------------------------------------
# SM budgets for compute
# ----------------------------------------------------------------------------------------------


def sm_budget(ctx: KernelCtx, device=None):
    """Scope the op's SM limit (``op.sms``) around its GEMMs: ``with sm_budget(ctx, device) as
    g`` then ``g.mm`` (None: plain torch), ``g.grouped_masked``, ``g.grouped_contiguous``
    (real.gemm.ComputeBudget: DeepGEMM's set_num_sms scoped, or persistent Triton GEMMs whose
    grid is the budget, on a GPU with more SMs than the limit; torch otherwise), in the op's
    GEMM dtype and the run's precision. Kernels used are counted in the run's log."""
    from overlap_lab.real.gemm import ComputeBudget

    return ComputeBudget(
        ctx.op.sms,
        device,
        dtype=ctx.op.dtype,
        log=ctx.log,
        precision=ctx.precision,
        fp8_weights=ctx.fp8_weights,
    )
