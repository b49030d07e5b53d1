"""The executor's kernels against the device's best on the same shapes (``overlap-lab kernels``).

Why: a validation of the simulator against the executor says nothing about serving if the
executor's kernels are far from what a production engine runs (on an H200 the executor's prefill
attention once took a math path 45x slower than flash, its RMSNorm an eager fp32 chain at a
tenth of the copy bandwidth). Each op class the executor runs gets rows per shape: the executor's
own call (the same call the executor makes: ``real.gemm.ComputeBudget`` entered as a kernel
entry enters it, ``real.model``'s attention, ``real.norm``'s RMSNorm), labelled by what that
call counted into its run log, against the device's best for that work:

- ``gemm``: BF16 on every SM (cuBLAS, SGLang's rule) and the SM-limited path (DeepGEMM's BF16
  kernel, else Triton's persistent one, here on every SM) against ``torch.mm`` (cuBLAS); FP8
  (the activation quantisation and DeepGEMM's GEMM, as the executor calls them) against the
  fastest installed block-scaled FP8 GEMM on the same pre-quantised operands (DeepGEMM's own
  GEMM alone; ``torch._scaled_mm`` with 1x128 / 128x128 scales where this torch runs it);
- ``grouped_gemm`` (masked, DeepEP's low-latency layout, every row valid): the same three paths
  against ``torch.bmm`` (BF16) or DeepGEMM's masked FP8 GEMM alone (torch has no block-scaled
  grouped GEMM);
- ``attention`` prefill: SDPA with ``is_causal`` on 4-D inputs (the flash kernel on a GPU);
- ``attention`` decode (absorbed MLA, with its two absorption GEMMs): FlashMLA where it runs,
  the batched SDPA path as the fallback row (counted only where FlashMLA cannot run), against
  the best installed kernels for that work without the executor's glue: FlashMLA alone on
  prepared latent queries plus the two absorptions as cuBLAS bmm. The roofline is reported
  beside it (the larger of the op's bytes, KV cache, W_UK and W_UV, read at the copy bandwidth
  and its FLOPs at cuBLAS's dense BF16 rate, both measured), and is the best itself where no
  MLA decode kernel is installed. It is no target where FlashMLA runs: with 128 heads and one
  query per sequence, MLA decode does ~240 FLOP per cache byte, above an H200's ridge (~200),
  and attention never reaches a dense GEMM's rate (FlashMLA's own table on the H200,
  2026-11-26: 122 µs for 128 sequences of 2048 tokens, where reading their cache takes
  75.6 µs and their FLOPs at cuBLAS's rate ~95 µs);
- ``elementwise`` (RMSNorm, and RMSNorm fused with the residual add): a device-to-device copy
  of the same bytes (read + write).

On a GPU each call is timed inside a CUDA graph of :data:`CALLS` calls (what the executor's
steps replay: no launch gaps, no idle clock between calls), eager where capture fails (said in
the row). The ratio is best / executor time (1.0: as fast as the best); the goal is at least
:data:`GOAL` for every class, over the rows that are the executor's kernels (``counted``).
``--device cpu`` runs the same path (same cases, same calls, same timing code but host clocks)
on tiny shapes: a dry run whose numbers mean nothing; rows that need a GPU say why they are
skipped.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

GOAL = 0.7
CALLS = 10  # calls per captured graph (timed per replay / CALLS)

#: Shapes per case, GPU (DeepSeek-V3 on EP 32: 8 local experts, hidden 7168, 128 heads) and the
#: CPU dry run's tiny stand-ins. One list, so the dry run walks exactly the GPU's cases.
SHAPES: dict[str, list[dict[str, Any]]] = {
    "cuda": [
        {"case": "gemm decode", "cls": "gemm", "M": 128, "K": 7168, "N": 4096},
        {"case": "gemm prefill", "cls": "gemm", "M": 4096, "K": 7168, "N": 4096},
        {"case": "grouped_gemm decode", "cls": "grouped_gemm", "E": 8, "M": 128, "K": 7168,
         "N": 4096},
        {"case": "grouped_gemm prefill", "cls": "grouped_gemm", "E": 8, "M": 512, "K": 7168,
         "N": 4096},
        {"case": "attention prefill", "cls": "attention", "H": 128, "T": 4096, "D": 192,
         "DV": 128},
        {"case": "attention decode", "cls": "attention", "H": 128, "S": 128, "L": 2048,
         "C": 512, "R": 64, "NOPE": 128, "V": 128},
        {"case": "elementwise rmsnorm", "cls": "elementwise", "M": 4096, "K": 7168},
        {"case": "elementwise add+rmsnorm", "cls": "elementwise", "M": 4096, "K": 7168},
    ],
    "cpu": [
        {"case": "gemm decode", "cls": "gemm", "M": 8, "K": 128, "N": 32},
        {"case": "gemm prefill", "cls": "gemm", "M": 32, "K": 128, "N": 32},
        {"case": "grouped_gemm decode", "cls": "grouped_gemm", "E": 2, "M": 8, "K": 128, "N": 32},
        {"case": "grouped_gemm prefill", "cls": "grouped_gemm", "E": 2, "M": 16, "K": 128,
         "N": 32},
        {"case": "attention prefill", "cls": "attention", "H": 2, "T": 32, "D": 24, "DV": 16},
        {"case": "attention decode", "cls": "attention", "H": 2, "S": 2, "L": 64, "C": 32,
         "R": 8, "NOPE": 16, "V": 16},
        {"case": "elementwise rmsnorm", "cls": "elementwise", "M": 8, "K": 64},
        {"case": "elementwise add+rmsnorm", "cls": "elementwise", "M": 8, "K": 64},
    ],
}  # fmt: skip

#: The dense GEMM whose cuBLAS rate is the compute roofline (DeepSeek-V3's prefill shape).
ROOFLINE_GEMM = {"cuda": (4096, 7168, 4096), "cpu": (32, 128, 32)}


@dataclass
class Ref:
    """One reference call: its time x ``scale`` is a candidate for the best. ``same_work``: it
    computes what the executor's call computes (tests compare their outputs)."""

    label: str
    fn: Callable[[], Any]
    scale: float = 1.0
    same_work: bool = True


