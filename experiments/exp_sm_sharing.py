"""How kernels share the SMs decides which schedule wins.

Three questions, each answered by the block-level SM model (sim/cost.py, docs/sm-sharing.md):

1. Why does DeepSeek reserve 24 of an H800's 132 SMs for DeepEP in prefill? DeepSeek-V3 prefill,
   EP32, 16K tokens per GPU (4 prompts of 4K): DeepSeek's schedule as published (GEMMs on 108
   SMs, DeepEP on 24), the same with the computation uncapped (persistent DeepGEMM-style GEMMs
   sized to all 132 SMs), and uncapped with waved (cuBLAS-style) GEMMs; and the waved case with
   DeepEP's stream at default priority, which shows what the stream priority contributes.
2. LightLLM's order against DeepSeek's on that prefill.
3. TBO against TBO+SBO in decode (DeepSeek-V3 cut to 4 layers, 128 requests per GPU, 4K context,
   EP32) on H800 and B200, SBO modes 1-3.

How sure: every case is re-run with the inputs of ``overlap_lab.sensitivity.EXPERIMENT_DESIGN``
at both ends of their ranges (only costs vary); the notes end with the share of those points at
which each comparison keeps its order.

Run: ``python -m overlap_lab.experiments sm_sharing`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import dataclasses
import sys
from functools import partial
from pathlib import Path

from overlap_lab.experiments.runner import (
    Case,
    Experiment,
    kept_traces,
    main,
    md_table,
    middle_layer,
    stamp,
)
from overlap_lab.figures import clip, layer_window, save_figure, timeline
from overlap_lab.sensitivity import (
    EXPERIMENT_DESIGN,
    design_meta,
    design_sentence,
    paired,
    step_times,
)
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model, with_layers
from overlap_lab.shared.ir.program import Program, map_ops
from overlap_lab.shared.outputs.trace import Trace, intersect, length, union
from overlap_lab.shared.schedules import ScheduleConfig

NAME = "sm_sharing"
PREFILL_EP, DECODE_EP = 32, 32
PROMPTS, CONTEXT = 4, 4096  # 16K tokens per GPU, DeepSeek's prefill profile
DECODE_BATCH, DECODE_LAYERS = 128, 4
GEMM_CLASSES = ("gemm", "grouped_gemm")


# ---- what-if passes on a Program (module level: the pool pickles them) --------------------------


def uncapped(program: Program) -> Program:
    """Every compute kernel may use the whole GPU (no SM cap); DeepEP keeps its SMs."""
    return map_ops(
        program, lambda op: op if op.kind == "comm" else dataclasses.replace(op, sms=None)
    )


def uncapped_waved(program: Program) -> Program:
    """Uncapped, and the GEMMs waved (cuBLAS/Triton-style tiles) instead of persistent."""

    def fn(op):
        if op.kind == "comm":
            return op
        grid = "waved" if op.op_class in GEMM_CLASSES else op.grid
        return dataclasses.replace(op, sms=None, grid=grid)

    return map_ops(program, fn)


def uncapped_waved_flat(program: Program) -> Program:
    """Uncapped waved GEMMs, and DeepEP's stream at default priority (no priority rule)."""
    p = uncapped_waved(program)
    ranks = tuple(dataclasses.replace(rp, priorities=()) for rp in p.ranks)
    return dataclasses.replace(p, ranks=ranks)


def capped(program: Program, sms: int) -> Program:
    """Every compute kernel limited to ``sms`` SMs (a DeepSeek-style split as a what-if)."""
    return map_ops(
        program, lambda op: op if op.kind == "comm" else dataclasses.replace(op, sms=sms)
    )


PUBLISHED = "108/24 (published)"
VARIANTS = {
    PUBLISHED: None,
    "uncapped, persistent GEMMs": uncapped,
    "uncapped, waved GEMMs": uncapped_waved,
    "uncapped, waved GEMMs, comm stream at default priority": uncapped_waved_flat,
}


