"""What a newcomer hit (issue 32): a HuggingFace config read quietly wrong, a misspelled schedule
in a sweep grid, --version, help that said its default twice, MTP that cost nothing."""

from __future__ import annotations

import json

import pytest

from overlap_lab.cli.main import main
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs import preset_files
from overlap_lab.shared.inputs.presets import load_model
from overlap_lab.shared.inputs.workload import MODELS

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
}


def _config(tmp_path, **changes):
    hf = {k: v for k, v in {**QWEN3_30B, **changes}.items() if v is not ...}
    p = tmp_path / "Qwen3-30B-A3B" / "config.json"
    p.parent.mkdir(exist_ok=True)
    p.write_text(json.dumps(hf))
    return p


def test_the_published_config_is_the_preset(tmp_path):
    assert load_model(_config(tmp_path)) == MODELS["qwen3-30b-a3b"]


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"model_type": ...}, "model_type missing"),
        ({"model_type": "qwen3moe"}, "model_type 'qwen3moe' is not a MoE this reader knows"),
        ({"num_hidden_layers": 48.5}, "num_hidden_layers must be a whole number, got 48.5"),
        ({"hidden_size": "2048"}, "hidden_size must be a whole number, got '2048'"),
        ({"num_experts": ...}, "num_experts missing (a qwen3_moe config gives it)"),
        ({"num_experts_per_tok": ...}, "num_experts_per_tok missing"),
    ],
)
def test_a_wrong_config_is_refused_naming_the_field(tmp_path, changes, fragment):
    p = _config(tmp_path, **changes)
    with pytest.raises(ConfigError) as e:
        load_model(p)
    assert fragment in str(e.value) and str(p) in str(e.value) and "\n" not in str(e.value)
    assert "is not a MoE this reader knows (DeepSeek" not in str(e.value)  # no contradiction


def test_a_missing_head_dim_is_noted(tmp_path, capsys):
    preset_files.hold_notes(False)
    preset_files._NOTED.clear()
    m = load_model(_config(tmp_path, head_dim=...))
    assert m.head_dim == 2048 // 32 and m.qk_norm  # as transformers takes it, and said
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "head_dim missing; took hidden_size / num_attention_heads" in err
    )
    assert main(["sim", "--model-file", str(_config(tmp_path, head_dim=...)), "--ep", "8",
                 "--layers", "2", "--out", ""]) == 0  # fmt: skip
    assert "note: HF config of qwen3-30b-a3b: head_dim missing" in capsys.readouterr().err
