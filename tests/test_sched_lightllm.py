"""LightLLM's two-micro-batch overlap against docs/schedules.md (splits, orders, groups,
hooks) and upstream ``Deepseek2TransformerLayerInfer.overlap_tpsp_*_forward``.

Golden files hold the text of one MoE layer's window (``tests/golden/lightllm_<case>.txt``) with the
work numbers stripped (those belong to ops.py's tests). Regenerate after an intended change with
``UPDATE_GOLDEN=1 pytest tests/test_sched_lightllm.py``.
"""

from __future__ import annotations

import pytest

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model
from overlap_lab.shared.ir.ops import DENSE_OP_NAMES, KEY_OF, MOE_OP_NAMES
from overlap_lab.shared.ir.program import Graph, Launch, Record, Sync, Wait, iter_gpu_instrs, ops_of
from overlap_lab.shared.schedules import ScheduleConfig, build
from overlap_lab.shared.schedules.lightllm import split_decode, split_prefill
from tests.sched_helpers import (
    check_golden,
    check_simulated,
    collapse,
    layer_window,
    main_thread,
    moe_mid_layer,
)

H800 = get_gpu("h800")
V3 = get_model("deepseek-v3")
LITE = get_model("deepseek-v2-lite")


def decode_w(n=128, ep=128, model=V3, **kw):
    return Workload(model, Batch.decode(n, **kw), Parallel(ep=ep))


def prefill_w(n=4, ep=32, model=V3, extend_len=4096, **kw):
    return Workload(model, Batch.prefill(n, extend_len=extend_len, **kw), Parallel(ep=ep))


# ----------------------------------------------------------------------------------------------
# Splits and padding
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, tps, want",
    [
        (128, 1, ((0, 64, 64), (64, 128, 64))),
        (5, 1, ((0, 3, 3), (3, 5, 3))),  # cdiv(5, 2) = 3 each: mb1 padded with one fake request
        (1, 1, ((0, 1, 1), (1, 1, 1))),  # mb1 is all padding
        (5, 2, ((0, 3, 6), (3, 5, 6))),  # tokens_per_seq scales tokens and padding
    ],
)
def test_decode_split_pads_both_to_cdiv_half(n, tps, want):
    mbs = split_decode(decode_w(n, tokens_per_seq=tps))
    got = tuple((mb.seq_lo, mb.seq_hi, mb.padded_tokens) for mb in mbs)
    assert got == want
    assert mbs[0].padded_tokens == mbs[1].padded_tokens  # asserted equal upstream
    assert mbs[0].tokens == (want[0][1] - want[0][0]) * tps


def test_decode_split_pads_to_the_dp_wide_max():
    mbs = split_decode(decode_w(6), max_decode_num=10)
    assert [mb.padded_tokens for mb in mbs] == [5, 5]
    assert [mb.tokens for mb in mbs] == [3, 3]
    # the DP maximum comes from the other ranks' decode tokens (all_reduce MAX upstream)
    p = build("lightllm", decode_w(6), H800, ScheduleConfig(dp_peer_tokens=(4, 10, 7)))
    assert p.meta.extra["max_decode_num"] == 10
    assert [m["padded_tokens"] for m in p.meta.micro_batches] == [5, 5]
    with pytest.raises(ConfigError, match="max_decode_num"):
        split_decode(decode_w(6), max_decode_num=5)


@pytest.mark.parametrize(
    "lens, want",
    [
        ((4096,) * 4, ((0, 2, 8192, 8192), (2, 4, 8192, 8192))),
        ((100, 1, 1), ((0, 2, 101, 101), (2, 3, 1, 1))),  # by request count, not tokens
        ((4096,), ((0, 1, 4096, 4096), (1, 1, 0, 1))),  # empty mb1: one fake 1-token request
        ((7, 9), ((0, 1, 7, 7), (1, 2, 9, 9))),  # no common size in prefill
    ],
)
def test_prefill_split_by_requests_padding_only_when_empty(lens, want):
    w = Workload(V3, Batch.prefill(extend_lens=lens), Parallel(ep=32))
    got = tuple((mb.seq_lo, mb.seq_hi, mb.tokens, mb.padded_tokens) for mb in split_prefill(w))
    assert got == want


# ----------------------------------------------------------------------------------------------
# Decode order
# ----------------------------------------------------------------------------------------------

