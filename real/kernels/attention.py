"""Attention: the q projections and new KV rows (``attn.prepare``), attention over the cache and
o_proj (``attn.core``): MLA (decode absorbed, through FlashMLA where ``flash_mla`` imports;
prefill expanded) or GQA, per ``real.model``."""

from __future__ import annotations

import torch

from overlap_lab.real import model as M
from overlap_lab.real.kernels.context import KernelCtx
from overlap_lab.real.kernels.registry import KernelFamily


def flash_mla_module():
    """``flash_mla`` when it imports (a module already in sys.modules counts), else None."""
    import importlib
    import sys

    from overlap_lab.real.deps import available

    mod = sys.modules.get("flash_mla")
    if mod is not None:
        return mod
    return importlib.import_module("flash_mla") if available("flash_mla") else None


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


FAMILY = KernelFamily(
    "attention",
    "MLA (FlashMLA or SDPA) or GQA attention over the KV cache, with its projections",
    {"attn.prepare": attn_prepare, "attn.core": attn_core},
)
