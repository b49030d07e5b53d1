"""The ops a deployment runs: o_proj, the absorbed projections and the FP8 quantisation kernels as
ops of their own with their own cost sources, and DeepSeek-V3's multi-token-prediction module in
decode steps that verify draft tokens."""

from __future__ import annotations

import dataclasses
import json

import pytest

import overlap_lab as ol
from overlap_lab.shared.inputs.knobs import knobs
from overlap_lab.shared.inputs.presets import load_model
from overlap_lab.shared.inputs.workload import ModelConfig, get_model
from overlap_lab.shared.ir.ops import MTP_HEAD_NAMES, MTP_OP_NAMES, mtp_passes
from overlap_lab.shared.ir.program import ops_of
from overlap_lab.sim.cost import duration_source
from overlap_lab.sim.profile import load_profile

OWN = ("attn.quant", "attn.uk_quant", "attn.absorb_k", "attn.uv_quant", "attn.absorb_v",
       "attn.o_quant", "attn.o_proj", "shared_experts.quant")  # fmt: skip


def _decode(tokens_per_seq: int = 1, model="deepseek-v3"):
    return ol.workload(model, batch=128, tokens_per_seq=tokens_per_seq, layers=4, ep=16)


@pytest.mark.parametrize("schedule", ["serial", "tbo", "deepseek", "sbo"])
def test_decode_runs_o_proj_absorbed_projections_and_quantisation_as_ops(schedule):
    res = ol.simulate(schedule, _decode(), "h800")
    names = {s.op for s in res.trace.spans if s.lane.startswith("stream:")}
    assert set(OWN) <= names
    prof = load_profile("h800-published")
    src = {op.name: duration_source(op, res.gpu, prof) for _, op in ops_of(res.program)}
    assert src["attn.o_proj"] == src["attn.absorb_k"] == src["attn.absorb_v"] == "profile"
    assert all(src[n] == "roofline" for n in OWN if n.endswith("quant"))  # memory-bound kernels
    assert src["attn.core"] == "roofline"  # the attention core alone: no GEMM class row


def test_o_proj_is_an_fp8_gemm_not_bf16_attention():
    res = ol.simulate("serial", _decode(), "h800")
    ops = {op.name: op for _, op in ops_of(res.program)}
    assert (ops["attn.o_proj"].op_class, ops["attn.o_proj"].dtype) == ("gemm", "fp8")
    assert (ops["attn.core"].op_class, ops["attn.core"].dtype) == ("attention", "bf16")


def test_bf16_models_run_no_quantisation_kernels():
    res = ol.simulate("serial", _decode(model="qwen3-30b-a3b"), "h800")
    names = {s.op for s in res.trace.spans}
    assert "attn.o_proj" in names and not any(n.endswith("quant") for n in names)


@pytest.mark.parametrize("schedule", ["serial", "tbo", "deepseek", "sbo", "lightllm", "vllm-dbo"])
def test_two_tokens_per_sequence_run_the_mtp_layer(schedule):
    res = ol.simulate(schedule, _decode(2), "h800")
    spans = [s for s in res.trace.spans if s.lane.startswith("stream:")]
    names = {s.op for s in spans}
    assert set(MTP_OP_NAMES + MTP_HEAD_NAMES) <= names
    mtp_layer = {s.op for s in spans if s.layer == 4}  # the MTP block: layer num_layers
    assert {"attn.core", "experts", "dispatch_a", "combine_b"} <= mtp_layer


def test_mtp_costs_time_and_is_off_without_a_module_or_draft_tokens():
    on = ol.simulate("serial", _decode(2), "h800")
    w = _decode(2)
    off_w = dataclasses.replace(w, model=dataclasses.replace(w.model, mtp=0))
    off = ol.simulate("serial", off_w, "h800")
    assert not any(s.op.startswith("mtp.") for s in off.trace.spans)
    assert on.metrics.iteration_us > off.metrics.iteration_us
    one = ol.simulate("serial", _decode(1), "h800")
    assert not any(s.op.startswith("mtp.") for s in one.trace.spans)
    assert mtp_passes(_decode(3)) == 2


def test_mtp_is_a_model_knob_on_for_deepseek_v3():
    assert "mtp" in {k.name for k in knobs(ModelConfig)}
    assert get_model("deepseek-v3").mtp == 1
    assert get_model("qwen3-30b-a3b").mtp == 0


def test_hf_config_reads_num_nextn_predict_layers(tmp_path):
    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 4, "hidden_size": 64,
           "vocab_size": 100, "num_attention_heads": 4, "num_key_value_heads": 4,
           "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
           "v_head_dim": 8, "n_routed_experts": 8, "num_experts_per_tok": 2,
           "moe_intermediate_size": 16, "n_shared_experts": 1, "intermediate_size": 64,
           "first_k_dense_replace": 1, "num_nextn_predict_layers": 1}  # fmt: skip
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    assert load_model(p).mtp == 1


def test_mtp_is_an_option_of_the_model_on_the_command_line(capsys):
    """`--mtp` sets the model's MTP modules: on by default for DeepSeek-V3 with two tokens per
    sequence, off with `--mtp 0`, and the API's `workload(mtp=...)` does the same."""
    import json

    from overlap_lab import api
    from overlap_lab.cli.main import main

    def ops(*extra):
        assert main(["show", "--tokens-per-seq", "2", "--layers", "3", *extra]) == 0
        return capsys.readouterr().out

    assert "mtp.eh_proj" in ops() and "mtp.eh_proj" not in ops("--mtp", "0")
    assert api.workload("deepseek-v3", tokens_per_seq=2, mtp=0).model.mtp == 0

    def num_ops(*extra):
        argv = ["sim", "--tokens-per-seq", "2", "--layers", "3", "--json", "--out", "", *extra]
        assert main(argv) == 0
        return json.loads(capsys.readouterr().out)["num_ops"]

    assert num_ops("--mtp", "0") < num_ops()
