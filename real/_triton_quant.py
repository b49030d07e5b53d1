"""Triton kernel of real/fp8.py (imported on first use: this module imports triton): FP8
activations per token and 128-column group in one pass, as SGLang's ``per_token_group_quant_fp8``
(its scales written straight into DeepGEMM's layout, so no second kernel lays them out).

Kept at module level because Triton's CPU interpreter resolves ``tl`` through the kernel's
module globals, not a closure.
"""

import triton
import triton.language as tl


@triton.jit
def per_token_group_quant_fp8(
    x, q, s, M, K,
    sxb, sxm, sqb, sqm, ssb, ssg, ssm,
    eps, fmax,
    GROUP: tl.constexpr,
):  # fmt: skip
    """One program per (row, group): ``x`` [B, M, K] -> ``q`` FP8 [B, M, K] and the group's
    scale amax/fmax at ``s + b*ssb + g*ssg + m*ssm`` (MN-major: ssm == 1)."""
    row = tl.program_id(0)
    g = tl.program_id(1)
    b = row // M
    m = row % M
    cols = g * GROUP + tl.arange(0, GROUP)
    v = tl.load(x + b * sxb + m * sxm + cols).to(tl.float32)
    # IEEE-rounded divisions (a plain fp32 "/" may compile to an approximate one): the scales
    # and the values before the FP8 cast are torch's, bit for bit
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v)), eps), fmax)
    y = tl.clamp(tl.math.div_rn(v, scale), -fmax, fmax)
    tl.store(q + b * sqb + m * sqm + cols, y.to(q.dtype.element_ty))
    tl.store(s + b * ssb + g * ssg + m * ssm, scale)
