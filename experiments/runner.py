"""Declared experiments and the one runner that sweeps them.

An experiment is data: its name, the Cases of its sweep (each a workload, a GPU preset, a schedule
and its configuration, plus the sweep coordinates that label the result row), what to measure
on each simulated trace, and how to draw and describe the results::

    EXPERIMENT = Experiment(
        name="tbo_decode",
        title="TBO against serial decode",
        cases=cases,                 # () -> Iterable[Case]
        measure=standard_metrics,    # (trace, program, case) -> dict, the default
        derive=lambda rows: speedup(rows, over={"schedule": "serial"}, by=("tokens",)),
        figure=figure,               # (results doc, path without suffix) -> None
        notes=notes,                 # (results doc) -> markdown
    )

:func:`run` simulates the cases through the one runner of batches (``overlap_lab.runner``: in
parallel on local worker processes, or on Ray; results in case order whatever the workers do),
writes ``results/<name>.json`` (rows, the exact command, date, git
commit, the model and hardware presets used, the traces the cases asked to keep), then reads that
file back and draws the figure and the notes from it: plots read files. The results file also
names the tool and its version, and the profile each GPU's op durations came from; its
``provenance`` (``shared.outputs.trace.provenance``: no date, no commit, so the same command records the
same) holds the command line and every case's full inputs (:func:`case_inputs`).

Run them with ``overlap-lab experiments [NAME ...]``, ``python -m overlap_lab.experiments
[NAME ...]`` or
``python -m overlap_lab.experiments.exp_<name>``. Results go to ``--out`` (default
``./overlap-lab-results/`` in the working directory, never inside the installed package); the
repository's committed results are written with ``--out experiments/results``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import pkgutil
import re
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

from overlap_lab.checks import check_profile_file
from overlap_lab.cli import inputs
from overlap_lab.metrics import compute_kernel_us
from overlap_lab.outdir import check_out_dir
from overlap_lab.runner import Backend, Local, in_order
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.workload import Workload
from overlap_lab.shared.ir.program import Program
from overlap_lab.shared.outputs.trace import Trace, provenance
from overlap_lab.shared.schedules import ScheduleConfig

#: Where results go unless ``--out`` says otherwise: the working directory, never the install.
RESULTS = Path("overlap-lab-results")
#: The results committed with the repository (``--out experiments/results`` from its root).
REPO_RESULTS = Path(__file__).parent / "results"
PROCESSES = 2  # this machine's cores; `--processes` / run(processes=) override


@dataclass(frozen=True)
class Case:
    """One simulation of a sweep: ``schedule`` built for ``workload`` on the ``gpu`` preset with
    ``cfg``. ``params`` are the sweep coordinates; they open the result row (after the schedule).
    ``keep`` names the trace (as cut by :attr:`Experiment.clip`) to store in the results file for
    the figure."""

    params: Mapping[str, Any]
    schedule: str
    workload: Workload
    gpu: str
    cfg: ScheduleConfig = field(default_factory=ScheduleConfig)
    keep: str | None = None
    #: a Program -> Program pass applied before simulating (a what-if on the schedule's kernels);
    #: module-level, so the pool can pickle it
    transform: Callable[[Program], Program] | None = None


def standard_metrics(trace: Trace, program: Program, case: Case) -> dict[str, Any]:
    """The default measurement: step time, exposed and comm-only communication, compute time."""
    return {
        "step_time_us": trace.step_time_us,
        "exposed_comm_us": trace.exposed_comm_us(),
        "comm_only_us": trace.comm_only_us(),
        "compute_kernel_us": compute_kernel_us(trace),
    }


def middle_layer(case: Case) -> int:
    """The MoE layer halfway through the case's model: a steady-state layer to look at."""
    model = case.workload.model
    return (model.first_k_dense + model.num_layers) // 2


def _whole(trace: Trace, case: Case) -> Trace:
    return trace


