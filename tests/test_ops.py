"""Op work pinned on tiny hand-checkable configs; dispatch/combine bytes follow their formulas."""

from __future__ import annotations

import math

import pytest

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import GPUS, get_gpu
from overlap_lab.shared.inputs.workload import (
    MODELS,
    Batch,
    MicroBatch,
    ModelConfig,
    Parallel,
    Workload,
    whole_batch,
)
from overlap_lab.shared.ir.ops import (
    DENSE_OP_NAMES,
    HEAD_OP_NAMES,
    MOE_OP_NAMES,
    attn_work,
    combine_bytes_per_copy,
    dispatch_bytes_per_copy,
    expand_keys,
    expected_dest_ranks,
    head_ops,
    layer_ops,
    ll_num_sms,
    moe_tokens,
    traffic,
)
from overlap_lab.shared.ir.program import HostThread, Launch, Program, RankProgram, parse, to_text

H800 = GPUS["h800"]

# hidden 64, 4 q heads / 2 kv heads of 8, 8 experts top-2 of width 16, one shared, dense 32.
TINY_GQA = ModelConfig(
    "tiny-gqa",
    num_layers=2,
    first_k_dense=1,
    hidden=64,
    vocab=100,
    attention="gqa",
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    num_experts=8,
    top_k=2,
    expert_inter=16,
    num_shared_experts=1,
    dense_inter=32,
)
# MLA without q_lora: 2 heads, latent 16, nope 8, rope 4, v 8.
TINY_MLA = ModelConfig(
    "tiny-mla",
    num_layers=2,
    first_k_dense=0,
    hidden=64,
    vocab=100,
    attention="mla",
    num_heads=2,
    num_kv_heads=2,
    kv_lora_rank=16,
    qk_nope_dim=8,
    qk_rope_dim=4,
    v_head_dim=8,
    num_experts=8,
    top_k=2,
    expert_inter=16,
)
DECODE2 = Batch.decode(2, kv_len=10)  # 2 tokens, each attending over 11 keys: 22 pairs


def _ops(model, batch, layer=1, parallel=None, mode="low_latency", mb=None, step=0):
    w = Workload(model, batch, parallel or Parallel())
    return layer_ops(w, H800, layer, mb or whole_batch(w), deepep_mode=mode, step=step)


# ---------------------------------------------------------------------------------------------
# FLOPs on the tiny configs (numbers worked out by hand)
# ---------------------------------------------------------------------------------------------


def test_gqa_flops_by_hand():
    ops = _ops(TINY_GQA, DECODE2)
    # qkv: 2*T*hidden*(4+2*2)*8 = 16384; RoPE is a kernel of its own: 6*T*(4+2)*8 = 576
    assert ops["attn.prepare"].flops == 16384
    assert ops["attn.rope"].flops == 576 and ops["attn.rope"].op_class == "elementwise"
    assert "attn.norm" not in ops  # no q/k norm in this model
    # attention: 4*heads*d*pairs = 4*4*8*22 = 2816; o_proj: 2*T*32*64 = 8192
    assert ops["attn.core"].flops == 2816
    assert ops["attn.o_proj"].flops == 8192 and ops["attn.o_proj"].op_class == "gemm"
    assert ops["gate"].flops == 2 * 2 * 64 * 8
    # every token's 2 copies through gate_up + down: T*k*6*hidden*inter
    assert ops["experts"].flops == 2 * 2 * 6 * 64 * 16
    # gate_up 2*T*64*32 + down 2*T*16*64; silu-mul 4*T*16 is a kernel of its own
    assert ops["shared_experts"].flops == 8192 + 4096
    assert ops["shared_experts.act"].flops == 128
    # low-latency mode: the experts' activation alone (BF16 GEMMs: no quantisation), 4*T*k*16
    assert ops["experts.act"].flops == 4 * 2 * 2 * 16 and "experts.scatter" not in ops
    dense = _ops(TINY_GQA, DECODE2, layer=0)
    assert dense["mlp"].flops == 2 * 2 * 64 * 64 + 2 * 2 * 32 * 64
    assert dense["mlp.act"].flops == 4 * 2 * 32


