"""``Result.as_dict``'s provenance (``sim.calibrate.cost_sources``) looks each distinct op up
once: it must count every launch of every rank, as a lookup per launch does."""

from __future__ import annotations

import pytest

import overlap_lab as ol
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model, with_layers
from overlap_lab.shared.ir.program import ops_of
from overlap_lab.sim.calibrate import cost_sources
from overlap_lab.sim.cost import duration_source


def _w(ep: int = 16) -> Workload:
    m = with_layers(get_model("deepseek-v3"), 3)
    return Workload(m, Batch.decode(32, kv_len=1024), Parallel(ep=ep))


@pytest.mark.parametrize(
    "schedule,ranks,imbalance,profile",
    [
        ("tbo", "explicit", "zipf:1.2", "auto"),
        ("sbo", "explicit", "zipf:1.2", "roofline"),
        ("deepseek", "explicit", "balanced", "auto"),
        ("tbo", "symmetric", "balanced", "auto"),
    ],
)
def test_cost_sources_count_every_launch(schedule, ranks, imbalance, profile):
    res = ol.simulate(schedule, _w(), "h800", ranks=ranks, imbalance=imbalance, profile=profile)
    want: dict[str, dict[str, int]] = {}
    for _, op in ops_of(res.program):  # one lookup per launch
        by = want.setdefault(op.op_class, {})
        src = duration_source(op, res.gpu, res.profile)
        by[src] = by.get(src, 0) + 1
    assert cost_sources(res.program, res.gpu, res.profile) == want
    assert res.as_dict()["cost_sources"] == want  # reduced runs: rank 0's counts x the ranks
    assert sum(n for by in want.values() for n in by.values()) == ol.api.num_ops(res.program)