#: grouped_fused_moe_ep's own kernels, launched one by one (not folded into ``experts``)
KERNELS = frozenset({"experts.scatter", "experts.act_quant", "experts.gather"})
# (mb, layer offset from L, op) in issue order: upstream overlap_tpsp_token_forward
DECODE_WINDOW = [
    (0, 0, "comm_prepare_attn"),
    (0, 0, "attn.prepare"),
    (0, 0, "attn.core"),
    (0, 0, "comm_prepare_mlp"),
    (0, 0, "gate"),
    (1, -1, "combine_b"),  # 1 hook: the previous layer's _1_hook_post
    (1, -1, "output"),
    (1, -1, "comm_postprocess_layer"),
    (0, 0, "shared_experts"),
    (0, 0, "select_experts"),  # low_latency_dispatch: select + LL send
    (0, 0, "dispatch_a"),
    (1, 0, "comm_prepare_attn"),
    (1, 0, "attn.prepare"),
    (1, 0, "attn.core"),
    (1, 0, "comm_prepare_mlp"),
    (1, 0, "gate"),
    (0, 0, "dispatch_b"),  # 0 hook
    (1, 0, "shared_experts"),
    (1, 0, "select_experts"),
    (1, 0, "dispatch_a"),
    (0, 0, "experts.gate_up"),  # masked grouped GEMM: grouped_fused_moe_ep's kernels
    (0, 0, "experts.act_quant"),
    (0, 0, "experts.down.0"),
    (1, 0, "dispatch_b"),  # 1 hook
    (0, 0, "combine_a"),
    (1, 0, "experts.gate_up"),
    (1, 0, "experts.act_quant"),
    (1, 0, "experts.down.0"),
    (0, 0, "combine_b"),  # 0 hook + finish
    (0, 0, "output"),
    (0, 0, "comm_postprocess_layer"),
    (1, 0, "combine_a"),  # its recv is deferred into the next layer
]


def test_decode_layer_order_is_upstreams():
    p = build("lightllm", decode_w(), H800)
    L = moe_mid_layer(V3)
    got = collapse([(op.mb, op.layer - L, op.name) for _, op in layer_window(p, L)], KERNELS)
    assert got == DECODE_WINDOW


def test_decode_first_moe_layer_has_no_pending_hook():
    p = build("lightllm", decode_w(), H800)
    seq = collapse([(op.mb, op.layer, op.name) for _, op in ops_of(p)])
    first = V3.first_k_dense
    # dense layers set no hook: the first MoE window runs 0.attn, 0.gate, then 0.shared directly
    i = seq.index((0, first, "gate"))
    assert seq[i + 1] == (0, first, "shared_experts")
    # dense layers: micro-batch 0's whole layer, then micro-batch 1's
    assert seq[2 : 2 + 2 * len(DENSE_OP_NAMES)] == [(0, 0, n) for n in DENSE_OP_NAMES] + [
        (1, 0, n) for n in DENSE_OP_NAMES
    ]


def test_decode_post_layer_flushes_the_deferred_combine_before_mb1_logits():
    p = build("lightllm", decode_w(), H800)
    seq = collapse([(op.mb, op.layer, op.name) for _, op in ops_of(p)])
    last = V3.num_layers - 1
    i0 = seq.index((0, None, "logits"))
    assert seq[i0 + 1 : i0 + 5] == [
        (1, last, "combine_b"),
        (1, last, "output"),
        (1, last, "comm_postprocess_layer"),
        (1, None, "logits"),
    ]
    assert seq.index((1, last, "combine_a")) < i0


def test_decode_is_one_stream_in_one_cuda_graph_with_ll_hooks():
    p = build("lightllm", decode_w(), H800)
    rp = p.rank(0)
    assert rp.streams == ("main",)
    graphs = [ins for ins in main_thread(p).instrs if isinstance(ins, Graph)]
    assert len(graphs) == 1
    for ins in graphs[0].body:
        assert isinstance(ins, Launch) and ins.stream == "main"
    for _, op in ops_of(p):
        if op.name in ("dispatch_a", "combine_a"):
            assert op.coll.role == "send"  # LL send: the data flies with no kernel waiting
        if op.name in ("dispatch_b", "combine_b"):
            assert op.coll.role == "recv"  # the hook's receive kernel
        if op.kind == "compute":
            assert op.sms is None  # no SM partition
    assert p.meta.deepep_mode == "low_latency"