@dataclass
class Case:
    """One comparison: the executor's call and the references on the same inputs, the work one
    call does (FLOPs or bytes), how the references combine into the best ("min": the fastest
    installed alternative; "sum": installed kernels that each do a part of the work; "max": a
    roofline, the larger of its floors), ``floors`` (a roofline reported beside the best),
    whether the row is one of the executor's kernels (``counted``) or ``skipped`` (why)."""

    name: str
    op_class: str
    shape: dict[str, Any]
    executor: Callable[[], Any] | None
    refs: list[Ref]
    executor_kernel: str | Callable[[], str]
    work: float
    unit: str  # "TFLOP/s" or "GB/s"
    combine: str = "min"
    floors: list[Ref] = field(default_factory=list)  # a roofline, reported beside the best
    counted: bool = True
    skipped: str | None = None
    notes: list[str] = field(default_factory=list)

    def kernel_label(self) -> str:
        k = self.executor_kernel
        return k() if callable(k) else k


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _budget(device: torch.device, **kw):
    """The executor's GEMM budget for an op without an SM limit (every SM)."""
    from overlap_lab.real.gemm import ComputeBudget

    return ComputeBudget(None, device, **kw)


def _run_in(budget, method: str, *args, **kw):
    """``budget.method(*args)`` inside the budget, as a kernel entry enters it per op."""
    with budget as b:
        return getattr(b, method)(*args, **kw)


def _ran(budget, drop: str = "") -> Callable[[], str]:
    """The kernels a budget's calls counted (its run log; ``drop``: a label the row's own call
    never takes), read after the timing."""
    return lambda: ", ".join(sorted(k for k in budget.log.gemms if k != drop)) or "torch (the CPU)"


def _fp8_setup(dev: torch.device):
    """(deep_gemm module, the run's precision) when FP8 GEMMs run here, else (None, why)."""
    from overlap_lab.real import fp8
    from overlap_lab.real.gemm import deep_gemm_module

    dg = deep_gemm_module() if dev.type == "cuda" else None
    p = fp8.resolve("fp8", cuda=dev.type == "cuda", module=dg)
    if p.fp8:
        p = fp8.probe(p, dg, str(dev))
    return (dg, p) if p.fp8 else (None, p.reason)


