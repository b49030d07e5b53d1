"""SGLang's CPU-GPU overlap scheduler: it hides host time up to the GPU time, and a prefill pays
about one iteration of TTFT for it.

Seed 000 §3 / 001: with overlap the host schedules batch N+1 and processes batch N-1 while the
GPU runs batch N, so an iteration takes max(GPU, host) instead of GPU + host
(``--disable-overlap-schedule``); the price is that a batch is scheduled one step ahead and its
result processed one step late, which the seed counts as one iteration of extra TTFT for a
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

Run: ``python -m experiments.exp_cpu_overlap`` (about 30 s on 2 cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

from tqdm import tqdm

from shared.hardware import HostCosts, get_gpu
from shared.schedules import ScheduleConfig, build
from shared.schedules.sglang_overlap import overlap_report
from shared.trace import Trace
from shared.workload import Batch, Parallel, Workload, get_model
from sim import simulate

TOPIC = "cpu_overlap"
RESULTS = Path(__file__).parent / "results"
SCALES = (0.25, 0.5, 1, 2, 4, 8, 16, 32)
V3_BATCHES = (16, 32, 64, 128, 256)
ITERATIONS = 6
TTFT_MODES = ("prefill", "decode", "decode", "prefill", "decode")
TTFT_STEP = 3  # the prefill measured (the second cohort, joining a running batch)
CONSECUTIVE_MODES = ("prefill", "prefill", "decode")
SHOW_SCALE = 8  # the timeline drawn


def scaled(s: float) -> HostCosts:
    return HostCosts(**{k: v * s for k, v in dataclasses.asdict(HostCosts()).items()})


def pair(w: Workload, gpu, cfg: ScheduleConfig) -> tuple[dict, Trace]:
    """Overlap and normal loop over the same iterations: the report (with baseline) and the
    overlap trace."""
    ov = simulate(build("sglang-overlap", w, gpu, cfg), gpu)
    no = simulate(
        build("sglang-overlap", w, gpu, dataclasses.replace(cfg, disable_overlap_schedule=True)),
        gpu,
    )
    return overlap_report(ov, baseline=no), ov


def host_us(trace: Trace, step: int) -> float:
    """Host time the loop spends on one iteration: its recv + schedule + launches + processing of
    the previous batch (the steady-state host cost per iteration)."""
    busy = [s for s in trace.spans if s.lane.startswith("host:") and s.kind == "host"]
    t0 = next(s.start for s in busy if s.op == "recv_requests" and s.step == step)
    t1 = next(s.start for s in busy if s.op == "recv_requests" and s.step == step + 1)
    return sum(min(s.end, t1) - max(s.start, t0) for s in busy if s.end > t0 and s.start < t1)


def decode_sweep(gpu, bar) -> list[dict]:
    w = Workload(get_model("deepseek-v2-lite"), Batch.decode(32, kv_len=2048), Parallel(ep=8))
    rows = []
    for s in SCALES:
        rep, ov = pair(w, gpu, ScheduleConfig(iterations=ITERATIONS, host=scaled(s)))
        mid = ITERATIONS // 2
        rows.append(
            {
                "host_scale": s,
                "host_us": host_us(ov, mid),
                "gpu_us": rep["iterations"][mid]["forward_us"],
                "overlap_us": rep["steady_period_us"],
                "normal_us": rep["baseline"]["steady_period_us"],
                "overlap_gpu_idle_us": rep["gpu_idle_us"],
                "normal_gpu_idle_us": rep["baseline"]["gpu_idle_us"],
                "speedup": rep["baseline"]["steady_period_us"] / rep["steady_period_us"],
            }
        )
        bar.update()
    return rows


def v3_sweep(bar) -> list[dict]:
    gpu = get_gpu("h800")
    rows = []
    for n in V3_BATCHES:
        w = Workload(get_model("deepseek-v3"), Batch.decode(n, kv_len=4096), Parallel(ep=32))
        rep, ov = pair(w, gpu, ScheduleConfig(iterations=4))
        rows.append(
            {
                "requests_per_gpu": n,
                "host_us": host_us(ov, 2),
                "gpu_us": rep["iterations"][2]["forward_us"],
                "overlap_us": rep["steady_period_us"],
                "normal_us": rep["baseline"]["steady_period_us"],
                "speedup": rep["baseline"]["steady_period_us"] / rep["steady_period_us"],
            }
        )
        bar.update()
    return rows


def _forward_start(trace: Trace, step: int) -> float:
    return min(s.start for s in trace.spans if s.step == step and s.op == "embed")


def ttft_sweep(gpu, bar) -> tuple[list[dict], Trace]:
    w = Workload(get_model("deepseek-v2-lite"), Batch.prefill(8, extend_len=32), Parallel(ep=8))
    rows, shown = [], None
    for s in SCALES:
        cfg = ScheduleConfig(iterations=ITERATIONS + 1, iteration_modes=TTFT_MODES, host=scaled(s))
        ov = simulate(build("sglang-overlap", w, gpu, cfg), gpu)
        no = simulate(
            build(
                "sglang-overlap", w, gpu, dataclasses.replace(cfg, disable_overlap_schedule=True)
            ),
            gpu,
        )
        rep = overlap_report(ov, baseline=no)
        o, n = rep["iterations"][TTFT_STEP], rep["baseline"]["iterations"][TTFT_STEP]

        def start_delay(tr: Trace, r: dict) -> float:
            recv = next(
                x.start for x in tr.spans if x.op == "recv_requests" and x.step == TTFT_STEP
            )
            return _forward_start(tr, TTFT_STEP) - recv

        rows.append(
            {
                "host_scale": s,
                "iteration_us": rep["steady_period_us"],
                "prefill_forward_us": o["forward_us"],
                "ttft_overlap_us": o["ttft_us"],
                "ttft_normal_us": n["ttft_us"],
                "ttft_cost_us": o["ttft_cost_us"],
                "ttft_cost_iterations": o["ttft_cost_us"] / rep["steady_period_us"],
                "start_delay_overlap_us": start_delay(ov, o),
                "start_delay_normal_us": start_delay(no, n),
                "wait_overlap_us": o["wait_us"],
                "wait_normal_us": n["wait_us"],
                "deferred": o["deferred"],
                "iterations_late_overlap": o["iterations_late"],
                "iterations_late_normal": n["iterations_late"],
            }
        )
        if s == SHOW_SCALE:
            shown = ov
        bar.update()
    return rows, shown


def consecutive(gpu, bar) -> list[dict]:
    """Two prefills in a row: default overlap, the SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP
    switch, and the normal loop; the first prefill's TTFT and the run's total time."""
    w = Workload(get_model("deepseek-v2-lite"), Batch.prefill(8, extend_len=32), Parallel(ep=8))
    rows = []
    for s in (1, SHOW_SCALE):
        base = ScheduleConfig(iterations=5, iteration_modes=CONSECUTIVE_MODES, host=scaled(s))
        for label, cfg in (
            ("overlap", base),
            (
                "overlap + switch",
                dataclasses.replace(base, disable_consecutive_prefill_overlap=True),
            ),
            ("normal", dataclasses.replace(base, disable_overlap_schedule=True)),
        ):
            rep = overlap_report(simulate(build("sglang-overlap", w, gpu, cfg), gpu))
            first = rep["iterations"][0]
            rows.append(
                {
                    "host_scale": s,
                    "loop": label,
                    "ttft_first_prefill_us": first["ttft_us"],
                    "wait_first_prefill_us": first["wait_us"],
                    "ttft_second_prefill_us": rep["iterations"][1]["ttft_us"],
                    "total_us": rep["total_us"],
                    "gpu_idle_us": rep["gpu_idle_us"],
                }
            )
            bar.update()
    return rows


def figure(result: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    from experiments.figures import timeline

    fig = Figure(figsize=(13, 9.5), layout="constrained")
    grid = fig.add_gridspec(3, 2, height_ratios=[1, 1, 1.1])
    ax_a, ax_b = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    ax_c, ax_d = fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    ax_t = fig.add_subplot(grid[2, :])

    rows = result["decode"]
    hx = [r["host_us"] / 1e3 for r in rows]
    ax_a.plot(hx, [r["overlap_us"] / 1e3 for r in rows], "o", label="overlap (simulated)")
    ax_a.plot(hx, [r["normal_us"] / 1e3 for r in rows], "s", label="--disable-overlap-schedule")
    ax_a.plot(
        hx, [max(r["gpu_us"], r["host_us"]) / 1e3 for r in rows], "-", lw=1, label="max(GPU, host)"
    )
    ax_a.plot(
        hx, [(r["gpu_us"] + r["host_us"]) / 1e3 for r in rows], "--", lw=1, label="GPU + host"
    )
    ax_a.axvline(rows[0]["gpu_us"] / 1e3, color="grey", lw=0.6, ls=":")
    ax_a.set_xscale("log")
    ax_a.set_yscale("log")
    ax_a.set_xlabel("host time per iteration (ms)")
    ax_a.set_ylabel("iteration time (ms)")
    ax_a.set_title(
        "(a) decode, DeepSeek-V2-Lite EP8, 32 req, H100: host cost x0.25..x32",
        fontsize=9,
        loc="left",
    )
    ax_a.legend(fontsize=7)
    ax_a.grid(alpha=0.3, which="both")

    v3 = result["v3"]
    xs = [r["requests_per_gpu"] for r in v3]
    ax_b.plot(xs, [100 * (r["speedup"] - 1) for r in v3], "o-", label="overlap speed-up (%)")
    ax_b.plot(
        xs, [100 * r["host_us"] / r["gpu_us"] for r in v3], "s--", label="host / GPU time (%)"
    )
    ax_b.set_xscale("log", base=2)
    ax_b.set_xlabel("decode requests per GPU (4K context)")
    ax_b.set_ylabel("%")
    ax_b.set_title("(b) DeepSeek-V3 EP32 on H800, default host costs", fontsize=9, loc="left")
    ax_b.legend(fontsize=7)
    ax_b.grid(alpha=0.3)

    tt = result["ttft"]
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
        "(c) a prefill (8x32 tokens) joining a running decode batch", fontsize=9, loc="left"
    )
    ax_c.legend(fontsize=7)
    ax_c.grid(alpha=0.3)

    cons = result["consecutive"]
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
        ax_d.plot(pos, [v["total_us"] / 1e3 / 5 for v in vals], "k_", ms=14)
    ax_d.set_xticks(
        [i + 0.4 - width / 2 for i in range(len(scales))], [f"host x{s}" for s in scales]
    )
    ax_d.set_ylabel("ms  (bars: TTFT; dashes: total / 5 iterations)")
    ax_d.set_title(
        "(d) prefill, prefill, decode: SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP",
        fontsize=9,
        loc="left",
    )
    ax_d.legend(fontsize=7)
    ax_d.grid(alpha=0.3, axis="y")

    tr = result["shown"]
    t0 = min(s.start for s in tr.spans if s.step == TTFT_STEP - 1 and s.op == "recv_requests")
    t1 = max(s.end for s in tr.spans if s.step == TTFT_STEP and s.op == "send_to_detokenizer")
    pad = 0.05 * (t1 - t0)
    timeline(
        tr,
        ax=ax_t,
        window=(t0 - pad, t1 + pad),
        title=f"(e) overlap loop at host x{SHOW_SCALE}: the prefill of step {TTFT_STEP} "
        f"(recv -> forward -> D2H -> processed after step {TTFT_STEP + 1} is launched)",
    )
    fig.savefig(path.with_suffix(".png"), dpi=130)
    fig.savefig(path.with_suffix(".svg"), metadata={"Date": None})


def notes(result: dict, command: str) -> str:
    dec, v3, tt, cons = result["decode"], result["v3"], result["ttft"], result["consecutive"]

    def row_a(r):
        return (
            f"| x{r['host_scale']:g} | {r['host_us'] / 1e3:.2f} | {r['gpu_us'] / 1e3:.2f} | "
            f"{r['overlap_us'] / 1e3:.2f} | {max(r['gpu_us'], r['host_us']) / 1e3:.2f} | "
            f"{r['normal_us'] / 1e3:.2f} | {(r['gpu_us'] + r['host_us']) / 1e3:.2f} | "
            f"{100 * (r['speedup'] - 1):+.0f} % |"
        )

    def row_c(r):
        return (
            f"| x{r['host_scale']:g} | {r['iteration_us'] / 1e3:.2f} | "
            f"{r['ttft_normal_us'] / 1e3:.2f} | {r['ttft_overlap_us'] / 1e3:.2f} | "
            f"{r['ttft_cost_us'] / 1e3:+.2f} ({r['ttft_cost_iterations']:.2f} it.) | "
            f"{(r['start_delay_overlap_us'] - r['start_delay_normal_us']) / 1e3:+.2f} | "
            f"{(r['wait_overlap_us'] - r['wait_normal_us']) / 1e3:+.2f} | "
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
    worst = max(
        abs(r["overlap_us"] - max(r["gpu_us"], r["host_us"])) / max(r["gpu_us"], r["host_us"])
        for r in dec
    )
    low = [r for r in tt if r["host_scale"] <= 1]
    return f"""# CPU-GPU overlap scheduler: host time hidden up to the GPU time; TTFT cost of a prefill

