"""``overlap_lab.tune``: the best schedule and knobs for a deployment under a latency target.

Given a model, a GPU and a number of GPUs, one phase (decode, prefill, or both for a
disaggregated pair) and a target (the most ms per iteration a decode step, or a prefill step,
may take), the tune searches every schedule that runs the workload, the batch, the EP layout
and each schedule's knobs (:mod:`overlap_lab.tune_space`), smartly rather than by brute force
(:mod:`overlap_lab.tune_search`), and returns a :class:`Tuning`: the Pareto frontier of tokens/s
per GPU against ms per iteration, per schedule and overall; the best configuration within the
target with its sensitivity (its win share against the best of the other schedules over
perturbed costs, and those it is not separated from: :mod:`overlap_lab.sensitivity`); and the
launch flags of the system that runs it (each schedule module's ``launch_flags``).

Simulations run through the sweep (:mod:`overlap_lab.sweep`, hence the one runner: parallel,
local or on Ray, deduplicated): every configuration simulated is a row of a sweep CSV, so a tune
interrupted and run again with the same ``out`` reads back what it had (the search is
deterministic, so it asks for the same configurations again) and ``overlap-lab plot`` draws it.
docs/tune.md says how the search works and what the frontier means.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from overlap_lab import runner, sweep, sweep_csv
from overlap_lab.shared import schedules as registry
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.schedules.launch import ServerLaunch
from overlap_lab.tune_search import FellBack, Point, Search, best_under, distinct, pareto
from overlap_lab.tune_space import (
    MTP_ACCEPT,
    CaseParser,
    Deployment,
    Setting,
    Space,
    batches,
    case_of,
    columns,
    deepep_normal,
    latency_iterations,
    layouts,
    space_size,
)

__all__ = ["Deployment", "Point", "Setting", "Space", "Tuning", "TuningPair", "tune"]

#: The design the best configuration is re-run over (overlap_lab.sensitivity): each input that
#: moves decode and prefill the most, alone at both ends of its range.
SENSITIVITY = "oat=1,lhs=0,inputs=hbm+bf16_rate+rdma+profile"
#: The results file of a tune in its ``out`` folder (a sweep CSV).
RESULTS = "tune.csv"
#: What a target bounds, per phase (:attr:`overlap_lab.tune_search.Point.ms`), in words and as
#: the frontier table's column: a decode sequence waits a pp round of micro-batches per token.
LATENCY = {"decode": "ms between a sequence's tokens", "prefill": "ms per prefill step"}
COLUMN = {"decode": "ms/token", "prefill": "ms/step"}


def accepted(drafts: int, accept: float) -> float:
    """Tokens a sequence gains per decode step with ``drafts`` draft tokens, each accepted with
    probability ``accept`` if those before it were: ``1 + a + a^2 + ... + a^drafts``."""
    return 1.0 + sum(accept**k for k in range(1, drafts + 1))


# ---------------------------------------------------------------------------------------------
# Simulating a round of configurations


class _Evaluator:
    """The search's ``evaluate``: each round's configurations appended to the sweep's cases and
    simulated through :func:`overlap_lab.sweep.run_sweep`. A configuration already in the file
    (an earlier run's, whatever its search asked in which order) is read back, not simulated
    again: the file's rows are found by their knobs. Counts what it did in :attr:`counts`."""

    def __init__(self, d: Deployment, csv_path: Path, backend, progress: bool, command, inputs):
        self.d, self.path, self.backend, self.progress = d, csv_path, backend, progress
        self.command, self.inputs = command, inputs
        self.cases: list[dict[str, Any]] = []
        self.index: dict[tuple[Setting, int], int] = {}
        self.counts = dict(simulated=0, duplicates=0, errors=0, resumed=0, rounds=0)
        self.parser = CaseParser(d)
        self._check_inputs()
        self.known: dict[tuple[str, ...], int] = {}
        for row in sweep_csv.read_rows(csv_path):
            i = int(row["case"])
            while len(self.cases) <= i:
                self.cases.append({})
            self.cases[i] = {c: row[c] for c in columns()}
            self.known[tuple(row[c] for c in columns())] = i

    def _check_inputs(self) -> None:
        """A results file of another deployment is refused: its rows answer other questions.
        (A tune with another target or space reads the rows it shares.)"""
        side = self.path.with_name(self.path.name + ".provenance.json")
        if not side.exists():
            return
        from overlap_lab.shared.outputs.trace import provenance

        try:
            old = json.loads(side.read_text())["inputs"]["tune"]["deployment"]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(
                f"tune: {self.path} is not a tune's results; choose another --out"
            ) from None
        new = provenance(None, self.inputs)["inputs"]["tune"]["deployment"]
        if old != new:
            diff = next((k for k in new if old.get(k) != new[k]), "inputs")
            raise ConfigError(
                f"tune: {self.path} holds a tune of another deployment ({diff} differs); choose "
                "another --out"
            )

    def __call__(self, pairs: Sequence[tuple[Setting, int]]) -> dict[tuple[Setting, int], Any]:
        # the longest simulations first (more stages, then more sequences), so that no worker
        # is left with a long one while the others wait at the round's end
        for pair in sorted(pairs, key=lambda p: (-p[0].pp, -p[1])):
            if pair in self.index:
                continue
            case = case_of(*pair)
            key = tuple(sweep_csv.cell(case[c]) for c in columns())
            if key in self.known:
                self.index[pair] = self.known[key]
                self.counts["resumed"] += 1
                continue
            self.index[pair] = self.known[key] = len(self.cases)
            self.cases.append(case)
        spec = sweep.Spec(columns(), tuple(self.cases))
        self.counts["rounds"] += 1
        label = f"tune round {self.counts['rounds']}" if self.progress else None
        stats = sweep.run_sweep(
            spec,
            self.path,
            self.parser,
            backend=self.backend,
            progress=label or False,
            command=self.command,
            inputs=self.inputs,
        )
        for k in ("simulated", "duplicates", "errors"):
            self.counts[k] += stats[k]
        rows = {int(r["case"]): r for r in sweep_csv.read_rows(self.path)}
        out = {}
        for pair in pairs:
            i = self.index[pair]
            row = rows.get(i)
            if row is None:
                raise ConfigError(f"tune: case {i} missing from {self.path}")
            out[pair] = self._point(pair, row)
        return out

    def _point(self, pair: tuple[Setting, int], row: Mapping[str, str]) -> Point | str:
        if row.get("error"):
            return row["error"]
        s, b = pair
        tps = float(row["tokens_per_s_gpu"])
        if s.drafts:  # every draft is computed; the accepted ones count
            tps *= accepted(s.drafts, self.d.mtp_accept) / (1 + s.drafts)
        n = latency_iterations(self.d, s, b)  # the target bounds a sequence's wait, not a turn
        return Point(s, b, n * float(row["iteration_us"]) / 1e3, tps, n)


# ---------------------------------------------------------------------------------------------
# The result


@dataclass(frozen=True)
class Tuning:
    """One phase's tune. ``points``: every configuration simulated; ``frontier`` their Pareto
    frontier (tokens/s per GPU against ms per iteration) and ``by_schedule`` each schedule's;
    ``best``: the most tokens/s per GPU within ``target_ms`` (None: none was);
    ``sensitivity``: ``overlap_lab.sensitivity.Sensitivity`` of the best and ``rivals`` (the
    best of other schedules within the target), keyed by :func:`label`; ``launch``: how to
    launch the best; ``caveats``: one line each where the answer rests on something the model
    treats roughly (``overlap_lab.caveats``); ``refused``: per schedule and layout without a
    point, why; ``counts``:
    configurations simulated, shared with an identical simulation, failed, read back from an
    earlier run, rounds, and ``space`` (what brute force would simulate)."""

    deployment: Deployment
    target_ms: float | None
    points: tuple[Point, ...]
    frontier: tuple[Point, ...]
    by_schedule: Mapping[str, tuple[Point, ...]]
    best: Point | None
    rivals: tuple[Point, ...] = ()
    sensitivity: Any = None
    launch: ServerLaunch | None = None
    refused: Mapping[str, str] = field(default_factory=dict)
    counts: Mapping[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    files: tuple[str, ...] = ()
    per_schedule: bool = False
    notes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    caveats: tuple[str, ...] = ()

    @property
    def unit(self) -> str:
        """What the target bounds and the frontier's time axis is, in words."""
        return LATENCY[self.deployment.mode]

    def text(self) -> str:
        """What ``overlap-lab tune`` prints (docs/tune.md)."""
        d, c = self.deployment, self.counts
        unit = self.unit
        goal = f"within {self.target_ms:g} {unit}" if self.target_ms is not None else "(no target)"
        lines = [
            f"{d.model.label} {d.mode} on {d.gpus} x {d.gpu.name} ({d.gpus_per_node} per node), "
            f"best tokens/s per GPU {goal}",
            f"simulated {c.get('simulated', 0)} configurations ({c.get('duplicates', 0)} more "
            f"shared an identical simulation, {c.get('errors', 0)} failed, "
            f"{c.get('resumed', 0)} read back from an earlier run) in {c.get('rounds', 0)} rounds "
            f"of a space of {c.get('space', 0):,} (brute force), {self.seconds:.1f} s; by step: "
            + ", ".join(f"{k} {v}" for k, v in c.get("asked", {}).items()),
            "",
            "Pareto frontier per schedule: of its configurations simulated, those no other is "
            "both faster than and ahead of in tokens/s per GPU"
            + (
                ""
                if self.per_schedule
                else " (a batch other schedules' points already dominate "
                "was not simulated: --per-schedule fills every schedule's own)"
            )
            + ":",
            f"  {'schedule':<15}{COLUMN[d.mode]:>9}{'ms/iter':>9}{'tok/s/GPU':>11}{'batch':>7}"
            "  layout   knobs",
        ]
        for name, pts in self.by_schedule.items():
            if not pts:
                why = next((v for k, v in self.refused.items() if k.startswith(name + " ")), "")
                lines.append(f"  {name:<15}{'-':>9}{'-':>9}{'-':>11}{'-':>7}  {why}")
                continue
            for i, (p, same) in enumerate(distinct(pts)):
                mark = "*" if self.best is not None and p == self.best else " "
                also = f" (+{same} settings, the same numbers)" if same else ""
                ran = self.notes.get(label(p), ())
                also += f" [{'; '.join(n.split(':')[0] for n in ran)}]" if ran else ""
                lines.append(
                    f" {mark}{name if i == 0 else '':<15}{p.ms:>9.3f}{p.iteration_ms:>9.3f}"
                    f"{p.tps:>11.0f}{p.batch:>7}"
                    f"  {p.setting.layout:<8} {p.setting.describe()}{also}"
                )
        on = {(p.setting, p.batch) for p in self.frontier}
        lines.append(
            f"  ({len(self.frontier)} of these points form the overall frontier; * the best {goal})"
        )
        lines.append("")
        lines += self._best_text(on)
        return "\n".join(lines)

    def _best_text(self, on_frontier: set) -> list[str]:
        b = self.best
        if b is None:
            return [f"No configuration meets the target of {self.target_ms:g} ms: the fastest "
                    "is " + (f"{min(self.points, key=lambda p: p.ms).ms:.3f} ms" if self.points
                             else "none (nothing ran)")]  # fmt: skip
        s = b.setting
        lines = [
            f"Best: {s.schedule}, {b.batch} {'sequences' if self.deployment.mode == 'decode' else 'prompts'} "
            f"per GPU, {s.layout}, knobs {s.describe()}: {b.ms:.3f} {self.unit}"
            + (
                f" ({b.iterations} iterations of {b.iteration_ms:.3f} ms)"
                if b.iterations > 1
                else ""
            )
            + f", {b.tps:,.0f} tokens/s per GPU"
        ]
        if self.sensitivity is not None:
            sens, me = self.sensitivity, label(b)
            r = sens[me]
            others = [x for x in r.not_separated]
            n = len(sens.points) + 1
            lines.append(
                f"  win share {100 * r.wins:.0f} % of {n} points of perturbed costs "
                f"({', '.join(i.name for i in sens.design.varied())}; docs/uncertainty.md) "
                f"against the best of {len(self.rivals)} other schedules"
            )
            lines.append(
                "  not separated from: "
                + (
                    ", ".join(
                        f"{o} (ahead at {100 * sens.paired_share(me, o):.0f} %)" for o in others
                    )
                    or "none"
                )  # fmt: skip
            )
        lines += [f"  {c}" for c in self.caveats]
        if self.launch is not None:
            lines.append("")
            lines.append(self.launch.text())
        return lines

    def as_dict(self) -> dict[str, Any]:
        def pt(p: Point) -> dict[str, Any]:
            s = p.setting
            return {"schedule": s.schedule, "batch": p.batch, "ep": s.ep, "pp": s.pp,
                    "mtp_drafts": s.drafts, "knobs": dict(s.knobs), "gpu": dict(s.gpu),
                    "latency_ms": p.ms, "latency_iterations": p.iterations,
                    "ms_per_iteration": p.iteration_ms, "tokens_per_s_gpu": p.tps}  # fmt: skip

        d = self.deployment
        return {
            "model": d.model.label,
            "gpu": d.gpu.name,
            "gpus": d.gpus,
            "mode": d.mode,
            "target_ms": self.target_ms,
            "counts": dict(self.counts),
            "seconds": self.seconds,
            "frontier": [pt(p) for p in self.frontier],
            "by_schedule": {k: [pt(p) for p in v] for k, v in self.by_schedule.items()},
            "best": None if self.best is None else pt(self.best),
            "sensitivity": None if self.sensitivity is None else self.sensitivity.as_dict(),
            "launch": None if self.launch is None else self.launch.as_dict(),
            "refused": dict(self.refused),
            "notes": {k: list(v) for k, v in self.notes.items()},
            "caveats": list(self.caveats),
            "files": list(self.files),
        }


@dataclass(frozen=True)
class TuningPair:
    """A prefill-decode disaggregated pair: each phase tuned on its own GPUs."""

    prefill: Tuning
    decode: Tuning

    def text(self) -> str:
        return "\n".join(["== prefill ==", self.prefill.text(), "", "== decode ==",
                          self.decode.text()])  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        return {"prefill": self.prefill.as_dict(), "decode": self.decode.as_dict()}

    @property
    def files(self) -> tuple[str, ...]:
        """What both phases wrote."""
        return self.prefill.files + self.decode.files


def label(p: Point) -> str:
    """A configuration's name in the sensitivity table: its setting and batch."""
    return f"{p.setting.label()} b{p.batch}"


# ---------------------------------------------------------------------------------------------
# The tune


def tune(
    model: Any = "deepseek-v3",
    gpu: Any = "h800",
    gpus: int = 32,
    mode: str = "decode",
    max_ms: float | None = None,
    *,
    max_prefill_ms: float | None = None,
    space: Space | None = None,
    exhaustive: bool = False,
    per_schedule: bool = False,
    gpus_per_node: int = 8,
    prefill_gpus: int | None = None,
    kv_len: int = 4096,
    extend_len: int = 4096,
    layers: int | None = None,
    profile: Any = "auto",
    mtp_accept: float = MTP_ACCEPT,
    sensitivity: Any = SENSITIVITY,
    rivals: int = 2,
    out: str | Path | None = None,
    figure_format: str = "png",
    processes: int | None = None,
    backend: runner.Backend | None = None,
    progress: bool = False,
    model_path: str | None = None,
    command: Sequence[str] | None = None,
) -> Tuning | TuningPair:
    """Tune ``model`` on ``gpus`` x ``gpu`` (see the module docstring).

    ``mode``: ``decode`` (target ``max_ms`` per iteration), ``prefill`` (``max_prefill_ms`` per
    prefill step) or ``both`` (each phase on its own GPUs: ``prefill_gpus``, default ``gpus``;
    a :class:`TuningPair`). ``space``: where to search (:class:`~overlap_lab.tune_space.Space`;
    default: every registered schedule, the phase's batch ladder, every EP size, each knob's
    values from its record); ``exhaustive``: every knob combination rather than the default
    coarse-to-fine search; ``per_schedule``: prune a batch only with its own schedule's points,
    so that every schedule's frontier is complete, not only the overall one (more
    simulations). ``sensitivity``: the design the best is re-run over (a
    ``overlap_lab.sensitivity.Design`` or its string; False: none) against ``rivals`` other
    schedules. ``out``: a folder for the results file (``tune.csv``, resumable), the frontier
    figure (``frontier.<figure_format>``), ``tune.json`` and ``launch.sh``; None: nothing kept.
    ``processes``/``backend``: where simulations run (``overlap_lab.runner``); ``progress``: a
    bar per round on stderr. ``model_path``: what the launch command loads (default: the
    model's name)."""
    from overlap_lab import api

    m = api.model(model)
    g = api.gpu(gpu)
    space = space or Space()
    mode = str(mode).lower()
    if mode not in ("decode", "prefill", "both"):
        raise ConfigError(f"tune: mode must be decode, prefill or both, got {mode!r}")
    if mode == "prefill" and max_ms is not None:
        raise ConfigError("tune: a prefill target is --max-prefill-ms (max_prefill_ms)")
    if mode == "decode" and max_prefill_ms is not None:
        raise ConfigError("tune: --max-prefill-ms applies to --mode prefill or both")
    for t in (max_ms, max_prefill_ms):
        if t is not None and not t > 0:
            raise ConfigError(f"tune: a target must be a positive number of ms, got {t}")
    kw = dict(gpus_per_node=gpus_per_node, kv_len=kv_len, extend_len=extend_len,
              layers=layers, profile=profile, mtp_accept=mtp_accept)  # fmt: skip
    common = dict(space=space, exhaustive=exhaustive, per_schedule=per_schedule,
                  sensitivity=sensitivity, rivals=rivals,
                  figure_format=figure_format, processes=processes, backend=backend,
                  progress=progress, model_path=model_path, command=command)  # fmt: skip
    if mode != "both":
        target = max_ms if mode == "decode" else max_prefill_ms
        d = Deployment(m, g, gpus, mode, **kw)
        return _tune_phase(d, target, out=None if out is None else Path(out), **common)
    outs = (None, None) if out is None else (Path(out) / "prefill", Path(out) / "decode")
    pre = Deployment(m, g, prefill_gpus or gpus, "prefill", **kw)
    dec = Deployment(m, g, gpus, "decode", **kw)
    return TuningPair(
        _tune_phase(pre, max_prefill_ms, out=outs[0], **common),
        _tune_phase(dec, max_ms, out=outs[1], **common),
    )


def _tune_phase(
    d: Deployment,
    target: float | None,
    *,
    out: Path | None,
    space: Space,
    exhaustive: bool,
    per_schedule: bool,
    sensitivity: Any,
    rivals: int,
    figure_format: str,
    processes: int | None,
    backend: runner.Backend | None,
    progress: bool,
    model_path: str | None,
    command: Sequence[str] | None,
) -> Tuning:
    t0 = time.perf_counter()
    names = list(space.schedules or registry.available())
    backend = backend or runner.Local(processes)
    inputs = _inputs(d, target, space, exhaustive, per_schedule)
    with tempfile.TemporaryDirectory(prefix="overlap-lab-tune-") as scratch:
        folder = out if out is not None else Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        ev = _Evaluator(d, folder / RESULTS, backend, progress, command, inputs)
        search = Search(
            d,
            space,
            names,
            target,
            ev,
            exhaustive=exhaustive,
            per_schedule=per_schedule,
            layouts=lambda s: layouts(d, space, s),
            ladder=batches(d, space),
        )
        search.run()
    points = tuple(search.points())
    mine = {n: [p for p in points if p.setting.schedule == n] for n in names}
    # the notes of every point a tie could put first: each schedule's frontier holds them all
    notes = _notes(d, [p for pts in mine.values() for p in pareto(pts)])

    def fell_back(p: Point) -> bool:
        return label(p) in notes

    by_schedule = {n: tuple(pareto(pts, fell_back)) for n, pts in mine.items()}
    best = best_under(points, target, fell_back)
    refused = _refused(search)
    counts = {**ev.counts, "space": space_size(d, space, names), "asked": dict(search.asked)}
    tuning = Tuning(d, target, points, tuple(pareto(points, fell_back)), by_schedule, best,
                    refused=refused, counts=counts, per_schedule=per_schedule,
                    notes=notes)  # fmt: skip
    if best is not None:
        launch = _launch(d, best, model_path)
        tuning = dataclasses.replace(tuning, launch=launch)
        if sensitivity:
            rival_pts = _rivals(points, best, target, rivals, fell_back)
            sens = _sensitivity(d, (best, *rival_pts), sensitivity, processes, backend)
            tuning = dataclasses.replace(tuning, rivals=rival_pts, sensitivity=sens)
        tuning = dataclasses.replace(tuning, caveats=_caveats(tuning))
    tuning = dataclasses.replace(tuning, seconds=time.perf_counter() - t0)
    if out is not None:
        tuning = dataclasses.replace(tuning, files=tuple(_write(tuning, out, figure_format)))
    return tuning


def _inputs(
    d: Deployment, target: float | None, space: Space, exhaustive: bool, per_schedule: bool
) -> dict:
    """What the results file's provenance records of the tune: the deployment, which every row
    depends on (the model and GPU records whole), and the search, which only chose the rows."""
    from overlap_lab.sim.calibrate import profile_name

    return {
        "tune": {
            "deployment": {
                "model": dataclasses.asdict(d.model),
                "gpu": dataclasses.asdict(d.gpu),
                "gpus": d.gpus,
                "mode": d.mode,
                "gpus_per_node": d.gpus_per_node,
                "kv_len": d.kv_len,
                "extend_len": d.extend_len,
                "layers": d.layers,
                "profile": profile_name(_profile(d)),
            },
            "target_ms": target,
            "mtp_accept": d.mtp_accept,
            "exhaustive": exhaustive,
            "per_schedule": per_schedule,
            "space": {
                "schedules": space.schedules,
                "batches": space.batches,
                "ep": space.ep,
                "pp": space.pp,
                "drafts": space.drafts,
                "values": {k: list(v) for k, v in space.values.items()},
            },
        }
    }


def _profile(d: Deployment):
    from overlap_lab import api

    return api.resolve_profile(d.profile, d.gpu)


def _refused(search: Search) -> dict[str, str]:
    """Per schedule and layout that has no point: the first reason a configuration failed."""
    out: dict[str, str] = {}
    have = {(p.setting.schedule, p.setting.ep, p.setting.pp) for p in search.points()}
    for (s, _), r in search.results.items():
        fam = (s.schedule, s.ep, s.pp)
        if isinstance(r, str) and fam not in have:
            out.setdefault(f"{s.schedule} {s.layout}", r)
    for s, ep, pp in search.families:
        if (s, ep, pp) not in have and not any(k.startswith(f"{s} ") for k in out):
            probe = Setting(s, ep, pp)
            if not search.feasible(probe):
                out[f"{s} {probe.layout}"] = "no batch fits in the GPU's memory"
    return out


def _notes(d: Deployment, pts: Sequence[Point]) -> dict[str, tuple[str, ...]]:
    """Per point (:func:`label`), the fallbacks its schedule recorded, as ``compare`` says them
    (``shared.schedules.fallbacks``: sbo on DeepEP's normal kernels ran as serial, vllm-dbo below
    its token threshold ran unsplit): a row named after a schedule that ran as another says so.
    Read from the Program's meta (a build, no simulation); the notes a trace shows (sbo-off's
    shared experts overlapping nothing) are not among them."""
    from overlap_lab.shared.schedules.fallbacks import fallback_notes

    out = {}
    for p in pts:
        w, g, cfg = CaseParser(d).inputs(case_of(p.setting, p.batch))
        w, _ = registry.prepare_workload(p.setting.schedule, w)
        said = fallback_notes(registry.build(p.setting.schedule, w, g, cfg).meta)
        if said:
            out[label(p)] = tuple(said)
    return out


def _caveats(t: Tuning) -> tuple[str, ...]:
    """The caveats of the answer (``overlap_lab.caveats``, as ``compare`` prints them): of the
    best, and of the rivals the sensitivity run did not separate from it."""
    from overlap_lab.caveats import normal_kernels_in_decode

    b, sens = t.best, t.sensitivity
    close = set(sens[label(b)].not_separated) if sens is not None else set()
    pts = [b, *(p for p in t.rivals if label(p) in close)]
    decode = t.deployment.mode == "decode"
    normal = [p.setting.schedule for p in pts if decode and deepep_normal(t.deployment, p.setting)]
    return tuple(c.line() for c in normal_kernels_in_decode(normal))


def _rivals(
    points: Sequence[Point],
    best: Point,
    target: float | None,
    n: int,
    fell_back: FellBack | None = None,
) -> tuple:
    """The best point of each other schedule within the target, the ``n`` best of them (ties
    as the best's: :func:`overlap_lab.tune_search.best_under`)."""
    per: dict[str, Point] = {}
    for name in dict.fromkeys(p.setting.schedule for p in points):
        if name == best.setting.schedule:
            continue
        b = best_under((p for p in points if p.setting.schedule == name), target, fell_back)
        if b is not None:
            per[name] = b
    return tuple(sorted(per.values(), key=lambda p: -p.tps)[:n])


def _simulate(d: Deployment, p: Point):
    """The nominal run of a configuration, as its row was simulated (an ``api.Result``)."""
    from overlap_lab import api

    case = CaseParser(d)(case_of(p.setting, p.batch))
    return api.simulate(case.schedule, case.workload, case.gpu, case.config, profile=case.profile)


@dataclass(frozen=True)
class _Row:
    schedule: str
    result: Any


@dataclass(frozen=True)
class _Compared:
    rows: tuple[_Row, ...]
    baseline: Any


def _sensitivity(d: Deployment, pts: Sequence[Point], design: Any, processes, backend):
    """The best and its rivals re-run over ``design`` (``overlap_lab.sensitivity``), each under
    its label, its tokens counted as the tune counts them (MTP's accepted drafts)."""
    from overlap_lab.sensitivity import sensitivity

    rows = tuple(_Row(label(p), _simulate(d, p)) for p in pts)
    scale = {
        label(p): accepted(p.setting.drafts, d.mtp_accept) / (1 + p.setting.drafts) for p in pts
    }
    return sensitivity(
        _Compared(rows, rows[0].result),
        design,
        profile=d.profile,
        workers=processes,
        backend=None if isinstance(backend, runner.Local) else backend,
        scale=scale,
    )


def _launch(d: Deployment, p: Point, model_path: str | None) -> ServerLaunch:
    """How to launch ``p``: its schedule module's flags; a knob the search set that no flag
    carries and the module did not explain is listed as having none declared."""
    from overlap_lab.shared.schedules.launch import Deployment as Deploy

    case = CaseParser(d)(case_of(p.setting, p.batch))
    launch = registry.launch_flags(
        case.schedule,
        Deploy(
            case.workload, case.gpu, case.config, d.gpus, model_path or d.model.name
        ),  # fmt: skip
    )
    said = launch.carried() | {k for k, _ in launch.unmapped}
    if launch.system is None:
        return launch
    missing = [
        (k, "the schedule's launch_flags declares no flag for it")
        for k, _ in p.setting.knobs + p.setting.gpu
        if k not in said
    ]
    return dataclasses.replace(launch, unmapped=(*launch.unmapped, *missing))


def _write(t: Tuning, out: Path, figure_format: str) -> list[str]:
    """The frontier figure, ``tune.json`` and ``launch.sh`` beside the results file."""
    from overlap_lab.figures.curves import frontier_figure

    files = [str(out / RESULTS)]
    fig = frontier_figure(t, out / f"frontier.{figure_format}")
    files.append(str(fig))
    (out / "tune.json").write_text(json.dumps(t.as_dict(), indent=1, default=str) + "\n")
    files.append(str(out / "tune.json"))
    if t.launch is not None and t.launch.system is not None:
        (out / "launch.sh").write_text(
            "#!/bin/sh\n# " + t.launch.system + ": the best configuration overlap-lab tune found "
            "(docs/tune.md)\n" + t.launch.shell() + "\n"
        )
        files.append(str(out / "launch.sh"))
    return files