def _gemm_cases(s, dev, rnd, fp8_ready) -> list[Case]:
    from overlap_lab.real import fp8
    from overlap_lab.real import model as M
    from overlap_lab.real.gemm import TORCH_BF16

    grouped = s["cls"] == "grouped_gemm"
    name, cls = s["case"], s["cls"]
    E = s.get("E", 1)
    M_, K, N = s["M"], s["K"], s["N"]
    flops = 2.0 * E * M_ * K * N
    if grouped:
        x, w = rnd(E, M_, K), rnd(E, N, K, scale=K**-0.5)
        counts = torch.full((E,), M_, dtype=torch.int32, device=dev)
        best = Ref("torch.bmm (cuBLAS)", lambda: torch.bmm(x, w.transpose(1, 2)))
    else:
        x, w = rnd(M_, K), rnd(N, K, scale=K**-0.5)
        best = Ref("torch.mm (cuBLAS)", lambda: torch.mm(x, w.t()))
    out = []
    b = _budget(dev)

    def ex():
        with b as g:  # the executor's calls (real.model, real/kernels/moe.py) in the op's budget
            if grouped:
                return M.grouped_gemm_masked(x, w, counts, g, expected_m=M_)
            return g.linear(x, w)

    out.append(Case(f"{name} bf16", cls, s, ex, [best], _ran(b), flops, "TFLOP/s"))
    lim = _budget(dev)
    # entered without a limit (every SM), the budget counts cuBLAS once; the row's calls take
    # the budget kernels, each counted under its own label
    limited = Case(f"{name} bf16, SM-limited path", cls, s, None, [best],
                   _ran(lim, drop=TORCH_BF16), flops, "TFLOP/s")  # fmt: skip
    if dev.type != "cuda" or lim.mechanism not in ("deep_gemm", "triton_persistent"):
        limited.skipped = f"no SM-budget kernels here (mechanism {lim.mechanism})"
    elif grouped:
        limited.executor = lambda: _run_in(lim, "budget_grouped_masked", x, w, counts, M_)
    else:
        limited.executor = lambda: _run_in(lim, "budget_linear", x, w)
    limited.notes.append("what an op with an SM limit runs, timed here on every SM")
    out.append(limited)
    dg, precision = fp8_ready
    row = Case(f"{name} fp8", cls, s, None, [], "", flops, "TFLOP/s")
    if dg is None:
        row.skipped = precision  # why FP8 does not run here
        return out + [row]
    cache = fp8.WeightCache().load([w])
    fb = _budget(dev, dtype="fp8", precision=precision, fp8_weights=cache)
    qa = fp8.activations(x)
    wq = cache.get(w)
    if grouped:
        row.executor = lambda: _run_in(fb, "grouped_masked", x, w, counts, M_)
        dq = torch.empty(E, M_, N, dtype=torch.bfloat16, device=dev)
        row.refs.append(Ref("deep_gemm.m_grouped_fp8_gemm_nt_masked alone (pre-quantised)",
                            lambda: (dg.m_grouped_fp8_gemm_nt_masked(qa, wq, dq, counts, M_), dq)[1]))  # fmt: skip
        row.notes.append("torch has no block-scaled grouped FP8 GEMM")
    else:
        row.executor = lambda: _run_in(fb, "linear", x, w)
        d = torch.empty(M_, N, dtype=torch.bfloat16, device=dev)
        row.refs.append(Ref("deep_gemm.fp8_gemm_nt alone (pre-quantised)",
                            lambda: (dg.fp8_gemm_nt(qa, wq, d), d)[1]))  # fmt: skip
        ref, note = _scaled_mm_ref(x, w, qa, wq)
        row.refs += [ref] if ref else []
        row.notes.append(note)
    row.executor_kernel = _ran(fb)
    return out + [row]