# ---- the sweep ------------------------------------------------------------------------------------


def prefill_workload() -> Workload:
    model = get_model("deepseek-v3")
    return Workload(model, Batch.prefill(PROMPTS, extend_len=CONTEXT), Parallel(ep=PREFILL_EP))


def decode_workload() -> Workload:
    model = with_layers(get_model("deepseek-v3"), DECODE_LAYERS)
    return Workload(model, Batch.decode(DECODE_BATCH, kv_len=CONTEXT), Parallel(ep=DECODE_EP))


def cases():
    pre = prefill_workload()
    for i, (variant, fn) in enumerate(VARIANTS.items()):
        yield Case(
            {"part": "split", "gpu": "h800", "variant": variant, "sbo_mode": None},
            "deepseek",
            pre,
            "h800",
            keep=f"split {i}" if i < 3 else None,
            transform=fn,
        )
    for name in ("lightllm", "deepseek"):
        params = {"part": "systems", "gpu": "h800", "variant": name, "sbo_mode": None}
        yield Case(params, name, pre, "h800")
    # what-if (not upstream: whether LightLLM can split the SMs is an open question):
    # LightLLM's order with its GEMMs capped beside DeepEP's default 20 SMs
    params = {
        "part": "systems",
        "gpu": "h800",
        "variant": "lightllm, GEMMs capped to 112 SMs (what-if)",
        "sbo_mode": None,
    }
    yield Case(params, "lightllm", pre, "h800", transform=partial(capped, sms=112))
    dec = decode_workload()
    for g in ("h800", "b200"):
        yield Case({"part": "sbo", "gpu": g, "variant": "tbo", "sbo_mode": None}, "tbo", dec, g)
        for m in (1, 2, 3):
            params = {"part": "sbo", "gpu": g, "variant": f"tbo+sbo mode {m}", "sbo_mode": m}
            yield Case(params, "tbo+sbo", dec, g, ScheduleConfig(sbo_mode=m))


def window(trace: Trace, case: Case) -> tuple[float, float]:
    return layer_window(trace, middle_layer(case), op="comm_prepare_attn")


def measure(trace, program, case) -> dict:
    """Step-level metrics, and from one steady-state layer: how many SMs the computation held on
    average, how long DeepEP's kernels held SMs, and how much of that ran beside computation."""
    t0, t1 = window(trace, case)
    span = t1 - t0
    comp = [s for s in trace.spans if s.rank == 0 and s.kind == "compute" and s.end > t0]
    comp = [s for s in comp if s.start < t1]
    sm_time = sum((min(s.end, t1) - max(s.start, t0)) * s.sms for s in comp)
    comm = [
        (max(s.start, t0), min(s.end, t1))
        for s in trace.spans
        if s.rank == 0 and s.kind == "comm" and s.sms > 0 and s.start < t1 and s.end > t0
    ]
    busy = union((max(s.start, t0), min(s.end, t1)) for s in comp)
    comm_u = union(comm)
    return {
        "step_time_us": trace.step_time_us,
        "exposed_comm_us": trace.exposed_comm_us(),
        "comm_only_us": trace.comm_only_us(),
        "layer": middle_layer(case),
        "layer_time_us": span,
        "layer_compute_sms_avg": sm_time / span if span > 0 else 0.0,
        "layer_comm_kernel_us": length(comm_u),
        "layer_comm_beside_compute_us": length(intersect(comm_u, busy)),
        "layer_attn_core_us": sum(
            min(s.end, t1) - max(s.start, t0) for s in comp if s.op == "attn.core"
        ),
        "comm_sms": program.meta.comm_sms,
        # the same Program under each perturbation of EXPERIMENT_DESIGN (only costs vary)
        "step_time_points_us": list(step_times(program, case.gpu)),
    }


