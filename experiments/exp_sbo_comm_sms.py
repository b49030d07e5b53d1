"""SBO's gain for each mode and how it depends on the communication SMs.

DeepSeek-V3 decode (DeepEP low-latency kernels, EP 32, 4K context) at 32 and 128 tokens per GPU on
H800 (preset: 3 comm SMs) and B200 (preset: 32), sweeping SGLANG_DEEPEP_LL_COMBINE_SEND_NUM_SMS
(``--comm-sms``) from 1 to 32 for SBO modes 1, 2 and 3 (mode 1 carries the shared-experts placement
SGLang pairs with it on each architecture: dispatch hook on Hopper, after the down GEMM on
Blackwell; see shared/schedules/sbo.py). The gain is ``serial / sbo - 1``.

Run: ``python -m experiments.exp_sbo_comm_sms`` (about 40 s on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

from tqdm import tqdm

from shared.hardware import get_gpu
from shared.schedules import ScheduleConfig, build
from shared.workload import Batch, Parallel, Workload, get_model
from sim import simulate

TOPIC = "sbo_comm_sms"
RESULTS = Path(__file__).parent / "results"
GPUS = ("h800", "b200")
TOKENS = (32, 128)
COMM_SMS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
MODES = (1, 2, 3)
EP = 32


def run(args: argparse.Namespace) -> dict:
    model = get_model("deepseek-v3")
    layer = (model.first_k_dense + model.num_layers) // 2
    rows = []
    total = len(args.gpus) * len(args.tokens) * (1 + len(MODES) * len(args.comm_sms))
    bar = tqdm(total=total, desc=TOPIC)
    for g in args.gpus:
        gpu = get_gpu(g)
        for n in args.tokens:
            w = Workload(model, Batch.decode(n), Parallel(ep=EP))
            serial = simulate(build("serial", w, gpu), gpu).step_time_us
            bar.update()
            for mode in MODES:
                for c in args.comm_sms:
                    cfg = ScheduleConfig(sbo_mode=mode, comm_sms=c)
                    p = build("sbo", w, gpu, cfg)
                    tr = simulate(p, gpu)
                    comb = [
                        s
                        for s in tr.spans
                        if s.layer == layer
                        and s.lane == "stream:alt"
                        and s.op.startswith("combine_a")
                    ]
                    rows.append(
                        {
                            "gpu": g,
                            "tokens_per_gpu": n,
                            "mode": mode,
                            "comm_sms": c,
                            "preset_comm_sms": gpu.sbo_comm_sms,
                            "upstream": p.meta["sbo_upstream"],
                            "overlaps": p.meta["sbo_overlaps"],
                            "serial_step_us": serial,
                            "step_time_us": tr.step_time_us,
                            "gain": serial / tr.step_time_us - 1,
                            "exposed_comm_us": tr.exposed_comm_us(),
                            "combine_send_us_layer": sum(s.end - s.start for s in comb),
                        }
                    )
                    bar.update()
    bar.close()
    return {"rows": rows, "layer": layer}


def figure(result: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    rows = result["rows"]
    gpus = sorted({r["gpu"] for r in rows}, key=GPUS.index)
    tokens = sorted({r["tokens_per_gpu"] for r in rows})
    fig = Figure(figsize=(11, 3.6 * len(tokens)), layout="constrained")
    axes = fig.subplots(len(tokens), len(gpus), squeeze=False)
    for i, n in enumerate(tokens):
        for j, g in enumerate(gpus):
            ax = axes[i][j]
            for mode, style in zip(MODES, ("-o", "-s", "-^"), strict=True):
                pts = [
                    r
                    for r in rows
                    if r["gpu"] == g and r["tokens_per_gpu"] == n and r["mode"] == mode
                ]
                up = " (not run by SGLang here)" if pts and not pts[0]["upstream"] else ""
                ax.plot(
                    [r["comm_sms"] for r in pts],
                    [100 * r["gain"] for r in pts],
                    style,
                    label=f"mode {mode}{up}",
                )
            preset = get_gpu(g).sbo_comm_sms
            ax.axvline(preset, color="grey", ls=":", label=f"preset {preset} SMs")
            ax.axhline(0, color="k", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("combine communication SMs (--comm-sms)")
            ax.set_ylabel("step-time gain vs serial (%)")
            ax.set_title(f"SBO, DeepSeek-V3 EP{EP} decode {n} tok/GPU, {g}", fontsize=9, loc="left")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    for suffix in (".png", ".svg"):
        fig.savefig(
            path.with_suffix(suffix), dpi=150, metadata={"Date": None} if suffix == ".svg" else {}
        )


def notes(result: dict, command: str) -> str:
    rows = result["rows"]

    def get(g, n, mode, c):
        return next(
            r
            for r in rows
            if (r["gpu"], r["tokens_per_gpu"], r["mode"], r["comm_sms"]) == (g, n, mode, c)
        )

    lines = [
        "| GPU | tokens/GPU | mode | gain at preset SMs | best gain (SMs) | gain at 1 SM | gain at 32 SMs |",
        "|---|---|---|---|---|---|---|",
    ]
    for g in sorted({r["gpu"] for r in rows}, key=GPUS.index):
        preset = get_gpu(g).sbo_comm_sms
        for n in sorted({r["tokens_per_gpu"] for r in rows}):
            for mode in MODES:
                pts = [
                    r for r in rows if (r["gpu"], r["tokens_per_gpu"], r["mode"]) == (g, n, mode)
                ]
                best = max(pts, key=lambda r: r["gain"])
                at = {r["comm_sms"]: r["gain"] for r in pts}
                flag = "" if pts[0]["upstream"] else " (what-if)"
                lines.append(
                    f"| {g} | {n} | {mode}{flag} | "
                    f"{100 * at[preset]:+.1f} % | {100 * best['gain']:+.1f} % ({best['comm_sms']}) | "
                    f"{100 * at[min(at)]:+.1f} % | {100 * at[max(at)]:+.1f} % |"
                )
    h1 = get("h800", 128, 1, 3) if any(r["gpu"] == "h800" for r in rows) else None
    return f"""# SBO: gain per mode and its dependence on the communication SMs

