"""The model's head: embedding, the final norm and lm_head, sampling."""

from __future__ import annotations

import torch

from overlap_lab.real import norm
from overlap_lab.real.kernels.context import KernelCtx
from overlap_lab.real.kernels.registry import KernelFamily


def embed(ctx: KernelCtx) -> None:
    w, mb = ctx.weights, ctx.mb
    ids = ctx.step.token_ids[mb["tok_lo"] : mb["tok_hi"]]
    h = torch.zeros(mb["padded_tokens"], ctx.cfg.hidden, dtype=w.dtype, device=w.device)
    h[: len(ids)] = w.embed[ids]
    ctx.put("hidden", h)
    ctx.put("residual", None)


def logits(ctx: KernelCtx) -> None:
    """Final norm (after the last residual add) and lm_head for the sampled tokens."""
    h, res = ctx.get("hidden"), ctx.get("residual")
    if res is not None:
        h = h + res
    n = ctx.real_rows()
    final = norm.rms_norm(h[:n], ctx.weights.final_norm, ctx.cfg.eps)
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


def sample(ctx: KernelCtx) -> None:
    rows, lg = ctx.get("logits")
    ctx.put("next_ids", (rows, lg.argmax(-1)))


FAMILY = KernelFamily(
    "head",
    "embedding, final norm + lm_head for the sampled tokens, greedy sampling",
    {"embed": embed, "logits": logits, "sample": sample},
)