Command: `{command}`  ·  {datetime.now(UTC).date()}  ·  schedule `sglang-overlap` (and its
`--disable-overlap-schedule` path), simulated. Host costs are `shared.hardware.HostCosts`
(estimates, not measurements) scaled by the factor shown; kernel launches cost `launch_us` each
(one `graph_launch_us` for a CUDA-graph decode forward).

## (a) Iteration time = max(GPU, host) with overlap, GPU + host without
DeepSeek-V2-Lite decode, 32 requests per GPU, EP8, H100. Host time per iteration = recv +
get_next_batch_to_run + the launches + processing and sending the previous batch.

| host | host ms | GPU ms | overlap ms | max(GPU, host) | normal ms | GPU + host | speed-up |
|---|---|---|---|---|---|---|---|
{chr(10).join(row_a(r) for r in dec)}

The overlap loop's iteration matches max(GPU, host) within {100 * worst:.1f} % over the sweep and
the normal loop matches GPU + host: the host work is hidden completely while it is shorter than the
forward, and once it is longer the GPU idles (forward stream gap) for the difference. The one
host block per iteration (`copy_done.synchronize()`) keeps the host exactly one step ahead.

## (b) What it buys on DeepSeek-V3 (EP32, H800, default host costs)

| requests/GPU | host ms | GPU ms | overlap ms | normal ms | speed-up |
|---|---|---|---|---|---|
{chr(10).join(f"| {r['requests_per_gpu']} | {r['host_us'] / 1e3:.2f} | {r['gpu_us'] / 1e3:.1f} | {r['overlap_us'] / 1e3:.1f} | {r['normal_us'] / 1e3:.1f} | {100 * (r['speedup'] - 1):+.1f} % |" for r in v3)}

