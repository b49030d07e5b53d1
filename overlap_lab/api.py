"""The public Python API: build a workload, simulate one schedule, compare several.

The command line (``overlap-lab``), the experiment runner and the tests all go through these
functions, so a notebook gets exactly what the CLI prints::

    import overlap_lab as ol

    w = ol.workload("deepseek-v3", mode="decode", batch=128, ep=32)
    r = ol.simulate("tbo", w, gpu="h800")
    r.metrics.iteration_us, r.metrics.tokens_per_s_gpu
    table = ol.compare(["serial", "tbo", "sbo"], w, gpu="h800")
    print(table.text())

A model or GPU is a preset name, a record (:class:`ModelConfig`, :class:`GPU`) or the path of a
YAML/JSON file (a HuggingFace ``config.json`` for models); see :mod:`overlap_lab.shared.inputs.presets`.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from overlap_lab.checks import check_overrides, verify_tokens
from overlap_lab.limits import check_values
from overlap_lab.metrics import Metrics, measure
from overlap_lab.shared import schedules as registry
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.inputs.presets import load_gpu, load_model
from overlap_lab.shared.inputs.workload import Batch, ModelConfig, Parallel, Workload, with_layers
from overlap_lab.shared.ir.deepep import below_published_sms
from overlap_lab.shared.ir.program import Program, num_ops, ops_of
from overlap_lab.shared.ir.validate import check_build_budget
from overlap_lab.shared.outputs.trace import Trace, no_gc
from overlap_lab.shared.schedules import BASELINE, SCHEDULES, ScheduleConfig
from overlap_lab.shared.schedules import build as build_schedule
from overlap_lab.shared.schedules import module as schedule_module
from overlap_lab.shared.schedules.fallbacks import fallback_notes

if TYPE_CHECKING:
    from overlap_lab.sim.models import CostModel, NetworkFactory

__all__ = [
    "CompareRow",
    "Comparison",
    "Result",
    "compare",
    "gpu",
    "model",
    "resolve_profile",
    "simulate",
    "simulate_explicit",
    "workload",
]

#: Sequences per GPU when none are given.
DEFAULT_BATCH = {"decode": 128, "prefill": 4}
#: Network grouping tolerance for explicit ranks (sim.network: completions within 2 % of the
#: flows' age are handled together; exact for balanced routing, where all flows end together).
NET_GROUP_TOL = 0.02


def __getattr__(name: str) -> Any:
    """``DEFAULT_COMPARE``: every registered schedule, what :func:`compare` runs when none are
    named (as ``overlap-lab compare``), computed when read so that a schedule installed later
    is in it."""
    if name == "DEFAULT_COMPARE":
        return tuple(SCHEDULES)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------------------------
# Inputs


def model(
    spec: str | Path | ModelConfig, *, layers: int | None = None, **overrides: Any
) -> ModelConfig:
    """A model: a preset name, a :class:`ModelConfig`, or a YAML/JSON/HF ``config.json`` path;
    ``overrides`` replace fields; ``layers`` keeps that many (one dense layer first, rest MoE)."""
    m = spec if isinstance(spec, ModelConfig) else load_model(spec)
    if overrides:
        known = {f.name for f in dataclasses.fields(ModelConfig)}
        bad = sorted(set(overrides) - known)
        if bad:
            raise ConfigError(
                f"unknown model field {bad[0]!r}; fields are {', '.join(sorted(known))}"
            )
        m = replace(m, **overrides)
    return with_layers(m, layers)


def gpu(spec: str | Path | GPU = "h800", **overrides: Any) -> GPU:
    """A GPU: a preset name, a :class:`GPU`, or a YAML/JSON file; ``overrides`` replace fields.

    Overridden hardware carries its own name, e.g. ``h800+hbm-gbps=2000``, so that no output
    labels a changed GPU with the preset's name."""
    g = spec if isinstance(spec, GPU) else load_gpu(spec)
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if not overrides:
        return g
    known = {f.name for f in dataclasses.fields(GPU)} - {"name"}
    bad = sorted(set(overrides) - known)
    if bad:
        raise ConfigError(f"unknown gpu field {bad[0]!r}; fields are {', '.join(sorted(known))}")
    check_overrides(overrides)  # the fields' ranges, as the command line's options check them
    for link in ("nvlink", "rdma"):  # as the command line: DeepEP's rate follows the line rate
        nominal, eff = overrides.get(f"{link}_gbps"), f"{link}_eff_gbps"
        if nominal is not None and eff not in overrides and getattr(g, eff) > 0:
            overrides[eff] = getattr(g, eff) * nominal / getattr(g, f"{link}_gbps")
    changed = {k: v for k, v in overrides.items() if getattr(g, k) != v}
    if not changed:
        return g
    tag = ",".join(f"{k.replace('_', '-')}={_fmt(v)}" for k, v in sorted(changed.items()))
    return replace(g, name=f"{g.name}+{tag}", **changed)


