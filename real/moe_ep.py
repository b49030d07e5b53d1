"""The data-movement kernels of LightLLM's ``grouped_fused_moe_ep`` (lightllm/common/fused_moe/),
as batched torch: the expert GEMMs between them are the caller's (real/kernels/moe.py).

Prefill (DeepEP normal layout, received rows in token order):
``ep_scatter`` copies each (row, top-k slot) with a local expert into expert-contiguous rows
and records where it put it (``output_index``); the grouped gate-up GEMM; ``silu_and_mul`` (+ the
FP8 quantisation of the down GEMM's input when the GEMMs run in FP8); the grouped down GEMM;
``ep_gather`` sums each row's slots back in token order, weighted by the top-k weights, in fp32.
Decode (DeepEP low-latency layout, already expert-major): only the activation sits between the
two masked GEMMs.

Differences from upstream, on purpose: the rows of one expert keep token order (a stable sort;
upstream's atomic counter gives an arbitrary order, so its GEMM rows, though not its sums, vary
from run to run); no 128-row padding per expert (the Triton and torch grouped GEMMs do not need
it; DeepGEMM's FP8 contiguous kernel would). The per-expert row counts are read on the host:
DeepEP's normal dispatch hands them to the host as a list (``num_recv_tokens_per_expert_list``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Scattered:
    """``ep_scatter``'s output: ``rows`` [N, H] expert-contiguous (``counts[e]`` rows of local
    expert e, in order), ``output_index`` [M, k] the row each (received row, slot) went to (-1:
    the slot's expert is not local), ``m_indices`` [N] each row's expert."""

    rows: torch.Tensor
    counts: list[int]
    output_index: torch.Tensor
    m_indices: torch.Tensor


def ep_scatter(x: torch.Tensor, topk_local: torch.Tensor, num_local: int) -> Scattered:
    """Permute received rows ``x`` [M, H] into expert-contiguous rows (``topk_local`` [M, k]:
    local expert ids, -1 where not local). One host read: the per-expert counts."""
    M, k = topk_local.shape
    flat = topk_local.reshape(-1)
    key = torch.where(flat >= 0, flat, num_local)  # slots with no local expert sort last
    order = torch.argsort(key, stable=True)
    hist = torch.zeros(num_local + 1, dtype=torch.long, device=x.device)
    hist.scatter_add_(0, key, torch.ones_like(key))
    counts = hist[:num_local].tolist()
    n = sum(counts)
    slots = order[:n]
    output_index = torch.full((M * k,), -1, dtype=torch.long, device=x.device)
    output_index[slots] = torch.arange(n, device=x.device)
    rows = x[torch.div(slots, k, rounding_mode="floor")]
    m_indices = key[slots].to(torch.int32)
    return Scattered(rows.contiguous(), counts, output_index.view(M, k), m_indices)


def ep_gather(
    y: torch.Tensor, output_index: torch.Tensor, topk_w: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``out[i] = Σ_j topk_w[i, j] · y[output_index[i, j]]`` over the slots with a local expert,
    accumulated in fp32 in slot order (deterministic: no atomics), as upstream's ``ep_gather``."""
    M, k = output_index.shape
    out = torch.zeros(M, y.shape[-1], dtype=torch.float32, device=y.device)
    if y.shape[0] == 0:
        return out.to(out_dtype)
    for j in range(k):
        oi = output_index[:, j]
        w = torch.where(oi >= 0, topk_w[:, j].float(), 0.0)
        out += y[oi.clamp_min(0)].float() * w[:, None]
    return out.to(out_dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation on a gate-up GEMM output [..., 2I] -> [..., I]."""
    g, u = gate_up.chunk(2, dim=-1)
    return (F.silu(g) * u).contiguous()