With a 61-layer model at EP32 the forward is tens of ms and the scheduler's host work (under a few
ms with these estimates) is small beside it: overlap buys the host fraction, a few percent. It
matters where the GPU step is short (small models, small batches, fast GPUs), as in (a).

## (c) TTFT of a prefill under overlap
A cohort of 8 x 32-token prompts is prefilled, decoded twice, then a second cohort is prefilled
(step {TTFT_STEP}) and joins the decode batch. TTFT here = from the `recv_requests` of the iteration that
picks the prompt up to its first token reaching the detokenizer.

| host | overlap iteration ms | TTFT normal | TTFT overlap | cost | of which lookahead | of which deferral | iterations late (overlap / normal) |
|---|---|---|---|---|---|---|---|
{chr(10).join(row_c(r) for r in tt)}

- The token always leaves one loop iteration later under overlap (its result is processed in
  iteration {TTFT_STEP + 1}, after batch {TTFT_STEP + 1} has been scheduled and launched; the normal loop
  processes it in iteration {TTFT_STEP}): the seed's "one iteration".
- In time, at default-ish host costs (x{low[0]["host_scale"]:g}..x1) the cost is
  {min(r["ttft_cost_iterations"] for r in low):.2f}-{max(r["ttft_cost_iterations"] for r in low):.2f}
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
{chr(10).join(row_d(r) for r in cons)}

SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP processes the first prefill before launching the
second. It helps the first prefill's TTFT only by the host work that overlap puts between that
prefill's forward and its processing beyond what the forward hides (here: scheduling the second
prefill and launching its eager forward, one launch per kernel, longer than this short prefill's
forward): {switch_text}. It costs the GPU the idle time of processing the first result before the
second forward can be launched, and the second prefill's TTFT.

## Where the model disagrees with the seed, and why
- The seed (001 §7, Q5) says the deferred prefill's first token waits one more iteration of GPU
  forward time. The model agrees on the count (one loop iteration) but in time the cost is the
  lookahead (the forward starting one forward later) when the GPU is the bottleneck, and the
  result's processing delay only when the host is: overlapping does not add a full forward
  between a prefill's end and its processing unless the host lags. Real schedulers also have host
  syncs the model leaves out (e.g. attention-backend planning that reads sequence lengths on the
  host), which would make the deferral closer to the seed's description.
- The D2H copy runs on the copy stream after a wait on the forward stream, as the brief and seed
  001 §3 describe; upstream's `copy_to_cpu` issues `.to("cpu", non_blocking=True)` on the current
  (forward) stream. The two differ only in whether the next forward queues behind a few-µs copy.
- Host costs are estimates (HostCosts); the sweep shows the shape, not SGLang's measured overhead.
  Spec-v2 draft/verify kernels and grammar mask building are not modeled (only their effect on the
  loop: the forced-serial case and the delayed sample).
