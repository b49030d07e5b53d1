"""LightLLM's order against DeepSeek's: when does the GPU sit with only communication running?

LightLLM (docs/schedules.md) moved the MoE block one slot later in decode and runs attention and
shared experts of one micro-batch back to back, where DeepSeek's figure pairs one micro-batch's
computation with the other's communication; LightLLM's design notes suspect that "in some cases the GPU
has only communication and no computation". This sweeps batch sizes on an H800 with DeepSeek-V3 at
the EP sizes of DeepSeek's published profiles (deepseek-ai/profile-data: prefill EP32 with 4K
prompts, decode EP128 with 4K contexts) and reports, per schedule, the step time, the GPU time with
only communication running (``Trace.comm_only_us``) and the exposed communication, plus where in a
layer the comm-only time falls. Serial is the reference. Figure: the curves and one MoE layer of
each schedule's timeline, stacked (decode at 128 requests, prefill at 16K tokens per GPU).

Run: ``python -m overlap_lab.experiments.exp_lightllm_vs_deepseek`` (about 20 s on 2 cores).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

from overlap_lab.experiments.runner import (
    Case,
    Experiment,
    kept_traces,
    main,
    middle_layer,
    speedup,
)
from overlap_lab.figures import (
    WIDTHS,
    add_legend,
    clip,
    fmt_time,
    layer_window,
    save_figure,
    series_style,
    timeline,
)
from overlap_lab.shared.trace import Trace, intersect, length, union
from overlap_lab.shared.workload import Batch, Parallel, Workload, get_model

NAME = "lightllm_vs_deepseek"
GPU = "h800"
SCHEDULES = ("serial", "lightllm", "deepseek")
DECODE_BATCHES = (16, 32, 64, 128, 192, 256)  # requests per GPU, 4K context (profile: 128)
PREFILL_PROMPTS = (1, 2, 3, 4, 6, 8)  # 4K prompts per GPU (profile: 4 = 16K tokens)
DECODE_EP, PREFILL_EP = 128, 32
CONTEXT = 4096
SHOW_DECODE, SHOW_PREFILL = 128, 4  # the timelines drawn


def workload(mode: str, size: int) -> Workload:
    model = get_model("deepseek-v3")
    if mode == "decode":
        return Workload(model, Batch.decode(size, kv_len=CONTEXT), Parallel(ep=DECODE_EP))
    return Workload(model, Batch.prefill(size, extend_len=CONTEXT), Parallel(ep=PREFILL_EP))


def cases():
    sweep = [("decode", n) for n in DECODE_BATCHES] + [("prefill", n) for n in PREFILL_PROMPTS]
    for mode, size in sweep:
        w = workload(mode, size)
        shown = (mode, size) in (("decode", SHOW_DECODE), ("prefill", SHOW_PREFILL))
        for name in SCHEDULES:
            params = {"mode": mode, "requests": size, "tokens": w.batch.num_tokens}
            yield Case(params, name, w, GPU, keep=f"{mode} {name}" if shown else None)


def window(trace: Trace, case: Case) -> tuple[float, float]:
    """One steady-state period: micro-batch 0's first attention kernel of the middle layer to
    that of the next (both schedules, like serial, start a layer there)."""
    return layer_window(trace, middle_layer(case), op="comm_prepare_attn")


def comm_only_in(trace: Trace, t0: float, t1: float) -> tuple[float, dict[str, float]]:
    """Comm-only time inside [t0, t1) and who it belongs to: the communication kernel running
    (e.g. a receive hook spinning), else the transfer in flight with nothing running at all."""
    clip = [(t0, t1)]
    comm = intersect(
        union((s.start, s.end) for s in trace.spans if s.kind in ("comm", "link")), clip
    )
    busy = union((s.start, s.end) for s in trace.spans if s.kind in ("compute", "copy"))
    only, cur = [], t0
    for a, b in busy + [(t1, t1)]:
        if a > cur:
            only += intersect(comm, [(cur, a)])
        cur = max(cur, b)
    who: dict[str, float] = defaultdict(float)
    for a, b in only:
        kernels = [s for s in trace.spans if s.kind == "comm" and s.start < b and s.end > a]
        links = [s for s in trace.spans if s.kind == "link" and s.start < b and s.end > a]
        pick = kernels or links
        label = (
            " + ".join(sorted({f"{s.op} mb{s.mb} L{s.layer}" for s in pick})) if pick else "other"
        )
        who[("running: " if kernels else "in flight: ") + label] += b - a
    return length(only), dict(sorted(who.items(), key=lambda kv: -kv[1]))


def measure(trace, program, case) -> dict:
    t0, t1 = window(trace, case)
    layer_only, who = comm_only_in(trace, t0, t1)
    return {
        "ep": case.workload.parallel.ep,
        "step_time_us": trace.step_time_us,
        "comm_only_us": trace.comm_only_us(),
        "exposed_comm_us": trace.exposed_comm_us(),
        "layer": middle_layer(case),
        "layer_time_us": t1 - t0,
        "layer_comm_only_us": layer_only,
        "layer_comm_only_by": {k: round(v, 3) for k, v in who.items()},
        "micro_batches": program.meta.micro_batches,
        "comm_sms": program.meta.comm_sms,
    }


def cut(trace: Trace, case: Case) -> Trace:
    return clip(trace, *window(trace, case))


def derive(rows: list[dict]) -> list[dict]:
    return speedup(
        rows, over={"schedule": "serial"}, by=("mode", "requests"), column="speedup_over_serial"
    )


def figure(doc: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    traces = kept_traces(doc)
    shown = {tuple(k.split(" ", 1)): tr for k, tr in traces.items()}
    names = [n for n in SCHEDULES if n != "serial"]
    tl = [(m, n) for m in ("decode", "prefill") for n in names if (m, n) in shown]
    tracks = [max(len(shown[k].tracks(0)), 1) for k in tl]
    fig = Figure(
        figsize=(WIDTHS["double"], 2.6 + 0.22 * sum(tracks) + 0.45 * len(tl)), layout="constrained"
    )
    gs = fig.add_gridspec(1 + len(tl), 2, height_ratios=[9] + tracks)
    rows = doc["rows"]
    for col, mode in enumerate(("decode", "prefill")):
        ax = fig.add_subplot(gs[0, col])
        for k, name in enumerate(("serial", "lightllm", "deepseek")):
            pts = [r for r in rows if r["schedule"] == name and r["mode"] == mode]
            xs = [r["requests"] if mode == "decode" else r["tokens"] / 1024 for r in pts]
            ax.plot(
                xs,
                [r["comm_only_us"] / 1e3 for r in pts],
                label=f"{name} comm-only",
                **series_style(k),
            )
        for name in names:
            pts = [r for r in rows if r["schedule"] == name and r["mode"] == mode]
            xs = [r["requests"] if mode == "decode" else r["tokens"] / 1024 for r in pts]
            ax.plot(
                xs,
                [r["step_time_us"] / 1e3 for r in pts],
                "--",
                alpha=0.5,
                label=f"{name} step time",
            )
        ep = DECODE_EP if mode == "decode" else PREFILL_EP
        ax.set_title(f"{mode}, DeepSeek-V3 EP{ep} on {GPU.upper()}", fontsize=7.5, loc="left")
        ax.set_xlabel(
            "requests per GPU (4K context)" if mode == "decode" else "K tokens per GPU", fontsize=7
        )
        ax.set_ylabel("ms per step", fontsize=7)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    width = {m: max(shown[(m, n)].step_time_us for n in names if (m, n) in shown) for m, _ in tl}
    seen: set = set()
    for i, key in enumerate(tl):
        ax = fig.add_subplot(gs[1 + i, :])
        tr = shown[key]
        mode, name = key
        size = SHOW_DECODE if mode == "decode" else SHOW_PREFILL * CONTEXT
        unit = "requests" if mode == "decode" else "tokens"
        only, _ = comm_only_in(tr, 0.0, tr.step_time_us)
        title = (
            f"{name} {mode} ({size} {unit}/GPU), layer {rows[0]['layer']}: "
            f"{fmt_time(tr.step_time_us)}, comm-only {fmt_time(only)}"
        )
        timeline(tr, ax, title=title, window=(0.0, width[mode]), legend=False, seen=seen)
    add_legend(fig, seen)
    save_figure(fig, path)


EXPERIMENT = Experiment(
    name=NAME,
    title="LightLLM's order against DeepSeek's: comm-only GPU time, DeepSeek-V3 on H800",
    cases=cases,
    measure=measure,
    derive=derive,
    clip=cut,
    figure=figure,
    # no notes function: the .md is hand-written from the JSON
    meta={
        "gpu": GPU,
        "model": "deepseek-v3",
        "decode_ep": DECODE_EP,
        "prefill_ep": PREFILL_EP,
        "context": CONTEXT,
    },
)

if __name__ == "__main__":
    raise SystemExit(
        main(sys.argv[1:], prog=f"python -m overlap_lab.experiments.exp_{NAME}", default=[NAME])
    )
