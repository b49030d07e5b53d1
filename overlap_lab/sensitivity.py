"""How sure a comparison is: the same schedules re-run over a design of perturbed costs.

A comparison's ranking rests on inputs nobody measured on the user's machine: kernel
efficiencies, the calibration profile's rows, effective HBM, NVLink and RDMA rates, DeepEP's
fixed costs. Moving one of them by a plausible amount can swap two schedules, and a plain table
does not say so. :func:`sensitivity` re-runs every schedule of a
:class:`~overlap_lab.api.Comparison` at each point of a :class:`Design` (one input at a time at
its range's ends, then a seeded Latin hypercube over all of them) and reports per schedule the
range of time per iteration, the share of points in which it has the best throughput per GPU,
and which schedules it is not separated from (their throughput ranges overlap).

Why it is fast: only costs vary. The comparison's lowered Programs are simulated again as they
are (no rebuild, no revalidation); each point is a :class:`PerturbedCostModel` wrapping the run's
cost model through the engine's ``cost_model`` seam. It asks the wrapped model the same
questions about a perturbed copy of the GPU record (peaks, HBM, links, DeepEP's fixed receive
cost) and scales what a calibration profile's rows give. Inputs that change a Program's structure
(communication SMs, the kernel floor the engine applies itself) are documented in
:data:`INPUTS` with their ranges but not varied here: varying them means rebuilding, which the
``sbo_comm_sms`` experiment does for the SMs. Each range and its source: docs/uncertainty.md.

The points are independent, so they run through the one runner of batches
(:mod:`overlap_lab.runner`): on forked worker processes (one per CPU this process may use;
``workers=1`` keeps them in this process) or on Ray.

Determinism: a design's points are a pure function of the design (its seed included), and the
simulator is deterministic, so the same comparison and design give the same result, with any
number of workers.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from overlap_lab.metrics import iterations_and_tokens
from overlap_lab.runner import Backend, Local, in_order
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import GPU

if TYPE_CHECKING:
    from overlap_lab.shared.inputs.workload import Workload
    from overlap_lab.shared.ir.program import Op, Program
    from overlap_lab.sim.cost import Grid, KernelDemand
    from overlap_lab.sim.models import CostModel, NetworkFactory

__all__ = [
    "DEFAULT_DESIGN",
    "EXPERIMENT_DESIGN",
    "INPUTS",
    "Design",
    "Input",
    "PerturbedCostModel",
    "Point",
    "ScheduleRange",
    "Sensitivity",
    "design_from",
    "paired",
    "perturbed_gpu",
    "sensitivity",
    "step_times",
]


# ---------------------------------------------------------------------------------------------
# The uncertain inputs


@dataclass(frozen=True)
class Input:
    """One uncertain input: a factor on the model's nominal value, from ``lo`` to ``hi``.

    ``basis`` says what the range rests on (``datasheet``, ``measured spread``, ``published
    tables``, ``fit``, ``assumption``); ``source`` names it. ``varied``: whether the cost-only
    design moves it (False: documented, but it changes the Program or is a hook still to fill)."""

    name: str
    what: str
    lo: float
    hi: float
    basis: str
    source: str
    varied: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.lo <= 1.0 <= self.hi:
            raise ConfigError(f"input {self.name}: range {self.lo}..{self.hi} must bracket 1")


#: Every uncertain input, with its range as factors on the nominal value and its source
#: (docs/uncertainty.md repeats them with the numbers behind each range).
INPUTS: tuple[Input, ...] = (
    Input(
        "hbm",
        "effective HBM bandwidth (all kernels together and each kernel's cap; carries the "
        "per-class memory efficiencies)",
        0.85,
        1.05,
        "measured spread",
        "H800/H100 SXM datasheet 3.35 TB/s as the ceiling; FlashMLA README: ~3000 GB/s "
        "memory-bound on H800 (the model's 0.90 x datasheet); lower end: an assumption for "
        "short kernels",
    ),
    Input(
        "fp8_rate",
        "achieved FP8 tensor-core rate of kernels no profile row covers (peak x class "
        "compute efficiency)",
        0.85,
        1.15,
        "published tables",
        "DeepGEMM README: 1350-1550 of 1979 dense FP8 TFLOP/s on H800 for large GEMMs "
        "(0.68-0.78 against the model's 0.65-0.70)",
    ),
    Input(
        "bf16_rate",
        "achieved BF16 rate (MLA attention, the router GEMM, BF16 GEMMs): peak x class "
        "compute efficiency",
        0.85,
        1.2,
        "published tables",
        "FlashMLA README: ~660 of 989 dense BF16 TFLOP/s compute-bound on H800 (0.67 against "
        "the model's 0.60)",
    ),
    Input(
        "profile",
        "durations a calibration profile's rows give (measured kernels)",
        0.9,
        1.1,
        "published tables",
        "DeepGEMM README's isolated H800 rows (the h800-published profile): run-to-run spread "
        "and the distance between a published shape and the op's",
    ),
    Input(
        "nvlink",
        "effective NVLink rate of DeepEP kernels (134 GB/s on H800)",
        0.85,
        1.1,
        "published tables",
        "DeepEP README intranode table: 153-158 GB/s bottleneck bandwidth counted over every "
        "received byte (x 7/8 over the links)",
    ),
    Input(
        "rdma",
        "effective RDMA rate of DeepEP kernels (44 GB/s per GPU over the NIC on H800 / ConnectX-7)",
        0.85,
        1.1,
        "published tables",
        "DeepEP README: its internode rows over the NIC (shared.ir.deepep.nic_gbps) are 33-40 "
        "GB/s (2025-02) and 43-45 GB/s (2025-04 on); the line rate, 50 GB/s, bounds it above",
    ),
    Input(
        "deepep_fixed",
        "DeepEP's fixed costs: the low-latency receive's fixed part (11 us) and the link latencies",
        0.5,
        1.5,
        "fit",
        "the receive cost is fitted to DeepEP README's low-latency rows (a 10.2-11.8 us "
        "window at EP 8, wider across EP 8-256); the latencies are estimates",
    ),
    Input(
        "interference",
        "slowdown of a kernel beside another beyond the SM sharing and HBM water-fill the engine "
        "models (measured beside a decode-size GEMM)",
        1.0,
        1.21,
        "measured spread",
        "the interference probe on an H200 (2026-11-26): beside decode-size GEMMs a large GEMM, "
        "a decode attention and a copy ran 1.21, 1.14 and 1.03x slower than the calibrated model "
        "gives (docs/sm-sharing.md); not varied: a cost model sees one kernel at a time, and "
        "this slowdown holds only beside another",
        varied=False,
    ),
    Input(
        "comm_sms",
        "SMs of communication kernels (SBO's combine: 3 on Hopper; DeepEP normal: 20, "
        "DeepSeek's 24)",
        0.67,
        1.33,
        "published tables",
        "SGLang's and DeepEP's defaults; DeepSeek's profile-data uses 24. Changes the "
        "Program: swept by the sbo_comm_sms experiment, not by this design",
        varied=False,
    ),
    Input(
        "kernel_floor",
        "GPU-side floor of any kernel (2 us) and host launch costs",
        0.5,
        2.0,
        "assumption",
        "estimates in the GPU preset; the engine applies the floor itself, so the cost-only "
        "design cannot move it",
        varied=False,
    ),
)
_BY_NAME = {i.name: i for i in INPUTS}


# ---------------------------------------------------------------------------------------------
# Designs


@dataclass(frozen=True)
class Point:
    """One point of a design: a label and a factor per varied input (1 where not named)."""

    label: str
    factors: tuple[tuple[str, float], ...]

    def factor(self, name: str) -> float:
        for k, v in self.factors:
            if k == name:
                return v
        return 1.0


#: The most Latin-hypercube points a design may have: each re-simulates every schedule (a
#: thousand take minutes on a workstation for a few layers; 10^8 filled 18 GB before the first
#: ran), and with at most the few inputs varied here more points no longer move the ranges.
MAX_LHS = 1000

#: What a design's refusals name: the API's keyword (``compare(sensitivity=...)``), which a
#: command line shows as its option
_NAMES = ("sensitivity",)


@dataclass(frozen=True)
class Design:
    """Which perturbations to run: one-at-a-time (each input at its range's ends, the others
    nominal) and ``lhs`` points of a Latin hypercube over all varied inputs, drawn from
    ``seed`` (the same seed, the same points). ``inputs``: the names to vary (default: every
    :data:`INPUTS` entry with ``varied``)."""

    oat: bool = True
    lhs: int = 4
    seed: int = 0
    inputs: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.lhs <= MAX_LHS:
            raise ConfigError(
                f"sensitivity: lhs must be in 0..{MAX_LHS}, got {self.lhs}", names=_NAMES
            )
        if not 0 <= self.seed < 2**32:  # numpy's seeds
            raise ConfigError(
                f"sensitivity: seed must lie in 0..{2**32 - 1}, got {self.seed}", names=_NAMES
            )
        for n in self.inputs or ():
            if n not in _BY_NAME:
                raise ConfigError(
                    f"sensitivity: unknown input {n!r}; inputs are {', '.join(_BY_NAME)}",
                    names=_NAMES,
                )
            if not _BY_NAME[n].varied:
                raise ConfigError(
                    f"sensitivity: input {n!r} is documented but not varied", names=_NAMES
                )
        if not self.oat and self.lhs == 0:
            raise ConfigError(
                "sensitivity: the design has no points (no one-at-a-time, lhs 0)", names=_NAMES
            )

    def varied(self) -> tuple[Input, ...]:
        names = self.inputs or tuple(i.name for i in INPUTS if i.varied)
        return tuple(_BY_NAME[n] for n in names)

    def points(self) -> tuple[Point, ...]:
        """The design's points, nominal excluded (the comparison itself is the nominal run)."""
        ins = self.varied()
        pts: list[Point] = []
        if self.oat:
            for i in ins:
                pts.append(Point(f"{i.name} x{i.lo:g}", ((i.name, i.lo),)))
                pts.append(Point(f"{i.name} x{i.hi:g}", ((i.name, i.hi),)))
        if self.lhs:
            rng = np.random.default_rng(self.seed)
            n = self.lhs
            cols = {}
            for i in ins:  # one stratum per point and input, shuffled: a Latin hypercube
                u = (rng.permutation(n) + rng.random(n)) / n
                cols[i.name] = i.lo + u * (i.hi - i.lo)
            for k in range(n):
                pts.append(Point(f"lhs {k}", tuple((i.name, float(cols[i.name][k])) for i in ins)))
        return tuple(pts)

    def describe(self) -> str:
        parts = []
        if self.oat:
            parts.append(f"one-at-a-time ({2 * len(self.varied())} points)")
        if self.lhs:
            parts.append(f"Latin hypercube of {self.lhs} (seed {self.seed})")
        return " + ".join(parts)


