"""SBO against docs/schedules.md (single_batch_overlap.py, DeepseekV2MoE.forward_deepep).

Golden Programs: tests/golden/sbo_*.txt; regenerate with
``UPDATE_GOLDEN=1 pytest tests/test_sched_sbo.py``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model
from overlap_lab.shared.ir.ops import layer_ops, whole_batch
from overlap_lab.shared.ir.program import Launch, Record, Wait, WaitStream, iter_gpu_instrs, ops_of
from overlap_lab.shared.schedules import ScheduleConfig, build
from overlap_lab.shared.schedules.sbo import (
    comm_sms,
    plan,
    signal_count,
    split_experts,
    split_op,
    stream_chunks,
)
from overlap_lab.sim import simulate
from tests import invariants
from tests.sched_helpers import collapse, layer_instrs

GOLDEN = Path(__file__).parent / "golden"
H800, B200 = get_gpu("h800"), get_gpu("b200")
DSV3, LITE = get_model("deepseek-v3"), get_model("deepseek-v2-lite")
L = 10  # a MoE layer of DeepSeek-V3


def _w(batch=None, model=DSV3, ep=32):
    return Workload(model, batch or Batch.decode(128), Parallel(ep=ep))


def _layer(p, layer=L):
    return layer_instrs(p, layer)


def _names(instrs, stream=None, keep=frozenset()):
    return collapse(
        [i.op.name for i in instrs if isinstance(i, Launch) and stream in (None, i.stream)], keep
    )


# -- SM partition ------------------------------------------------------------------------------


def test_comm_sms_from_the_preset_and_overridable():
    assert comm_sms(H800, ScheduleConfig()) == 3
    assert comm_sms(B200, ScheduleConfig()) == 32
    assert comm_sms(H800, ScheduleConfig(comm_sms=8)) == 8
    p = plan(B200, ScheduleConfig())
    assert p.compute_sms == 148 - 32
    with pytest.raises(ConfigError):
        comm_sms(H800, ScheduleConfig(comm_sms=132))


def test_meta_reports_the_partition():
    m = build("sbo", _w(), H800).meta
    assert (m.comm_sms, m.compute_sms, m.sbo_mode) == (3, 129, 1)
    assert m.sbo_overlaps == ["combine<->down_gemm", "dispatch<->shared_experts"]
    assert m.sbo_upstream is True


# -- signals and chunks ------------------------------------------------------------------------


def test_signal_count_hopper_and_blackwell():
    w = _w(Batch.decode(128))
    # Hopper: local experts x ceil(rows/64); rows = 128 tokens x 8 / 8 local experts = 128
    assert signal_count(w, H800, 128) == w.local_experts * math.ceil(128 / 64) == 16
    assert signal_count(w, H800, 8) == w.local_experts * 1
    assert signal_count(w, B200, 128) == w.local_experts  # one uint32 per local expert


def test_stream_chunks_one_slice_per_signal():
    assert stream_chunks(16) == [1 / 16] * 16
    assert stream_chunks(1) == [1.0]


def test_splitting_conserves_work_and_traffic():
    ops = layer_ops(_w(), H800, L, whole_batch(_w()), deepep_mode="low_latency")
    up, down = split_experts(ops["experts"])
    assert up.flops + down.flops == pytest.approx(ops["experts"].flops)
    assert down.flops == pytest.approx(ops["experts"].flops / 3)
    pieces = split_op(ops["combine_a"], stream_chunks(6), sms=3)
    assert sum(p.hbm_bytes for p in pieces) == pytest.approx(ops["combine_a"].hbm_bytes)
    for link in ("nvlink", "rdma"):
        total = sum(f.nbytes for f in ops["combine_a"].coll.flows if f.link == link)
        split = sum(f.nbytes for p in pieces for f in p.coll.flows if f.link == link)
        assert split == pytest.approx(total)
    assert {p.coll.key for p in pieces} == {ops["combine_a"].coll.key}


# -- mode 1 ------------------------------------------------------------------------------------


def test_mode1_hopper_layer():
    ins = _layer(build("sbo", _w(), H800))
    main = _names(ins, "main", keep={"experts.act_quant"})
    assert main == [
        "comm_prepare_attn", "attn.prepare", "attn.core", "comm_prepare_mlp", "gate",
        "select_experts", "dispatch_a", "shared_experts", "dispatch_b",  # mode 3 companion
        # the activation between the gate-up and the down GEMM, before the start event
        "experts.gate_up", "experts.act_quant", *(f"experts.down.{k}" for k in range(16)),
        "combine_b", "output", "comm_postprocess_layer",
    ]  # fmt: skip
    assert _names(ins, "alt") == ["combine_a"]  # one resident kernel polling 16 signals
    launches = [i for i in ins if isinstance(i, Launch)]
    assert all(i.op.sms == 129 for i in launches if i.op.name.startswith("experts.down"))
    assert all(i.op.sms == 3 for i in launches if i.stream == "alt")
    assert next(i for i in launches if i.op.name == "experts.gate_up").op.sms is None


def test_mode1_the_combine_polls_every_signal_in_order():
    ins = _layer(build("sbo", _w(), H800))
    combine = next(i.op for i in ins if isinstance(i, Launch) and i.op.name == "combine_a")
    assert combine.waits == tuple(f"s0.L{L}.mb0.sbo.sig{k}" for k in range(16))
    for k in range(16):
        sig = f"s0.L{L}.mb0.sbo.sig{k}"
        rec = next(j for j, i in enumerate(ins) if isinstance(i, Record) and i.event == sig)
        assert _names([ins[rec - 1]]) == [f"experts.down.{k}"]
    start = next(i for i in ins if isinstance(i, Wait) and i.event.endswith("sbo.start"))
    assert start.stream == "alt"


def test_mode1_blackwell_puts_shared_after_down_on_compute_sms():
    ins = _layer(build("sbo", _w(), B200))
    main = _names(ins, "main")
    assert main.index("shared_experts") > main.index("dispatch_b")
    shared = next(i.op for i in ins if isinstance(i, Launch) and i.op.name == "shared_experts")
    assert shared.sms == 148 - 32
    assert main.index("shared_experts") > main.index("experts.down.7")
    assert signal_count(_w(), B200, 128) == 8 and _names(ins, "alt") == ["combine_a"]


def test_combine_b_sync_rule():
    p = build("sbo", _w(), H800)
    flat = list(iter_gpu_instrs(p.ranks[0].threads[0].instrs))
    k = next(k for k, i in enumerate(flat) if isinstance(i, Launch) and i.op.name == "combine_b")
    assert flat[k - 1] == WaitStream("alt", "main") and flat[k + 1] == WaitStream("main", "alt")
    p2 = build("sbo", _w(), B200, ScheduleConfig(sbo_mode=2))
    flat = list(iter_gpu_instrs(p2.ranks[0].threads[0].instrs))
    k = next(k for k, i in enumerate(flat) if isinstance(i, Launch) and i.op.name == "combine_b")
    assert flat[k - 1] == WaitStream("alt", "main") and flat[k + 1] == WaitStream("main", "alt")


# -- mode 2 and mode 3 -------------------------------------------------------------------------


def test_mode2_shared_on_main_while_combine_on_alt():
    ins = _layer(build("sbo", _w(), B200, ScheduleConfig(sbo_mode=2)))
    main = _names(ins, "main")
    assert main[main.index("dispatch_a") + 1] == "dispatch_b"  # no dispatch hook
    assert main[main.index("experts") + 1] == "shared_experts"
    assert _names(ins, "alt") == ["combine_a"]
    rec = next(j for j, i in enumerate(ins) if isinstance(i, Record))
    assert _names([ins[rec - 1]]) == ["experts"] and ins[rec].event.endswith("down_done")
    wait = next(i for i in ins if isinstance(i, Wait))
    assert (wait.stream, wait.event) == ("alt", ins[rec].event)
    ops = {i.op.name: i.op for i in ins if isinstance(i, Launch)}
    assert ops["shared_experts"].sms == 116 and ops["combine_a"].sms == 32
    assert build("sbo", _w(), B200, ScheduleConfig(sbo_mode=2)).meta.sbo_upstream


def test_mode3_shared_in_the_dispatch_hook_one_stream():
    p = build("sbo", _w(), H800, ScheduleConfig(sbo_mode=3))
    ins = _layer(p)
    main = _names(ins, "main")
    assert main[main.index("dispatch_a") : main.index("dispatch_a") + 3] == [
        "dispatch_a",
        "shared_experts",
        "dispatch_b",
    ]
    assert _names(ins, "alt") == [] and not any(isinstance(i, (Record, Wait)) for i in ins)
    assert main[main.index("experts") + 1 : main.index("experts") + 3] == ["combine_a", "combine_b"]
    assert p.meta.sbo_overlaps == ["dispatch<->shared_experts"]


def test_upstream_flags_what_sglang_does_not_run():
    assert not build("sbo", _w(), H800, ScheduleConfig(sbo_mode=2)).meta.sbo_upstream
    assert not build("sbo", _w(), B200, ScheduleConfig(sbo_mode=3)).meta.sbo_upstream


# -- scope -------------------------------------------------------------------------------------


def test_dense_layers_untouched_and_op_counts_match():
    p = build("sbo", _w(), H800)
    ops = [i.op for i in iter_gpu_instrs(p.ranks[0].threads[0].instrs) if isinstance(i, Launch)]
    moe = DSV3.num_layers - DSV3.first_k_dense
    assert sum(o.name == "experts.gate_up" for o in ops) == moe
    assert sum(o.name == "shared_experts" for o in ops) == moe
    assert sum(o.name == "mlp" for o in ops) == DSV3.first_k_dense
    assert all(o.name != "experts" for o in ops)
    assert sum(o.name == "combine_a" and len(o.waits) == 16 for o in ops) == moe


def test_prefill_normal_kernels_fall_back():
    w = _w(Batch.prefill(2, extend_len=512))
    p = build("sbo", w, H800)
    assert "low-latency" in p.meta.fallback_reason and p.meta.schedule == "sbo"
    assert [o.name for _, o in ops_of(p)] == [o.name for _, o in ops_of(build("serial", w, H800))]


# -- simulation --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [1, 2, 3])
@pytest.mark.parametrize("gpu", [H800, B200], ids=["h800", "b200"])
def test_trace_invariants(mode, gpu):
    w = _w(Batch.decode(32), model=LITE, ep=8)
    p = build("sbo", w, gpu, ScheduleConfig(sbo_mode=mode))
    tr = simulate(p, gpu)
    invariants.check_all(p, tr, gpu.num_sms)
    busiest = max(tr.summary()["busy_us"].values())
    total = sum(s.end - s.start for s in tr.spans if s.lane.split(":")[0] in ("stream", "host"))
    assert busiest - 1e-6 <= tr.summary()["step_time_us"] <= total + 1e-6


def test_mode1_combine_overlaps_the_down_gemm_in_the_trace():
    tr = simulate(build("sbo", _w(), H800), H800)
    spans = [s for s in tr.spans if s.layer == L and s.lane.startswith("stream:")]
    down = [s for s in spans if s.op.startswith("experts.down")]
    (comb,) = [s for s in spans if s.op == "combine_a"]
    assert comb.start < min(d.end for d in down)  # resident from the start event on
    assert comb.end > max(d.end for d in down)  # its last part waits for the last signal


@pytest.mark.parametrize("mode", [1, 2, 3])
def test_golden(mode):
    w = _w(Batch.decode(6), model=LITE, ep=8)
    text = str(build("sbo", w, H800, ScheduleConfig(sbo_mode=mode)))
    path = GOLDEN / f"sbo_lite_decode_mode{mode}.txt"
    if os.environ.get("UPDATE_GOLDEN") == "1" or not path.exists():
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs; UPDATE_GOLDEN=1 to regenerate"


@pytest.mark.parametrize(
    "gpu,sms", [(H800, 8), (H800, 32), (B200, 32)], ids=["h800-8", "h800-32", "b200-32"]
)
@pytest.mark.parametrize("schedule", ["sbo", "tbo+sbo"])
def test_many_comm_sms_beside_the_receive_hook_do_not_stall(gpu, sms, schedule):
    """DeepSeek-V3's low-latency hook holds 128 SMs: with more than num_sms - 128 comm SMs a hook
    issued before the last send piece would wait forever (see sbo.lower_combine_b)."""
    w = Workload(DSV3, Batch.decode(64), Parallel(ep=32))
    p = build(schedule, w, gpu, ScheduleConfig(comm_sms=sms))
    tr = simulate(p, gpu)
    assert tr.step_time_us > 0
