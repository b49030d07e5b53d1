"""Work, the FLOPs and HBM bytes of a kernel, and the primitive formulas every op is made of.

``shared.ir.ops`` (the layer's ops) and ``shared.ir.ops_kernels`` (the memory- and latency-bound
kernels a deployment runs around them) both build on these; they live apart so neither imports
the other's module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ACT = 2  # activations are bf16
FP8_SCALE_BLOCK = 128  # DeepEP / DeepGEMM: one fp32 scale per 128 fp8 values of a token


@dataclass(frozen=True)
class Work:
    flops: float = 0.0
    hbm_bytes: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(self.flops + other.flops, self.hbm_bytes + other.hbm_bytes)


def gemm(m: float, k: int, n: int, wbytes: int, out_bytes: int = ACT) -> Work:
    """Y[m,n] = X[m,k] W[k,n]: 2mkn FLOPs; W read once, X read and Y written once."""
    if m <= 0:
        return Work()
    return Work(2.0 * m * k * n, k * n * wbytes + m * k * ACT + m * n * out_bytes)


def bmm(m: float, heads: int, k: int, n: int, wbytes: int) -> Work:
    """Per-head GEMM (MLA's W_UK / W_UV absorption): ``heads`` GEMMs of m x k x n."""
    if m <= 0:
        return Work()
    return Work(2.0 * m * heads * k * n, heads * k * n * wbytes + m * heads * (k + n) * ACT)


def rmsnorm(rows: float, width: int, residual: bool = False) -> Work:
    """RMSNorm (fused with the residual add): reads x (+residual), writes y (+new residual)."""
    tensors = 4 if residual else 2
    return Work(5.0 * rows * width, tensors * rows * width * ACT)


def elementwise(rows: float, width: int, reads: int, writes: int, flops_per: float = 1.0) -> Work:
    """A memory-bound pass over ``rows x width`` bf16 values."""
    return Work(flops_per * rows * width, (reads + writes) * rows * width * ACT)


def fp8_row_bytes(width: int) -> float:
    """Bytes of one FP8 row with its per-128 fp32 scales (DeepGEMM's block-scaled layout)."""
    return width + math.ceil(width / FP8_SCALE_BLOCK) * 4


def quant(rows: float, width: int) -> Work:
    """Per-token-group FP8 quantisation of a bf16 activation (SGLang's
    ``per_token_group_quant_fp8`` in front of every block-scaled DeepGEMM GEMM): reads the bf16
    values, writes fp8 values and one fp32 scale per 128; about 4 FLOPs a value (abs, group max,
    scale, cast). Memory-bound."""
    if rows <= 0 or width <= 0:
        return Work()
    return Work(4.0 * rows * width, rows * (width * ACT + fp8_row_bytes(width)))
