"""SBO's gain for each mode and how it depends on the communication SMs.

DeepSeek-V3 decode (DeepEP low-latency kernels, EP 32, 4K context) at 32 and 128 tokens per GPU on
H800 (preset: 3 comm SMs) and B200 (preset: 32), sweeping SGLANG_DEEPEP_LL_COMBINE_SEND_NUM_SMS
from 1 to 32 for SBO modes 1, 2 and 3 (mode 1 carries the shared-experts placement
SGLang pairs with it on each architecture: dispatch hook on Hopper, after the down GEMM on
Blackwell; see shared/schedules/sbo.py). The gain is ``serial / sbo - 1``.

Run: ``python -m overlap_lab.experiments.exp_sbo_comm_sms`` (about 40 s on 2 cores).
"""

from __future__ import annotations

import sys
from pathlib import Path

from overlap_lab.experiments.figures import WIDTHS, save_figure, series_style
from overlap_lab.experiments.runner import (
    Case,
    Experiment,
    main,
    md_table,
    middle_layer,
    speedup,
    stamp,
)
from overlap_lab.shared.hardware import get_gpu
from overlap_lab.shared.schedules import ScheduleConfig
from overlap_lab.shared.workload import Batch, Parallel, Workload, get_model

NAME = "sbo_comm_sms"
GPUS = ("h800", "b200")
TOKENS = (32, 128)
COMM_SMS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
MODES = (1, 2, 3)
EP = 32


def cases():
    model = get_model("deepseek-v3")
    for g in GPUS:
        for n in TOKENS:
            w = Workload(model, Batch.decode(n), Parallel(ep=EP))
            at = {"gpu": g, "tokens_per_gpu": n}
            yield Case({**at, "mode": None, "comm_sms": None}, "serial", w, g)
            for mode in MODES:
                for c in COMM_SMS:
                    cfg = ScheduleConfig(sbo_mode=mode, comm_sms=c)
                    yield Case({**at, "mode": mode, "comm_sms": c}, "sbo", w, g, cfg)


def measure(trace, program, case) -> dict:
    layer = middle_layer(case)
    comb = [
        s
        for s in trace.spans
        if s.layer == layer and s.lane == "stream:alt" and s.op.startswith("combine_a")
    ]
    return {
        "preset_comm_sms": get_gpu(case.gpu).sbo_comm_sms,
        "upstream": program.meta.get("sbo_upstream"),
        "overlaps": program.meta.get("sbo_overlaps"),
        "step_time_us": trace.step_time_us,
        "exposed_comm_us": trace.exposed_comm_us(),
        "combine_send_us_layer": sum(s.end - s.start for s in comb),
    }


def derive(rows: list[dict]) -> list[dict]:
    """The gain ``serial / sbo - 1`` of each SBO row; the serial rows themselves are dropped."""
    speedup(
        rows,
        over={"schedule": "serial"},
        by=("gpu", "tokens_per_gpu"),
        column="gain",
        change=True,
        base_column="serial_step_us",
    )
    return [r for r in rows if r["schedule"] == "sbo"]


MODE_COLORS = (
    "#0072B2",
    "#D55E00",
    "#009E73",
)  # Okabe-Ito: readable in print and by the colour-blind


def figure(doc: dict, path: Path) -> None:
    from matplotlib.figure import Figure
    from matplotlib.ticker import ScalarFormatter

    rows = doc["rows"]
    gpus = sorted({r["gpu"] for r in rows}, key=GPUS.index)
    tokens = sorted({r["tokens_per_gpu"] for r in rows})
    fig = Figure(figsize=(WIDTHS["double"], 2.3 * len(tokens) + 0.5), layout="constrained")
    axes = fig.subplots(len(tokens), len(gpus), squeeze=False)
    for i, n in enumerate(tokens):
        for j, g in enumerate(gpus):
            ax = axes[i][j]
            for k, mode in enumerate(MODES):
                pts = [
                    r
                    for r in rows
                    if r["gpu"] == g and r["tokens_per_gpu"] == n and r["mode"] == mode
                ]
                up = " (what-if)" if pts and not pts[0]["upstream"] else ""
                # modes 2 and 3 coincide where the RDMA transfer bounds both: distinct line
                # styles, hollow markers of different sizes and a drawing order that keeps both
                ax.plot(
                    [r["comm_sms"] for r in pts],
                    [100 * r["gain"] for r in pts],
                    label=f"mode {mode}{up}",
                    color=MODE_COLORS[k],
                    zorder=3 + len(MODES) - k,
                    **series_style(k),
                )
            preset = pts[0]["preset_comm_sms"]
            ax.axvline(preset, color="grey", ls=":", lw=0.8, label=f"preset ({preset} SMs)")
            ax.axhline(0, color="k", lw=0.6)
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.set_xticks([1, 2, 4, 8, 16, 32])
            if i == len(tokens) - 1:
                ax.set_xlabel("combine communication SMs (--comm-sms)", fontsize=7)
            if j == 0:
                ax.set_ylabel("gain vs serial (%)", fontsize=7)
            ax.tick_params(labelsize=7)
            ax.set_title(
                f"DeepSeek-V3 EP{EP} decode, {n} tok/GPU, {g.upper()}", fontsize=7.5, loc="left"
            )
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6, loc="best", handlelength=2.6)
    save_figure(fig, path)


