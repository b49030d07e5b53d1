"""Where the loop runs: the device and its preset, the software, the commit, and the GPU tests
(``run_pytest``) recorded in the archive beside the numbers."""

from __future__ import annotations

import datetime as _dt
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

#: The checkout's root (commit, GPU tests, default output and results folders).
ROOT = Path(__file__).resolve().parents[2]


def _cmd(args: list[str], timeout: float = 20) -> str | None:
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def device_preset(name: str) -> str:
    """The shared.inputs.hardware preset of a device name ("NVIDIA H100 80GB HBM3" -> "h100")."""
    for p in ("h200", "h100", "h800", "h20", "b200", "gb200", "a100"):
        if p in name.lower().replace(" ", ""):
            return p
    return "h100"


def environment_commit() -> str | None:
    """The checkout's commit (None outside a git checkout)."""
    return _cmd(["git", "rev-parse", "HEAD"])


def environment(device: str) -> dict:
    import torch

    from overlap_lab.real.deps import probe

    deps = probe()
    env = {
        "device_type": device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "versions": {k: v.get("version") for k, v in deps.items()},
        "distributions": {k: v.get("distribution") for k, v in deps.items()},
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "commit": environment_commit(),
        "dirty": bool(_cmd(["git", "status", "--porcelain"])),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(
            device=props.name,
            num_sms=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            driver=_cmd(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
            cuda=torch.version.cuda,
        )
    else:
        env.update(device="cpu", num_sms=None)
    return env


def run_pytest(timeout: float) -> dict:
    """``pytest -m gpu tests/test_real_gpu.py`` from the checkout (the working directory when it
    has the tests: the project may be installed elsewhere, without them)."""
    t = time.time()
    cwd = Path.cwd() if (Path.cwd() / "tests" / "test_real_gpu.py").is_file() else ROOT
    try:
        r = subprocess.run(
            [sys.executable, "-P", "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
             "tests/test_real_gpu.py"],
            capture_output=True, text=True, timeout=timeout, cwd=cwd,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "seconds": round(time.time() - t, 1)}
    out = r.stdout.strip().splitlines()
    last = out[-1] if out else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", last)}
    return {
        "status": "ok" if r.returncode == 0 else f"exit {r.returncode}",
        "counts": counts,
        "seconds": round(time.time() - t, 1),
        "tail": out[-25:],
    }
