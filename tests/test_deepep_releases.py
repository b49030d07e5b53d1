"""DeepEP releases: the normal kernels' throughput as a function of the SMs they hold, per
release, and what it does to DeepSeek's prefill partition (24 communication SMs of 132)."""

from __future__ import annotations

import pytest

import overlap_lab as ol
from overlap_lab.shared.inputs.hardware import GPU, get_gpu
from overlap_lab.shared.inputs.knobs import knobs
from overlap_lab.shared.ir.deepep import RELEASES, deepep_normal_rate


def _prefill():
    return ol.workload("deepseek-v3", mode="prefill", batch=2, extend_len=4096, layers=4, ep=32)


def _step(comm_sms: int, release: str = "v1") -> float:
    g = ol.gpu("h800", deepep_release=release)
    return ol.simulate("deepseek", _prefill(), g, {"comm_sms": comm_sms}).metrics.iteration_us


def test_rate_follows_the_sms_per_release():
    assert deepep_normal_rate("v1", 24, "rdma") == pytest.approx(44.0)
    assert deepep_normal_rate("v1", 8, "rdma") == pytest.approx(44.0 * 8 / 24)
    assert deepep_normal_rate("v1", 64, "nvlink") == pytest.approx(134.0)
    assert deepep_normal_rate("v2", 6, "rdma") == pytest.approx(44.0)
    assert deepep_normal_rate("v2", 3, "rdma", link_gbps=50.0) == pytest.approx(25.0)
    for r in RELEASES.values():
        assert r.sources and r.date


def test_deepseek_prefill_on_v1_is_slower_with_8_comm_sms_than_24():
    assert _step(8) > _step(24)


def test_v2_needs_few_sms():
    assert _step(8, "v2") <= _step(24, "v2")


def test_the_trace_shows_the_slow_kernel():
    """At 8 SMs the dispatch kernel outlasts its data: the span is the channels' time, three times
    the link's on 8 of V1's 24 SMs, and beside the other micro-batch's computation a little more
    (its copies slow under the HBM load: docs/sm-sharing.md, "Communication beside computation")."""
    from overlap_lab.sim.cost import LOADED_LATENCY

    g = ol.gpu("h800")
    spans = {}
    for sms in (8, 24):
        res = ol.simulate("deepseek", _prefill(), g, {"comm_sms": sms})
        kern = [s for s in res.trace.spans if s.op == "dispatch_a" and s.layer == 2]
        stream = [s.duration for s in kern if s.lane.startswith("stream:")]
        link = [s.duration for s in kern if s.lane == "link:rdma"]
        spans[sms] = (max(stream), max(link))
    assert spans[8][1] == pytest.approx(spans[24][1])  # the same bytes cross RDMA as fast
    top = LOADED_LATENCY[-1][1]
    assert 3 * spans[8][1] <= spans[8][0] <= 3 * top * spans[8][1]  # 8 of V1's 24 SMs
    assert spans[24][1] <= spans[24][0] <= top * spans[24][1]
    assert spans[8][0] > 2.5 * spans[24][0]


def test_release_is_a_gpu_knob_the_preset_names():
    assert "deepep_release" in {k.name for k in knobs(GPU)}
    assert get_gpu("h800").deepep_release == "v1"
    assert ol.gpu("h800", deepep_release="v2").name == "h800+deepep-release=v2"


def test_a_rate_below_the_published_sms_is_named_as_an_assumption():
    """V1 publishes no rate below 24 SMs: a run that depends on one says so in its notes."""
    from overlap_lab import api

    w = api.workload("deepseek-v3", mode="prefill", batch=1, extend_len=4096, layers=3, ep=32)
    low = api.simulate("deepseek", w, "h800", config={"comm_sms": 8}).notes
    assert any("v1 normal kernels on 8 SMs" in n and "assumed" in n for n in low), low
    assert not any("assumed" in n for n in api.simulate("deepseek", w, "h800").notes)
