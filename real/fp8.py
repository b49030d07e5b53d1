"""GEMM precision: FP8 through DeepGEMM where the workload asks for it and the machine can, BF16
otherwise, and always said which.

The workload's ``gemm_dtype`` ("bf16" | "fp8", shared/inputs/workload.py) is what the simulator models.
The executor honours it per op (``Op.dtype``: the projections, shared and routed experts, dense
MLP carry the workload's GEMM dtype; the router stays BF16, as in the simulator) when
:func:`resolve` says FP8 can run: a CUDA device, torch's ``float8_e4m3fn``, and a ``deep_gemm``
with the FP8 entry points. Otherwise the run is BF16 and its trace says why; the GPU loop then
predicts with ``gemm_dtype="bf16"`` (like with like).

DeepGEMM's FP8 format (DeepSeek-V3's recipe, SM90): activations per token in groups of 128
along K (FP8 e4m3 + one fp32 scale per group; the scales MN-major and TMA-aligned: stored as
[K/128, align(M, 4)], handed over as its transposed [M, K/128] view), weights in 128 x 128 blocks
(fp32 scales [ceil(N/128), K/128]), BF16 output. K must be a multiple of 128. The masked grouped
GEMM takes DeepEP's low-latency layout ([G, M_max, K] with device counts and ``expected_m``), the
contiguous one rows sorted by expert with each expert's segment padded to DeepGEMM's M alignment
(``grouped_layout``: the expert per row, -1 on padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 128  # activation group along K and weight block edge
SF_ALIGN = 4  # fp32 scales: 16-byte TMA alignment along M
CONTIGUOUS_ALIGN = 128  # DeepGEMM's default M alignment per expert (contiguous layout)
ENTRY_POINTS = ("fp8_gemm_nt", "m_grouped_fp8_gemm_nt_masked", "m_grouped_fp8_gemm_nt_contiguous")


@dataclass(frozen=True)
class Precision:
    """What a run's GEMMs run in: ``requested`` (the workload's gemm_dtype), ``used`` and why."""

    requested: str
    used: str
    reason: str

    @property
    def fp8(self) -> bool:
        return self.used == "fp8"


def resolve(requested: str, *, cuda: bool, module) -> Precision:
    """FP8 only when asked for and runnable here; otherwise BF16 with the reason."""
    if requested != "fp8":
        return Precision(requested, "bf16", f"gemm_dtype={requested}")
    if not cuda:
        why = "the CPU has no FP8 GEMMs"
    elif fp8_dtype() is None:
        why = "this torch has no float8_e4m3fn"
    elif module is None:
        why = "deep_gemm is not installed"
    else:
        missing = [n for n in ENTRY_POINTS if not callable(getattr(module, n, None))]
        if not missing:
            return Precision("fp8", "fp8", "DeepGEMM FP8 (1x128 activation, 128x128 weight scales)")
        why = f"deep_gemm lacks {', '.join(missing)}"
    return Precision("fp8", "bf16", f"fp8 asked for, BF16 run: {why}")


BF16 = Precision("bf16", "bf16", "gemm_dtype=bf16")


def fp8_dtype() -> torch.dtype | None:
    return getattr(torch, "float8_e4m3fn", None)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


SCALE_EPS = 1e-4  # the smallest group amax: an all-zero group gets a finite scale


def quant_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, groups of 128 along K: (FP8 e4m3 like ``x``, fp32 scales [..., K/128]) with
    ``x ≈ q * scale`` per group, scale = amax / 448. On CUDA (or under Triton's interpreter)
    one fused Triton kernel (:func:`quant_tokens_fused`), whose scales are already in
    DeepGEMM's layout; otherwise torch ops (:func:`quant_tokens_torch`, row-major scales).
    Either way :func:`sf_for_deep_gemm` hands DeepGEMM its layout."""
    if _fused_here(x):
        return quant_tokens_fused(x)
    return quant_tokens_torch(x)