def test_decode_hooks_run_later_with_compute_in_between():
    """Between a send and its hook the stream runs other work (the hook is called later)."""
    p = build("lightllm", decode_w(), H800)
    seq = [op for _, op in ops_of(p)]
    for i, op in enumerate(seq):
        if op.name in ("dispatch_a", "combine_a") and op.layer is not None:
            j = next(
                k
                for k in range(i + 1, len(seq))
                if seq[k].name == op.name[:-1] + "b" and seq[k].mb == op.mb
            )
            between = seq[i + 1 : j]
            assert any(o.kind == "compute" for o in between), (op.name, op.mb, op.layer)


def test_one_communication_group_per_micro_batch():
    p = build("lightllm", decode_w(), H800)
    keys = {0: set(), 1: set()}
    for _, op in ops_of(p):
        if op.coll is not None:
            keys[op.mb].add(op.coll.key)
    assert keys[0] and keys[1] and not keys[0] & keys[1]
    assert all(".mb0." in k for k in keys[0]) and all(".mb1." in k for k in keys[1])
    assert [g["group"] for g in p.meta.extra["comm_groups"]] == [0, 1]
    pp = build("lightllm", prefill_w(), H800)
    assert [g["stream"] for g in pp.meta.extra["comm_groups"]] == ["comm0", "comm1"]


# ----------------------------------------------------------------------------------------------
# Prefill order: normal kernels, Buffer.capture events, a comm stream per micro-batch
# ----------------------------------------------------------------------------------------------

PREFILL_WINDOW = [
    ("launch main", 0, 0, "comm_prepare_attn"),
    ("launch main", 0, 0, "attn.prepare"),
    ("launch main", 0, 0, "attn.core"),
    ("launch main", 0, 0, "comm_prepare_mlp"),
    ("launch main", 0, 0, "gate"),
    ("wait main", "L{p}.mb1.combine_done"),  # wait last 1 combine ...
    ("launch main", 1, -1, "output"),  # ... and its finish
    ("launch main", 1, -1, "comm_postprocess_layer"),
    ("launch main", 0, 0, "select_experts"),  # select + quant
    ("record main", "L{L}.mb0.dispatch_ready"),  # _0_overlap_event = Buffer.capture()
    ("launch main", 1, 0, "comm_prepare_attn"),
    ("launch main", 1, 0, "attn.prepare"),
    ("launch main", 1, 0, "attn.core"),
    ("launch main", 1, 0, "comm_prepare_mlp"),
    ("launch main", 1, 0, "gate"),
    ("wait comm0", "L{L}.mb0.dispatch_ready"),  # previous_event
    ("launch comm0", 0, 0, "dispatch_a"),  # get_dispatch_layout, notify_dispatch
    ("record comm0", "s0.L{L}.mb0.dispatch.counts"),  # DeepEP normal dispatch: the CPU waits
    ("sync", "s0.L{L}.mb0.dispatch.counts"),  # for the counts notify_dispatch writes
    ("launch comm0", 0, 0, "dispatch_a"),
    ("launch comm0", 0, 0, "dispatch_b"),
    ("record comm0", "L{L}.mb0.dispatch_done"),
    ("wait main", "L{L}.mb0.dispatch_done"),  # wait 0 dispatch
    ("launch main", 1, 0, "select_experts"),
    ("record main", "L{L}.mb1.dispatch_ready"),  # _1_overlap_event
    ("launch main", 0, 0, "shared_experts"),
    ("launch main", 1, 0, "shared_experts"),
    ("launch main", 0, 0, "experts.scatter"),  # prefilled_group_gemm's kernels
    ("launch main", 0, 0, "experts.gate_up"),
    ("launch main", 0, 0, "experts.act_quant"),
    ("launch main", 0, 0, "experts.down.0"),
    ("launch main", 0, 0, "experts.gather"),
    ("wait comm1", "L{L}.mb1.dispatch_ready"),
    ("launch comm1", 1, 0, "dispatch_a"),
    ("record comm1", "s0.L{L}.mb1.dispatch.counts"),
    ("sync", "s0.L{L}.mb1.dispatch.counts"),
    ("launch comm1", 1, 0, "dispatch_a"),
    ("launch comm1", 1, 0, "dispatch_b"),
    ("record comm1", "L{L}.mb1.dispatch_done"),
    ("wait main", "L{L}.mb1.dispatch_done"),  # wait 1 dispatch
    ("record main", "L{L}.mb0.combine_ready"),  # _0_combine_event
    ("wait comm0", "L{L}.mb0.combine_ready"),
    ("launch comm0", 0, 0, "combine_a"),
    ("launch comm0", 0, 0, "combine_b"),
    ("record comm0", "L{L}.mb0.combine_done"),
    ("launch main", 1, 0, "experts.scatter"),
    ("launch main", 1, 0, "experts.gate_up"),
    ("launch main", 1, 0, "experts.act_quant"),
    ("launch main", 1, 0, "experts.down.0"),
    ("launch main", 1, 0, "experts.gather"),
    ("wait main", "L{L}.mb0.combine_done"),  # wait 0 combine
    ("record main", "L{L}.mb1.combine_ready"),  # _1_combine_event, before 0's finish
    ("launch main", 0, 0, "output"),
    ("launch main", 0, 0, "comm_postprocess_layer"),
    ("wait comm1", "L{L}.mb1.combine_ready"),
    ("launch comm1", 1, 0, "combine_a"),
    ("launch comm1", 1, 0, "combine_b"),
    ("record comm1", "L{L}.mb1.combine_done"),  # _1_hook_post: deferred
]