def _fmt(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def workload(
    model_spec: str | Path | ModelConfig = "deepseek-v3",
    *,
    mode: str = "decode",
    batch: int | None = None,
    kv_len: int = 4096,
    kv_lens: Sequence[int] | None = None,
    tokens_per_seq: int | None = None,
    extend_len: int = 4096,
    extend_lens: Sequence[int] | None = None,
    prefix_len: int = 0,
    prefix_lens: Sequence[int] | None = None,
    layers: int | None = None,
    mtp: int | None = None,
    ep: int = 32,
    gpus_per_node: int = 8,
    attn_tp: int = 1,
    dp_attention: bool = True,
    pp: int = 1,
) -> Workload:
    """One rank's workload: the model, its batch (``batch`` sequences per GPU) and the layout.

    Decode: ``batch`` sequences of ``kv_len`` cached tokens (or explicit ``kv_lens``), each
    computing ``tokens_per_seq`` tokens. Prefill: ``batch`` sequences of ``extend_len`` new
    tokens over ``prefix_len`` cached ones (or explicit ``extend_lens``/``prefix_lens``).
    ``mtp``: MTP draft steps per decode step, each a run of the model's MTP module; the step
    then verifies ``mtp + 1`` tokens per sequence (``checks.verify_tokens``). None: the model's
    own module drafts ``tokens_per_seq - 1`` tokens (default 1: no drafts); 0: no MTP."""
    mode = str(mode).lower()  # as the command line: names are case-insensitive
    if mode not in ("decode", "prefill"):
        raise ConfigError(f"mode must be decode or prefill, got {mode!r}", names=("mode",))
    given = dict(batch=batch, kv_len=kv_len, kv_lens=kv_lens, tokens_per_seq=tokens_per_seq,
                 extend_len=extend_len, extend_lens=extend_lens, prefix_len=prefix_len,
                 prefix_lens=prefix_lens, layers=layers, mtp=mtp, ep=ep,
                 gpus_per_node=gpus_per_node, attn_tp=attn_tp, pp=pp)  # fmt: skip
    check_values(given, {"pp": "pp_size"})  # the ranges the command line's options check
    m = model(model_spec, layers=layers)
    tokens_per_seq = verify_tokens(mtp, tokens_per_seq, mode)
    if mtp is not None and (mtp == 0) != (m.mtp == 0):  # off, or a module where it has none
        m = replace(m, mtp=min(mtp, 1))
    if mode == "decode":
        if kv_lens is not None:
            b = Batch.decode(batch, kv_lens=kv_lens, tokens_per_seq=tokens_per_seq)
        else:
            b = Batch.decode(
                batch or DEFAULT_BATCH["decode"], kv_len=kv_len, tokens_per_seq=tokens_per_seq
            )
    elif extend_lens is not None:
        b = Batch.prefill(batch, extend_lens=extend_lens, prefix_lens=prefix_lens)
    else:
        b = Batch.prefill(
            batch or DEFAULT_BATCH["prefill"], extend_len=extend_len, prefix_len=prefix_len
        )
    par = Parallel(
        ep=ep, gpus_per_node=gpus_per_node, dp_attention=dp_attention, attn_tp=attn_tp, pp=pp
    )
    return Workload(m, b, par)


_workload, _gpu = workload, gpu  # for the functions whose parameters shadow these names


def default_stages() -> dict[str, int]:
    """The pipeline stages each schedule runs by default where its workload defaults set them
    (``shared.schedules.prepare_workload`` on a one-stage workload: pp's two)."""
    out = {}
    for name in registry.pipeline_schedules():
        staged, _ = registry.prepare_workload(name, workload())
        if staged.parallel.pp != 1:
            out[name] = staged.parallel.pp
    return out


@dataclass(frozen=True)
class Ranks:
    """How ranks are simulated: one mirrored rank (``symmetric``, fast) or every EP rank
    (``explicit``) with seeded expert-load (``imbalance``: balanced, zipf:S, file:PATH) and DP
    attention (``dp_imbalance`` in [0, 1)) imbalance.

    ``reduce``: explicit ranks that provably cannot differ (``shared.ir.symmetry``: every rank's
    program is rank 0's relabeled, as with balanced routing) are simulated once and the Trace
    copied to every rank; the result is the full run's, without its network grouping tolerance.
    False simulates every rank all the same. ``fast_forward``: likewise for layers, every run:
    once the simulation's state at a layer repeats an earlier layer's, the layers that follow
    are copied rather than simulated (``sim.fastforward``; the same Trace to float round-off,
    said in ``trace.meta["fast_forward"]``); False simulates every layer."""

    mode: str = "symmetric"
    imbalance: str = "balanced"
    dp_imbalance: float = 0.0
    group_limited: bool | None = None
    seed: int = 0
    reduce: bool = True
    fast_forward: bool = True

    def __post_init__(self) -> None:
        from overlap_lab.shared.inputs.routing import parse_imbalance

        names = ("imbalance", "dp_imbalance", "ranks")
        if self.mode not in ("symmetric", "explicit"):
            raise ConfigError(
                f"ranks must be symmetric or explicit, got {self.mode!r}", names=names
            )
        if not 0.0 <= self.dp_imbalance < 1.0:
            raise ConfigError(
                f"dp_imbalance must lie in [0, 1), got {self.dp_imbalance}", names=names
            )
        skewed = parse_imbalance(self.imbalance).kind != "balanced" or self.dp_imbalance > 0
        if skewed and self.mode == "symmetric":  # refused when the record is made: before a run
            raise ConfigError("imbalance and dp_imbalance need ranks explicit", names=names)


# ---------------------------------------------------------------------------------------------
# One run


@dataclass(frozen=True)
class Result:
    """One simulated schedule: its inputs as run, the Program, the Trace and the Metrics.

    ``notes`` say what the run changed or fell back to (the schedule's workload defaults, such as
    pp's stage count, and every fallback the schedule recorded: ``shared.schedules.fallbacks``),
    in words a table can print."""

    schedule: str
    workload: Workload
    gpu: GPU
    config: ScheduleConfig
    program: Program
    trace: Trace
    metrics: Metrics
    notes: tuple[str, ...] = ()
    balanced_window_us: float | None = None  # explicit ranks: the same run with balanced routing
    profile: Any = None  # the calibration profile op durations came from (None: roofline alone)
    cost_model: Any = None  # the cost model as given: a name, an object, None (roofline)

    @property
    def fallback_reason(self) -> str | None:
        return self.program.meta.fallback_reason

    def as_dict(self) -> dict[str, Any]:
        """The JSON ``overlap-lab sim --json`` prints (keys listed in docs/metrics.md)."""
        with no_gc():  # it walks every rank's ops and spans (see shared.outputs.trace.no_gc)
            return self._as_dict()

    def _as_dict(self) -> dict[str, Any]:
        w, meta, m = self.workload, self.program.meta, self.metrics
        # per iteration, as every time without "window" in its name (docs/metrics.md)
        busy = {k: v / m.iterations for k, v in self.trace.busy_us().items()}
        out: dict[str, Any] = {
            "schedule": self.schedule,
            "model": w.model.label,  # a cut model says so: deepseek-v3[8 of 61 layers]
            "layers": w.model.num_layers,
            "model_layers_total": w.model.layers_total or w.model.num_layers,
            "gpu": self.gpu.name,
            "mode": w.batch.mode,
            "batch": w.batch.num_seqs,
            "tokens": w.batch.num_tokens,
            **_layout(w),
            **m.as_dict(),
            "step_time_us": m.iteration_us,  # step time = time per iteration, every schedule
            "busy_us": busy,
            "micro_batches": meta.micro_batches or [],
            "num_ops": num_ops(self.program),
            "notes": list(self.notes),
        }
        for key in (
            "comm_sms",
            "fallback_reason",
            "deepep_mode",
            "ranks",
            "imbalance",
            "dp_tokens",
        ):
            if meta.reported(key):
                out[key] = getattr(meta, key)
        if not self.program.symmetric and meta.ranks == "explicit":
            out["per_rank"] = self._per_rank(busy)
            if "reduction" in self.trace.meta:  # simulated once for all ranks, or why not
                out["reduction"] = self.trace.meta["reduction"]
        if "fast_forward" in self.trace.meta:  # layers copied rather than simulated, or why not
            out["fast_forward"] = self.trace.meta["fast_forward"]
        if self.balanced_window_us is not None:
            out["balanced_window_us"] = self.balanced_window_us
            out["straggler_cost_window_us"] = m.window_us - self.balanced_window_us
            out["straggler_cost_us"] = out["straggler_cost_window_us"] / m.iterations
        report = getattr(schedule_module(self.schedule), "report", None)
        if report is not None:  # its totals over the window say so, as every key here does
            rep = report(self.trace, self.program)
            out["report"] = {
                (f"{k[:-3]}_window_us" if k in _REPORT_WINDOW_TOTALS else k): v
                for k, v in rep.items()
            }
        self._provenance(out)
        return out

    def _per_rank(self, busy: dict[str, float]) -> list[dict[str, Any]]:
        """Each rank's window and link busy times (``busy``: :meth:`Trace.busy_us` of all)."""
        per_rank = self.trace.per_rank_step_us()
        links: dict[int, dict[str, float]] = {r: {} for r in per_rank}
        one = len(per_rank) == 1  # busy_us keys are bare lanes then
        for key, v in busy.items():
            r, lane = (next(iter(per_rank)), key) if one else key[1:].split("/", 1)
            if lane.startswith("link:"):
                links[int(r)][lane.split(":", 1)[1]] = v
        return [{"rank": r, "window_us": per_rank[r], "link_busy_us": links[r]} for r in per_rank]

    def _provenance(self, out: dict[str, Any]) -> None:
        """``profile`` and ``cost_sources`` (``sim.calibrate.add_provenance``'s keys); a reduced
        run's ranks hold rank 0's ops (only flow destinations differ, which no duration source
        reads): rank 0's counts times the ranks."""
        from overlap_lab.caveats import result_caveats
        from overlap_lab.sim.calibrate import cost_sources, profile_name
        from overlap_lab.sources import cost_share

        p = self.program
        one = _one_of_alike(p, self.trace)
        out["profile"] = profile_name(self.profile)
        out["cost_sources"] = cost_sources(one, self.gpu, self.profile, self.cost_model)
        out["cost_share"] = cost_share(self)  # of rank 0's kernel time, by source
        out["caveats"] = [c.line() for c in result_caveats(self)]
        dropped = None if self.profile is None else self.profile.for_gpu(self.gpu)[1]
        if dropped and dropped not in out.setdefault("notes", []):
            out["notes"].append(dropped)  # which measured rows the GPU's overrides invalidate
        if one is not p:
            n = len(p.ranks)
            out["cost_sources"] = {
                c: {src: k * n for src, k in by.items()} for c, by in out["cost_sources"].items()
            }


#: Keys of a schedule's own ``report`` (sglang-overlap's) that sum over the whole window: in the
#: JSON they are named ``*_window_us`` (the rest are per iteration or per event)
_REPORT_WINDOW_TOTALS = frozenset({"total_us", "gpu_idle_us", "forward_gap_us", "host_blocked_us"})


def _one_of_alike(program: Program, trace: Trace) -> Program:
    """Rank 0 alone when ``trace`` is a reduced run of ``program`` (its ranks hold the same ops
    but for flow destinations: ``shared.ir.symmetry``), else ``program``: what per-op summaries
    (op classes, duration sources) need to read."""
    if str(trace.meta.get("reduction", "")).startswith("reduced"):
        return replace(program, ranks=program.ranks[:1])
    return program


def _as_config(config: ScheduleConfig | Mapping[str, Any] | None) -> ScheduleConfig:
    if config is None:
        return ScheduleConfig()
    if isinstance(config, ScheduleConfig):
        return config
    return ScheduleConfig(**dict(config))


def _layout(w: Workload) -> dict[str, int]:
    """The parallel layout as results name it: EP size and pipeline stages."""
    return dict(ep=w.parallel.ep, pp=w.parallel.pp)


def _with_pp(w: Workload, pp: int) -> Workload:
    return replace(w, parallel=replace(w.parallel, pp=pp))


def simulate(
    schedule: str = BASELINE,
    workload: Workload | None = None,
    gpu: str | Path | GPU = "h800",
    config: ScheduleConfig | Mapping[str, Any] | None = None,
    *,
    ranks: Ranks | str = "symmetric",
    imbalance: str = "balanced",
    dp_imbalance: float = 0.0,
    group_limited: bool | None = None,
    seed: int = 0,
    reduce: bool = True,
    fast_forward: bool = True,
    profile: Any = "auto",
    max_events: int | None = None,
    transform: Callable[[Program], Program] | None = None,
    cost_model: CostModel | str | None = None,
    network: NetworkFactory | str | None = None,
) -> Result:
    """Build ``schedule``'s Program for ``workload`` on ``gpu``, validate it and simulate it.

    The schedule's workload defaults apply first (``shared.schedules.prepare_workload``: ``pp``
    on a workload without pipeline stages runs two stages of the workload's EP size), each said
    in ``notes``. ``ranks="explicit"`` simulates every EP rank, with
    the given routing and DP imbalance; its Result also carries the balanced run's window, so the
    straggler cost is ``window_us - balanced_window_us``; ranks that cannot differ (balanced
    routing) are simulated once unless ``reduce`` is False, and repeated layers once unless
    ``fast_forward`` is False (:class:`Ranks`). ``profile`` gives
    op durations measured on a GPU: a ``sim.profile.Profile``, a file, a built-in name
    (``h800-published``), ``roofline``, or ``auto`` (the GPU preset's built-in profile if it has
    one, else roofline).
    ``max_events`` bounds the simulation (default: ``sim.budget``'s, from the Program's size).
    ``transform`` rewrites the schedule's Program before it is lowered and simulated (a what-if:
    e.g. an SM cap on some kernels); the Result carries the rewritten Program.
    ``cost_model`` (what a kernel costs) and ``network`` (what carries explicit ranks' flows):
    names registered in ``overlap_lab.cost_models`` and ``overlap_lab.networks`` (a cost model
    built by name is handed ``profile``), or objects (``sim.models.CostModel``, whose ``profile``
    is then not read, and ``sim.models.NetworkFactory``); None: ``roofline`` and ``max-min``
    (docs/architecture.md, "Plugging in a cost model or a network")."""
    from overlap_lab.sim import simulate as sim_run
    from overlap_lab.sim.engine import SimulationStalled
    from overlap_lab.sim.models import check_model_names

    w = workload if workload is not None else _workload()
    g = _gpu(gpu)
    cfg = _as_config(config)
    r = (
        ranks
        if isinstance(ranks, Ranks)
        else Ranks(ranks, imbalance, dp_imbalance, group_limited, seed, reduce, fast_forward)
    )
    check_model_names(cost_model, network)  # an unknown name fails before the build
    named = cost_model is None or isinstance(cost_model, str)  # built with the profile
    prof = resolve_profile(profile, g) if named else None
    models = {"cost_model": cost_model, "network": network, "fast_forward": r.fast_forward}
    w, changed = registry.prepare_workload(schedule, w)
    notes = list(changed)
    program = build_schedule(schedule, w, g, cfg)
    if transform is not None:
        program = transform(program)
    check_build_budget(program)  # before explicit lowering multiplies it by the ranks
    lowered = lower_ranks(program, w, g, r)
    balanced = None
    try:
        if lowered is program:
            trace = sim_run(program, g, profile=prof, max_events=max_events, **models)
        else:
            trace = simulate_explicit(lowered, w, g, r, prof, max_events, models)
            if _is_balanced(r):
                balanced = trace.step_time_us  # this run is the balanced one
            else:
                balanced = sim_run(program, g, profile=prof, **models).step_time_us
    except SimulationStalled as e:  # validation should have refused it: one line all the same
        raise ConfigError(f"{e} (please report this command)") from None
    # the workload in the trace, for figure titles and exported traces; op classes for colours
    with no_gc():  # every rank's ops and spans walked (see shared.outputs.trace.no_gc)
        trace.meta.update(
            schedule=schedule,
            model=w.model.label,
            mode=w.batch.mode,
            batch=w.batch.num_seqs,
            tokens=w.batch.num_tokens,
            ep=w.parallel.ep,
            pp=w.parallel.pp,
            gpu=g.name,
            op_class={op.name: op.op_class for _, op in ops_of(_one_of_alike(lowered, trace))},
        )
        metrics = measure(trace, lowered, w, g.num_sms)
    notes += fallback_notes(lowered.meta, trace)  # every fallback the schedule recorded
    assumed = below_published_sms(program, g.deepep_release)
    if assumed:
        notes.append(assumed)
    return Result(
        schedule, w, g, cfg, lowered, trace, metrics, tuple(notes), balanced, prof, cost_model
    )


def _is_balanced(r: Ranks) -> bool:
    """Whether explicit ranks ``r`` route as the symmetric Program does (their run is the
    balanced one)."""
    from overlap_lab.shared.inputs.routing import parse_imbalance

    return parse_imbalance(r.imbalance).kind == "balanced" and r.dp_imbalance == 0


def simulate_explicit(
    lowered: Program,
    w: Workload,
    g: GPU,
    r: Ranks,
    prof,
    max_events,
    models: Mapping[str, Any] | None = None,
) -> Trace:
    """Simulate every rank of the explicit ``lowered``: once for all when they cannot differ
    (``shared.ir.symmetry``), else each, with the network's grouping tolerance. ``models``: the
    ``cost_model`` and ``network`` keywords of the run. Public so a sweep simulates a case's
    explicit ranks as :func:`simulate` does."""
    from overlap_lab.shared.ir.symmetry import Reduction, expand_trace, reduce_program
    from overlap_lab.shared.ir.validate import validate
    from overlap_lab.sim import simulate as sim_run
    from overlap_lab.sim.engine import Engine

    models = {**(models or {}), "fast_forward": r.fast_forward}
    red = reduce_program(lowered, w.parallel.gpus_per_node) if r.reduce else "reduce=False"
    if isinstance(red, Reduction):
        quotient = sim_run(
            red.program, g, seed=r.seed, profile=prof, max_events=max_events, **models
        )
        return expand_trace(quotient, red)
    validate(lowered, g.num_sms)  # what is simulated: the explicit Program
    trace = Engine(
        lowered,
        g,
        r.seed,
        net_group_tol=NET_GROUP_TOL,
        profile=prof,
        max_events=max_events,
        **models,
    ).run()
    trace.meta["reduction"] = f"not reduced: {red}"
    return trace


def resolve_profile(spec: Any, gpu: str | GPU):
    """The calibration profile ``spec`` names for ``gpu`` (None: roofline alone); ``auto`` picks
    the built-in profile whose measured configuration the GPU matches, so a renamed copy of a
    preset keeps it. Loaded once per (spec, GPU): a sweep resolves it once for all its cases."""
    from overlap_lab.sim.profile import profile_for

    return profile_for(spec, gpu)


def lower_ranks(program: Program, w: Workload, g: GPU, r: Ranks) -> Program:
    """The Program to simulate: the schedule's symmetric one, or every rank explicit (public: the
    command line shows, the sweep keys and the benchmarks time this same lowered Program)."""
    if r.mode == "symmetric" and r.imbalance == "balanced" and r.dp_imbalance == 0:
        return program  # the common case needs no routing module (a symmetric run draws none)
    from overlap_lab.shared.inputs.routing import dp_token_counts, parse_imbalance, routing_for

    imb = parse_imbalance(r.imbalance)
    if not program.symmetric:  # a pipeline's Program lists its ranks itself
        raise ConfigError(
            f"--ranks explicit does not apply to --schedule {program.meta.schedule} (its Program "
            "lists every rank)"
        )
    from overlap_lab.shared.ir.ranks import expand_ranks

    dp = dp_token_counts(w.batch.num_tokens, w.parallel.ep, r.dp_imbalance, r.seed)
    routing = routing_for(w, imb, seed=r.seed, dp_tokens=dp, group_limited=r.group_limited)
    return expand_ranks(program, w, g, routing)


# ---------------------------------------------------------------------------------------------
# Comparisons


@dataclass(frozen=True)
class CompareRow:
    """One schedule of a comparison. ``result`` is None when the schedule refused the workload
    (``note`` holds its reason). ``speedup`` is throughput per GPU over ``baseline``'s."""

    schedule: str
    result: Result | None
    speedup: float | None
    baseline: str
    note: str

    @property
    def cost_share(self) -> dict[str, float]:
        """The share of rank 0's kernel time timed from each source (profile, roofline, link;
        ``overlap_lab.sources.cost_share``); empty when the schedule refused."""
        from overlap_lab.sources import cost_share

        return {} if self.result is None else cost_share(self.result)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schedule": self.schedule,
            "speedup_vs_serial": self.speedup,  # tokens/s per GPU over the baseline's
            "baseline": self.baseline,
            "note": self.note,
        }
        if self.result is not None:
            out.update(self.result.as_dict())
            out["schedule"] = self.schedule
        return out