def quant_tokens_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quant_tokens` by torch ops (several kernels and an fp32 copy of ``x``): the CPU
    path and the fused kernel's reference."""
    K = _check_k(x)
    dt = fp8_dtype()
    fmax = torch.finfo(dt).max
    g = x.float().reshape(*x.shape[:-1], K // GROUP, GROUP)
    scale = g.abs().amax(-1).clamp_min(SCALE_EPS) / fmax
    q = (g / scale[..., None]).clamp(-fmax, fmax).to(dt).reshape(x.shape)
    return q, scale


def quant_tokens_fused(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quant_tokens` by one Triton kernel (SGLang's ``per_token_group_quant_fp8``): one
    program per token and 128-column group reads the group once, writes its FP8 values and its
    scale, the scale straight into DeepGEMM's SM90 layout (MN-major, M padded to 4: the
    [..., M, K/128] view of a [..., K/128, align(M, 4)] buffer), so no second pass lays them out.
    ``x``: [M, K] or [B, M, K] (DeepEP's low-latency layout: per expert), K a multiple of 128."""
    from overlap_lab.real.deps import interpreting

    K = _check_k(x)
    kern = _quant_kernel(interpreting())
    x3 = x.reshape(-1, *x.shape[-2:]) if x.dim() >= 2 else x.reshape(1, 1, K)
    x3 = x3 if x3.stride(-1) == 1 else x3.contiguous()
    B, M, _ = x3.shape
    dt = fp8_dtype()
    q = torch.empty(B, M, K, dtype=dt, device=x.device)
    pad = _cdiv(M, SF_ALIGN) * SF_ALIGN
    buf = torch.empty(B, K // GROUP, pad, dtype=torch.float32, device=x.device)
    if B * M:
        kern[(B * M, K // GROUP)](
            x3, q, buf, M, K,
            x3.stride(0), x3.stride(1), q.stride(0), q.stride(1),
            buf.stride(0), buf.stride(1), buf.stride(2),
            SCALE_EPS, float(torch.finfo(dt).max),
            GROUP=GROUP,
        )  # fmt: skip
    scale = buf.transpose(-1, -2)[..., :M, :]  # indexed, never reshaped: strides kept
    if x.dim() == 2:
        return q[0], scale[0]
    if x.dim() == 3:
        return q, scale
    return q.reshape(x.shape), scale.reshape(*x.shape[:-1], K // GROUP)


def _check_k(x: torch.Tensor) -> int:
    K = x.shape[-1]
    if K % GROUP:
        raise ValueError(f"FP8 activations: K={K} is not a multiple of {GROUP}")
    return K


def _fused_here(x: torch.Tensor) -> bool:
    """The fused kernel runs on CUDA tensors, or anywhere under Triton's CPU interpreter."""
    from overlap_lab.real.deps import available, interpreting

    return (x.is_cuda or interpreting()) and available("triton")


_QUANT_KERNEL: dict[bool, object] = {}


def _quant_kernel(mode: bool):
    """The Triton kernel, defined in the interpreter mode in force (reloaded when it changed)."""
    if mode not in _QUANT_KERNEL:
        import importlib

        import overlap_lab.real._triton_quant as mod

        if _QUANT_KERNEL:
            mod = importlib.reload(mod)
        _QUANT_KERNEL.clear()
        _QUANT_KERNEL[mode] = mod.per_token_group_quant_fp8
    return _QUANT_KERNEL[mode]


def sf_for_deep_gemm(scale: torch.Tensor) -> torch.Tensor:
    """Activation scales [..., M, K/128] as DeepGEMM's SM90 kernels read them: MN-major (stride 1
    along M) with M padded to 4 (TMA alignment), returned as the [..., M, K/128] view; scales
    already laid out so (the fused kernel's) are returned as they are, not copied."""
    *lead, M, kg = scale.shape
    if _deep_gemm_layout(scale):
        return scale
    pad = _cdiv(M, SF_ALIGN) * SF_ALIGN
    buf = torch.zeros(*lead, kg, pad, dtype=torch.float32, device=scale.device)
    buf[..., :M] = scale.transpose(-1, -2)
    return buf.transpose(-1, -2)[..., :M, :]


def _deep_gemm_layout(scale: torch.Tensor) -> bool:
    """MN-major with M padded to 4 inside one buffer [..., K/128, align(M, 4)]."""
    if scale.dim() < 2 or scale.dtype != torch.float32:
        return False
    M, kg = scale.shape[-2:]
    pad = _cdiv(M, SF_ALIGN) * SF_ALIGN
    if scale.stride(-2) != 1 or scale.stride(-1) != pad:
        return False
    return scale.dim() == 2 or scale.stride(-3) == kg * pad


def quant_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights [..., N, K] in 128 x 128 blocks: (FP8 e4m3, fp32 scales [..., ceil(N/128), K/128])."""
    *lead, N, K = w.shape
    if K % GROUP:
        raise ValueError(f"FP8 weights: K={K} is not a multiple of {GROUP}")
    dt = fp8_dtype()
    fmax = torch.finfo(dt).max
    nb = _cdiv(N, GROUP)
    wp = torch.zeros(*lead, nb * GROUP, K, dtype=torch.float32, device=w.device)
    wp[..., :N, :] = w.float()
    blocks = wp.reshape(*lead, nb, GROUP, K // GROUP, GROUP)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp_min(1e-4) / fmax  # [..., nb, K/128]
    q = (blocks / scale[..., :, None, :, None]).clamp(-fmax, fmax)
    q = q.reshape(*lead, nb * GROUP, K)[..., :N, :].to(dt).contiguous()
    return q, scale.contiguous()


# The model's GEMM weights that run in FP8 where the run does (the router and attention
# projections stay BF16): quantised at load by :meth:`WeightCache.load`.
GEMM_WEIGHTS = ("mlp_w13", "mlp_w2", "w13", "w2", "shared_w13", "shared_w2")


class WeightCache:
    """FP8 weights (:func:`quant_blocks`) made once, at load, as an engine loads FP8 checkpoints:
    quantising weights is never part of a step or of a captured graph. A view along the leading
    (expert) dimensions of a loaded tensor (SBO's expert slices, one expert of a loop) is served
    as the same view of its quantised pair: blocks never straddle experts. Anything else is
    quantised on first use and counted in ``late`` (what the executor's load missed)."""

    def __init__(self) -> None:
        self._by_storage: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self.late = 0

    def load(self, tensors) -> WeightCache:
        for w in tensors:
            if self._find(w) is None:
                self._by_storage.setdefault(_storage(w), []).append((w, *quant_blocks(w)))
        return self

    def get(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hit = self._find(w)
        if hit is None:
            self.late += 1
            self.load([w])
            hit = self._find(w)
        return hit

    def _find(self, w: torch.Tensor):
        for base, q, s in self._by_storage.get(_storage(w), ()):
            lead = base.dim() - w.dim()  # 0: the tensor or a slice [a:b]; 1: one expert [e]
            if base.dtype != w.dtype or lead not in (0, 1):
                continue
            if w.shape[1 - lead :] != base.shape[1:] or w.stride() != base.stride()[lead:]:
                continue
            off = w.storage_offset() - base.storage_offset()
            if off < 0 or off % base.stride(0):
                continue
            i = off // base.stride(0)
            if lead:
                return q[i], s[i]
            n = w.shape[0]
            if i == 0 and n == base.shape[0]:
                return q, s
            if w.dim() >= 3:  # experts [i, i + n): whole blocks per expert
                return q[i : i + n], s[i : i + n]
        return None


def _storage(w: torch.Tensor) -> int:
    return w.untyped_storage().data_ptr()


def load_weights(weights) -> WeightCache:
    """The FP8 cache of a model's GEMM weights (real.model.ModelWeights), made at load."""
    return WeightCache().load(
        lw[k] for lw in weights.layers.values() for k in GEMM_WEIGHTS if k in lw
    )


def activations(x) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` BF16 -> (FP8, DeepGEMM-layout scales); an already quantised (q, scale) pair (the
    activation kernel's output) only gets the scale layout."""
    q, s = x if isinstance(x, tuple) else quant_tokens(x)
    return q.contiguous(), sf_for_deep_gemm(s)


def dequant(x) -> torch.Tensor:
    """A (q, scale) pair back to BF16 (a GEMM that falls back to BF16 after the activation
    kernel quantised its input); a tensor is returned as it is."""
    if not isinstance(x, tuple):
        return x
    q, s = x
    K = q.shape[-1]
    g = q.float().reshape(*q.shape[:-1], K // GROUP, GROUP) * s[..., None]
    return g.reshape(q.shape).to(torch.bfloat16)


def linear(dg, x: torch.Tensor, w: torch.Tensor, cache: WeightCache) -> torch.Tensor:
    """``x @ w.T`` by ``deep_gemm.fp8_gemm_nt`` (x [M, K] BF16 or a quantised pair)."""
    a = activations(x)
    d = torch.empty(a[0].shape[0], w.shape[0], dtype=torch.bfloat16, device=w.device)
    dg.fp8_gemm_nt(a, cache.get(w), d)
    return d


def grouped_masked(
    dg, x, w: torch.Tensor, counts: torch.Tensor, expected_m: int, cache: WeightCache
) -> torch.Tensor:
    """DeepEP's low-latency layout by ``deep_gemm.m_grouped_fp8_gemm_nt_masked``."""
    a = activations(x)
    G, M, _ = a[0].shape
    d = torch.empty(G, M, w.shape[1], dtype=torch.bfloat16, device=w.device)
    dg.m_grouped_fp8_gemm_nt_masked(a, cache.get(w), d, counts.int(), int(expected_m))
    return d


def contiguous_layout(counts: list[int], align: int) -> tuple[list[int], list[int]]:
    """Rows sorted by expert (``counts``) -> (each row's index in the padded layout, the expert
    of every padded row, -1 on padding): each expert's segment starts at a multiple of
    ``align``."""
    dst, layout = [], []
    for e, n in enumerate(counts):
        start = len(layout)
        dst.extend(range(start, start + n))
        layout.extend([e] * n + [-1] * (_cdiv(n, align) * align - n))
    return dst, layout


def grouped_contiguous(
    dg, x, w: torch.Tensor, counts: list[int], cache: WeightCache
) -> torch.Tensor:
    """Rows sorted by expert by ``deep_gemm.m_grouped_fp8_gemm_nt_contiguous``: the rows are
    copied into DeepGEMM's aligned layout (what LightLLM's scatter writes directly) and the
    valid output rows read back."""
    get_align = getattr(dg, "get_mk_alignment_for_contiguous_layout", None)
    align = int(get_align()) if callable(get_align) else CONTIGUOUS_ALIGN
    q, s = x if isinstance(x, tuple) else quant_tokens(x)
    dst_l, layout_l = contiguous_layout(counts, align)
    dev = w.device
    dst = torch.tensor(dst_l, dtype=torch.long).to(dev, non_blocking=True)
    layout = torch.tensor(layout_l, dtype=torch.int32).to(dev, non_blocking=True)
    qp = torch.zeros(len(layout_l), q.shape[-1], dtype=torch.uint8, device=dev)
    sp = torch.ones(len(layout_l), s.shape[-1], dtype=torch.float32, device=dev)
    qp[dst] = q.view(torch.uint8)  # bytes: FP8 indexing is not implemented everywhere
    sp[dst] = s
    qp = qp.view(q.dtype)
    d = torch.empty(len(layout_l), w.shape[1], dtype=torch.bfloat16, device=dev)
    dg.m_grouped_fp8_gemm_nt_contiguous((qp, sf_for_deep_gemm(sp)), cache.get(w), d, layout)
    return d[dst]


def probe(p: Precision, module, device) -> Precision:
    """``p`` after one small call of each FP8 entry point on ``device`` (DeepGEMM compiles its
    kernels on first use): BF16, with the error, when one fails, so that a whole run (and the
    prediction it is compared with) is BF16 rather than a mix."""
    if not p.fp8:
        return p
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2, 128, 256, generator=g).to(device, torch.bfloat16)
    w = torch.randn(2, 256, 256, generator=g).to(device, torch.bfloat16)
    counts = torch.tensor([128, 64], dtype=torch.int32).to(device)
    cache = WeightCache().load([w])
    try:
        linear(module, x[0], w[0], cache)
        grouped_masked(module, x, w, counts, 96, cache)
        grouped_contiguous(module, x.reshape(-1, 256)[:192], w, [128, 64], cache)
        if device != "cpu":
            torch.cuda.synchronize()
    except Exception as e:  # JIT (nvcc, CUDA_HOME) or an unsupported build
        return Precision(p.requested, "bf16", f"fp8 asked for, BF16 run: DeepGEMM FP8 probe "
                         f"failed ({type(e).__name__}: {str(e)[:200]})")  # fmt: skip
    return p
