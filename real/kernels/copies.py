"""Device-to-host copies of what a step sampled: the next token ids and, with
``--return-logprob``, their log-probabilities (non-blocking; the Program orders the host's read
after them with an event)."""

from __future__ import annotations

import torch

from overlap_lab.real.kernels.context import KernelCtx
from overlap_lab.real.kernels.registry import KernelFamily


def d2h(ctx: KernelCtx) -> None:
    """The non-blocking copy of the sampled ids to the host."""
    ids = ctx.gather_mbs("next_ids")
    ctx.put("next_ids_host", ids.to("cpu", non_blocking=ids.is_cuda))


def d2h_logprobs(ctx: KernelCtx) -> None:
    """``--return-logprob``: the log-probabilities of the sampled ids, copied to the host. The
    executor computes logits only for the positions it samples, so the input-token variant
    covers those rows too (SGLang computes them for every prompt token: more rows, same op)."""
    rows, lg = ctx.get("logits")
    _, ids = ctx.get("next_ids")
    lp = torch.log_softmax(lg.float(), -1).gather(-1, ids[:, None])[:, 0]
    ctx.put(f"{ctx.op.name}_host", (rows, lp.to("cpu", non_blocking=lp.is_cuda)))


FAMILY = KernelFamily(
    "copies",
    "non-blocking D2H copies of the sampled ids and, with --return-logprob, their logprobs",
    {
        "d2h": d2h,
        "d2h_next_token_ids": d2h,
        "d2h_next_token_logprobs": d2h_logprobs,
        "d2h_input_token_logprobs": d2h_logprobs,
    },
)
