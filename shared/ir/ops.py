"""The ops of one layer (and of the model's head) with their work, computed from the workload.

Each op carries FLOPs, HBM bytes, dtype, op_class and SM demand; dispatch/combine carry the bytes
this rank pushes over NVLink (peers in its node) and RDMA (other nodes). Op names follow upstream
(SGLang's DeepSeek operations): see MOE_OP_NAMES. Schedules take ops from here and never invent
work (they may only narrow ``sms`` with ``dataclasses.replace``).

Conventions and simplifications, stated once:
- GEMM M is the micro-batch's ``padded_tokens``; attention work uses its real tokens (padding
  rows of a CUDA graph attend over nothing worth counting).
- A GEMM Y[m,n] = X[m,k] W[k,n] costs 2mkn FLOPs and reads W once (``gemm_dtype`` bytes per
  weight; block scales ignored), reads X and writes Y in bf16.
- Under DP attention with ``attn_tp > 1`` each rank computes ``heads/attn_tp`` heads for all the
  micro-batch's tokens, and the MoE half runs on its ``1/attn_tp`` share of them (SGLang's
  scattered layout). The attention-TP all-reduce / reduce-scatter / all-gather that this implies
  lives in comm_prepare_mlp / comm_prepare_attn / comm_postprocess_layer and is NOT modeled as
  link traffic yet (a note, not a flow).
- Routing here is balanced (the symmetric program): every rank sends and receives the same
  number of token copies, and each of a token's top-k experts lands on an EP rank independently
  and uniformly (choices with replacement). Real routing, imbalance and per-rank work come from
  ``shared.inputs.routing`` and are applied per rank by ``shared.ir.ranks.expand_ranks``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.inputs.workload import (
    DTYPE_BYTES,
    Batch,
    MicroBatch,
    Workload,
    dense_layers,
    moe_layers,
    whole_batch,
)
from overlap_lab.shared.ir import ops_kernels as K
from overlap_lab.shared.ir.program import Coll, Flow, Op
from overlap_lab.shared.ir.work import (
    ACT,
    FP8_SCALE_BLOCK,
    Work,
    bmm,
    elementwise,
    fp8_row_bytes,
    gemm,
    quant,
    rmsnorm,
)

__all__ = [
    "DENSE_OP_NAMES",
    "HEAD_OP_NAMES",
    "KEY_OF",
    "MOE_OP_NAMES",
    "MTP_HEAD_NAMES",
    "MTP_OP_NAMES",
    "PARTS",
    "PART_OP_NAMES",
    "AttnWork",
    "Work",
    "attn_work",
    "combine_bytes_per_copy",
    "dense_layers",
    "dispatch_bytes_per_copy",
    "expected_dest_ranks",
    "expand_keys",
    "experts_work",
    "gemm",
    "head_ops",
    "layer_ops",
    "ll_num_sms",
    "moe_layers",
    "moe_tokens",
    "mtp_ops",
    "mtp_passes",
    "parts",
    "quant",
    "traffic",
    "whole_batch",
]

#: Ops a schedule launches where it names one of the keys below (``parts``), in this order: the
#: attention half's own GEMMs, the quantisation kernels in front of each FP8 GEMM, and the
#: memory- and latency-bound kernels a deployment runs around them (``shared.ir.ops_kernels``:
#: the attention's norms, RoPE and KV-cache store; the top-k ids' cast and the dispatch's FP8
#: quantisation; DeepEP normal mode's layout and notify kernels on its comm stream; the MoE's
#: scatter, activation and gather passes around the grouped GEMMs; the MLPs' activation; the
#: final norm before the LM head). They run back to back on the stream of their key in every
#: upstream schedule (SGLang's ``op_*`` and DeepSeek's stages each hold them all), so the
#: schedules keep naming the key and launch its parts. Parts absent for a model or mode (no
#: absorbed projections under GQA, no quantisation with BF16 GEMMs, no layout or notify kernel
#: with the low-latency kernels) are skipped. Where upstream runs a pass between two GEMMs this
#: model holds in one op (the grouped GEMMs' activation, the MLPs'), the pass follows the op:
#: the stream runs the same work, one kernel boundary off (docs/schedules.md).
PARTS: dict[str, tuple[str, ...]] = {
    "attn.prepare": (
        "attn.quant",
        "attn.prepare",
        "attn.norm",
        "attn.uk_quant",
        "attn.absorb_k",
        "attn.rope",
        "attn.kv_write",
    ),
    "attn.core": ("attn.core", "attn.uv_quant", "attn.absorb_v", "attn.o_quant", "attn.o_proj"),
    "select_experts": ("select_experts", "select_experts.ids", "dispatch.quant"),
    "dispatch_a": ("get_dispatch_layout", "notify_dispatch", "dispatch_a"),
    "experts": (
        "experts.scatter",
        "experts",
        "experts.act",
        "experts.quant",
        "experts.act_quant",
        "experts.gather",
    ),
    "combine_a": ("cached_notify", "combine_a"),
    "shared_experts": ("shared_experts.quant", "shared_experts", "shared_experts.act"),
    "mlp": ("mlp.quant", "mlp", "mlp.act"),
    "logits": ("final_norm", "logits"),
}
#: The key each part is launched for (a key's own op maps to itself).
KEY_OF: dict[str, str] = {p: k for k, ps in PARTS.items() for p in ps}
PART_OP_NAMES: tuple[str, ...] = tuple(
    dict.fromkeys(n for ps in PARTS.values() for n in ps if n not in PARTS)
)
MOE_OP_NAMES: tuple[str, ...] = (
    "comm_prepare_attn",
    "attn.prepare",
    "attn.core",
    "comm_prepare_mlp",
    "gate",
    "select_experts",
    "dispatch_a",
    "dispatch_b",
    "experts",
    "combine_a",
    "combine_b",
    "shared_experts",
    "output",
    "comm_postprocess_layer",
)
DENSE_OP_NAMES: tuple[str, ...] = (
    "comm_prepare_attn",
    "attn.prepare",
    "attn.core",
    "comm_prepare_mlp",
    "mlp",
    "comm_postprocess_layer",
)
HEAD_OP_NAMES: tuple[str, ...] = ("embed", "final_norm", "logits", "sample", "d2h")


def parts(ops: Mapping[str, Op], key: str) -> list[Op]:
    """The ops a schedule launches for ``key``, in order (:data:`PARTS`; a key without parts is
    itself)."""
    return [ops[k] for k in PARTS.get(key, (key,)) if k in ops]


def expand_keys(keys: Iterable) -> list:
    """``keys`` with every key that has parts replaced by its parts (non-string items, such as
    TBO's YIELD, pass through)."""
    out: list = []
    for k in keys:
        out.extend(PARTS[k] if isinstance(k, str) and k in PARTS else (k,))
    return out


def mlp(rows: float, hidden: int, inter: int, wbytes: int) -> Work:
    """Gated MLP's GEMMs: gate_up (hidden -> 2*inter) and down (inter -> hidden). Its
    SiLU-and-mul is a kernel of its own (``ops_kernels.silu_and_mul``: the ``*.act`` part)."""
    if rows <= 0 or inter <= 0:
        return Work()
    return gemm(rows, hidden, 2 * inter, wbytes) + gemm(rows, inter, hidden, wbytes)


# ----------------------------------------------------------------------------------------------
# Attention: what a micro-batch's tokens attend over
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttnWork:
    """Attention geometry of a token range of a batch (sequences may be cut, see split_seq).

    A piece is the part of one sequence inside the range; ``cached`` for a piece is every token of
    its sequence before the piece (prefix or KV cache, plus earlier pieces).
    """

    q_tokens: int  # query tokens (real, unpadded)
    pairs: float  # causal query-key pairs: sum over pieces of n*cached + n(n+1)/2
    ctx_tokens: int  # keys read: sum over pieces of cached + n
    cached_tokens: int  # keys already in the KV cache: sum over pieces of cached
    seq_ends: int  # pieces that hold their sequence's last token (rows of prefill logits)
    pieces: int


@lru_cache(maxsize=4096)
def attn_work(batch: Batch, tok_lo: int, tok_hi: int) -> AttnWork:
    """Sum the attention geometry of tokens [tok_lo, tok_hi) of ``batch``."""
    offs = batch.token_offsets()
    q = ctx = cached_sum = ends = pieces = 0
    pairs = 0.0
    for i in range(batch.num_seqs):
        lo, hi = max(tok_lo, offs[i]), min(tok_hi, offs[i + 1])
        if lo >= hi:
            continue
        n = hi - lo
        cached = batch.seq_cached(i) + (lo - offs[i])
        q += n
        pairs += n * cached + n * (n + 1) / 2
        ctx += cached + n
        cached_sum += cached
        ends += hi == offs[i + 1]
        pieces += 1
    return AttnWork(q, pairs, ctx, cached_sum, ends, pieces)


def mla_prepare(w: Workload, rows: int) -> Work:
    """The projections' GEMMs: q down/up (or q_proj without q_lora) and kv_a (down); prefill adds
    the kv_b up-projection of the new tokens (non-absorbed MHA path). Their norms, RoPE and the
    KV-cache store are kernels of their own (``ops_kernels``: ``attn.norm``, ``attn.rope``,
    ``attn.kv_write``), as is decode's W_UK absorption (``mla_absorb_k``)."""
    m, h = w.model, w.heads_per_rank
    wb = DTYPE_BYTES[m.gemm_dtype]
    dqk, lat = m.qk_nope_dim + m.qk_rope_dim, m.kv_lora_rank + m.qk_rope_dim
    if m.q_lora_rank:
        q = gemm(rows, m.hidden, m.q_lora_rank, wb) + gemm(rows, m.q_lora_rank, h * dqk, wb)
    else:
        q = gemm(rows, m.hidden, h * dqk, wb)
    kv = gemm(rows, m.hidden, lat, wb)
    if w.batch.mode == "decode":
        return q + kv
    return q + kv + gemm(rows, m.kv_lora_rank, h * (m.qk_nope_dim + m.v_head_dim), wb)


def mla_absorb_k(w: Workload, rows: int) -> Work:
    """Decode's W_UK absorption: q_nope -> latent, one GEMM per head batched over the heads
    (DeepGEMM's masked grouped FP8 GEMM in SGLang with DeepGEMM, ``torch.bmm`` otherwise)."""
    m = w.model
    return bmm(rows, w.heads_per_rank, m.qk_nope_dim, m.kv_lora_rank, DTYPE_BYTES[m.gemm_dtype])


def mla_absorb_v(w: Workload, rows: int) -> Work:
    """Decode's W_UV: the attention's latent output -> v per head, batched over the heads."""
    m = w.model
    return bmm(rows, w.heads_per_rank, m.kv_lora_rank, m.v_head_dim, DTYPE_BYTES[m.gemm_dtype])


def o_proj(w: Workload, rows: int) -> Work:
    """o_proj: the heads' values -> hidden, an FP8 GEMM (DeepGEMM) for FP8 checkpoints."""
    m = w.model
    width = w.heads_per_rank * (m.v_head_dim if m.attention == "mla" else m.head_dim)
    return gemm(rows, width, m.hidden, DTYPE_BYTES[m.gemm_dtype])


def mla_core(w: Workload, aw: AttnWork, rows: int) -> Work:
    """Core attention (W_UV and o_proj are ops of their own). Decode: absorbed MLA (MQA over the
    kv_lora+rope latent, read once per piece for all heads: FlashMLA). Prefill: MHA with causal
    attention over prefix+extend, the cached prefix latents up-projected by kv_b first."""
    m, h = w.model, w.heads_per_rank
    wb, kvb = DTYPE_BYTES[m.gemm_dtype], DTYPE_BYTES[m.attn_dtype]
    dqk, lat = m.qk_nope_dim + m.qk_rope_dim, m.kv_lora_rank + m.qk_rope_dim
    if w.batch.mode == "decode":
        qo = aw.q_tokens * h * (lat + m.kv_lora_rank) * ACT
        return Work(2.0 * h * aw.pairs * (lat + m.kv_lora_rank), aw.ctx_tokens * lat * kvb + qo)
    up = gemm(aw.cached_tokens, m.kv_lora_rank, h * (m.qk_nope_dim + m.v_head_dim), wb)
    up = up + Work(0.0, aw.cached_tokens * lat * kvb)
    qo = aw.q_tokens * h * (dqk + m.v_head_dim) * ACT
    core = Work(
        2.0 * h * aw.pairs * (dqk + m.v_head_dim),
        aw.ctx_tokens * h * (dqk + m.v_head_dim) * ACT + qo,
    )
    return up + core


def gqa_prepare(w: Workload, rows: int) -> Work:
    """The fused qkv projection; the q/k RMSNorm (Qwen3), RoPE and the KV-cache store are
    kernels of their own (``ops_kernels``)."""
    m, hq, hkv = w.model, w.heads_per_rank, w.kv_heads_per_rank
    return gemm(rows, m.hidden, (hq + 2 * hkv) * m.head_dim, DTYPE_BYTES[m.gemm_dtype])


def gqa_core(w: Workload, aw: AttnWork, rows: int) -> Work:
    """Causal attention (QK^T and PV: 4*d FLOPs per pair per q head; K and V read once per
    piece per kv head); o_proj is an op of its own."""
    m, hq, hkv = w.model, w.heads_per_rank, w.kv_heads_per_rank
    kvb, d = DTYPE_BYTES[m.attn_dtype], m.head_dim
    kv_read = aw.ctx_tokens * 2 * hkv * d * kvb
    return Work(4.0 * hq * d * aw.pairs, kv_read + 2 * aw.q_tokens * hq * d * ACT)


# ----------------------------------------------------------------------------------------------
# MoE: routing, experts and the traffic of dispatch/combine
# ----------------------------------------------------------------------------------------------


def moe_tokens(w: Workload, mb: MicroBatch) -> int:
    """Tokens of the micro-batch that this rank's MoE half handles (its attn-TP share)."""
    return math.ceil(mb.padded_tokens / w.parallel.attn_tp)


def router_gemm(w: Workload, rows: int) -> Work:
    """gate: hidden x num_experts router GEMM in bf16 with fp32 logits (unquantized in V3)."""
    return gemm(rows, w.model.hidden, w.model.num_experts, DTYPE_BYTES["bf16"], out_bytes=4)


def select_experts_work(w: Workload, rows: int) -> Work:
    """Top-k over the router logits (+ group scores and group top-k for DeepSeek-V3's
    group-limited routing): reads fp32 logits, writes int32 ids and fp32 weights."""
    e, k = w.model.num_experts, w.model.top_k
    flops_per = 8.0 if w.model.group_limited else 4.0
    return Work(flops_per * rows * e, rows * e * 4 + rows * k * 8)


def expert_active_prob(w: Workload, rows: int) -> float:
    """Chance a given expert receives at least one of the ``rows * ep`` tokens of the EP group
    (each token picks ``top_k`` of ``num_experts``), i.e. that its weights are read."""
    m, total = w.model, rows * w.parallel.ep
    return 1.0 - (1.0 - m.top_k / m.num_experts) ** total


def routed_experts(w: Workload, rows: int) -> Work:
    """Grouped GEMM over the token copies this rank receives. Under symmetric balanced load a
    rank receives as many copies as it sends: rows * top_k, i.e. rows * top_k / local_experts
    per local expert (= rows * ep * top_k / num_experts). Weights of active experts are read."""
    return experts_work(w, rows * w.model.top_k, w.local_experts * expert_active_prob(w, rows))


def experts_work(w: Workload, copies: float, active_experts: float) -> Work:
    """The two grouped GEMMs (gate_up, down) over ``copies`` received token copies; the weights
    of ``active_experts`` local experts are read. Each GEMM reads its fp8 input (with scales)
    and writes bf16: hidden in and 2 x inter out, inter in and hidden out. The activation
    between them and the passes around them are kernels of their own (``ops_kernels``)."""
    m, wb = w.model, DTYPE_BYTES[w.model.gemm_dtype]
    if copies <= 0:
        return Work()
    flops = copies * 6.0 * m.hidden * m.expert_inter
    weights = active_experts * 3 * m.hidden * m.expert_inter * wb
    ins = fp8_row_bytes(m.hidden) + fp8_row_bytes(m.expert_inter)
    acts = copies * (ins + (2 * m.expert_inter + m.hidden) * ACT)
    return Work(flops, weights + acts)


def expected_dest_ranks(ep: int, top_k: int) -> float:
    """Distinct EP ranks a token goes to: R * (1 - (1 - 1/R)^k), each of its k experts landing
    on a rank independently and uniformly (balanced routing, choices with replacement)."""
    return ep * rank_hit_prob(ep, top_k)


def rank_hit_prob(ep: int, top_k: int) -> float:
    """Chance that a given EP rank holds at least one of a token's top-k experts."""
    return 1.0 - (1.0 - 1.0 / ep) ** top_k


def dispatch_bytes_per_copy(hidden: int) -> float:
    """FP8 dispatch: hidden fp8 bytes + one fp32 scale per 128 values."""
    return hidden + math.ceil(hidden / FP8_SCALE_BLOCK) * 4


def combine_bytes_per_copy(hidden: int) -> float:
    """BF16 combine: 2 bytes per hidden value."""
    return 2.0 * hidden


def ll_num_sms(num_experts: int, num_device_sms: int) -> int:
    """SMs of DeepEP's low-latency kernels (csrc/kernels/internode_ll.cu):
    num_warp_groups = ceil(E / device_sms); num_sms = ceil(E / num_warp_groups)."""
    groups = math.ceil(num_experts / num_device_sms)
    return math.ceil(num_experts / groups)


def expected_bytes(
    tokens: float, ep: int, gpus_per_node: int, top_k: int, mode: str, per_copy: float
) -> dict[str, float]:
    """What one rank sends under balanced routing (the symmetric program's flows): "local"
    (itself, no flow), "nvlink" and "rdma". Equal to a row sum of ``shared.ir.deepep.byte_matrices``
    for the balanced expectation, so explicit balanced ranks reproduce the symmetric step. It
    lives here, not in ``shared.ir.deepep``, so building a Program imports neither numpy nor the
    routing sampler."""
    g = min(ep, gpus_per_node)
    nodes = -(-ep // g)
    per_rank = top_k / ep if mode == "low_latency" else rank_hit_prob(ep, top_k)
    unit = tokens * per_rank * per_copy
    if mode == "low_latency" or nodes == 1:
        return {"local": unit, "nvlink": unit * (g - 1), "rdma": unit * (ep - g)}
    node_unit = tokens * rank_hit_prob(nodes, top_k) * per_copy
    return {"local": unit, "nvlink": unit * (g - 1) * nodes, "rdma": node_unit * (nodes - 1)}


def traffic(w: Workload, rows: int, per_copy: float, dedup: bool) -> dict[str, float]:
    """Bytes this rank sends for ``rows`` tokens under balanced routing, split into "local"
    (itself, no flow), "nvlink" and "rdma" (``expected_bytes``).

    low-latency (no dedup): one copy per (token, expert): k/R copies per token per rank, peers of
    the node over NVLink, other nodes over RDMA. normal (dedup): one copy per (token, destination
    rank) inside a node; across nodes one RDMA copy per (token, destination node) to the same-rail
    GPU there, which forwards it over NVLink to the GPUs of its node that need it.
    """
    p = w.parallel
    mode = "normal" if dedup else "low_latency"
    return expected_bytes(rows, p.ep, p.gpus_per_node, w.model.top_k, mode, per_copy)


def _flows(t: dict[str, float]) -> tuple[Flow, ...]:
    return tuple(Flow(link, t[link]) for link in ("nvlink", "rdma") if t[link] > 0)


# ----------------------------------------------------------------------------------------------
# Assembling the ops
# ----------------------------------------------------------------------------------------------


def _resolve_mode(w: Workload, deepep_mode: str) -> str:
    if deepep_mode == "auto":
        return "low_latency" if w.batch.mode == "decode" else "normal"
    if deepep_mode not in ("normal", "low_latency"):
        raise ConfigError(f"deepep_mode must be normal, low_latency or auto, got {deepep_mode!r}")
    return deepep_mode


def _check_mb(w: Workload, mb: MicroBatch) -> None:
    b = w.batch
    if not (
        0 <= mb.tok_lo <= mb.tok_hi <= b.num_tokens and 0 <= mb.seq_lo <= mb.seq_hi <= b.num_seqs
    ):
        raise ConfigError(f"micro-batch {mb.index} lies outside the batch: {mb}")
    if mb.padded_tokens < mb.tokens:
        raise ConfigError(f"micro-batch {mb.index}: padded_tokens < tokens ({mb})")


_NO_WORK = Work()


class _Maker:
    """Stamps layer / micro-batch / step / tokens on every op of one call."""

    def __init__(self, layer: int | None, mb: MicroBatch, step: int | None):
        self.layer, self.mb, self.step = layer, mb, step

    def __call__(self, name: str, work: Work = _NO_WORK, **kw) -> Op:
        return Op(
            name,
            layer=self.layer,
            mb=self.mb.index,
            step=self.step,
            tokens=self.mb.padded_tokens,
            flops=float(work.flops),
            hbm_bytes=float(work.hbm_bytes),
            **kw,
        )

    def key(self, what: str) -> str:
        return f"s{self.step}.L{self.layer}.mb{self.mb.index}.{what}"


def _attention_ops(w: Workload, mb: MicroBatch, mk: _Maker) -> dict[str, Op]:
    """The attention half's ops in launch order (``PARTS`` of ``attn.prepare``/``attn.core``).

    With FP8 GEMMs every GEMM input is quantised by a kernel of its own first (``*quant``):
    the hidden states (and, with q_lora, the normed q latent) before the fused q_a/kv_a and q_b
    projections (``attn.quant``: two launches, one op), q_nope before W_UK, the latent output
    before W_UV and the heads' values before o_proj. The projections' norms (``attn.norm``),
    RoPE (``attn.rope``) and the KV-cache store (``attn.kv_write``) run at memory rate as the
    kernels they are upstream, before the attention kernel."""
    m, rows = w.model, mb.padded_tokens
    aw = attn_work(w.batch, mb.tok_lo, mb.tok_hi)
    fp8, h = m.gemm_dtype == "fp8", w.heads_per_rank
    absorbed = m.attention == "mla" and w.batch.mode == "decode"
    if m.attention == "mla":
        prep, core = mla_prepare(w, rows), mla_core(w, aw, rows)
    else:
        prep, core = gqa_prepare(w, rows), gqa_core(w, aw, rows)
    gemm_kw = dict(dtype=m.gemm_dtype, op_class="gemm")
    out = {"comm_prepare_attn": mk("comm_prepare_attn", rmsnorm(rows, m.hidden, residual=True))}
    if fp8:
        q_in = quant(rows, m.hidden) + (quant(rows, m.q_lora_rank) if m.q_lora_rank else Work())
        out["attn.quant"] = mk("attn.quant", q_in)
    out["attn.prepare"] = mk("attn.prepare", prep, **gemm_kw)
    norms = K.attn_norms(w, rows)
    if norms.hbm_bytes:
        out["attn.norm"] = mk("attn.norm", norms)
    if absorbed:
        if fp8:
            out["attn.uk_quant"] = mk("attn.uk_quant", quant(rows, h * m.qk_nope_dim))
        out["attn.absorb_k"] = mk("attn.absorb_k", mla_absorb_k(w, rows), **gemm_kw)
    out["attn.rope"] = mk("attn.rope", K.rope(w, rows))
    out["attn.kv_write"] = mk("attn.kv_write", K.kv_write(w, rows))
    # prefill attention (FlashAttention-3, varlen causal) hands tiles to its persistent CTAs
    # from an atomic counter (DynamicPersistentTileScheduler): CTAs that start late take what
    # is left. Decode attention (FlashMLA) splits the work statically per SM part.
    out["attn.core"] = mk(
        "attn.core",
        core,
        dtype=m.attn_dtype,
        op_class="attention",
        grid="dynamic" if w.batch.mode == "prefill" else None,
    )
    if absorbed:
        if fp8:
            out["attn.uv_quant"] = mk("attn.uv_quant", quant(rows, h * m.kv_lora_rank))
        out["attn.absorb_v"] = mk("attn.absorb_v", mla_absorb_v(w, rows), **gemm_kw)
    width = h * (m.v_head_dim if m.attention == "mla" else m.head_dim)
    if fp8:
        out["attn.o_quant"] = mk("attn.o_quant", quant(rows, width))
    out["attn.o_proj"] = mk("attn.o_proj", o_proj(w, rows), **gemm_kw)
    return out


def _comm_pair(w: Workload, gpu: GPU, mk: _Maker, what: str, rows: int, mode: str):
    """The two halves of dispatch or combine. low_latency: *_a sends (DeepEP LL grid), *_b is
    the recv hook (the same grid, recv phase: waits for arrival, unpacks). normal: *_a sends
    and receives holding deepep_normal_sms; *_b is an empty completion marker."""
    m = w.model
    dispatch = what == "dispatch"
    per_copy = dispatch_bytes_per_copy(m.hidden) if dispatch else combine_bytes_per_copy(m.hidden)
    t = traffic(w, rows, per_copy, dedup=mode == "normal")
    sent = t["local"] + t["nvlink"] + t["rdma"]  # == received, by symmetry
    dtype, key = ("fp8" if dispatch else "bf16"), mk.key(what)
    common = dict(kind="comm", op_class="comm", dtype=dtype)
    if mode == "low_latency":
        sms = ll_num_sms(m.num_experts, gpu.num_sms)
        src = rows * m.hidden * ACT if dispatch else rows * m.top_k * m.hidden * ACT
        a = mk(
            f"{what}_a", Work(0.0, src + sent), sms=sms, coll=Coll(key, "send", _flows(t)), **common
        )
        b = mk(f"{what}_b", Work(0.0, 2 * sent), sms=sms, coll=Coll(key, "recv"), **common)
    else:
        sms = gpu.deepep_normal_sms
        a = mk(
            f"{what}_a",
            Work(0.0, 2 * sent),
            sms=sms,
            coll=Coll(key, "sendrecv", _flows(t)),
            **common,
        )
        b = mk(f"{what}_b", sms=0, coll=Coll(key, "recv"), **common)
    return {a.name: a, b.name: b}


def _notify(w: Workload, gpu: GPU, mk: _Maker, what: str) -> Op:
    """DeepEP normal mode's notify kernel on the comm stream before the dispatch
    (``notify_dispatch``: the received-token counts) or the combine (``cached_notify``: a barrier
    and buffer cleaning). Each waits for every peer's notify, so it is a collective of its own
    (role sendrecv, a small flow to each peer: ``ops_kernels.notify_payload``) that completes only
    when every peer's has arrived; in explicit ranks its time holds the skew between the ranks
    (``shared.ir.ranks``). Its grid is DeepEP's (``ctas``: ``notify_dispatch`` one CTA and one
    per peer or node, ``cached_notify_combine`` one and one per channel), within the Buffer's
    SMs (``sms``); across nodes ``cached_notify``'s grid is the Buffer's SMs themselves."""
    p = w.parallel
    g = min(p.ep, p.gpus_per_node)
    nodes = math.ceil(p.ep / g)
    peers = {"nvlink": g - 1, "rdma": nodes - 1}
    flows = tuple(
        Flow(link, n * K.notify_payload(w, link, what)) for link, n in peers.items() if n > 0
    )
    nbytes = 2 * sum(f.nbytes for f in flows)
    coll = Coll(mk.key(f"{what}_notify"), "sendrecv", flows)
    sms = gpu.deepep_normal_sms
    common = dict(kind="comm", op_class="comm", dtype="bf16", coll=coll, sms=sms)
    if what == "dispatch":
        ctas = K.notify_dispatch_ctas(p.ep, p.gpus_per_node)
        return mk("notify_dispatch", Work(0.0, nbytes), ctas=min(ctas, sms), **common)
    ctas = K.cached_notify_ctas(p.ep, p.gpus_per_node, sms)
    return mk("cached_notify", Work(0.0, nbytes), ctas=ctas if ctas != sms else None, **common)


def _expert_passes(w: Workload, rows: int, mode: str) -> dict[str, Work]:
    """The memory-bound passes around the grouped GEMMs, as SGLang's DeepEP MoE runs them
    (``DeepEPMoE.forward_deepgemm_contiguous`` / ``forward_deepgemm_masked``,
    ``layers/moe/ep_moe/layer.py``). Normal mode (received tokens deduplicated per rank):
    ``ep_scatter`` into expert-contiguous rows, ``silu_and_mul``, the down GEMM's input
    quantisation, ``ep_gather``'s weighted reduce. Low-latency mode: DeepEP already delivers the
    masked expert-major layout and its combine does the weighted reduce, so only the activation
    runs, fused with the quantisation (``silu_and_mul_masked_post_quant_fwd``)."""
    m, fp8 = w.model, w.model.gemm_dtype == "fp8"
    copies = K.copies_received(w, rows)
    if mode == "low_latency":
        if fp8:
            return {"experts.act_quant": K.silu_and_mul_quant(copies, m.expert_inter)}
        return {"experts.act": K.silu_and_mul(copies, m.expert_inter)}
    out = {"experts.scatter": K.ep_scatter(w, rows)}
    out["experts.act"] = K.silu_and_mul(copies, m.expert_inter)
    if fp8:
        out["experts.quant"] = quant(copies, m.expert_inter)
    out["experts.gather"] = K.ep_gather(w, rows)
    return out


def _moe_ops(w: Workload, gpu: GPU, mb: MicroBatch, mk: _Maker, mode: str) -> dict[str, Op]:
    """A MoE layer's ops in launch order (``PARTS`` expanded): the router GEMM, the top-k chain,
    DeepEP's kernels, the grouped GEMMs with the passes around them, the shared experts."""
    m, rows = w.model, moe_tokens(w, mb)
    wb, fp8, normal = DTYPE_BYTES[m.gemm_dtype], m.gemm_dtype == "fp8", mode == "normal"
    ops = {
        "comm_prepare_mlp": mk("comm_prepare_mlp", rmsnorm(rows, m.hidden, residual=True)),
        "gate": mk("gate", router_gemm(w, rows), op_class="gemm"),
        "select_experts": mk("select_experts", select_experts_work(w, rows)),
        "select_experts.ids": mk("select_experts.ids", K.topk_ids_int64(rows, m.top_k)),
    }
    if normal and fp8:  # dispatch_a's per_token_group_quant_fp8 on the compute stream
        ops["dispatch.quant"] = mk("dispatch.quant", quant(rows, m.hidden))
    if normal:  # Buffer.get_dispatch_layout, then notify_dispatch, on DeepEP's comm stream
        ctas = K.dispatch_layout_ctas(m.num_experts, w.parallel.ep)
        layout = K.dispatch_layout(w, rows)
        ops["get_dispatch_layout"] = mk(
            "get_dispatch_layout", layout, op_class="sampling", ctas=ctas
        )
        ops["notify_dispatch"] = _notify(w, gpu, mk, "dispatch")
    ops.update(_comm_pair(w, gpu, mk, "dispatch", rows, mode))
    passes = _expert_passes(w, rows, mode)
    if "experts.scatter" in passes:
        ops["experts.scatter"] = mk("experts.scatter", passes.pop("experts.scatter"))
    ops["experts"] = mk(
        "experts", routed_experts(w, rows), dtype=m.gemm_dtype, op_class="grouped_gemm"
    )
    for name, work in passes.items():
        ops[name] = mk(name, work)
    if normal:
        ops["cached_notify"] = _notify(w, gpu, mk, "combine")
    ops.update(_comm_pair(w, gpu, mk, "combine", rows, mode))
    shared = mlp(rows, m.hidden, m.shared_inter, wb)  # zero work without shared experts (Qwen3)
    if fp8 and m.shared_inter > 0:  # gate_up's and down's inputs
        sq = quant(rows, m.hidden) + quant(rows, m.shared_inter)
        ops["shared_experts.quant"] = mk("shared_experts.quant", sq)
    ops["shared_experts"] = mk("shared_experts", shared, dtype=m.gemm_dtype, op_class="gemm")
    if m.shared_inter > 0:
        ops["shared_experts.act"] = mk("shared_experts.act", K.silu_and_mul(rows, m.shared_inter))
    ops["output"] = mk("output", elementwise(rows, m.hidden, reads=2, writes=1))
    ops["comm_postprocess_layer"] = mk("comm_postprocess_layer", _postprocess(w, rows))
    return ops


def _postprocess(w: Workload, rows: int) -> Work:
    """Residual add of the layer output. With attn_tp > 1 SGLang also gathers the scattered
    tokens here (an all-gather over the attention-TP group): not modeled as traffic yet."""
    return elementwise(rows, w.model.hidden, reads=2, writes=1)


#: The multi-token-prediction module's own ops (DeepSeek-V3 §2.2; SGLang's
#: ``DeepseekModelNextN``): embed the tokens, RMSNorm the embeddings and the main model's last
#: hidden states (``enorm``, ``hnorm``), project their concatenation back to the hidden size
#: (``eh_proj``), one transformer layer (launched as layer ``num_layers + pass``, its ops named as
#: every layer's), then the shared head (final norm + lm_head) and the draft token's argmax.
MTP_OP_NAMES: tuple[str, ...] = ("mtp.embed", "mtp.norm", "mtp.eh_proj")
MTP_HEAD_NAMES: tuple[str, ...] = ("mtp.final_norm", "mtp.logits", "mtp.sample")


def mtp_passes(w: Workload) -> int:
    """How many times a decode step runs the MTP module: once per draft token it proposes
    (``tokens_per_seq - 1``: the step verifies the previous step's drafts and proposes as many
    new ones, SGLang's EAGLE worker reusing DeepSeek-V3's one module for every draft step), when
    the model has a module (``ModelConfig.mtp``); 0 in prefill or with one token per sequence."""
    b = w.batch
    if w.model.mtp <= 0 or b.mode != "decode" or b.tokens_per_seq <= 1:
        return 0
    return b.tokens_per_seq - 1


def mtp_ops(
    w: Workload, gpu: GPU, mb: MicroBatch, *, deepep_mode: str = "auto", step: int | None = None
) -> list[Op]:
    """The MTP module's ops for one micro-batch after the main model's sample, in launch order
    (empty when :func:`mtp_passes` is 0). Every pass runs over the micro-batch's tokens (the draft
    extend after verification holds up to ``tokens_per_seq`` tokens per sequence; later draft
    steps, one token per sequence, are charged the same: an upper bound). The layer is a MoE
    layer (DeepSeek-V3's MTP block), with its own collectives (layer ``num_layers + pass``)."""
    passes = mtp_passes(w)
    if not passes:
        return []
    _check_mb(w, mb)
    mode = _resolve_mode(w, deepep_mode)
    m, rows = w.model, mb.padded_tokens
    out: list[Op] = []
    for k in range(passes):
        layer = m.num_layers + k
        mk = _Maker(layer, mb, step)
        out.append(mk("mtp.embed", Work(0.0, 2 * rows * m.hidden * ACT)))
        out.append(mk("mtp.norm", rmsnorm(rows, m.hidden) + rmsnorm(rows, m.hidden)))
        eh = gemm(rows, 2 * m.hidden, m.hidden, DTYPE_BYTES["bf16"])  # not quantised in V3
        out.append(mk("mtp.eh_proj", eh, op_class="gemm"))
        template = _layer_template(w, gpu, mb, mode, m.num_layers >= m.first_k_dense, step)
        out.extend(_stamp(template, layer, mb, step).values())
        out.append(mk("mtp.final_norm", rmsnorm(rows, m.hidden)))
        logits = gemm(rows, m.hidden, m.vocab, ACT, out_bytes=4)
        out.append(mk("mtp.logits", logits, op_class="gemm"))
        argmax = Work(2.0 * rows * m.vocab, rows * m.vocab * 4 + rows * 8)
        out.append(mk("mtp.sample", argmax, op_class="sampling"))
    return out


def layer_ops(
    w: Workload,
    gpu: GPU,
    layer: int,
    mb: MicroBatch,
    *,
    deepep_mode: str = "auto",
    step: int | None = None,
) -> dict[str, Op]:
    """The ops of one layer for one micro-batch, keyed (and ordered) as MOE_OP_NAMES or, for the
    first dense layers, DENSE_OP_NAMES. ``deepep_mode`` "auto" resolves as SGLang does.

    The ops of two MoE (or two dense) layers differ only in their ``layer`` field and their
    collectives' keys, so the work is computed once per (workload, GPU, micro-batch, mode, step)
    (``_layer_template``) and only those two are stamped per layer."""
    mode = _resolve_mode(w, deepep_mode)
    _check_mb(w, mb)
    template = _layer_template(w, gpu, mb, mode, w.model.is_moe_layer(layer), step)
    return _stamp(template, layer, mb, step)


def _stamp(template: tuple, layer: int, mb: MicroBatch, step: int | None) -> dict[str, Op]:
    """A layer template's ops with ``layer`` and its collectives' keys stamped on."""
    prefix = f"s{step}.L{layer}.mb{mb.index}."
    out = {}
    for name, kw, coll in template:
        if coll is None:
            out[name] = Op(layer=layer, **kw)
        else:
            what, role, flows = coll
            out[name] = Op(layer=layer, coll=Coll(prefix + what, role, flows), **kw)
    return out


_STAMPED = ("layer", "coll")
_OP_FIELDS = tuple(f for f in Op.__dataclass_fields__ if f not in _STAMPED)


@lru_cache(maxsize=512)
def _layer_template(
    w: Workload, gpu: GPU, mb: MicroBatch, mode: str, moe: bool, step: int | None
) -> tuple[tuple[str, dict, tuple[str, str, tuple[Flow, ...]] | None], ...]:
    """One layer's ops as (key, Op fields but ``layer`` and ``coll``, (what, role, flows) of the
    collective or None): what ``layer_ops`` stamps per layer. Built with a layer-less maker,
    so the collective's key ends in ``.{what}`` after the layer part, which is replaced."""
    mk = _Maker(None, mb, step)
    ops = _attention_ops(w, mb, mk)
    if moe:
        ops.update(_moe_ops(w, gpu, mb, mk, mode))
    else:
        m, rows = w.model, moe_tokens(w, mb)
        ops["comm_prepare_mlp"] = mk("comm_prepare_mlp", rmsnorm(rows, m.hidden, residual=True))
        # Dense MLP computed whole on each rank (SGLang's moe_dense_tp_size=1 under DP attention).
        dense = mlp(rows, m.hidden, m.dense_inter, DTYPE_BYTES[m.gemm_dtype])
        if m.gemm_dtype == "fp8":  # gate_up's and down's inputs
            dq = quant(rows, m.hidden) + quant(rows, m.dense_inter)
            ops["mlp.quant"] = mk("mlp.quant", dq)
        ops["mlp"] = mk("mlp", dense, dtype=m.gemm_dtype, op_class="gemm")
        ops["mlp.act"] = mk("mlp.act", K.silu_and_mul(rows, m.dense_inter))
        ops["comm_postprocess_layer"] = mk("comm_postprocess_layer", _postprocess(w, rows))
    lead = mk.key("")
    out = []
    for name, op in ops.items():
        kw = {f: getattr(op, f) for f in _OP_FIELDS}
        c = op.coll
        out.append((name, kw, None if c is None else (c.key[len(lead) :], c.role, c.flows)))
    return tuple(out)


def head_ops(w: Workload, gpu: GPU, mb: MicroBatch, step: int | None = None) -> dict[str, Op]:
    """embed (before layer 0), final_norm (the model's last RMSNorm, ``DeepseekV2Model.norm``,
    over every token of the micro-batch), logits (the lm_head GEMM, bf16 in every preset),
    sample and d2h (the non-blocking copy of the sampled int32 ids to the host, over PCIe, no
    SMs). Prefill computes logits only for the last token of each sequence ending in the
    micro-batch (SGLang's LogitsProcessor prunes to them after the norm); decode for every token
    (MTP / verify needs them all). Whether a schedule runs the head once per step or once per
    micro-batch is the schedule's (docs/schedules.md)."""
    _check_mb(w, mb)
    m, mk = w.model, _Maker(None, mb, step)
    if w.batch.mode == "prefill":
        rows = attn_work(w.batch, mb.tok_lo, mb.tok_hi).seq_ends
    else:
        rows = mb.padded_tokens
    embed = Work(0.0, 2 * mb.padded_tokens * m.hidden * ACT)  # gather rows, write them
    logits = gemm(rows, m.hidden, m.vocab, ACT, out_bytes=4)
    sample = Work(5.0 * rows * m.vocab, rows * m.vocab * 4 + rows * 8)
    return {
        "embed": mk("embed", embed),
        "final_norm": mk("final_norm", rmsnorm(mb.padded_tokens, m.hidden)),
        "logits": mk("logits", logits, op_class="gemm"),
        "sample": mk("sample", sample, op_class="sampling"),
        "d2h": mk("d2h", Work(0.0, rows * 4), kind="copy", op_class="copy", sms=0),
    }
