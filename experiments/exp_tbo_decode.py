"""TBO against serial decode: slower at small batches, faster at large ones.

SGLang's large-scale EP deployment of DeepSeek-V3 (H800-class nodes, DeepEP low-latency kernels,
DP attention) reports TBO at about -27 % throughput at 32 tokens per GPU, break-even around
64-128 and about +25 % at 256 (SGLang's TBO notes: "too small a batch can make TBO slower"). This sweeps
tokens per GPU on DeepSeek-V3 / H800 at EP 32 and EP 72's nearest divisor of 256 experts, EP 64
(the sizes SGLang ran: 4 and 9 decode nodes), simulates serial and TBO (and TBO+SBO for
reference), and reports the step time, the change in throughput ``serial / tbo - 1`` and where
the difference comes from (the exposed communication and the GPU time of the compute kernels).

Run: ``python -m overlap_lab.experiments.exp_tbo_decode`` (about 20 s on 2 cores).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from overlap_lab.experiments.runner import (
    Case,
    Experiment,
    kept_traces,
    main,
    md_table,
    middle_layer,
    speedup,
    stamp,
    standard_metrics,
)
from overlap_lab.figures import WIDTHS, compare_timelines, layer_clip, save_figure
from overlap_lab.shared.hardware import get_gpu
from overlap_lab.shared.workload import Batch, Parallel, Workload, get_model

NAME = "tbo_decode"
GPU = "h800"
SCHEDULES = ("serial", "tbo", "tbo+sbo")
TOKENS = (8, 16, 32, 64, 128, 256, 512)
EPS = (32, 64)
CONTEXT = 4096
SHOW = (32, 256)  # tokens per GPU whose MoE layer is drawn (EP 32)


def cases():
    model = get_model("deepseek-v3")
    for ep in EPS:
        for n in TOKENS:
            w = Workload(model, Batch.decode(n, kv_len=CONTEXT), Parallel(ep=ep))
            for name in SCHEDULES:
                shown = ep == EPS[0] and n in SHOW and name in ("serial", "tbo")
                yield Case(
                    {"ep": ep, "tokens_per_gpu": n},
                    name,
                    w,
                    GPU,
                    keep=f"{name} {n} tok/GPU" if shown else None,
                )


def measure(trace, program, case) -> dict:
    return {
        **standard_metrics(trace, program, case),
        "kernels": sum(1 for s in trace.spans if s.lane.startswith("stream:")),
        "micro_batches": program.meta.micro_batches,
        "fallback_reason": program.meta.fallback_reason,
    }


def clip(trace, case):
    return layer_clip(trace, middle_layer(case))


def derive(rows: list[dict]) -> list[dict]:
    return speedup(
        rows,
        over={"schedule": "serial"},
        by=("ep", "tokens_per_gpu"),
        column="throughput_change",
        change=True,
    )


def break_even(rows: list[dict], ep: int, name: str = "tbo") -> float | None:
    """Tokens per GPU where the throughput change crosses zero (log-linear interpolation)."""
    pts = sorted(
        (r["tokens_per_gpu"], r["throughput_change"])
        for r in rows
        if r["ep"] == ep and r["schedule"] == name
    )
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if y0 < 0 <= y1:
            f = -y0 / (y1 - y0)
            return math.exp(math.log(x0) + f * (math.log(x1) - math.log(x0)))
    return None


def figure(doc: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    rows = doc["rows"]
    fig = Figure(figsize=(WIDTHS["double"], 3.0), layout="constrained")
    ax, ax2 = fig.subplots(1, 2)
    for ep in sorted({r["ep"] for r in rows}):
        for name, style in (("tbo", "-o"), ("tbo+sbo", "--^")):
            pts = [r for r in rows if r["ep"] == ep and r["schedule"] == name]
            ax.plot(
                [r["tokens_per_gpu"] for r in pts],
                [100 * r["throughput_change"] for r in pts],
                style,
                label=f"{name}, EP{ep}",
            )
    ax.plot([32, 256], [-27, 25], "k*", ms=9, label="SGLang reported (-27 %, +25 %)")
    ax.axvspan(64, 128, color="grey", alpha=0.15, label="SGLang break-even 64-128")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode tokens per GPU (4K context)")
    ax.set_ylabel("throughput change vs serial (%)")
    ax.set_title(f"TBO decode, DeepSeek-V3 on {GPU}", fontsize=7.5, loc="left")
    ax.grid(alpha=0.3)
    ax.legend()
    ep = min(r["ep"] for r in rows)
    for name, style in (("serial", ":s"), ("tbo", "-o")):
        pts = [r for r in rows if r["ep"] == ep and r["schedule"] == name]
        xs = [r["tokens_per_gpu"] for r in pts]
        ax2.plot(xs, [r["step_time_us"] / 1e3 for r in pts], style, label=f"{name} step")
        ax2.plot(
            xs,
            [r["exposed_comm_us"] / 1e3 for r in pts],
            style,
            alpha=0.4,
            label=f"{name} exposed comm",
        )
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("decode tokens per GPU")
    ax2.set_ylabel("ms per step")
    ax2.set_title(f"EP{ep}: step time and exposed communication", fontsize=7.5, loc="left")
    ax2.grid(alpha=0.3)
    ax2.legend()
    save_figure(fig, path)
    compare_timelines(
        kept_traces(doc),
        path.with_name(f"{NAME}_timeline.png"),
        window="step",
        title=f"One MoE layer (the middle one) of DeepSeek-V3 decode on {GPU.upper()}, EP{min(r['ep'] for r in rows)}, 4K context",
    )


def notes(doc: dict) -> str:
    rows = doc["rows"]
    ep = min(r["ep"] for r in rows)
    eps = sorted({r["ep"] for r in rows})
    header = ["tokens/GPU"] + [
        h for e in eps for h in (f"serial EP{e} (ms)", f"TBO EP{e}", f"TBO+SBO EP{e}")
    ]
    tab = []
    for n in sorted({r["tokens_per_gpu"] for r in rows}):
        cells = [n]
        for e in eps:
            by = {r["schedule"]: r for r in rows if r["ep"] == e and r["tokens_per_gpu"] == n}
            cells += [
                f"{by['serial']['step_time_us'] / 1e3:.1f}",
                f"{100 * by['tbo']['throughput_change']:+.0f} %",
                f"{100 * by['tbo+sbo']['throughput_change']:+.0f} %",
            ]
        tab.append(cells)
    be = {e: break_even(rows, e) for e in eps}
    small = {r["schedule"]: r for r in rows if r["ep"] == ep and r["tokens_per_gpu"] == 32}
    big = {r["schedule"]: r for r in rows if r["ep"] == ep and r["tokens_per_gpu"] == 256}
    return f"""# TBO decode: throughput against serial

