"""The network's compiled change step (``Network._changed_compiled``, numba) gives exactly the
numpy step's results: the same arrival times, in the same order, with the same re-rate count,
grouped (``group_tol``) or not, with staggered sends, latencies and stalled flows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import simpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from overlap_lab.sim import network
from overlap_lab.sim.network import Network


def _run(flows, tol, lat, gap, compiled_after):
    """Arrivals (time, tag, kind) in the order reported, and the re-rate count."""
    env, arrived = simpy.Environment(), []

    def on_done(tags, kinds):
        arrived.extend((env.now, t, k) for t, k in zip(tags.tolist(), kinds.tolist()))

    old = network._COMPILED_AFTER
    network._COMPILED_AFTER = compiled_after
    try:
        net = Network(env, 4, {"nvlink": (50.0, lat), "rdma": (20.0, 0.0)}, on_done, tol)

        def sender(env):
            for i, (src, dsts, nbytes) in enumerate(flows):
                if i and i % 3 == 0:
                    yield env.timeout(gap)
                net.send(src, dsts, [i % 2] * len(dsts), nbytes, [10 * i + j for j in dsts])

        env.process(sender(env))
        env.run()
    finally:
        network._COMPILED_AFTER = old
    return arrived, net.rerates, net.live


flow_st = st.tuples(
    st.integers(0, 3),
    st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True),
    st.floats(0.0, 1e4),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    flows=st.lists(flow_st, min_size=1, max_size=12),
    tol=st.sampled_from([0.0, 0.02, 0.3]),
    lat=st.sampled_from([0.0, 1.5]),
    gap=st.floats(0.0, 50.0),
)
def test_compiled_step_matches_numpy(flows, tol, lat, gap):
    pytest.importorskip("numba")
    flows = [(s, d, [b * (1 + j) for j in range(len(d))]) for s, d, b in flows]
    assert _run(flows, tol, lat, gap, 0) == _run(flows, tol, lat, gap, 10**18)


def test_compiled_step_stalls_on_an_infinite_flow(monkeypatch):
    pytest.importorskip("numba")
    monkeypatch.setattr(network, "_COMPILED_AFTER", 0)
    env, done = simpy.Environment(), []
    net = Network(env, 2, {"rdma": (1.0, 0.0)}, lambda t, k: done.extend(t.tolist()))
    net.send(0, [1, 1], [0, 0], [math.inf, 5.0], [0, 1])
    env.run()
    assert done == [1] and net.live == 1


def test_without_numba_the_numpy_step_runs(monkeypatch):
    """``_step_loops = False`` (numba missing): the numpy step, whatever the re-rate count."""
    monkeypatch.setattr(network, "_step_loops", False)
    flows = [(s, [d for d in range(4) if d != s], [100.0 * (s + 1)] * 3) for s in range(4)]
    arrived, rerates, live = _run(flows, 0.0, 0.0, 1.0, 0)
    assert live == 0 and rerates > 0
    assert sorted(t for _, t, _ in arrived) == sorted(
        10 * i + d for i, (_, ds, _) in enumerate(flows) for d in ds
    )
    # rank 3 sends 4x rank 0's bytes through the same egress bandwidth: it finishes last
    assert max(arrived)[1] // 10 == 3
    assert np.isfinite([t for t, _, _ in arrived]).all()
