"""The steps SGLang's ``LayerCommunicator`` (python/sglang/srt/layers/communicator.py) runs
around a layer's two halves; here their norms and residual adds (``comm_prepare_attn``,
``comm_prepare_mlp``, ``comm_postprocess_layer``: shared/ir/ops.py)."""

from __future__ import annotations

from overlap_lab.real import norm
from overlap_lab.real.kernels.context import KernelCtx
from overlap_lab.real.kernels.registry import KernelFamily


def comm_prepare_attn(ctx: KernelCtx) -> None:
    """Input RMSNorm; the hidden state entering the layer becomes the residual."""
    h = ctx.get("hidden")
    ctx.put("residual", h)
    ctx.put("attn_in", norm.rms_norm(h, ctx.lw["input_norm"], ctx.cfg.eps))


def comm_prepare_mlp(ctx: KernelCtx) -> None:
    h, res = ctx.get("hidden"), ctx.get("residual")
    normed, s = norm.fused_add_rms_norm(h, res, ctx.lw["post_attn_norm"], ctx.cfg.eps)
    ctx.put("residual", s)
    ctx.put("mlp_in", normed)


def comm_postprocess_layer(ctx: KernelCtx) -> None:
    """The layer's residual add (shared/ir/ops.py's postprocess): hidden += residual."""
    h, res = ctx.get("hidden"), ctx.get("residual")
    ctx.put("hidden", h + res)
    ctx.put("residual", None)


FAMILY = KernelFamily(
    "comm-prep",
    "a layer's input RMSNorm, post-attention fused add + RMSNorm, and final residual add",
    {
        "comm_prepare_attn": comm_prepare_attn,
        "comm_prepare_mlp": comm_prepare_mlp,
        "comm_postprocess_layer": comm_postprocess_layer,
    },
)
