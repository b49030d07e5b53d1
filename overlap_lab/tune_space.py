"""What ``overlap-lab tune`` searches: the deployment, the search space and one configuration of
it, each as a record, and how a configuration becomes a simulation (docs/tune.md).

The space is learnt, never listed by schedule name: the schedules are the registry's; each
schedule's knobs and the values worth trying are its module's knob records (``Knob.tune``: the
knobs every schedule reads, its own ``Knobs``, and the GPU record's deployment fields, DeepEP's
normal kernels' release and SMs); the layouts are every EP size that divides the model's
experts and the GPUs (with pipeline stages for a schedule that runs them,
``shared.schedules.supports_pp``); multi-token prediction where the model has a module and the
schedule runs it (its Program has the module's ops).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from overlap_lab.shared import schedules as registry
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import GPU, gpu_fields
from overlap_lab.shared.inputs.knobs import Knob
from overlap_lab.shared.inputs.workload import ModelConfig
from overlap_lab.shared.schedules import ScheduleConfig
from overlap_lab.simcase import SimCase

#: Sequences per GPU a decode search tries, and prompts per GPU a prefill search tries.
DECODE_BATCHES = (8, 16, 32, 48, 64, 96, 128, 160, 192, 256)
PREFILL_BATCHES = (1, 2, 3, 4, 6, 8)
#: Pipeline stages a schedule that runs them is tried with.
PP_STAGES = (2, 4)
#: MTP draft tokens per step tried where the model has a module (0: off, always tried):
#: DeepSeek-V3 has one module, and LightLLM runs one step with it.
MTP_DRAFTS = (1,)
#: DeepSeek-V3's report: 85-90 % of the second token's predictions are accepted; taken per
#: draft position, a chain (the k-th draft counts only if the k-1 before it were accepted).
MTP_ACCEPT = 0.85


@dataclass(frozen=True)
class Deployment:
    """What is tuned: a model on ``gpus`` GPUs (``gpus_per_node`` a node) of one kind, in one
    phase (``mode``), each sequence of a decode batch holding ``kv_len`` tokens and each prompt
    of a prefill batch ``extend_len``; ``layers`` cuts the model (tests, quick looks);
    ``profile`` as ``simulate`` takes it; ``mtp_accept``: the share of draft tokens accepted,
    per position (what multi-token prediction's throughput counts)."""

    model: ModelConfig
    gpu: GPU
    gpus: int
    mode: str = "decode"
    gpus_per_node: int = 8
    kv_len: int = 4096
    extend_len: int = 4096
    layers: int | None = None
    profile: Any = "auto"
    mtp_accept: float = MTP_ACCEPT

    def __post_init__(self) -> None:
        if self.mode not in ("decode", "prefill"):
            raise ConfigError(f"tune: mode must be decode or prefill, got {self.mode!r}")
        if self.gpus < 1:
            raise ConfigError(f"tune: --gpus must be at least 1, got {self.gpus}")
        if not 0.0 <= self.mtp_accept <= 1.0:
            raise ConfigError(f"tune: --mtp-accept must lie in 0..1, got {self.mtp_accept}")


@dataclass(frozen=True)
class Setting:
    """One configuration without its batch: a schedule, its layout (``ep`` ranks, ``pp``
    stages), the MTP draft tokens per step, and the knobs it sets away from their defaults,
    each ``(name, value)`` in name order: schedule knobs (``knobs``, those every schedule reads
    included) and GPU record fields (``gpu``)."""

    schedule: str
    ep: int
    pp: int = 1
    drafts: int = 0
    knobs: tuple[tuple[str, Any], ...] = ()
    gpu: tuple[tuple[str, Any], ...] = ()

    def with_value(self, name: str, value: Any, default: Any, on_gpu: bool) -> Setting:
        """This setting with knob ``name`` at ``value`` (dropped where it is the default)."""
        if name == "drafts":
            return dataclasses.replace(self, drafts=value)
        which = "gpu" if on_gpu else "knobs"
        kept = {k: v for k, v in getattr(self, which) if k != name}
        if value != default:
            kept[name] = value
        return dataclasses.replace(self, **{which: tuple(sorted(kept.items()))})

    def value(self, name: str, default: Any = None) -> Any:
        if name == "drafts":
            return self.drafts
        return dict(self.knobs + self.gpu).get(name, default)

    @property
    def layout(self) -> str:
        return f"EP{self.ep}" + (f"xPP{self.pp}" if self.pp > 1 else "")

    def describe(self) -> str:
        """The knobs set, as ``name=value`` (``-``: every knob at its default)."""
        parts = [f"{k}={v}" for k, v in self.knobs + self.gpu]
        if self.drafts:
            parts.append(f"mtp_drafts={self.drafts}")
        return " ".join(parts) or "-"

    def label(self) -> str:
        return f"{self.schedule} {self.layout} {self.describe()}".replace(" -", "")


@dataclass(frozen=True)
class Dim:
    """One knob the search varies for a schedule: its name, default and the values it tries,
    and whether it is a field of the GPU record (``on_gpu``)."""

    name: str
    default: Any
    values: tuple[Any, ...]
    on_gpu: bool = False

    @property
    def numeric(self) -> bool:
        return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in self.values)