def notes(doc: dict) -> str:
    rows = doc["rows"]

    def get(g, n, mode, c):
        return next(
            r
            for r in rows
            if (r["gpu"], r["tokens_per_gpu"], r["mode"], r["comm_sms"]) == (g, n, mode, c)
        )

    header = [
        "GPU",
        "tokens/GPU",
        "mode",
        "gain at preset SMs",
        "best gain (SMs)",
        "gain at 1 SM",
        "gain at 32 SMs",
    ]
    lines = []
    for g in sorted({r["gpu"] for r in rows}, key=GPUS.index):
        preset = next(r["preset_comm_sms"] for r in rows if r["gpu"] == g)
        for n in sorted({r["tokens_per_gpu"] for r in rows}):
            for mode in MODES:
                pts = [
                    r for r in rows if (r["gpu"], r["tokens_per_gpu"], r["mode"]) == (g, n, mode)
                ]
                best = max(pts, key=lambda r: r["gain"])
                at = {r["comm_sms"]: r["gain"] for r in pts}
                flag = "" if pts[0]["upstream"] else " (what-if)"
                lines.append(
                    [
                        g,
                        n,
                        f"{mode}{flag}",
                        f"{100 * at[preset]:+.1f} %",
                        f"{100 * best['gain']:+.1f} % ({best['comm_sms']})",
                        f"{100 * at[min(at)]:+.1f} %",
                        f"{100 * at[max(at)]:+.1f} %",
                    ]
                )
    h1 = get("h800", 128, 1, 3) if any(r["gpu"] == "h800" for r in rows) else None
    h1s1 = get("h800", 128, 1, 1) if any(r["gpu"] == "h800" for r in rows) else None
    return f"""# SBO: gain per mode and its dependence on the communication SMs

{stamp(doc)}  ·  DeepSeek-V3 decode, EP{EP}, 4K context,
DeepEP low-latency kernels, CUDA graph. Gain = serial step / SBO step - 1.

{md_table(header, lines)}

## What the model shows
- SBO's gains are a few percent to ~13 %: mode 3 hides the shared experts under the dispatch
  transfer; mode 1 additionally starts the combine's transfer while the down GEMM is still running
  (its first block leaves once the GEMM signals it instead of after all of it, plus the send
  kernel's own time), which matters most at small batches where the per-layer chain is short.
  Mode 2 on its own only hides the shared experts under the combine.
- Mode 3 does not depend on the comm SMs: nothing runs on the alt stream.
- Modes 1 and 2 depend on the comm SMs only below a few SMs: with DeepEP's low-latency combine the
  RDMA transfer, not the send kernel, bounds the combine, so once the send kernel is faster than
  the transfer (about 3 SMs on H800, 1 on B200 in this model) more SMs change nothing, and the SMs
  they take from the down GEMM are hidden behind the same transfer. With 1 SM on H800 the send
  kernel itself becomes the bottleneck and SBO loses{f" ({100 * h1s1['gain']:+.1f} % at 128 tokens/GPU)" if h1s1 else ""}.
  {f"On H800 at 128 tokens, mode 1 with the preset's 3 SMs gains {100 * h1['gain']:+.1f} %; its one resident send kernel takes {h1['combine_send_us_layer']:.0f} µs per layer in all." if h1 else ""}
- So the model supports Hopper's small preset (3 SMs): it is about the fewest SMs at which the
  send keeps up with the link. Blackwell's 32 are more than the model needs at EP 32 over RDMA;
  they would matter where the combine is NVLink-bound (a single NVL72 domain), not modelled here.

## Where it may disagree with published figures, and why
- SGLang reports SBO's gain on full servers; the model's send kernel speed on few SMs comes from
  the cost model's HBM cap per SM fraction, not from a measurement of DeepEP's combine on 3 SMs.
- The combine is one kernel resident on its SMs that polls every Hopper signal
  (num_local_experts x ceil(rows/64)) or Blackwell signal (one per local expert). Part i of its
  work and traffic waits for signal i, and no chunking constant is involved (issue 8). Before, the
  signals were grouped into 4 chunk kernels, and the gains were about 1 point lower (e.g. +6.0 %
  -> +7.1 % at 128 tokens on H800).
"""


EXPERIMENT = Experiment(
    name=NAME,
    title="SBO gain per mode against the combine's communication SMs, H800 and B200",
    cases=cases,
    measure=measure,
    derive=derive,
    figure=figure,
    notes=notes,
    meta={"ep": EP},
)

if __name__ == "__main__":
    raise SystemExit(
        main(sys.argv[1:], prog=f"python -m overlap_lab.experiments.exp_{NAME}", default=[NAME])
    )