@dataclass(frozen=True)
class Experiment:
    """A declared experiment. ``measure`` and ``clip`` run in the pool's workers, so they must be
    module-level functions (pickled by name); the others run in the calling process. ``derive``
    adds columns that compare rows (speed-ups, see :func:`speedup`) and may drop rows; ``clip``
    cuts the traces the cases keep; ``meta`` is written into the results file as is (the sweep's
    constants)."""

    name: str
    title: str
    cases: Callable[[], Iterable[Case]]
    measure: Callable[[Trace, Program, Case], dict[str, Any]] = standard_metrics
    derive: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None
    clip: Callable[[Trace, Case], Trace] = _whole
    figure: Callable[[dict[str, Any], Path], None] | None = None
    notes: Callable[[dict[str, Any]], str] | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    #: Simulates a case its own way (a module-level function, run in the pool's workers) for
    #: experiments whose cases are not schedules, e.g. one collective of every EP rank.
    simulate: Callable[[Case], tuple[dict[str, Any], Trace | None]] | None = None
    #: Printed on stdout after the run (e.g. each row's error against a published table).
    summary: Callable[[dict[str, Any]], str] | None = None


# ---------------------------------------------------------------------------------------------
# Running


def simulate_case(
    case: Case,
    measure: Callable[[Trace, Program, Case], dict[str, Any]] = standard_metrics,
    clip: Callable[[Trace, Case], Trace] = _whole,
    profile: str = "auto",
) -> tuple[dict[str, Any], Trace | None]:
    """Build, simulate and measure one case: its row, and its kept trace (or None). ``profile``
    names the calibration profile (``sim.profile``; auto: the preset's built-in one)."""
    from overlap_lab import api

    res = api.simulate(
        case.schedule,
        case.workload,
        case.gpu,
        case.cfg,
        profile=profile,
        transform=case.transform,
    )
    row = {"schedule": case.schedule, **case.params, **measure(res.trace, res.program, case)}
    return row, (clip(res.trace, case) if case.keep else None)


@lru_cache(maxsize=8)
def _profile(spec: str, gpu: str):
    """A profile per (spec, preset), loaded once per worker process."""
    from overlap_lab.sim.profile import load_profile, resolve

    return load_profile(resolve(spec, gpu))


