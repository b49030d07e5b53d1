"""SGLang's CPU-GPU overlap scheduler: it hides host time up to the GPU time, and a prefill pays
about one iteration of TTFT for it.

SGLang's CPU-GPU overlap scheduler (docs/schedules.md): with overlap the host schedules batch N+1 and processes batch N-1 while the
GPU runs batch N, so an iteration takes max(GPU, host) instead of GPU + host
(``--disable-overlap-schedule``); the price is that a batch is scheduled one step ahead and its
result processed one step late, which SGLang's design counts as one iteration of extra TTFT for a
prefill (and why SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP exists).

Three sweeps, each simulating the overlap loop and the normal loop over the same iterations:
(a) decode, DeepSeek-V2-Lite EP8 on an H100 (a small MoE whose GPU step is a few ms), scaling
    every host cost of ``HostCosts`` by 0.25x..32x: iteration time against host time per
    iteration, with max(GPU, host) and GPU + host drawn;
(b) decode, DeepSeek-V3 EP32 on an H800 at the default host costs, sweeping requests per GPU: what
    overlap buys on the model the project is about;
(c) a prefill joining a running decode batch (iterations: prefill, decode, decode, prefill,
    decode...; the second prefill is the one measured), same host scaling as (a): its TTFT from
    the iteration that picks it up to its token reaching the detokenizer, overlap minus normal,
    split into the lookahead part (its forward starts later: the GPU is still busy with the last
    batch) and the deferral part (the time from its forward's end to its result being processed);
plus the consecutive-prefill switch (prefill, prefill, decode...) with and without it.

Run: ``python -m overlap_lab.experiments.exp_cpu_overlap`` (about 30 s on 2 cores).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from overlap_lab.experiments.runner import Case, Experiment, kept_traces, main, stamp
from overlap_lab.figures import WIDTHS, save_figure, timeline
from overlap_lab.shared.inputs.hardware import HostCosts
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model
from overlap_lab.shared.outputs.trace import Trace
from overlap_lab.shared.schedules import ScheduleConfig
from overlap_lab.shared.schedules.sglang_overlap import overlap_report

NAME = "cpu_overlap"
GPU = "h100"  # sweeps (a), (c), (d); (b) runs on an H800
SCALES = (0.25, 0.5, 1, 2, 4, 8, 16, 32)
V3_BATCHES = (16, 32, 64, 128, 256)
ITERATIONS = 6
TTFT_MODES = ("prefill", "decode", "decode", "prefill", "decode")
TTFT_STEP = 3  # the prefill measured (the second cohort, joining a running batch)
CONSECUTIVE_MODES = ("prefill", "prefill", "decode")
SHOW_SCALE = 8  # the timeline drawn
LOOPS = ("overlap", "normal")


def scaled(s: float) -> HostCosts:
    return HostCosts(**{k: v * s for k, v in dataclasses.asdict(HostCosts()).items()})


def loop_cfg(cfg: ScheduleConfig, loop: str) -> ScheduleConfig:
    """The overlap loop, ``--disable-overlap-schedule`` ("normal") or the overlap loop with
    SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP ("overlap + switch")."""
    if loop == "normal":
        return dataclasses.replace(cfg, disable_overlap_schedule=True)
    if loop == "overlap + switch":
        return dataclasses.replace(cfg, disable_consecutive_prefill_overlap=True)
    return cfg


def cases():
    lite, v3 = get_model("deepseek-v2-lite"), get_model("deepseek-v3")
    decode = Workload(lite, Batch.decode(32, kv_len=2048), Parallel(ep=8))
    prefill = Workload(lite, Batch.prefill(8, extend_len=32), Parallel(ep=8))
    # (a) decode: host cost x0.25..x32
    for s in SCALES:
        cfg = ScheduleConfig(iterations=ITERATIONS, host=scaled(s))
        for loop in LOOPS:
            at = {"sweep": "decode", "host_scale": s, "loop": loop}
            yield Case(at, "sglang-overlap", decode, GPU, loop_cfg(cfg, loop))
    # (b) DeepSeek-V3 EP32 on H800, default host costs
    for n in V3_BATCHES:
        w = Workload(v3, Batch.decode(n, kv_len=4096), Parallel(ep=32))
        for loop in LOOPS:
            at = {"sweep": "v3", "requests_per_gpu": n, "loop": loop}
            yield Case(at, "sglang-overlap", w, "h800", loop_cfg(ScheduleConfig(), loop))
    # (c) a prefill joining a running decode batch
    for s in SCALES:
        cfg = ScheduleConfig(iterations=ITERATIONS + 1, iteration_modes=TTFT_MODES, host=scaled(s))
        for loop in LOOPS:
            at = {"sweep": "ttft", "host_scale": s, "loop": loop}
            keep = f"ttft {loop} x{s}" if s == SHOW_SCALE and loop == "overlap" else None
            yield Case(at, "sglang-overlap", prefill, GPU, loop_cfg(cfg, loop), keep)
    # (d) prefill, prefill, decode: the consecutive-prefill switch
    for s in (1, SHOW_SCALE):
        cfg = ScheduleConfig(iterations=5, iteration_modes=CONSECUTIVE_MODES, host=scaled(s))
        for loop in ("overlap", "overlap + switch", "normal"):
            at = {"sweep": "consecutive", "host_scale": s, "loop": loop}
            yield Case(at, "sglang-overlap", prefill, GPU, loop_cfg(cfg, loop))


def host_us(trace: Trace, step: int) -> float:
    """Host time the loop spends on one iteration: its recv + schedule + launches + processing of
    the previous batch (the steady-state host cost per iteration)."""
    busy = [s for s in trace.spans if s.lane.startswith("host:") and s.kind == "host"]
    t0 = next(s.start for s in busy if s.op == "recv_requests" and s.step == step)
    t1 = next(s.start for s in busy if s.op == "recv_requests" and s.step == step + 1)
    return sum(min(s.end, t1) - max(s.start, t0) for s in busy if s.end > t0 and s.start < t1)


def _forward_start(trace: Trace, step: int) -> float:
    return min(s.start for s in trace.spans if s.step == step and s.op == "embed")


def measure(trace, program, case) -> dict:
    """Per loop; :func:`derive` pairs each overlap row with its normal loop."""
    rep = overlap_report(trace)
    kind, loop = case.params["sweep"], case.params["loop"]
    if kind in ("decode", "v3"):
        mid = case.cfg.iterations // 2
        out = {"host_us": host_us(trace, mid), "gpu_us": rep["iterations"][mid]["forward_us"]}
        out[f"{loop}_us"] = rep["steady_period_us"]
        if kind == "decode":
            out[f"{loop}_gpu_idle_us"] = rep["gpu_idle_us"]
        return out if loop == "overlap" else {k: out[k] for k in out if k.startswith(loop)}
    if kind == "ttft":
        it = rep["iterations"][TTFT_STEP]
        recv = next(x.start for x in trace.spans if x.op == "recv_requests" and x.step == TTFT_STEP)
        out = {"iteration_us": rep["steady_period_us"], "prefill_forward_us": it["forward_us"]}
        return (out if loop == "overlap" else {}) | {
            f"ttft_{loop}_us": it["ttft_us"],
            f"start_delay_{loop}_us": _forward_start(trace, TTFT_STEP) - recv,
            f"wait_{loop}_us": it["wait_us"],
            **({"deferred": it["deferred"]} if loop == "overlap" else {}),
            f"iterations_late_{loop}": it["iterations_late"],
        }
    first = rep["iterations"][0]
    return {
        "ttft_first_prefill_us": first["ttft_us"],
        "wait_first_prefill_us": first["wait_us"],
        "ttft_second_prefill_us": rep["iterations"][1]["ttft_us"],
        "total_us": rep["total_us"],
        "gpu_idle_us": rep["gpu_idle_us"],
    }


def derive(rows: list[dict]) -> list[dict]:
    """One row per overlap/normal pair in sweeps (a)-(c), with the speed-up and TTFT cost; the
    consecutive-prefill rows as they are."""
    out, pairs = [], {}
    for r in rows:
        if r["sweep"] == "consecutive":
            out.append(r)
            continue
        key = (r["sweep"], r.get("host_scale"), r.get("requests_per_gpu"))
        if r.pop("loop") == "overlap":
            pairs[key] = r
            out.append(r)
        else:
            pairs[key].update({k: v for k, v in r.items() if k not in pairs[key]})
    for r in out:
        if r["sweep"] in ("decode", "v3"):
            r["speedup"] = r["normal_us"] / r["overlap_us"]
            r["throughput_change"] = r["speedup"] - 1
            # the two bounds the notes hold the loops to, and how far overlap is from its own
            r["overlap_bound_us"] = max(r["gpu_us"], r["host_us"])
            r["normal_bound_us"] = r["gpu_us"] + r["host_us"]
            r["overlap_bound_error"] = (
                abs(r["overlap_us"] - r["overlap_bound_us"]) / r["overlap_bound_us"]
            )
        elif r["sweep"] == "ttft":
            r["ttft_cost_us"] = r["ttft_overlap_us"] - r["ttft_normal_us"]
            r["ttft_cost_iterations"] = r["ttft_cost_us"] / r["iteration_us"]
            r["lookahead_cost_us"] = r["start_delay_overlap_us"] - r["start_delay_normal_us"]
            r["deferral_cost_us"] = r["wait_overlap_us"] - r["wait_normal_us"]
    return out


def keep_window(trace: Trace, case: Case) -> Trace:
    """Panel (e): the loop from the recv of the step before the measured prefill to the
    prefill's result reaching the detokenizer, padded by 5 %: the spans it shows, uncut."""
    t0, t1 = ttft_window(trace)
    pad = 0.05 * (t1 - t0)
    shown = [s for s in trace.spans if s.end > t0 - pad and s.start < t1 + pad]
    # and the first span of each lane, outside the window: it fixes the order of the rows
    firsts = {}
    for s in trace.spans:
        firsts.setdefault((s.rank, s.lane), s)
    return Trace(set(shown) | set(firsts.values()), trace.meta)