def _instr_key(ins, L):
    if isinstance(ins, Launch):
        return (f"launch {ins.stream}", ins.op.mb, ins.op.layer - L, ins.op.name)
    if isinstance(ins, Record):
        return (f"record {ins.stream}", ins.event)
    if isinstance(ins, Wait):
        return (f"wait {ins.stream}", ins.event)
    if isinstance(ins, Sync):
        return ("sync", ins.event)
    raise AssertionError(ins)


def test_prefill_layer_order_events_and_streams_are_upstreams():
    p = build("lightllm", prefill_w(), H800)
    L = moe_mid_layer(V3)
    got = collapse([_instr_key(ins, L) for ins in layer_window(p, L, instrs=True)], KERNELS)
    want = [
        tuple(x.format(L=L, p=L - 1) if isinstance(x, str) else x for x in row)
        for row in PREFILL_WINDOW
    ]
    assert got == want


def test_prefill_comm_kernels_hold_deepep_sms_compute_unpartitioned():
    p = build("lightllm", prefill_w(), H800)
    assert p.rank(0).streams == ("main", "comm0", "comm1")
    assert not any(isinstance(i, Graph) for i in main_thread(p).instrs)  # no graph in prefill
    for ins in iter_gpu_instrs(main_thread(p).instrs):
        if isinstance(ins, Launch):
            op = ins.op
            if op.name == "get_dispatch_layout":  # DeepEP's, on its Buffer's comm stream
                assert op.sms is None and ins.stream == f"comm{op.mb}"
            elif op.kind == "compute":
                assert op.sms is None and ins.stream == "main"
            elif op.name == "notify_dispatch":  # DeepEP's grid (1 + nodes) in the Buffer's SMs
                assert (op.ctas, op.sms) == (5, H800.deepep_normal_sms)
                assert ins.stream == f"comm{op.mb}"
            elif op.name in ("dispatch_a", "combine_a", "cached_notify"):
                assert op.sms == H800.deepep_normal_sms and op.coll.role == "sendrecv"
                assert ins.stream == f"comm{op.mb}"
            elif op.name in ("dispatch_b", "combine_b"):
                assert op.sms == 0 and ins.stream == f"comm{op.mb}"
    assert p.meta.deepep_mode == "normal"
    assert not p.meta.reported("comm_sms")  # LightLLM does not partition SMs


def test_prefill_post_layer_waits_mb1_combine_before_its_logits():
    p = build("lightllm", prefill_w(), H800)
    last = V3.num_layers - 1
    seq = []
    for ins in iter_gpu_instrs(main_thread(p).instrs):
        if isinstance(ins, Launch):
            seq.append((ins.op.mb, ins.op.layer, ins.op.name))
        elif isinstance(ins, Wait):
            seq.append(("wait", ins.stream, ins.event))
    i0 = seq.index((0, None, "logits"))
    assert seq[i0 + 1 : i0 + 6] == [
        ("wait", "main", f"L{last}.mb1.combine_done"),
        (1, last, "output"),
        (1, last, "comm_postprocess_layer"),
        (1, None, "final_norm"),  # post_infer: its final norm and logits
        (1, None, "logits"),
    ]