def _scaled_mm_ref(x, w, qa, wq) -> tuple[Ref | None, str]:
    """``torch._scaled_mm`` with DeepSeek's block scales (1x128 activations, 128x128 weights:
    cuBLASLt's block scaling on Hopper where this torch and CUDA have it), None and why where it
    does not run or does not match the BF16 GEMM. The layouts torch checks (PyTorch
    aten/src/ATen/native/cuda/ScaledBlas.cpp ``is_blockwise_1x128_scaling``,
    ``is_blockwise_128x128_scaling``): the activation scales (M, K/128) MN-major, which is
    DeepGEMM's layout (stride (1, M) where M is a multiple of 4); the weight's, checked on
    ``b.t()`` = w (N, K) as (N/128, K/128) row-major, which is ``quant_blocks``' own."""
    fn = getattr(torch, "_scaled_mm", None)
    if fn is None:
        return None, "torch has no _scaled_mm"
    a, sa = qa[0], qa[1]
    b, sb = wq[0].t(), wq[1]  # [K, N] column-major, scales [N/128, K/128] row-major
    want = (x.float() @ w.float().t()).to(torch.bfloat16)
    if sa.stride() != (1, sa.shape[0]):  # M not a multiple of 4: DeepGEMM pads, torch does not
        sa = sa.t().contiguous().t()
    sb = sb.t()

    def call():
        return fn(a, b, sa, sb, out_dtype=torch.bfloat16)

    try:
        rel = float((call().float() - want.float()).norm() / want.float().norm())
    except Exception as e:  # no block scaling in this torch / CUDA / device
        return (
            None,
            f"torch._scaled_mm with block scales does not run here: {type(e).__name__}: "
            f"{' '.join(str(e).split())[:120]}",
        )
    if rel >= 0.05:
        return None, f"torch._scaled_mm with block scales: relative error {rel:.3f}, not used"
    return Ref(
        "torch._scaled_mm (cuBLASLt, 1x128 / 128x128 scales)", call
    ), "torch._scaled_mm runs with block scales"