@dataclass(frozen=True)
class Space:
    """Where the search looks: ``schedules`` (None: every registered one), the ``batches``
    (sequences per GPU in decode, prompts per GPU in prefill; None: the phase's defaults),
    ``ep`` sizes (None: every one that divides the experts and the GPUs), ``pp`` stages of
    schedules that run them, MTP ``drafts``, and ``values``: knob name -> the values to try,
    replacing what the knob records say (an empty tuple: leave the knob at its default)."""

    schedules: tuple[str, ...] | None = None
    batches: tuple[int, ...] | None = None
    ep: tuple[int, ...] | None = None
    pp: tuple[int, ...] = PP_STAGES
    drafts: tuple[int, ...] = MTP_DRAFTS
    values: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for b in self.batches or ():
            if b < 1:
                raise ConfigError(f"tune: batches must be positive, got {b}")
        for n in self.schedules or ():
            if n not in registry.SCHEDULES:
                raise ConfigError(
                    f"tune: unknown schedule {n!r}; choose from {', '.join(registry.SCHEDULES)}"
                )
        known = set(tunable_knobs()) | {k.name for k in _gpu_dims()} | {"drafts"}
        for n in self.values:
            if n not in known:
                raise ConfigError(
                    f"tune: {n!r} is no knob the search varies; knobs: {', '.join(sorted(known))}"
                )


# ---- what the knob records say -----------------------------------------------------------------


@functools.cache
def tunable_knobs() -> dict[str, Knob]:
    """Every schedule knob some registered schedule declares with values to try (``tune``):
    those every schedule reads, then each schedule's own, by name (the columns of a tune's
    results file)."""
    out = {k.name: k for k in registry.common_knobs() if k.tune}
    for name in registry.REGISTRY.usable():
        try:
            records = registry.own_knobs(name)
        except ConfigError:
            continue
        for k in records:
            if k.tune and k.name not in out:
                out[k.name] = k
    return out


#: How ``--try`` spells a boolean knob's values (as every boolean option: ``cli.options._bool``)
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _scalar(kind: type, text: str) -> Any:
    """One value of a knob, as its record types it (ValueError for one it cannot be)."""
    if kind is bool:
        if text.lower() not in _TRUE + _FALSE:
            raise ValueError(text)
        return text.lower() in _TRUE
    return kind(text) if kind in (int, float) else text


