"""TBO against serial decode: slower at small batches, faster at large ones.

SGLang's large-scale EP deployment of DeepSeek-V3 (H800-class nodes, DeepEP low-latency kernels,
DP attention) reports TBO at about -27 % throughput at 32 tokens per GPU, break-even around
64-128 and about +25 % at 256 (seed 000 §5: "too small a batch can make TBO slower"). This sweeps
tokens per GPU on DeepSeek-V3 / H800 at EP 32 and EP 72's nearest divisor of 256 experts, EP 64
(the sizes SGLang ran: 4 and 9 decode nodes), simulates serial and TBO (and TBO+SBO for
reference), and reports the step time, the change in throughput ``serial / tbo - 1`` and where
the difference comes from (the exposed communication and the GPU time of the compute kernels).

Run: ``python -m experiments.exp_tbo_decode`` (about 20 s on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from tqdm import tqdm

from shared.hardware import get_gpu
from shared.schedules import build
from shared.trace import Trace
from shared.workload import Batch, Parallel, Workload, get_model
from sim import simulate

TOPIC = "tbo_decode"
RESULTS = Path(__file__).parent / "results"
SCHEDULES = ("serial", "tbo", "tbo+sbo")
TOKENS = (8, 16, 32, 64, 128, 256, 512)
EPS = (32, 64)
CONTEXT = 4096
SHOW = (32, 256)  # tokens per GPU whose MoE layer is drawn (EP 32)


def workload(tokens: int, ep: int) -> Workload:
    return Workload(get_model("deepseek-v3"), Batch.decode(tokens, kv_len=CONTEXT), Parallel(ep=ep))


def compute_busy_us(trace: Trace) -> float:
    """GPU time spent in compute kernels (sum over kernels, overlap counted once per stream)."""
    return sum(s.end - s.start for s in trace.spans if s.kind == "compute")


def layer_clip(trace: Trace, layer: int) -> Trace:
    """Spans of one MoE layer period (mb 0's first kernel of ``layer`` to that of ``layer + 1``),
    moved to start at 0, host lanes dropped."""

    def start(L: int) -> float:
        return min(s.start for s in trace.spans if s.layer == L and s.mb == 0)

    t0, t1 = start(layer), start(layer + 1)
    spans = [
        replace(s, start=max(s.start, t0) - t0, end=min(s.end, t1) - t0)
        for s in trace.spans
        if s.end > t0 and s.start < t1 and not s.lane.startswith("host")
    ]
    return Trace(tuple(spans), dict(trace.meta))


def run(args: argparse.Namespace) -> dict:
    gpu = get_gpu(args.gpu)
    model = get_model("deepseek-v3")
    layer = (model.first_k_dense + model.num_layers) // 2
    rows, shown = [], {}
    cases = [(ep, n) for ep in args.ep for n in args.tokens]
    bar = tqdm(total=len(cases) * len(SCHEDULES), desc=TOPIC)
    for ep, n in cases:
        w = workload(n, ep)
        for name in SCHEDULES:
            program = build(name, w, gpu)
            trace = simulate(program, gpu)
            rows.append(
                {
                    "schedule": name,
                    "ep": ep,
                    "tokens_per_gpu": n,
                    "step_time_us": trace.step_time_us,
                    "exposed_comm_us": trace.exposed_comm_us(),
                    "comm_only_us": trace.comm_only_us(),
                    "compute_kernel_us": compute_busy_us(trace),
                    "kernels": sum(1 for s in trace.spans if s.lane.startswith("stream:")),
                    "micro_batches": program.meta.get("micro_batches"),
                    "fallback_reason": program.meta.get("fallback_reason"),
                }
            )
            if ep == args.ep[0] and n in SHOW and name in ("serial", "tbo"):
                shown[f"{name} {n} tok/GPU"] = layer_clip(trace, layer)
            bar.update()
    bar.close()
    base = {(r["ep"], r["tokens_per_gpu"]): r for r in rows if r["schedule"] == "serial"}
    for r in rows:
        s = base[(r["ep"], r["tokens_per_gpu"])]
        r["throughput_change"] = s["step_time_us"] / r["step_time_us"] - 1
    return {"rows": rows, "shown": shown, "layer": layer, "gpu": gpu.name}


def break_even(rows: list[dict], ep: int, name: str = "tbo") -> float | None:
    """Tokens per GPU where the throughput change crosses zero (log-linear interpolation)."""
    import math

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


def figure(result: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    rows = result["rows"]
    fig = Figure(figsize=(11, 4), layout="constrained")
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
    ax.plot([32, 256], [-27, 25], "k*", ms=12, label="SGLang reported (-27 %, +25 %)")
    ax.axvspan(64, 128, color="grey", alpha=0.15, label="SGLang break-even 64-128")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode tokens per GPU (4K context)")
    ax.set_ylabel("throughput change vs serial (%)")
    ax.set_title(f"TBO decode, DeepSeek-V3 on {result['gpu']}", fontsize=9, loc="left")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
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
    ax2.set_title(f"EP{ep}: step time and exposed communication", fontsize=9, loc="left")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=7)
    for suffix in (".png", ".svg"):
        fig.savefig(
            path.with_suffix(suffix), dpi=150, metadata={"Date": None} if suffix == ".svg" else {}
        )


def notes(result: dict, command: str) -> str:
    rows = result["rows"]
    ep = min(r["ep"] for r in rows)
    tab = [
        "| tokens/GPU | "
        + " | ".join(
            f"serial EP{e} (ms) | TBO EP{e} | TBO+SBO EP{e}"
            for e in sorted({r["ep"] for r in rows})
        )
        + " |"
    ]
    tab.append("|" + "---|" * (1 + 3 * len({r["ep"] for r in rows})))
    for n in sorted({r["tokens_per_gpu"] for r in rows}):
        cells = []
        for e in sorted({r["ep"] for r in rows}):
            by = {r["schedule"]: r for r in rows if r["ep"] == e and r["tokens_per_gpu"] == n}
            cells += [
                f"{by['serial']['step_time_us'] / 1e3:.1f}",
                f"{100 * by['tbo']['throughput_change']:+.0f} %",
                f"{100 * by['tbo+sbo']['throughput_change']:+.0f} %",
            ]
        tab.append(f"| {n} | " + " | ".join(cells) + " |")
    be = {e: break_even(rows, e) for e in sorted({r["ep"] for r in rows})}
    small = {r["schedule"]: r for r in rows if r["ep"] == ep and r["tokens_per_gpu"] == 32}
    big = {r["schedule"]: r for r in rows if r["ep"] == ep and r["tokens_per_gpu"] == 256}
    return f"""# TBO decode: throughput against serial

Command: `{command}`  ·  {datetime.now(UTC).date()}  ·  DeepSeek-V3, {result["gpu"]}, 4K context,
DeepEP low-latency kernels, CUDA graph (both micro-batches in one graph), DeepSeek decode strategy
(6 stages, delta 2). Throughput change = serial step / TBO step - 1.

{chr(10).join(tab)}

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
- TBO+SBO is below TBO here: SBO's combine on {get_gpu(result["gpu"]).sbo_comm_sms} SMs is slower than the 128-SM low-latency combine,
  and under TBO the other micro-batch's full-GPU kernels keep the comm SMs from being granted
  (the simulator does not let a 3-SM kernel in between the blocks of a running kernel), so the
  combine's tail is exposed instead of hidden. On real GPUs blocks of a running kernel retire and
  free SMs, so this penalty is an upper bound.

## Where it disagrees with the published numbers, and why
- The magnitudes depend on the cost model's per-kernel floor and launch costs and on the
  RDMA bandwidth figure (DeepEP's measured ~46 GB/s); none were tuned for this experiment.
- The model's routing is balanced and has no straggler: real decode steps wait for the slowest
  rank in each all-to-all, which penalises serial (whose waits are exposed) more than TBO, so the
  measured gain at large batches can exceed the model's.
- SGLang measured whole-server throughput (with the CPU-GPU overlap scheduler and MTP off/on); the
  model compares one decode step of one rank.
- Figure `{TOPIC}_timeline.png`: one MoE layer of serial and TBO at {SHOW[0]} and {SHOW[1]} tokens/GPU.
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="h800")
    ap.add_argument("--ep", type=lambda s: [int(x) for x in s.split(",")], default=list(EPS))
    ap.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=list(TOKENS))
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m experiments.exp_tbo_decode " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    payload = {
        "topic": TOPIC,
        "command": command.strip(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "gpu": result["gpu"],
        "layer_drawn": result["layer"],
        "break_even_tokens": {str(e): break_even(result["rows"], e) for e in args.ep},
        "rows": result["rows"],
    }
    (args.out / f"{TOPIC}.json").write_text(json.dumps(payload, indent=1))
    figure(result, args.out / f"{TOPIC}.png")
    if result["shown"]:
        from experiments.figures import compare_timelines

        compare_timelines(result["shown"], args.out / f"{TOPIC}_timeline.png")
    (args.out / f"{TOPIC}.md").write_text(notes(result, command.strip()))
    print((args.out / f"{TOPIC}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
