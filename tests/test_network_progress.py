"""The network's fluid model always makes progress, whatever the rates, sizes and clock.

Rates, sizes, latencies and start times span 1e-12 ... 1e12 (start times up to 1e16 µs, where a
float clock cannot represent small steps): every flow arrives, after it was sent, and the number
of re-rates is bounded by the flows (each timer finishes at least one flow). The compiled
progressive filling returns bit-identical rates to the numpy one.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import simpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from overlap_lab.shared.errors import ConfigError
from overlap_lab.sim import network
from overlap_lab.sim.network import Network, max_min_rates, max_min_rates_compiled


def _log_uniform(lo: float, hi: float):
    return st.floats(math.log10(lo), math.log10(hi)).map(lambda x: 10.0**x)


flows_st = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 3), _log_uniform(1e-12, 1e12)),
    min_size=1,
    max_size=12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    flows=flows_st,
    bw=_log_uniform(1e-12, 1e12),
    bw2=_log_uniform(1e-12, 1e12),
    lat=st.one_of(st.just(0.0), _log_uniform(1e-12, 1e12)),
    start=st.one_of(st.just(0.0), _log_uniform(1e-12, 1e16)),
    split=st.integers(0, 12),
    tol=st.sampled_from([0.0, 0.02]),
)
def test_every_flow_arrives_in_bounded_steps(flows, bw, bw2, lat, start, split, tol):
    env, arrived = simpy.Environment(), {}

    def on_done(tags, kinds):
        for t in tags.tolist():
            arrived[t] = env.now

    net = Network(env, 4, {"nvlink": (bw, lat), "rdma": (bw2, 0.0)}, on_done, tol)

    def sender(env):
        yield env.timeout(start)
        for i, (src, dst, nbytes) in enumerate(flows):
            if i == split:  # a second batch of sends, a little later
                yield env.timeout(start * 1e-9)
            net.send(src, [dst], [i % 2], [nbytes], [i])

    env.process(sender(env))
    steps, cap = 0, 50 + 20 * len(flows)
    while env.peek() < math.inf and steps < cap:
        env.step()
        steps += 1
    assert steps < cap, "the network keeps re-arming timers without progress"
    assert sorted(arrived) == list(range(len(flows)))
    assert all(t >= start for t in arrived.values())
    assert net.rerates <= 2 * len(flows) + 2


@settings(max_examples=200, deadline=None)
@given(
    pairs=st.lists(st.tuples(st.integers(0, 5), st.integers(6, 11)), min_size=1, max_size=40),
    caps=st.lists(_log_uniform(1e-12, 1e12), min_size=12, max_size=12),
    tol=st.sampled_from([0.0, 0.02, 0.3]),
)
def test_compiled_rates_are_bit_identical(pairs, caps, tol):
    pytest.importorskip("numba")
    src = np.array([a for a, _ in pairs], dtype=np.int64)
    dst = np.array([b for _, b in pairs], dtype=np.int64)
    cap = np.array(caps)
    a = max_min_rates(src, dst, cap, tol)
    b = max_min_rates_compiled(src, dst, cap, tol)
    assert a.tobytes() == b.tobytes()


def test_compiled_path_gives_the_same_arrivals(monkeypatch):
    """A network switched to the compiled re-rate at once finishes every flow at the same time."""

    def finish_times():
        env, done = simpy.Environment(), {}

        def on_done(tags, kinds):
            for t in tags.tolist():
                done[t] = env.now

        net = Network(env, 8, {"rdma": (37.0, 1.5)}, on_done)
        rng = np.random.default_rng(5)
        for src in range(8):
            dsts = [d for d in range(8) if d != src]
            net.send(
                src, dsts, [0] * 7, rng.uniform(10, 1000, 7).tolist(), [src * 8 + d for d in dsts]
            )
        env.run()
        return done

    exact = finish_times()
    monkeypatch.setattr(network, "_COMPILED_AFTER", 0)
    assert finish_times() == exact


@pytest.mark.parametrize("nbytes", [float("nan"), -1.0])
def test_bad_flow_sizes_are_refused(nbytes):
    from overlap_lab.shared.errors import ConfigError

    net = Network(simpy.Environment(), 2, {"rdma": (1.0, 0.0)}, lambda t, k: None)
    with pytest.raises(ConfigError, match="flow sizes"):
        net.send(0, [1], [0], [nbytes], [0])


def test_an_infinite_flow_stalls_instead_of_hanging():
    env, done = simpy.Environment(), []
    net = Network(env, 2, {"rdma": (1.0, 0.0)}, lambda t, k: done.extend(t.tolist()))
    net.send(0, [1, 1], [0, 0], [float("inf"), 5.0], [0, 1])
    env.run()
    assert done == [1] and net.live == 1


@pytest.mark.parametrize(
    "override", [{"hbm_gbps": 1e-3}, {"bf16_tflops": 1e-12}, {"nvlink_lat_us": 1e16}]
)
def test_issue_reproducers_finish(override):
    """These explicit-rank runs used to re-arm network timers forever (issue 14). The CLI now
    refuses such values up front (overlap_lab/cli/inputs.py); the simulator itself must still finish
    them: the API refuses them too (``ol.gpu`` checks overrides as the options do), so the GPU
    record is made by hand, as a plug-in or a notebook could."""
    import dataclasses

    import overlap_lab as ol

    w = ol.workload("deepseek-v3", mode="decode", ep=8, layers=2)
    with pytest.raises(ConfigError):
        ol.gpu("h800", **override)
    g = dataclasses.replace(ol.gpu("h800"), **override)
    r = ol.simulate("serial", w, gpu=g, ranks="explicit")
    assert math.isfinite(r.trace.step_time_us) and r.trace.step_time_us > 0


@pytest.mark.parametrize(
    "option", [("--hbm-gbps", "1e-3"), ("--bf16-tflops", "1e-12"), ("--nvlink-lat-us", "1e16")]
)
def test_issue_reproducers_on_the_command_line_end_cleanly(option, capsys):
    """On the command line the same values either simulate or are refused in one line."""
    import json

    from overlap_lab.cli.main import main

    argv = ["sim", "--layers", "2", "--ep", "8", "--ranks", "explicit", "--out", "", "--json"]
    try:
        code = main([*argv, *option])
    except SystemExit as e:  # argparse's own refusal of an option's type or range
        code = e.code
    out, err = capsys.readouterr()
    if code == 0:
        assert json.loads(out)["step_time_us"] > 0
    else:
        assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