def test_mla_decode_flops_by_hand():
    ops = _ops(TINY_MLA, DECODE2)
    # absorbed: 2*H*pairs*((16+4) + 16) = 3168; W_UV 2*T*H*16*8 = 1024; o_proj 2*T*16*64 = 4096
    assert ops["attn.core"].flops == 3168
    assert ops["attn.absorb_v"].flops == 1024 and ops["attn.o_proj"].flops == 4096
    # q_proj 2*T*64*2*12 = 6144, kv_a 2*T*64*20 = 5120; kernels of their own: kv norm
    # 5*T*16 = 160, rope 6*T*(2+1)*4 = 144; W_UK 2*T*H*8*16 = 1024
    assert ops["attn.prepare"].flops == 6144 + 5120
    assert (ops["attn.norm"].flops, ops["attn.rope"].flops) == (160, 144)
    assert ops["attn.kv_write"].hbm_bytes == 2 * 20 * (2 + 2)  # latent+rope, bf16 in and out
    assert ops["attn.absorb_k"].flops == 1024


def test_mla_prefill_flops_by_hand():
    ops = _ops(TINY_MLA, Batch.prefill(extend_lens=[3], prefix_lens=[2]), mode="normal")
    # pairs = 3*2 + 3*4/2 = 12: attention 2*H*12*(12+8) = 960; prefix up-proj 2*2*16*2*16 = 2048;
    # o_proj 2*3*16*64 = 6144
    assert ops["attn.core"].flops == 960 + 2048
    assert ops["attn.o_proj"].flops == 6144
    assert "attn.absorb_k" not in ops and "attn.absorb_v" not in ops  # MHA path


def test_kv_cache_bytes_dominate_long_decode():
    short = _ops(MODELS["deepseek-v3"], Batch.decode(8, kv_len=16))["attn.core"]
    long = _ops(MODELS["deepseek-v3"], Batch.decode(8, kv_len=16 + 1000))["attn.core"]
    # latent (512 + 64) bf16 per cached token, read once per sequence for all heads
    assert long.hbm_bytes - short.hbm_bytes == pytest.approx(8 * 1000 * 576 * 2)


def test_attn_work_split_sequence():
    b = Batch.prefill(extend_lens=[4, 6], prefix_lens=[0, 10])
    aw = attn_work(b, 2, 7)  # seq0 tokens 2..3 (ends it), seq1 tokens 0..2
    assert (aw.q_tokens, aw.pieces, aw.seq_ends) == (5, 2, 1)
    assert aw.pairs == (2 * 2 + 3) + (3 * 10 + 6)
    assert (aw.ctx_tokens, aw.cached_tokens) == (4 + 13, 2 + 10)
    whole = attn_work(b, 0, 10)
    assert whole.pairs == 10 + (6 * 10 + 21)


def test_verify_tokens_attend_causally():
    aw = attn_work(Batch.decode(1, kv_len=10, tokens_per_seq=3), 0, 3)
    assert aw.pairs == 11 + 12 + 13


def test_padding_scales_gemms_not_attention():
    w = Workload(TINY_GQA, DECODE2)
    plain = layer_ops(w, H800, 1, whole_batch(w))
    padded = layer_ops(w, H800, 1, MicroBatch(0, 0, 2, 0, 2, 4))
    assert padded["gate"].flops == 2 * plain["gate"].flops
    assert padded["experts"].flops == 2 * plain["experts"].flops
    o_proj = 2 * 32 * 64
    assert padded["attn.core"].flops == plain["attn.core"].flops
    assert padded["attn.o_proj"].flops - plain["attn.o_proj"].flops == 2 * o_proj
    assert padded["gate"].tokens == 4


def test_attn_tp_scatters_moe_tokens():
    w = Workload(MODELS["deepseek-v3"], Batch.decode(5), Parallel(ep=8, attn_tp=2))
    assert moe_tokens(w, whole_batch(w)) == 3
    ops = layer_ops(w, H800, 3, whole_batch(w))
    assert ops["gate"].flops == 2 * 3 * 7168 * 256


# ---------------------------------------------------------------------------------------------
# dispatch / combine
# ---------------------------------------------------------------------------------------------


