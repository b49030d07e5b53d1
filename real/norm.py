"""RMSNorm, plain and fused with the residual add: one kernel each on a GPU, torch ops elsewhere.

The eager fp32 chain (:func:`rms_norm_reference`: a cast, a square, a mean, an rsqrt, two
multiplies, a cast back) ran at a tenth of the device's copy bandwidth on an H200; the executor
runs one kernel per norm instead, as an engine does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["fused_add_rms_norm", "rms_norm", "rms_norm_reference"]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm by torch ops in fp32 (several kernels and an fp32 copy of ``x``): the CPU path
    and the reference the fused kernels are tested against."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim. On CUDA one fused kernel, torch's own: ``F.rms_norm`` runs
    ``_fused_rms_norm`` there (PyTorch aten/src/ATen/native/layer_norm.cpp ``rms_norm_symint``;
    native_functions.yaml ``CUDA: _fused_rms_norm_cuda``), in fp32 inside, as the reference,
    when the weight's dtype is the input's (torch takes its composite path otherwise);
    elsewhere :func:`rms_norm_reference`."""
    if x.is_cuda and weight.dtype == x.dtype:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return rms_norm_reference(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps=1e-6):
    """SGLang's fused (x + residual) -> (norm(sum), sum): one Triton kernel on CUDA (or under
    Triton's CPU interpreter) that reads both inputs once and writes both outputs
    (real/_triton_norm.py), as SGLang's ``fused_add_rmsnorm``; torch ops otherwise."""
    from overlap_lab.real.deps import available, interpreting

    K = x.shape[-1]
    if (
        (x.is_cuda or interpreting())
        and x.shape == residual.shape
        and x.dtype == residual.dtype
        and K <= NORM_MAX_K
        and available("triton")
    ):
        return _add_rms_norm_fused(x, residual, weight, eps)
    s = x + residual
    return rms_norm(s, weight, eps), s


NORM_MAX_K = 1 << 15  # one row per program: a row must fit one block


def _add_rms_norm_fused(x, residual, weight, eps):
    from overlap_lab.real.deps import interpreting

    kern = _norm_kernel(interpreting())
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    r2 = residual.reshape(-1, K)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    r2 = r2 if r2.stride(-1) == 1 else r2.contiguous()
    s = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block = 1 << max(0, (K - 1).bit_length())
    if x2.shape[0]:
        kern[(x2.shape[0],)](
            x2, r2, s, y, weight, K, x2.stride(0), r2.stride(0), s.stride(0), y.stride(0),
            float(eps), BLOCK=block, RESIDUAL=True, num_warps=min(16, max(1, block // 512)),
        )  # fmt: skip
    return y.reshape(x.shape), s.reshape(x.shape)


_NORM_KERNEL: dict[bool, object] = {}


def _norm_kernel(mode: bool):
    """The Triton kernel, defined in the interpreter mode in force (reloaded when it changed)."""
    if mode not in _NORM_KERNEL:
        import importlib

        import overlap_lab.real._triton_norm as mod

        if _NORM_KERNEL:
            mod = importlib.reload(mod)
        _NORM_KERNEL.clear()
        _NORM_KERNEL[mode] = mod.add_rms_norm
    return _NORM_KERNEL[mode]
