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

How sure: LightLLM's and DeepSeek's cases are re-run with the inputs of
``overlap_lab.sensitivity.EXPERIMENT_DESIGN`` at both ends of their ranges (only costs vary), and
the notes give the share of those points at which DeepSeek's order is ahead. The notes are
generated from the results file, every number included.

Run: ``python -m overlap_lab.experiments.exp_lightllm_vs_deepseek`` (about a minute on 2 cores).
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
    md_table,
    middle_layer,
    speedup,
    stamp,
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
from overlap_lab.sensitivity import (
    EXPERIMENT_DESIGN,
    design_meta,
    design_sentence,
    paired,
    step_times,
)
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model
from overlap_lab.shared.outputs.trace import Trace, intersect, length, union

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
        # the same Program under each perturbation of EXPERIMENT_DESIGN (only costs vary)
        **(
            {"step_time_points_us": list(step_times(program, case.gpu))}
            if case.schedule != "serial"
            else {}
        ),
    }


def cut(trace: Trace, case: Case) -> Trace:
    return clip(trace, *window(trace, case))


def derive(rows: list[dict]) -> list[dict]:
    """Speed-up over serial; on LightLLM's rows, its comm-only time and step over DeepSeek's and
    the share of the perturbations at which DeepSeek's order is ahead; every row's comm-only
    share of its step (the numbers the notes quote)."""
    speedup(
        rows, over={"schedule": "serial"}, by=("mode", "requests"), column="speedup_over_serial"
    )
    at = {(r["mode"], r["requests"], r["schedule"]): r for r in rows}
    for r in rows:
        r["comm_only_share"] = r["comm_only_us"] / r["step_time_us"]
        if r["schedule"] != "lightllm":
            continue
        ds = at[(r["mode"], r["requests"], "deepseek")]
        r["comm_only_over_deepseek"] = (
            r["comm_only_us"] / ds["comm_only_us"] if ds["comm_only_us"] > 0 else None
        )
        r["slower_than_deepseek"] = r["step_time_us"] / ds["step_time_us"] - 1
        r["deepseek_ahead_share"] = paired(
            [ds["step_time_us"], *ds["step_time_points_us"]],
            [r["step_time_us"], *r["step_time_points_us"]],
        )
        top = max(r["layer_comm_only_by"].items(), key=lambda kv: kv[1], default=("none", 0.0))
        r["layer_comm_only_top"] = {"where": top[0], "us": top[1]}
    return rows


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