# ----------------------------------------------------------------------------------------------
# Counts, refusals, golden text, simulation
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "w", [decode_w(5, ep=8, model=LITE), prefill_w(3, ep=8, model=LITE, extend_len=64)]
)
def test_every_op_of_every_layer_once_per_micro_batch(w):
    p = build("lightllm", w, H800)
    counts: dict = {}
    for _, op in ops_of(p):
        counts[(op.mb, op.layer, op.name)] = counts.get((op.mb, op.layer, op.name), 0) + 1
    assert set(counts.values()) == {1}
    for mb in (0, 1):
        for L in range(w.model.num_layers):
            names = MOE_OP_NAMES if w.model.is_moe_layer(L) else DENSE_OP_NAMES
            got = {KEY_OF.get(n, n) for (m, layer, n) in counts if m == mb and layer == L}
            kernels = {n for n in got if n.startswith("experts.")}  # grouped_fused_moe_ep's
            assert (got - kernels) | ({"experts"} if kernels else set()) == set(names)
        assert {n for (m, layer, n) in counts if m == mb and layer is None} >= {
            "embed",
            "logits",
            "sample",
        }


def test_explicit_deepep_mode_other_than_the_systems_is_refused():
    with pytest.raises(ConfigError, match="low_latency kernels in decode"):
        build("lightllm", decode_w(), H800, ScheduleConfig(deepep_mode="normal"))
    with pytest.raises(ConfigError, match="normal kernels in prefill"):
        build("lightllm", prefill_w(), H800, ScheduleConfig(deepep_mode="low_latency"))
    build("lightllm", decode_w(), H800, ScheduleConfig(deepep_mode="low_latency"))


def test_meta_reports_micro_batches_and_padding():
    p = build("lightllm", decode_w(5), H800)
    assert [m["padded_tokens"] for m in p.meta.micro_batches] == [3, 3]
    assert [m["tokens"] for m in p.meta.micro_batches] == [3, 2]
    assert p.meta.schedule == "lightllm" and p.meta.cuda_graph is True


@pytest.mark.parametrize("case", ["decode", "prefill"])
def test_golden_one_layer(case):
    w = decode_w() if case == "decode" else prefill_w()
    p = build("lightllm", w, H800)
    check_golden(f"lightllm_{case}", p, moe_mid_layer(V3))


@pytest.mark.parametrize(
    "w",
    [
        decode_w(6, ep=8, model=LITE),
        decode_w(1, ep=8, model=LITE),
        prefill_w(3, ep=8, model=LITE, extend_len=256),
        prefill_w(1, ep=8, model=LITE, extend_len=256),
        decode_w(128, ep=128),
        prefill_w(4, ep=32),
    ],
    ids=[
        "lite-decode",
        "lite-decode-1",
        "lite-prefill",
        "lite-prefill-1",
        "v3-decode",
        "v3-prefill",
    ],
)
def test_simulated_trace_invariants(w):
    check_simulated(build("lightllm", w, H800), H800)


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_expert_kernels_conserve_the_experts_work(mode):
    from overlap_lab.shared.ir.ops import layer_ops
    from overlap_lab.shared.schedules.lightllm import expert_kernels, split_decode, split_prefill
    from overlap_lab.sim import cost

    w = decode_w() if mode == "decode" else prefill_w(2)
    mb = (split_decode(w) if mode == "decode" else split_prefill(w))[0]
    L = moe_mid_layer(V3)
    ops = layer_ops(w, H800, L, mb)
    ks = expert_kernels(w, ops)
    gemms = [k for k in ks if k.op_class == "grouped_gemm"]
    experts = ops["experts"]
    assert sum(k.flops for k in gemms) == pytest.approx(experts.flops)
    assert sum(k.hbm_bytes for k in gemms) == pytest.approx(experts.hbm_bytes)
    assert all(k.hbm_bytes >= 0 for k in ks)
    names = [k.name for k in ks]
    if mode == "prefill":  # the layer's own scatter and gather, around the fused activation
        assert names[0] == "experts.scatter" and names[-1] == "experts.gather"
        assert ks[0] == ops["experts.scatter"] and ks[-1] == ops["experts.gather"]
        act = ks[names.index("experts.act_quant")]  # silu_and_mul + quant in one pass
        assert act.hbm_bytes < ops["experts.act"].hbm_bytes + ops["experts.quant"].hbm_bytes
    else:
        assert ks[1] == ops["experts.act_quant"]
    # DeepGEMM's grouped GEMMs hold their SMs; the Triton kernels between them release them
    kinds = {k.name: cost.grid_kind(k) for k in ks}
    assert kinds["experts.gate_up"] == kinds["experts.down.0"] == "persistent"
    assert kinds["experts.act_quant"] == "waved"