Command: `{command}`  ·  {datetime.now(UTC).date()}  ·  DeepSeek-V3 decode, EP{EP}, 4K context,
DeepEP low-latency kernels, CUDA graph. Gain = serial step / SBO step - 1.

{chr(10).join(lines)}

## What the model shows
- SBO's gains are a few percent to ~13 %: mode 3 hides the shared experts under the dispatch
  transfer; mode 1 additionally starts the combine's transfer while the down GEMM is still running
  (its first block leaves after a quarter of the GEMM instead of after all of it, plus the send
  kernel's own time), which matters most at small batches where the per-layer chain is short.
  Mode 2 on its own only hides the shared experts under the combine.
- Mode 3 does not depend on the comm SMs: nothing runs on the alt stream.
- Modes 1 and 2 depend on the comm SMs only below a few SMs: with DeepEP's low-latency combine the
  RDMA transfer, not the send kernel, bounds the combine, so once the send kernel is faster than
  the transfer (about 3 SMs on H800, 1 on B200 in this model) more SMs change nothing, and the SMs
  they take from the down GEMM are hidden behind the same transfer. With 1 SM on H800 the send
  kernel itself becomes the bottleneck and SBO loses (-16 % at 128 tokens/GPU).
  {f"On H800 at 128 tokens, mode 1 with the preset's 3 SMs gains {100 * h1['gain']:+.1f} %; its four send pieces take {h1['combine_send_us_layer']:.0f} µs per layer in all." if h1 else ""}
- So the model supports Hopper's small preset (3 SMs): it is about the fewest SMs at which the
  send keeps up with the link. Blackwell's 32 are more than the model needs at EP 32 over RDMA;
  they would matter where the combine is NVLink-bound (a single NVL72 domain), not modelled here.

## Where it may disagree with published figures, and why
- SGLang reports SBO's gain on full servers; the model's send kernel speed on few SMs comes from
  the cost model's HBM cap per SM fraction, not from a measurement of DeepEP's combine on 3 SMs.
- The model groups the Hopper signals (num_local_experts x ceil(rows/64)) into at most 4 chunks,
  so one chunk's worth of the combine stays exposed after the down GEMM; finer streaming would
  expose less (shared/schedules/sbo.py, MAX_STREAM_CHUNKS).
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--gpus", type=lambda s: s.split(","), default=list(GPUS))
    ap.add_argument("--tokens", type=ints, default=list(TOKENS))
    ap.add_argument("--comm-sms", type=ints, default=list(COMM_SMS))
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m experiments.exp_sbo_comm_sms " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    payload = {
        "topic": TOPIC,
        "command": command.strip(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "rows": result["rows"],
    }
    (args.out / f"{TOPIC}.json").write_text(json.dumps(payload, indent=1))
    figure(result, args.out / f"{TOPIC}.png")
    (args.out / f"{TOPIC}.md").write_text(notes(result, command.strip()))
    print((args.out / f"{TOPIC}.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
