"""Overlap slows both sides (docs/sm-sharing.md, "Communication beside computation" and
"Persistent kernels beside DeepEP"): DeepEP's kernels pace their HBM traffic at their link rate
and copy more slowly while other kernels load HBM; a dynamic persistent kernel spreads its work
over the SMs DeepEP leaves it instead of running its late CTAs as a second wave."""

from __future__ import annotations

import dataclasses

import pytest

import overlap_lab as ol
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.ir.builder import RankBuilder, program
from overlap_lab.shared.ir.program import Coll, Flow, Op, ops_of
from overlap_lab.sim import cost, simulate
from tests.invariants import kernels_on

GPU = get_gpu("h800", launch_us=0.0, graph_launch_us=0.0)


def deepep(sms: int, rdma_bytes: float) -> Op:
    """A DeepEP normal kernel (sendrecv) moving ``rdma_bytes`` over RDMA on ``sms`` SMs."""
    flows = (Flow("rdma", rdma_bytes),)
    return Op("dispatch_a", kind="comm", op_class="comm", dtype="fp8", hbm_bytes=2 * rdma_bytes,
              sms=sms, coll=Coll("L0.dispatch", "sendrecv", flows))  # fmt: skip


def run(*launches: tuple[Op, str], gpu=GPU):
    """Each (op, stream) launched in order, 1 µs of host time apart."""
    r = RankBuilder(0, tuple(dict.fromkeys(s for _, s in launches)))
    t = r.thread("main")
    for i, (op, stream) in enumerate(launches):
        if i:
            t.host("h", 1.0)
        t.launch(op, stream)
    return simulate(program([r], world=1), gpu)


def span(trace, lane: str) -> tuple[float, float]:
    ((_, t0, t1),) = kernels_on(trace, 0, f"stream:{lane}")
    return t0, t1


# ---- communication beside computation ---------------------------------------------------------


def test_tbo_prefill_dispatch_and_combine_run_slower_than_alone():
    """DeepSeek-V3 prefill, EP 32, 4 x 4,096 tokens on an H800: each micro-batch's dispatch and
    combine, beside the other micro-batch's computation, take longer than the same kernel (same
    bytes, same SMs) in a Program that runs nothing else."""
    w = ol.workload("deepseek-v3", mode="prefill", batch=4, layers=5, ep=32)
    res = ol.simulate("tbo", w, "h800")
    ops = {(op.name, op.layer, op.mb): op for _, op in ops_of(res.program)}
    gpu = res.gpu
    beside = alone_total = 0.0
    for name in ("dispatch_a", "combine_a"):
        for s in res.trace.spans:
            if s.op != name or s.layer != 4 or not s.lane.startswith("stream:"):
                continue
            op = ops[(name, s.layer, s.mb)]
            r = RankBuilder(0, ("comm",))
            r.thread("t").launch(op, "comm")
            alone = span(simulate(program([r], world=res.program.world), gpu), "comm")
            t_alone = alone[1] - alone[0]
            assert t_alone == pytest.approx(cost.solo_duration_us(op, gpu), rel=0.05)
            assert s.end - s.start > 1.01 * t_alone, (name, s.mb)
            beside += s.end - s.start
            alone_total += t_alone
    assert beside > 1.1 * alone_total


def test_a_deepep_kernel_paces_its_hbm_traffic_at_its_link_rate():
    """On 24 SMs (V1's saturating count) the kernel's channels keep up with the link, and its HBM
    traffic spreads over its link time: a memory-bound kernel beside it runs as alone. Before,
    it asked for its whole demand at once (the 24 SMs' cap, 1.46 TB/s on an H800) and took that
    from the kernel beside it for as long as its bytes lasted."""
    comm = deepep(24, 4e8)
    d = cost.demand(comm, GPU, 24)
    link = 4e8 / GPU.link_bytes_per_us("rdma", effective=True)
    assert d.t_compute == pytest.approx(link) and d.cap == pytest.approx(8e8 / link)
    assert d.cap < 0.1 * cost.bandwidth_cap(comm, GPU, 24)
    copy = Op("norm", hbm_bytes=4e9, sms=108)  # waved, memory-bound, off DeepEP's SMs
    alone = span(run((copy, "a")), "a")
    both = run((comm, "b"), (copy, "a"))
    t0, t1 = span(both, "a")
    assert t1 - t0 == pytest.approx(alone[1] - alone[0], rel=1e-6)


