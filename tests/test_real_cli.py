"""overlap_lab/cli/run.py (`overlap-lab run`): the CPU check's JSON and exit codes; the one line without a GPU."""

import json
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from overlap_lab.cli.run import NO_GPU, run_main  # noqa: E402


def test_without_gpu_and_without_device_cpu_one_line(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_main(SimpleNamespace(schedule="tbo")) == 2
    assert capsys.readouterr().out.strip() == NO_GPU


def test_cpu_check_json_reports_each_schedule(capsys):
    rc = run_main(SimpleNamespace(device="cpu", check=True, json=True, schedule="serial"))
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"]
    assert out["max_rel_diff_vs_serial"] == {"serial": 0.0}


def test_cpu_check_fails_when_tolerance_exceeded(monkeypatch, capsys):
    import overlap_lab.real.check as C

    monkeypatch.setattr(C, "compare_steps", lambda states, ref: 1.0)
    rc = run_main(SimpleNamespace(device="cpu", check=True, schedule="serial"))
    assert rc == 1 and "FAIL" in capsys.readouterr().out


def test_unknown_schedule_is_a_config_error(capsys):
    assert run_main(SimpleNamespace(device="cpu", check=True, schedule="nope")) == 2
    assert "unknown schedule" in capsys.readouterr().err


def test_gpu_validation_without_a_gpu_says_so_and_runs_nothing(capsys, monkeypatch, tmp_path):
    import torch

    from overlap_lab.experiments import gpu_validation as V

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert V.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA GPU" in capsys.readouterr().out and not list(tmp_path.iterdir())
    assert V.device_preset("NVIDIA H100 80GB HBM3") == "h100"
    assert V.device_preset("NVIDIA H200") == "h200"
