"""The event loop's accounting (``sim.budget.run_budgeted``): passes of the block scheduler run
inline, with the same result as their own SimPy event, and fewer events."""

from __future__ import annotations

import pytest

from overlap_lab.shared import schedules
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model
from overlap_lab.sim import budget, engine
from overlap_lab.sim.engine import Engine

GPU = get_gpu("h800")
MODEL = get_model("deepseek-v3", num_layers=4)


def _program(name: str, batch: Batch):
    return schedules.build(name, Workload(MODEL, batch, Parallel(ep=8)), GPU)


def _counted_run(program, monkeypatch, inline: bool, env=None):
    """The trace and the SimPy events of one run; ``inline=False`` drives the environment with
    a plain ``env.run()``, so every pass goes through its ``GRANT_PRIORITY`` event."""
    eng = Engine(program, GPU, 0, env=env)
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
def test_inline_passes_give_the_trace_of_pass_events(name, batch, monkeypatch, tie_shuffled):
    p = _program(name, batch)  # every one of these schedules takes both batch kinds
    inline, n_inline = _counted_run(p, monkeypatch, True)
    evented, n_evented = _counted_run(p, monkeypatch, False)
    assert inline == evented
    assert n_inline < n_evented  # each instant with a pass saved its event
    shuffled, _ = _counted_run(p, monkeypatch, True, env=tie_shuffled(7))
    assert shuffled == inline


def test_passes_count_against_the_budget():
    p = _program("tbo", Batch.decode(64, kv_len=2048))
    with pytest.raises(budget.SimulationBudgetExceeded):  # (every kernel through the passes)
        Engine(p, GPU, 0, max_events=50, alone=False).run()


def test_timers_share_an_instant_and_prune_past_ones():
    """Callbacks of one instant share an event; the table of instants drops processed ones in
    sweeps, so it stays bounded over a long run while pending instants are kept."""
    import simpy

    from overlap_lab.sim.resources import timers
    from overlap_lab.sim.simpy_fast import AT_PRUNE

    env = simpy.Environment()
    t = timers(env)
    seen: list[tuple[float, int]] = []
    sizes = []

    def chain(i: int):
        def fire(_ev):
            seen.append((env.now, i))
            sizes.append(len(t._at))
            if i < 1000:
                t.call_later(1.0, chain(i + 1))
                t.call_later(1.0, lambda _e: seen.append((env.now, -1)))  # same instant

        return fire

    t.call_later(0.0, chain(0))
    steps = 0
    while env.peek() != float("inf"):
        env.step()
        steps += 1
    assert steps == 1001  # one event per instant, not per callback
    assert [i for _, i in seen if i >= 0] == list(range(1001))
    assert all(now == float(i) for now, i in seen if i >= 0)
    assert max(sizes) <= AT_PRUNE
