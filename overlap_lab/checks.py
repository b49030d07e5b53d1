"""What is checked of a run's inputs before it starts, beyond each value's own range.

- Memory: the GPU's (the model's weights and the KV cache of every batch in flight against
  ``GPU.mem_gib``)
  and the simulator's own (an explicit-rank run's routing draw and Program against this
  machine's memory): a run that cannot fit is refused in one line instead of failing halfway or
  swapping the machine to a halt.
- Routing files: a regular text file of finite, sensible numbers; routing options that fit the
  model (:func:`check_ranks`).
- Own knobs given to schedules none of which reads them (:func:`check_knobs_read`).
- Hardware overrides (:func:`check_overrides`): each in its field's range (the knob record's,
  which the command line's options check too), and one that looks typed in another unit
  (:func:`implausible`) taken, but said.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import gpu_fields

GIB = 1 << 30


def _bytes_per(dtype: str) -> int:
    return 1 if dtype == "fp8" else 2


def gpu_memory_bytes(w, in_flight: int = 1) -> tuple[float, float]:
    """(weights, KV cache) bytes one GPU holds: its pipeline stage's layers, its share of the
    experts and attention heads, the embedding and LM head; the KV cache of its sequences for
    those layers, ``in_flight`` batches of them (pp's micro-batches, each a whole batch:
    ``shared.schedules.batches_in_flight``)."""
    m, par, b = w.model, w.parallel, w.batch
    layers = math.ceil(m.num_layers / par.pp)
    wb = _bytes_per(m.gemm_dtype)
    if m.attention == "mla":
        q = (
            m.hidden * m.q_lora_rank + m.q_lora_rank * m.num_heads * (m.qk_nope_dim + m.qk_rope_dim)
            if m.q_lora_rank
            else m.hidden * m.num_heads * (m.qk_nope_dim + m.qk_rope_dim)
        )
        kv = m.hidden * (m.kv_lora_rank + m.qk_rope_dim)
        kv += m.kv_lora_rank * m.num_heads * (m.qk_nope_dim + m.v_head_dim)
        attn = q + kv + m.num_heads * m.v_head_dim * m.hidden
        kv_per_token = (m.kv_lora_rank + m.qk_rope_dim) * _bytes_per(m.attn_dtype)
    else:
        attn = m.hidden * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
        attn += m.num_heads * m.head_dim * m.hidden
        kv_heads = max(1, m.num_kv_heads // par.attn_tp)
        kv_per_token = 2 * kv_heads * m.head_dim * _bytes_per(m.attn_dtype)
    attn //= par.attn_tp
    moe = [m.is_moe_layer(i) for i in range(m.num_layers)]
    frac = layers / m.num_layers
    n_moe, n_dense = sum(moe) * frac, (len(moe) - sum(moe)) * frac
    expert = 3 * m.hidden * m.expert_inter
    moe_layer = expert * (m.num_experts // par.ep + m.num_shared_experts) + m.hidden * m.num_experts
    dense_layer = 3 * m.hidden * m.dense_inter
    weights = wb * (layers * attn + n_moe * moe_layer + n_dense * dense_layer)
    weights += 2 * 2 * m.vocab * m.hidden  # embedding and LM head, bf16
    cached = sum(b.seq_cached(i) + b.seq_tokens(i) for i in range(b.num_seqs))
    return float(weights), float(cached * kv_per_token * layers * in_flight)


def check_memory(w, gpu, allow: bool, *, schedule: str | None = None, cfg: Any = None) -> None:
    """Refuse a workload whose weights plus KV cache exceed the GPU memory (unless ``allow``).
    With its ``schedule`` (and ScheduleConfig ``cfg``), the workload that schedule runs
    (``prepare_workload``: pp's default stages) and the KV cache of every batch it holds at
    once (``batches_in_flight``: pp's micro-batches, each a whole batch of the sequences)."""
    from overlap_lab.shared import schedules

    in_flight, what = 1, ""
    if schedule is not None:
        cfg = cfg if cfg is not None else schedules.ScheduleConfig()
        w, _ = schedules.prepare_workload(schedule, w)
        in_flight = schedules.batches_in_flight(schedule, w, cfg)
        if in_flight > 1:
            what = f" of {in_flight} batches in flight ({schedule})"
    weights, kv = gpu_memory_bytes(w, in_flight)
    have = gpu.mem_gib * GIB
    if weights + kv > have and not allow:
        raise ConfigError(
            f"does not fit in GPU memory: weights {weights / GIB:.1f} GiB + KV cache{what} "
            f"{kv / GIB:.1f} GiB > {gpu.mem_gib:g} GiB ({gpu.name}, --mem-gib); use fewer or "
            "shorter sequences, more --ep/--pp-size, or --allow-oversubscribe"
        )


def host_memory_bytes() -> float:
    """This machine's physical memory."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return float("inf")


def sim_memory_bytes(w, ranks: str = "symmetric", imbalance: str = "balanced") -> float:
    """A rough upper estimate of the simulator's own memory for an explicit-rank run: the
    routing draw of every MoE layer when sampled (tokens of all ranks × experts: the int64
    ``argpartition`` result ``shared.inputs.routing`` keeps per layer, and one float32 score array at a
    time) plus the explicit Program (about 1 KB per op, 32 ops
    per layer and rank, and 128 B per flow of its four all-to-alls per layer; a DeepSeek-V3
    decode step at EP 32 measures under 100 MB)."""
    if ranks != "explicit":
        return 0.0
    m, par = w.model, w.parallel
    moe_layers = sum(m.is_moe_layer(i) for i in range(m.num_layers))
    tokens = w.batch.num_tokens * par.ep
    sampled = str(imbalance) != "balanced"
    routing = (moe_layers * 8 + 4) * tokens * m.num_experts if sampled else 0
    program = par.ep * m.num_layers * (32 * 1024 + 4 * par.ep * 128)
    return float(routing + program)


def check_workload(
    w, gpu, cfg: Any, schedules: Sequence[str | None], allow: bool, sim: tuple[str, str] | None
) -> None:
    """The memory checks of a built workload for each schedule of ``schedules`` with the
    ScheduleConfig ``cfg`` (:func:`check_memory`: the batches it holds at once, pp's
    micro-batches; a name that is no schedule, ``run``'s ``all``, as a one-batch schedule; a
    broken plug-in is left to the command, which refuses its row), and with ``sim`` = (ranks,
    imbalance) the simulator's own (:func:`check_sim_memory`)."""
    from overlap_lab.shared.schedules import SCHEDULES, loadable

    usable = set(loadable())
    for name in schedules:
        if name in SCHEDULES and name not in usable:
            continue
        check_memory(w, gpu, allow, schedule=name if name in SCHEDULES else None, cfg=cfg)
    if sim is not None:
        check_sim_memory(w, *sim)


def check_sim_memory(w, ranks: str = "symmetric", imbalance: str = "balanced") -> None:
    """Refuse an explicit-rank run whose estimated footprint exceeds 80 % of this machine."""
    need, have = sim_memory_bytes(w, ranks, imbalance), 0.8 * host_memory_bytes()
    if need > have:
        raise ConfigError(
            f"the simulation would need about {need / GIB:.1f} GiB of memory, more than the "
            f"{have / GIB:.1f} GiB it may use here (80 % of this machine); use fewer --layers, "
            "tokens or --ep, or --ranks symmetric"
        )


def check_profile_file(spec) -> None:
    """A ``--profile`` naming a file is read through ``shared.files`` first (a regular JSON
    file of at most 16 MiB, nested at most 100 deep), so that a FIFO, a device, a 2 GiB file or
    deeply nested JSON is one line here rather than a hang, gigabytes or a RecursionError in
    ``sim.profile.load_profile``, which then parses it. A missing file is left to it (its
    message lists the built-in profiles)."""
    from overlap_lab.shared.files import read_json
    from overlap_lab.sim.profile import BUILTIN, ROOFLINE

    if not isinstance(spec, (str, os.PathLike)) or str(spec) in ("auto", ROOFLINE, *BUILTIN):
        return
    if os.path.lexists(spec):
        read_json(spec, "profile")


MAX_EXPERT_COUNT = 1e15


def check_routing_file(path: str, num_experts: int, top_k: int) -> None:
    """A routing file: a regular UTF-8 text file (``shared.inputs.routing.read_sample`` reads it
    through ``shared.files``) whose numbers are finite and sensible."""
    from overlap_lab.shared.inputs.routing import read_sample

    sample = read_sample(path, num_experts, top_k)
    counts = getattr(sample, "counts", None)
    if counts and any(not math.isfinite(c) or c > MAX_EXPERT_COUNT for c in counts):
        raise ConfigError(
            f"routing file {path}: expert counts must be finite numbers in 0..{MAX_EXPERT_COUNT:g}"
        )


#: A value more than this many times the fastest built-in preset's is said to be implausible.
IMPLAUSIBLE = 2.0


@functools.cache
def _fastest_presets() -> dict[str, tuple[float, str]]:
    """GPU field -> (its largest value among the built-in presets, that preset's name)."""
    from overlap_lab.shared.inputs.hardware import GPUS

    out = {}
    for k in gpu_fields():
        if k.scalar in (int, float):
            name = max(GPUS, key=lambda n: getattr(GPUS[n], k.name))
            if getattr(GPUS[name], k.name) > 0:
                out[k.name] = (getattr(GPUS[name], k.name), name)
    return out


def implausible(values: Mapping[str, float | None]) -> list[str]:
    """What to say of the hardware values given (``values``: GPU field -> the value, None: not
    given) above :data:`IMPLAUSIBLE` times the fastest built-in preset's: such a value is taken,
    but is most likely in another unit (``rdma_gbps 400`` for a 400 Gb/s NIC, which is 50 GB/s).
    Each names its field as the API does; the command line shows its option."""
    records = {k.name: k for k in gpu_fields()}
    out = []
    for field, (top, name) in _fastest_presets().items():
        v = values.get(field)
        if v is None or v <= IMPLAUSIBLE * top:
            continue
        unit = records[field].unit
        hint = " (a link sold in Gb/s: divide by 8)" if unit == "GB/s" else ""
        out.append(
            f"{field} {v:g} {unit} is over {IMPLAUSIBLE:g}x the fastest built-in "
            f"GPU's ({name}: {top:g} {unit}); is it in {unit}?{hint}"
        )
    return out


class ImplausibleValue(UserWarning):
    """A hardware value taken that most likely is in another unit (:func:`implausible`)."""


def check_overrides(overrides: Mapping[str, float]) -> None:
    """GPU fields given to replace a preset's (``overlap_lab.gpu(..., hbm_gbps=...)``, which the
    command line's hardware options call): each within its knob record's range, the same as the
    option's (``hbm_gbps=3.35`` is TB/s typed as GB/s: refused, naming ``hbm_gbps``); a value in
    range that looks typed in another unit is an :class:`ImplausibleValue` warning."""
    records = {k.name: k for k in gpu_fields()}
    for name, v in overrides.items():
        records[name].validate(v)
    for msg in implausible(overrides):
        warnings.warn(msg, ImplausibleValue, stacklevel=3)


def verify_tokens(mtp: int | None, tokens_per_seq: int | None, mode: str) -> int:
    """Tokens per sequence a decode step computes, given ``mtp`` MTP draft steps (None: the
    model's own module drafts ``tokens_per_seq - 1``; 0: none): with ``mtp`` N >= 1 the MTP module
    runs N times per step (SGLang's EAGLE worker, ``speculative_num_steps``: the draft extend
    after verification, then N - 1 draft decodes, each a forward of DeepSeek-V3's one module,
    python/sglang/srt/speculative/eagle_worker.py) and the step verifies N + 1 tokens per
    sequence (``speculative_num_draft_tokens = speculative_num_steps + 1`` at top-k 1,
    python/sglang/srt/server_args.py), so a ``tokens_per_seq`` given otherwise is refused."""
    if mtp is None or mtp == 0:
        return 1 if tokens_per_seq is None else tokens_per_seq
    names = ("mtp", "tokens_per_seq")
    if mode != "decode":
        raise ConfigError(f"mtp applies to decode steps, not {mode}", names=names)
    if tokens_per_seq not in (None, mtp + 1):
        raise ConfigError(
            f"mtp {mtp} drafts {mtp} tokens per sequence, so the step verifies {mtp + 1} "
            f"(tokens_per_seq {mtp + 1}, SGLang's draft tokens = steps + 1), got "
            f"tokens_per_seq {tokens_per_seq}",
            names=names,
        )
    return mtp + 1


def check_ranks(model: Any, group_limited: bool | None, imbalance: str) -> None:
    """Routing options against the model: group-limited routing needs expert groups, and a
    routing file (``file:PATH``) must hold the model's experts and top-k (:func:`check_routing_file`)."""
    from overlap_lab.shared.inputs.routing import parse_imbalance

    if group_limited and model.n_group <= 1:
        raise ConfigError(
            f"group_limited true needs a model with expert groups; {model.name} has none "
            "(n_group 1)",
            names=("group_limited",),
        )
    imb = parse_imbalance(imbalance)
    if imb.kind == "file":
        check_routing_file(imb.path, model.num_experts, model.top_k)


def partial_knob_readers() -> dict[str, tuple[str, ...]]:
    """Schedule knobs read by only some schedules -> those schedules (each schedule module
    declares its own, ``shared.schedules.knob_readers``)."""
    from overlap_lab.shared.schedules import SCHEDULES, knob_readers

    return {n: r for n, r in knob_readers().items() if len(r) < len(SCHEDULES)}


def check_knobs_read(given: Mapping[str, Any], schedules: Sequence[str]) -> None:
    """Refuse a schedule knob given (``given``: knob -> value; None, empty or False: not given)
    that none of ``schedules`` reads: it would change nothing."""
    for name, owners in partial_knob_readers().items():
        v = given.get(name)
        if v is None or v == () or v is False or set(schedules) & set(owners):
            continue
        raise ConfigError(
            f"{name} applies to schedule {' or '.join(owners)} only, not {', '.join(schedules)}",
            names=(name, "schedule"),
        )


#: Workload parameters (``api.workload``'s) that one mode reads and the other does not
DECODE_ONLY = ("kv_len", "kv_lens", "tokens_per_seq", "mtp")
PREFILL_ONLY = ("extend_len", "extend_lens", "prefix_len", "prefix_lens")


def mode_of(mode: Any) -> str:
    """``mode`` as the workload reads it: decode or prefill, case-insensitive."""
    m = str(mode).lower()
    if m not in ("decode", "prefill"):
        raise ConfigError(f"mode must be decode or prefill, got {mode!r}", names=("mode",))
    return m


def check_batch_fields(mode: str, given: Mapping[str, Any]) -> None:
    """Refuse workload parameters given (``given``: name -> value, None: not given) that
    ``mode`` does not read (they would change nothing), and explicit lengths whose count
    contradicts the batch or each other."""
    other = "prefill" if mode == "decode" else "decode"
    for name in PREFILL_ONLY if mode == "decode" else DECODE_ONLY:
        if given.get(name) is not None:
            raise ConfigError(
                f"{name} applies to mode {other} only, not {mode}", names=(name, "mode")
            )
    batch = given.get("batch")
    kv, ext, pre = (given.get(k) for k in ("kv_lens", "extend_lens", "prefix_lens"))
    names = ("batch", "kv_lens", "extend_lens", "prefix_lens")
    if mode == "decode" and kv is not None and batch is not None and batch != len(kv):
        raise ConfigError(f"batch {batch} but {len(kv)} kv_lens", names=names)
    if mode == "prefill" and ext is not None:
        if batch is not None and batch != len(ext):
            raise ConfigError(f"batch {batch} but {len(ext)} extend_lens", names=names)
        if pre is not None and len(pre) != len(ext):
            raise ConfigError(f"{len(pre)} prefix_lens for {len(ext)} extend_lens", names=names)
    elif mode == "prefill" and pre is not None:
        raise ConfigError("prefix_lens needs extend_lens (one prefix per sequence)", names=names)


def check_comm_sms(given: Mapping[str, Any], num_sms: int) -> None:
    """Communication SMs (``comm_sms``, ``sbo_comm_sms``, ``deepep_normal_sms`` as given; None:
    not given) below the GPU's ``num_sms``: a kernel cannot hold every SM of the GPU."""
    for name in ("comm_sms", "sbo_comm_sms", "deepep_normal_sms"):
        v = given.get(name)
        if v is not None and v >= num_sms:
            raise ConfigError(f"{name} {v} must be below the GPU's {num_sms} SMs", names=(name,))


def schedule_names(names: Sequence[str], *, extra: Sequence[str] = ()) -> list[str]:
    """Schedule names as registered (case and spaces aside, each once, in order), at least one;
    an unknown one is refused naming the registered ones (``extra``: other names taken, such as
    ``run``'s ``all``)."""
    from overlap_lab.shared.schedules import SCHEDULES

    choices = ", ".join(SCHEDULES)
    out = list(dict.fromkeys(n.strip().lower() for n in names if n.strip()))
    if not out:
        raise ConfigError(
            f"schedules needs at least one schedule, from {choices}", names=("schedules",)
        )
    for n in out:
        if n not in SCHEDULES and n not in extra:
            raise ConfigError(f"unknown schedule {n!r}; choose from {choices}")
    return out


def check_stages(schedule: str, w: Any, pp_size: int | None) -> None:
    """A ``pp_size`` given is run as given: where ``schedule``'s workload defaults would replace
    it (``shared.schedules.prepare_workload``: pp's stages for ``pp_size`` 1), it is refused;
    None (not given): the schedule's default applies (said in the run's notes)."""
    from overlap_lab.shared.schedules import prepare_workload

    if pp_size is None:
        return
    ready, notes = prepare_workload(schedule, w)
    if ready.parallel.pp != w.parallel.pp:
        raise ConfigError(
            f"{schedule} does not run pp_size {pp_size}; leave pp_size out for "
            f"{'; '.join(notes) or f'{ready.parallel.pp} stages'}",
            names=("pp_size",),
        )