def test_a_deepep_kernel_copies_slower_under_the_others_hbm_load():
    """Beside a kernel drawing a fraction u of the usable HBM bandwidth, a DeepEP kernel whose SMs
    just keep up with its link (20 of V1's 24) copies ``loaded_latency(u)`` times slower: its
    span is its link time x that / (20/24). Alone it takes its channel time."""
    comm = deepep(20, 2e7)
    link = 2e7 / GPU.link_bytes_per_us("rdma", effective=True)
    alone = span(run((comm, "b")), "b")
    assert alone[1] - alone[0] == pytest.approx(link * 24 / 20, rel=1e-3)
    big = Op("norm", hbm_bytes=2e10, sms=112)  # outlasts the comm kernel
    both = run((big, "a"), (comm, "b"))
    c0, c1 = span(both, "b")
    load = cost.bandwidth_cap(big, GPU, 112) / (GPU.hbm_bytes_per_us * cost.HBM_USABLE)
    slow = cost.loaded_latency(load)
    assert slow > 1.5  # a memory-bound neighbour: the copies' latency rises steeply
    assert c1 - c0 == pytest.approx(link * slow * 24 / 20, rel=1e-3)


def test_spare_sms_absorb_the_first_of_the_slowdown():
    """V2 reaches the link from 6 SMs: on 20 its channels have 3.3 times the link's rate, so a
    load that slows each copy 2-fold leaves the kernel at its link rate."""
    v2 = dataclasses.replace(GPU, deepep_release="v2")
    comm = deepep(20, 2e7)
    alone = span(run((comm, "b"), gpu=v2), "b")
    big = Op("norm", hbm_bytes=2e10, sms=112)
    c0, c1 = span(run((big, "a"), (comm, "b"), gpu=v2), "b")
    assert cost.loaded_latency(0.889) > 2.0  # the neighbour's load slows each copy 2-fold ...
    assert c1 - c0 == pytest.approx(alone[1] - alone[0], rel=1e-9)  # ... and the link still sets it


def test_loaded_latency_follows_the_measured_copy_sweep():
    assert cost.loaded_latency(0.0) == 1.0
    assert cost.loaded_latency(0.382) == pytest.approx(1.244)  # 24 CTAs, 1.49 TB/s on the H200
    pts = [cost.loaded_latency(u / 100) for u in range(0, 120)]
    assert pts == sorted(pts) and pts[-1] == cost.LOADED_LATENCY[-1][1]


# ---- persistent kernels beside DeepEP ----------------------------------------------------------


def test_attention_beside_deepep_takes_its_work_over_the_sms_left_not_two_waves():
    """FlashAttention-3's dynamic tile scheduler: with DeepEP holding 20 SMs for the whole
    kernel, the attention's resident CTAs take every tile, so it runs its work over 112 SMs
    (132/112 of its time alone, compute-bound), not its 20 late CTAs' shares as a second wave."""
    attn = Op("attn.core", flops=3e12, hbm_bytes=3e9, op_class="attention", grid="dynamic")
    comm = deepep(20, 6e8)  # outlasts the attention
    tr = run((comm, "b"), (attn, "a"))
    a0, a1 = span(tr, "a")
    c0, c1 = span(tr, "b")
    assert c1 > a1
    t132, t112 = (cost.solo_duration_us(attn, GPU, s) for s in (132, 112))
    assert a1 - a0 == pytest.approx(t112, rel=1e-6)
    assert t112 == pytest.approx(t132 * 132 / 112, rel=1e-3)
    assert [s.sms for s in tr.spans if s.lane == "stream:a"] == [112]
    # a static persistent grid (DeepGEMM's scheduler) runs its 20 late CTAs' shares as a second
    # wave once its first CTAs end: that is what SGLang's deep_gemm_num_sms avoids
    stat = dataclasses.replace(attn, grid="persistent")
    s0, s1 = span(run((comm, "b"), (stat, "a")), "a")
    assert s1 - s0 == pytest.approx(2 * t132, rel=1e-3)
