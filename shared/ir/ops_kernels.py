"""The small kernels a deployment runs around a layer's GEMMs and attention, each the work of one
upstream kernel (or of one fixed pair of launches, said where so), so that it costs what its own
kind of kernel costs (memory rate, latency) rather than riding inside a GEMM at GEMM rate.

``shared.ir.ops`` makes them ops (``PARTS`` places each beside the key a schedule names). The
upstream code that launches each (SGLang ``python/sglang/srt/...``, DeepEP ``csrc/kernels/
legacy/...``) is named in its docstring; docs/schedules.md ("The kernels a deployment runs")
lists them with their op class and grid.

Balanced routing throughout (the symmetric program): a rank receives as many token copies as it
sends, ``rows * top_k``; ``shared.ir.ranks`` rescales the MoE passes to each rank's own copies.
"""

from __future__ import annotations

import math

from overlap_lab.shared.inputs.workload import DTYPE_BYTES, Workload
from overlap_lab.shared.ir.work import ACT, Work, elementwise, fp8_row_bytes, rmsnorm

__all__ = [
    "DISPATCH_LAYOUT_EXPERTS_PER_CTA",
    "DISPATCH_LAYOUT_RANKS_PER_CTA",
    "attn_norms",
    "cached_notify_ctas",
    "copies_received",
    "dispatch_layout",
    "dispatch_layout_ctas",
    "ep_gather",
    "ep_scatter",
    "kv_write",
    "notify_dispatch_ctas",
    "notify_payload",
    "rope",
    "silu_and_mul",
    "silu_and_mul_quant",
    "tokens_received",
    "topk_ids_int64",
]

# ----------------------------------------------------------------------------------------------
# Attention's elementwise kernels (SGLang DeepseekV2AttentionMLA / Qwen3MoeAttention)
# ----------------------------------------------------------------------------------------------


def attn_norms(w: Workload, rows: int) -> Work:
    """MLA: ``q_a_layernorm`` (with q_lora) and ``kv_a_layernorm`` after the fused q_a/kv_a
    projection, two RMSNorm launches (one op); Qwen3: the per-head q/k RMSNorm (``qk_norm``).
    None for a GQA model without q/k norm."""
    m = w.model
    if m.attention == "mla":
        q = rmsnorm(rows, m.q_lora_rank) if m.q_lora_rank else Work()
        return q + rmsnorm(rows, m.kv_lora_rank)
    if m.qk_norm:
        return rmsnorm(rows, (w.heads_per_rank + w.kv_heads_per_rank) * m.head_dim)
    return Work()


def rope(w: Workload, rows: int) -> Work:
    """``rotary_emb(positions, q_pe, k_pe)``: the rope part of every q head and of the one MLA
    key (every q and kv head under GQA), read and written in place; ~6 FLOPs a value."""
    m = w.model
    if m.attention == "mla":
        width = (w.heads_per_rank + 1) * m.qk_rope_dim
    else:
        width = (w.heads_per_rank + w.kv_heads_per_rank) * m.head_dim
    return elementwise(rows, width, reads=1, writes=1, flops_per=6.0)


def kv_write(w: Workload, rows: int) -> Work:
    """The KV-cache store of the new tokens (``token_to_kv_pool.set_mla_kv_buffer`` /
    ``set_kv_buffer`` in the attention backend, before the attention kernel): the latent (MLA) or
    the K and V heads (GQA) read in bf16, written in the cache's dtype."""
    m = w.model
    kvb = DTYPE_BYTES[m.attn_dtype]
    if m.attention == "mla":
        width = m.kv_lora_rank + m.qk_rope_dim
    else:
        width = 2 * w.kv_heads_per_rank * m.head_dim
    return Work(0.0, rows * width * (ACT + kvb))


def silu_and_mul(rows: float, inter: int) -> Work:
    """SwiGLU's activation as its own pass (sgl-kernel ``silu_and_mul``): reads gate and up
    (2 x inter bf16), writes inter bf16; ~4 FLOPs a value."""
    if rows <= 0 or inter <= 0:
        return Work()
    return elementwise(rows, inter, reads=2, writes=1, flops_per=4.0)


def silu_and_mul_quant(rows: float, inter: int) -> Work:
    """SGLang's ``silu_and_mul_masked_post_quant_fwd`` (Triton; LightLLM runs the same fusion):
    the activation and the FP8 quantisation of the down GEMM's input in one pass, reading
    2 x inter bf16 and writing inter fp8 plus its scales."""
    if rows <= 0 or inter <= 0:
        return Work()
    return Work(8.0 * rows * inter, rows * (2 * inter * ACT + fp8_row_bytes(inter)))


# ----------------------------------------------------------------------------------------------
# The MoE routing chain and DeepEP's normal-mode kernels
# ----------------------------------------------------------------------------------------------


def topk_ids_int64(rows: float, top_k: int) -> Work:
    """``topk_ids.to(torch.int64)`` in SGLang's ``_DeepEPDispatcherImpl*.dispatch_a``
    (``layers/moe/token_dispatcher/deepep.py``; DeepEP takes int64 ids): int32 in, int64 out."""
    return Work(0.0, rows * top_k * (4 + 8))


