"""GPU validation of the real executor, in one call: ``python -m overlap_lab.experiments.gpu_validation``.

What a session with a GPU runs (one device call, within its 10-minute limit):
1. ``pytest -m gpu tests/`` (the GPU tests: Triton GEMMs within SM budgets, the sync-free
   low-latency path, CUDA-graph capture, the emulated link kernels, every schedule vs serial);
2. ``overlap-lab run --schedule S --backend emulated --device cuda --json`` for every schedule at
   two decode batch sizes (the same code path, called in-process so one CUDA context serves all
   runs; each run's failure is recorded, not fatal);
3. writes ``experiments/results/gpu_<device>.json``: device, SMs, driver, CUDA, torch / triton /
   deep_ep / deep_gemm versions (and which wheels provide them), date, git commit, the pytest
   outcome and, per schedule and batch, the measured step times (median and all repeats),
   exposed communication, the CUDA-graph mode and the SM-budget mechanisms used.
Commit that file (and nothing from ``--out``, which holds traces and figures).

Without a CUDA GPU it prints one line saying so and exits with status 2, running nothing.
Options: ``--batches 32,128``, ``--layers 4``, ``--modes decode[,prefill]``, ``--schedules a,b``,
``--repeats 5``, ``--warmup 2``, ``--budget-s 540`` (runs left when the budget is spent are
recorded as skipped), ``--skip-pytest``, ``--out DIR``, ``--results DIR``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import io
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = "gpu_validation: no CUDA GPU found; nothing was run (run it in a session with a GPU)"


def _cmd(args: list[str], timeout: float = 20) -> str | None:
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def device_preset(name: str) -> str:
    """The shared.hardware preset of a device name ("NVIDIA H100 80GB HBM3" -> "h100")."""
    for p in ("h200", "h100", "h800", "h20", "b200", "gb200", "a100"):
        if p in name.lower().replace(" ", ""):
            return p
    return "h100"


def environment() -> dict:
    import torch

    from overlap_lab.real.deps import probe

    props = torch.cuda.get_device_properties(0)
    deps = probe()
    return {
        "device": props.name,
        "num_sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "driver": _cmd(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "versions": {k: v.get("version") for k, v in deps.items()},
        "importable": {k: v.get("importable") for k, v in deps.items()},
        "distributions": {k: v.get("distribution") for k, v in deps.items()},
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "commit": _cmd(["git", "rev-parse", "HEAD"]),
        "dirty": bool(_cmd(["git", "status", "--porcelain"])),
    }


def run_pytest(timeout: float) -> dict:
    t = time.time()
    try:
        r = subprocess.run(
            [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "tests/"],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "seconds": round(time.time() - t, 1)}
    out = r.stdout.strip().splitlines()
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", out[-1])}
    return {
        "status": "ok" if r.returncode == 0 else f"exit {r.returncode}",
        "counts": counts if out else {},
        "seconds": round(time.time() - t, 1),
        "tail": out[-25:],
    }


def run_one(schedule: str, mode: str, batch: int, opts) -> dict:
    """``overlap-lab run --schedule ... --backend emulated --json``, in-process."""
    from overlap_lab.experiments.cli import parser

    argv = [
        "run", "--schedule", schedule, "--backend", "emulated", "--device", "cuda",
        "--gpu", opts.gpu, "--mode", mode, "--batch", str(batch), "--layers", str(opts.layers),
        "--repeats", str(opts.repeats), "--warmup", str(opts.warmup),
        "--out", str(Path(opts.out) / f"{mode}_b{batch}"), "--json",
    ]  # fmt: skip
    args = parser().parse_args(argv)
    buf, err = io.StringIO(), io.StringIO()
    t = time.time()
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
            rc = args.func(args)
    except Exception as e:  # recorded; the next run goes on
        return {"error": f"{type(e).__name__}: {e}"[:500], "seconds": round(time.time() - t, 1)}
    res: dict = {"command": "overlap-lab " + " ".join(argv), "rc": rc}
    try:
        res.update(json.loads(buf.getvalue()))
    except json.JSONDecodeError:
        res["stdout"] = buf.getvalue()[-500:]
    if err.getvalue().strip():
        res["stderr"] = err.getvalue()[-500:]
    res["seconds"] = round(time.time() - t, 1)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="32,128")
    p.add_argument("--modes", default="decode")
    p.add_argument("--schedules", default=None, help="default: every available schedule")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gpu", default=None, help="shared.hardware preset (default: from the name)")
    p.add_argument("--budget-s", type=float, default=540.0)
    p.add_argument("--pytest-timeout-s", type=float, default=240.0)
    p.add_argument("--skip-pytest", action="store_true")
    p.add_argument("--out", default=str(ROOT / "overlap-lab-out" / "gpu_validation"))
    p.add_argument("--results", default=str(ROOT / "experiments" / "results"))
    opts = p.parse_args(argv)
    if str(ROOT) not in sys.path:  # run as a script: python experiments/gpu_validation.py
        sys.path.insert(0, str(ROOT))
    try:
        import torch
    except ImportError:
        print(NO_GPU + " (torch is not installed)")
        return 2
    if not torch.cuda.is_available():
        print(NO_GPU)
        return 2
    t0 = time.time()
    env = environment()
    opts.gpu = opts.gpu or device_preset(env["device"])
    print(f"gpu_validation on {env['device']} ({env['num_sms']} SMs), preset {opts.gpu}")
    report: dict = {"environment": env, "preset": opts.gpu, "backend": "emulated"}
    report["pytest_gpu"] = (
        {"status": "skipped"} if opts.skip_pytest else run_pytest(opts.pytest_timeout_s)
    )
    print(
        f"pytest -m gpu: {report['pytest_gpu'].get('status')} {report['pytest_gpu'].get('counts', '')}"
    )
    from overlap_lab.shared import schedules as S

    names = opts.schedules.split(",") if opts.schedules else S.available()
    runs: dict = {}
    for mode in opts.modes.split(","):
        for batch in [int(b) for b in opts.batches.split(",")]:
            for name in names:
                key = f"{mode}/b{batch}/{name}"
                if time.time() - t0 > opts.budget_s:
                    runs[key] = {"skipped": f"time budget of {opts.budget_s:.0f} s spent"}
                    continue
                r = runs[key] = run_one(name, mode, batch, opts)
                step = r.get("step_time_us")
                print(f"{key:32s} " + (f"step {step:.1f} us" if step else str(r)[:160]))
    report["runs"] = runs
    report["seconds"] = round(time.time() - t0, 1)
    out = Path(opts.results) / f"gpu_{opts.gpu}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    ok = report["pytest_gpu"].get("status") in ("ok", "skipped") and all(
        "error" not in r and r.get("rc", 0) == 0 for r in runs.values()
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
