"""The compute ops' GEMM kernels, and their SM budgets: GEMMs that run on at most ``sms`` SMs.

A schedule limits a compute op with ``Op.sms`` (SBO's ``compute_num_sms``, DeepSeek prefill's
132 - 24 = 108, TBO prefill's DeepGEMM limit ``num_sms - DeepEP's SMs``). cuBLAS ignores such
limits. The kernel registry runs every compute op's GEMMs through :class:`ComputeBudget`, which
picks the kernel per dtype as SGLang does:

- BF16 on every SM (no limit, or one at least the device's SMs): cuBLAS (torch), the device's
  best BF16 GEMM and what SGLang runs for unquantised linears (python/sglang/srt/layers/
  quantization/unquant.py ``UnquantizedLinearMethod.apply``: ``F.linear``); the masked grouped
  GEMM a batched cuBLAS GEMM over the padded rows (SGLang's BF16 MoE runs Triton's
  ``fused_moe``; the kernel table holds both to cuBLAS over the same expert batches).
- FP8 (1x128 / 128x128 block scales): DeepGEMM, on the op's budget or every SM, as SGLang
  dispatches block-FP8 GEMMs to DeepGEMM where it is enabled (python/sglang/srt/layers/
  quantization/fp8_utils.py ``dispatch_w8a8_block_fp8_linear`` ->
  ``deepgemm_w8a8_block_fp8_linear_with_fallback``).
- BF16 with an SM limit below the device's (what cuBLAS cannot honour): the budget kernels
  below, DeepGEMM's BF16 kernels scoped by ``set_num_sms`` where this build has them (SGLang
  wraps the same entry points: ``deep_gemm_wrapper`` ``gemm_nt_bf16bf16bf16``,
  ``grouped_gemm_nt_bf16bf16bf16_masked``), else persistent Triton GEMMs with that grid.

The budget kernels:

- ``deep_gemm`` imports: ``deep_gemm.set_num_sms(sms)`` scoped by :func:`deep_gemm_num_sms` (the
  previous value restored on exit, even on error), and DeepGEMM's BF16 kernels when this build
  has them (``bf16_gemm_nt``, ``m_grouped_bf16_gemm_nt_masked``; feature-detected). GEMMs this
  build lacks run through the Triton kernels below with the same budget.
- otherwise, triton imports: persistent Triton GEMMs whose grid is exactly the budget
  (``num_sms`` programs, each looping over output tiles ``pid, pid + num_sms, ...``), as
  DeepGEMM's persistent kernels and NanoFlow limit a kernel's SMs:
  :func:`matmul` (``a @ w.T``), :func:`grouped_matmul_masked` (DeepEP low-latency layout
  ``[E, M, K]`` with a device tensor of valid rows per expert: tiles past the count are skipped,
  their rows left unwritten, as DeepGEMM's masked kernel does; no host sync) and
  :func:`grouped_matmul_contiguous` (rows sorted by expert, host counts: the normal layout).
- neither, or the CPU, or no limit: torch (the whole GPU); the mechanism is recorded.

Triton is imported on first use (the kernels live in real/_triton_gemm.py). On the CPU they run
under Triton's interpreter with CPU tensors: ``TRITON_INTERPRET=1`` must be in the environment
before ``import triton`` (triton.language's own helpers, tl.cdiv for one, are @jit functions
decorated at import, and a compiled helper cannot be called from an interpreted kernel); the
tests run those checks in a child process. bf16 does not survive the interpreter: fp32/fp16 there.
"""

from __future__ import annotations

import importlib
import sys
from contextlib import contextmanager

import torch

from overlap_lab.real import fp8
from overlap_lab.real.deps import interpreting
from overlap_lab.real.runlog import RunLog

_KERNELS: dict[bool, tuple] = {}

# Tile sizes for the GPU (BF16, Hopper-sized registers); tests pass small ones to the interpreter.
BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M = 64, 128, 64, 8


def _kernels():
    """(persistent_mm, grouped_masked_mm, grouped_contig_mm), defined in the interpreter mode
    in force at the first call (the module is reloaded when the mode changed)."""
    mode = interpreting()
    if mode not in _KERNELS:
        import overlap_lab.real._triton_gemm as mod

        if _KERNELS:  # defined before in the other mode
            mod = importlib.reload(mod)
        _KERNELS.clear()
        _KERNELS[mode] = (mod.persistent_mm, mod.grouped_masked_mm, mod.grouped_contig_mm)
    return _KERNELS[mode]


def _blocks(blocks):
    bm, bn, bk = blocks or (BLOCK_M, BLOCK_N, BLOCK_K)
    return bm, bn, bk


