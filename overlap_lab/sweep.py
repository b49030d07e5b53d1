"""Sweeps: thousands of simulations, deduplicated, streamed to a CSV file, resumable.

A sweep is a :class:`Spec`: the names of its knobs and, per case, the knobs' values. What a
case's knobs mean is the caller's to say: ``parse(knobs)`` turns them into a :class:`SimCase`
(the checked inputs of one simulation) or raises ConfigError, which makes that case an error
row. ``overlap-lab sweep`` passes the parser of ``overlap-lab sim``'s own options
(:mod:`overlap_lab.cli.sweep`), so a spec's knob means what the same option means on the command
line.

Each case is built and lowered as ``overlap-lab sim`` does it (explicit ranks when asked) and
simulated through the one runner (:mod:`overlap_lab.runner`): on local worker processes or a Ray
cluster. Cases that cannot differ are simulated once: a case's key (:func:`sim_key`) is the
lowered Program's content key (``Program.content_key``: every rank, op and flow) with what else
the simulation and the row's metrics read: the GPU as the simulator reads it, the network
grouping tolerance, the calibration profile, the event budget and the iterations and tokens the
metrics count. The first case of a key to reach a worker simulates; the others copy its metrics.

Rows stream to the CSV as cases finish (:mod:`overlap_lab.sweep_csv`; one row per case: ``case``
index, every knob of the spec, what produced the row (:data:`PROVENANCE`), the metrics
(:data:`METRICS`), ``sim_key`` and ``error``; cases with one ``sim_key`` were simulated once and
their rows are the same whatever the backend or the order cases finished in). A sweep run again
on the same file skips the cases it has and reuses their results for duplicates. With a
``.parquet`` output the rows stream to ``<out>.partial.csv`` and become a Parquet file when the
sweep completes.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import itertools
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overlap_lab import runner
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.inputs.workload import Workload
from overlap_lab.shared.ir.content import canonical
from overlap_lab.shared.ir.program import Program
from overlap_lab.simcase import SimCase, build

#: what produced each row, from the case's own inputs (never copied from a duplicate's owner):
#: the GPU's full name (overrides included, ``h800+hbm-gbps=2000``), the model and its layer
#: count, the calibration profile op durations came from (``roofline``: none)
PROVENANCE = ("gpu_name", "model_name", "model_layers", "profile_name")
#: the metric columns, in order; every time is per iteration unless its name ends in
#: ``_window_us`` (docs/metrics.md). ``step_time_us`` is ``iteration_us``, as in ``sim --json``;
#: ``max/min_rank_window_us``: the slowest and fastest rank; ``cost_sources``: how many ops took
#: their duration from the profile, the roofline and the link model
METRICS = (
    "iterations",
    "window_us",
    "iteration_us",
    "step_time_us",
    "tokens",
    "tokens_per_s_gpu",
    "comm_us",
    "exposed_comm_us",
    "comm_only_us",
    "compute_kernel_us",
    "sm_compute",
    "sm_comm",
    "sm_idle",
    "max_rank_window_us",
    "min_rank_window_us",
    "num_ops",
    "num_spans",
    "cost_sources",
)
TAIL = ("sim_key", "error")


@dataclass(frozen=True)
class Spec:
    """The expanded sweep: ``knobs`` (column names, spec order) and one dict per case."""

    knobs: tuple[str, ...]
    cases: tuple[dict[str, Any], ...]


#: The most cases one spec may expand to. Counted from the grid's sizes before anything is
#: expanded, so a grid that multiplies out to 1e8 cases is refused at once instead of filling
#: memory (each expanded case is a dict of its knobs, ~1 KB); 100,000 cases take hours to
#: simulate on a workstation, so a larger study is several specs (or a Ray cluster's sweeps).
MAX_CASES = 100_000


def expand(
    src: Mapping[str, Any], known: Collection[str], check: Callable[[str, str, Any], None]
) -> Spec:
    """A spec's ``base``, ``grid`` and ``cases`` expanded: the grid's cartesian product (first
    key slowest) over base, then each listed case over base. Every knob must be one ``known``
    names (written with ``-`` or ``_``), every value passes ``check(where, knob, value)`` and
    every schedule named is registered and loads, all before anything is expanded (a misspelled
    schedule is refused as a misspelled knob is, not made an error row of each case it is in);
    at most :data:`MAX_CASES` cases."""
    extra = set(src) - {"base", "grid", "cases"}
    if extra:
        raise ConfigError(f"sweep: unknown spec keys {sorted(extra)} (base, grid, cases)")
    for key in ("base", "grid"):
        if not isinstance(src.get(key) or {}, Mapping):
            raise ConfigError(f"sweep: {key} must be a mapping of knob: value")
    raw_cases = src.get("cases") or []
    if not isinstance(raw_cases, list):
        raise ConfigError("sweep: cases must be a list of mappings of knob: value")
    for i, c in enumerate(raw_cases):
        if not isinstance(c, Mapping):
            raise ConfigError(f"sweep: cases[{i}] must be a mapping of knob: value, got {c!r:.40}")
    base = _names(src.get("base") or {}, known, "base")
    grid = _names(src.get("grid") or {}, known, "grid")
    for k, v in grid.items():
        if not isinstance(v, list) or not v:
            raise ConfigError(f"sweep: grid {k} needs a non-empty list of values")
    count = math.prod(len(v) for v in grid.values()) if grid or not raw_cases else 0
    count += len(raw_cases)
    if count > MAX_CASES:
        raise ConfigError(
            f"sweep: the spec expands to {count:,} cases, more than {MAX_CASES:,}: "
            "split it into several specs"
        )
    listed = [_names(c, known, "cases") for c in raw_cases]
    for where, k, v in [
        *(("base", k, v) for k, v in base.items()),
        *(("grid", k, v) for k, vs in grid.items() for v in vs),
        *((f"cases[{i}]", k, v) for i, c in enumerate(listed) for k, v in c.items()),
    ]:
        check(where, k, v)
        if k == "schedule":
            _check_schedule(v, where)
    knobs = list(dict.fromkeys([*base, *grid, *(k for c in listed for k in c)]))
    if "schedule" not in knobs:
        knobs.insert(0, "schedule")
    cases = []
    if grid or not listed:
        for values in itertools.product(*grid.values()):
            c = {**base, **dict(zip(grid, values))}
            cases.append({k: c.get(k) for k in knobs})
    cases += [{k: {**base, **c}.get(k) for k in knobs} for c in listed]
    return Spec(tuple(knobs), tuple(cases))


def _names(knobs: Mapping[str, Any], known: Collection[str], where: str) -> dict[str, Any]:
    out = {}
    for k, v in knobs.items():
        name = str(k).replace("-", "_")
        if name not in known:
            raise ConfigError(
                f"sweep: unknown knob {k!r} in {where} (an option of overlap-lab sim)"
            )
        out[name] = v
    return out


def _check_schedule(value: Any, where: str) -> None:
    """A schedule a spec names is registered and loads (a broken plug-in: its one-line error)."""
    from overlap_lab.shared.schedules import SCHEDULES, module

    name = str(value).strip().lower()
    if name not in SCHEDULES:
        raise ConfigError(
            f"sweep: unknown schedule {value!r} in {where}; choose from {', '.join(SCHEDULES)}"
        )
    try:
        module(name)
    except ConfigError as e:
        raise ConfigError(f"sweep: {where}: {e}") from None


# ---------------------------------------------------------------------------------------------
# One case


#: GPU preset fields that are schedule defaults, read when a schedule builds its Program (so
#: already in it) and never by the simulator (tests/test_sweep.py checks that sim/ does not name
#: them): left out of the key with the GPU's name, which only labels the trace, so that e.g.
#: serial cases differing only in ``sbo_comm_sms`` merge.
SCHEDULE_ONLY_GPU_FIELDS = ("sbo_comm_sms", "deepep_normal_sms")


def sim_key(
    program: Program,
    gpu: GPU,
    net_group_tol: float,
    profile: Any = None,
    *,
    workload: Workload | None = None,
    ranks: Any = None,
    max_events: int | None = None,
) -> str:
    """What a case's row depends on, hashed: the lowered Program's content key, the GPU as the
    simulator reads it, the network tolerance, the calibration profile (None: the roofline) and
    the event budget; with the ``workload``, the iterations and tokens the metrics count
    (``metrics.iterations_and_tokens``: the Program's report and the batch); with the case's
    ``ranks``, how explicit ranks are run (reduced to one when they cannot differ, or not)."""
    from overlap_lab.metrics import iterations_and_tokens

    hw = {f.name: getattr(gpu, f.name) for f in dataclasses.fields(gpu)}
    for name in (*SCHEDULE_ONLY_GPU_FIELDS, "name"):
        hw.pop(name, None)
    counted = None if workload is None else iterations_and_tokens(program, workload)
    how = None
    if ranks is not None and not program.symmetric and workload is not None:
        how = (ranks.reduce, workload.parallel.gpus_per_node)
    h = hashlib.sha256(program.content_key().encode())
    h.update(canonical((sorted(hw.items()), net_group_tol, profile, max_events, counted, how)))
    return h.hexdigest()[:24]


def simulate(case: SimCase, w: Workload, program: Program, tol: float):
    """The Trace of a built case: the symmetric Program validated and simulated, explicit ranks
    as ``overlap_lab.simulate`` runs them (once for all when they cannot differ)."""
    from overlap_lab import api
    from overlap_lab.shared.ir.validate import validate
    from overlap_lab.sim.engine import Engine

    if not program.symmetric:
        return api.simulate_explicit(
            program, w, case.gpu, case.ranks, case.profile, case.max_events
        )
    validate(program, case.gpu.num_sms)
    return Engine(
        program,
        case.gpu,
        case.ranks.seed,
        net_group_tol=tol,
        profile=case.profile,
        max_events=case.max_events,
    ).run()


def metrics(trace, program, gpu, workload, profile=None) -> dict[str, Any]:
    """The metric columns of one simulated trace: :func:`overlap_lab.metrics.measure`'s
    definitions, so that a row and ``overlap-lab sim`` agree number for number."""
    from overlap_lab.api import _one_of_alike
    from overlap_lab.metrics import compute_kernel_us, measure
    from overlap_lab.shared.ir.program import num_ops
    from overlap_lab.sim.calibrate import cost_sources

    m = measure(trace, program, workload, gpu.num_sms)
    per_rank = trace.per_rank_step_us()
    rank = min(trace.ranks, default=0)
    one = _one_of_alike(program, trace)  # a reduced run: rank 0's ops stand for every rank's
    alike = 1 if one is program else len(program.ranks)
    counts: dict[str, int] = {}
    for by in cost_sources(one, gpu, profile).values():
        for src, n in by.items():
            counts[src] = counts.get(src, 0) + n
    return {
        "iterations": m.iterations,
        "window_us": m.window_us,
        "iteration_us": m.iteration_us,
        "step_time_us": m.iteration_us,
        "tokens": m.tokens,
        "tokens_per_s_gpu": m.tokens_per_s_gpu,
        "comm_us": m.comm_us,
        "exposed_comm_us": m.exposed_comm_us,
        "comm_only_us": trace.comm_only_us(rank) / m.iterations,
        "compute_kernel_us": compute_kernel_us(trace, rank) / m.iterations,
        "sm_compute": m.sm_compute,
        "sm_comm": m.sm_comm,
        "sm_idle": m.sm_idle,
        "max_rank_window_us": max(per_rank.values(), default=0.0),
        "min_rank_window_us": min(per_rank.values(), default=0.0),
        "num_ops": num_ops(program),
        "num_spans": len(trace.spans),
        "cost_sources": ";".join(f"{k}={n * alike}" for k, n in sorted(counts.items())),
    }


def provenance(case: SimCase) -> dict[str, Any]:
    """The :data:`PROVENANCE` columns of one case, from its checked inputs."""
    from overlap_lab.sim.calibrate import profile_name

    w = case.workload
    return {
        "gpu_name": case.gpu.name,
        "model_name": w.model.label,  # a cut model says so: deepseek-v3[8 of 61 layers]
        "model_layers": w.model.num_layers,
        "profile_name": profile_name(case.profile),
    }


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


@dataclass(frozen=True)
class SweepJob:
    """The runner's job for one sweep: ``prepare`` parses, builds, lowers and keys a case (its
    own part: the provenance columns, or the error that stopped it); ``finish`` simulates it and
    adds the metrics. A failing case is an error row, and the sweep goes on."""

    parse: Callable[[Mapping[str, Any]], SimCase]

    def prepare(self, knobs: Mapping[str, Any]) -> runner.Prepared:
        from overlap_lab.shared.outputs.trace import no_gc

        own: dict[str, Any] = {"error": ""}
        # a case makes ~10^5 short-lived acyclic objects (ops, nodes, spans): the cyclic
        # collector would walk them over and over (~12 % of a case's CPU)
        with no_gc():
            try:
                case = self.parse(knobs)
                own.update(provenance(case))
                w, program, tol = build(case)
                key = sim_key(
                    program,
                    case.gpu,
                    tol,
                    case.profile,
                    workload=w,
                    ranks=case.ranks,
                    max_events=case.max_events,
                )
            except Exception as e:  # noqa: BLE001 - a failing case is a row, the sweep goes on
                own["error"] = _error(e)
                return runner.Prepared(None, None, own)
        return runner.Prepared(key, (case, w, program, tol), own)

    def finish(self, prepared: runner.Prepared) -> dict[str, Any]:
        from overlap_lab.shared.outputs.trace import no_gc

        out = dict(prepared.own)
        if prepared.state is None:
            return out
        case, w, program, tol = prepared.state
        with no_gc():
            try:
                trace = simulate(case, w, program, tol)
                out.update(metrics(trace, program, case.gpu, w, case.profile))
            except Exception as e:  # noqa: BLE001 - a failing case is a row, the sweep goes on
                out["error"] = _error(e)
        return out


# ---------------------------------------------------------------------------------------------
# The sweep


def columns(spec: Spec) -> list[str]:
    """The CSV's columns: the case index, the spec's knobs, provenance, metrics, key, error."""
    return ["case", *spec.knobs, *PROVENANCE, *METRICS, *TAIL]


def run_sweep(
    spec: Spec,
    out: str | Path,
    parse: Callable[[Mapping[str, Any]], SimCase],
    *,
    backend: runner.Backend | None = None,
    progress: bool | str = True,
    limit: int | None = None,
    dedupe: bool = True,
    command: Sequence[str] | None = None,
    inputs: Mapping[str, Any] | None = None,
) -> dict[str, int]:
    """Run the cases of ``spec`` not yet in ``out`` and append their rows as they finish.

    ``parse``: a case's knobs to its :class:`SimCase`, run in the workers. Beside ``out``,
    ``<out>.provenance.json`` records what produced it: the tool's version, ``command`` (the
    command line as typed; None from Python) and ``inputs`` (default: the spec's knobs and
    cases); each row names its own GPU, model and profile (:data:`PROVENANCE`).
    ``backend``: ``runner.Local`` (the default) or ``runner.Ray``; ``progress``: a bar on
    stderr, labelled ``sweep`` or by the string given. ``limit`` stops after that
    many new rows (as an interruption would); ``dedupe=False`` simulates every case (to measure
    what deduplication saves). Returns counts: cases, done before, simulated, duplicates,
    errors."""
    from overlap_lab import sweep_csv
    from overlap_lab.outdir import check_out_file, file_target

    if limit is not None and limit < 1:
        raise ConfigError(f"sweep: --limit must be a positive number of cases, got {limit}")
    out = file_target(out)  # links followed: one file, one lock, whatever name reaches it
    parquet = out.suffix == ".parquet"
    csv_path = rows_file(out)
    if parquet and out.exists():
        raise ConfigError(
            f"sweep: {out} exists (a finished sweep, or another file); a .parquet sweep writes a "
            "new file: choose another --out"
        )
    file_target(csv_path)
    check_out_file(out.with_name(out.name + ".provenance.json"), beside=())
    record = inputs if inputs is not None else {"knobs": spec.knobs, "cases": spec.cases}
    job = SweepJob(parse)
    with sweep_csv.locked(csv_path):
        f, done_rows = sweep_csv.open_rows(csv_path, columns(spec))
        try:
            _check_resumed(done_rows, spec, out)  # before the record of this run replaces it
            sweep_csv.write_provenance(out, command, record)
            stats = _run_locked(spec, f, done_rows, job, backend, progress, limit, dedupe)
        finally:
            f.close()
        if parquet and len(sweep_csv.read_rows(csv_path)) == len(spec.cases):
            sweep_csv.to_parquet(csv_path, out)
            csv_path.unlink()
    return stats


def rows_file(out: str | Path) -> Path:
    """The CSV file a sweep into ``out`` streams its rows to: ``out`` itself, or
    ``<out>.partial.csv`` for a ``.parquet`` sweep until every case is done."""
    out = Path(out)
    return out.with_name(out.name + ".partial.csv") if out.suffix == ".parquet" else out


def stats_text(out: str | Path, stats: Mapping[str, int]) -> str:
    """A finished sweep in one line: :func:`run_sweep`'s counts."""
    return (
        f"{out}: {stats['cases']} cases, {stats['done_before']} done before, "
        f"{stats['simulated']} simulated, {stats['duplicates']} duplicates, "
        f"{stats['errors']} errors"
    )


