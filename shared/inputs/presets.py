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
import math
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
        except ConfigError as e:  # it names the field: the file is said here
            raise ConfigError(f"{p}: {e}") from None
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


#: The HF ``model_type`` values this reader maps, each to how its fields are read: the type
#: decides what no field says (QK-norm for qwen3_moe; MLA for DeepSeek), so it must be given.
HF_TYPES = {
    "deepseek_v2": "deepseek",
    "deepseek_v3": "deepseek",
    "qwen2_moe": "qwen",
    "qwen3_moe": "qwen",
    "mixtral": "mixtral",
}
#: The types whose configuration classes define the head size as hidden / heads (transformers'
#: Qwen2MoeConfig and MixtralConfig): a config of another type without ``head_dim`` is noted
#: (Qwen3-MoE checkpoints give 128, twice hidden / heads for Qwen3-30B-A3B).
_HEAD_DIM_DERIVED = ("qwen2_moe", "mixtral")
_MISSING = object()


def _int(hf: dict[str, Any], key: str, name: str, default: Any = _MISSING) -> int:
    """A whole-number field of an HF config (``default`` where it is missing or null; none: a
    missing field is refused), refused in one line naming it when it is not a whole number."""
    v = hf.get(key)
    if v is None:
        if default is _MISSING:
            mt = hf.get("model_type")
            raise ConfigError(f"HF config of {name}: missing {key} (a {mt} config gives it)")
        return default
    whole = isinstance(v, int) or (isinstance(v, float) and math.isfinite(v) and v.is_integer())
    if isinstance(v, bool) or not whole:
        raise ConfigError(f"HF config of {name}: {key} must be a whole number, got {v!r}")
    return int(v)


def from_hf_config(hf: dict[str, Any], *, default_name: str) -> dict[str, Any]:
    """ModelConfig fields from a HuggingFace ``config.json``, by its ``model_type``
    (:data:`HF_TYPES`; missing or another is refused, naming it). Every whole-number field must
    be one (``num_hidden_layers: 48.5`` is refused, not cut to 48); a field without a safe
    default (the experts and top-k of a MoE) is refused when missing, naming it.

    - DeepSeek-V2/V3 (``deepseek_v2``/``deepseek_v3``): MLA (``kv_lora_rank``, ``q_lora_rank``
      null -> 0, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``),
      ``n_routed_experts``, ``n_shared_experts``, ``moe_intermediate_size``,
      ``first_k_dense_replace``, ``n_group``/``topk_group``; fp8 GEMMs when
      ``quantization_config.quant_method`` is fp8.
    - Qwen2-MoE/Qwen3-MoE: GQA (``num_key_value_heads``, ``head_dim``: hidden/heads where
      missing, as transformers takes it, noted for qwen3_moe), ``num_experts``,
      ``moe_intermediate_size``, ``shared_expert_intermediate_size`` (Qwen2-MoE: one shared
      expert of that width), ``mlp_only_layers``/``decoder_sparse_step`` (only leading dense
      layers are representable), QK-norm for qwen3_moe.
    - Mixtral: ``num_local_experts``, ``intermediate_size`` is the expert width, no shared expert.
    """
    name = default_name
    mt = hf.get("model_type")
    if mt is None:
        raise ConfigError(
            f"HF config of {name}: model_type missing; it says how the fields are read (one of "
            f"{', '.join(HF_TYPES)})"
        )
    family = HF_TYPES.get(str(mt).lower())
    if family is None:
        raise ConfigError(
            f"HF config of {name}: model_type {mt!r} is not a MoE this reader knows (one of "
            f"{', '.join(HF_TYPES)})"
        )
    mt = str(mt).lower()
    heads = _int(hf, "num_attention_heads", name)
    out: dict[str, Any] = {
        "name": name,
        "num_layers": _int(hf, "num_hidden_layers", name),
        "hidden": _int(hf, "hidden_size", name),
        "vocab": _int(hf, "vocab_size", name),
        "num_heads": heads,
        "num_kv_heads": _int(hf, "num_key_value_heads", name, heads),
    }
    quant = (hf.get("quantization_config") or {}).get("quant_method", "")
    out["gemm_dtype"] = "fp8" if str(quant).lower() == "fp8" else "bf16"
    if family == "deepseek":
        out.update(
            attention="mla",
            num_kv_heads=heads,
            q_lora_rank=_int(hf, "q_lora_rank", name, 0),
            kv_lora_rank=_int(hf, "kv_lora_rank", name),
            qk_nope_dim=_int(hf, "qk_nope_head_dim", name),
            qk_rope_dim=_int(hf, "qk_rope_head_dim", name),
            v_head_dim=_int(hf, "v_head_dim", name),
            num_experts=_int(hf, "n_routed_experts", name),
            top_k=_int(hf, "num_experts_per_tok", name),
            expert_inter=_int(hf, "moe_intermediate_size", name, None)
            or _int(hf, "intermediate_size", name),
            num_shared_experts=_int(hf, "n_shared_experts", name, 0),
            dense_inter=_int(hf, "intermediate_size", name),
            first_k_dense=_int(hf, "first_k_dense_replace", name, 0),
            n_group=_int(hf, "n_group", name, 1),
            topk_group=_int(hf, "topk_group", name, 1),
            mtp=_int(hf, "num_nextn_predict_layers", name, 0),  # DeepSeek-V3's MTP module
        )
        return out
    derived = out["hidden"] // heads
    head_dim = _int(hf, "head_dim", name, None)
    if head_dim is None:
        head_dim = derived
        if mt not in _HEAD_DIM_DERIVED:
            note(
                f"HF config of {name}: head_dim missing; took hidden_size / num_attention_heads "
                f"= {derived}, as transformers does ({mt} checkpoints usually give it)"
            )
    out.update(attention="gqa", head_dim=head_dim)
    if family == "mixtral":
        out.update(
            num_experts=_int(hf, "num_local_experts", name),
            top_k=_int(hf, "num_experts_per_tok", name),
            expert_inter=_int(hf, "intermediate_size", name),
            dense_inter=_int(hf, "intermediate_size", name),
            first_k_dense=0,
        )
        return out
    n = out["num_layers"]
    step = _int(hf, "decoder_sparse_step", name, 1) or 1
    dense = sorted(set(hf.get("mlp_only_layers") or []) | {i for i in range(n) if (i + 1) % step})
    if dense != list(range(len(dense))):
        raise ConfigError(
            f"HF config of {name}: dense layers {dense} are not the leading ones; "
            "only leading dense layers (first_k_dense) are modelled"
        )
    shared = _int(hf, "shared_expert_intermediate_size", name, 0)
    expert = _int(hf, "moe_intermediate_size", name)
    out.update(
        num_experts=_int(hf, "num_experts", name),
        top_k=_int(hf, "num_experts_per_tok", name),
        expert_inter=expert,
        dense_inter=_int(hf, "intermediate_size", name, None) or expert,
        first_k_dense=len(dense),
        qk_norm=mt == "qwen3_moe",
    )
    if shared:
        if shared % expert:
            raise ConfigError(
                f"HF config of {name}: shared_expert_intermediate_size {shared} is "
                f"not a multiple of moe_intermediate_size {expert}"
            )
        out["num_shared_experts"] = shared // expert
    return out
