"""The GPU session's two steps that are not the loop (experiments/gpu_session.sh):

    python -m overlap_lab.experiments.gpu_session_steps kernels --out OUT [--device cuda|cpu]
    python -m overlap_lab.experiments.gpu_session_steps pytest --out OUT --limit-s S

``kernels``: the kernel table (``overlap-lab kernels``, ``real.kernel_table``), first in the
session, into ``OUT/results/kernels_<preset>.{json,md}`` (the name the results folder keeps;
``kernels_cpu`` for the CPU's dry run, which tests run). ``pytest``: the GPU tests, last, in the
time left (``gpu_validation.environment.run_pytest``: written to ``OUT/pytest_gpu.log`` as they
end, DeepGEMM's JIT test last), their summary into ``OUT/pytest_gpu.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def kernels(out: Path, device: str) -> Path:
    """The kernel table into ``out/results``; returns its markdown file."""
    import torch

    from overlap_lab.experiments.gpu_validation.environment import device_preset
    from overlap_lab.real.kernel_table import kernel_table, table_text

    warm, reps = (3, 10) if device == "cuda" else (0, 1)
    name = device_preset(torch.cuda.get_device_name(0)) if device == "cuda" else "cpu"
    d = out / "results"
    d.mkdir(parents=True, exist_ok=True)
    js, md = d / f"kernels_{name}.json", d / f"kernels_{name}.md"

    def write(report: dict) -> None:  # after every row: a step stopped at its limit keeps them
        js.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
        md.write_text(table_text(report))

    write(kernel_table(device, warmup=warm, repeats=reps, on_row=write))
    return md


def gpu_tests(out: Path, limit_s: float) -> dict:
    from overlap_lab.experiments.gpu_validation.environment import run_pytest

    got = run_pytest(limit_s, out / "pytest_gpu.log")
    (out / "pytest_gpu.json").write_text(json.dumps(got, indent=2) + "\n")
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m overlap_lab.experiments.gpu_session_steps")
    p.add_argument("step", choices=("kernels", "pytest"))
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--limit-s", type=float, default=60.0, help="pytest: the time it may take")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.step == "kernels":
        md = kernels(a.out, a.device)
        print(md.read_text().rstrip().rpartition("\n")[2])  # the goal line
        return 0
    got = gpu_tests(a.out, a.limit_s)
    print(f"pytest: {got['status']} {got['counts']} in {got['seconds']} s")
    return 0 if got["status"] == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main())
