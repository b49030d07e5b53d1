"""The CPU equivalence check reaches the split path of every schedule it claims to check."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from overlap_lab.real.check import (  # noqa: E402
    check_equivalence,
    default_workloads,
    split_config,
    unsplit_runs,
)
from overlap_lab.shared import schedules as S  # noqa: E402
from overlap_lab.shared.inputs.hardware import get_gpu  # noqa: E402
from overlap_lab.shared.schedules import ScheduleConfig  # noqa: E402


def test_vllm_dbo_splits_every_check_workload() -> None:
    cfg = split_config(None)
    for w in default_workloads():
        meta = S.build("vllm-dbo", w, get_gpu("h100"), cfg).meta
        assert not meta.fallback_reason, meta.fallback_reason
        assert len(meta.micro_batches) == 2


def test_check_reports_no_unsplit_vllm_dbo() -> None:
    res = check_equivalence(["serial", "vllm-dbo"], default_workloads()[:1])
    assert res.ok and "vllm-dbo" not in res.unsplit
    assert "vllm-dbo" in res.max_rel_diff_vs_serial


def test_thresholds_the_caller_set_are_kept_and_unsplit_runs_reported() -> None:
    cfg = split_config(ScheduleConfig(dbo_prefill_token_threshold=100))
    assert cfg.dbo_prefill_token_threshold == 100 and cfg.dbo_decode_token_threshold == 1
    got = unsplit_runs(["serial", "vllm-dbo"], default_workloads(), cfg=cfg)
    assert set(got) == {"vllm-dbo"} and got["vllm-dbo"].startswith("2 of 4 workloads")


def test_cli_says_when_a_schedule_ran_unsplit(capsys) -> None:
    from overlap_lab.cli.main import main

    rc = main(
        ["run", "--device", "cpu", "--check", "--schedule", "vllm-dbo",
         "--dbo-prefill-token-threshold", "100"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0 and "vllm-dbo         ran unsplit on 2 of 4 workloads" in out