def test_bytes_per_copy():
    assert dispatch_bytes_per_copy(7168) == 7168 + 7168 // 128 * 4
    assert combine_bytes_per_copy(7168) == 2 * 7168


def test_expected_dest_ranks():
    assert expected_dest_ranks(1, 8) == 1
    assert expected_dest_ranks(64, 1) == pytest.approx(1)
    assert expected_dest_ranks(8, 8) == pytest.approx(8 * (1 - (7 / 8) ** 8))


def test_ll_num_sms_matches_deepep():
    assert ll_num_sms(256, 132) == 128
    assert ll_num_sms(64, 132) == 64
    assert ll_num_sms(288, 80) == 72
    assert ll_num_sms(256, 148) == 128


@pytest.mark.parametrize("ep, gpn", [(16, 8), (32, 4), (8, 8), (4, 8), (1, 8)])
def test_traffic_splits_by_node(ep, gpn):
    w = Workload(MODELS["deepseek-v3"], Batch.decode(64), Parallel(ep=ep, gpus_per_node=gpn))
    g = min(ep, gpn)
    ll = traffic(w, 64, 1.0, dedup=False)
    assert ll["nvlink"] == pytest.approx(64 * 8 / ep * (g - 1))
    assert ll["rdma"] == pytest.approx(64 * 8 / ep * (ep - g))
    assert sum(ll.values()) == pytest.approx(64 * 8)  # one copy per (token, expert)
    hn = traffic(w, 64, 1.0, dedup=True)
    p = 1 - (1 - 1 / ep) ** 8
    nodes = ep // g
    if nodes == 1:  # intranode normal kernels: one NVLink copy per (token, rank)
        assert hn["nvlink"] == pytest.approx(64 * p * (g - 1))
        assert hn["rdma"] == 0
        assert sum(hn.values()) == pytest.approx(64 * expected_dest_ranks(ep, 8))
    else:  # internode: one RDMA copy per (token, node), NVLink forwarding of every rail's tokens
        p_node = 1 - (1 - 1 / nodes) ** 8
        assert hn["rdma"] == pytest.approx(64 * p_node * (nodes - 1))
        assert hn["nvlink"] == pytest.approx(64 * p * (g - 1) * nodes)


def _flow_bytes(op):
    return {f.link: f.nbytes for f in op.coll.flows}


def test_low_latency_dispatch_and_combine_ops():
    w = Workload(MODELS["deepseek-v3"], Batch.decode(32), Parallel(ep=16, gpus_per_node=8))
    ops = layer_ops(w, H800, 7, whole_batch(w), deepep_mode="low_latency", step=3)
    da, db, ca, cb = (ops[n] for n in ("dispatch_a", "dispatch_b", "combine_a", "combine_b"))
    per_rank = 32 * 8 / 16  # token copies to each rank
    assert _flow_bytes(da) == pytest.approx(
        {"nvlink": per_rank * 7 * 7392, "rdma": per_rank * 8 * 7392}
    )
    assert _flow_bytes(ca) == pytest.approx(
        {"nvlink": per_rank * 7 * 14336, "rdma": per_rank * 8 * 14336}
    )
    assert (da.coll.role, db.coll.role, ca.coll.role, cb.coll.role) == (
        "send",
        "recv",
        "send",
        "recv",
    )
    assert da.coll.key == db.coll.key == "s3.L7.mb0.dispatch"
    assert ca.coll.key == cb.coll.key == "s3.L7.mb0.combine"
    assert db.coll.flows == () and cb.coll.flows == ()
    assert {op.sms for op in (da, db, ca, cb)} == {128}
    assert (da.dtype, ca.dtype) == ("fp8", "bf16")
    assert all(op.kind == "comm" and op.op_class == "comm" for op in (da, db, ca, cb))