- Figure (e): the loop at host x{SHOW_SCALE} around the measured prefill (host lane, schedule / forward /
  copy streams, links).
"""


def run(args: argparse.Namespace) -> dict:
    gpu = get_gpu(args.gpu)
    total = 2 * len(SCALES) + len(V3_BATCHES) + 6
    with tqdm(total=total, desc=TOPIC) as bar:
        dec = decode_sweep(gpu, bar)
        v3 = v3_sweep(bar)
        tt, shown = ttft_sweep(gpu, bar)
        cons = consecutive(gpu, bar)
    return {
        "gpu": gpu.name,
        "decode": dec,
        "v3": v3,
        "ttft": tt,
        "consecutive": cons,
        "shown": shown,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="h100", help="GPU of sweeps (a), (c), (d)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m experiments.exp_cpu_overlap " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    payload = {
        "topic": TOPIC,
        "command": command.strip(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "host_costs": dataclasses.asdict(HostCosts()),
        **{k: v for k, v in result.items() if k != "shown"},
    }
    (args.out / f"{TOPIC}.json").write_text(json.dumps(payload, indent=1) + "\n")
    figure(result, args.out / f"{TOPIC}.png")
    (args.out / f"{TOPIC}.md").write_text(notes(result, command.strip()))
    print((args.out / f"{TOPIC}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