#: What ``compare --sensitivity`` and ``compare(..., sensitivity=True)`` run.
DEFAULT_DESIGN = Design()


def design_from(spec: Design | bool | str | Mapping[str, Any] | None) -> Design | None:
    """A design from what ``compare(sensitivity=...)`` takes: a :class:`Design`, True (the
    default design), a mapping of its fields, or a string ``"lhs=8,seed=1,oat=0"`` (the command
    line's). None or False: none."""
    if spec is None or spec is False:
        return None
    if spec is True:
        return DEFAULT_DESIGN
    if isinstance(spec, Design):
        return spec
    if isinstance(spec, Mapping):
        return Design(**dict(spec))
    if not isinstance(spec, str):
        raise ConfigError(f"sensitivity: expected a design, got {spec!r}")
    kw: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, _, val = part.partition("=")
        key = key.strip()
        if key not in ("lhs", "seed", "oat", "inputs"):
            raise ConfigError(
                f"sensitivity: unknown key {key!r}; keys are lhs, seed, oat, inputs "
                "(e.g. lhs=8,seed=1,inputs=hbm+rdma)",
                names=_NAMES,
            )
        if key in ("lhs", "seed"):
            try:
                kw[key] = int(val)
            except ValueError:
                raise ConfigError(
                    f"sensitivity: {key} needs an integer, got {val!r}", names=_NAMES
                ) from None
        elif key == "oat":
            kw["oat"] = val.strip().lower() not in ("0", "false", "no", "off")
        else:
            kw["inputs"] = tuple(x for x in val.split("+") if x)
    return Design(**kw)