def _warps(bm, bn) -> int:
    return 8 if bm * bn >= 128 * 128 else 4


def matmul(a: torch.Tensor, w: torch.Tensor, *, num_sms: int, blocks=None) -> torch.Tensor:
    """``a @ w.T`` (a [M, K], w [N, K]) by ``num_sms`` persistent programs."""
    persistent_mm, _, _ = _kernels()
    lead = a.shape[:-1]
    a2 = a.reshape(-1, a.shape[-1])
    M, K = a2.shape
    N = w.shape[0]
    c = torch.empty(M, N, dtype=a.dtype, device=a.device)
    if M and N:
        bm, bn, bk = _blocks(blocks)
        persistent_mm[(max(1, int(num_sms)),)](
            a2, w, c, M, N, K, a2.stride(0), a2.stride(1), w.stride(0), w.stride(1),
            c.stride(0), c.stride(1), BM=bm, BN=bn, BK=bk, GM=GROUP_M, num_warps=_warps(bm, bn),
        )  # fmt: skip
    return c.reshape(*lead, N)


def grouped_matmul_masked(
    a: torch.Tensor,
    w: torch.Tensor,
    counts: torch.Tensor,
    *,
    num_sms: int,
    out: torch.Tensor | None = None,
    blocks=None,
    signal: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepEP low-latency layout: ``out[e, :counts[e]] = a[e, :counts[e]] @ w[e].T`` (a [E, M, K],
    w [E, N, K], counts [E] on the device). Rows past the count are not written (torch.empty
    unless ``out`` is given), and nothing is read back to the host.

    ``signal``: SBO's down GEMM (SGLang's ``DownGemmOverlapArgs.signal``): a zeroed int32 tensor
    of :func:`signal_shape` elements; every stored tile of (expert e, row block b) adds 1 to
    ``signal[e, b]`` (release), so a block with rows ends at :func:`signal_threshold` and a block
    without rows stays 0 (its tiles are skipped, as DeepGEMM's masked kernel skips them)."""
    _, grouped_masked_mm, _ = _kernels()
    E, M, K = a.shape
    N = w.shape[1]
    c = out if out is not None else torch.empty(E, M, N, dtype=a.dtype, device=a.device)
    bm, bn, bk = _blocks(blocks)
    if signal is not None:
        assert signal.dtype == torch.int32 and signal.numel() == E * -(-M // bm), signal.shape
    if E and M and N:
        grouped_masked_mm[(max(1, int(num_sms)),)](
            a, w, c, counts, signal if signal is not None else counts,
            E, M, N, K, a.stride(0), a.stride(1), a.stride(2),
            w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1), c.stride(2),
            BM=bm, BN=bn, BK=bk, SIGNAL=signal is not None, num_warps=_warps(bm, bn),
        )  # fmt: skip
    return c


def signal_shape(num_experts: int, rows: int, blocks=None) -> tuple[int, int]:
    """SBO's Hopper signal: one int32 per (local expert, row block of BLOCK_M = 64 rows), as
    SGLang allocates it (``num_local_experts * ceil(num_tokens / 64)``)."""
    return num_experts, -(-rows // _blocks(blocks)[0])


def signal_threshold(n: int, blocks=None) -> int:
    """The count at which a row block of the signalled down GEMM is complete: one increment per
    N tile of the block (``ceil(N / BLOCK_N)``). The combine waits for ``signal >= threshold``.
    Upstream SGLang passes ``threshold = compute_num_sms`` to DeepEP for DeepGEMM's signal
    kernel, whose per-block count differs from this kernel's; this value belongs to THIS
    kernel's signal and must be the one given to whatever polls it."""
    return -(-n // _blocks(blocks)[1])


def contiguous_tiles(counts: list[int], block_m: int) -> tuple[list[int], list[int], list[int]]:
    """M tiles of the contiguous layout (rows sorted by expert, ``counts[e]`` each): (expert,
    first row, end row) per tile; a tile never spans two experts."""
    te, lo, hi = [], [], []
    start = 0
    for e, n in enumerate(counts):
        for r in range(start, start + n, block_m):
            te.append(e)
            lo.append(r)
            hi.append(start + n)
        start += n
    return te, lo, hi


def grouped_matmul_contiguous(
    a: torch.Tensor, w: torch.Tensor, counts: list[int], *, num_sms: int, blocks=None
) -> torch.Tensor:
    """Normal layout: rows of ``a`` [T, K] sorted by expert (``counts`` from the host, which
    DeepEP's normal dispatch returns as a list), row block of expert e times ``w[e].T``."""
    _, _, grouped_contig_mm = _kernels()
    T, K = a.shape
    N = w.shape[1]
    c = torch.empty(T, N, dtype=a.dtype, device=a.device)
    bm, bn, bk = _blocks(blocks)
    te, lo, hi = contiguous_tiles(counts, bm)
    if te and N:
        tab = torch.tensor([te, lo, hi], dtype=torch.int32).to(a.device, non_blocking=True)
        grouped_contig_mm[(max(1, int(num_sms)),)](
            a, w, c, tab[0], tab[1], tab[2], len(te), N, K, a.stride(0), a.stride(1),
            w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1),
            BM=bm, BN=bn, BK=bk, num_warps=_warps(bm, bn),
        )  # fmt: skip
    return c


# ----------------------------------------------------------------------------------------------
# DeepGEMM's SM budget, scoped
# ----------------------------------------------------------------------------------------------


def deep_gemm_module():
    """The deep_gemm module when it imports (a module already in sys.modules counts), else None."""
    mod = sys.modules.get("deep_gemm")
    if mod is not None:
        return mod
    from overlap_lab.real.deps import available

    return importlib.import_module("deep_gemm") if available("deep_gemm") else None


@contextmanager
def deep_gemm_num_sms(sms: int | None, module=None):
    """``deep_gemm.set_num_sms(sms)`` for the body; the previous value is restored on exit (also
    on error, and when nested). Does nothing when ``sms`` is None or deep_gemm is absent."""
    dg = module if module is not None else (deep_gemm_module() if sms else None)
    if not sms or dg is None:
        yield None
        return
    prev = dg.get_num_sms()
    dg.set_num_sms(int(sms))
    try:
        yield dg
    finally:
        dg.set_num_sms(prev)


# ----------------------------------------------------------------------------------------------
# What the kernel registry uses
# ----------------------------------------------------------------------------------------------

MECHANISMS = ("none", "deep_gemm", "triton_persistent", "torch", "torch_unlimited")

#: The label a BF16 GEMM on every SM is counted under (``sm_budget_mechanisms``).
TORCH_BF16 = "torch (cuBLAS: bf16 on every SM)"


def choose_mechanism(
    sms: int | None, *, device_sms: int | None, cuda: bool, deep_gemm: bool, triton: bool
) -> str:
    """Which budget kernels a compute op's GEMMs may take (:class:`ComputeBudget` then runs
    BF16 on every SM through cuBLAS whatever this says): "deep_gemm" (set_num_sms scoped;
    DeepGEMM's kernels where this build has them, the Triton ones with the same budget
    otherwise), else "triton_persistent". Without either: "torch" (no limit asked) or
    "torch_unlimited" (a limit that cannot be honoured: recorded so the trace says so).
    "none": the CPU (plain torch, no SMs)."""
    if not cuda:
        return "none"
    if deep_gemm:
        return "deep_gemm"
    if triton:
        return "triton_persistent"
    limited = bool(sms) and (device_sms is None or sms < device_sms)
    return "torch_unlimited" if limited else "torch"


_DEVICE_SMS: dict[int, int] = {}


def device_sms(device: torch.device) -> int:
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _DEVICE_SMS:
        _DEVICE_SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _DEVICE_SMS[i]


class ComputeBudget:
    """``with ComputeBudget(op.sms, device) as g:`` then ``g.linear``, ``g.grouped_masked``,
    ``g.grouped_contiguous`` run the op's GEMMs: BF16 on every SM by cuBLAS, FP8 or an SM
    limit by the budget kernels (``g.limited``; ``g.mechanism`` says which family; ``g.sms``
    the grid: the limit, or every SM of the device when the op has none; the module's
    docstring says why). ``applied`` counts the kernels actually run, by label, into the run's ``log``
    (real.runlog.RunLog, one per run: a trace reports its own run). ``precision``: the run's
    (real.fp8.resolve); ``fp8_weights``: the FP8 weights quantised at load. A DeepGEMM call that fails (JIT compilation, an unsupported shape) falls back to
    the Triton kernel with the same budget and is counted under its own label, never as
    ``deep_gemm``."""

    def __init__(
        self,
        sms: int | None,
        device=None,
        *,
        mechanism: str | None = None,
        dtype: str = "bf16",
        log: RunLog | None = None,
        precision: fp8.Precision = fp8.BF16,
        fp8_weights: fp8.WeightCache | None = None,
    ):
        self.log = log if log is not None else RunLog()
        self.precision = precision
        self.fp8_weights = fp8_weights if fp8_weights is not None else fp8.WeightCache()
        self.requested = int(sms) if sms else None
        self.dtype = dtype  # the op's GEMM dtype (Op.dtype): FP8 where the run allows it
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self.device = dev
        cuda = dev.type == "cuda"
        dsms = device_sms(dev) if cuda else None
        self.device_sms = dsms
        if mechanism is None:
            mechanism = choose_mechanism(
                self.requested,
                device_sms=dsms,
                cuda=cuda,
                deep_gemm=cuda and deep_gemm_module() is not None,
                triton=cuda and _has_triton(),
            )
        self.mechanism = mechanism
        sms_eff = self.requested
        if dsms is not None and (sms_eff is None or sms_eff > dsms):
            sms_eff = dsms
        self.sms = sms_eff
        self._scope = None
        self._dg = None

    @property
    def applied(self) -> dict[str, int]:
        """The run's kernels so far, by label (this budget's and every other of the run)."""
        return self.log.gemms

    def note(self, label: str) -> None:
        self.log.count_gemm(label)

    def __enter__(self) -> ComputeBudget:
        global ENTERED
        ENTERED += 1
        if self.mechanism == "deep_gemm":
            self._scope = deep_gemm_num_sms(self.sms)
            self._dg = self._scope.__enter__()
        if self.mechanism in ("deep_gemm", "triton_persistent"):
            if not self.limited:  # the budget kernels' calls count themselves, each its own
                self.note(TORCH_BF16)
        elif self.mechanism != "none":
            self.note(self.mechanism)  # torch, torch_unlimited
        return self

    def __exit__(self, *exc):
        if self._scope is not None:
            self._scope.__exit__(*exc)
            self._scope = None
        return False

    @property
    def sm_limited(self) -> bool:
        """The op asks for fewer SMs than the device has (every SM of an unknown device)."""
        if self.requested is None:
            return False
        return self.device_sms is None or self.requested < self.device_sms

    @property
    def limited(self) -> bool:
        """True when the GEMMs run through the budget kernels (DeepGEMM or Triton persistent):
        FP8 GEMMs (DeepGEMM's), and BF16 ones under an SM limit; BF16 on every SM is cuBLAS."""
        if self.mechanism not in ("deep_gemm", "triton_persistent") or not self.sms:
            return False
        return self.sm_limited or self.fp8

    @property
    def mm(self):
        """``mm(a, w) = a @ w.T`` within the budget, or None (plain torch) when unlimited."""
        return self.linear if self.limited else None

    @property
    def fp8(self) -> bool:
        """This op's GEMMs run in FP8 through DeepGEMM (the op's dtype is fp8, the run resolved
        FP8 as runnable, and the budget holds deep_gemm)."""
        return self.dtype == "fp8" and self._dg is not None and self.precision.fp8

    def _fp8(self, name: str, fn, *args):
        """DeepGEMM's FP8 ``name`` through ``fn`` (real/fp8.py); None when it failed (JIT, an
        unsupported shape): reported, not retried, and the caller runs BF16."""
        if name in DEEP_GEMM_ERRORS:
            self.note(f"bf16 fallback (deep_gemm.{name} failed earlier)")
            return None
        try:
            out = fn(self._dg, *args, self.fp8_weights)
        except Exception as e:  # reported in the run's meta; this GEMM runs BF16
            self.note(f"bf16 fallback (deep_gemm.{name} failed: {type(e).__name__})")
            DEEP_GEMM_ERRORS.setdefault(name, f"{type(e).__name__}: {e}"[:300])
            return None
        self.note(f"deep_gemm.{name}")
        return out

    def _deep_gemm(self, name: str, *args) -> bool:
        """Call DeepGEMM's ``name`` when this build has it; False (and the reason counted) when
        it lacks it or the call fails, so the caller runs the Triton kernel instead."""
        fn = getattr(self._dg, name, None) if self._dg is not None else None
        if fn is None:
            self.note(f"triton_persistent (deep_gemm has no {name})")
            return False
        if name in DEEP_GEMM_ERRORS:  # failed once (JIT): not retried on every call
            self.note(f"triton_persistent (deep_gemm.{name} failed earlier)")
            return False
        try:
            fn(*args)
        except Exception as e:  # JIT compilation or an unsupported shape: reported, not fatal
            self.note(f"triton_persistent (deep_gemm.{name} failed: {type(e).__name__})")
            DEEP_GEMM_ERRORS.setdefault(name, f"{type(e).__name__}: {e}"[:300])
            return False
        self.note(f"deep_gemm.{name}")
        return True

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x @ w.T``."""
        if not self.limited:
            return x @ w.t()
        return self.budget_linear(x, w)

    def budget_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``x @ w.T`` by the budget kernels on ``self.sms`` SMs whatever the dtype: what an op
        with an SM limit runs (``overlap-lab kernels`` times it on every SM against cuBLAS)."""
        if self.fp8:
            x2 = x.reshape(-1, x.shape[-1])
            y = self._fp8("fp8_gemm_nt", fp8.linear, x2, w)
            if y is not None:
                return y.reshape(*x.shape[:-1], w.shape[0])
        if self._dg is not None and x.dtype == torch.bfloat16:
            x2 = x.reshape(-1, x.shape[-1]).contiguous()
            out = torch.empty(x2.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
            if self._deep_gemm("bf16_gemm_nt", x2, w, out):
                return out.reshape(*x.shape[:-1], w.shape[0])
        elif self._dg is not None:
            self.note("triton_persistent (under deep_gemm: not bf16)")
        else:
            self.note("triton_persistent")
        return matmul(x, w, num_sms=self.sms)

    def grouped_masked(
        self, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, expected_m: int | None = None
    ):
        """Per expert ``x[e] @ w[e].T`` over its ``counts[e]`` valid rows (low-latency layout).
        Rows past the count: zero on the torch path, unwritten on the limited paths.
        ``expected_m``: the expected valid rows per expert, DeepGEMM's tile heuristic (a host
        number from the workload, :func:`expected_rows`, never read from ``counts``); without
        it the padded row count is passed."""
        if not self.limited:
            x = fp8.dequant(x)
            y = torch.bmm(x, w.transpose(1, 2))
            valid = torch.arange(x.shape[1], device=x.device)[None, :] < counts[:, None]
            return torch.where(valid[..., None], y, torch.zeros((), dtype=y.dtype, device=y.device))
        return self.budget_grouped_masked(x, w, counts, expected_m)

    def budget_grouped_masked(
        self, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, expected_m: int | None = None
    ):
        """:meth:`grouped_masked` by the budget kernels whatever the dtype (rows past the count
        unwritten): what an op with an SM limit runs."""
        m = expected_m if expected_m else _rows(x)
        m = max(1, min(int(m), _rows(x)))
        if self.fp8:
            y = self._fp8("m_grouped_fp8_gemm_nt_masked", fp8.grouped_masked, x, w, counts, m)
            if y is not None:
                return y
        x = fp8.dequant(x)
        if self._dg is not None and x.dtype == torch.bfloat16:
            out = torch.empty(*x.shape[:2], w.shape[1], dtype=x.dtype, device=x.device)
            if self._deep_gemm("m_grouped_bf16_gemm_nt_masked", x, w, out, counts.int(), m):
                return out
        elif self._dg is not None:
            self.note("triton_persistent (under deep_gemm: not bf16)")
        else:
            self.note("triton_persistent")
        return grouped_matmul_masked(x, w, counts, num_sms=self.sms)

    def grouped_contiguous(self, x: torch.Tensor, w: torch.Tensor, counts: list[int]):
        """Rows of x sorted by expert (host counts) times their expert's ``w[e].T``."""
        if not self.limited:
            return None  # the caller's torch path (torch._grouped_mm or a loop)
        if self.fp8:
            y = self._fp8("m_grouped_fp8_gemm_nt_contiguous", fp8.grouped_contiguous, x, w, counts)
            if y is not None:
                return y
        x = fp8.dequant(x)
        self.note(
            "triton_persistent" + (" (under deep_gemm: contiguous layout)" if self._dg else "")
        )
        return grouped_matmul_contiguous(x, w, counts, num_sms=self.sms)


def _rows(x) -> int:
    """Padded rows per expert of a low-latency layout (a tensor or a quantised pair)."""
    return (x[0] if isinstance(x, tuple) else x).shape[1]


ENTERED = 0  # budgets entered since the process started (the executor diffs it per op)
DEEP_GEMM_ERRORS: dict[str, str] = {}  # first failure per DeepGEMM entry point (trace meta)


def expected_rows(tokens: int, topk: int, num_experts: int, world: int, max_rows: int) -> int:
    """Mean valid rows per local expert in DeepEP's low-latency layout: ``tokens`` per rank,
    ``world`` ranks sending, each token to ``topk`` of ``num_experts`` experts (what SGLang
    passes to DeepGEMM's masked GEMM as ``expected_m``), clamped to [1, max_rows]."""
    m = -(-tokens * topk * world // max(num_experts, 1))
    return max(1, min(m, max_rows))


def _has_triton() -> bool:
    from overlap_lab.real.deps import available

    return available("triton")
