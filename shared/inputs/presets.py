"""Models and GPUs from files: the built-in presets and a researcher's own.

A model file is YAML or JSON holding the fields of :class:`~overlap_lab.shared.inputs.workload.ModelConfig`
(``name``, ``num_layers``, ``hidden``, ...), or a HuggingFace ``config.json`` read as it is:
DeepSeek-V2/V3 (``DeepseekV2ForCausalLM``/``DeepseekV3ForCausalLM``), Qwen2-MoE/Qwen3-MoE and
Mixtral field names are mapped below. A GPU file is YAML or JSON holding the fields of
:class:`~overlap_lab.shared.inputs.hardware.GPU`. The built-in presets are such files, shipped inside the
package (``shared/inputs/presets/models/*.yaml``, ``shared/inputs/presets/gpus/*.yaml``), each value with its
source in a comment, and read by ``shared.inputs.preset_files`` (below the record types, so that
``hardware`` and ``workload`` load their built-ins without importing this module).

A file without a ``name`` takes its file name (``my-gpu.yaml`` -> ``my-gpu``), so every output
says which hardware or model it was computed for.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.files import read_mapping
from overlap_lab.shared.inputs.hardware import GPU, get_gpu, gpu_fields
from overlap_lab.shared.inputs.preset_files import from_file, note
from overlap_lab.shared.inputs.workload import ModelConfig, get_model, model_file_fields

SUFFIXES = (".yaml", ".yml", ".json")


def _is_path(spec: str | Path) -> bool:
    return isinstance(spec, Path) or str(spec).endswith(SUFFIXES) or "/" in str(spec)


def _fields_of(cls, data: dict[str, Any], what: str, path: Path, required, defaulted):
    """The record of a file's fields: unknown and missing fields, and values out of their knob
    range, are one-line errors naming the field and the file; the defaults it took that change
    the result are said in one note on stderr."""
    known = [f.name for f in dataclasses.fields(cls)]
    bad = sorted(set(data) - set(known))
    if bad:
        raise ConfigError(
            f"{path}: unknown {what} field {bad[0]!r}; fields are {', '.join(sorted(known))}"
        )
    missing = [f for f in required if f not in data]
    if missing:
        raise ConfigError(
            f"{path}: {what} field{'s' if len(missing) > 1 else ''} {', '.join(missing)} missing "
            "(docs/models-and-gpus.md lists the fields a file must give)"
        )
    record = from_file(cls, data, path)
    if defaulted:
        note(
            f"{path}: took the default "
            + ", ".join(f"{f}={getattr(record, f)!r}" for f in defaulted)
        )
    return record


def load_gpu(spec: str | Path) -> GPU:
    """A GPU preset by name, or a YAML/JSON file of GPU fields (every field without a default;
    ``name`` defaults to the file name)."""
    if not _is_path(spec):
        return get_gpu(str(spec))
    p = Path(spec)
    data = read_mapping(p, "gpu file")
    data.setdefault("name", p.stem)
    records = gpu_fields()
    required = [k.name for k in records if k.default is dataclasses.MISSING]
    defaulted = [k.name for k in records if k.name not in data and k.name not in required]
    return _fields_of(GPU, data, "gpu", p, required, defaulted)


def load_model(spec: str | Path) -> ModelConfig:
    """A model preset by name, a YAML/JSON file of ModelConfig fields (``model_file_fields``
    says which it must give), or an HF config.json."""
    if not _is_path(spec):
        return get_model(str(spec))
    p = Path(spec)
    data = read_mapping(p, "model file")
    hf = "hidden_size" in data or "architectures" in data or "model_type" in data
    if hf:
        try:
            data = from_hf_config(data, default_name=_hf_name(data, p))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{p}: HF config field missing or malformed: {e}") from None
    data.setdefault("name", p.stem)
    required, defaulted = model_file_fields(data)
    # an HF config's defaults are its architecture's, applied by the mapping: nothing to say
    return _fields_of(ModelConfig, data, "model", p, required, () if hf else defaulted)


def _hf_name(data: dict[str, Any], p: Path) -> str:
    """An HF config has no model name in it: use the folder (``DeepSeek-V3/config.json``)."""
    if p.stem == "config" and p.parent.name not in ("", "."):
        return p.parent.name.lower()
    return data.get("_name_or_path", p.stem).rsplit("/", 1)[-1].lower() or p.stem


def _need(hf: dict[str, Any], key: str, name: str) -> Any:
    """A field of an HF config that has no safe default (the experts and top-k of a MoE)."""
    if hf.get(key) is None:
        raise ConfigError(f"HF config of {name}: missing {key} (a MoE config gives it)")
    return hf[key]


def from_hf_config(hf: dict[str, Any], *, default_name: str) -> dict[str, Any]:
    """ModelConfig fields from a HuggingFace ``config.json``.

    - DeepSeek-V2/V3 (``model_type`` deepseek_v2/deepseek_v3): MLA (``kv_lora_rank``,
      ``q_lora_rank`` null -> 0, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``),
      ``n_routed_experts``, ``n_shared_experts``, ``moe_intermediate_size``,
      ``first_k_dense_replace``, ``n_group``/``topk_group``; fp8 GEMMs when
      ``quantization_config.quant_method`` is fp8.
    - Qwen2-MoE/Qwen3-MoE: GQA (``num_key_value_heads``, ``head_dim`` or hidden/heads),
      ``num_experts``, ``moe_intermediate_size``, ``shared_expert_intermediate_size`` (Qwen2-MoE:
      one shared expert of that width), ``mlp_only_layers``/``decoder_sparse_step`` (only leading
      dense layers are representable), ``qk_norm`` for qwen3_moe.
    - Mixtral: ``num_local_experts``, ``intermediate_size`` is the expert width, no shared expert.
    """
    mt = str(hf.get("model_type", "")).lower()
    need = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads")
    missing = [k for k in need if k not in hf]
    if missing:
        raise ConfigError(f"HF config of {default_name}: missing {', '.join(missing)}")
    heads = int(hf["num_attention_heads"])
    out: dict[str, Any] = {
        "name": default_name,
        "num_layers": int(hf["num_hidden_layers"]),
        "hidden": int(hf["hidden_size"]),
        "vocab": int(hf["vocab_size"]),
        "num_heads": heads,
        "num_kv_heads": int(hf.get("num_key_value_heads") or heads),
    }
    quant = (hf.get("quantization_config") or {}).get("quant_method", "")
    out["gemm_dtype"] = "fp8" if str(quant).lower() == "fp8" else "bf16"
    if mt.startswith("deepseek") or "kv_lora_rank" in hf:
        moe_inter = int(hf.get("moe_intermediate_size") or hf["intermediate_size"])
        out.update(
            attention="mla",
            num_kv_heads=heads,
            q_lora_rank=int(hf.get("q_lora_rank") or 0),
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_dim=int(hf["qk_nope_head_dim"]),
            qk_rope_dim=int(hf["qk_rope_head_dim"]),
            v_head_dim=int(hf["v_head_dim"]),
            num_experts=int(_need(hf, "n_routed_experts", default_name)),
            top_k=int(_need(hf, "num_experts_per_tok", default_name)),
            expert_inter=moe_inter,
            num_shared_experts=int(hf.get("n_shared_experts") or 0),
            dense_inter=int(hf["intermediate_size"]),
            first_k_dense=int(hf.get("first_k_dense_replace") or 0),
            n_group=int(hf.get("n_group") or 1),
            topk_group=int(hf.get("topk_group") or 1),
            mtp=int(hf.get("num_nextn_predict_layers") or 0),  # DeepSeek-V3's MTP module
        )
        return out
    head_dim = int(hf.get("head_dim") or out["hidden"] // heads)
    out.update(attention="gqa", head_dim=head_dim)
    if mt == "mixtral" or hf.get("num_local_experts"):
        out.update(
            num_experts=int(hf["num_local_experts"]),
            top_k=int(_need(hf, "num_experts_per_tok", default_name)),
            expert_inter=int(hf["intermediate_size"]),
            dense_inter=int(hf["intermediate_size"]),
            first_k_dense=0,
        )
        return out
    if hf.get("num_experts"):  # Qwen2-MoE / Qwen3-MoE
        n = out["num_layers"]
        step = int(hf.get("decoder_sparse_step") or 1)
        dense = sorted(
            set(hf.get("mlp_only_layers") or []) | {i for i in range(n) if (i + 1) % step}
        )
        if dense != list(range(len(dense))):
            raise ConfigError(
                f"HF config of {default_name}: dense layers {dense} are not the leading ones; "
                "only leading dense layers (first_k_dense) are modelled"
            )
        shared = int(hf.get("shared_expert_intermediate_size") or 0)
        expert = int(hf["moe_intermediate_size"])
        out.update(
            num_experts=int(hf["num_experts"]),
            top_k=int(_need(hf, "num_experts_per_tok", default_name)),
            expert_inter=expert,
            dense_inter=int(hf.get("intermediate_size") or expert),
            first_k_dense=len(dense),
            qk_norm=mt == "qwen3_moe",
        )
        if shared:
            if shared % expert:
                raise ConfigError(
                    f"HF config of {default_name}: shared_expert_intermediate_size {shared} is "
                    f"not a multiple of moe_intermediate_size {expert}"
                )
            out["num_shared_experts"] = shared // expert
        return out
    raise ConfigError(
        f"HF config of {default_name}: model_type {mt!r} is not a MoE this reader knows "
        "(DeepSeek-V2/V3, Qwen2-MoE, Qwen3-MoE, Mixtral)"
    )