@dataclass(frozen=True)
class Comparison:
    """Every schedule of one workload, on equal terms: per-iteration time and throughput per GPU
    (and per node) over the same GPUs; see :func:`compare`."""

    rows: tuple[CompareRow, ...]
    baseline: Result
    #: the knobs every run was given (what each schedule's footnote reads)
    config: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    #: the same comparison over perturbed costs (``compare(..., sensitivity=...)``;
    #: ``overlap_lab.sensitivity.Sensitivity``), or None
    sensitivity: Any = None

    def __getitem__(self, schedule: str) -> CompareRow:
        for row in self.rows:
            if row.schedule == schedule:
                return row
        raise KeyError(schedule)

    def traces(self) -> dict[str, Trace]:
        return {r.schedule: r.result.trace for r in self.rows if r.result is not None}

    def as_dicts(self) -> list[dict[str, Any]]:
        return [r.as_dict() for r in self.rows]

    def caveats(self) -> list[str]:
        """One line per caveat of the comparison (``overlap_lab.caveats``): what a result rests
        on that the model treats roughly, each printed once for the schedules it concerns."""
        from overlap_lab.caveats import comparison_caveats

        return [c.line() for c in comparison_caveats(self)]

    def text(self) -> str:
        """The table ``overlap-lab compare`` prints, with the footnotes that say how
        (``overlap_lab.compare_table``)."""
        from overlap_lab.compare_table import comparison_text

        return comparison_text(self)