NOTES = """\
# LightLLM's order against DeepSeek's: when does the GPU sit with only communication running?

{stamp}  ·  numbers in `{name}.json`, figure `{name}.png` / `.svg`.
Simulator, {gpu_name} preset, DeepSeek-V3, the EP sizes of DeepSeek's published profiles
(deepseek-ai/profile-data): decode EP{doc[decode_ep]} with {context_k}K contexts,
prefill EP{doc[prefill_ep]} with {context_k}K prompts. Schedules: `lightllm`
(docs/schedules.md, upstream `overlap_tpsp_token_forward` / `overlap_tpsp_context_forward`),
`deepseek` (docs/schedules.md, the day-6 blog figures), `serial` as reference. "Comm-only" is
`Trace.comm_only_us`: GPU time in which communication (a comm kernel or a transfer in flight)
runs and no compute or copy does; per-layer numbers are for layer {layer}, one steady-state
period (micro-batch 0's first attention kernel of layer {layer} to that of the next).
"DeepSeek ahead": the share of the {design} at which DeepSeek's
step is shorter than LightLLM's, both perturbed alike.

## What the model shows

Decode (requests per GPU; ms per step; comm-only in ms; per-layer comm-only in µs):

{decode_table}

- At {dec[0]} requests LightLLM's and DeepSeek's steps take {small_lt_ms} and {small_ds_ms} ms,
  {small_lt_loss:.0f} and {small_ds_loss:.0f} % slower than serial: splitting
  halves the grouped GEMMs' M while each half still reads the expert weights, the small-batch
  loss SGLang reports for TBO.
- From {big[0][requests]} requests on, LightLLM leaves the GPU with only communication
  {ratio_lo:.1f}-{ratio_hi:.1f}x as long as DeepSeek's pipeline and is
  {slower_lo:.0f}-{slower_hi:.0f} % slower; DeepSeek's order is ahead at every
  point of the design at {sure} requests.
  Where, at {show_decode} requests: the largest comm-only window of LightLLM's layer
  {layer} is "{shown[layer_comm_only_top][where]}" ({shown[layer_comm_only_top][us]:.0f} µs of
  {shown[layer_comm_only_us]:.0f}). LightLLM moves the MoE block one slot later and runs a
  micro-batch's attention and shared expert back to back, so a combine or dispatch is covered by
  a single expert GEMM: what LightLLM's design notes suspect.

Prefill ({context_k}K prompts per GPU; ms per step; comm-only in ms):

{prefill_table}

- One prompt: LightLLM splits by request count, so its second micro-batch holds
  {one_lt[micro_batches][1][tokens]} tokens and nothing overlaps
  (x{one_lt[speedup_over_serial]:.2f} against serial); DeepSeek cuts the prompt
  ({one_ds[micro_batches][0][tokens]} / {one_ds[micro_batches][1][tokens]} tokens) so that
  the attention pairs balance (x{one_ds[speedup_over_serial]:.2f}).
- With balanced micro-batches ({show_prefill} prompts) little communication is left exposed
  by either order: DeepSeek's pipeline leaves {p_ds_comm_only_pct:.1f} % of its step
  with only communication, LightLLM's {p_lt_comm_only_pct:.1f} %. LightLLM is still
  {p_lt_slower_pct:.0f} % slower ({p_lt_ms} against {p_ds_ms} ms),
  and DeepSeek's order is ahead at {p_lt_share} of the points: the difference lies in which
  kernels run side by side and how the SMs are split (DeepSeek's static split gives
  {p_ds[comm_sms]} of {gpu[num_sms]} SMs to communication; LightLLM never limits
  DeepGEMM's SMs), not in communication left bare.

## Where the model may disagree with the published figures, and why

- Prefill traffic follows DeepEP's internode normal kernels (`shared/ir/deepep.py`): one RDMA copy
  per token and destination node to the same-rail GPU, then NVLink forwarding.
- DeepSeek's decode figure draws SHARED + ATTN-0 as long as a DISPATCH; in the model the
  low-latency dispatch over RDMA can outlast them, and its receive hook is then exposed (the
  per-layer comm-only column). The relative sizes of DeepSeek's ATTN-0 and dispatch are not
  published; the cost model's are estimates (GPU preset, docs/uncertainty.md).
- Who gets the SMs when a communication kernel and a GEMM are released by the same event is the
  simulator's rule (stream priority, then launch order; no preemption: docs/sm-sharing.md); on
  hardware it depends on the block scheduler. The size of LightLLM's prefill gap rests on that
  tie, its existence on the missing SM reservation.
- Host side: both prefill Programs include the host busy-wait of DeepEP's normal dispatch for the
  received-token counts (`shared/ir/lowering.py`).
"""