# ---------------------------------------------------------------------------------------------
# A perturbed cost model


def perturbed_gpu(gpu: GPU, point: Point) -> GPU:
    """``gpu`` as the cost model should see it at ``point``: peaks, HBM, effective links and
    DeepEP's fixed costs scaled (the record the engine itself holds is not this one, so SM
    counts, launch costs and the kernel floor stay as built)."""

    def eff(link: str, f: float) -> float:
        e = getattr(gpu, f"{link}_eff_gbps") or getattr(gpu, f"{link}_gbps")
        return e * f

    fixed = point.factor("deepep_fixed")
    return replace(
        gpu,
        bf16_tflops=gpu.bf16_tflops * point.factor("bf16_rate"),
        fp8_tflops=gpu.fp8_tflops * point.factor("fp8_rate"),
        hbm_gbps=gpu.hbm_gbps * point.factor("hbm"),
        nvlink_eff_gbps=eff("nvlink", point.factor("nvlink")),
        rdma_eff_gbps=eff("rdma", point.factor("rdma")),
        deepep_ll_recv_us=gpu.deepep_ll_recv_us * fixed,
        nvlink_lat_us=gpu.nvlink_lat_us * fixed,
        rdma_lat_us=gpu.rdma_lat_us * fixed,
    )


class PerturbedCostModel:
    """A ``sim.models.CostModel`` that answers as ``inner`` does about a perturbed GPU record
    (:func:`perturbed_gpu`) and scales the durations ``inner``'s calibration profile gives by
    the point's ``profile`` factor. Pure, like ``inner``: the engine's per-key cache stays
    valid within a run."""

    __slots__ = ("_profile_f", "gpu", "inner", "key", "profile")

    def __init__(self, inner: CostModel, gpu: GPU, point: Point):
        self.inner = inner
        self.gpu = perturbed_gpu(gpu, point)
        self.profile = getattr(inner, "profile", None)
        self._profile_f = point.factor("profile")
        self.key = inner.key  # the wrapped model's own function: it runs per launch

    def grid(self, op: Op, limit: int) -> Grid:
        return self.inner.grid(op, limit)

    def demand(self, op: Op, gpu: GPU, sms: int) -> KernelDemand:
        d = self.inner.demand(op, self.gpu, sms)
        f = self._profile_f
        if f != 1.0 and self.profile is not None and self.profile.lookup(op, sms) is not None:
            return replace(d, t_compute=d.t_compute * f, nbytes=d.nbytes * f)
        return d

    def hbm_bytes_per_us(self, gpu: GPU) -> float:
        return self.inner.hbm_bytes_per_us(self.gpu)

    def link(self, gpu: GPU, kind: str) -> tuple[float, float]:
        return self.inner.link(self.gpu, kind)


