"""Issue 12: explicit ranks that cannot differ are simulated once (shared/ir/symmetry.py).

The reduced run must be the full explicit run: same step time and every rank's per-lane busy
time (to 1e-9 relative: the reduced run sends an op's equal flows of one link kind as one flow,
which changes float round-off only; bit for bit when that merge is off), on every schedule, decode
and prefill, EP 16 and 32. Routing or DP imbalance that makes ranks differ must not be reduced.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

import overlap_lab as ol
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.routing import dp_token_counts, routing_for
from overlap_lab.shared.inputs.topology import Topology
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model, with_layers
from overlap_lab.shared.ir.program import Graph, HostThread, Launch
from overlap_lab.shared.ir.ranks import expand_ranks
from overlap_lab.shared.ir.symmetry import Reduction, expand_trace, reduce_program, relabeling
from overlap_lab.shared.outputs.trace import Trace
from overlap_lab.shared.schedules import build
from overlap_lab.sim import simulate
from overlap_lab.sim.engine import Engine

H800 = get_gpu("h800")
SCHEDULES = (
    "serial",
    "sglang-overlap",
    "sbo",
    "tbo",
    "tbo+sbo",
    "lightllm",
    "vllm-dbo",
    "deepseek",
)
REL = 1e-9


def _workload(mode: str, ep: int, layers: int = 3) -> Workload:
    m = with_layers(get_model("deepseek-v3"), layers)  # one dense layer, the rest MoE
    b = Batch.decode(32, kv_len=1024) if mode == "decode" else Batch.prefill(1, extend_len=1024)
    return Workload(m, b, Parallel(ep=ep))


def _explicit(schedule: str, w: Workload, imbalance: str = "balanced", dp=None):
    p = build(schedule, w, H800)
    return expand_ranks(p, w, H800, routing_for(w, imbalance, seed=3, dp_tokens=dp))


def _reduced(x, **kw) -> tuple[Reduction, Trace]:
    red = reduce_program(x, 8, **kw)
    assert isinstance(red, Reduction), red
    return red, expand_trace(simulate(red.program, H800), red)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * max(abs(a), abs(b), 1e-12)


@pytest.mark.parametrize(
    "schedule,mode,ep", list(itertools.product(SCHEDULES, ("decode", "prefill"), (16, 32)))
)
def test_reduced_run_is_the_explicit_run(schedule, mode, ep):
    w = _workload(mode, ep)
    x = _explicit(schedule, w)
    red, got = _reduced(x)
    full = Engine(x, H800, 0).run()  # exact network (no grouping tolerance)
    assert red.program.symmetric and len(red.program.ranks) == 1
    assert got.meta["reduction"].startswith("reduced") and got.meta["world"] == ep
    assert got.ranks == full.ranks == tuple(range(ep))
    assert len(got.spans) == len(full.spans)
    assert _close(got.step_time_us, full.step_time_us)
    bf, bg = full.busy_us(), got.busy_us()
    assert list(bf) == list(bg)  # every rank, every lane, in the same order
    bad = {k: (bf[k], bg[k]) for k in bf if not _close(bf[k], bg[k])}
    assert not bad
    pf, pg = full.per_rank_step_us(), got.per_rank_step_us()
    assert all(_close(pf[r], pg[r]) for r in pf)


@pytest.mark.parametrize("schedule,mode", [("tbo", "prefill"), ("deepseek", "decode")])
def test_reduced_run_without_flow_merge_is_bit_identical(schedule, mode):
    """One flow per peer, as the explicit op has: the quotient's per-flow link spans merge back
    into the network's per-op spans, and the Trace equals the explicit run's span for span."""
    x = _explicit(schedule, _workload(mode, 16))
    red, got = _reduced(x, merge_flows=False)
    assert any(n > 1 for b in red.bundles.values() for n in b.values())
    full = Engine(x, H800, 0).run()
    assert got.spans == full.spans
    assert got.spans == Trace(got.spans).spans  # built in canonical order


def test_explicit_run_with_grouping_tolerance_agrees():
    """The api's full run groups network completions (2 %); balanced flows of an op end
    together, so it agrees with the (exact) reduced run here."""
    w = _workload("decode", 32)
    x = _explicit("tbo", w)
    _, got = _reduced(x)
    full = Engine(x, H800, 0, net_group_tol=ol.api.NET_GROUP_TOL).run()
    assert _close(got.step_time_us, full.step_time_us)


@pytest.mark.parametrize(
    "imbalance,spread", [("zipf:1.2", 0.0), ("zipf:0", 0.0), ("balanced", 0.3)]
)
def test_ranks_that_differ_are_not_reduced(imbalance, spread):
    w = _workload("decode", 16)
    dp = dp_token_counts(w.batch.num_tokens, 16, spread, 3)
    x = _explicit("tbo", w, imbalance, dp)
    why = reduce_program(x, 8)
    assert isinstance(why, str) and "differs from rank 0" in why


def test_one_changed_op_on_one_rank_is_not_reduced():
    """Detection is exact: one expert GEMM one ulp heavier on rank 5 is enough."""
    x = _explicit("serial", _workload("decode", 16))
    rp = x.ranks[5]

    def bump(instrs):  # the first expert GEMM, inside a CUDA graph or not
        out, done = [], False
        for ins in instrs:
            if not done and isinstance(ins, Graph):
                body, done = bump(ins.body)
                ins = Graph(ins.name, body)
            elif not done and isinstance(ins, Launch) and ins.op.name.startswith("experts"):
                op = dataclasses.replace(ins.op, flops=ins.op.flops * (1 + 2**-52))
                ins, done = Launch(op, ins.stream), True
            out.append(ins)
        return tuple(out), done

    threads, hit = [], False
    for th in rp.threads:
        instrs, done = bump(th.instrs)
        hit |= done
        threads.append(HostThread(th.name, instrs))
    assert hit
    ranks = list(x.ranks)
    ranks[5] = dataclasses.replace(rp, threads=tuple(threads))
    why = reduce_program(dataclasses.replace(x, ranks=tuple(ranks)), 8)
    assert why == "rank 5 differs from rank 0 under the node-preserving relabeling"


def test_relabeling_is_a_topology_preserving_group_action():
    for world, g in ((16, 8), (32, 8), (8, 8), (4, 8), (24, 4)):
        topo = Topology(world, min(g, world))
        sigma = relabeling(world, g)
        for r in range(world):
            perm = [sigma(r, d) for d in range(world)]
            assert sorted(perm) == list(range(world)) and perm[0] == r
            for a, b in itertools.product(range(world), repeat=2):
                assert topo.path(a, b) == topo.path(perm[a], perm[b])
                same_rail = topo.local_index(a) == topo.local_index(b)
                assert same_rail == (topo.local_index(perm[a]) == topo.local_index(perm[b]))
    assert relabeling(12, 8) is None  # a partial node: its GPUs are not like the others


def test_graph_bodies_are_compared_too():
    """sglang-overlap and others capture ops in graphs; a reduced Program keeps them."""
    x = _explicit("tbo", _workload("decode", 16))
    red = reduce_program(x, 8)
    assert isinstance(red, Reduction)
    n = sum(isinstance(i, Graph) for th in x.ranks[0].threads for i in th.instrs)
    m = sum(isinstance(i, Graph) for th in red.program.ranks[0].threads for i in th.instrs)
    assert n == m


def test_api_reduces_by_default_and_gives_the_full_runs_result():
    w = ol.workload("deepseek-v3", mode="decode", batch=16, ep=16, layers=3)
    red = ol.simulate("tbo", w, ranks="explicit", seed=5)
    full = ol.simulate("tbo", w, ranks="explicit", seed=5, reduce=False)
    assert red.trace.meta["reduction"].startswith("reduced")
    meta = {k: v for k, v in red.trace.meta.items() if k != "reduction"}
    assert meta == {k: v for k, v in full.trace.meta.items() if k != "reduction"}
    assert full.trace.meta["reduction"] == "not reduced: reduce=False"
    assert red.program == full.program  # the Result carries the explicit Program either way
    a, b = red.as_dict(), full.as_dict()
    assert a.keys() == b.keys() and a["reduction"].startswith("reduced: all 16 ranks")
    assert a["cost_sources"] == b["cost_sources"] and a["num_ops"] == b["num_ops"]
    assert a["straggler_cost_us"] == 0.0
    assert _close(a["window_us"], b["window_us"])
    for ra, rb in zip(a["per_rank"], b["per_rank"]):
        assert ra["rank"] == rb["rank"] and _close(ra["window_us"], rb["window_us"])
        assert ra["link_busy_us"].keys() == rb["link_busy_us"].keys()
        assert all(_close(v, rb["link_busy_us"][k]) for k, v in ra["link_busy_us"].items())
    skew = ol.simulate("tbo", w, ranks="explicit", imbalance="zipf:1.2")
    assert skew.trace.meta["reduction"].startswith("not reduced: rank")


@pytest.mark.parametrize("flag,prefix", [([], "reduced: "), (["--reduce-ranks", "false"], "not ")])
def test_cli_reduce_ranks(capsys, flag, prefix):
    from overlap_lab.cli.main import main

    argv = ["sim", "--schedule", "tbo", "--layers", "3", "--ep", "16", "--batch", "16",
            "--ranks", "explicit", "--out", "", "--json", *flag]  # fmt: skip
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["reduction"].startswith(prefix) and len(res["per_rank"]) == 16
