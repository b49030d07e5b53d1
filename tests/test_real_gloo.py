"""EP across two gloo processes gives what one process with every expert gives."""

import pytest

pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from overlap_lab.real.check import default_workloads  # noqa: E402
from overlap_lab.real.distributed import run_gloo  # noqa: E402
from overlap_lab.shared import schedules as S  # noqa: E402


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo")
def test_ep_over_two_gloo_ranks_matches_one_process():
    w = default_workloads()
    # decode: low-latency layout, interleaved micro-batches; prefill: normal layout
    sched = "tbo" if "tbo" in S.available() else "serial"
    res = run_gloo([(sched, w[0]), ("serial", w[2])], world=2)
    assert len(res) == 4
    for r in res:
        assert r["max_rel_diff"] < 1e-5, r
    # bytes really crossed between the ranks
    assert all(sum(v.get("nvlink", 0) for v in r["traffic"].values()) > 0 for r in res)


def test_schedules_gloo_cannot_run_are_skipped_with_the_reason(monkeypatch):
    import overlap_lab.real.check as C
    from overlap_lab.real.distributed import split_cases

    w = default_workloads()[0]
    runnable, skipped = split_cases([("serial", w), ("pp", w)])
    assert [n for n, _ in runnable] == ["serial"]
    assert "non-symmetric" in skipped["pp"]  # built on its pp=2 copy: in-process ranks
    monkeypatch.setattr(C, "pp_variants", lambda w: [w])  # pp on the pp=1 workload refuses it
    assert "pp-size >= 2" in split_cases([("pp", w)])[1]["pp"]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo")
def test_cli_over_gloo_reports_skipped_schedules_and_exits_0(capsys):
    import json
    from types import SimpleNamespace

    from overlap_lab.cli.run import run_main

    args = SimpleNamespace(device="cpu", check=True, json=True, ranks=2, schedule="pp")
    rc = run_main(args)
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["ok"] and not out["errors"], out
    assert set(out["max_rel_diff_vs_one_process"]) == {"serial"} and "pp" in out["skipped"]
