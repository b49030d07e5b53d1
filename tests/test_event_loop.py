"""The event loop's accounting (``sim.budget.run_budgeted``): passes of the block scheduler run
inline, with the same result as their own SimPy event, and fewer events."""

from __future__ import annotations

import pytest

from overlap_lab.shared import schedules
from overlap_lab.shared.hardware import get_gpu
from overlap_lab.shared.workload import Batch, Parallel, Workload, get_model
from overlap_lab.sim import budget, engine
from overlap_lab.sim.engine import Engine

GPU = get_gpu("h800")
MODEL = get_model("deepseek-v3", num_layers=4)


def _program(name: str, batch: Batch):
    return schedules.build(name, Workload(MODEL, batch, Parallel(ep=8)), GPU)


def _counted_run(program, monkeypatch, inline: bool, tie_seed: int | None = None):
    """The trace and the SimPy events of one run; ``inline=False`` drives the environment with
    a plain ``env.run()``, so every pass goes through its ``GRANT_PRIORITY`` event."""
    eng = Engine(program, GPU, 0, tie_seed=tie_seed)
    count = [0]
    step = eng.env.step

    def counting_step():
        count[0] += 1
        step()

    eng.env.step = counting_step
    with monkeypatch.context() as m:
        if not inline:
            m.setattr(engine, "run_budgeted", lambda env, n: env.run())
        trace = eng.run()
    return trace, count[0]


@pytest.mark.parametrize("name", ["tbo", "sbo", "sglang-overlap", "deepseek"])
@pytest.mark.parametrize("batch", [Batch.decode(64, kv_len=2048), Batch.prefill(2, extend_len=512)])
def test_inline_passes_give_the_trace_of_pass_events(name, batch, monkeypatch):
    try:
        p = _program(name, batch)
    except Exception as e:  # a schedule that does not take this batch kind
        pytest.skip(str(e))
    inline, n_inline = _counted_run(p, monkeypatch, True)
    evented, n_evented = _counted_run(p, monkeypatch, False)
    assert inline == evented
    assert n_inline < n_evented  # each instant with a pass saved its event
    shuffled, _ = _counted_run(p, monkeypatch, True, tie_seed=7)
    assert shuffled == inline


def test_passes_count_against_the_budget():
    p = _program("tbo", Batch.decode(64, kv_len=2048))
    with pytest.raises(budget.SimulationBudgetExceeded):
        Engine(p, GPU, 0, max_events=50).run()