def derive(rows: list[dict]) -> list[dict]:
    """Each row's share of the design's points (nominal included) at which it is faster than
    its part's reference: the published 108/24 split, DeepSeek's schedule, or TBO on the same
    GPU (``ahead_of``, ``ahead_share``)."""

    def times(r: dict) -> list[float]:
        return [r["step_time_us"], *r["step_time_points_us"]]

    ref = {
        "split": next(r for r in rows if r["part"] == "split" and r["variant"] == PUBLISHED),
        "systems": next(r for r in rows if r["part"] == "systems" and r["variant"] == "deepseek"),
    }
    for r in rows:
        base = ref.get(r["part"]) or next(
            o for o in rows if o["part"] == "sbo" and o["gpu"] == r["gpu"] and o["variant"] == "tbo"
        )
        if base is r:
            continue
        r["ahead_of"] = base["variant"]
        r["ahead_share"] = paired(times(r), times(base))
    return rows


def cut(trace: Trace, case: Case) -> Trace:
    return clip(trace, *window(trace, case))


# ---- figure and notes -------------------------------------------------------------------------------


def _rows(doc, part):
    return [r for r in doc["rows"] if r["part"] == part]


def figure(doc: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    traces = kept_traces(doc)
    shown = [k for k in ("split 0", "split 1", "split 2") if k in traces]
    fig = Figure(figsize=(13, 4.5 + 1.6 * len(shown)), layout="constrained")
    gs = fig.add_gridspec(1 + len(shown), 3, height_ratios=[5] + [3] * len(shown))
    for col, part in enumerate(("split", "systems", "sbo")):
        ax = fig.add_subplot(gs[0, col])
        rows = _rows(doc, part)
        labels = [f"{r['gpu']} {r['variant']}" if part == "sbo" else r["variant"] for r in rows]
        ys = list(range(len(rows)))
        ax.barh(ys, [r["step_time_us"] / 1e3 for r in rows], color="#4c72b0", label="step")
        ax.barh(ys, [r["comm_only_us"] / 1e3 for r in rows], color="#dd8452", label="comm-only")
        ax.set_yticks(ys, [lab.replace(", comm stream", ",\ncomm stream") for lab in labels])
        ax.tick_params(axis="y", labelsize=7)
        ax.invert_yaxis()
        ax.set_xlabel(
            f"ms per step ({DECODE_BATCH} req/GPU, {DECODE_LAYERS} layers)"
            if part == "sbo"
            else "ms per step"
        )
        ax.set_title(
            {
                "split": "DeepSeek prefill, H800 EP32, 16K tok/GPU",
                "systems": "LightLLM vs DeepSeek, same prefill",
                "sbo": "TBO vs TBO+SBO decode",
            }[part],
            fontsize=9,
            loc="left",
        )
        ax.grid(axis="x", alpha=0.3)
        if col == 0:  # one legend for the three bar charts, outside them: it hides no bar
            fig.legend(fontsize=7, loc="outside upper center", ncols=2, frameon=False)
    split = _rows(doc, "split")
    width = max(traces[k].step_time_us for k in shown) if shown else 0.0
    for i, key in enumerate(shown):
        ax = fig.add_subplot(gs[1 + i, :])
        r = split[int(key.split()[1])]
        title = (
            f"{r['variant']}: layer {r['layer']}, {r['layer_time_us']:.0f} µs, compute holds "
            f"{r['layer_compute_sms_avg']:.0f} SMs on average"
        )
        timeline(traces[key], ax, title=title, window=(0.0, width), legend=False)
    save_figure(fig, path, dpi=120)


def _ms(x: float) -> str:
    return f"{x / 1e3:.1f}"


def _ahead(r: dict, rows: list[dict]) -> str:
    """Row ``r``'s share of points ahead of its reference, or that they tie at every point."""
    ref = next(
        o
        for o in rows
        if o["part"] == r["part"] and o["gpu"] == r["gpu"] and o["variant"] == r["ahead_of"]
    )
    mine = [r["step_time_us"], *r["step_time_points_us"]]
    theirs = [ref["step_time_us"], *ref["step_time_points_us"]]
    if mine == theirs:
        return "equal at every point"
    return f"{100 * r['ahead_share']:.0f} %"


#: the sentences of part 1 that depend on how the waved variants compare
WAVED_BEATS_SPLIT = (
    "This beats the split: the GEMMs use every SM while DeepEP is idle and give way within one "
    "wave when it needs its SMs"
)
WAVED_WAITS = "The communication still waits up to one wave each time"
PRIORITY_CHANGES_NOTHING = (
    "Identical: the host issues far ahead of the GPU, and in DeepSeek's issue order each DeepEP "
    "kernel is launched before the GEMM it overlaps, so launch order alone already gives it "
    "precedence at the GEMM's wave boundaries; the stream priority decides only when a GEMM "
    "issued earlier is still waving."
)
LAUNCH_ORDER_DECIDES = (
    "Without the priority, pending CTAs go in launch order: a GEMM launched first keeps its SMs "
    "wave after wave and DeepEP fills in only behind its last wave."
)
NOTES = """\
# {doc[title]}

{stamp}

## 1. DeepSeek's 108/24 split (DeepSeek-V3 prefill, H800, EP32, 16K tokens per GPU)

{split_table}

- **Published 108/24: {pub_ms} ms.** DeepEP's kernels always find their 24 SMs free, so each micro-batch's dispatch and combine run beside the other's computation ({pub[layer_comm_beside_compute_us]:.0f} of {pub[layer_comm_kernel_us]:.0f} µs per layer).
- **Uncapped, persistent GEMMs: {per_ms} ms.** DeepGEMM-style kernels size their grid to all 132 SMs and hold them to the end; a DeepEP kernel (24 coresident CTAs) issued while one runs waits for it to finish, even from its high-priority stream (the block scheduler never preempts a running CTA). The communication is still hidden (exposed {per_exposed_ms} ms), but the GEMMs pay: a GEMM launched while DeepEP holds 24 SMs starts 108 of its 132 persistent CTAs, and the other 24, each with 1/132 of the tiles, start only when DeepEP ends, so the GEMM ends one CTA-length after the communication. Computation holds {per[layer_compute_sms_avg]:.0f} SMs on average instead of {pub[layer_compute_sms_avg]:.0f}, and the layer takes {per[layer_time_us]:.0f} µs instead of {pub[layer_time_us]:.0f}.
- **Uncapped, waved GEMMs: {wav_ms} ms.** cuBLAS-style GEMMs release SMs at every wave boundary; DeepEP's stream has the higher priority, so its CTAs take 24 SMs at the next boundary and the GEMM continues on the rest. {waved_verdict} (compute holds {wav[layer_compute_sms_avg]:.0f} SMs on average vs {pub[layer_compute_sms_avg]:.0f}).
- **Same, DeepEP's stream at default priority: {flat_ms} ms.** {priority_verdict}

So the reservation is what persistent GEMMs need: DeepGEMM's static grid never gives an SM back, and only a cap on it leaves SMs for DeepEP. Waved GEMMs beside a high-priority comm stream would not need one. How long DeepEP then waits depends on the wave length, which follows from the assumed CTA size (`WAVED_CTA_FLOPS`), and real cuBLAS GEMMs reach lower efficiency than DeepGEMM, which this variant does not charge.

## 2. LightLLM's order against DeepSeek's (same prefill)

{systems_table}

LightLLM {lightllm_ms} ms vs DeepSeek {deepseek_ms} ms. As modelled, LightLLM caps nothing: its DeepGEMM grouped GEMMs are persistent on all 132 SMs, and each micro-batch's DeepEP Buffer runs on its own high-priority comm stream with DeepEP's default 20 SMs. Where a dispatch's completion releases the other micro-batch's combine and this micro-batch's expert GEMM at the same instant, the combine's higher-priority stream now takes its SMs first, by rule (before, SimPy's event order gave the GEMM all 132 SMs). What remains is the persistent-grid cost of part 1: GEMMs issued while a DeepEP kernel runs start part of their CTAs late (compute holds {sysb[lightllm][layer_compute_sms_avg]:.0f} SMs on average). The what-if row caps LightLLM's GEMMs beside DeepEP's 20 SMs: {capped_ms} ms. Whether LightLLM can run such a split is an open question (see docs/schedules.md); the row is a what-if, not LightLLM's configuration.

## 3. TBO against TBO+SBO (decode, 128 requests per GPU, 4 layers, EP32)

{sbo_table}

SBO's combine is one kernel resident on its comm SMs from the down GEMM's start event, polling the GEMM's per-block signals (Hopper: 64-row blocks per local expert; Blackwell: one per local expert) and sending each block when signalled; other kernels cannot take its SMs between blocks. SGLang creates the alt stream at default priority, so a tie between the alt-stream combine and the other micro-batch's kernel goes to the one issued first. Under TBO mode 3 changes nothing (TBO's stages already place the shared experts), so its rows equal TBO's. Mode 2 on Hopper is a what-if SGLang does not run (mode 2 is its Blackwell set-up). Where TBO+SBO is slower, the trace shows why (last column): the combine holds its comm SMs while the other micro-batch's attention (a persistent FlashMLA-style grid sized to every SM) is launched, so that many of the attention's CTAs start only when the combine ends and the attention ends late; the gain from hiding the combine behind the down GEMM is smaller than that on Hopper's 3 comm SMs with a short combine, and larger on Blackwell. This depends on the assumption that decode attention is persistent (`sim.cost.PERSISTENT_CLASSES`).

## Assumptions the results depend on

- Within one stream priority, pending CTAs are dispatched in launch order (NVIDIA does not document the order; `sim/cost.py`). Row 4 of part 1 drops the priority.
- Which kernels are persistent and how much work one waved CTA holds (`sim.cost.PERSISTENT_CLASSES`, `WAVED_CTA_FLOPS`, `WAVED_CTA_BYTES`).
- Static against dynamic tile scheduling. DeepGEMM's tile scheduler is static, so CTAs that start late run their full share, and so is FlashMLA's decode split. Both are read from upstream. FlashAttention-3's prefill scheduler is dynamic (an atomic tile counter), so its late CTAs share the work that is left. Parts 1 and 2 turn on the static DeepGEMM grid; part 3 turns on the static decode-attention split.
- A coresident (DeepEP) kernel starts only when all its CTAs fit; freed SMs are kept for the first such kernel in precedence order.
- DeepEP normal kernels: DeepSeek's profile uses 24 SMs; SGLang and LightLLM are taken to run DeepEP's default `Buffer.num_sms` = 20.


## How sure

Each case re-run at {design}, both sides of a comparison perturbed alike. Share of the points at which each variant is faster than its reference:

{ahead_table}

Ties count half. A share strictly between 0 and 100 % (other than a tie at every point) marks a comparison the model does not settle: moving one input within its range swaps the two."""


def notes(doc: dict) -> str:
    split, systems, sbo = _rows(doc, "split"), _rows(doc, "systems"), _rows(doc, "sbo")
    by = {r["variant"]: r for r in split}
    pub = by["108/24 (published)"]
    per = by["uncapped, persistent GEMMs"]
    wav = by["uncapped, waved GEMMs"]
    flat = by["uncapped, waved GEMMs, comm stream at default priority"]
    sysb = {r["variant"]: r for r in systems}
    return NOTES.format(
        doc=doc,
        per=per,
        pub=pub,
        sysb=sysb,
        wav=wav,
        stamp=stamp(doc),
        split_table=md_table(
            [
                "variant",
                "step ms",
                "exposed comm ms",
                "comm-only ms",
                "layer µs",
                "compute SMs (avg)",
                "DeepEP kernel µs / layer",
                "of it beside compute µs",
            ],
            [
                [
                    r["variant"],
                    _ms(r["step_time_us"]),
                    _ms(r["exposed_comm_us"]),
                    _ms(r["comm_only_us"]),
                    f"{r['layer_time_us']:.0f}",
                    f"{r['layer_compute_sms_avg']:.0f}",
                    f"{r['layer_comm_kernel_us']:.0f}",
                    f"{r['layer_comm_beside_compute_us']:.0f}",
                ]
                for r in split
            ],
        ),
        pub_ms=_ms(pub["step_time_us"]),
        per_ms=_ms(per["step_time_us"]),
        per_exposed_ms=_ms(per["exposed_comm_us"]),
        wav_ms=_ms(wav["step_time_us"]),
        waved_verdict=WAVED_BEATS_SPLIT
        if wav["step_time_us"] < pub["step_time_us"]
        else WAVED_WAITS,
        flat_ms=_ms(flat["step_time_us"]),
        priority_verdict=PRIORITY_CHANGES_NOTHING
        if abs(flat["step_time_us"] - wav["step_time_us"]) < 1e-6 * wav["step_time_us"]
        else LAUNCH_ORDER_DECIDES,
        systems_table=md_table(
            ["schedule", "step ms", "exposed comm ms", "comm-only ms", "compute SMs (avg)"],
            [
                [
                    r["variant"],
                    _ms(r["step_time_us"]),
                    _ms(r["exposed_comm_us"]),
                    _ms(r["comm_only_us"]),
                    f"{r['layer_compute_sms_avg']:.0f}",
                ]
                for r in systems
            ],
        ),
        lightllm_ms=_ms(sysb["lightllm"]["step_time_us"]),
        deepseek_ms=_ms(sysb["deepseek"]["step_time_us"]),
        capped_ms=_ms(sysb["lightllm, GEMMs capped to 112 SMs (what-if)"]["step_time_us"]),
        sbo_table=md_table(
            [
                "gpu",
                "schedule",
                "step µs",
                "exposed comm µs",
                "comm-only µs",
                "attn.core µs / layer (both mbs)",
            ],
            [
                [
                    r["gpu"],
                    r["variant"],
                    f"{r['step_time_us']:.0f}",
                    f"{r['exposed_comm_us']:.0f}",
                    f"{r['comm_only_us']:.0f}",
                    f"{r['layer_attn_core_us']:.0f}",
                ]
                for r in sbo
            ],
        ),
        design=design_sentence(doc["sensitivity"]),
        ahead_table=md_table(
            ["part", "GPU", "variant", "reference", "ahead at"],
            [
                [r["part"], r["gpu"], r["variant"], r["ahead_of"], _ahead(r, doc["rows"])]
                for r in doc["rows"]
                if "ahead_of" in r
            ],
        ),
    )


EXPERIMENT = Experiment(
    name=NAME,
    title="How kernels share the SMs: DeepSeek's 108/24 split, LightLLM vs DeepSeek, TBO vs TBO+SBO",
    cases=cases,
    measure=measure,
    derive=derive,
    clip=cut,
    figure=figure,
    notes=notes,
    meta={
        "sensitivity": design_meta(EXPERIMENT_DESIGN),
        "model": "deepseek-v3",
        "prefill": f"{PROMPTS} x {CONTEXT} tokens per GPU, EP{PREFILL_EP}, h800",
        "decode": f"{DECODE_BATCH} requests, {CONTEXT} context, {DECODE_LAYERS} layers, "
        f"EP{DECODE_EP}",
    },
)

if __name__ == "__main__":
    raise SystemExit(
        main(sys.argv[1:], prog=f"python -m overlap_lab.experiments.exp_{NAME}", default=[NAME])
    )
