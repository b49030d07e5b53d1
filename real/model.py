"""A real DeepSeek-style MoE decoder in torch: MLA (or GQA) attention over a KV cache, a router
with top-k and DeepSeek-V3's group-limited routing, routed experts as grouped GEMMs, a shared
expert, RMSNorm and residuals; dense MLP layers for the first ``first_k_dense`` layers.

The model is a bag of seeded weights plus pure functions on tensors, so that the kernels bound to
op names (real/kernels/) can run any slice of a layer on any micro-batch. Weights are generated
per tensor (and per expert) from the seed and the tensor's name, so an EP rank holding experts
[r*E/R, (r+1)*E/R) holds exactly the slices a one-process model holds: that is what makes the
gloo EP test comparable with one process.

torch is imported when this module is imported; ``real`` itself imports it lazily.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from overlap_lab.real.norm import rms_norm
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.workload import with_layers


@dataclass(frozen=True)
class RealModelConfig:
    """The shapes the executor needs; built from a shared.inputs.workload ModelConfig or a tiny preset."""

    name: str
    num_layers: int
    first_k_dense: int
    hidden: int
    vocab: int
    attention: str = "mla"  # "mla" | "gqa"
    num_heads: int = 4
    # MLA
    q_lora_rank: int = 0  # 0: q projected directly from the hidden state (DeepSeek-V2-Lite)
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    # GQA
    num_kv_heads: int = 2
    head_dim: int = 16
    # MoE
    num_experts: int = 8
    top_k: int = 2
    expert_inter: int = 32
    num_shared_experts: int = 1
    dense_inter: int = 128
    n_group: int = 1
    topk_group: int = 1
    scoring: str = "softmax"  # "sigmoid" (DeepSeek-V3) | "softmax"
    norm_topk: bool = True
    routed_scaling: float = 1.0
    qk_norm: bool = False
    rope_theta: float = 10000.0
    eps: float = 1e-6

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense and self.num_experts > 0


def tiny_models() -> dict:
    """Scaled-down shared.inputs.workload ModelConfigs for CPU tests (schedules need a ModelConfig).

    ``tiny-mla`` is DeepSeek-V3 in miniature (MLA with q LoRA, sigmoid group-limited routing,
    a shared expert, one dense layer); ``tiny-gqa`` is Qwen3-MoE in miniature.
    """
    from overlap_lab.shared.inputs.workload import ModelConfig

    return {
        "tiny-mla": ModelConfig(
            name="tiny-mla",
            num_layers=3,
            first_k_dense=1,
            hidden=64,
            vocab=128,
            attention="mla",
            num_heads=4,
            num_kv_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_dim=16,
            qk_rope_dim=8,
            v_head_dim=16,
            num_experts=8,
            top_k=2,
            expert_inter=32,
            num_shared_experts=1,
            dense_inter=128,
            n_group=4,
            topk_group=2,
            gemm_dtype="bf16",
        ),
        "tiny-gqa": ModelConfig(
            name="tiny-gqa",
            num_layers=2,
            first_k_dense=0,
            hidden=64,
            vocab=128,
            attention="gqa",
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            num_experts=8,
            top_k=2,
            expert_inter=32,
            dense_inter=128,
            qk_norm=True,
        ),
    }


TINY_NAMES = ("tiny-mla", "tiny-gqa")


def from_model_config(mc, num_layers: int | None = None) -> RealModelConfig:
    """The torch model's configuration for a shared.inputs.workload ModelConfig.

    Router scoring is not a ModelConfig field: DeepSeek-V3 (group-limited, n_group > 1) scores
    with sigmoid plus a correction bias and scales routed outputs by 2.5; DeepSeek-V2-Lite and
    Qwen3 score with softmax (HF configs: scoring_func, routed_scaling_factor).
    """
    grouped = mc.n_group > 1
    cfg = RealModelConfig(
        name=mc.name,
        num_layers=mc.num_layers,
        first_k_dense=mc.first_k_dense,
        hidden=mc.hidden,
        vocab=mc.vocab,
        attention=mc.attention,
        num_heads=mc.num_heads,
        q_lora_rank=mc.q_lora_rank,
        kv_lora_rank=mc.kv_lora_rank,
        qk_nope_head_dim=mc.qk_nope_dim,
        qk_rope_head_dim=mc.qk_rope_dim,
        v_head_dim=mc.v_head_dim,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        num_experts=mc.num_experts,
        top_k=mc.top_k,
        expert_inter=mc.expert_inter,
        num_shared_experts=mc.num_shared_experts,
        dense_inter=mc.dense_inter,
        n_group=mc.n_group,
        topk_group=mc.topk_group,
        scoring="sigmoid" if grouped else "softmax",
        routed_scaling=2.5 if grouped else 1.0,
        qk_norm=mc.qk_norm,
    )
    return with_layers(cfg, num_layers)


def get_config(name: str, num_layers: int | None = None) -> RealModelConfig:
    """A tiny preset of this module, or a shared.inputs.workload preset adapted."""
    return from_model_config(get_model_config(name), num_layers)


def get_model_config(name: str):
    """The shared.inputs.workload ModelConfig of a tiny preset or a shared preset."""
    tiny = tiny_models()
    if name in tiny:
        return tiny[name]
    from overlap_lab.shared.inputs.workload import get_model

    return get_model(name)


def get_model_config_layers(name: str, num_layers: int | None = None):
    return with_layers(get_model_config(name), num_layers)


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------


def _gen(seed: int, key: str, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63 - 1))
    return g


def _randn(shape, key: str, *, seed: int, dtype, device, std: float = 1.0) -> torch.Tensor:
    g = _gen(seed, key, device)
    t = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
    return (t * std).to(dtype)


@dataclass
class ModelWeights:
    """Seeded weights of the layers this rank runs; experts only for ``ep_rank``'s slice."""

    cfg: RealModelConfig
    layers: dict[int, dict[str, torch.Tensor]]
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    ep_rank: int
    ep_size: int
    dtype: torch.dtype
    device: torch.device

    @property
    def experts_per_rank(self) -> int:
        return self.cfg.num_experts // self.ep_size