def ttft_window(tr: Trace) -> tuple[float, float]:
    t0 = min(s.start for s in tr.spans if s.step == TTFT_STEP - 1 and s.op == "recv_requests")
    t1 = max(s.end for s in tr.spans if s.step == TTFT_STEP and s.op == "send_to_detokenizer")
    return t0, t1


def sweep(rows: list[dict], kind: str) -> list[dict]:
    return [r for r in rows if r["sweep"] == kind]


def figure(doc: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    rows = doc["rows"]
    fig = Figure(figsize=(7.0, 7.6), layout="constrained")
    grid = fig.add_gridspec(3, 2, height_ratios=[1, 1, 1.1])
    ax_a, ax_b = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    ax_c, ax_d = fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    ax_t = fig.add_subplot(grid[2, :])

    dec = sweep(rows, "decode")
    hx = [r["host_us"] / 1e3 for r in dec]
    ax_a.plot(hx, [r["overlap_us"] / 1e3 for r in dec], "o", label="overlap (simulated)")
    ax_a.plot(hx, [r["normal_us"] / 1e3 for r in dec], "s", label="--disable-overlap-schedule")
    ax_a.plot(
        hx, [max(r["gpu_us"], r["host_us"]) / 1e3 for r in dec], "-", lw=1, label="max(GPU, host)"
    )
    ax_a.plot(hx, [(r["gpu_us"] + r["host_us"]) / 1e3 for r in dec], "--", lw=1, label="GPU + host")
    ax_a.axvline(dec[0]["gpu_us"] / 1e3, color="grey", lw=0.6, ls=":")
    ax_a.set_xscale("log")
    ax_a.set_yscale("log")
    from matplotlib.ticker import FormatStrFormatter

    ax_a.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax_a.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax_a.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax_a.set_xlabel("host time per iteration (ms)")
    ax_a.set_ylabel("iteration time (ms)")
    ax_a.set_title(
        "(a) decode, DeepSeek-V2-Lite EP8, 32 req, H100,\nhost cost x0.25..x32",
        fontsize=7.5,
        loc="left",
    )
    ax_a.legend()
    ax_a.grid(alpha=0.3, which="both")

    v3 = sweep(rows, "v3")
    xs = [r["requests_per_gpu"] for r in v3]
    ax_b.plot(xs, [100 * (r["speedup"] - 1) for r in v3], "o-", label="overlap speed-up (%)")
    ax_b.plot(
        xs, [100 * r["host_us"] / r["gpu_us"] for r in v3], "s--", label="host / GPU time (%)"
    )
    ax_b.set_xscale("log", base=2)
    ax_b.set_xlabel("decode requests per GPU (4K context)")
    ax_b.set_ylabel("%")
    ax_b.set_title("(b) DeepSeek-V3 EP32 on H800,\ndefault host costs", fontsize=7.5, loc="left")
    ax_b.legend()
    ax_b.grid(alpha=0.3)

    tt = sweep(rows, "ttft")
    sx = [r["host_scale"] for r in tt]
    ax_c.plot(sx, [r["ttft_cost_us"] / 1e3 for r in tt], "o-", label="TTFT cost (overlap - normal)")
    ax_c.plot(
        sx,
        [(r["start_delay_overlap_us"] - r["start_delay_normal_us"]) / 1e3 for r in tt],
        "^--",
        label="  of which: forward starts later (lookahead)",
    )
    ax_c.plot(
        sx,
        [(r["wait_overlap_us"] - r["wait_normal_us"]) / 1e3 for r in tt],
        "v--",
        label="  of which: result processed later (deferral)",
    )
    ax_c.plot(sx, [r["iteration_us"] / 1e3 for r in tt], "k:", label="one overlap iteration")
    ax_c.set_xscale("log", base=2)
    ax_c.set_xlabel("host cost scale (x HostCosts)")
    ax_c.set_ylabel("ms")
    ax_c.set_title(
        "(c) a prefill (8x32 tokens) joining\na running decode batch", fontsize=7.5, loc="left"
    )
    ax_c.legend()
    ax_c.grid(alpha=0.3)

    cons = sweep(rows, "consecutive")
    labels = sorted({r["loop"] for r in cons}, key=["overlap", "overlap + switch", "normal"].index)
    scales = sorted({r["host_scale"] for r in cons})
    width = 0.8 / len(labels)
    for k, label in enumerate(labels):
        vals = [
            next(r for r in cons if r["loop"] == label and r["host_scale"] == s) for s in scales
        ]
        pos = [i + k * width for i in range(len(scales))]
        ax_d.bar(
            pos,
            [v["ttft_first_prefill_us"] / 1e3 for v in vals],
            width,
            label=f"{label}: TTFT 1st prefill",
        )
        ax_d.plot(pos, [v["total_us"] / 1e3 / 5 for v in vals], "k_", ms=10)
    ax_d.set_xticks(
        [i + 0.4 - width / 2 for i in range(len(scales))], [f"host x{s}" for s in scales]
    )
    ax_d.set_ylabel("ms (bars: TTFT;\ndashes: total / 5 iterations)")
    ax_d.set_title(
        "(d) prefill, prefill, decode:\nSGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP",
        fontsize=7.5,
        loc="left",
    )
    ax_d.set_ylim(top=ax_d.get_ylim()[1] * 1.45)  # room for the legend above the bars
    ax_d.legend(loc="upper left")
    ax_d.grid(alpha=0.3, axis="y")

    (tr,) = kept_traces(doc).values()
    t0, t1 = ttft_window(tr)
    pad = 0.05 * (t1 - t0)
    timeline(
        tr,
        ax=ax_t,
        window=(t0 - pad, t1 + pad),
        title=f"(e) overlap loop at host x{SHOW_SCALE}: the prefill of step {TTFT_STEP}\n"
        f"(recv -> forward -> D2H -> processed after step {TTFT_STEP + 1} is launched)",
        width=WIDTHS["double"],
    )
    save_figure(fig, path)


NOTES = """\
# CPU-GPU overlap scheduler: host time hidden up to the GPU time; TTFT cost of a prefill

{stamp}  ·  schedule `sglang-overlap` (and its
`--disable-overlap-schedule` path), simulated. Host costs are `shared.inputs.hardware.HostCosts`
(estimates, not measurements) scaled by the factor shown; kernel launches cost `launch_us` each
(one `graph_launch_us` for a CUDA-graph decode forward).

## (a) Iteration time = max(GPU, host) with overlap, GPU + host without
DeepSeek-V2-Lite decode, 32 requests per GPU, EP8, H100. Host time per iteration = recv +
get_next_batch_to_run + the launches + processing and sending the previous batch.

| host | host ms | GPU ms | overlap ms | max(GPU, host) | normal ms | GPU + host | speed-up |
|---|---|---|---|---|---|---|---|
{rows_a}

The overlap loop's iteration matches max(GPU, host) within {worst_pct:.1f} % over the sweep and
the normal loop matches GPU + host: the host work is hidden completely while it is shorter than the
forward, and once it is longer the GPU idles (forward stream gap) for the difference. The one
host block per iteration (`copy_done.synchronize()`) keeps the host exactly one step ahead.

## (b) What it buys on DeepSeek-V3 (EP32, H800, default host costs)

| requests/GPU | host ms | GPU ms | overlap ms | normal ms | speed-up |
|---|---|---|---|---|---|
{rows_b}

With a 61-layer model at EP32 the forward is tens of ms and the scheduler's host work (under a few
ms with these estimates) is small beside it: overlap buys the host fraction, a few percent. It
matters where the GPU step is short (small models, small batches, fast GPUs), as in (a).

## (c) TTFT of a prefill under overlap
A cohort of 8 x 32-token prompts is prefilled, decoded twice, then a second cohort is prefilled
(step {step}) and joins the decode batch. TTFT here = from the `recv_requests` of the iteration that
picks the prompt up to its first token reaching the detokenizer.

| host | overlap iteration ms | TTFT normal | TTFT overlap | cost | of which lookahead | of which deferral | iterations late (overlap / normal) |
|---|---|---|---|---|---|---|---|
{rows_c}

- The token always leaves one loop iteration later under overlap (its result is processed in
  iteration {next_step}, after batch {next_step} has been scheduled and launched; the normal loop
  processes it in iteration {step}): SGLang's "one iteration".
- In time, at default-ish host costs (x{low[0][host_scale]:g}..x1) the cost is
  {cost_lo:.2f}-{cost_hi:.2f}
  of an overlap iteration, and it is almost all *lookahead*, not deferral: the host picks the
  prompt up while the GPU is still running the previous decode (the host is one step ahead), so
  the prefill's forward starts up to one forward later than in the normal loop, which picks it up
  with the GPU idle. The result itself is processed as soon as its copy lands, because the host
  has already scheduled and launched the next batch and is waiting in `copy_done.synchronize()`.
- The *deferral* (time from the forward's end to the result being processed) costs extra only
  when the next iteration's host work (its recv, scheduling, launches and the processing of the
  batch before) outlasts the prefill's forward: then the result sits in the queue for the
  difference (the rising curve in (c) at large host costs), up to one host iteration.
- As host cost grows the loop becomes host-bound, the GPU is idle when the prompt is picked up,
  the lookahead part vanishes and the total cost falls towards the deferral part.

## (d) The consecutive-prefill switch
Two prefill cohorts in a row, then decodes; TTFT of the first (and second) prefill, total time
of 5 iterations and GPU idle time:

| host | loop | TTFT 1st ms | wait after forward ms | TTFT 2nd ms | total ms | GPU idle ms |
|---|---|---|---|---|---|---|
{rows_d}

SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP processes the first prefill before launching the
second. It helps the first prefill's TTFT only by the host work that overlap puts between that
prefill's forward and its processing beyond what the forward hides (here: scheduling the second
prefill and launching its eager forward, one launch per kernel, longer than this short prefill's
forward): {switch}. It costs the GPU the idle time of processing the first result before the
second forward can be launched, and the second prefill's TTFT.

## Where the model disagrees with SGLang's description, and why
- SGLang's design notes say the deferred prefill's first token waits one more iteration of GPU
  forward time. The model agrees on the count (one loop iteration) but in time the cost is the
  lookahead (the forward starting one forward later) when the GPU is the bottleneck, and the
  result's processing delay only when the host is: overlapping does not add a full forward
  between a prefill's end and its processing unless the host lags. Real schedulers also have host
  syncs the model leaves out (e.g. attention-backend planning that reads sequence lengths on the
  host), which would make the deferral closer to that description.
- The D2H copy runs on the copy stream after a wait on the forward stream, as SGLang's design
  001 §3 describe; upstream's `copy_to_cpu` issues `.to("cpu", non_blocking=True)` on the current
  (forward) stream. The two differ only in whether the next forward queues behind a few-µs copy.
- Host costs are estimates (HostCosts); the sweep shows the shape, not SGLang's measured overhead.
  Spec-v2 draft/verify kernels and grammar mask building are not modeled (only their effect on the
  loop: the forced-serial case and the delayed sample).
- Figure (e): the loop at host x{show_scale} around the measured prefill (host lane, schedule / forward /
  copy streams, links).
"""


def notes(doc: dict) -> str:
    dec, v3, tt, cons = (sweep(doc["rows"], k) for k in ("decode", "v3", "ttft", "consecutive"))

    def row_a(r):
        return (
            f"| x{r['host_scale']:g} | {r['host_us'] / 1e3:.2f} | {r['gpu_us'] / 1e3:.2f} | "
            f"{r['overlap_us'] / 1e3:.2f} | {r['overlap_bound_us'] / 1e3:.2f} | "
            f"{r['normal_us'] / 1e3:.2f} | {r['normal_bound_us'] / 1e3:.2f} | "
            f"{100 * r['throughput_change']:+.0f} % |"
        )

    def row_b(r):
        return (
            f"| {r['requests_per_gpu']} | {r['host_us'] / 1e3:.2f} | {r['gpu_us'] / 1e3:.1f} | "
            f"{r['overlap_us'] / 1e3:.1f} | {r['normal_us'] / 1e3:.1f} | "
            f"{100 * r['throughput_change']:+.1f} % |"
        )

    def row_c(r):
        return (
            f"| x{r['host_scale']:g} | {r['iteration_us'] / 1e3:.2f} | "
            f"{r['ttft_normal_us'] / 1e3:.2f} | {r['ttft_overlap_us'] / 1e3:.2f} | "
            f"{r['ttft_cost_us'] / 1e3:+.2f} ({r['ttft_cost_iterations']:.2f} it.) | "
            f"{r['lookahead_cost_us'] / 1e3:+.2f} | "
            f"{r['deferral_cost_us'] / 1e3:+.2f} | "
            f"{r['iterations_late_overlap']} / {r['iterations_late_normal']} |"
        )

    def row_d(r):
        return (
            f"| x{r['host_scale']:g} | {r['loop']} | {r['ttft_first_prefill_us'] / 1e3:.2f} | "
            f"{r['wait_first_prefill_us'] / 1e3:.2f} | {r['ttft_second_prefill_us'] / 1e3:.2f} | "
            f"{r['total_us'] / 1e3:.2f} | {r['gpu_idle_us'] / 1e3:.2f} |"
        )

    def by(scale, loop):
        return next(r for r in cons if r["host_scale"] == scale and r["loop"] == loop)

    switch_text = "; ".join(
        f"at host x{sc:g} the first TTFT goes {by(sc, 'overlap')['ttft_first_prefill_us'] / 1e3:.2f}"
        f" -> {by(sc, 'overlap + switch')['ttft_first_prefill_us'] / 1e3:.2f} ms, the second"
        f" {by(sc, 'overlap')['ttft_second_prefill_us'] / 1e3:.2f}"
        f" -> {by(sc, 'overlap + switch')['ttft_second_prefill_us'] / 1e3:.2f} ms, GPU idle"
        f" {by(sc, 'overlap')['gpu_idle_us'] / 1e3:.2f}"
        f" -> {by(sc, 'overlap + switch')['gpu_idle_us'] / 1e3:.2f} ms"
        for sc in sorted({r["host_scale"] for r in cons})
    )
    worst = max(r["overlap_bound_error"] for r in dec)
    low = [r for r in tt if r["host_scale"] <= 1]
    return NOTES.format(
        show_scale=SHOW_SCALE,
        step=TTFT_STEP,
        low=low,
        switch=switch_text,
        stamp=stamp(doc),
        rows_a="\n".join(row_a(r) for r in dec),
        worst_pct=100 * worst,
        rows_b="\n".join(row_b(r) for r in v3),
        rows_c="\n".join(row_c(r) for r in tt),
        next_step=TTFT_STEP + 1,
        cost_lo=min(r["ttft_cost_iterations"] for r in low),
        cost_hi=max(r["ttft_cost_iterations"] for r in low),
        rows_d="\n".join(row_d(r) for r in cons),
    )


EXPERIMENT = Experiment(
    name=NAME,
    title="SGLang's CPU-GPU overlap scheduler: host time hidden, TTFT cost of a prefill",
    cases=cases,
    measure=measure,
    derive=derive,
    clip=keep_window,
    figure=figure,
    notes=notes,
    meta={"gpu": GPU, "host_costs": dataclasses.asdict(HostCosts())},
)

if __name__ == "__main__":
    raise SystemExit(
        main(sys.argv[1:], prog=f"python -m overlap_lab.experiments.exp_{NAME}", default=[NAME])
    )
