"""Where the loop runs: the device and its preset, the software, the commit, and the GPU tests
(``run_pytest``) recorded in the archive beside the numbers."""

from __future__ import annotations

import datetime as _dt
import platform
import re
import subprocess
import sys
import tempfile
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


#: The GPU test that compiles DeepGEMM's FP8 kernels (JIT, minutes on a fresh machine): run
#: after the others, in what time is left, so that it cannot take their results with it.
JIT_TEST = "test_deep_gemm_fp8_matches_bf16_when_installed"


def pytest_argv(per_test_s: float, select: str) -> list[str]:
    """The GPU tests' pytest command: verbose (one line per test as it ends, so a run stopped
    at its limit keeps what finished), ``-k select``, and a per-test limit: pytest-timeout's
    ``--timeout`` where it is installed, else pytest's own ``faulthandler_timeout`` (dumps the
    stacks of a test that runs longer, without stopping it)."""
    import importlib.util

    limit = (["-p", "pytest_timeout", f"--timeout={per_test_s:g}"]
             if importlib.util.find_spec("pytest_timeout") is not None
             else ["-o", f"faulthandler_timeout={per_test_s:g}"])  # fmt: skip
    return [sys.executable, "-P", "-m", "pytest", "-m", "gpu", "-v", "-rA", "-p",
            "no:cacheprovider", *limit, "-k", select, "tests/test_real_gpu.py"]  # fmt: skip


def run_pytest(timeout: float, log: Path | None = None, per_test_s: float = 60.0) -> dict:
    """``pytest -m gpu tests/test_real_gpu.py`` from the checkout (the working directory when it
    has the tests: the project may be installed elsewhere, without them), written to ``log`` as
    it runs: first every test but DeepGEMM's JIT one (:data:`JIT_TEST`), then that one in the
    time left. A phase stopped at the limit reports the tests that finished (``timeout``
    status, their counts and the log's tail), never nothing."""
    t = time.time()
    cwd = Path.cwd() if (Path.cwd() / "tests" / "test_real_gpu.py").is_file() else ROOT
    log = Path(log) if log is not None else Path(tempfile.gettempdir()) / "pytest_gpu.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    phases = {}
    with log.open("w") as f:
        for name, select in (("tests", f"not {JIT_TEST}"), ("deep_gemm_jit", JIT_TEST)):
            left = timeout - (time.time() - t)
            if left < 5:
                phases[name] = {"status": "not run: no time left"}
                continue
            argv = pytest_argv(per_test_s, select)
            f.write(f"== {name}: -k {select!r}, {per_test_s:g} s per test, {left:.0f} s left\n")
            f.flush()
            start = f.tell()
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=cwd)
            try:
                rc = proc.wait(timeout=left)
                status = "ok" if rc in (0, 5) else f"exit {rc}"  # 5: nothing selected
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                status = "timeout"
            f.flush()
            phases[name] = {"status": status, **_results(log.read_text()[start:])}
    statuses = [p["status"] for p in phases.values()]
    bad = [s for s in statuses if s != "ok" and not s.startswith("not run")]
    counts: dict[str, int] = {}
    for p in phases.values():
        for k, n in p.get("counts", {}).items():
            counts[k] = counts.get(k, 0) + n
    return {
        "status": bad[0] if bad else "ok",
        "counts": counts,
        "phases": phases,
        "seconds": round(time.time() - t, 1),
        "log": str(log),
        "tail": log.read_text().splitlines()[-25:],
    }


def _results(text: str) -> dict:
    """The tests a verbose pytest log says ended, by outcome (``tests/x.py::t PASSED``)."""
    got = re.findall(r"::(\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", text)
    counts: dict[str, int] = {}
    for _, outcome in got:
        counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
    return {"counts": counts, "tests": {n: o.lower() for n, o in got}}
