"""The lowering's proof that its ranks are alike (``shared.ir.ranks``: each op's per-rank versions,
``shared.ir.symmetry.certify_alike``) must decide as matching every rank instruction by instruction
does (``shared.ir.symmetry._Matcher``), and the Reduction it lets ``reduce_program`` build must be
the matched one."""

from __future__ import annotations

import dataclasses
import gc

import pytest

from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.routing import dp_token_counts, routing_for
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model, with_layers

# symmetry._certified tested directly: whether the lowering's certificate holds
from overlap_lab.shared.ir import symmetry
from overlap_lab.shared.ir.ranks import expand_ranks
from overlap_lab.shared.ir.symmetry import Reduction, reduce_program, relabeling
from overlap_lab.shared.schedules import build

H800 = get_gpu("h800")


def _lowered(schedule: str, ep: int, imbalance: str, dp: float, mode: str = "decode"):
    m = with_layers(get_model("deepseek-v3"), 3)
    b = Batch.decode(32, kv_len=1024) if mode == "decode" else Batch.prefill(1, extend_len=1024)
    w = Workload(m, b, Parallel(ep=ep))
    dps = dp_token_counts(w.batch.num_tokens, ep, dp, 1)
    return expand_ranks(
        build(schedule, w, H800), w, H800, routing_for(w, imbalance, seed=1, dp_tokens=dps)
    )


def _matched(x) -> bool:
    sigma = relabeling(x.world, 8)
    r0 = x.ranks[0]
    return all(
        symmetry._Matcher([sigma(rp.rank, d) for d in range(x.world)]).rank(r0, rp)
        for rp in x.ranks[1:]
    )


CASES = [
    (s, ep, imb, dp, mode)
    for s in ("serial", "tbo", "sbo", "deepseek", "lightllm")
    for ep, imb, dp, mode in (
        (16, "balanced", 0.0, "decode"),
        (32, "balanced", 0.0, "decode"),
        (16, "balanced", 0.0, "prefill"),
        (16, "zipf:1.2", 0.0, "decode"),
        (16, "balanced", 0.3, "decode"),
    )
]


@pytest.mark.parametrize("schedule,ep,imbalance,dp,mode", CASES)
def test_certificate_decides_as_matching(schedule, ep, imbalance, dp, mode):
    x = _lowered(schedule, ep, imbalance, dp, mode)
    assert symmetry._certified(x, 8) == _matched(x)
    if imbalance == "balanced" and dp == 0:
        assert symmetry._certified(x, 8)  # the case the proof is for
    # a copy is a new object: not certified, so reduce_program matches it rank by rank
    copy = dataclasses.replace(x)
    assert not symmetry._certified(copy, 8)
    a, b = reduce_program(x, 8), reduce_program(copy, 8)
    assert isinstance(a, Reduction) == isinstance(b, Reduction)
    if isinstance(a, Reduction):
        assert (a.program, a.bundles, a.why, a.world) == (b.program, b.bundles, b.why, b.world)
    else:
        assert a == b


def test_certificate_is_for_its_topology_and_lifetime():
    x = _lowered("tbo", 16, "balanced", 0.0)
    assert symmetry._certified(x, 8) and not symmetry._certified(x, 4)
    key = id(x)
    del x
    gc.collect()
    assert key not in symmetry._CERTIFIED
