"""The loop's prediction of the emulated backend's communication (experiments/gpu_validation/
emulated_comm.py, overlap_lab.device_time.local_work_us) and the graph gap's two bounds.

The fixture (tests/data/README.md) is layer 1 of the H200 run of 2026-11-27, decode 32 serial:
its four DeepEP ops and ``experts``, one eager run and one graph replay. Numbers asserted were
read off the whole recording by the same functions; the sums are checked against the device
records themselves.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from overlap_lab.device_time import (
    GRAPH_LAUNCH,
    LINK_KERNELS,
    KernelMap,
    graph_gap_us,
    load_chrome,
    local_work_us,
    map_kernels,
)
from overlap_lab.experiments.gpu_validation import emulated_comm as EC
from overlap_lab.experiments.gpu_validation.context import case_workload, model_config

FIXTURE = Path(__file__).parent / "data" / "h200_decode32_serial_comm_layer1.trace.json.gz"
COMM = ("dispatch_a", "dispatch_b", "combine_a", "combine_b")


@pytest.fixture(scope="module")
def chrome() -> dict:
    return load_chrome(FIXTURE)


def _graph_kernels(chrome: dict) -> list[dict]:
    ev = chrome["traceEvents"]
    launch = {e["args"]["correlation"] for e in ev if e.get("name") == GRAPH_LAUNCH}
    return [e for e in ev if e.get("cat") == "kernel" and e["args"]["correlation"] in launch]


def test_local_work_is_the_replayed_kernels_outside_the_link_kernels(chrome):
    local = local_work_us(chrome)
    assert {op for op, _, _ in local} == set(COMM)  # experts has no link kernel
    km = map_kernels(chrome)
    replayed = sum(km.ops[(op, 1, 0)].replay_us for op in COMM)
    link = sum(e["dur"] for e in _graph_kernels(chrome) if e["name"] in LINK_KERNELS)
    assert sum(local.values()) + link == pytest.approx(replayed)
    # read off the whole recording (layer 1): the data path of a 32-token LL dispatch
    assert local[("dispatch_a", 1, 0)] == pytest.approx(86.368, abs=1e-3)
    assert local[("combine_b", 1, 0)] == pytest.approx(27.776, abs=1e-3)


def test_local_work_in_a_graph_holds_the_gaps_between_the_ops_kernels(chrome):
    bare, gapped = local_work_us(chrome), local_work_us(chrome, gap_us=0.5)
    km = map_kernels(chrome)
    for op in COMM:
        n = km.ops[(op, 1, 0)].kernels
        assert gapped[(op, 1, 0)] == pytest.approx(bare[(op, 1, 0)] + (n - 1) * 0.5)


def test_ops_named_are_timed_even_without_a_link_kernel(chrome):
    got = local_work_us(chrome, ops=[("experts", 1, 0), ("absent", 1, 0)])
    assert set(got) == {("experts", 1, 0)}
    assert got[("experts", 1, 0)] == pytest.approx(map_kernels(chrome).ops[("experts", 1, 0)].us)


def _decode_ops(mode: str = "decode", size: int = 32):
    from overlap_lab.shared import schedules as S
    from overlap_lab.shared.inputs.hardware import get_gpu
    from overlap_lab.shared.ir.program import ops_of

    gpu = get_gpu("h200")
    w = case_workload(model_config("deepseek-v3", 4), mode, size, ep=32, kv_len=4096)
    return gpu, w, {op.name: op for _, op in ops_of(S.build("serial", w, gpu)) if op.layer == 1}


def test_cost_model_charges_the_data_path_on_deepep_ops_only():
    from overlap_lab.sim.cost import RooflineCostModel, compute_time_us

    gpu, _, ops = _decode_ops()
    base = RooflineCostModel(None)
    cost = EC.EmulatedCommCost(base, {("dispatch_a", 32): 100.0, ("dispatch_b", 16): 8.0})
    a, b = ops["dispatch_a"], ops["dispatch_b"]
    d = cost.demand(a, gpu, a.sms)
    assert d.t_compute == pytest.approx(100.0 + compute_time_us(a, gpu, a.sms))
    assert d.fixed_us == 0.0
    # measured at 16 tokens only: the nearest size measured
    assert cost.demand(b, gpu, b.sms).t_compute == pytest.approx(
        max(base.demand(b, gpu, b.sms).t_compute, 8.0 + compute_time_us(b, gpu, b.sms))
    )
    for name in ("combine_a", "experts"):  # not measured / not communication: the base's
        op = ops[name]
        assert cost.demand(op, gpu, op.sms or gpu.num_sms) == base.demand(
            op, gpu, op.sms or gpu.num_sms
        )


def test_a_data_path_shorter_than_the_flight_stays_hidden():
    from overlap_lab.api import simulate
    from overlap_lab.sim.cost import RooflineCostModel

    gpu, w, _ = _decode_ops()

    def step(us: float) -> float:
        cost = EC.EmulatedCommCost(RooflineCostModel(None), {("dispatch_a", 32): us})
        return simulate("serial", w, gpu, profile="roofline", cost_model=cost).trace.step_time_us

    base = simulate("serial", w, gpu, profile="roofline").trace.step_time_us
    assert step(5.0) == pytest.approx(base, abs=0.01)  # hidden by the flight
    layers = 3  # the MoE layers of 4 (the first is dense)
    grown = step(500.0) - base
    assert layers * (500.0 - 100.0) < grown < layers * 500.0


def test_a_normal_receive_with_a_data_path_runs_on_the_sms():
    gpu, _, ops = _decode_ops("prefill", 4096)
    b = ops["combine_b"]
    assert b.sms == 0
    got = EC.as_executed(b, {("combine_b", 4096): 1891.0}, gpu.num_sms)
    assert (got.sms, got.grid, got.ctas) == (None, "waved", gpu.num_sms)
    assert EC.as_executed(b, {}, gpu.num_sms) is b
    assert EC.as_executed(ops["dispatch_a"], {("dispatch_a", 4096): 1.0}, 132) is ops["dispatch_a"]


def test_rows_round_trip():
    work = {("combine_b", 16): 27.8, ("dispatch_a", 32): 128.1}
    assert EC.from_rows(EC.rows(work)) == work


def test_graph_gap_is_the_lesser_of_the_unprofiled_and_the_profiled_bound():
    km = KernelMap({}, (), (4000.0,), (4302.0,), (708,), (0,), 0)
    assert graph_gap_us(km, 4662.0) == pytest.approx(302.0 / 708)  # the span's bound
    assert graph_gap_us(km, 4100.0) == pytest.approx(100.0 / 708)  # the step's bound
    assert graph_gap_us(dataclasses.replace(km, replay_device_us=()), 4662.0) is None