def init_weights(
    cfg: RealModelConfig,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    ep_rank: int = 0,
    ep_size: int = 1,
    layers: list[int] | None = None,
) -> ModelWeights:
    """Random weights, std 1/sqrt(fan_in) so activations keep their scale through the layers."""
    device = torch.device(device)
    if cfg.num_experts and cfg.num_experts % ep_size:
        raise ConfigError(f"EP size {ep_size} does not divide {cfg.num_experts} experts")

    def w(shape, key, fan_in=None, std=None):
        s = std if std is not None else 1.0 / math.sqrt(fan_in or shape[-1])
        return _randn(shape, key, seed=seed, dtype=dtype, device=device, std=s)

    def norm(n, key):
        return (1.0 + w((n,), key, std=0.1)).to(dtype)

    H = cfg.hidden
    out: dict[int, dict[str, torch.Tensor]] = {}
    for li in layers if layers is not None else range(cfg.num_layers):
        p = f"L{li}."
        lw: dict[str, torch.Tensor] = {
            "input_norm": norm(H, p + "input_norm"),
            "post_attn_norm": norm(H, p + "post_attn_norm"),
        }
        if cfg.attention == "mla":
            qd = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            if cfg.q_lora_rank:
                lw["q_a"] = w((cfg.q_lora_rank, H), p + "q_a")
                lw["q_a_norm"] = norm(cfg.q_lora_rank, p + "q_a_norm")
                lw["q_b"] = w((cfg.num_heads * qd, cfg.q_lora_rank), p + "q_b")
            else:
                lw["q_proj"] = w((cfg.num_heads * qd, H), p + "q_proj")
            lw["kv_a"] = w((cfg.kv_lora_rank + cfg.qk_rope_head_dim, H), p + "kv_a")
            lw["kv_a_norm"] = norm(cfg.kv_lora_rank, p + "kv_a_norm")
            lw["kv_b"] = w(
                (cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                p + "kv_b",
            )
            lw["o_proj"] = w((H, cfg.num_heads * cfg.v_head_dim), p + "o_proj")
        elif cfg.attention == "gqa":
            hd = cfg.head_dim
            lw["q_proj"] = w((cfg.num_heads * hd, H), p + "q_proj")
            lw["k_proj"] = w((cfg.num_kv_heads * hd, H), p + "k_proj")
            lw["v_proj"] = w((cfg.num_kv_heads * hd, H), p + "v_proj")
            lw["q_norm"] = norm(hd, p + "q_norm")
            lw["k_norm"] = norm(hd, p + "k_norm")
            lw["o_proj"] = w((H, cfg.num_heads * hd), p + "o_proj")
        else:
            raise ConfigError(f"unknown attention kind {cfg.attention!r}")
        if cfg.is_moe_layer(li):
            E, inter = cfg.num_experts, cfg.expert_inter
            lw["gate"] = w((E, H), p + "gate")
            if cfg.scoring == "sigmoid":
                lw["gate_bias"] = w((E,), p + "gate_bias", std=0.05)
            e_lo = ep_rank * (E // ep_size)
            idx = range(e_lo, e_lo + E // ep_size)
            lw["w13"] = torch.stack([w((2 * inter, H), f"{p}e{e}.w13") for e in idx])
            lw["w2"] = torch.stack([w((H, inter), f"{p}e{e}.w2") for e in idx])
            if cfg.num_shared_experts:
                si = inter * cfg.num_shared_experts
                lw["shared_w13"] = w((2 * si, H), p + "shared.w13")
                lw["shared_w2"] = w((H, si), p + "shared.w2")
        else:
            lw["mlp_w13"] = w((2 * cfg.dense_inter, H), p + "mlp.w13")
            lw["mlp_w2"] = w((H, cfg.dense_inter), p + "mlp.w2")
        out[li] = lw
    return ModelWeights(
        cfg=cfg,
        layers=out,
        embed=w((cfg.vocab, H), "embed", std=1.0),
        final_norm=norm(H, "final_norm"),
        lm_head=w((cfg.vocab, H), "lm_head"),
        ep_rank=ep_rank,
        ep_size=ep_size,
        dtype=dtype,
        device=device,
    )


# ----------------------------------------------------------------------------------------------
# Building blocks (pure functions)
# ----------------------------------------------------------------------------------------------


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE on the last dim of x [T, ..., d] at integer positions [T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.to(torch.float32)[:, None] * inv[None, :]  # [T, d/2]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    cos, sin = ang.cos().view(shape), ang.sin().view(shape)
    x1, x2 = x.float()[..., : d // 2], x.float()[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


def swiglu_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, mm=None) -> torch.Tensor:
    """``mm(a, w) = a @ w.T``: torch by default, or an SM-limited GEMM (real.gemm)."""
    if mm is None:
        g, u = (x @ w13.t()).chunk(2, dim=-1)
        return (F.silu(g) * u) @ w2.t()
    g, u = mm(x, w13).chunk(2, dim=-1)
    return mm((F.silu(g) * u).contiguous(), w2)


# -- MLA ---------------------------------------------------------------------------------------


def mla_prepare(cfg: RealModelConfig, lw, h: torch.Tensor, positions: torch.Tensor):
    """Project to q (nope, rope parts) and the compressed KV (normed latent, roped k_pe)."""
    T = h.shape[0]
    qd = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.q_lora_rank:
        q = rms_norm(h @ lw["q_a"].t(), lw["q_a_norm"], cfg.eps) @ lw["q_b"].t()
    else:
        q = h @ lw["q_proj"].t()
    q = q.view(T, cfg.num_heads, qd)
    q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
    kv = h @ lw["kv_a"].t()
    c_kv = rms_norm(kv[:, : cfg.kv_lora_rank], lw["kv_a_norm"], cfg.eps)
    k_pe = rope(kv[:, cfg.kv_lora_rank :], positions, cfg.rope_theta)
    q_pe = rope(q_pe, positions, cfg.rope_theta)
    return q_nope, q_pe, torch.cat([c_kv, k_pe], dim=-1)


def _kv_b_split(cfg: RealModelConfig, lw):
    w = lw["kv_b"].view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]  # W_UK [h,n,c], W_UV [h,v,c]


def causal_variant(num_queries: int, num_keys: int) -> str:
    """The attention-kernel label of :func:`prefill_attention` (trace meta ``attention_kernels``)."""
    if num_queries == num_keys:
        return "sdpa causal"
    return "sdpa causal lower-right (cached prefix)"


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None
) -> torch.Tensor:
    """Causal attention where the T queries q [..., T, d] are the last T positions of the L keys
    k [..., L, d] (values v [..., L, dv]): query i sees keys 0..L-T+i (bottom-right alignment,
    a cached prefix before the new tokens). Without a cached prefix, SDPA's ``is_causal``; with
    one, torch's lower-right ``CausalBias``, which SDPA's fused kernels (flash,
    memory-efficient) take as their own causal alignment: neither builds a dense [T, L] mask,
    which would rule out the flash kernel. On CUDA a narrower V (MLA: 128 against q/k 192) is
    zero-padded to q's head size so the flash kernel, which takes one head size, stays
    eligible; the padding's output columns are dropped. The fused kernels take 4-D [batch,
    heads, T, d] inputs only (a 3-D call runs the math kernel), so a 3-D [heads, T, d] call gets
    a batch of one. The math kernel (the CPU) builds the mask itself."""
    from torch.nn.attention.bias import causal_lower_right

    if q.dim() == 3:
        return prefill_attention(q[None], k[None], v[None], scale=scale)[0]
    T, L, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    if T > L:
        raise ValueError(f"{T} queries over {L} keys: the queries are the last keys' positions")
    if q.is_cuda and dv < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - dv))
    if T == L:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, L), scale=scale)
    return o[..., :dv]