{stamp(doc)}  ·  DeepSeek-V3, {GPU}, 4K context,
DeepEP low-latency kernels, CUDA graph (both micro-batches in one graph), DeepSeek decode strategy
(6 stages, delta 2). Throughput change = serial step / TBO step - 1.

{md_table(header, tab)}

Break-even (throughput change crosses 0): {", ".join(f"EP{e}: {v:.0f} tokens/GPU" if v else f"EP{e}: none in range" for e, v in be.items())}.

## What the model shows
- TBO loses at small batches and wins at large ones, as SGLang reports (-27 % at 32, break-even
  64-128, +25 % at 256). At 32 tokens/GPU (EP{ep}) the model gives
  {100 * small["tbo"]["throughput_change"]:+.0f} %, at 256 {100 * big["tbo"]["throughput_change"]:+.0f} %.
- Why it loses when small: every sparse layer issues each kernel twice on half the tokens, and the
  small kernels sit at the per-kernel floor (`kernel_min_us`) or are weight-bound (the expert and
  projection GEMMs read the same weights for each half), so the GPU time of the compute kernels
  grows ({small["serial"]["compute_kernel_us"] / 1e3:.1f} -> {small["tbo"]["compute_kernel_us"] / 1e3:.1f} ms
  at 32 tokens) while there is little communication to hide (exposed comm
  {small["serial"]["exposed_comm_us"] / 1e3:.1f} -> {small["tbo"]["exposed_comm_us"] / 1e3:.1f} ms).
- Why it wins when large: the dispatch/combine transfers (RDMA-bound at EP{ep}) grow with the tokens
  and TBO hides one micro-batch's transfer under the other's attention and experts
  (exposed comm {big["serial"]["exposed_comm_us"] / 1e3:.1f} -> {big["tbo"]["exposed_comm_us"] / 1e3:.1f} ms at 256),
  while the compute kernels are large enough that halving them costs little
  ({big["serial"]["compute_kernel_us"] / 1e3:.1f} -> {big["tbo"]["compute_kernel_us"] / 1e3:.1f} ms).
- TBO+SBO is below TBO here. SBO's combine is one kernel resident on {get_gpu(GPU).sbo_comm_sms}
  SMs from the down GEMM's start event on (docs/sm-sharing.md). While it holds them, the other
  micro-batch's decode attention is launched. That attention is a FlashMLA-style persistent grid
  with a static split over every SM, so the CTAs it cannot place start only when the combine ends,
  and the attention ends late. The combine hidden behind the down GEMM gains less than that
  costs. This depends on the static split of decode attention (`sim.cost.PERSISTENT_CLASSES`);
  `sm_sharing.md`, part 3, shows the per-layer attention time.
- What changed (issue 8): TBO+SBO's deficit shrank (e.g. +3 % -> +9 % at 128 tokens/GPU, EP32).
  SBO's combine used to be four chunk kernels, each asking for SMs again. It is now one resident
  kernel that polls the down GEMM's 64-row-block signals, and ties go by stream priority and
  launch order rather than by event order.

## Where it disagrees with the published numbers, and why
- The magnitudes depend on the cost model's per-kernel floor and launch costs and on the
  RDMA bandwidth figure (DeepEP's measured ~46 GB/s); none were tuned for this experiment.
- The model's routing is balanced and has no straggler: real decode steps wait for the slowest
  rank in each all-to-all, which penalises serial (whose waits are exposed) more than TBO, so the
  measured gain at large batches can exceed the model's.
- SGLang measured whole-server throughput (with the CPU-GPU overlap scheduler and MTP off/on); the
  model compares one decode step of one rank.
- Figure `{NAME}_timeline.png`: one MoE layer of serial and TBO at {SHOW[0]} and {SHOW[1]} tokens/GPU.
"""


EXPERIMENT = Experiment(
    name=NAME,
    title="TBO against serial decode, DeepSeek-V3 EP32/EP64 on H800",
    cases=cases,
    measure=measure,
    derive=derive,
    clip=clip,
    figure=figure,
    notes=notes,
    meta={"gpu": GPU, "context": CONTEXT},
)

if __name__ == "__main__":
    raise SystemExit(
        main(sys.argv[1:], prog=f"python -m overlap_lab.experiments.exp_{NAME}", default=[NAME])
    )
