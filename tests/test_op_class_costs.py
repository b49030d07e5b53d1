"""The cost model and the calibration profile key on what an op is (kind, op class, role), not on
its name: a new op of a known class is costed with no edit, DeepEP's rules hold for DeepEP's
kernels of any name and for no NCCL kernel, and the names a profile row may carry are read off
the IR's ops."""

from __future__ import annotations

import pytest

import overlap_lab as ol
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.ir import ops as layer_ops
from overlap_lab.shared.ir import ops_sched
from overlap_lab.shared.ir.deepep import below_published_sms
from overlap_lab.shared.ir.program import DEEPEP_CLASS, Coll, Flow, Op, ops_of
from overlap_lab.sim import cost
from overlap_lab.sim.profile import from_json, profiled_ops, reference_ops

H800 = get_gpu("h800")
HEAD = {"format": "overlap-lab-profile/1", "device": "H800", "date": "2025-01-01",
        "software": {"torch": "2.6"}, "source": "test"}  # fmt: skip


def _recv(name: str, op_class: str) -> Op:
    return Op(name, kind="comm", sms=24, hbm_bytes=1e6, op_class=op_class, coll=Coll("k", "recv"))


def _sendrecv(name: str, op_class: str, sms: int = 2) -> Op:
    flows = (Flow("nvlink", 1e8),)
    return Op(name, kind="comm", sms=sms, hbm_bytes=2e8, op_class=op_class,
              coll=Coll("k", "sendrecv", flows))  # fmt: skip


def test_deepeps_receive_cost_holds_for_its_class_whatever_the_name():
    assert H800.deepep_ll_recv_us > 0
    for name in ("dispatch_b", "combine_b", "a_new_deepep_recv"):
        assert cost.roofline_demand(_recv(name, DEEPEP_CLASS), H800, 24).fixed_us == (
            H800.deepep_ll_recv_us
        )
    for name in ("dispatch_b", "pp_recv_hidden"):  # NCCL's receives: no DeepEP cost
        assert cost.roofline_demand(_recv(name, "nccl"), H800, 24).fixed_us == 0.0


def test_deepeps_channels_hold_for_its_class_only():
    deepep = cost.channel_time_us(_sendrecv("any_name", DEEPEP_CLASS), H800)
    assert deepep > 1e8 / H800.link_bytes_per_us("nvlink", effective=True)  # 2 SMs: slower
    assert cost.channel_time_us(_sendrecv("dispatch_a", "nccl"), H800) == 0.0


def test_pipeline_all_gather_is_costed_as_ncclss_not_deepeps():
    """pp with attention TP all-gathers each received slice with NCCL on 2 SMs: no DeepEP
    channel model (it used to be charged DeepEP's rate on 2 of 24 SMs) and no note about it."""
    w = ol.workload("deepseek-v3", layers=4, batch=16, attn_tp=2, pp=2)
    res = ol.simulate("pp", w)
    gathers = [op for _, op in ops_of(res.program) if op.name.startswith("pp_allgather")]
    assert gathers and all(op.op_class == "nccl" for op in gathers)
    assert all(cost.channel_time_us(op, res.gpu) == 0.0 for op in gathers)
    assert below_published_sms(res.program, res.gpu.deepep_release) is None
    assert not any("DeepEP" in n for n in res.notes)


def test_a_new_compute_op_is_timed_by_its_class_row():
    doc = {**HEAD, "rows": [{"op": "gemm", "dtype": "fp8", "size": 64, "sms": 132, "us": 50.0}]}
    p = from_json(doc)
    new = Op("my_new_gemm", tokens=64, flops=1e9, hbm_bytes=1e6, op_class="gemm", dtype="fp8")
    m = p.lookup(new, 132)
    assert m is not None and (m.key, m.us) == ("gemm", 50.0)
    assert p.lookup(Op("gemm", kind="comm", op_class="comm", tokens=64, flops=1e9), 132) is None


def test_the_ops_a_row_may_name_are_read_off_the_irs_ops():
    built = {op.name for op in reference_ops()}
    named = (
        set(layer_ops.MOE_OP_NAMES + layer_ops.DENSE_OP_NAMES + layer_ops.HEAD_OP_NAMES)
        | set(layer_ops.PART_OP_NAMES + layer_ops.MTP_OP_NAMES + layer_ops.MTP_HEAD_NAMES)
        | ops_sched.SCHED_OP_NAMES
    )
    assert named <= built  # the reference workloads emit every op the IR names
    names = profiled_ops()
    assert {"experts", "attn.core", "logits", "mlp", "seq_lens_add"} <= names
    # communication and copies are the link model's, found by kind and class, not by name
    not_timed = {"dispatch_a", "dispatch_b", "combine_a", "combine_b", "d2h", "h2d_input_ids"}
    assert not names & not_timed


@pytest.mark.parametrize("op", ["h2d_input_ids", "d2h_next_token_ids", "combine_b"])
def test_a_row_for_a_copy_or_a_communication_op_is_refused(op):
    doc = {**HEAD, "rows": [{"op": op, "dtype": "bf16", "size": 64, "sms": 132, "us": 5.0}]}
    with pytest.raises(ConfigError, match=f"unknown op '{op}'"):
        from_json(doc)
