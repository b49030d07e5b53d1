"""A kernel alone on an idle GPU (``sim.alone``): the engine times it in closed form, and the
Trace is the one the block scheduler's events give, bit for bit."""

from __future__ import annotations

import dataclasses
import math

import pytest
import simpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from overlap_lab.api import Ranks, lower_ranks
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model, with_layers
from overlap_lab.shared.ir.builder import RankBuilder, program
from overlap_lab.shared.ir.program import Op
from overlap_lab.shared.ir.validate import validate
from overlap_lab.shared.schedules import build
from overlap_lab.sim import alone
from overlap_lab.sim.engine import Engine
from overlap_lab.sim.simpy_fast import InstantTimers

GPU = get_gpu("h800")
N = GPU.num_sms


def _both(p, gpu=GPU, env=None, **kw):
    """The Trace with plain kernels timed alone and with every kernel left to the Gpu, and how
    many kernels were timed alone."""
    validate(p, gpu.num_sms)
    fast = Engine(p, gpu, fast_forward=False, env=env() if env else None, **kw)
    timed = fast.run()
    n = sum(a is not None for a in fast._plans.values())
    slow = Engine(p, gpu, fast_forward=False, alone=False, env=env() if env else None, **kw)
    return timed, slow.run(), n


kernels = st.builds(
    lambda f, b, ctas, per_sm, grid, sms: Op(
        "k",
        flops=f,
        hbm_bytes=b,
        ctas=ctas,
        ctas_per_sm=per_sm,
        grid=grid,
        sms=sms,
        op_class="gemm",
    ),  # fmt: skip
    st.sampled_from([0.0, 1e6, 3.3e9, 1e11, 7.7e12]),
    st.sampled_from([0.0, 1e5, 4.1e7, 3e9]),
    st.one_of(st.none(), st.integers(1, 3 * N + 7)),
    st.one_of(st.none(), st.integers(1, 4)),
    st.sampled_from([None, "waved", "persistent", "coresident", "dynamic"]),
    st.one_of(st.none(), st.integers(1, N)),
).filter(
    lambda o: (
        o.grid != "coresident"
        or o.ctas is None
        or -(-o.ctas // (o.ctas_per_sm or 1)) <= (o.sms or N)
    )
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(kernels, min_size=1, max_size=8),
    st.sampled_from([0.0, 0.37, 1234.567, 3.1e7]),  # where the clock stands: round-off differs
    st.booleans(),
    st.booleans(),
)
def test_a_kernel_alone_ends_where_the_block_scheduler_ends_it(ops, start, graph, record):
    r = RankBuilder(0, ("main",))
    t = r.thread("main")
    t.host("before", start)
    if graph:
        t.begin_graph()
    for i, op in enumerate(ops):
        t.launch(dataclasses.replace(op, name=f"k{i}"), "main")
        if record and i == 0:
            t.record("e", "main")
    if graph:
        t.end_graph("g")
    if record:
        t.sync("e")
    timed, slow, n = _both(program([r], world=1))
    assert timed == slow
    assert n > 0 or all(o.grid == "dynamic" for o in ops)


def _skewed(schedule: str, layers: int):
    w = Workload(with_layers(get_model("deepseek-v3"), layers), Batch.decode(64), Parallel(ep=8))
    return lower_ranks(build(schedule, w, GPU), w, GPU, Ranks("explicit", "zipf:1.2"))


def test_shuffled_callbacks_give_the_same_trace(callbacks_shuffled):
    p = _skewed("tbo", 2)
    timed, slow, n = _both(p, net_group_tol=0.02)
    assert timed == slow and n > 0
    for seed in (1, 2):
        shuffled, _, m = _both(
            p, env=lambda seed=seed: callbacks_shuffled(seed), net_group_tol=0.02
        )
        assert shuffled == timed and m == n


def test_an_environment_with_its_own_schedule_times_every_kernel_on_the_gpu(tie_shuffled):
    """Its ``schedule`` adds a delay to now, which cannot land on an instant computed ahead to
    the ulp (``InstantTimers.exact``): the engine leaves every kernel to the Gpu there."""
    timed, slow, n = _both(_skewed("tbo", 2), env=lambda: tie_shuffled(3), net_group_tol=0.02)
    assert timed == slow and n == 0


@pytest.mark.parametrize("schedule", ["serial", "sbo", "tbo", "deepseek", "vllm-dbo"])
def test_explicit_skewed_ranks_give_the_same_trace(schedule):
    """Every schedule's explicit ranks with skewed routing (no layer repeats, no rank alike):
    the Trace with plain kernels timed alone is the Gpu's, span for span."""
    timed, slow, _ = _both(_skewed(schedule, 3), net_group_tol=0.02)
    assert timed.spans == slow.spans and timed.step_time_us == slow.step_time_us


def test_a_rank_with_two_streams_leaves_its_kernels_to_the_gpu():
    r = RankBuilder(0, ("a", "b"))
    r.thread("main").launch(Op("x", flops=1e10, op_class="gemm"), "a")
    timed, slow, n = _both(program([r], world=1))
    assert timed == slow and n == 0


@pytest.mark.parametrize("now", [0.0, 1.0, 3.0, 1e-3, 7.123456789e6, 1e16])
def test_a_timer_lands_at_the_instant_asked_for(now):
    env = simpy.Environment(initial_time=now)
    timers, seen = InstantTimers(env), []
    whens = [now + x for x in (0.0, 1e-9, 0.1, 2.9999999999999996, 1e7)]
    whens.append(math.nextafter(3 * now, math.inf) if now else 5.0)  # (now + (when - now): off)
    for when in whens:
        timers.call_at(when, lambda _e, when=when: seen.append((env.now, when)))
    env.run()
    assert len(seen) == len(whens) and all(a == b for a, b in seen)


def test_what_alone_does_not_time():
    """Collectives, polled signals, copies, hooks and dynamic grids stay with the Gpu."""
    from overlap_lab.shared.ir.program import Coll
    from overlap_lab.sim.resources import Gpu

    gpu = Gpu(simpy.Environment(), GPU)
    assert alone.plan(gpu, Op("c", kind="comm", sms=3, coll=Coll("x", "recv")), 3) is None
    assert alone.plan(gpu, Op("w", flops=1e9, waits=("e",)), N) is None
    assert alone.plan(gpu, Op("cp", kind="copy", hbm_bytes=1e6), N) is None
    assert alone.plan(gpu, Op("hook", kind="comm", sms=0), 0) is None
    assert alone.plan(gpu, Op("d", flops=1e9, grid="dynamic"), N) is None
    a = alone.plan(gpu, Op("g", flops=1e12, op_class="gemm"), N)
    assert a is not None and a.sms == N
