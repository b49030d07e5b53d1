"""Presets carry the published shapes; bad input fails with one ConfigError line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import GPUS, HOST_COSTS, HostCosts, get_gpu
from overlap_lab.shared.inputs.workload import (
    MODELS,
    Batch,
    ModelConfig,
    Parallel,
    Workload,
    dense_layers,
    get_model,
    moe_layers,
    pp_stage_layers,
    whole_batch,
)

# ---------------------------------------------------------------------------------------------
# model presets
# ---------------------------------------------------------------------------------------------


def test_deepseek_v3_shapes():
    m = get_model("deepseek-v3")
    assert (m.num_layers, m.first_k_dense, m.hidden, m.vocab) == (61, 3, 7168, 129280)
    assert m.attention == "mla"
    assert (m.q_lora_rank, m.kv_lora_rank, m.num_heads) == (1536, 512, 128)
    assert (m.qk_nope_dim, m.qk_rope_dim, m.v_head_dim) == (128, 64, 128)
    assert (m.num_experts, m.top_k, m.expert_inter, m.num_shared_experts) == (256, 8, 2048, 1)
    assert (m.dense_inter, m.n_group, m.topk_group) == (18432, 8, 4)
    assert (m.gemm_dtype, m.attn_dtype) == ("fp8", "bf16")
    assert m.group_limited


def test_deepseek_v2_lite_shapes():
    m = get_model("deepseek-v2-lite")
    assert (m.num_layers, m.first_k_dense, m.hidden, m.vocab) == (27, 1, 2048, 102400)
    assert (m.attention, m.q_lora_rank, m.kv_lora_rank, m.num_heads) == ("mla", 0, 512, 16)
    assert (m.num_experts, m.top_k, m.expert_inter, m.num_shared_experts) == (64, 6, 1408, 2)
    assert m.dense_inter == 10944 and m.shared_inter == 2816
    assert (m.gemm_dtype, m.attn_dtype) == ("bf16", "bf16")
    assert not m.group_limited


@pytest.mark.parametrize(
    "name, layers, hidden, heads, experts_inter",
    [("qwen3-30b-a3b", 48, 2048, 32, 768), ("qwen3-235b-a22b", 94, 4096, 64, 1536)],
)
def test_qwen3_shapes(name, layers, hidden, heads, experts_inter):
    m = get_model(name)
    assert (m.num_layers, m.first_k_dense, m.hidden, m.vocab) == (layers, 0, hidden, 151936)
    assert (m.attention, m.num_heads, m.num_kv_heads, m.head_dim) == ("gqa", heads, 4, 128)
    assert (m.num_experts, m.top_k, m.expert_inter, m.num_shared_experts) == (
        128,
        8,
        experts_inter,
        0,
    )
    assert m.gemm_dtype == "bf16"


def test_moe_and_dense_layers():
    m = get_model("deepseek-v3")
    assert list(dense_layers(m)) == [0, 1, 2]
    assert moe_layers(m) == range(3, 61)
    assert not m.is_moe_layer(2) and m.is_moe_layer(3) and m.is_moe_layer(60)
    with pytest.raises(ConfigError):
        m.is_moe_layer(61)
    assert list(dense_layers(get_model("qwen3-30b-a3b"))) == []


def test_get_model_overrides_and_errors():
    assert get_model("DeepSeek-V3", num_layers=4).num_layers == 4
    with pytest.raises(ConfigError):
        get_model("llama")
    with pytest.raises(ConfigError):
        get_model("deepseek-v3", bogus=1)
    with pytest.raises(ConfigError):
        get_model("deepseek-v3", hidden=0)


def test_all_presets_valid():
    for name, m in MODELS.items():
        assert m.name == name
        Workload(m, Batch.decode(4, kv_len=16), Parallel(ep=8))


# ---------------------------------------------------------------------------------------------
# batch
# ---------------------------------------------------------------------------------------------


def test_batch_decode_and_prefill():
    d = Batch.decode(3, kv_len=100, tokens_per_seq=2)
    assert (d.num_seqs, d.num_tokens, d.seq_tokens(1), d.seq_cached(1)) == (3, 6, 2, 100)
    p = Batch.prefill(extend_lens=[5, 7], prefix_lens=[0, 10])
    assert (p.num_seqs, p.num_tokens, p.seq_tokens(1), p.seq_cached(1)) == (2, 12, 7, 10)
    assert p.token_offsets() == (0, 5, 12)
    assert Batch.prefill(2, extend_len=8, prefix_len=3).prefix_lens == (3, 3)
    assert Batch.decode(kv_lens=[1, 2]).kv_lens == (1, 2)


def test_whole_batch():
    w = Workload(get_model("qwen3-30b-a3b"), Batch.prefill(extend_lens=[5, 7]))
    mb = whole_batch(w)
    assert (mb.index, mb.seq_lo, mb.seq_hi, mb.tok_lo, mb.tok_hi, mb.padded_tokens) == (
        0,
        0,
        2,
        0,
        12,
        12,
    )


BAD_BATCHES = {
    "mode": lambda: Batch("extend", extend_lens=(1,), prefix_lens=(0,)),
    "zero seqs": lambda: Batch.decode(0),
    "negative seqs": lambda: Batch.prefill(-1),
    "zero kv_len": lambda: Batch.decode(2, kv_len=0),
    "zero tokens_per_seq": lambda: Batch.decode(2, tokens_per_seq=0),
    "zero extend": lambda: Batch.prefill(2, extend_len=0),
    "negative prefix": lambda: Batch.prefill(2, prefix_len=-1),
    "mismatched lens": lambda: Batch.prefill(extend_lens=[1, 2], prefix_lens=[0]),
    "num_seqs vs lens": lambda: Batch.decode(3, kv_lens=[1, 2]),
    "decode with extend": lambda: Batch("decode", kv_lens=(1,), extend_lens=(1,)),
    "prefill with kv": lambda: Batch("prefill", extend_lens=(1,), prefix_lens=(0,), kv_lens=(1,)),
    "empty decode": lambda: Batch("decode"),
    "float len": lambda: Batch.decode(kv_lens=[1.5]),
}


@pytest.mark.parametrize("case", sorted(BAD_BATCHES))
def test_bad_batches(case):
    with pytest.raises(ConfigError) as e:
        BAD_BATCHES[case]()
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# parallel + workload
# ---------------------------------------------------------------------------------------------

V3 = MODELS["deepseek-v3"]
DEC = Batch.decode(4, kv_len=64)

BAD_LAYOUTS = {
    "ep zero": lambda: Parallel(ep=0),
    "gpus_per_node zero": lambda: Parallel(gpus_per_node=0),
    "attn_tp negative": lambda: Parallel(attn_tp=-1),
    "pp zero": lambda: Parallel(pp=0),
    "ep not a node multiple": lambda: Parallel(ep=12, gpus_per_node=8),
    "attn_tp not dividing ep": lambda: Parallel(ep=8, attn_tp=3),
    "ep not dividing experts": lambda: Workload(V3, DEC, Parallel(ep=3, gpus_per_node=3)),
    "attn_tp not dividing heads": lambda: Workload(
        get_model("deepseek-v2-lite"), DEC, Parallel(ep=64, gpus_per_node=8, attn_tp=32)
    ),
    "gqa kv heads": lambda: Workload(
        get_model("qwen3-30b-a3b", num_heads=24, num_kv_heads=3), DEC, Parallel(ep=2, attn_tp=2)
    ),
    "pp > layers": lambda: Workload(get_model("deepseek-v3", num_layers=4), DEC, Parallel(pp=5)),
}


@pytest.mark.parametrize("case", sorted(BAD_LAYOUTS))
def test_bad_layouts(case):
    with pytest.raises(ConfigError) as e:
        BAD_LAYOUTS[case]()
    assert "\n" not in str(e.value)


BAD_MODELS = {
    "zero hidden": dict(hidden=0),
    "first_k_dense > layers": dict(first_k_dense=62),
    "top_k > experts": dict(top_k=300),
    "n_group not dividing": dict(n_group=7),
    "topk_group > n_group": dict(topk_group=9),
    "dtype": dict(gemm_dtype="int4"),
    "attention kind": dict(attention="mha"),
    "mla without latent": dict(kv_lora_rank=0),
    "negative shared": dict(num_shared_experts=-1),
}


@pytest.mark.parametrize("case", sorted(BAD_MODELS))
def test_bad_models(case):
    with pytest.raises(ConfigError):
        get_model("deepseek-v3", **BAD_MODELS[case])


def test_gqa_heads_must_nest():
    with pytest.raises(ConfigError):
        ModelConfig("x", 2, 0, 64, 10, "gqa", num_heads=6, num_kv_heads=4, head_dim=8)


def test_workload_derived_sizes():
    w = Workload(V3, DEC, Parallel(ep=32, gpus_per_node=8, attn_tp=2))
    assert (w.local_experts, w.heads_per_rank) == (8, 64)
    assert w.parallel.node_peers == 8 and w.parallel.world == 32
    q = Workload(get_model("qwen3-235b-a22b"), DEC, Parallel(ep=8, attn_tp=8))
    assert q.kv_heads_per_rank == 1  # 4 kv heads replicated over 8 attention-TP ranks


def test_pp_stage_layers():
    stages = pp_stage_layers(get_model("deepseek-v3"), 4)
    assert [len(s) for s in stages] == [16, 15, 15, 15]
    assert stages[0].start == 0 and stages[-1].stop == 61
    with pytest.raises(ConfigError):
        pp_stage_layers(get_model("deepseek-v3"), 62)


# ---------------------------------------------------------------------------------------------
# hardware
# ---------------------------------------------------------------------------------------------


def test_gpu_presets():
    assert set(GPUS) == {"h100", "h200", "h800", "b200"}
    h800, h100 = GPUS["h800"], GPUS["h100"]
    assert h800.num_sms == 132 and h800.nvlink_gbps == 200.0 and h800.rdma_gbps == 50.0
    assert (h800.bf16_tflops, h800.fp8_tflops) == (h100.bf16_tflops, h100.fp8_tflops)
    assert h800.nvlink_eff_gbps == 134.0  # 153 x 7/8: DeepEP counts its own 1/8
    assert h100.nvlink_gbps == 450.0 and GPUS["h200"].hbm_gbps == 4800.0
    assert [g.sbo_comm_sms for g in GPUS.values()] == [3, 3, 3, 32]
    assert all(g.deepep_normal_sms == 20 for g in GPUS.values())
    assert GPUS["b200"].arch == "blackwell" and GPUS["b200"].num_sms == 148


def test_gpu_units():
    g = GPUS["h100"]
    assert g.hbm_bytes_per_us == 3.35e6
    assert g.peak_flops_per_us("fp8") == pytest.approx(1978.9e6)
    assert g.link_bytes_per_us("nvlink") == 450e3
    assert GPUS["h800"].link_bytes_per_us("nvlink", effective=True) == 134e3
    assert g.link_bytes_per_us("pcie", effective=True) == 64e3
    assert g.link_latency_us("rdma") == g.rdma_lat_us
    with pytest.raises(ConfigError):
        g.link_bytes_per_us("ethernet")
    with pytest.raises(ConfigError):
        g.peak_flops_per_us("int8")


def test_get_gpu():
    assert get_gpu("H800").name == "h800"
    g = get_gpu("h100", sbo_comm_sms=8, nvlink_gbps=100.0)
    assert (g.sbo_comm_sms, g.nvlink_gbps) == (8, 100.0)
    assert GPUS["h100"].sbo_comm_sms == 3  # the preset is untouched


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("a100", {}),
        ("h100", {"warp_speed": 1}),
        ("h100", {"num_sms": 0}),
        ("h100", {"hbm_gbps": -1.0}),
        ("h100", {"launch_us": -1.0}),
        ("h100", {"sbo_comm_sms": 132}),
        ("h100", {"deepep_normal_sms": 0}),
        ("h100", {"arch": "ampere"}),
        ("h100", {"num_sms": 132.5}),
    ],
)
def test_get_gpu_errors(name, overrides):
    with pytest.raises(ConfigError):
        get_gpu(name, **overrides)


def test_host_costs():
    assert HOST_COSTS.schedule_us(10) == HOST_COSTS.schedule_base_us + 10 * (
        HOST_COSTS.schedule_per_req_us
    )
    assert HOST_COSTS.process_result_us(0) == HOST_COSTS.process_result_base_us
    with pytest.raises(ConfigError):
        HostCosts(recv_requests_us=-1.0)


# ---------------------------------------------------------------------------------------------
# import hygiene
# ---------------------------------------------------------------------------------------------


def test_shared_imports_no_heavy_packages():
    code = (
        "import sys, shared, shared.inputs.workload, shared.inputs.hardware, shared.ir.ops, shared.ir.program;"
        "import shared.schedules;"
        "bad = [m for m in ('torch', 'simpy', 'matplotlib') if m in sys.modules];"
        "assert not bad, bad"
    )
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert r.returncode == 0, r.stderr