# ---------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class ScheduleRange:
    """One schedule over the design: time per iteration (µs) and throughput per GPU at the
    nominal point and their extremes over every point, the share of points where it has the
    best throughput per GPU (ties split), and the schedules whose throughput ranges overlap its
    own (not separated by this design)."""

    schedule: str
    nominal_us: float
    lo_us: float
    hi_us: float
    nominal_tps: float
    lo_tps: float
    hi_tps: float
    wins: float
    not_separated: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Sensitivity:
    """A comparison re-run over a design. ``iteration_us[s]`` and ``tps[s]``: per point
    (nominal first, then :meth:`Design.points` in order) schedule ``s``'s time per iteration
    and tokens/s per GPU."""

    design: Design
    points: tuple[Point, ...]
    iteration_us: Mapping[str, tuple[float, ...]]
    tps: Mapping[str, tuple[float, ...]]
    ranges: tuple[ScheduleRange, ...]

    def __getitem__(self, schedule: str) -> ScheduleRange:
        for r in self.ranges:
            if r.schedule == schedule:
                return r
        raise KeyError(schedule)

    def separated(self, a: str, b: str) -> bool:
        """Whether ``a``'s and ``b``'s throughput ranges over the design do not overlap."""
        return b not in self[a].not_separated

    def paired_share(self, a: str, b: str) -> float:
        """Share of the points (nominal included) at which ``a`` has more throughput per GPU
        than ``b`` (ties count half): the same inputs apply to both at each point, so this
        says more than whether their ranges overlap."""
        xs, ys = self.tps[a], self.tps[b]
        return sum(1.0 if x > y else 0.5 if x == y else 0.0 for x, y in zip(xs, ys)) / len(xs)

    def as_dict(self) -> dict[str, Any]:
        return {
            "design": dataclasses.asdict(self.design),
            "points": [{"label": p.label, **dict(p.factors)} for p in self.points],
            "inputs": [dataclasses.asdict(i) for i in INPUTS],
            "schedules": [r.as_dict() for r in self.ranges],
            "iteration_us": {k: list(v) for k, v in self.iteration_us.items()},
        }

    def text(self) -> str:
        """The sensitivity table ``overlap-lab compare --sensitivity`` prints under the
        comparison, with the pairs that are not separated and how often each wins."""
        n = len(self.points) + 1
        lines = [
            "",
            *textwrap.wrap(
                f"Sensitivity: {n} points (the nominal run, {self.design.describe()}) over "
                + ", ".join(i.name for i in self.design.varied())
                + " (ranges and their sources: docs/uncertainty.md)",
                100,
                subsequent_indent="  ",
            ),
            f"{'schedule':<15}{'ms/iter':>10}{'range':>20}{'tok/s/GPU range':>20}"
            f"{'wins':>7}  group",
        ]
        groups = self.groups()
        group_of = {s: str(k) for k, g in enumerate(groups, 1) for s in g}
        for r in self.ranges:
            rng = f"{r.lo_us / 1e3:.3f}-{r.hi_us / 1e3:.3f}"
            tps = f"{r.lo_tps:.0f}-{r.hi_tps:.0f}"
            lines.append(
                f"{r.schedule:<15}{r.nominal_us / 1e3:>10.3f}{rng:>20}{tps:>20}"
                f"{100 * r.wins:>6.0f}%  {group_of.get(r.schedule, '-')}"
            )
        if groups:
            lines += ["", *textwrap.wrap(
                "Groups not separated (their tok/s/GPU ranges overlap, directly or through another "
                "of the group), nominally faster first; [P %] between two: the share of points at "
                "which the one before has more tok/s/GPU than the one after (each point perturbs "
                "both alike):", 100, subsequent_indent="  ")]  # fmt: skip
            for k, g in enumerate(groups, 1):
                chain = g[0] + "".join(
                    f" [{100 * self.paired_share(a, b):.0f} %] {b}" for a, b in zip(g, g[1:])
                )
                lines += textwrap.wrap(
                    f"{k}: {chain}", 100, initial_indent="  ", subsequent_indent="     "
                )
        lines.append("")
        fixed = [i for i in INPUTS if not i.varied]
        slow = _BY_NAME["interference"].hi
        lines += textwrap.wrap(
            "range: lowest to highest time per iteration over the points; wins: share of the "
            "points where the schedule has the most tokens/s per GPU (ties split); group: the "
            "group of schedules it is not separated from (listed above). Only costs vary (the "
            "Programs are "
            f"the nominal run's). Not varied: {', '.join(i.name for i in fixed)} "
            "(docs/uncertainty.md); of these, interference means a kernel beside another may "
            f"run up to {slow:g}x slower than simulated (measured beside decode-size GEMMs), so "
            "gains from overlapping GEMMs with other kernels are optimistic.",
            100,
            subsequent_indent="  ",
        )
        return "\n".join(lines)

    def groups(self) -> list[list[str]]:
        """The schedules not separated, each group once: those whose throughput ranges overlap,
        directly or through another member (connected), nominally fastest first, groups in the
        order of their fastest; a schedule separated from every other is in none."""
        by = {r.schedule: r for r in self.ranges}
        seen: set[str] = set()
        out = []
        for r in sorted(self.ranges, key=lambda r: -r.nominal_tps):
            if r.schedule in seen or not r.not_separated:
                continue
            group, todo = [], [r.schedule]
            while todo:
                s = todo.pop()
                if s not in seen:
                    seen.add(s)
                    group.append(s)
                    todo += by[s].not_separated
            out.append(sorted(group, key=lambda s: -by[s].nominal_tps))
        return out


