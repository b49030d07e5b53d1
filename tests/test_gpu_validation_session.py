"""The GPU session's plumbing, on the CPU: the GPU tests leave what finished when stopped at
their limit (the H200 session of 2026-11-27 lost a whole call's test output to a timeout), and
experiments/gpu_session.sh fits one ten-minute call."""

from __future__ import annotations

import importlib
import re
import shlex
import sys
from pathlib import Path

# the module, not the package's ``environment`` function of the same name
E = importlib.import_module("overlap_lab.experiments.gpu_validation.environment")

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "gpu_session.sh"


def test_gpu_tests_stopped_at_their_limit_keep_what_finished(tmp_path, monkeypatch):
    slow = "print('tests/test_real_gpu.py::test_a PASSED', flush=True); import time; time.sleep(60)"
    seen = []

    def argv(per_test_s, select):
        seen.append(select)
        return [sys.executable, "-c", slow]

    monkeypatch.setattr(E, "pytest_argv", argv)
    got = E.run_pytest(6.0, tmp_path / "gpu.log")
    assert got["status"] == "timeout"
    assert got["phases"]["tests"]["tests"] == {"test_a": "passed"}
    assert got["counts"] == {"passed": 1}
    assert got["phases"]["deep_gemm_jit"]["status"].startswith("not run")
    assert seen == [f"not {E.JIT_TEST}"]  # DeepGEMM's JIT test never runs before the others
    assert "test_a PASSED" in (tmp_path / "gpu.log").read_text()


def test_the_jit_test_runs_last_in_the_time_left(tmp_path, monkeypatch):
    seen = []

    def argv(per_test_s, select):
        seen.append((select, per_test_s))
        return [sys.executable, "-c", f"print('t.py::{select.split()[-1]} PASSED')"]

    monkeypatch.setattr(E, "pytest_argv", argv)
    got = E.run_pytest(60.0, tmp_path / "gpu.log", per_test_s=20)
    assert [s for s, _ in seen] == [f"not {E.JIT_TEST}", E.JIT_TEST]
    assert got["status"] == "ok" and got["counts"] == {"passed": 2}
    assert all(t == 20 for _, t in seen)


def test_pytest_argv_has_a_per_test_limit():
    argv = E.pytest_argv(45, "not x")
    assert "--timeout=45" in argv or "faulthandler_timeout=45" in argv
    assert argv[-3:] == ["-k", "not x", "tests/test_real_gpu.py"] and "-v" in argv


def test_the_session_fits_one_ten_minute_call():
    """Every step's hard limit, with the setup (pip, nvidia-smi: about 15 s), within the
    session's limit, itself under the call's 600 s; the decode loop first, its budget within
    its limit."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    session = int(re.search(r"SESSION_S=\$\{SESSION_S:-(\d+)\}", text)[1])
    loops = [shlex.split(line.strip()) for line in text.splitlines()
             if line.strip().startswith("loop ") and "--modes" in line]  # fmt: skip
    others = [int(n) for n in re.findall(r"^\s*if fits (\d+); then", text, re.M)]
    limits = [int(a[2]) for a in loops] + others
    assert 15 + sum(limits) <= session <= 580
    assert loops[0][1] == "bf16_decode" and "decode" in loops[0]
    for a in loops:
        assert float(a[a.index("--budget-s") + 1]) < int(a[2])


def test_the_session_runs_the_kernel_table_first_and_the_gpu_tests_last():
    """The order the session keeps: kernel table, BF16 loops, FP8 loops, interference, GPU
    tests (each later step skipped, not cut, when its limit no longer fits)."""
    text = SCRIPT.read_text()
    steps = ["gpu_session_steps kernels", "loop bf16_decode", "loop bf16_prefill",
             "loop fp8_decode", "loop fp8_prefill", "-m overlap_lab.experiments.gpu_interference",
             "gpu_session_steps pytest"]  # fmt: skip
    at = [text.index(s) for s in steps]
    assert at == sorted(at)
    assert "--kernels" not in text and "--pytest" not in text  # not inside a loop's budget


def test_the_kernel_table_step_dry_runs_on_the_cpu(tmp_path, capsys):
    """The session's kernel table step, as the session runs it, on the CPU: the table into
    results/kernels_<preset>.{json,md} (``cpu`` here), its goal line printed."""
    import json

    from overlap_lab.experiments.gpu_session_steps import main

    assert main(["kernels", "--out", str(tmp_path), "--device", "cpu"]) == 0
    goal = capsys.readouterr().out.strip()
    report = json.loads((tmp_path / "results" / "kernels_cpu.json").read_text())
    assert report["timing_meaningful"] is False and goal.startswith("GOAL ")
    assert (tmp_path / "results" / "kernels_cpu.md").read_text().rstrip().endswith(goal)


def test_the_gpu_tests_step_writes_its_summary(tmp_path, monkeypatch):
    import json

    from overlap_lab.experiments.gpu_session_steps import main

    def argv(per_test_s, select):
        return [sys.executable, "-c", f"print('t.py::{select.split()[-1]} PASSED')"]

    monkeypatch.setattr(E, "pytest_argv", argv)
    assert main(["pytest", "--out", str(tmp_path), "--limit-s", "30"]) == 0
    got = json.loads((tmp_path / "pytest_gpu.json").read_text())
    assert got["status"] == "ok" and got["counts"] == {"passed": 2}
    assert (tmp_path / "pytest_gpu.log").is_file()


def test_the_sessions_own_steps_dry_run_through_the_readme_map(tmp_path):
    """The session's two steps as it runs them (``python3 -P -m ...`` through real/README.md's
    map of the namespace, no install), on the CPU: the kernel table's dry run writes its
    results, and the GPU tests step runs pytest -m gpu (skipping without a GPU) and writes its
    summary."""
    import json
    import os
    import subprocess

    root = SCRIPT.parents[1]
    text = (root / "real" / "README.md").read_text()
    m = re.search(r"(mkdir -p /tmp/ol/overlap_lab.*?)export PYTHONPATH", text, re.S)
    setup = m.group(1).replace("/tmp/ol", str(tmp_path / "ol")).rstrip().rstrip("&\\ \n")
    subprocess.run(["bash", "-c", setup.replace("\\\n", " ")], cwd=root, check=True)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "ol")}
    out = tmp_path / "out"
    for argv in (["kernels", "--device", "cpu"], ["pytest", "--limit-s", "120"]):
        r = subprocess.run(
            [sys.executable, "-P", "-m", "overlap_lab.experiments.gpu_session_steps", *argv,
             "--out", str(out)],
            cwd=root, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (out / "results" / "kernels_cpu.md").read_text().rstrip().endswith("meaningless]")
    got = json.loads((out / "pytest_gpu.json").read_text())
    assert got["status"] == "ok" and set(got["counts"]) <= {"skipped"}, got