def _attention_cases(s, dev, rnd, roofline) -> list[Case]:
    """Prefill (one row) and decode (FlashMLA and the SDPA fallback); ``roofline``: (the dense
    GEMM's call, its µs per FLOP once timed = 1 / its FLOPs, its label)."""
    from overlap_lab.real import model as M

    if s["case"] == "attention prefill":
        # the executor's call as real.model.mla_attend_expanded makes it: [heads, T, d] (3-D)
        q, k = rnd(s["H"], s["T"], s["D"]), rnd(s["H"], s["T"], s["D"])
        v = rnd(s["H"], s["T"], s["DV"])
        vp = F.pad(v, (0, s["D"] - s["DV"]))[None]
        flops = 2.0 * s["H"] * s["T"] * s["T"] * (s["D"] + s["DV"]) / 2  # causal half
        best = Ref("SDPA is_causal ([1, heads, T, d])", lambda: F.scaled_dot_product_attention(
            q[None], k[None], vp, is_causal=True)[..., : s["DV"]])  # fmt: skip
        return [Case(s["case"], "attention", s, lambda: M.prefill_attention(q, k, v), [best],
                     "real.model.prefill_attention ([heads, T, d], as the executor)", flops,
                     "TFLOP/s")]  # fmt: skip
    from overlap_lab.real.kernels.attention import flash_mla_module

    S, L, H, C, R = s["S"], s["L"], s["H"], s["C"], s["R"]
    cfg = M.RealModelConfig(
        name="kernel-table", num_layers=1, first_k_dense=0, hidden=C, vocab=8, num_heads=H,
        kv_lora_rank=C, qk_nope_head_dim=s["NOPE"], qk_rope_head_dim=R, v_head_dim=s["V"],
    )  # fmt: skip
    lw = {"kv_b": rnd(H * (s["NOPE"] + s["V"]), C, scale=C**-0.5)}
    q_nope, q_pe = rnd(S, H, s["NOPE"]), rnd(S, H, R)
    kv = rnd(S, L, C + R)
    q_pos = torch.full((S, 1), L - 1, dtype=torch.long, device=dev)
    flops = 2.0 * S * H * L * (2 * C + R) + 2.0 * S * H * C * (s["NOPE"] + s["V"])
    nbytes = (kv.numel() + lw["kv_b"].numel()) * kv.element_size()
    src = torch.empty(nbytes // kv.element_size(), dtype=kv.dtype, device=dev)
    dst = torch.empty_like(src)
    floors = [
        Ref("bytes (KV cache, W_UK, W_UV) read at d2d-copy bandwidth", lambda: dst.copy_(src),
            0.5, same_work=False),
        Ref(f"FLOPs at cuBLAS's dense BF16 rate ({roofline[2]})", roofline[0],
            roofline[1] * flops, same_work=False),
    ]  # fmt: skip
    fm = flash_mla_module()
    why = M.flash_mla_unusable(cfg, kv, fm)
    # the best installed kernels for the op's work, without the executor's glue: FlashMLA on
    # prepared latent queries and the two absorptions as heads-major cuBLAS bmms; where
    # FlashMLA cannot run there is no installed MLA decode kernel to compare with, and the
    # best is the roofline itself
    refs, combine = floors, "max"
    flash = Case("attention decode flash_mla", "attention", s, None, [], "", flops, "TFLOP/s",
                 floors=floors)  # fmt: skip
    if why is None:
        table = torch.arange(S * (L // M.FLASH_MLA_PAGE), dtype=torch.int32, device=dev)
        table = table.view(S, -1)
        flash.executor = lambda: M.mla_attend_flash(cfg, lw, q_nope, q_pe, kv, q_pos, fm, table)
        flash.executor_kernel = f"real.model.mla_attend_flash: {M.flash_mla_api(fm).label}"
        w_uk, w_uv = M._kv_b_split(cfg, lw)
        q_lat = rnd(S, 1, H, C + R)
        qn_h, o_h = rnd(H, S, s["NOPE"]), rnd(H, S, C)
        refs, combine = [
            Ref(f"{M.flash_mla_api(fm).label} alone on prepared queries",
                lambda: M.flash_mla_latent(cfg, q_lat, kv, q_pos, fm, table), same_work=False),
            Ref("the absorptions as cuBLAS bmm [heads, T, *]",
                lambda: (torch.bmm(qn_h, w_uk), torch.bmm(o_h, w_uv.transpose(1, 2))),
                same_work=False),
        ], "sum"  # fmt: skip
    else:
        flash.skipped = why
    flash.refs, flash.combine = refs, combine
    sdpa = Case("attention decode sdpa (fallback)", "attention", s,
                lambda: M.mla_attend_absorbed_batched(cfg, lw, q_nope, q_pe, kv, q_pos), refs,
                "real.model.mla_attend_absorbed_batched (SDPA)", flops, "TFLOP/s",
                combine=combine, counted=why is not None, floors=floors)  # fmt: skip
    sdpa.notes.append("the executor's path where FlashMLA cannot run"
                      + ("" if why else "; not counted: FlashMLA runs here"))  # fmt: skip
    return [flash, sdpa]


def _elementwise_case(s, rnd) -> Case:
    from overlap_lab.real import norm

    x, wn = rnd(s["M"], s["K"]), rnd(s["K"])
    if s["case"] == "elementwise rmsnorm":
        src = x
        ex, label = (lambda: norm.rms_norm(x, wn)), "real.norm.rms_norm"
    else:  # reads x and the residual, writes the sum and the norm: a copy of twice the bytes
        r = rnd(s["M"], s["K"])
        src = torch.cat([x, r])
        ex, label = (lambda: norm.fused_add_rms_norm(x, r, wn)), "real.norm.fused_add_rms_norm"
    dst = torch.empty_like(src)
    nbytes = 2 * src.numel() * src.element_size()
    ref = Ref("d2d copy of the same bytes", lambda: dst.copy_(src), same_work=False)
    return Case(s["case"], "elementwise", s, ex, [ref], label, float(nbytes), "GB/s")


def build_cases(device: str | torch.device, seed: int = 0) -> list[Case]:
    """The cases of :data:`SHAPES` for ``device`` with their inputs made (seeded)."""
    dev = torch.device(device)
    dt = _dtype(dev)
    g = torch.Generator(device=dev).manual_seed(seed)  # on the device: 1.2 G numbers on a GPU

    def rnd(*shape, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dt)

    kind = "cuda" if dev.type == "cuda" else "cpu"
    m, k, n = ROOFLINE_GEMM[kind]
    a, w = rnd(m, k), rnd(n, k, scale=k**-0.5)
    roofline = (lambda: torch.mm(a, w.t()), 1.0 / (2.0 * m * k * n), f"torch.mm {m}x{k}x{n}")
    fp8_ready = _fp8_setup(dev)
    out: list[Case] = []
    for s in SHAPES[kind]:
        if s["cls"] in ("gemm", "grouped_gemm"):
            out += _gemm_cases(s, dev, rnd, fp8_ready)
        elif s["cls"] == "attention":
            out += _attention_cases(s, dev, rnd, roofline)
        else:
            out.append(_elementwise_case(s, rnd))
    return out


def time_us(fn: Callable[[], Any], device: torch.device, *, warmup: int, repeats: int):
    """(median µs of one call, how it was timed). On a GPU: :data:`CALLS` calls captured in
    one CUDA graph, each replay between CUDA events (per call: / CALLS), or back to back
    eagerly where capture fails; on the CPU the host clock around each call."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        ts = []
        for _ in range(max(1, repeats)):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e6)
        return statistics.median(ts), "host clock"
    torch.cuda.synchronize(device)
    graph, how = None, "cuda graph"
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS):
                fn()
    except Exception as e:  # a call that cannot be captured: timed eagerly, and said so
        graph, how = None, f"eager ({type(e).__name__} in capture)"
        torch.cuda.synchronize(device)

    def run():
        if graph is not None:
            graph.replay()
        else:
            for _ in range(CALLS):
                fn()

    run()
    ts = []
    for _ in range(max(1, repeats)):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / CALLS)
    return statistics.median(ts), how


def _rate(work: float, us: float, unit: str) -> float:
    return work / us / (1e6 if unit == "TFLOP/s" else 1e3)


def _best(
    c: Case, dev, warmup: int, repeats: int, refs=None, combine=None
) -> tuple[float, str, dict]:
    """The best time of ``c``'s references (the fastest, their sum, or a roofline's larger
    floor), its label, and every reference's time (or why it failed). ``refs`` / ``combine``:
    others than the case's (its floors)."""
    refs = c.refs if refs is None else refs
    combine = c.combine if combine is None else combine
    times: dict[str, float | str] = {}
    for r in refs:
        try:
            times[r.label] = time_us(r.fn, dev, warmup=warmup, repeats=repeats)[0] * r.scale
        except Exception as e:  # an installed alternative that fails is reported, not fatal
            times[r.label] = f"failed: {type(e).__name__}: {str(e)[:120]}"
    ok = {k: v for k, v in times.items() if isinstance(v, float)}
    if not ok or (combine == "sum" and len(ok) < len(times)):
        return math.nan, "no reference ran", times
    if combine == "sum":
        return sum(ok.values()), " + ".join(ok), times
    pick = (min if combine == "min" else max)(ok, key=ok.get)
    label = pick if combine == "min" else f"roofline, the larger floor: {pick}"
    return ok[pick], label, times


def kernel_table(device: str = "cuda", *, warmup: int = 3, repeats: int = 10, on_row=None) -> dict:
    """Every case timed: executor vs best, ratio, and whether the goal holds. ``device``:
    ``cuda`` (a GPU) or ``cpu`` (the dry run). ``on_row(report)``: called with the report so
    far (``complete`` False) after each row, so a run stopped at its time limit still leaves
    what it measured. A call that raises is a row with its error, the goal not met."""
    dev = torch.device(device)
    rows: list[dict] = []
    for c in build_cases(dev):
        rows.append(_row(c, dev, warmup, repeats))
        if on_row is not None:
            on_row(_report(dev, rows, warmup, repeats, complete=False))
    return _report(dev, rows, warmup, repeats, complete=True)


def _row(c: Case, dev, warmup: int, repeats: int) -> dict:
    row = {"case": c.name, "op_class": c.op_class, "shape": c.shape, "unit": c.unit,
           "counted": c.counted and c.skipped is None, "notes": list(c.notes)}  # fmt: skip
    if c.skipped is not None:
        return {**row, "skipped": c.skipped, "goal_met": None}
    try:
        ex, how = time_us(c.executor, dev, warmup=warmup, repeats=repeats)
    except Exception as e:  # the executor's own call failed: reported, the goal not met
        msg = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        return {**row, "error": msg, "ratio": 0.0, "goal_met": False}
    best, best_label, refs = _best(c, dev, warmup, repeats)
    if c.floors and c.floors is not c.refs:
        roof, _, floor_us = _best(c, dev, warmup, repeats, c.floors, "max")
        refs = {**refs, **floor_us}
        row["roofline_ratio"] = roof / ex if ex > 0 else math.inf
        row["notes"].append(f"roofline {roof:.1f} µs (ratio {roof / ex:.2f}): the larger of "
                            "the floors, a bound no kernel reaches")  # fmt: skip
    ratio = best / ex if ex > 0 else math.inf
    return {
        **row, "executor_kernel": c.kernel_label(), "best_kernel": best_label,
        "references_us": refs, "timing": how,
        "executor_us": ex, "best_us": best, "ratio": ratio,
        "executor_rate": _rate(c.work, ex, c.unit), "best_rate": _rate(c.work, best, c.unit),
        "goal_met": ratio >= GOAL,
    }  # fmt: skip


def _report(dev, rows: list[dict], warmup: int, repeats: int, *, complete: bool) -> dict:
    by_class: dict[str, float] = {}
    for r in rows:
        if r["counted"]:
            by_class[r["op_class"]] = min(by_class.get(r["op_class"], math.inf), r["ratio"])
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {
        "device": name, "device_type": dev.type, "torch": torch.__version__,
        "timing_meaningful": dev.type == "cuda", "goal": GOAL, "rows": list(rows),
        "worst_ratio_by_class": by_class, "complete": complete,
        "goal_met": complete and bool(by_class) and all(v >= GOAL for v in by_class.values()),
        "warmup": warmup, "repeats": repeats, "calls_per_graph": CALLS,
    }  # fmt: skip


def table_text(report: dict) -> str:
    """The markdown table, the notes under it, the goal line last."""
    lines = []
    if not report["timing_meaningful"]:
        lines.append("**DRY RUN on the CPU: tiny shapes, host timings; they mean nothing.**\n")
    lines.append(f"device {report['device']}, torch {report['torch']}, median of "
                 f"{report['repeats']} timings after {report['warmup']} calls (GPU: each a "
                 f"CUDA graph of {report.get('calls_per_graph', 1)} calls)\n")  # fmt: skip
    lines.append("| case | shape | executor kernel | µs | rate | best | µs | rate | ratio |")
    lines.append("|---|---|---|---:|---:|---|---:|---:|---:|")
    notes = []
    for r in report["rows"]:
        shape = " ".join(f"{k}={v}" for k, v in r["shape"].items() if k not in ("case", "cls"))
        if r.get("skipped"):
            lines.append(f"| {r['case']} | {shape} | skipped: {r['skipped']} | | | | | | |")
            continue
        if r.get("error"):
            lines.append(f"| {r['case']} | {shape} | failed: {r['error']} | | | | | | 0 ! |")
            continue
        mark = "" if r["goal_met"] else " !"
        mark += "" if r["counted"] else " (not counted)"
        lines.append(
            f"| {r['case']} | {shape} | {r['executor_kernel']} | {r['executor_us']:.1f} | "
            f"{r['executor_rate']:.1f} {r['unit']} | {r['best_kernel']} | {r['best_us']:.1f} | "
            f"{r['best_rate']:.1f} {r['unit']} | {r['ratio']:.2f}{mark} |"
        )
        refs = "; ".join(f"{k}: {v:.1f} µs" if isinstance(v, float) else f"{k}: {v}"
                         for k, v in r["references_us"].items())  # fmt: skip
        notes.append(f"- {r['case']}: timed {r['timing']}; references {refs}"
                     + "".join(f"; {n}" for n in r["notes"]))  # fmt: skip
    worst = ", ".join(f"{c} {v:.2f}" for c, v in sorted(report["worst_ratio_by_class"].items()))
    lines += ["", *notes, ""]
    dry = "" if report["timing_meaningful"] else " [CPU dry run: meaningless]"
    if not report.get("complete", True):
        dry += " [INCOMPLETE: stopped before every case ran]"
    lines.append(f"GOAL {'MET' if report['goal_met'] else 'NOT MET'}: every op class at least "
                 f"{report['goal']:.1f} of the device's best (worst per class: {worst}){dry}")  # fmt: skip
    return "\n".join(lines) + "\n"
