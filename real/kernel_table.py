"""The executor's kernels against the device's best on the same shapes (``overlap-lab kernels``).

Why: a validation of the simulator against the executor says nothing about serving if the
executor's kernels are far from what a production engine runs (on an H200 the executor's prefill
attention once took a math path 45x slower than flash, its Triton GEMMs ran at a third of
cuBLAS). Each op class the executor runs gets one row per shape: the executor's own kernel (the
same call the executor makes: ``real.gemm.ComputeBudget`` on every SM, ``real.model``'s attention
and RMSNorm) against the device's best for that work:

- ``gemm``: ``torch.mm`` (cuBLAS);
- ``grouped_gemm`` (masked, DeepEP's low-latency layout, every row valid): ``torch.bmm``;
- ``attention`` prefill: SDPA with ``is_causal`` (the flash kernel on a GPU; V padded to q's head
  size, as flash takes one head size);
- ``attention`` decode (absorbed MLA over the KV cache): reading the cache once at the device's
  copy bandwidth (half a device-to-device copy of the cache's bytes): the memory-bound floor;
- ``elementwise`` (RMSNorm): a device-to-device copy of the same bytes (read + write).

The ratio is best / executor time (1.0: as fast as the best); the goal is at least
:data:`GOAL` for every class. ``--device cpu`` runs the same path (same cases, same calls, same
timing code) on tiny shapes: a dry run whose numbers mean nothing.
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
    ],
    "cpu": [
        {"case": "gemm decode", "cls": "gemm", "M": 8, "K": 64, "N": 32},
        {"case": "gemm prefill", "cls": "gemm", "M": 32, "K": 64, "N": 32},
        {"case": "grouped_gemm decode", "cls": "grouped_gemm", "E": 2, "M": 8, "K": 64, "N": 32},
        {"case": "grouped_gemm prefill", "cls": "grouped_gemm", "E": 2, "M": 16, "K": 64,
         "N": 32},
        {"case": "attention prefill", "cls": "attention", "H": 2, "T": 32, "D": 24, "DV": 16},
        {"case": "attention decode", "cls": "attention", "H": 2, "S": 2, "L": 32, "C": 32,
         "R": 8, "NOPE": 16, "V": 16},
        {"case": "elementwise rmsnorm", "cls": "elementwise", "M": 8, "K": 64},
    ],
}  # fmt: skip


@dataclass
class Case:
    """One comparison: the executor's call and the best call on the same inputs, the work one
    call does (FLOPs or bytes) and what each kernel is."""

    name: str
    op_class: str
    shape: dict[str, Any]
    executor: Callable[[], Any]
    best: Callable[[], Any]
    executor_kernel: str
    best_kernel: str
    work: float
    unit: str  # "TFLOP/s" or "GB/s"
    best_scale: float = 1.0  # best time = measured best call x this (the decode floor: 0.5)
    notes: list[str] = field(default_factory=list)


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _budget(device: torch.device):
    """The executor's GEMM budget for an op on every SM (what a schedule's full-SM op gets)."""
    from overlap_lab.real.gemm import ComputeBudget, device_sms

    sms = device_sms(device) if device.type == "cuda" else None
    return ComputeBudget(sms, device)


def build_cases(device: str | torch.device, seed: int = 0) -> list[Case]:
    """The cases of :data:`SHAPES` for ``device`` with their inputs made (seeded)."""
    from overlap_lab.real import model as M

    dev = torch.device(device)
    dt = _dtype(dev)
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dev, dt)

    out = []
    for s in SHAPES["cuda" if dev.type == "cuda" else "cpu"]:
        cls, name = s["cls"], s["case"]
        if cls == "gemm":
            a, w = rnd(s["M"], s["K"]), rnd(s["N"], s["K"], scale=s["K"] ** -0.5)
            b = _budget(dev)
            out.append(Case(name, cls, s, lambda a=a, w=w, b=b: b.linear(a, w),
                            lambda a=a, w=w: torch.mm(a, w.t()), b.mechanism,
                            "torch.mm (cuBLAS)", 2.0 * s["M"] * s["K"] * s["N"],
                            "TFLOP/s"))  # fmt: skip
        elif cls == "grouped_gemm":
            x, w = rnd(s["E"], s["M"], s["K"]), rnd(s["E"], s["N"], s["K"], scale=s["K"] ** -0.5)
            counts = torch.full((s["E"],), s["M"], dtype=torch.int32, device=dev)
            b = _budget(dev)
            out.append(Case(name, cls, s,
                            lambda x=x, w=w, c=counts, b=b, m=s["M"]: M.grouped_gemm_masked(
                                x, w, c, b, expected_m=m),
                            lambda x=x, w=w: torch.bmm(x, w.transpose(1, 2)), b.mechanism,
                            "torch.bmm (cuBLAS)", 2.0 * s["E"] * s["M"] * s["K"] * s["N"],
                            "TFLOP/s"))  # fmt: skip
        elif name == "attention prefill":
            # the executor's call as real.model.mla_attend_expanded makes it: [heads, T, d]
            # (3-D); the best: SDPA is_causal on [1, heads, T, d], the layout torch's fused
            # kernels (flash, memory-efficient) accept
            q, k = rnd(s["H"], s["T"], s["D"]), rnd(s["H"], s["T"], s["D"])
            v = rnd(s["H"], s["T"], s["DV"])
            vp = F.pad(v, (0, s["D"] - s["DV"]))[None]
            flops = 2.0 * s["H"] * s["T"] * s["T"] * (s["D"] + s["DV"]) / 2  # causal half
            out.append(Case(name, cls, s, lambda q=q, k=k, v=v: M.prefill_attention(q, k, v),
                            lambda q=q[None], k=k[None], vp=vp, dv=s["DV"]:
                                F.scaled_dot_product_attention(q, k, vp, is_causal=True)[..., :dv],
                            "real.model.prefill_attention ([heads, T, d], as the executor)",
                            "SDPA is_causal ([1, heads, T, d])", flops, "TFLOP/s"))  # fmt: skip
        elif name == "attention decode":
            cfg = M.RealModelConfig(
                name="kernel-table", num_layers=1, first_k_dense=0, hidden=s["C"], vocab=8,
                num_heads=s["H"], kv_lora_rank=s["C"], qk_nope_head_dim=s["NOPE"],
                qk_rope_head_dim=s["R"], v_head_dim=s["V"],
            )  # fmt: skip
            lw = {"kv_b": rnd(s["H"] * (s["NOPE"] + s["V"]), s["C"], scale=s["C"] ** -0.5)}
            S, L, H = s["S"], s["L"], s["H"]
            q_nope, q_pe = rnd(S, H, s["NOPE"]), rnd(S, H, s["R"])
            kv = rnd(S, L, s["C"] + s["R"])
            q_pos = torch.full((S, 1), L - 1, dtype=torch.long, device=dev)
            dst = torch.empty_like(kv)
            nbytes = kv.numel() * kv.element_size()
            out.append(Case(name, cls, s,
                            lambda a=(cfg, lw, q_nope, q_pe, kv, q_pos):
                                M.mla_attend_absorbed_batched(*a),
                            lambda kv=kv, dst=dst: dst.copy_(kv),
                            "real.model.mla_attend_absorbed_batched (SDPA; FlashMLA not covered)",
                            "read of the KV cache at d2d-copy bandwidth", float(nbytes), "GB/s",
                            best_scale=0.5))  # fmt: skip
        elif cls == "elementwise":
            x, wn = rnd(s["M"], s["K"]), rnd(s["K"])
            dst = torch.empty_like(x)
            nbytes = 2 * x.numel() * x.element_size()
            out.append(Case(name, cls, s, lambda x=x, wn=wn: M.rms_norm(x, wn),
                            lambda x=x, dst=dst: dst.copy_(x), "real.model.rms_norm",
                            "d2d copy of the same bytes", float(nbytes), "GB/s"))  # fmt: skip
    return out


def time_us(fn: Callable[[], Any], device: torch.device, *, warmup: int, repeats: int) -> float:
    """Median µs of one call: CUDA events around each call on a GPU, the host clock on the CPU
    (the same loop either way)."""
    for _ in range(warmup):
        fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    ts = []
    for _ in range(max(1, repeats)):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3)
        else:
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e6)
    return statistics.median(ts)


def _rate(work: float, us: float, unit: str) -> float:
    return work / us / (1e6 if unit == "TFLOP/s" else 1e3)


def kernel_table(device: str = "cuda", *, warmup: int = 3, repeats: int = 10) -> dict:
    """Every case timed: executor vs best, ratio, and whether the goal holds. ``device``:
    ``cuda`` (a GPU) or ``cpu`` (the dry run)."""
    dev = torch.device(device)
    rows = []
    for c in build_cases(dev):
        ex = time_us(c.executor, dev, warmup=warmup, repeats=repeats)
        best = time_us(c.best, dev, warmup=warmup, repeats=repeats) * c.best_scale
        ratio = best / ex if ex > 0 else math.inf
        rows.append({
            "case": c.name, "op_class": c.op_class, "shape": c.shape,
            "executor_kernel": c.executor_kernel, "best_kernel": c.best_kernel,
            "executor_us": ex, "best_us": best, "ratio": ratio, "unit": c.unit,
            "executor_rate": _rate(c.work, ex, c.unit), "best_rate": _rate(c.work, best, c.unit),
            "goal_met": ratio >= GOAL,
        })  # fmt: skip
    by_class: dict[str, float] = {}
    for r in rows:
        by_class[r["op_class"]] = min(by_class.get(r["op_class"], math.inf), r["ratio"])
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {
        "device": name, "device_type": dev.type, "torch": torch.__version__,
        "timing_meaningful": dev.type == "cuda", "goal": GOAL, "rows": rows,
        "worst_ratio_by_class": by_class,
        "goal_met": all(v >= GOAL for v in by_class.values()),
        "warmup": warmup, "repeats": repeats,
    }  # fmt: skip


def table_text(report: dict) -> str:
    """The markdown table, the goal line last."""
    lines = []
    if not report["timing_meaningful"]:
        lines.append("**DRY RUN on the CPU: tiny shapes, host timings; they mean nothing.**\n")
    lines.append(f"device {report['device']}, torch {report['torch']}, median of "
                 f"{report['repeats']} calls after {report['warmup']}\n")  # fmt: skip
    lines.append("| case | shape | executor kernel | µs | rate | best kernel | µs | rate | "
                 "ratio |")  # fmt: skip
    lines.append("|---|---|---|---:|---:|---|---:|---:|---:|")
    for r in report["rows"]:
        shape = " ".join(f"{k}={v}" for k, v in r["shape"].items() if k not in ("case", "cls"))
        lines.append(
            f"| {r['case']} | {shape} | {r['executor_kernel']} | {r['executor_us']:.1f} | "
            f"{r['executor_rate']:.1f} {r['unit']} | {r['best_kernel']} | {r['best_us']:.1f} | "
            f"{r['best_rate']:.1f} {r['unit']} | {r['ratio']:.2f}{'' if r['goal_met'] else ' !'} |"
        )
    worst = ", ".join(f"{c} {v:.2f}" for c, v in sorted(report["worst_ratio_by_class"].items()))
    lines.append("")
    dry = "" if report["timing_meaningful"] else " [CPU dry run: meaningless]"
    lines.append(f"GOAL {'MET' if report['goal_met'] else 'NOT MET'}: every op class at least "
                 f"{report['goal']:.1f} of the device's best (worst per class: {worst}){dry}")  # fmt: skip
    return "\n".join(lines) + "\n"
