"""EP across two gloo processes gives what one process with every expert gives."""

import pytest

pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from real.check import default_workloads  # noqa: E402
from real.distributed import run_gloo  # noqa: E402
from shared import schedules as S  # noqa: E402


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