def parse_tries(items: Sequence[str]) -> dict[str, tuple[Any, ...]]:
    """``KNOB=V1,V2`` items (``overlap-lab tune --try``): each knob's values to try, parsed and
    checked by its record (``KNOB=`` holds it at its default); ``mtp_drafts``/``drafts``: the
    MTP draft counts (:attr:`Space.drafts`). A knob the search does not vary is refused, naming
    those it does."""
    records = {**tunable_knobs(), **{k.name: k for k in _gpu_dims()}}
    out: dict[str, tuple[Any, ...]] = {}
    for item in items:
        name, eq, text = item.partition("=")
        name = name.strip().replace("-", "_")
        if not eq:
            raise ConfigError(f"--try takes KNOB=V1,V2, got {item!r}")
        values = [v.strip() for v in text.split(",") if v.strip()]
        if name in ("mtp_drafts", "drafts"):
            try:
                out["drafts"] = tuple(int(v) for v in values)
            except ValueError:
                raise ConfigError(f"--try {name}: integers, got {text!r}") from None
            continue
        if name not in records:
            raise ConfigError(
                f"--try: {name!r} is no knob the search varies; knobs: {', '.join(records)}"
            )
        k = records[name]
        try:
            vals = tuple(_scalar(k.scalar, v) for v in values)
        except ValueError:
            raise ConfigError(f"--try {name}: {k.expects()}, got {text!r}") from None
        for v in vals:
            why = k.refusal(v)
            if why:
                raise ConfigError(f"--try {name} {why}")
        out[name] = vals
    return out


def _gpu_dims() -> tuple[Knob, ...]:
    """The GPU record's deployment fields: DeepEP's normal kernels' release and SMs."""
    return tuple(k for k in gpu_fields() if k.tune)


def dims(d: Deployment, space: Space, schedule: str, deepep_normal: bool) -> tuple[Dim, ...]:
    """The knobs the search varies for ``schedule``: each knob it reads that has values to try
    (``space.values`` first, else the knob's record), the GPU's deployment fields where DeepEP's
    normal kernels run (``deepep_normal``), MTP drafts where the model and the schedule run
    them. Values equal to the default are left out (the default is always tried), and so are
    values of a knob every schedule reads that this schedule always refuses (:func:`refusal`:
    lightllm's and deepseek's DeepEP mode is the phase's)."""
    out = []
    own = {k.name: k for k in registry.own_knobs(schedule)}
    common = {k.name for k in registry.common_knobs()}
    for k in (*registry.common_knobs(), *own.values()):
        values = space.values.get(k.name, k.tune)
        default = k.default
        if k.name == "deepep_mode":  # auto is one of the two: its twin is no new value
            default = ScheduleConfig().resolved_deepep_mode(d.mode)
        vals = tuple(v for v in dict.fromkeys(values) if v != default)
        if (
            k.name in common
        ):  # a knob every schedule reads: a value this one never runs is not tried
            vals = tuple(v for v in vals if refusal(d, schedule, k.name, v) is None)
        if vals:
            out.append(Dim(k.name, k.default, vals))
    if deepep_normal:
        for k in _gpu_dims():
            base = getattr(d.gpu, k.name)
            vals = tuple(v for v in dict.fromkeys(space.values.get(k.name, k.tune)) if v != base)
            if vals:
                out.append(Dim(k.name, base, vals, on_gpu=True))
    drafts = tuple(n for n in space.values.get("drafts", space.drafts) if n > 0)
    if drafts and d.mode == "decode" and d.model.mtp > 0 and runs_mtp(d, schedule):
        out.append(Dim("drafts", 0, drafts))
    return tuple(out)


def refusal(d: Deployment, schedule: str, name: str, value: Any) -> str | None:
    """Why ``schedule`` refuses knob ``name`` at ``value`` in ``d``'s phase whatever the batch
    and layout (None: it runs it), asked up front as the sweep's checks are: its build of a small
    workload of the deployment's own model (cut to two layers) on its own GPU refuses the value
    where it builds the default (lightllm and deepseek run DeepEP's low-latency kernels in decode
    and the normal ones in prefill, nothing else; a schedule may refuse by model or GPU too)."""
    return _refusal(schedule, d.model, d.gpu, d.mode, _probe_ep(d), name, value)


def _probe_ep(d: Deployment) -> int:
    """The EP size a refusal is asked at: the largest within one node that divides the model's
    experts and the GPUs (a layout the search tries)."""
    top = min(d.gpus, d.gpus_per_node)
    return max(e for e in range(1, top + 1) if d.model.num_experts % e == 0 and d.gpus % e == 0)