def notes(doc: dict) -> str:
    """:data:`NOTES` over the results file (tests/test_experiment_notes.py)."""
    rows = doc["rows"]
    at = {(r["mode"], r["requests"], r["schedule"]): r for r in rows}
    layer = rows[0]["layer"]
    dec = sorted({r["requests"] for r in rows if r["mode"] == "decode"})
    pre = sorted({r["requests"] for r in rows if r["mode"] == "prefill"})

    def ms(r: dict, k: str = "step_time_us", d: int = 2) -> str:
        return f"{r[k] / 1e3:.{d}f}"

    def share(r: dict) -> str:
        return f"{100 * r['deepseek_ahead_share']:.0f} %"

    dec_tab = []
    for n in dec:
        s, lt, ds = (at[("decode", n, k)] for k in SCHEDULES)
        dec_tab.append(
            [
                n,
                ms(s),
                ms(lt),
                ms(ds),
                ms(lt, "comm_only_us"),
                ms(ds, "comm_only_us"),
                f"{lt['layer_comm_only_us']:.0f} / {ds['layer_comm_only_us']:.0f}",
                share(lt),
            ]
        )
    pre_tab = []
    for n in pre:
        s, lt, ds = (at[("prefill", n, k)] for k in SCHEDULES)
        pre_tab.append(
            [
                f"{n} ({s['tokens'] / 1024:.0f})",
                ms(s, d=0),
                ms(lt, d=0),
                ms(ds, d=0),
                ms(lt, "comm_only_us", 0),
                ms(ds, "comm_only_us", 0),
                share(lt),
            ]
        )
    small_lt, small_ds = at[("decode", dec[0], "lightllm")], at[("decode", dec[0], "deepseek")]
    big = [at[("decode", n, "lightllm")] for n in dec if n >= SHOW_DECODE // 2]
    ratios = [r["comm_only_over_deepseek"] for r in big if r["comm_only_over_deepseek"]]
    slower = [r["slower_than_deepseek"] for r in big]
    shown = at[("decode", SHOW_DECODE, "lightllm")]
    one_lt, one_ds = at[("prefill", pre[0], "lightllm")], at[("prefill", pre[0], "deepseek")]
    p_lt, p_ds = (
        at[("prefill", SHOW_PREFILL, "lightllm")],
        at[("prefill", SHOW_PREFILL, "deepseek")],
    )
    gpu = doc["presets"]["gpus"][GPU]
    sure_dec = [r for r in big if r["deepseek_ahead_share"] == 1.0]
    return NOTES.format(
        gpu_name=GPU,
        name=NAME,
        show_decode=SHOW_DECODE,
        show_prefill=SHOW_PREFILL,
        big=big,
        dec=dec,
        doc=doc,
        gpu=gpu,
        layer=layer,
        one_ds=one_ds,
        one_lt=one_lt,
        p_ds=p_ds,
        shown=shown,
        stamp=stamp(doc),
        context_k=doc["context"] // 1024,
        design=design_sentence(doc["sensitivity"]),
        decode_table=md_table(
            [
                "req/GPU",
                "serial",
                "lightllm",
                "deepseek",
                "lightllm comm-only",
                "deepseek comm-only",
                f"layer {layer}: lightllm / deepseek",
                "DeepSeek ahead",
            ],
            dec_tab,
            "---:",
        ),
        small_lt_ms=ms(small_lt),
        small_ds_ms=ms(small_ds),
        small_lt_loss=100 * (1 - small_lt["speedup_over_serial"]),
        small_ds_loss=100 * (1 - small_ds["speedup_over_serial"]),
        ratio_lo=min(ratios),
        ratio_hi=max(ratios),
        slower_lo=100 * min(slower),
        slower_hi=100 * max(slower),
        sure=", ".join(str(r["requests"]) for r in sure_dec) or "none",
        prefill_table=md_table(
            [
                "prompts (K tokens)",
                "serial",
                "lightllm",
                "deepseek",
                "lightllm comm-only",
                "deepseek comm-only",
                "DeepSeek ahead",
            ],
            pre_tab,
            "---:",
        ),
        p_ds_comm_only_pct=100 * p_ds["comm_only_share"],
        p_lt_comm_only_pct=100 * p_lt["comm_only_share"],
        p_lt_slower_pct=100 * p_lt["slower_than_deepseek"],
        p_lt_ms=ms(p_lt, d=0),
        p_ds_ms=ms(p_ds, d=0),
        p_lt_share=share(p_lt),
    )


EXPERIMENT = Experiment(
    name=NAME,
    title="LightLLM's order against DeepSeek's: comm-only GPU time, DeepSeek-V3 on H800",
    cases=cases,
    measure=measure,
    derive=derive,
    clip=cut,
    figure=figure,
    notes=notes,
    meta={
        "sensitivity": design_meta(EXPERIMENT_DESIGN),
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