def _check_resumed(rows: Sequence[Mapping[str, str]], spec: Spec, out: Path) -> None:
    """The rows an earlier run left in ``out`` are this spec's: each case once, with the knobs
    this spec gives it. A changed spec of the same columns would otherwise skip the cases it
    shares by index and keep rows of knobs it no longer has."""
    from overlap_lab.sweep_csv import cell

    seen: set[int] = set()
    for r in rows:
        try:
            i = int(r["case"])
        except ValueError:
            raise ConfigError(f"sweep: {out} holds a row whose case is {r['case']!r}") from None
        if i in seen:
            raise ConfigError(
                f"sweep: {out} holds case {i} twice; it is not one sweep's file: choose another "
                "--out"
            )
        seen.add(i)
        case = spec.cases[i] if 0 <= i < len(spec.cases) else None
        diff = ["case"] if case is None else [k for k in spec.knobs if r[k] != cell(case.get(k))]
        if diff:
            there = f"{diff[0]} {r.get(diff[0])!r} there" + (
                "" if case is None else f", {cell(case.get(diff[0]))!r} here"
            )
            raise ConfigError(
                f"sweep: {out} holds another spec's results (case {i}: {there}); choose "
                "another --out, or run the spec that wrote it"
            )


def _run_locked(
    spec: Spec,
    f: Any,
    done_rows: list[dict[str, str]],
    job: SweepJob,
    backend: runner.Backend | None,
    progress: bool | str,
    limit: int | None,
    dedupe: bool,
) -> dict[str, int]:
    """:func:`run_sweep` with the output's lock held and its file ``f`` open for appending
    (``done_rows``: the rows it held)."""
    from overlap_lab import sweep_csv

    cols = columns(spec)
    done = {int(r["case"]) for r in done_rows}
    known: dict[str, tuple[int, dict[str, str]]] = {}
    for r in done_rows:
        if r["sim_key"] and not r["error"]:
            known.setdefault(r["sim_key"], (int(r["case"]), r))
    todo = [(i, c) for i, c in enumerate(spec.cases) if i not in done]
    if limit is not None:
        todo = todo[:limit]
    stats = {"cases": len(spec.cases), "done_before": len(done), "simulated": 0, "duplicates": 0}
    stats["errors"] = 0
    writer = csv.writer(f, lineterminator="\n")
    outcomes = runner.run(
        job,
        todo,
        backend=backend,
        known=known,
        dedupe=dedupe,
        progress=(progress if isinstance(progress, str) else "sweep") if progress else None,
    )
    try:
        for o in outcomes:
            res = o.result
            row = {"case": o.index, **spec.cases[o.index]}
            row.update({p: res.get(p, "") for p in PROVENANCE})
            if o.same_as is not None:
                stats["duplicates"] += 1
                owner = o.shared
                row.update({m: owner.get(m, "") for m in METRICS})
                row["error"] = owner.get("error") or res["error"]
            else:
                stats["simulated" if not res["error"] else "errors"] += 1
                row.update({m: res.get(m, "") for m in METRICS})
                row["error"] = res["error"]
            row["sim_key"] = o.key or ""
            writer.writerow([sweep_csv.cell(row.get(c)) for c in cols])
            f.flush()
    finally:
        outcomes.close()  # the bar is closed and the workers stopped, also on Ctrl-C
    return stats
