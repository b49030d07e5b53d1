"""The ops a deployment runs: o_proj, the absorbed projections and the FP8 quantisation kernels as
ops of their own with their own cost sources, and DeepSeek-V3's multi-token-prediction module in
decode steps that verify draft tokens."""

from __future__ import annotations

import dataclasses
import json

import pytest

import overlap_lab as ol
from overlap_lab.shared.inputs.hardware import get_gpu
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


# ----------------------------------------------------------------------------------------------
# The memory- and latency-bound kernels around the GEMMs, and DeepEP's notify and layout kernels
# ----------------------------------------------------------------------------------------------

#: Kernels a DeepSeek-V3 prefill on DeepEP's normal kernels runs besides its GEMMs and attention
#: (docs/schedules.md, "The kernels a deployment runs"): op -> (stream, cost source)
PREFILL_KERNELS = {
    "attn.norm": ("main", "roofline"),
    "attn.rope": ("main", "roofline"),
    "attn.kv_write": ("main", "roofline"),
    "select_experts.ids": ("main", "roofline"),
    "dispatch.quant": ("main", "roofline"),
    "get_dispatch_layout": ("comm", "roofline"),
    "notify_dispatch": ("comm", "link"),
    "experts.scatter": ("main", "roofline"),
    "experts.act": ("main", "roofline"),
    "experts.quant": ("main", "roofline"),
    "experts.gather": ("main", "roofline"),
    "cached_notify": ("comm", "link"),
    "shared_experts.act": ("main", "roofline"),
    "final_norm": ("main", "roofline"),
}


def _prefill(ep=32, layers=5):
    return ol.workload("deepseek-v3", mode="prefill", batch=4, layers=layers, ep=ep)


def test_deepseek_prefill_trace_shows_the_deployments_kernels_each_with_its_cost_source():
    res = ol.simulate("deepseek", _prefill(), "h800")
    prof = load_profile("h800-published")
    src = {op.name: duration_source(op, res.gpu, prof) for _, op in ops_of(res.program)}
    lanes: dict[str, set] = {}
    for s in res.trace.spans:
        if s.lane.startswith("stream:"):
            lanes.setdefault(s.op, set()).add(s.lane[len("stream:") :])
    for name, (stream, source) in PREFILL_KERNELS.items():
        assert lanes.get(name) == {stream}, name  # an op of its own, on upstream's stream
        assert src[name] == source, name
    assert src["experts"] == src["attn.prepare"] == "profile"  # the GEMMs keep their rows
    # one span per layer and micro-batch: the kernels are cut, not folded into a neighbour
    moe = [L for L in range(res.workload.model.num_layers) if res.workload.model.is_moe_layer(L)]
    for name in ("get_dispatch_layout", "notify_dispatch", "experts.scatter", "cached_notify"):
        got = {(s.layer, s.mb) for s in res.trace.spans if s.op == name and s.lane != "host"}
        assert got == {(L, mb) for L in moe for mb in (0, 1)}, name


def test_memory_bound_passes_run_at_memory_rate_not_gemm_rate():
    """RoPE, the norms and the MoE's passes are waved elementwise kernels at the roofline's
    memory rate: their time alone is their bytes over the usable bandwidth (or the launch floor),
    whatever GEMM they sit beside."""
    from overlap_lab.shared.ir.ops import layer_ops, whole_batch
    from overlap_lab.sim import cost

    w = _prefill()
    g = get_gpu("h800")
    ops = layer_ops(w, g, 4, whole_batch(w), deepep_mode="normal")
    for name in ("attn.rope", "attn.norm", "experts.scatter", "experts.act", "experts.gather"):
        op = ops[name]
        assert cost.grid_kind(op) == "waved" and op.op_class == "elementwise"
        mem = op.hbm_bytes / (g.hbm_bytes_per_us * cost.EFFICIENCY["elementwise"][1])
        assert cost.solo_duration_us(op, g) == pytest.approx(max(mem, g.kernel_min_us), rel=0.02)


def test_notify_kernels_wait_for_every_peer_in_explicit_ranks():
    """A rank that reaches its notify early waits there for the last one: with DP attention's
    ranks holding different token counts (their attention takes different times), every rank's
    notify_dispatch ends after the last rank's has started, so the skew is in its span, while the
    balanced program's notifies take only their link latency."""
    w = _prefill(ep=16)
    skew = ol.simulate("serial", w, "h800", ranks="explicit", dp_imbalance=0.5, reduce=False)
    even = ol.simulate("serial", w, "h800")
    L = max(L for L in range(w.model.num_layers) if w.model.is_moe_layer(L))

    def spans(res, name):
        return [s for s in res.trace.spans if s.op == name and s.layer == L and s.lane != "host"]

    notify = [s for s in spans(skew, "notify_dispatch") if s.lane.startswith("stream:")]
    assert len({s.rank for s in notify}) == 16
    first, last = min(s.start for s in notify), max(s.start for s in notify)
    assert last - first > 1000  # the ranks reached it far apart ...
    assert all(s.end >= last for s in notify)  # ... and each waited for the last one
    (one,) = [s for s in spans(even, "notify_dispatch") if s.lane.startswith("stream:")]
    assert one.end - one.start < 10  # no peer to wait for: its link latency