def _probe(model: ModelConfig, mode: str, ep: int, **kw: Any):
    """A two-layer workload of ``model`` in ``mode`` at EP ``ep``, a small batch: what
    :func:`refusal` and :func:`runs_mtp` build a schedule's Program of (no simulation)."""
    from overlap_lab import api

    batch = dict(batch=8) if mode == "decode" else dict(batch=1, extend_len=256)
    return api.workload(model, mode=mode, ep=ep, layers=2, **batch, **kw)


@functools.cache
def _refusal(
    schedule: str, model: ModelConfig, gpu: GPU, mode: str, ep: int, name: str, value: Any
) -> str | None:
    w, _ = registry.prepare_workload(schedule, _probe(model, mode, ep))

    def why(knobs: dict[str, Any]) -> str | None:
        try:
            registry.build(schedule, w, gpu, ScheduleConfig(**knobs))
        except ConfigError as e:
            return str(e)
        return None

    return None if why({}) is not None else why({name: value})


def runs_mtp(d: Deployment, schedule: str) -> bool:
    """Whether ``schedule`` runs ``d``'s model's MTP module in a decode step with draft tokens:
    its Program for the model cut to two layers, on the deployment's GPU, has the module's ops
    (``mtp.*``)."""
    return _runs_mtp(schedule, d.model, d.gpu, _probe_ep(d))


@functools.cache
def _runs_mtp(schedule: str, model: ModelConfig, gpu: GPU, ep: int) -> bool:
    from overlap_lab.shared.ir.program import ops_of

    try:
        w, _ = registry.prepare_workload(schedule, _probe(model, "decode", ep, mtp=1))
        program = registry.build(schedule, w, gpu, ScheduleConfig())
    except ConfigError:
        return False
    return any(op.name.startswith("mtp.") for _, op in ops_of(program))


def deepep_normal(d: Deployment, setting: Setting) -> bool:
    """Whether DeepEP's normal kernels run in ``setting`` (its DeepEP mode, resolved)."""
    mode = setting.value("deepep_mode", "auto")
    return ScheduleConfig(deepep_mode=mode).resolved_deepep_mode(d.mode) == "normal"


def layouts(d: Deployment, space: Space, schedule: str) -> tuple[tuple[int, int], ...]:
    """(EP size, pipeline stages) of one instance: EP divides the model's experts and, with the
    stages, the GPUs (the rest are copies); EP across nodes is whole nodes. Stages only for a
    schedule that runs them (and then always more than one)."""
    staged = registry.supports_pp(schedule)
    stages = tuple(p for p in space.pp if p > 1) if staged else (1,)
    out = []
    for ep in space.ep or range(1, d.gpus + 1):
        if d.model.num_experts % ep or (ep > d.gpus_per_node and ep % d.gpus_per_node):
            continue
        for pp in stages:
            if d.gpus % (ep * pp) == 0 and pp <= (d.layers or d.model.num_layers):
                out.append((ep, pp))
    return tuple(out)


def batches(d: Deployment, space: Space) -> tuple[int, ...]:
    return tuple(
        sorted(set(space.batches or (DECODE_BATCHES if d.mode == "decode" else PREFILL_BATCHES)))
    )


# ---- a configuration as a simulation -----------------------------------------------------------


def columns() -> tuple[str, ...]:
    """The knob columns of a tune's results file (a sweep CSV: ``overlap_lab.sweep``)."""
    return ("schedule", "batch", "ep", "pp", "tokens_per_seq", *tunable_knobs(),
            *(k.name for k in _gpu_dims()))  # fmt: skip


def case_of(setting: Setting, batch: int) -> dict[str, Any]:
    """The results file's knob columns of ``setting`` at ``batch`` (None: the default)."""
    row: dict[str, Any] = dict.fromkeys(columns())
    row.update(schedule=setting.schedule, batch=batch, ep=setting.ep, pp=setting.pp)
    row["tokens_per_seq"] = 1 + setting.drafts
    row.update(dict(setting.knobs + setting.gpu))
    return row


