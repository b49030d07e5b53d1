"""One link model on both sides: the emulated backend's arrival time for a communication-only
Program (dispatch and combine, no compute) equals the simulator's predicted link time of the same
collectives, decode (low-latency kernels) and prefill (normal kernels), over NVLink and RDMA."""

from __future__ import annotations

import pytest

from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload
from overlap_lab.shared.ir.links import arrival_us, gpu_links, program_sends

torch = pytest.importorskip("torch")
pytest.importorskip("simpy")


def _w(mode: str, ep: int, gpus_per_node: int) -> Workload:
    from overlap_lab.real import model as M

    mc = M.get_model_config("tiny-mla")
    b = Batch.decode(kv_lens=[40] * 6) if mode == "decode" else Batch.prefill(extend_lens=[20, 9])
    return Workload(mc, b, Parallel(ep=ep, gpus_per_node=gpus_per_node))


def test_arrival_is_latency_plus_bytes_over_bandwidth_links_in_parallel():
    bw, lat = {"nvlink": 100.0, "rdma": 10.0}, {"nvlink": 1.0, "rdma": 3.0}
    assert arrival_us({"nvlink": 1000.0, "rdma": 0.0}, bw, lat) == pytest.approx(11.0)
    assert arrival_us({"nvlink": 1000.0, "rdma": 50.0}, bw, lat) == pytest.approx(11.0)
    assert arrival_us({"nvlink": 1000.0, "rdma": 500.0}, bw, lat) == pytest.approx(53.0)
    assert arrival_us({}, bw, lat) == 0.0  # local only: no link time
    g = get_gpu("h200")
    b, la = gpu_links(g)
    assert b["nvlink"] == g.nvlink_eff_gbps * 1e3 and la["rdma"] == g.rdma_lat_us


def test_at_deepeps_sm_budget_both_sides_take_the_channel_rate():
    """DeepSeek-V3 prefill 4096 on an H200 (EP 32, DeepEP's default 20 SMs): the simulator holds
    each normal dispatch/combine until its channels on 20 SMs have moved its bytes (20/24 of the
    link rate: V1's tables saturate at 24), longer than the links' arrival; the emulated
    backend's flight for the same bytes and SMs is that same time, to 1e-9 (not the links'
    arrival alone: 1,780 / 3,449 µs per layer where the simulator charges 2,132 / 4,135)."""
    from overlap_lab.experiments.gpu_validation import comm_program
    from overlap_lab.real.comm.bytes import LinkParams
    from overlap_lab.shared.inputs.workload import get_model, with_layers
    from overlap_lab.sim import simulate

    g = get_gpu("h200")
    w = Workload(with_layers(get_model("deepseek-v3"), 4), Batch.prefill(extend_lens=[2048] * 2),
                 Parallel(ep=32))  # fmt: skip
    prog = comm_program(w, g)
    tr = simulate(prog, g)
    span = {(s.op, s.layer): s.duration for s in tr.spans if s.lane.startswith("stream:")}
    lp = LinkParams.from_gpu(g)
    sends = program_sends(prog)
    assert {s.op.sms for s in sends} == {g.deepep_normal_sms} == {20}
    for s in sends:
        links_only = arrival_us(s.nbytes, *gpu_links(g))
        emulated = lp.arrival_us(s.nbytes, s.op.sms)
        assert emulated == pytest.approx(span[(s.op.name, s.op.layer)], rel=1e-9)
        assert emulated == pytest.approx(links_only * 24 / 20, rel=0.01)  # the RDMA bytes bind
    by = {s.what: round(lp.arrival_us(s.nbytes, 20)) for s in sends}
    assert by == {"dispatch": 2132, "combine": 4135}
    assert lp.arrival_us(sends[0].nbytes, 24) == arrival_us(sends[0].nbytes, *gpu_links(g))
    assert lp.arrival_us(sends[0].nbytes) == arrival_us(sends[0].nbytes, *gpu_links(g))


def test_the_emulated_link_model_is_the_simulators():
    from overlap_lab.real.comm.bytes import ByteCount, LinkParams

    g = get_gpu("h200")
    lp = LinkParams.from_gpu(g)
    nb = {"nvlink": 3.5e6, "rdma": 1.25e7}
    assert lp.arrival_us(nb) == arrival_us(nb, *gpu_links(g))
    assert lp.arrival_us(ByteCount(0, 3_500_000, 12_500_000, 0)) == arrival_us(nb, *gpu_links(g))