#: DeepEP ``get_dispatch_layout`` (``csrc/kernels/legacy/layout.cu``): ``kNumExpertsPerSM = 4``,
#: ``kNumRanksPerSM = 8``, 256 threads a CTA.
DISPATCH_LAYOUT_EXPERTS_PER_CTA, DISPATCH_LAYOUT_RANKS_PER_CTA = 4, 8


def dispatch_layout_ctas(num_experts: int, ep: int) -> int:
    """The grid of ``get_dispatch_layout``: one CTA per 4 experts and one per 8 ranks."""
    e, r = DISPATCH_LAYOUT_EXPERTS_PER_CTA, DISPATCH_LAYOUT_RANKS_PER_CTA
    return math.ceil(num_experts / e) + math.ceil(ep / r)


def dispatch_layout(w: Workload, rows: int) -> Work:
    """``get_dispatch_layout``: every CTA walks the whole ``topk_idx`` (int64) to count the
    tokens of its 4 experts or 8 ranks, so the kernel streams the ids once per CTA; it writes
    ``is_token_in_rank`` (a bool per token and rank) and the per-rank, per-node and per-expert
    counts. A count per id and CTA is its arithmetic."""
    m, ep = w.model, w.parallel.ep
    ctas = dispatch_layout_ctas(m.num_experts, ep)
    ids = rows * m.top_k
    nodes = math.ceil(ep / min(ep, w.parallel.gpus_per_node))
    out = rows * ep + 4 * (ep + nodes + m.num_experts)
    return Work(2.0 * ctas * ids, ctas * ids * 8 + out)


def notify_dispatch_ctas(ep: int, gpus_per_node: int) -> int:
    """``notify_dispatch``'s grid: ``1 + num_ranks`` CTAs inside one node
    (``intranode.cu``), ``1 + num_rdma_ranks`` (one per node) across nodes (``internode.cu``)."""
    g = min(ep, gpus_per_node)
    return 1 + (ep if ep <= g else math.ceil(ep / g))


def cached_notify_ctas(ep: int, gpus_per_node: int, num_sms: int) -> int:
    """The grid of combine's notify kernel: ``cached_notify_combine`` inside one node runs
    ``1 + num_channels`` CTAs (``intranode.cu``), ``cached_notify`` across nodes
    ``num_channels * 2`` (``internode.cu``); a channel is two of the Buffer's SMs."""
    channels = max(1, num_sms // 2)
    return 1 + channels if ep <= gpus_per_node else 2 * channels


def notify_payload(w: Workload, link: str, what: str) -> float:
    """Bytes one notify kernel sends a peer over ``link``. ``notify_dispatch`` exchanges the
    counts the receivers size their buffers by: per NVLink peer its token count and its
    experts' counts (int32), per RDMA peer (the same-rail GPU of another node) those of the
    whole node. ``cached_notify`` only barriers with its peers: one flag each. Small either way:
    the kernels take their time from the link latency and from waiting for every peer."""
    if what != "dispatch":
        return 4.0
    g = min(w.parallel.ep, w.parallel.gpus_per_node)
    per_rank = 1 + w.local_experts
    return 4.0 * (per_rank if link == "nvlink" else g * per_rank + 1)


# ----------------------------------------------------------------------------------------------
# The MoE passes around the grouped GEMMs (SGLang DeepEPMoE, layers/moe/ep_moe/layer.py)
# ----------------------------------------------------------------------------------------------


def copies_received(w: Workload, rows: int) -> float:
    """Token copies (token, local expert) this rank's experts receive: ``rows * top_k``."""
    return rows * w.model.top_k


def tokens_received(w: Workload, rows: int) -> float:
    """Tokens DeepEP's normal dispatch delivers to this rank, one per (token, destination rank):
    each of the ``ep`` ranks sends its ``rows`` tokens here with the chance that one of their
    ``top_k`` experts lives here."""
    ep, k = w.parallel.ep, w.model.top_k
    return rows * ep * (1.0 - (1.0 - 1.0 / ep) ** k)


def ep_scatter(w: Workload, rows: int) -> Work:
    """``ep_scatter`` (two Triton kernels, one op: the per-expert start offsets, then the copy):
    each received FP8 token (with its scales) is written once per local expert it goes to,
    into expert-contiguous rows for DeepGEMM's contiguous grouped GEMM, with its ``m_indices``
    (int32 per row) and ``output_index`` (int32 per token and top-k)."""
    m = w.model
    recv, copies = tokens_received(w, rows), copies_received(w, rows)
    row = fp8_row_bytes(m.hidden)
    return Work(0.0, recv * (row + m.top_k * (8 + 4)) + copies * (row + 4))


def ep_gather(w: Workload, rows: int) -> Work:
    """``ep_gather`` (Triton): the weighted reduce of each received token's expert outputs back
    into token order, before DeepEP's combine sends it (reads every copy's bf16 row, the top-k
    weights and indices; writes one bf16 row per received token)."""
    m = w.model
    recv, copies = tokens_received(w, rows), copies_received(w, rows)
    return Work(
        2.0 * copies * m.hidden,
        copies * m.hidden * ACT + recv * (m.top_k * 8 + m.hidden * ACT),
    )
