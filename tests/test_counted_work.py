"""The validator's and the simulator's work grows linearly in layers and in ranks (issue 31):
counted operations, not seconds, so the check holds on any machine and catches a quadratic
pass (the starvation check's searches once took 44 of 47 s at 16 layers, EP 32) long before
it shows in a benchmark.

Work counted: the validator's graph nodes and edges made and visited, and the nodes its
starvation searches visit (``shared.ir.starvation.ValidationWork``); the engine's SimPy events
and rounds of block-scheduler passes (the steps ``sim.budget.run_budgeted`` takes) and the
kernels it times alone with no event of their own (``sim.alone``). Cases:
explicit ranks with skewed routing, where every rank's Program is its own: the regression's
TBO decode (one stream), SGLang's overlap scheduler in prefill (three streams, one of them
never waited on until the end: the case that defeats a search bound taken from any launch not
ordered before a receiver) and SBO decode (kernels polling signals: searches that run).
"""

from __future__ import annotations

from functools import cache

import pytest

from overlap_lab.api import Ranks, lower_ranks
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model, with_layers
from overlap_lab.shared.ir.program import Program, iter_gpu_instrs
from overlap_lab.shared.ir.starvation import ValidationWork
from overlap_lab.shared.ir.validate import validate
from overlap_lab.shared.schedules import build
from overlap_lab.sim.engine import Engine
from overlap_lab.sim.resources import timers

GPU = get_gpu("h800")
#: (schedule, batch per rank): small batches, so a rank sends to a few ranks, not to all
CASES = [
    ("tbo", Batch.decode(8, kv_len=1024)),
    ("sglang-overlap", Batch.prefill(1, extend_len=32)),
    ("sbo", Batch.decode(2, kv_len=1024)),
]
#: a dense first layer, then 4, 8, 16 MoE layers: the work that doubles
LAYERS = (5, 9, 17)
RANKS = (8, 16, 32)
#: 2x per doubling of the layers, with 10 % for what does not double with them (the dense
#: layer, the step's first and last micro-batches on their own); a quadratic pass gives 4x
BOUND = 2.2
#: per doubling of the ranks, the most the work per instruction and flow may grow (a quadratic
#: pass doubles it): the engine's steps per item grow up to 14 % from EP 8 to 16 (more ranks
#: end their kernels at instants of their own), and less beyond
PER_ITEM = 1.25


def _program(schedule: str, layers: int, ep: int) -> Program:
    batch = dict(CASES)[schedule]
    model = with_layers(get_model("deepseek-v3"), layers)
    w = Workload(model, batch, Parallel(ep=ep))
    ranks = Ranks("explicit", "zipf:1.2", 0.0, None, 1, True)
    return lower_ranks(build(schedule, w, GPU), w, GPU, ranks)


def _items(program: Program) -> int:
    """The Program's size: its instructions (graph bodies counted) and flows."""
    n = 0
    for rp in program.ranks:
        for th in rp.threads:
            for ins in iter_gpu_instrs(th.instrs):
                n += 1
                op = getattr(ins, "op", None)
                if op is not None and op.coll is not None:
                    n += len(op.coll.flows)
    return n


@cache
def _work(schedule: str, layers: int, ep: int) -> dict[str, int]:
    """The validator's counted work and the engine's steps on the case's Program."""
    program = _program(schedule, layers, ep)
    work = ValidationWork()
    validate(program, GPU.num_sms, work=work)
    eng = Engine(program, GPU, 1)
    counts = {"events": 0, "passes": 0}
    step, t = eng.env.step, timers(eng.env)
    run_passes = t.run_passes

    def counting_step():
        counts["events"] += 1
        step()

    def counting_passes():
        counts["passes"] += 1
        run_passes()

    eng.env.step, t.run_passes = counting_step, counting_passes
    eng.run()
    counts["alone"] = eng.timed_alone
    steps = counts["events"] + counts["passes"] + counts["alone"]  # (the budget: but alone)
    return {"size": _items(program), "validation": work.total(), "steps": steps, **counts}


@pytest.mark.parametrize("schedule", [c[0] for c in CASES])
def test_work_grows_linearly_in_layers(schedule):
    runs = [_work(schedule, n, RANKS[0]) for n in LAYERS]
    assert runs[0]["validation"] > 0 and runs[0]["events"] > 0
    assert (runs[0]["alone"] > 0) == (schedule == "tbo")  # one stream: its kernels timed alone
    for small, large in zip(runs, runs[1:]):
        for what in ("validation", "events", "passes", "alone"):
            if not small[what]:
                continue
            ratio = large[what] / small[what]
            assert ratio <= BOUND, (what, small, large)


@pytest.mark.parametrize("schedule", [c[0] for c in CASES])
def test_work_grows_linearly_in_ranks(schedule):
    """Every rank of a skewed routing has its own Program, and the Program does not grow as the
    ranks do: more ranks mean more flows per rank (a token's experts fall on more distinct
    ranks), fewer experts and so fewer launches per rank (SBO's per-expert GEMMs). The bound is
    on the work per instruction and flow, the engine's counted as its steps (SimPy events and
    rounds of passes together, as its event budget counts them)."""
    runs = [_work(schedule, LAYERS[0], ep) for ep in RANKS]
    for small, large in zip(runs, runs[1:]):
        grown = large["size"] / small["size"]
        assert grown >= 1.5, (small, large)  # the case grows
        for what in ("validation", "steps"):
            ratio = large[what] / small[what]
            assert ratio <= PER_ITEM * grown, (what, grown, small, large)


def test_the_count_sees_a_search_without_its_bounds(monkeypatch):
    """Without the bounds on its search (``_RankChains.bounds``), the starvation check walks
    back through every earlier layer for every receiver: the count must show it."""
    from overlap_lab.shared.ir import starvation

    monkeypatch.setattr(starvation._RankChains, "bounds", lambda self, anc: (0, 0))
    runs = []
    for n in LAYERS:
        work = ValidationWork()
        validate(_program("sglang-overlap", n, RANKS[0]), GPU.num_sms, work=work)
        runs.append(work.total())
    assert runs[2] / runs[1] > BOUND