@pytest.mark.parametrize(
    "mode,ep,gpn", [("decode", 2, 8), ("decode", 4, 2), ("prefill", 4, 2), ("prefill", 2, 1)]
)
def test_comm_only_program_emulated_arrival_equals_simulated_link_time(mode, ep, gpn):
    """(a) of the communication-only case: per collective, the delay the emulated backend
    computes (what its kernels hold until) equals the simulator's link span, to 1e-9."""
    from overlap_lab.experiments.gpu_validation import comm_kernels, comm_program
    from overlap_lab.real.comm import make_backend
    from overlap_lab.real.comm.bytes import LinkParams
    from overlap_lab.real.executor import execute
    from overlap_lab.sim import simulate

    g = get_gpu("h200")
    w = _w(mode, ep, gpn)
    prog = comm_program(w, g)
    sends = program_sends(prog)
    assert sends and [s.what for s in sends] == ["dispatch", "combine"] * (len(sends) // 2)
    # the simulator: each collective's link spans (one per link kind), the longest
    tr = simulate(prog, g)
    link: dict[tuple, float] = {}
    for s in tr.spans:
        if s.lane.startswith("link:") and s.rank == (tr.ranks[0] if tr.ranks else 0):
            k = (s.op, s.layer, s.mb)
            link[k] = max(link.get(k, 0.0), s.duration)
    predicted = [link[(s.op.name, s.op.layer, s.op.mb)] for s in sends]
    # the executor with the emulated backend, fed the Program's bytes
    be = make_backend("emulated", rank=0, world=ep, num_experts=w.model.num_experts,
                      hidden=w.model.hidden, link=LinkParams.from_gpu(g),
                      device_sms=132)  # fmt: skip
    be.plan_links(prog)
    execute(prog, w, backend=be, warmup=1, repeats=1, gpu=g, kernels=[comm_kernels()])
    runs = be.launches[-len(sends) :]  # the last run's transfers
    assert [r["kind"].split("_")[1] for r in runs] == [s.what for s in sends]
    assert all(r["bytes_from"] == "program" for r in runs)
    kinds = {r["kind"] for r in runs}
    assert kinds == ({"ll_dispatch", "ll_combine"} if mode == "decode"
                     else {"normal_dispatch", "normal_combine"})  # fmt: skip
    emulated = [r["delay_us"] for r in runs]
    assert all(p > 0 for p in predicted)
    assert emulated == pytest.approx(predicted, rel=1e-9, abs=0)
    used = {k for s in sends for k, b in s.nbytes.items() if b > 0}
    assert used == ({"rdma"} if gpn == 1 else {"nvlink", "rdma"} if ep > gpn else {"nvlink"})


def test_routing_bytes_remain_the_default():
    from overlap_lab.real.comm import make_backend
    from overlap_lab.real.executor import execute
    from overlap_lab.shared import schedules as S

    g = get_gpu("h200")
    w = _w("decode", 2, 8)
    be = make_backend("emulated", rank=0, world=2, num_experts=w.model.num_experts,
                      hidden=w.model.hidden, device_sms=132)  # fmt: skip
    execute(S.build("serial", w, g), w, backend=be)
    assert {r["bytes_from"] for r in be.launches} == {"routing"}


@pytest.mark.parametrize("schedule,mode", [("serial", "decode"), ("sbo", "decode"),
                                           ("tbo", "prefill"), ("serial", "prefill")])  # fmt: skip
def test_every_emulated_transfer_counts_its_flight_from_its_ops_start(schedule, mode):
    """The loopback data path is not DeepEP's work: the emulated flight starts at the op's start
    (a stamp before the data path), so the data path runs inside the modelled flight. Every
    transfer takes its own op's stamp (none left over, none shared); off, none does."""
    from overlap_lab.real.comm import make_backend
    from overlap_lab.real.executor import execute
    from overlap_lab.shared import schedules as S

    g = get_gpu("h200")
    w = _w(mode, 2, 8)
    for on in (True, False):
        be = make_backend("emulated", rank=0, world=2, num_experts=w.model.num_experts,
                          hidden=w.model.hidden, device_sms=132)  # fmt: skip
        be.arrival_from_op_start = on
        execute(S.build(schedule, w, g), w, backend=be)
        assert be.launches and {r["from"] for r in be.launches} == (
            {"op start"} if on else {"send kernel"}
        )
        assert be._t_start is None


def test_the_emulated_normal_kernels_hold_until_their_channels_have_moved_the_bytes():
    """Through the executor: each normal dispatch/combine's modelled flight is the link model's
    at its kernel's CTAs (one per SM), so below V1's 24 SMs the channel rate binds; the
    low-latency kernels keep the links' arrival (no channel bound on either side)."""
    from overlap_lab.experiments.gpu_validation import comm_kernels, comm_program
    from overlap_lab.real.comm import make_backend
    from overlap_lab.real.comm.bytes import LinkParams
    from overlap_lab.real.executor import execute

    g = get_gpu("h200")
    slow = LinkParams(nvlink_gbps=0.01, nvlink_lat_us=0.0, rdma_gbps=0.01, rdma_lat_us=0.0)
    for mode, kinds in (("prefill", {"normal_dispatch", "normal_combine"}),
                        ("decode", {"ll_dispatch", "ll_combine"})):  # fmt: skip
        w = _w(mode, 4, 2)
        prog = comm_program(w, g)
        be = make_backend("emulated", rank=0, world=4, num_experts=w.model.num_experts,
                          hidden=w.model.hidden, link=slow, num_sms=g.deepep_normal_sms,
                          device_sms=132)  # fmt: skip
        be.plan_links(prog)
        execute(prog, w, backend=be, warmup=0, repeats=1, gpu=g, kernels=[comm_kernels()])
        runs = be.launches
        assert {r["kind"] for r in runs} == kinds
        for r in runs:
            links_only = slow.arrival_us(r["bytes"])
            if mode == "prefill":
                assert r["ctas"] < 24
                assert r["delay_us"] == pytest.approx(links_only * 24 / r["ctas"], rel=1e-9)
            else:
                assert r["delay_us"] == pytest.approx(links_only, rel=1e-12)
