"""Models and GPUs from files (issue 11, item 5): YAML/JSON of the record's fields, HuggingFace
config.json read directly, the built-in presets shipped as such files, names carried to outputs."""

from __future__ import annotations

import json

import pytest

import overlap_lab as ol
from overlap_lab.cli.main import main
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import GPUS
from overlap_lab.shared.inputs.preset_files import PRESETS
from overlap_lab.shared.inputs.presets import load_gpu, load_model
from overlap_lab.shared.inputs.workload import MODELS

# The fields of the published config.json files (huggingface.co/<org>/<model>/blob/main/config.json)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "num_nextn_predict_layers": 1,
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
}
QWEN3_30B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_hidden_layers": 48,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
QWEN2_57B = {
    "model_type": "qwen2_moe",
    "num_hidden_layers": 28,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "moe_intermediate_size": 2560,
    "shared_expert_intermediate_size": 20480,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 151936,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
MIXTRAL = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
}


def write(tmp_path, name, data):
    p = tmp_path / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data))
    return p


def test_builtin_presets_are_files_in_the_package():
    assert {p.stem for p in (PRESETS / "gpus").glob("*.yaml")} == set(GPUS)
    assert {p.stem for p in (PRESETS / "models").glob("*.yaml")} == set(MODELS)
    for name, gpu in GPUS.items():
        assert load_gpu(PRESETS / "gpus" / f"{name}.yaml") == gpu
    for name, model in MODELS.items():
        assert load_model(PRESETS / "models" / f"{name}.yaml") == model


def test_hf_deepseek_v3_config_is_the_preset(tmp_path):
    m = load_model(write(tmp_path, "DeepSeek-V3/config.json", DEEPSEEK_V3))
    assert m.name == "deepseek-v3"
    assert m == MODELS["deepseek-v3"]


def test_hf_qwen3_moe_config_is_the_preset(tmp_path):
    m = load_model(write(tmp_path, "Qwen3-30B-A3B/config.json", QWEN3_30B))
    assert m == MODELS["qwen3-30b-a3b"]


def test_hf_qwen2_moe_and_mixtral(tmp_path):
    q = load_model(write(tmp_path, "Qwen2-57B-A14B/config.json", QWEN2_57B))
    assert q.num_shared_experts == 8 and q.expert_inter == 2560 and q.attention == "gqa"
    assert q.head_dim == 128 and q.num_kv_heads == 4 and not q.qk_norm
    x = load_model(write(tmp_path, "Mixtral-8x7B/config.json", MIXTRAL))
    assert (x.num_experts, x.top_k, x.expert_inter, x.num_shared_experts) == (8, 2, 14336, 0)
    assert x.name == "mixtral-8x7b"
    r = ol.simulate("tbo", ol.workload(x, layers=3, ep=8, batch=16))
    assert r.metrics.iteration_us > 0


def test_yaml_model_and_gpu_files(tmp_path):
    (tmp_path / "tiny.yaml").write_text(
        "num_layers: 4\nfirst_k_dense: 1\nhidden: 1024\nvocab: 32000\nattention: gqa\n"
        "num_heads: 8\nnum_kv_heads: 2\nhead_dim: 128\nnum_experts: 16\ntop_k: 2\n"
        "expert_inter: 512\ndense_inter: 2048\n"
    )
    m = load_model(tmp_path / "tiny.yaml")
    assert m.name == "tiny" and m.num_experts == 16
    gpu = dict(json.loads(json.dumps(GPUS["h800"].__dict__)), name="my-h800", hbm_gbps=2000.0)
    g = load_gpu(write(tmp_path, "gpu.json", gpu))
    assert g.name == "my-h800" and g.hbm_gbps == 2000.0


def test_bad_files_are_one_line_errors(tmp_path):
    (tmp_path / "bad.yaml").write_text("num_layers: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_model(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="unknown gpu field 'warp_size'"):
        load_gpu(write(tmp_path, "g.json", {**GPUS["h800"].__dict__, "warp_size": 32}))
    with pytest.raises(ConfigError, match="no such file"):
        load_gpu(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not a MoE"):
        load_model(
            write(
                tmp_path,
                "llama/config.json",
                {**MIXTRAL, "model_type": "llama", "num_local_experts": None},
            )
        )


def test_cli_model_and_gpu_files_carry_their_names(tmp_path, capsys):
    mf = write(tmp_path, "Mixtral-8x7B/config.json", MIXTRAL)
    gf = write(tmp_path, "lab-gpu.json", {**GPUS["h100"].__dict__, "name": "lab-gpu"})
    args = [
        "sim",
        "--model-file",
        str(mf),
        "--gpu-file",
        str(gf),
        "--layers",
        "3",
        "--ep",
        "8",
        "--batch",
        "16",
        "--json",
        "--out",
        "",
    ]
    assert main(args) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["model"] == "mixtral-8x7b[3 of 32 layers]" and res["gpu"] == "lab-gpu"
    assert main([*args, "--hbm-gbps", "1000"]) == 0
    assert json.loads(capsys.readouterr().out)["gpu"] == "lab-gpu+hbm-gbps=1000"


def test_hf_deepseek_v2_lite_config_is_the_preset(tmp_path):
    hf = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "num_hidden_layers": 27,
        "first_k_dense_replace": 1,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "n_group": 1,
        "topk_group": 1,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "vocab_size": 102400,
    }
    assert (
        load_model(write(tmp_path, "DeepSeek-V2-Lite/config.json", hf))
        == MODELS["deepseek-v2-lite"]
    )
