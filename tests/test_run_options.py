"""`run --device cpu --check` honours or refuses every option (issue 11, item 8)."""

from __future__ import annotations

import importlib.util

import pytest

from overlap_lab.cli.main import main
from overlap_lab.measure import CPU_CHECK_REFUSES, INSTALL_REAL


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "option",
    [
        ["--batch", "8"],
        ["--kv-len", "128"],
        ["--mode", "prefill"],
        ["--ep", "16"],
        ["--layers", "2"],
        ["--mtp", "0"],
        ["--pp-size", "2"],
        ["--backend", "torch"],
        ["--out", "elsewhere"],
        ["--repeats", "3"],
        ["--model", "qwen3-30b-a3b"],
    ],
)
def test_cpu_check_refuses_options_it_cannot_honour(capsys, option):
    pytest.importorskip("torch")
    code, _, err = run(capsys, "run", "--device", "cpu", "--check", *option)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and option[0] in lines[0], err


def test_every_workload_option_is_either_honoured_or_refused():
    from overlap_lab.cli.main import parser

    run_opts = set(vars(parser().parse_args(["run"])))
    honoured = {
        "command",
        "func",
        "schedule",
        "device",
        "check",
        "ranks",
        "tolerance",
        "seed",
        "json",
        "model",
        "gpu",
        "gpu_file",
        "kernels",  # the kernel families preferred: both sides of every comparison run them
    }
    # schedule knobs reach the check through cfg, hardware overrides through the GPU
    from dataclasses import fields

    from overlap_lab.shared.inputs.hardware import GPU, HostCosts
    from overlap_lab.shared.schedules import schedule_knobs

    honoured |= {k.name for k in schedule_knobs()} | {f.name for f in fields(GPU)}
    honoured |= {"host_" + f.name for f in fields(HostCosts)}
    assert run_opts - honoured - set(CPU_CHECK_REFUSES) == set()


def test_without_torch_the_exact_install_command(capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a)
    )
    code, _, err = run(capsys, "run", "--device", "cpu", "--check")
    assert code == 2 and INSTALL_REAL in err and "torch==2.13.0" in INSTALL_REAL
    assert len(err.strip().splitlines()) == 1
