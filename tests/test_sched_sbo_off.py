"""sbo-off against docs/schedules.md: SGLang's DeepseekV2MoE.forward_deepep with SBO off, the
baseline SBO is compared with.

Golden Program: tests/golden/sbo_off_lite_decode.txt; regenerate with
``UPDATE_GOLDEN=1 pytest tests/test_sched_sbo_off.py``.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model
from overlap_lab.shared.ir.program import (
    HIGH_PRIORITY,
    Launch,
    Record,
    Wait,
    WaitStream,
    ops_of,
)
from overlap_lab.shared.schedules import build
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


def _short(ins) -> str:
    if isinstance(ins, Launch):
        return f"{ins.stream}:{ins.op.name}"
    if isinstance(ins, Record):
        return f"record {ins.stream}"
    if isinstance(ins, Wait):
        return f"wait {ins.stream}"
    if isinstance(ins, WaitStream):
        return f"{ins.stream} waits {ins.other}"
    raise AssertionError(ins)


def test_decode_layer_forks_the_shared_experts_after_the_gate_and_joins_before_output():
    body = _layer(build("sbo-off", _w(), H800))
    assert collapse([_short(i) for i in body]) == [
        "main:comm_prepare_attn",
        "main:attn.prepare",
        "main:attn.core",
        "main:comm_prepare_mlp",
        "main:gate",
        "alt waits main",  # alt_stream.wait_stream(current_stream())
        "alt:shared_experts",
        "record alt",  # shared_event = alt_stream.record_event()
        "main:select_experts",
        "main:dispatch_a",
        "main:dispatch_b",
        "main:experts",
        "main:combine_a",
        "main:combine_b",
        "wait main",  # current_stream().wait_event(shared_event)
        "main:output",
        "main:comm_postprocess_layer",
    ]
    (rec,) = [i for i in body if isinstance(i, Record)]
    (wait,) = [i for i in body if isinstance(i, Wait)]
    assert rec.event == wait.event


def test_no_sm_limits_and_default_priority_streams():
    p = build("sbo-off", _w(), H800)
    rp = p.ranks[0]
    assert rp.streams == ("main", "alt") and rp.priorities == ()
    layer = [i.op for i in _layer(p) if isinstance(i, Launch)]
    assert all(o.sms is None for o in layer if o.kind == "compute")
    assert all(not o.waits for o in layer)
    assert not p.meta.reported("sbo_mode") and not p.meta.reported("comm_sms")
    assert p.meta.schedule == "sbo-off" and not p.meta.reported("fallback_reason")


@pytest.mark.parametrize("batch", [Batch.decode(64), Batch.prefill(2, extend_len=512)])
def test_same_ops_and_work_as_serial(batch):
    w = _w(batch)
    assert Counter(o for _, o in ops_of(build("sbo-off", w, H800))) == Counter(
        o for _, o in ops_of(build("serial", w, H800))
    )


def test_prefill_normal_kernels_on_deepep_high_priority_comm_stream():
    p = build("sbo-off", _w(Batch.prefill(2, extend_len=512)), H800)
    rp = p.ranks[0]
    assert rp.streams == ("main", "alt", "comm") and rp.priority("comm") == HIGH_PRIORITY
    assert rp.priority("alt") == 0
    on = {i.op.name: i.stream for i in _layer(p) if isinstance(i, Launch)}
    assert (on["dispatch_a"], on["combine_a"], on["shared_experts"]) == ("comm", "comm", "alt")
    assert (on["dispatch_b"], on["combine_b"], on["experts"]) == ("main", "main", "main")
    assert p.meta.deepep_mode == "normal"


@pytest.mark.parametrize("gpu", [H800, B200], ids=["h800", "b200"])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_trace_shared_experts_between_gate_and_output(gpu, mode):
    b = Batch.decode(32) if mode == "decode" else Batch.prefill(1, extend_len=512)
    w = _w(b, model=LITE, ep=8)
    p = build("sbo-off", w, gpu)
    tr = simulate(p, gpu)
    invariants.check_all(p, tr, gpu.num_sms)
    layer = 2  # deepseek-v2-lite: layer 0 dense, the rest MoE

    def span(name, lane="stream:main") -> tuple[float, float]:
        """(start, end) of the op in ``layer``, over all its spans (a waved kernel has one per
        cohort of waves)."""
        sp = [s for s in tr.spans if s.layer == layer and s.op == name and s.lane == lane]
        assert sp, name
        return min(s.start for s in sp), max(s.end for s in sp)

    shared = span("shared_experts", "stream:alt")
    assert span("gate")[1] <= shared[0] + 1e-9
    assert shared[1] <= span("output")[0] + 1e-9


def test_golden():
    text = str(build("sbo-off", _w(Batch.decode(6), model=LITE, ep=8), H800))
    path = GOLDEN / "sbo_off_lite_decode.txt"
    if os.environ.get("UPDATE_GOLDEN") == "1" or not path.exists():
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs; UPDATE_GOLDEN=1 to regenerate"