def mla_attend_expanded(cfg, lw, q_nope, q_pe, kv: torch.Tensor):
    """Prefill form for one sequence: expand the latent to per-head K and V, causal attention.

    q_*: [T, h, *], the last T positions of kv: [L, c + r] cache rows for positions 0..L-1.
    """
    w_uk, w_uv = _kv_b_split(cfg, lw)
    c, k_pe = kv[:, : cfg.kv_lora_rank], kv[:, cfg.kv_lora_rank :]
    k_nope = torch.einsum("lc,hnc->hln", c, w_uk)
    v = torch.einsum("lc,hvc->hlv", c, w_uv)
    k = torch.cat([k_nope, k_pe[None].expand(cfg.num_heads, -1, -1)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [h, T, d]
    scale = 1.0 / math.sqrt(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    o = prefill_attention(q, k, v, scale=scale)  # [h, T, v]
    return o.transpose(0, 1).reshape(q_nope.shape[0], -1)


def mla_attend_absorbed(cfg, lw, q_nope, q_pe, kv_pad, q_seq, q_pos):
    """Decode form (weight absorption): attention in the latent space over padded caches.

    q_*: [T, h, *]; kv_pad: [S, Lmax, c + r]; q_seq [T] index into S; q_pos [T] positions.
    """
    w_uk, w_uv = _kv_b_split(cfg, lw)
    q_lat = torch.einsum("thn,hnc->thc", q_nope, w_uk)
    kvt = kv_pad[q_seq]  # [T, L, c + r]
    c, k_pe = kvt[..., : cfg.kv_lora_rank], kvt[..., cfg.kv_lora_rank :]
    scores = torch.einsum("thc,tlc->thl", q_lat.float(), c.float())
    scores = scores + torch.einsum("thr,tlr->thl", q_pe.float(), k_pe.float())
    scores = scores / math.sqrt(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    valid = torch.arange(kv_pad.shape[1], device=kv_pad.device)[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    p = scores.softmax(-1)
    o_lat = torch.einsum("thl,tlc->thc", p, c.float()).to(q_nope.dtype)
    return torch.einsum("thc,hvc->thv", o_lat, w_uv).reshape(q_nope.shape[0], -1)


def mla_attend_absorbed_batched(cfg, lw, q_nope, q_pe, kv_pad, q_pos):
    """:func:`mla_attend_absorbed` for S sequences of r query tokens each (q_*: [S*r, h, *],
    q_pos [S, r]), as one batched scaled_dot_product_attention in the latent space (MQA: one
    KV head of c + r dims, values the first c): no per-token gather or fp32 copy of the cache;
    the backend (FlashAttention-class where the head size allows, else torch's math kernel)
    is torch's choice."""
    w_uk, w_uv = _kv_b_split(cfg, lw)
    S, r = q_pos.shape
    h = q_nope.shape[1]
    q_lat = torch.einsum("thn,hnc->thc", q_nope, w_uk)
    q = torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1).view(S, r, h, -1).transpose(1, 2)
    k = kv_pad[:, None].to(q.dtype)  # [S, 1, L, c + r]
    v = kv_pad[:, None, :, : cfg.kv_lora_rank].to(q.dtype)
    valid = torch.arange(kv_pad.shape[1], device=kv_pad.device)[None, None, :] <= q_pos[..., None]
    o = F.scaled_dot_product_attention(
        q,
        k.expand(S, h, *k.shape[2:]),
        v.expand(S, h, *v.shape[2:]),
        attn_mask=valid[:, None],
        scale=1.0 / math.sqrt(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim),
    )  # [S, h, r, c]
    o_lat = o.transpose(1, 2).reshape(S * r, h, -1).to(q_nope.dtype)
    return torch.einsum("thc,hvc->thv", o_lat, w_uv).reshape(S * r, -1)


FLASH_MLA_PAGE = 64  # FlashMLA's paged KV cache: tokens per block
FLASH_MLA_DIMS = (512, 64)  # kv_lora_rank, qk_rope_head_dim: the head sizes its kernels take


@dataclass(frozen=True)
class FlashMLAApi:
    """Which of FlashMLA's two Python interfaces a ``flash_mla`` module has, read from its
    signatures (never by calling and catching): ``sched_meta`` (FlashMLA 1.0 and sgl-flash-mla
    1.0: ``get_mla_metadata()`` takes no argument and returns an empty scheduler record,
    ``num_splits`` must be None, the record fills on the first call; ``use_legacy``, where the
    kernel call has it, selects the dense decode kernel) or ``legacy`` (``get_mla_metadata(
    cache_seqlens, q heads per KV head, KV heads)`` -> (tile metadata, num_splits))."""

    name: str
    use_legacy: bool = False

    @property
    def label(self) -> str:
        return f"flash_mla ({self.name} API)"


def _required_params(fn) -> list[str] | None:
    """Names of ``fn``'s parameters without defaults, or None when its signature is unreadable."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a C function without a text signature
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [n for n, p in sig.parameters.items() if p.kind in kinds and p.default is p.empty]


def _takes(fn, name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def flash_mla_api(module) -> FlashMLAApi | str:
    """``module``'s interface (:class:`FlashMLAApi`), or why it is none this executor knows."""
    meta_fn = getattr(module, "get_mla_metadata", None)
    call = getattr(module, "flash_mla_with_kvcache", None)
    if not callable(meta_fn) or not callable(call):
        return "flash_mla lacks get_mla_metadata or flash_mla_with_kvcache"
    required = _required_params(meta_fn)
    if required is None:
        return "flash_mla's get_mla_metadata has no readable signature"
    if not required:
        return FlashMLAApi("sched_meta", use_legacy=_takes(call, "use_legacy"))
    if len(required) == 3:
        return FlashMLAApi("legacy")
    return f"flash_mla's get_mla_metadata{tuple(required)} is neither known interface"


def flash_mla_unusable(cfg: RealModelConfig, cache: torch.Tensor, module) -> str | None:
    """Why FlashMLA's decode kernel cannot run on ``cache`` [S, L, c + r] here (None: it can):
    what the executor reports when it runs SDPA instead."""
    if module is None:
        return "flash_mla is not installed"
    api = flash_mla_api(module)
    if isinstance(api, str):
        return api
    if not cache.is_cuda:
        return "the CPU (FlashMLA is a CUDA kernel)"
    if cache.dtype not in (torch.bfloat16, torch.float16):
        return f"a {cache.dtype} cache (FlashMLA takes bf16/fp16)"
    if (cfg.kv_lora_rank, cfg.qk_rope_head_dim) != FLASH_MLA_DIMS:
        return f"latent {cfg.kv_lora_rank} + rope {cfg.qk_rope_head_dim} (FlashMLA: 512 + 64)"
    if cache.shape[1] % FLASH_MLA_PAGE:
        return f"a cache of {cache.shape[1]} rows per sequence (pages of {FLASH_MLA_PAGE})"
    return None


def mla_attend_flash(cfg, lw, q_nope, q_pe, cache, q_pos, fm, block_table):
    """:func:`mla_attend_absorbed_batched` by FlashMLA's decode kernel: the sequences' caches
    ``cache`` [S, L, c + r] (L a multiple of 64) as pages of 64 rows (``block_table`` [S, L/64]
    int32, page i of sequence s at s*L/64 + i), ``q_pos`` [S, r] the queries' positions (the
    last one + 1 is the sequence's cache length; r > 1 is causal, as MTP's drafts)."""
    w_uk, w_uv = _kv_b_split(cfg, lw)
    S, r = q_pos.shape
    h = q_nope.shape[1]
    q_lat = torch.einsum("thn,hnc->thc", q_nope, w_uk)
    q = torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1).view(S, r, h, -1).contiguous()
    o = flash_mla_latent(cfg, q.to(cache.dtype), cache, q_pos, fm, block_table)
    o_lat = o.reshape(S * r, h, -1).to(q_nope.dtype)
    return torch.einsum("thc,hvc->thv", o_lat, w_uv).reshape(S * r, -1)


def flash_mla_latent(cfg, q, cache, q_pos, fm, block_table) -> torch.Tensor:
    """FlashMLA's decode kernel alone: latent queries ``q`` [S, r, h, c + r_pe] (contiguous,
    the cache's dtype) over the paged ``cache`` -> the latent outputs [S, r, h, c] (the
    arguments of :func:`mla_attend_flash`)."""
    S, r = q_pos.shape
    h = q.shape[2]
    pages = cache.reshape(-1, FLASH_MLA_PAGE, 1, cache.shape[-1])
    seqlens = (q_pos[:, -1] + 1).to(torch.int32)
    api = flash_mla_api(fm)
    extra = {}
    if api.name == "legacy":
        meta, splits = fm.get_mla_metadata(seqlens, r * h, 1)
    else:  # an empty scheduler record, filled by the call; num_splits must be None
        meta, splits = fm.get_mla_metadata()[0], None
        if api.use_legacy:
            extra["use_legacy"] = True
    o, _lse = fm.flash_mla_with_kvcache(
        q, pages, block_table, seqlens, cfg.kv_lora_rank, meta, splits,
        softmax_scale=1.0 / math.sqrt(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim),
        causal=r > 1, **extra,
    )  # fmt: skip
    return o


# -- GQA ---------------------------------------------------------------------------------------


def gqa_prepare(cfg: RealModelConfig, lw, h, positions):
    T, hd = h.shape[0], cfg.head_dim
    q = (h @ lw["q_proj"].t()).view(T, cfg.num_heads, hd)
    k = (h @ lw["k_proj"].t()).view(T, cfg.num_kv_heads, hd)
    if cfg.qk_norm:
        q, k = rms_norm(q, lw["q_norm"], cfg.eps), rms_norm(k, lw["k_norm"], cfg.eps)
    v = (h @ lw["v_proj"].t()).view(T, cfg.num_kv_heads, hd)
    q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
    return q, torch.stack([k, v], dim=1)  # cache rows [T, 2, kvh, hd]


def gqa_attend(cfg, q, kv):
    """One sequence: q [T, h, d], the last T positions of kv [L, 2, kvh, d]; causal."""
    rep = cfg.num_heads // cfg.num_kv_heads
    k = kv[:, 0].transpose(0, 1).repeat_interleave(rep, 0)
    v = kv[:, 1].transpose(0, 1).repeat_interleave(rep, 0)
    o = prefill_attention(q.transpose(0, 1), k, v)
    return o.transpose(0, 1).reshape(q.shape[0], -1)


def kv_row_shape(cfg: RealModelConfig) -> tuple[int, ...]:
    if cfg.attention == "mla":
        return (cfg.kv_lora_rank + cfg.qk_rope_head_dim,)
    return (2, cfg.num_kv_heads, cfg.head_dim)


# -- Router ------------------------------------------------------------------------------------


def select_experts(cfg: RealModelConfig, logits: torch.Tensor, bias: torch.Tensor | None):
    """Top-k with DeepSeek-V3's group-limited routing (sigmoid scores, correction bias used only
    for the choice, top-2 sum per group, ``topk_group`` groups kept), or softmax top-k.

    Returns (topk_idx int64 [T, k], topk_weights float32 [T, k]); the routed scaling factor is
    folded into the weights.
    """
    lf = logits.float()
    scores = lf.sigmoid() if cfg.scoring == "sigmoid" else lf.softmax(-1)
    choice = scores + bias.float() if bias is not None else scores
    if cfg.n_group > 1:
        T = choice.shape[0]
        grouped = choice.view(T, cfg.n_group, -1)
        gscore = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        gidx = gscore.topk(cfg.topk_group, dim=-1).indices
        gmask = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, gidx, True)
        choice = choice.masked_fill(~gmask[:, :, None].expand_as(grouped).reshape(T, -1), -1e30)
    idx = choice.topk(cfg.top_k, dim=-1).indices
    w = scores.gather(1, idx)
    if cfg.norm_topk:
        w = w / w.sum(-1, keepdim=True).clamp_min(1e-20)
    return idx, w * cfg.routed_scaling


# -- Experts -----------------------------------------------------------------------------------


def grouped_gemm_contiguous(x: torch.Tensor, w: torch.Tensor, counts: list[int], gemm=None):
    """One grouped GEMM over rows sorted by local expert (``counts[e]`` rows each): row block of
    expert e times ``w[e].T``. With an SM-limited ``gemm`` (real.gemm.ComputeBudget): its
    contiguous grouped GEMM. Else torch._grouped_mm on CUDA BF16 when present, a loop of GEMMs
    per expert otherwise."""
    if gemm is not None and gemm.limited:
        return gemm.grouped_contiguous(x.contiguous(), w, counts)
    if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        try:
            offs = torch.tensor(counts, device=x.device, dtype=torch.int32).cumsum(0).int()
            return torch._grouped_mm(x.contiguous(), w.transpose(1, 2), offs=offs)
        except (RuntimeError, TypeError):  # unsupported arch/layout: fall back to the loop
            pass
    out = x.new_empty(x.shape[0], w.shape[1])
    lo = 0
    for e, n in enumerate(counts):
        if n:
            out[lo : lo + n] = x[lo : lo + n] @ w[e].t()
        lo += n
    return out


def grouped_experts_contiguous(
    x: torch.Tensor, counts: list[int], w13, w2, gemm=None
) -> torch.Tensor:
    """Rows of x sorted by local expert (``counts[e]`` rows each) through their experts: the
    gate-up GEMM, SwiGLU, the down GEMM (:func:`grouped_gemm_contiguous` each)."""
    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    g, u = grouped_gemm_contiguous(x, w13, counts, gemm).chunk(2, dim=-1)
    return grouped_gemm_contiguous((F.silu(g) * u).contiguous(), w2, counts, gemm)


def grouped_gemm_masked(
    x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, gemm=None, expected_m=None
):
    """One masked grouped GEMM in DeepEP's low-latency layout: ``x[e, :counts[e]] @ w[e].T``
    (``counts`` on the device: no host read). With an SM-limited ``gemm``: its masked kernel
    (rows past the count left unwritten); else a batched GEMM over the padded rows, rows past the
    count zeroed."""
    if gemm is not None and gemm.limited:
        return gemm.grouped_masked(x, w, counts, expected_m)
    y = torch.bmm(x, w.transpose(1, 2))
    valid = torch.arange(x.shape[1], device=x.device)[None, :] < counts.to(x.device)[:, None]
    return torch.where(valid[..., None], y, torch.zeros((), dtype=y.dtype, device=y.device))


def grouped_experts_masked(
    x: torch.Tensor, counts: torch.Tensor, w13, w2, gemm=None, expected_m: int | None = None
) -> torch.Tensor:
    """DeepEP low-latency layout x [E, M, H] with ``counts[e]`` valid rows (a device tensor: no
    host read) through their experts (:func:`grouped_gemm_masked` twice). Rows past the count
    may hold garbage (DeepEP's buffers are torch.empty); they are never mixed into valid rows."""
    g, u = grouped_gemm_masked(x, w13, counts, gemm, expected_m).chunk(2, dim=-1)
    return grouped_gemm_masked((F.silu(g) * u).contiguous(), w2, counts, gemm, expected_m)


def experts_weighted(
    x, topk_local: torch.Tensor, topk_w: torch.Tensor, w13, w2, gemm=None
) -> torch.Tensor:
    """DeepEP normal layout: x [M, H] received rows, topk_local [M, k] local expert ids (-1: not
    here), weights [M, k]. Returns Σ_k w_k expert_k(x) per row (the receiver-side reduction)."""
    M = x.shape[0]
    out = torch.zeros_like(x, dtype=torch.float32)
    if M == 0:
        return out.to(x.dtype)
    rows, slots = (topk_local >= 0).nonzero(as_tuple=True)
    experts = topk_local[rows, slots]
    order = torch.argsort(experts, stable=True)
    rows, slots, experts = rows[order], slots[order], experts[order]
    counts = torch.bincount(experts, minlength=w13.shape[0]).tolist()
    y = grouped_experts_contiguous(x[rows], counts, w13, w2, gemm)
    out.index_add_(0, rows, y.float() * topk_w[rows, slots].float()[:, None])
    return out.to(x.dtype)


def moe_reference(cfg: RealModelConfig, lw, h: torch.Tensor) -> torch.Tensor:
    """Dense reference of one MoE MLP (all experts local): routed + shared, no communication."""
    idx, w = select_experts(cfg, h @ lw["gate"].t(), lw.get("gate_bias"))
    y = experts_weighted(h, idx, w, lw["w13"], lw["w2"])
    if "shared_w13" in lw:
        y = y + swiglu_mlp(h, lw["shared_w13"], lw["shared_w2"])
    return y