def compare(
    schedules: Iterable[str] | None = None,
    workload: Workload | None = None,
    gpu: str | Path | GPU = "h800",
    config: ScheduleConfig | Mapping[str, Any] | None = None,
    *,
    pp_stages: int | None = None,
    progress: bool = False,
    profile: Any = "auto",
    max_events: int | None = None,
    cost_model: CostModel | str | None = None,
    network: NetworkFactory | str | None = None,
    sensitivity: Any = None,
    **ranks: Any,
) -> Comparison:
    """Simulate ``schedules`` (None: every registered one) on one workload and GPU and rank them
    like for like.

    Every schedule is compared by throughput per GPU against serial on the same GPUs, so
    windows of different lengths (one iteration, ``sglang-overlap``'s ``iterations``, pp's
    micro-batch iterations) compare fairly; ``ms/iter`` is the window over its iterations.
    A schedule that runs pipeline stages (``shared.schedules.supports_pp``) runs ``pp_stages``
    stages (default: the workload's ``pp``, then its own workload defaults: pp's two stages
    where that is 1) of the workload's EP size; its baseline is serial on the same
    ``stages × ep`` GPUs (EP ``stages × ep``, the same sequences per GPU), falling back to serial's
    per-GPU throughput at EP ``ep`` when that does not build. Every other schedule runs one
    pipeline stage. A schedule that refuses the workload gets a row with its reason.
    ``cost_model`` and ``network`` go to every run, as in :func:`simulate`.
    ``sensitivity``: a design (``overlap_lab.sensitivity.Design``, True for the default one, or
    its command-line form ``"lhs=8,seed=1"``) to re-run the comparison over perturbed costs;
    the Comparison then carries the ranges (``Comparison.sensitivity``; docs/uncertainty.md).
    """
    from tqdm import tqdm

    from overlap_lab.sensitivity import design_from
    from overlap_lab.sim.models import check_model_names

    design = design_from(sensitivity)  # a bad design: one line before anything runs
    names = list(dict.fromkeys(s.strip() for s in (schedules or SCHEDULES) if s.strip()))
    for n in names:
        if n not in SCHEDULES:
            raise ConfigError(f"unknown schedule {n!r}; choose from {', '.join(SCHEDULES)}")
    w0 = workload if workload is not None else _workload()
    staged = _with_pp(w0, pp_stages or w0.parallel.pp)
    w1 = _with_pp(w0, 1)
    g = _gpu(gpu)
    cfg = _as_config(config)

    def run(name: str, wl: Workload) -> Result:
        return simulate(
            name,
            wl,
            g,
            cfg,
            profile=profile,
            max_events=max_events,
            cost_model=cost_model,
            network=network,
            **ranks,
        )

    check_model_names(cost_model, network)  # a bad name or profile: one line, before the bar
    if cost_model is None or isinstance(cost_model, str):
        resolve_profile(profile, g)
    base = run(BASELINE, w1)  # before the bar: a refusal of the workload is one line alone
    # in a terminal the bar is erased when done; written to a file (stderr redirected, often
    # with stdout) its last state is kept and ends its line, so the table starts on its own
    bar = tqdm(
        total=len(names),
        desc="simulating",
        unit="schedule",
        disable=not progress,
        leave=not sys.stderr.isatty(),
    )
    rows = []
    for n in names:
        if n == BASELINE:
            res, note = base, ""
        else:
            try:
                if registry.supports_pp(n):  # its stages are said in its baseline's note
                    res = run(n, registry.prepare_workload(n, staged)[0])
                else:
                    res = run(n, w1)
                note = "; ".join(res.notes)
            except ConfigError as e:
                res, note = None, f"refused: {e}"
        bar.update()
        if res is None:
            rows.append(CompareRow(n, None, None, BASELINE, note))
            continue
        ref, label = base, BASELINE
        if res.workload.parallel.pp > 1:
            ref, label, extra = _pipeline_baseline(res, base, run)
            note = "; ".join(x for x in (note, extra) if x)
        speedup = res.metrics.tokens_per_s_gpu / ref.metrics.tokens_per_s_gpu
        rows.append(CompareRow(n, res, speedup, label, note))
    bar.close()
    table = Comparison(tuple(rows), base, cfg)
    if design is None:
        return table
    from overlap_lab.sensitivity import sensitivity as over_design

    r = ranks.get("ranks")
    rest = {k: v for k, v in ranks.items() if k != "ranks"}
    rk = r if isinstance(r, Ranks) else Ranks(r or "symmetric", **rest)
    models = {"network": network}

    def explicit(p: Program, wl: Workload, cm: CostModel) -> float:
        """Every rank again, as the nominal run simulated them (reduced where it could be)."""
        run = {**models, "cost_model": cm}
        return simulate_explicit(p, wl, g, rk, None, max_events, run).step_time_us

    if isinstance(cost_model, str):  # the design perturbs a model object: the named one's
        from overlap_lab.sim.models import cost_model as build

        cost_model = build(cost_model, resolve_profile(profile, g))[0]
    s = over_design(
        table,
        design,
        cost_model=cost_model,
        network=network,
        profile=profile,
        max_events=max_events,
        rerun=explicit if rk.mode == "explicit" else None,
        progress=progress,
    )
    return replace(table, sensitivity=s)


def _pipeline_baseline(res: Result, base: Result, run) -> tuple[Result, str, str]:
    """The baseline schedule over a pipeline's GPUs: EP = stages × EP, same sequences per GPU."""
    w = res.workload
    p, e = w.parallel.pp, w.parallel.ep
    same = replace(w, parallel=replace(w.parallel, pp=1, ep=p * e))
    try:
        ref = run(BASELINE, same)
    except ConfigError as err:
        return (
            base,
            BASELINE,
            (
                f"{p} stages x EP {e} = {p * e} GPUs; {BASELINE} at EP {p * e} does not build "
                f"({err}), so against {BASELINE}'s per-GPU throughput at EP {e}"
            ),
        )
    return (
        ref,
        f"{BASELINE} EP{p * e}",
        (
            f"{p} stages x EP {e} = {p * e} GPUs, against {BASELINE} on the same {p * e} GPUs "
            f"(EP {p * e}: {ref.metrics.iteration_us / 1e3:.3f} ms/iter)"
        ),
    )