def workload_of(d: Deployment, ep: int, pp: int, batch: int, tokens_per_seq: int = 1):
    from overlap_lab import api

    return api.workload(
        d.model,
        mode=d.mode,
        batch=batch,
        kv_len=d.kv_len,
        extend_len=d.extend_len,
        tokens_per_seq=tokens_per_seq if d.mode == "decode" else 1,
        layers=d.layers,
        ep=ep,
        pp=pp,
        gpus_per_node=d.gpus_per_node,
    )


@dataclass(frozen=True)
class CaseParser:
    """A results-file row's knobs as the simulation they name (what the sweep's workers call:
    a frozen record, so it pickles for Ray). DeepEP's normal kernels run without CUDA graphs,
    as SGLang forces (``server_args.py``: "Cuda graph is disabled because deepep_mode=`normal`";
    their dispatch waits on the host for its received-token counts)."""

    deployment: Deployment

    def checked(self, knobs: Mapping[str, Any]) -> tuple[Any, GPU, ScheduleConfig]:
        """The row's workload, GPU and ScheduleConfig, its memory checked (``fits``)."""
        from overlap_lab.checks import check_memory

        w, g, cfg = self.inputs(knobs)
        check_memory(w, g, allow=False, schedule=str(knobs["schedule"]), cfg=cfg)
        return w, g, cfg

    def inputs(self, knobs: Mapping[str, Any]) -> tuple[Any, GPU, ScheduleConfig]:
        """The row's workload, GPU and ScheduleConfig."""
        from overlap_lab import api

        d = self.deployment
        tune = tunable_knobs()
        own = {k: v for k, v in knobs.items() if k in tune and v is not None}
        gpu_set = {k.name: knobs[k.name] for k in _gpu_dims() if knobs.get(k.name) is not None}
        g = api.gpu(d.gpu, **gpu_set)
        w = workload_of(d, int(knobs["ep"]), int(knobs["pp"]), int(knobs["batch"]),
                        int(knobs["tokens_per_seq"]))  # fmt: skip
        cfg = ScheduleConfig(**own)
        if cfg.resolved_deepep_mode(d.mode) == "normal" and cfg.cuda_graph is None:
            cfg = ScheduleConfig(cuda_graph=False, **own)  # as SGLang forces: see below
        return w, g, cfg

    def __call__(self, knobs: Mapping[str, Any]) -> SimCase:
        from overlap_lab import api

        w, g, cfg = self.checked(knobs)
        return SimCase(
            str(knobs["schedule"]),
            w,
            g,
            cfg,
            api.Ranks(),
            api.resolve_profile(self.deployment.profile, g),
        )


def latency_iterations(d: Deployment, setting: Setting, batch: int) -> int:
    """Iterations of ``setting``'s window a sequence waits between two of its tokens (a prompt,
    its prefill step): its schedule's ``latency_iterations`` (pp: every micro-batch in flight
    on every stage; one-batch schedules: one). Times ms per iteration, what a target bounds."""
    w, _, cfg = CaseParser(d).inputs(case_of(setting, batch))
    w, _ = registry.prepare_workload(setting.schedule, w)
    return registry.latency_iterations(setting.schedule, w, cfg)


def fits(d: Deployment, setting: Setting, batch: int) -> bool:
    """Whether the model's share and the KV cache of every batch ``setting`` holds at once
    (pp's micro-batches) fit in the GPU's memory, as the simulation checks it."""
    try:
        CaseParser(d).checked(case_of(setting, batch))
    except ConfigError:
        return False
    return True


def space_size(d: Deployment, space: Space, names: Sequence[str]) -> int:
    """Configurations in the space (every knob value crossed with every other, every layout and
    batch): what a brute-force search would simulate."""
    total = 0
    nb = len(batches(d, space))
    for s in names:
        n_layouts = len(layouts(d, space, s))
        combos = 1
        normal = 1
        for dim in dims(d, space, s, deepep_normal=True):
            combos *= len(dim.values) + 1
            if not dim.on_gpu:
                normal *= len(dim.values) + 1
        total += n_layouts * nb * max(combos, normal)
    return total