def test_normal_dispatch_and_combine_ops():
    w = Workload(MODELS["deepseek-v3"], Batch.prefill(2, extend_len=512), Parallel(ep=8))
    ops = layer_ops(w, H800, 3, whole_batch(w), deepep_mode="normal")
    da, db = ops["dispatch_a"], ops["dispatch_b"]
    p = 1 - (7 / 8) ** 8
    assert _flow_bytes(da) == pytest.approx({"nvlink": 1024 * p * 7 * 7392})  # one node: no rdma
    assert (da.coll.role, da.sms) == ("sendrecv", 20)  # DeepEP Buffer.num_sms default
    assert (db.coll.role, db.sms, db.flops, db.hbm_bytes) == ("recv", 0, 0.0, 0.0)
    assert da.coll.key == "sNone.L3.mb0.dispatch"
    custom = layer_ops(w, get_gpu("h800", deepep_normal_sms=20), 3, whole_batch(w))
    assert custom["combine_a"].sms == 20


@pytest.mark.parametrize("ep", [8, 32])
def test_normal_mode_runs_deepep_layout_and_notify_kernels(ep):
    """DeepEP's normal kernels come with their layout kernel (its grid: one CTA per 4 experts
    and per 8 ranks) and a notify kernel before dispatch and combine; each notify is a
    collective of its own that sends a small flow to every peer (NVLink inside the node, RDMA
    to the same-rail GPU of every other node)."""
    w = Workload(MODELS["deepseek-v3"], Batch.prefill(2, extend_len=512), Parallel(ep=ep))
    ops = layer_ops(w, H800, 3, whole_batch(w), deepep_mode="normal", step=0)
    names = list(ops)
    order = ["select_experts", "select_experts.ids", "dispatch.quant", "get_dispatch_layout",
             "notify_dispatch", "dispatch_a", "dispatch_b", "experts.scatter", "experts",
             "experts.act", "experts.quant", "experts.gather", "cached_notify", "combine_a"]  # fmt: skip
    assert [n for n in names if n in order] == order
    layout = ops["get_dispatch_layout"]
    assert (layout.kind, layout.op_class, layout.ctas) == ("compute", "sampling", 64 + ep // 8)
    nd, cn = ops["notify_dispatch"], ops["cached_notify"]
    nodes = ep // 8
    # DeepEP's grids (intranode / internode) within the Buffer's 20 SMs
    assert (nd.ctas, nd.sms) == ((1 + ep if nodes == 1 else 1 + nodes), 20)
    assert (cn.ctas, cn.sms) == ((11, 20) if nodes == 1 else (None, 20))  # 1 + channels / all
    for op, what in ((nd, "dispatch_notify"), (cn, "combine_notify")):
        assert (op.kind, op.op_class, op.coll.role) == ("comm", "comm", "sendrecv")
        assert op.coll.key == f"s0.L3.mb0.{what}"
        links = {f.link for f in op.coll.flows}
        assert links == ({"nvlink"} if nodes == 1 else {"nvlink", "rdma"})
        assert sum(f.nbytes for f in op.coll.flows) < 64 * 1024  # counts and flags, not tokens
    ll = layer_ops(w, H800, 3, whole_batch(w), deepep_mode="low_latency")
    assert not {"get_dispatch_layout", "notify_dispatch", "cached_notify", "dispatch.quant",
                "experts.scatter", "experts.gather", "experts.act", "experts.quant"} & set(ll)  # fmt: skip
    assert "experts.act_quant" in ll  # the masked layout's fused activation + quantisation


def test_auto_mode_follows_sglang():
    assert _ops(TINY_GQA, DECODE2, mode="auto")["dispatch_a"].coll.role == "send"
    prefill = Batch.prefill(1, extend_len=8)
    assert _ops(TINY_GQA, prefill, mode="auto")["dispatch_a"].coll.role == "sendrecv"


def test_experts_receive_what_they_send():
    """Balanced symmetric load: a rank's grouped GEMM rows equal the copies it sends."""
    w = Workload(MODELS["deepseek-v3"], Batch.decode(16), Parallel(ep=32, gpus_per_node=8))
    ops = layer_ops(w, H800, 3, whole_batch(w))
    m = w.model
    assert ops["experts"].flops == 16 * m.top_k * 6 * m.hidden * m.expert_inter


# ---------------------------------------------------------------------------------------------
# op sets, stamping, errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_every_layer_has_its_op_names(name, mode):
    m = MODELS[name]
    w = Workload(m, Batch.decode(4, kv_len=32), Parallel(ep=16, gpus_per_node=8))
    mb = whole_batch(w)
    for layer in range(m.num_layers):
        ops = layer_ops(w, H800, layer, mb, deepep_mode=mode, step=1)
        want = expand_keys(MOE_OP_NAMES if m.is_moe_layer(layer) else DENSE_OP_NAMES)
        assert [k for k in want if k in ops] == list(ops)  # the keys' parts, in order
        assert set(MOE_OP_NAMES if m.is_moe_layer(layer) else DENSE_OP_NAMES) <= set(ops)
        if m.gemm_dtype == "fp8":  # every FP8 GEMM's input is quantised by its own kernel
            assert {"attn.quant", "attn.o_quant"} <= set(ops)
        for key, op in ops.items():
            assert op.name == key
            assert (op.layer, op.mb, op.step, op.tokens) == (layer, 0, 1, 4)
            assert op.flops >= 0 and op.hbm_bytes >= 0
    assert tuple(head_ops(w, H800, mb)) == HEAD_OP_NAMES
    assert len(MOE_OP_NAMES) == 14


def test_no_shared_expert_is_empty_work():
    ops = _ops(MODELS["qwen3-30b-a3b"], DECODE2, layer=0)
    assert ops["shared_experts"].flops == 0 and ops["shared_experts"].hbm_bytes == 0


def test_head_ops():
    w = Workload(TINY_GQA, Batch.prefill(extend_lens=[4, 6]))
    first = head_ops(w, H800, MicroBatch(0, 0, 1, 0, 3, 3, split_seq=True))
    assert first["logits"].flops == 0  # no sequence ends in it
    assert first["final_norm"].flops == 5 * 3 * 64  # but the final norm runs over its tokens
    whole = head_ops(w, H800, whole_batch(w), step=2)
    assert whole["logits"].flops == 2 * 2 * 64 * 100  # lm_head for the last token of each seq
    assert whole["final_norm"].flops == 5 * 10 * 64  # the model's last norm: every token
    assert whole["sample"].op_class == "sampling" and whole["logits"].step == 2
    d2h = whole["d2h"]
    assert (d2h.kind, d2h.op_class, d2h.sms, d2h.hbm_bytes, d2h.flops) == (
        "copy",
        "copy",
        0,
        8.0,
        0,
    )
    dec = head_ops(Workload(TINY_GQA, DECODE2), H800, MicroBatch(0, 0, 2, 0, 2, 2))
    assert dec["logits"].flops == 2 * 2 * 64 * 100


def test_bad_calls():
    w = Workload(TINY_GQA, DECODE2)
    with pytest.raises(ConfigError):
        layer_ops(w, H800, 1, whole_batch(w), deepep_mode="fast")
    with pytest.raises(ConfigError):
        layer_ops(w, H800, 1, MicroBatch(0, 0, 3, 0, 3, 3))  # beyond the batch
    with pytest.raises(ConfigError):
        layer_ops(w, H800, 1, MicroBatch(0, 0, 2, 0, 2, 1))  # padded below tokens
    with pytest.raises(ConfigError):
        layer_ops(w, H800, 2, whole_batch(w))  # no such layer


def test_ops_round_trip_through_program_text():
    w = Workload(MODELS["deepseek-v3"], Batch.decode(8), Parallel(ep=16))
    mb = whole_batch(w)
    ops = [*head_ops(w, H800, mb, step=0).values()]
    for mode in ("low_latency", "normal"):
        ops += layer_ops(w, H800, 3, mb, deepep_mode=mode, step=0).values()
    prog = Program(
        (RankProgram(0, ("main",), (HostThread("t", tuple(Launch(o, "main") for o in ops)),)),)
    )
    back = parse(to_text(prog))
    got = [i.op for i in back.ranks[0].threads[0].instrs]
    assert len(got) == len(ops)
    for a, b in zip(got, ops, strict=True):
        assert a.name == b.name and a.coll == b.coll
        assert math.isclose(a.flops, b.flops) and math.isclose(a.hbm_bytes, b.hbm_bytes)