def run(
    exp: Experiment,
    processes: int | None = None,
    *,
    out: Path = RESULTS,
    command: str | Sequence[str] | None = None,
    profile: str = "auto",
    commit: str | None = None,
    backend: Backend | None = None,
) -> Path:
    """Sweep ``exp``'s cases on ``processes`` local workers (default :data:`PROCESSES`; 1 runs in
    this process) or on ``backend`` (``overlap_lab.runner.Ray()``: a Ray cluster), write
    ``out/<name>.json``, then draw the figure and write the notes from that file. ``command`` is
    the command line as typed (a list, or one string split at spaces; None: called from Python);
    ``commit`` the repository state to record (default: now). Returns the JSON path."""
    cases = list(exp.cases())
    labels = [c.keep for c in cases if c.keep]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"{exp.name}: two cases keep a trace under the same label")
    check_profile_file(profile)  # bounded (shared.files), before sim.profile parses it
    for c in cases:  # a bad profile fails here, in one line, not in a worker
        _profile(profile, c.gpu)
    one = (
        exp.simulate
        if exp.simulate is not None
        else partial(simulate_case, measure=exp.measure, clip=exp.clip, profile=profile)
    )
    backend = backend if backend is not None else Local(processes or PROCESSES)
    results = in_order(one, cases, backend=backend, progress=exp.name, leave=False)
    rows = [row for row, _ in results]
    if exp.derive is not None:
        rows = exp.derive(rows)
    typed = command.split() if isinstance(command, str) else command
    profiles = (
        {"profiles": {g: _profile_name(profile, g) for g in sorted({c.gpu for c in cases})}}
        if exp.simulate is None
        else {}
    )
    prov = provenance(
        typed, {"experiment": exp.name, "profile": profile, **profiles, **case_inputs(cases)}
    )
    doc = {
        "experiment": exp.name,
        "title": exp.title,
        "tool": prov["tool"],
        "version": prov["version"],
        "command": " ".join(typed) if typed else f"python -m overlap_lab.experiments {exp.name}",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": commit or git_commit(),
        "presets": presets(cases),
        **profiles,
        **dict(exp.meta),
        "rows": rows,
        "provenance": prov,
        "traces": {c.keep: _stored(t) for c, (_, t) in zip(cases, results, strict=True) if c.keep},
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{exp.name}.json"
    path.write_text(_dumps(_jsonable(doc)))
    draw(exp, path)
    return path


def _profile_name(spec: str, gpu: str) -> str:
    p = _profile(spec, gpu)
    return "roofline" if p is None else p.name


def draw(exp: Experiment, path: Path) -> None:
    """The figure and the notes of ``exp`` from its results file (no simulation)."""
    if not path.is_file():
        raise ConfigError(
            f"--draw: no results for {exp.name} at {path}: run `python -m overlap_lab.experiments "
            f"{exp.name} --out {path.parent}` first"
        )
    from overlap_lab.shared.files import read_json

    doc = read_json(path, "--draw: results file")
    if not isinstance(doc, dict):
        raise ConfigError(f"--draw: results file {path} holds no results object")
    try:
        if exp.figure is not None:
            from overlap_lab.figures import paper_style

            with paper_style():
                exp.figure(doc, path.with_suffix(""))
        if exp.notes is not None:
            path.with_suffix(".md").write_text(exp.notes(doc))
    except (KeyError, IndexError, TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(
            f"--draw: results file {path} lacks what {exp.name} draws from ({type(e).__name__}: {e})"
        ) from None


def kept_traces(doc: Mapping[str, Any]) -> dict[str, Trace]:
    """The traces a results file keeps, by label, in case order."""
    return {k: Trace.from_chrome(v) for k, v in doc.get("traces", {}).items()}


def git_commit() -> str | None:
    """HEAD of the repository, with ``+dirty`` when the tree has changes; None without git."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def presets(cases: Sequence[Case]) -> dict[str, Any]:
    """The model and GPU presets the cases used, as simulated (overrides included)."""
    models = {c.workload.model.name: c.workload.model for c in cases}
    gpus = {c.gpu: get_gpu(c.gpu) for c in cases}
    return {
        "models": {k: dataclasses.asdict(v) for k, v in sorted(models.items())},
        "gpus": {k: dataclasses.asdict(v) for k, v in sorted(gpus.items())},
    }


def case_inputs(cases: Sequence[Case]) -> dict[str, Any]:
    """Every case's full inputs for the results file's provenance: ``cases`` in case order, each
    its schedule, sweep coordinates, batch, layout, GPU preset, every knob, the transform (by
    its qualified name) and the trace it keeps; its model a key into ``models`` and its GPU one
    into ``gpus``, which hold each once, as simulated. Models are keyed by content, not name: two
    cuts of one model are two entries (``presets`` keeps one per name, for the figures)."""
    models: dict[str, Any] = {}
    out = []
    for c in cases:
        m = c.workload.model
        key = next((k for k, v in models.items() if v == m), None)
        if key is None:
            key, n = m.label, 2
            while key in models:
                key, n = f"{m.label}#{n}", n + 1
            models[key] = m
        out.append(
            {
                "schedule": c.schedule,
                "params": dict(c.params),
                "model": key,
                "batch": c.workload.batch,
                "parallel": c.workload.parallel,
                "gpu": c.gpu,
                "knobs": c.cfg.as_dict(),
                "transform": _callable_name(c.transform),
                "keep": c.keep,
            }
        )
    gpus = {g: get_gpu(g) for g in sorted({c.gpu for c in cases})}
    return {"models": models, "gpus": gpus, "cases": out}


def _callable_name(f: Callable | None) -> str | None:
    """A case's transform in words: its qualified name, a ``partial`` with its arguments
    (``exp_sm_sharing.capped(sms=112)``), so the record says which what-if ran."""
    if f is None:
        return None
    if isinstance(f, partial):
        args = [repr(a) for a in f.args] + [f"{k}={v!r}" for k, v in f.keywords.items()]
        return f"{_callable_name(f.func)}({', '.join(args)})"
    name = getattr(f, "__qualname__", type(f).__qualname__)
    return f"{getattr(f, '__module__', None) or type(f).__module__}.{name}"


def _stored(trace: Trace) -> dict[str, Any]:
    """A kept trace as Chrome trace JSON, with only its scalar meta (schedule, gpu, ...)."""
    meta = {k: v for k, v in trace.meta.items() if isinstance(v, (str, int, float, bool))}
    return Trace(trace.spans, meta).to_chrome()


def _dumps(doc: dict[str, Any]) -> str:
    """JSON with one-space indents, except the kept traces' events and the provenance's cases:
    one line each (a case's batch lists every sequence's KV length)."""
    events: list[str] = []

    def mark(e: Any) -> str:
        events.append(json.dumps(e, separators=(",", ":")))
        return f"@@event{len(events) - 1}@@"

    traces = {
        k: {**v, "traceEvents": [mark(e) for e in v["traceEvents"]]}
        for k, v in doc.get("traces", {}).items()
    }
    doc = {**doc, "traces": traces}
    prov = doc.get("provenance")
    if isinstance(prov, dict) and isinstance(prov.get("inputs", {}).get("cases"), list):
        inputs = {**prov["inputs"], "cases": [mark(c) for c in prov["inputs"]["cases"]]}
        doc["provenance"] = {**prov, "inputs": inputs}
    text = json.dumps(doc, indent=1) + "\n"
    return re.sub(r'"@@event(\d+)@@"', lambda m: events[int(m.group(1))], text)


def _jsonable(x: Any) -> Any:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _jsonable(dataclasses.asdict(x))
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


# ---------------------------------------------------------------------------------------------
# Helpers the experiments share


def speedup(
    rows: list[dict[str, Any]],
    *,
    over: Mapping[str, Any],
    by: Sequence[str],
    metric: str = "step_time_us",
    column: str = "speedup",
    change: bool = False,
    base_column: str | None = None,
) -> list[dict[str, Any]]:
    """Add ``column`` = base[metric] / row[metric] to every row (minus 1 with ``change``: the
    throughput change), where base is the row matching ``over`` with the same values of ``by``;
    ``base_column`` also copies base[metric] into each row. Returns ``rows``."""
    base = {_key(r, by): r for r in rows if all(r.get(k) == v for k, v in over.items())}
    for r in rows:
        b = base[_key(r, by)][metric]
        if base_column:
            r[base_column] = b
        r[column] = b / r[metric] - (1 if change else 0)
    return rows


def _key(row: Mapping[str, Any], by: Sequence[str]) -> str:
    return json.dumps([row[k] for k in by])


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str = "") -> str:
    """A markdown table; ``align`` ``"---:"`` right-aligns every column."""
    lines = ["| " + " | ".join(header) + " |", "|" + f"{align or '---'}|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def stamp(doc: Mapping[str, Any]) -> str:
    """``Command: `...`  ·  date`` for the head of a notes file."""
    return f"Command: `{doc['command']}`  ·  {doc['date'][:10]}"


# ---------------------------------------------------------------------------------------------
# Command line


def declared() -> dict[str, Experiment]:
    """Every ``experiments/exp_*.py`` module's ``EXPERIMENT``, by name, sorted."""
    found = {}
    for info in sorted(pkgutil.iter_modules([str(Path(__file__).parent)]), key=lambda m: m.name):
        if info.name.startswith("exp_"):
            exp = getattr(
                importlib.import_module(f"overlap_lab.experiments.{info.name}"), "EXPERIMENT", None
            )
            if isinstance(exp, Experiment):
                found[exp.name] = exp
    return found


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The runner's options, on its own parser or on ``overlap-lab experiments``."""
    ap.add_argument("names", nargs="*", help="experiments to run (default: all declared)")
    ap.add_argument("--list", action="store_true", help="list the declared experiments")
    ap.add_argument(
        "--processes",
        type=inputs.limited(inputs.Limit(int, 1, 256)),
        default=PROCESSES,
        help="worker processes [1..256]",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=RESULTS,
        help=f"results folder (default: ./{RESULTS}; the repository's: experiments/results)",
    )
    ap.add_argument("--draw", action="store_true", help="redraw from the results files only")
    ap.add_argument(
        "--profile",
        default="auto",
        help="calibration profile: a file, h800-published or roofline; auto: the preset's "
        "built-in one (h800 -> h800-published), else roofline (default: auto)",
    )


def main(
    argv: Sequence[str] | None = None,
    *,
    prog: str = "python -m overlap_lab.experiments",
    default: Sequence[str] = (),
) -> int:
    """``python -m overlap_lab.experiments [NAME ...] [--list] [--processes N] [--out DIR] [--draw]``;
    ``default``: the names run when none is given (all when empty)."""
    ap = inputs.OneLineParser(prog=prog, description="Run declared experiments.")
    add_arguments(ap)
    args = ap.parse_args(argv)
    return _guarded(ap, args, argv, prog, default)


def _guarded(ap, args, argv, prog, default) -> int:
    try:
        return _main(ap, args, argv, prog, default)
    except ConfigError as e:
        print(f"{prog}: error: {str(e).strip()}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return inputs.closed_stdout()


def register(sub) -> None:
    """``overlap-lab experiments``: this runner as a subcommand of the command line, registered
    through the ``overlap_lab.commands`` entry point group (pyproject.toml), since the command
    line sits below the experiments and may not import them."""
    s = sub.add_parser(
        "experiments",
        help="run declared experiments and write their results",
        description="Run declared experiments (all, or those named) and write their results, "
        "figures and notes into --out.",
    )
    add_arguments(s)
    s.set_defaults(func=partial(_command, s))


def _command(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The handler of ``overlap-lab experiments``: the runner, with the command line recorded
    as typed (``overlap-lab experiments ...``)."""
    typed = list(getattr(args, "command_line", None) or ["overlap-lab", "experiments"])
    return _guarded(ap, args, typed[2:], "overlap-lab experiments", ())


def _main(ap, args, argv, prog, default) -> int:
    exps = declared()
    if args.list:
        for name, exp in exps.items():
            print(f"{name:24s} {exp.title}")
        return 0
    names = [n.removeprefix("exp_") for n in args.names] or list(default) or list(exps)
    unknown = [n for n in names if n not in exps]
    if unknown:
        ap.error(f"unknown experiment(s) {', '.join(unknown)}; declared: {', '.join(exps)}")
    command = [*prog.split(), *(argv if argv is not None else sys.argv[1:])]
    commit = git_commit()  # once: the files this command writes must not make the next "dirty"
    check_out_dir(args.out)  # before any experiment runs
    for name in names:
        try:
            if args.draw:
                path = args.out / f"{name}.json"
                draw(exps[name], path)
            else:
                path = run(
                    exps[name],
                    args.processes,
                    out=args.out,
                    command=command,
                    commit=commit,
                    profile=args.profile,
                )
        except ConfigError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2
        except OSError as e:
            print(f"{prog}: error: {args.out}: {e.strerror or e}", file=sys.stderr)
            return 2
        if exps[name].summary is not None:
            print(exps[name].summary(json.loads(path.read_text())))
        print(f"{name}: {path}", file=sys.stderr)
    return 0