# ---------------------------------------------------------------------------------------------
# Running a design


class Compared(Protocol):
    """What :func:`sensitivity` reads of an ``overlap_lab.api.Comparison`` (a protocol, so this
    module need not import the API that calls it): its rows, each with a schedule and a Result
    (``program``, ``workload``, ``metrics``) or None, and its baseline Result (``gpu``)."""

    rows: tuple[Any, ...]
    baseline: Any


#: ``(program, workload, cost_model) -> window µs``: how one Program is simulated again.
Rerun = Callable[["Program", "Workload", "CostModel"], float]


@dataclass(frozen=True)
class _Run:
    """What one schedule's re-runs need: its lowered Program, workload and GPU, and the
    iterations and tokens of its window (fixed by the Program: only the window's length
    changes)."""

    schedule: str
    program: Program
    workload: Workload
    iterations: int
    tokens: float
    gpu: GPU


def sensitivity(
    comparison: Compared,
    design: Design | bool | str | Mapping[str, Any] = True,
    *,
    cost_model: CostModel | None = None,
    network: NetworkFactory | None = None,
    profile: Any = "auto",
    max_events: int | None = None,
    rerun: Rerun | None = None,
    workers: int | None = None,
    progress: bool = False,
    backend: Backend | None = None,
    scale: Mapping[str, float] | None = None,
) -> Sensitivity:
    """Re-run ``comparison``'s schedules at every point of ``design`` and summarise.

    ``cost_model``, ``network``, ``profile`` and ``max_events``: what the comparison ran with
    (:func:`overlap_lab.compare` passes its own); the perturbed cost model wraps ``cost_model``,
    or the default roofline with ``profile``'s rows. The comparison's Programs are re-simulated
    as they are, so only costs change between points. ``rerun(program, workload, cost_model)``
    gives a Program's window under a cost model: ``compare`` passes its explicit-ranks path
    when the comparison simulated every rank; the default runs the engine on the Program as the
    symmetric runs do.

    ``workers``: local processes that share the points (None: the CPUs this process may use; 1:
    in this process); ``backend``: where else to run them (``overlap_lab.runner.Ray()``). Each
    point is simulated alone, so any count gives the same result. ``progress``: a bar over the
    points on stderr. ``scale``: a factor on the tokens a row's throughput counts, by its
    name (``overlap-lab tune``: the accepted share of multi-token prediction's drafts). Each
    row is re-run on its own GPU record (a tune's rows may differ in DeepEP's fields)."""
    from overlap_lab.sim.cost import RooflineCostModel
    from overlap_lab.sim.profile import profile_for

    d = design_from(design)
    if d is None:
        raise ConfigError("sensitivity: no design given")
    if workers is not None and workers < 1:
        raise ConfigError(f"sensitivity: workers must be >= 1, got {workers}")
    base = comparison.baseline
    g = base.gpu
    if cost_model is not None:
        inner = cost_model
    else:
        inner = RooflineCostModel(profile_for(profile, g))
    done = [row for row in comparison.rows if row.result is not None]
    factor = dict(scale or {})
    runs = [_run_of(row.schedule, row.result, factor.get(row.schedule, 1.0)) for row in done]
    points = d.points()
    # the nominal point is the comparison itself
    its = {row.schedule: [row.result.metrics.iteration_us] for row in done}
    tps = {
        row.schedule: [row.result.metrics.tokens_per_s_gpu * factor.get(row.schedule, 1.0)]
        for row in done
    }
    # The comparison's traces and Programs are a large live heap; every full collection the
    # re-runs trigger would walk it again. Frozen, they are skipped (and, in forked workers,
    # left unwritten, so the pages stay shared); the re-runs' own garbage is still collected.
    gc.freeze()
    try:
        job = _Job(points, runs, inner, network, max_events, rerun)
        windows = in_order(
            job.windows,
            range(len(points)),
            backend=backend if backend is not None else Local(workers),
            progress="perturbing" if progress else None,
            unit="point",
            leave=not sys.stderr.isatty(),
        )
    finally:
        gc.unfreeze()
    for run_windows in windows:
        for run, window in zip(runs, run_windows):
            its[run.schedule].append(window / run.iterations)
            tps[run.schedule].append(run.tokens / window * 1e6 if window > 0 else 0.0)
    ranges = _ranges(its, tps)
    return Sensitivity(
        d,
        points,
        {k: tuple(v) for k, v in its.items()},
        {k: tuple(v) for k, v in tps.items()},
        ranges,
    )


