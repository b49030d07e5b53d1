"""Triton kernel of real/norm.py's ``fused_add_rms_norm`` (imported on first use: this module
imports triton): SGLang's fused (x + residual) -> (RMSNorm(sum), sum) in one pass over the row,
where torch has no fused form (its own fused RMSNorm, ``_fused_rms_norm``, takes no residual).

Kept at module level because Triton's CPU interpreter resolves ``tl`` through the kernel's
module globals, not a closure.
"""

import triton
import triton.language as tl


@triton.jit
def add_rms_norm(
    x, r, s, y, w, K, sx, sr, ss, sy, eps,
    BLOCK: tl.constexpr, RESIDUAL: tl.constexpr,
):  # fmt: skip
    """One program per row of ``x`` [M, K] (K <= BLOCK): with RESIDUAL, ``s = x + r`` rounded to
    the input's dtype and stored, as torch's add rounds it; then ``y = s * rstd * w`` in fp32,
    ``rstd = 1 / sqrt(mean(s^2) + eps)``, rounded once to the output's dtype (the formula of
    ``real.norm.rms_norm_reference``). IEEE-rounded square root and division (plain ones may
    compile to approximations) keep the CPU interpreter's numbers torch's."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    v = tl.load(x + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    if RESIDUAL:
        v = v + tl.load(r + row * sr + cols, mask=mask, other=0.0).to(tl.float32)
        v = v.to(s.dtype.element_ty)
        tl.store(s + row * ss + cols, v, mask=mask)
        v = v.to(tl.float32)
    mean_sq = tl.math.div_rn(tl.sum(v * v, axis=0), K.to(tl.float32))
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))
    g = tl.load(w + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y + row * sy + cols, (v * rstd * g).to(y.dtype.element_ty), mask=mask)
