"""TBO and TBO+SBO against docs/schedules.md (and upstream operations_strategy.py).

Golden Programs: tests/golden/tbo_*.txt and tbo_sbo_*.txt; regenerate with
``UPDATE_GOLDEN=1 pytest tests/test_sched_tbo.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model
from overlap_lab.shared.ir.program import (
    Graph,
    Launch,
    Record,
    Wait,
    WaitStream,
    iter_gpu_instrs,
    ops_of,
)
from overlap_lab.shared.schedules import ScheduleConfig, build
from overlap_lab.shared.schedules.stages import YIELD, interleave, to_stages
from overlap_lab.shared.schedules.tbo import (
    DEEPSEEK_DECODE,
    DEEPSEEK_PREFILL,
    QWEN3_DECODE,
    QWEN3_PREFILL,
    strategy_for,
)
from overlap_lab.sim import simulate
from tests import invariants
from tests.sched_helpers import collapse

GOLDEN = Path(__file__).parent / "golden"
H800 = get_gpu("h800")
DSV3 = get_model("deepseek-v3")
LITE = get_model("deepseek-v2-lite")


def _w(batch, model=DSV3, ep=32, attn_tp=1):
    return Workload(model, batch, Parallel(ep=ep, attn_tp=attn_tp))


def _instrs(p):
    return list(iter_gpu_instrs(p.ranks[0].threads[0].instrs))


def _main_ops(p, layers=None):
    """(mb, layer, name) of every op launched on main, in issue order, each key's parts folded
    into the key (``tests.sched_helpers.collapse``)."""
    return collapse(
        [
            (i.op.mb, i.op.layer, i.op.name)
            for i in _instrs(p)
            if isinstance(i, Launch)
            and i.stream == "main"
            and (layers is None or i.op.layer in layers)
        ]
    )


def _check_golden(name: str, text: str) -> None:
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("UPDATE_GOLDEN") == "1" or not path.exists():
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs; UPDATE_GOLDEN=1 to regenerate"


# -- the interleaver -------------------------------------------------------------------------


def test_to_stages_chunks_at_yields_and_ignores_a_trailing_one():
    assert to_stages(["a", "b", YIELD, "c", YIELD]) == [["a", "b"], ["c"]]
    with pytest.raises(ValueError):
        to_stages(["a", YIELD, YIELD, "b"])


def test_interleave_delta_two():
    a, b = [["a0"], ["a1"], ["a2"], ["a3"]], [["b0"], ["b1"], ["b2"], ["b3"]]
    order = [s[0] for _, s in interleave(a, b, 2)]
    assert order == ["a0", "a1", "a2", "b0", "a3", "b1", "b2", "b3"]


def test_interleave_delta_zero_alternates():
    order = [s[0] for _, s in interleave([["a0"], ["a1"]], [["b0"], ["b1"]], 0)]
    assert order == ["a0", "b0", "a1", "b1"]


# -- strategies ------------------------------------------------------------------------------


def test_strategy_stage_counts_and_deltas():
    assert (DEEPSEEK_DECODE.layer_stage_count(), DEEPSEEK_DECODE.delta_stages) == (6, 2)
    assert (DEEPSEEK_PREFILL.layer_stage_count(), DEEPSEEK_PREFILL.delta_stages) == (3, 0)
    assert (QWEN3_DECODE.layer_stage_count(), QWEN3_DECODE.delta_stages) == (5, 2)
    assert (QWEN3_PREFILL.layer_stage_count(), QWEN3_PREFILL.delta_stages) == (3, 0)
    assert DEEPSEEK_PREFILL.limit_deep_gemm and not DEEPSEEK_DECODE.limit_deep_gemm
    assert "shared_experts" not in QWEN3_DECODE.operations + QWEN3_PREFILL.operations


def test_strategy_choice_follows_layer_class_and_mode():
    assert strategy_for(_w(Batch.decode(8))) is DEEPSEEK_DECODE
    assert strategy_for(_w(Batch.decode(8, tokens_per_seq=2))) is DEEPSEEK_DECODE  # verify
    assert strategy_for(_w(Batch.prefill(2, extend_len=64))) is DEEPSEEK_PREFILL
    q = get_model("qwen3-30b-a3b")
    assert strategy_for(_w(Batch.decode(8), model=q)) is QWEN3_DECODE


# -- DeepSeek decode: order, lag, merge across layers ----------------------------------------


def test_deepseek_decode_order_first_layer():
    p = build("tbo", _w(Batch.decode(64)), H800)
    got = [(mb, name) for mb, layer, name in _main_ops(p, layers={3, 4})][:26]
    A, B = 0, 1
    assert got == [
        (A, "comm_prepare_attn"), (A, "attn.prepare"),  # A stage 0 alone
        (A, "attn.core"), (A, "comm_prepare_mlp"), (A, "gate"), (A, "select_experts"),  # A 1
        (A, "dispatch_a"), (A, "shared_experts"),  # A stage 2 ...
        (B, "comm_prepare_attn"), (B, "attn.prepare"),  # ... while B starts (lag 2)
        (A, "dispatch_b"), (A, "experts"), (A, "combine_a"),
        (B, "attn.core"), (B, "comm_prepare_mlp"), (B, "gate"), (B, "select_experts"),
        (A, "combine_b"),
        (B, "dispatch_a"), (B, "shared_experts"),
        # A's [output, postprocess] merges with its next layer's first stage (no YIELD between)
        (A, "output"), (A, "comm_postprocess_layer"), (A, "comm_prepare_attn"), (A, "attn.prepare"),
        (B, "dispatch_b"), (B, "experts"),
    ]  # fmt: skip


def test_deepseek_decode_b_lags_a_by_two_stages():
    p = build("tbo", _w(Batch.decode(64)), H800)
    sparse = set(range(DSV3.first_k_dense, DSV3.num_layers))
    ops = _main_ops(p, layers=sparse)
    # each micro-batch: 6 stages per layer, merged across layers -> 5 per layer + 1
    stage_starts = {"comm_prepare_attn", "attn.core", "dispatch_a", "dispatch_b", "combine_b"}
    starts = {0: [], 1: []}
    for pos, (mb, _layer, name) in enumerate(ops):
        if name in stage_starts:
            starts[mb].append(pos)
    assert len(starts[0]) == len(starts[1]) == 5 * len(sparse)
    # B's stage k is issued right after A's stage k + 2
    for k in range(len(starts[1]) - 3):
        assert starts[0][k + 2] < starts[1][k] < starts[0][k + 3]


def test_dense_layers_run_unsplit_before_the_split():
    w = _w(Batch.decode(64))
    p = build("tbo", w, H800)
    ops = _main_ops(p)
    dense = [x for x in ops if x[1] is not None and x[1] < DSV3.first_k_dense]
    first_b = next(i for i, x in enumerate(ops) if x[0] == 1)
    assert dense and all(mb == 0 for mb, _, _ in dense)
    assert max(ops.index(x) for x in dense) < first_b
    tokens = {i.op.tokens for i in _instrs(p) if isinstance(i, Launch) and i.op.layer == 0}
    assert tokens == {64}


def test_op_counts_match_the_model():
    w = _w(Batch.decode(64))
    p = build("tbo", w, H800)
    ops = [op for _, op in ops_of(p)]
    sparse = DSV3.num_layers - DSV3.first_k_dense
    for mb in (0, 1):
        assert sum(1 for o in ops if o.mb == mb and o.name == "experts") == sparse
        assert sum(1 for o in ops if o.mb == mb and o.name == "attn.core") == sparse + (
            DSV3.first_k_dense if mb == 0 else 0
        )
    assert sum(1 for o in ops if o.name == "mlp") == DSV3.first_k_dense


def test_two_dispatchers_distinct_collective_keys():
    p = build("tbo", _w(Batch.decode(64)), H800)
    keys = {(o.mb, o.coll.key) for _, o in ops_of(p) if o.coll and o.layer == 10}
    assert {k for mb, k in keys if mb == 0}.isdisjoint({k for mb, k in keys if mb == 1})
    assert len(keys) == 4  # dispatch + combine per micro-batch


def test_decode_graph_holds_both_micro_batches():
    p = build("tbo", _w(Batch.decode(64)), H800)
    graphs = [i for i in p.ranks[0].threads[0].instrs if isinstance(i, Graph)]
    assert len(graphs) == 1
    mbs = {i.op.mb for i in graphs[0].body if isinstance(i, Launch)}
    assert mbs == {0, 1}
    assert p.meta.cuda_graph is True


def test_decode_everything_on_one_stream():
    p = build("tbo", _w(Batch.decode(64)), H800)
    assert p.ranks[0].streams == ("main",)
    assert {i.stream for i in _instrs(p) if isinstance(i, Launch)} == {"main"}


def test_meta_reports_the_split_and_knobs():
    p = build("tbo", _w(Batch.decode(7)), H800)
    m = p.meta
    assert m.schedule == "tbo" and m.extra["delta_stages"] == 2
    assert m.extra["strategy"] == "deepseek-decode"
    assert [mb["tokens"] for mb in m.micro_batches] == [3, 4]
    assert not m.reported("fallback_reason")


def test_delta_stages_override():
    p = build("tbo", _w(Batch.decode(64)), H800, ScheduleConfig(delta_stages=0))
    ops = _main_ops(p, layers={3})
    assert ops[:3] == [
        (0, 3, "comm_prepare_attn"),
        (0, 3, "attn.prepare"),
        (1, 3, "comm_prepare_attn"),
    ]


# -- DeepSeek prefill ------------------------------------------------------------------------


def test_prefill_limits_deep_gemm_in_sparse_layers_only():
    p = build("tbo", _w(Batch.prefill(2, extend_len=1024)), H800)
    limit = H800.num_sms - H800.deepep_normal_sms
    assert p.meta.extra["deep_gemm_sms"] == limit == 112  # DeepEP default Buffer.num_sms = 20
    for _, op in ops_of(p):
        deep_gemm = op.dtype == "fp8" and op.op_class in ("gemm", "grouped_gemm")
        if op.layer is not None and op.layer >= DSV3.first_k_dense and deep_gemm:
            assert op.sms == limit, op.name
        elif op.layer is not None and op.layer < DSV3.first_k_dense:
            assert op.sms is None or op.kind == "comm"


def test_prefill_stages_alternate_with_delta_zero():
    p = build("tbo", _w(Batch.prefill(2, extend_len=1024)), H800)
    ops = [(mb, n) for mb, layer, n in _main_ops(p, layers={3}) if n in ("dispatch_b", "attn.core")]
    assert ops == [(0, "attn.core"), (1, "attn.core"), (0, "dispatch_b"), (1, "dispatch_b")]


def test_prefill_normal_deepep_runs_on_the_comm_stream():
    p = build("tbo", _w(Batch.prefill(2, extend_len=1024)), H800)
    assert p.ranks[0].streams == ("main", "comm")
    ins = _instrs(p)
    on_comm = [i.op.name for i in ins if isinstance(i, Launch) and i.stream == "comm"]
    # DeepEP's Buffer runs its layout and notify kernels on its comm stream too
    deepep = {"get_dispatch_layout", "notify_dispatch", "dispatch_a", "cached_notify", "combine_a"}
    assert set(on_comm) == deepep
    # dispatch_b waits on the comm stream's completion event before it is launched
    for k, i in enumerate(ins):
        if isinstance(i, Launch) and i.op.name == "dispatch_b":
            assert isinstance(ins[k - 1], Wait) and ins[k - 1].stream == "main"
            assert ins[k - 1].event.endswith("dispatch_a.done")
    assert p.meta.cuda_graph is False


# -- Qwen3-MoE -------------------------------------------------------------------------------


def test_qwen3_decode_five_stages_no_merge_no_shared():
    q = get_model("qwen3-30b-a3b")
    p = build("tbo", _w(Batch.decode(64), model=q), H800)
    assert p.meta.extra["strategy"] == "qwen3-moe-decode"
    ops = _main_ops(p)
    assert not any(n == "shared_experts" for _, _, n in ops)
    # B's first stage comes after A's stage 2 = [dispatch_a] (delta 2)
    first_b = next(i for i, x in enumerate(ops) if x[0] == 1)
    assert ops[first_b - 1] == (0, 0, "dispatch_a")
    # layer boundary does not merge: A's next attention prep is a stage of its own
    seq = [(mb, n) for mb, layer, n in ops if layer in (0, 1)]
    i = seq.index((0, "comm_postprocess_layer"))
    assert seq[i + 1 : i + 5] == [
        (1, "dispatch_a"),  # B's stage 2
        (0, "comm_prepare_attn"), (0, "attn.prepare"),  # A's next layer, stage 0 on its own
        (1, "dispatch_b"),  # B's stage 3
    ]  # fmt: skip


# -- fallbacks -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch,cfg,reason",
    [
        (Batch.decode(1), ScheduleConfig(), "empty micro-batch"),
        (Batch.decode(64), ScheduleConfig(dp_ranks_disagree=True), "DP ranks disagree"),
        (Batch.prefill(2, extend_len=64), ScheduleConfig(deepep_mode="low_latency"), "extend"),
    ],
)
@pytest.mark.parametrize("schedule", ["tbo", "tbo+sbo"])
def test_refusals_run_unsplit_and_say_why(batch, cfg, reason, schedule):
    p = build(schedule, _w(batch), H800, cfg)
    assert reason in p.meta.fallback_reason
    assert len(p.meta.micro_batches) == 1 and p.meta.schedule == schedule
    assert {op.mb for _, op in ops_of(p)} == {0}


# -- TBO + SBO -------------------------------------------------------------------------------


def test_tbo_sbo_streams_the_combine_of_each_micro_batch():
    p = build("tbo+sbo", _w(Batch.decode(128)), H800)
    assert p.ranks[0].streams == ("main", "alt")
    ins = _instrs(p)
    alt = [i.op for i in ins if isinstance(i, Launch) and i.stream == "alt" and i.op.layer == 10]
    assert {o.mb for o in alt} == {0, 1}
    assert all(o.name == "combine_a" and o.sms == 3 and o.waits for o in alt)
    down = [i.op for i in ins if isinstance(i, Launch) and i.op.name.startswith("experts.down.")]
    assert down and all(o.sms == H800.num_sms - 3 for o in down)
    assert p.meta.sbo_overlaps == ["combine<->down_gemm"] and p.meta.comm_sms == 3


def test_tbo_sbo_keeps_tbo_stage_order():
    p1 = build("tbo", _w(Batch.decode(128)), H800)
    p2 = build("tbo+sbo", _w(Batch.decode(128)), H800)

    def coarse(p):
        out = []
        for mb, _layer, n in _main_ops(p, layers={3, 4}):
            n = "experts" if n.startswith("experts.") else n
            if not out or out[-1] != (mb, n):
                out.append((mb, n))
        return out

    assert [x for x in coarse(p1) if x[1] != "combine_a"] == coarse(p2)


def test_tbo_sbo_combine_b_sync_rule():
    ins = _instrs(build("tbo+sbo", _w(Batch.decode(128)), H800))
    k = next(k for k, i in enumerate(ins) if isinstance(i, Launch) and i.op.name == "combine_b")
    assert ins[k - 1] == WaitStream("alt", "main") and ins[k + 1] == WaitStream("main", "alt")


def test_tbo_sbo_prefill_is_plain_tbo_with_a_reason():
    w = _w(Batch.prefill(2, extend_len=1024))
    p = build("tbo+sbo", w, H800)
    assert p.meta.reported("sbo_inactive_reason") and not p.meta.reported("fallback_reason")
    assert _main_ops(p) == _main_ops(build("tbo", w, H800))


# -- simulated traces satisfy the invariants; goldens ------------------------------------------


CASES = [
    ("tbo", Batch.decode(16)),
    ("tbo", Batch.prefill(extend_lens=[300, 200, 60])),
    ("tbo+sbo", Batch.decode(16)),
]


@pytest.mark.parametrize("schedule,batch", CASES)
def test_trace_invariants(schedule, batch):
    p = build(schedule, _w(batch, model=LITE, ep=8), H800)
    tr = simulate(p, H800)
    invariants.check_all(p, tr, H800.num_sms)
    # between the busiest lane (a lower bound on any schedule) and everything end to end
    busiest = max(tr.summary()["busy_us"].values())
    total = sum(s.end - s.start for s in tr.spans if s.lane.split(":")[0] in ("stream", "host"))
    assert busiest - 1e-6 <= tr.summary()["step_time_us"] <= total + 1e-6


@pytest.mark.parametrize(
    "name,schedule,batch",
    [
        ("tbo_lite_decode", "tbo", Batch.decode(6)),
        ("tbo_lite_prefill", "tbo", Batch.prefill(extend_lens=[300, 20, 60])),
        ("tbo_sbo_lite_decode", "tbo+sbo", Batch.decode(6)),
    ],
)
def test_golden(name, schedule, batch):
    p = build(schedule, _w(batch, model=LITE, ep=8), H800)
    _check_golden(name, str(p))


def test_record_before_wait_everywhere():
    """Events are single-assignment and recorded before any wait on them is issued."""
    for schedule, batch in CASES:
        p = build(schedule, _w(batch, model=LITE, ep=8), H800)
        recorded = set()
        for i in _instrs(p):
            if isinstance(i, Record):
                assert i.event not in recorded
                recorded.add(i.event)
            elif isinstance(i, Wait):
                assert i.event in recorded, i