@dataclass(frozen=True)
class _Job:
    """What every point's re-runs share."""

    points: tuple[Point, ...]
    runs: list[_Run]
    inner: CostModel
    network: NetworkFactory | None
    max_events: int | None
    rerun: Rerun | None

    def windows(self, i: int) -> list[float]:
        """Each run's window at point ``i`` (a cost model per GPU record the runs hold)."""
        models: dict[GPU, PerturbedCostModel] = {}
        out = []
        for r in self.runs:
            if r.gpu not in models:
                models[r.gpu] = PerturbedCostModel(self.inner, r.gpu, self.points[i])
            cm = models[r.gpu]
            if self.rerun is not None:
                out.append(self.rerun(r.program, r.workload, cm))
            else:
                out.append(_window(r.program, r.gpu, cm, self.network, self.max_events))
        return out


def _run_of(schedule: str, res: Any, scale: float = 1.0) -> _Run:
    """``res``: an ``overlap_lab.api.Result``; ``scale``: a factor on the tokens counted."""
    iters, tokens = iterations_and_tokens(res.program, res.workload)
    return _Run(schedule, res.program, res.workload, iters, tokens * scale, res.gpu)


def _window(
    program: Program,
    g: GPU,
    cm: CostModel,
    network: NetworkFactory | None,
    max_events: int | None,
) -> float:
    """The simulated window of a symmetric run's ``program`` under ``cm`` (validated already:
    the nominal run checked this same Program; seed 0, as that run)."""
    from overlap_lab.sim.engine import Engine

    engine = Engine(program, g, 0, max_events=max_events, cost_model=cm, network=network)
    return engine.run().step_time_us


def _ranges(
    its: Mapping[str, Sequence[float]], tps: Mapping[str, Sequence[float]]
) -> tuple[ScheduleRange, ...]:
    """Each schedule's extremes, wins (ties split) and the schedules its throughput range
    overlaps; point 0 is the nominal run."""
    names = list(its)
    n = len(next(iter(its.values()))) if its else 0
    wins = dict.fromkeys(names, 0.0)
    for k in range(n):
        best = max(tps[s][k] for s in names)
        top = [s for s in names if tps[s][k] >= best * (1 - 1e-12)]
        for s in top:
            wins[s] += 1.0 / len(top) / n
    lo = {s: min(tps[s]) for s in names}
    hi = {s: max(tps[s]) for s in names}
    out = []
    for s in names:
        overl = tuple(o for o in names if o != s and lo[o] <= hi[s] and lo[s] <= hi[o])
        out.append(
            ScheduleRange(
                s,
                its[s][0],
                min(its[s]),
                max(its[s]),
                tps[s][0],
                lo[s],
                hi[s],
                wins[s],
                overl,
            )
        )
    return tuple(out)


#: The design the experiments attach to their claims: each of the inputs that move decode and
#: prefill the most, alone at both ends of its range (8 re-runs per case).
EXPERIMENT_DESIGN = Design(oat=True, lhs=0, inputs=("hbm", "bf16_rate", "rdma", "profile"))


def step_times(
    program: Program,
    gpu: GPU | str,
    design: Design = EXPERIMENT_DESIGN,
    *,
    profile: Any = "auto",
) -> tuple[float, ...]:
    """The window of an already built and validated symmetric ``program`` at each point of
    ``design`` (not the nominal one): what an experiment's ``measure`` stores to say how sure
    each of its rows is, at the cost of one simulation per point."""
    from overlap_lab.shared.inputs.presets import load_gpu
    from overlap_lab.sim.cost import RooflineCostModel
    from overlap_lab.sim.engine import Engine
    from overlap_lab.sim.profile import profile_for

    g = gpu if isinstance(gpu, GPU) else load_gpu(gpu)
    inner = RooflineCostModel(profile_for(profile, g))
    return tuple(
        Engine(program, g, 0, cost_model=PerturbedCostModel(inner, g, p)).run().step_time_us
        for p in design.points()
    )


def paired(a: Sequence[float], b: Sequence[float]) -> float:
    """Share of points (paired, the same perturbation for both) at which time ``a`` is below
    time ``b`` (ties half)."""
    return sum(1.0 if x < y else 0.5 if x == y else 0.0 for x, y in zip(a, b, strict=True)) / len(a)


def design_meta(design: Design = EXPERIMENT_DESIGN) -> dict[str, Any]:
    """What an experiment's results file records of the design its rows were re-run over."""
    return {
        "design": design.describe(),
        "inputs": [i.name for i in design.varied()],
        "points": [dict(p.factors) for p in design.points()],
        "runs": len(design.points()) + 1,  # the nominal run too
    }


def design_sentence(meta: Mapping[str, Any]) -> str:
    """The design of :func:`design_meta` in words, for an experiment's notes."""
    n = meta["runs"]
    ins = ", ".join(f"`{i}`" for i in meta["inputs"])
    return (
        f"{n} points: the nominal run and {meta['design']}, each of {ins} alone at both ends "
        "of its range (`overlap_lab.sensitivity.EXPERIMENT_DESIGN`; ranges and sources in "
        "docs/uncertainty.md)"
    )
