"""``overlap-lab sweep SPEC``: a spec file's cases, parsed as ``overlap-lab sim``'s options.

A spec (YAML or JSON) names fixed knobs and the grid to sweep; a knob is any option of
``overlap-lab sim`` (workload, hardware overrides, schedule knobs, host costs, ranks and routing),
by its option name with ``-`` or ``_``::

    base:                      # the same in every case
      model: deepseek-v3
      gpu: h800
      mode: decode
    grid:                      # the cartesian product, first key slowest
      schedule: [serial, sbo, tbo]
      batch: [32, 64, 128]
      sbo_comm_sms: [8, 16, 24]
    cases:                     # optional: more cases, each merged over base (no grid)
      - {schedule: tbo, ranks: explicit, imbalance: "zipf:1.2", ep: 16}

:func:`load_spec` expands and checks a spec; :func:`case_inputs` turns a case's knobs into the
API's records by ``sim``'s own option parser and checks, so that a case means what the same
options mean on the command line. The sweep (workers, deduplication, the CSV file, resuming) is
:func:`overlap_lab.sweep.run_sweep`, which calls :func:`case_inputs` in its workers.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from overlap_lab.shared.errors import ConfigError
from overlap_lab.simcase import SimCase
from overlap_lab.sweep import Spec
from overlap_lab.sweep_csv import read_rows

#: `sim` options that are not knobs of a simulation
NOT_KNOBS = frozenset(
    {"command", "func", "out", "figure_format", "json", "window", "rank", "width"}
)


@functools.cache
def _sim_parser() -> argparse.ArgumentParser:
    from overlap_lab.cli.options import subcommand_parser

    return subcommand_parser("sim")


@functools.cache
def _knob_actions() -> dict[str, argparse.Action]:
    return {
        a.dest: a
        for a in _sim_parser()._actions
        if a.dest not in NOT_KNOBS and a.dest != "help" and a.option_strings
    }


def defaults() -> dict[str, Any]:
    """Every knob of ``overlap-lab sim`` with its default."""
    return dict(_defaults())


@functools.cache
def _defaults() -> dict[str, Any]:
    ns = _sim_parser().parse_args(["--out", ""])
    return {k: v for k, v in vars(ns).items() if k not in NOT_KNOBS}


def _convert(action: argparse.Action, value: Any) -> Any:
    """A spec value as the option's parser reads it (lists for tuple options, YAML booleans)."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        text = ",".join(str(v) for v in value)
    elif isinstance(value, bool):
        text = "true" if value else "false"
    else:
        text = str(value)
    try:
        out = action.type(text) if action.type is not None else text
    except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
        raise ConfigError(f"sweep: {action.dest}={value!r}: {e}") from None
    if action.choices is not None and out not in action.choices:
        raise ConfigError(f"sweep: {action.dest} must be one of {', '.join(action.choices)}")
    return out


def _normalise(knobs: Mapping[str, Any], actions: Mapping[str, argparse.Action], where: str):
    out = {}
    for k, v in knobs.items():
        name = str(k).replace("-", "_")
        if name not in actions:
            raise ConfigError(
                f"sweep: unknown knob {k!r} in {where} (an option of overlap-lab sim)"
            )
        out[name] = v
    return out


#: The most cases one spec may expand to. Counted from the grid's sizes before anything is
#: expanded, so a grid that multiplies out to 1e8 cases is refused at once instead of filling
#: memory (each expanded case is a dict of its knobs, ~1 KB); 100,000 cases take hours to
#: simulate on a workstation, so a larger study is several specs (or a Ray cluster's sweeps).
MAX_CASES = 100_000


def load_spec(src: str | Path | Mapping[str, Any]) -> Spec:
    """Read and expand a spec (a YAML/JSON file, or the mapping itself); every value is checked
    by its option's own parser before any simulation starts, once per distinct value."""
    if not isinstance(src, Mapping):
        from overlap_lab.shared.files import read_mapping

        src = read_mapping(src, "sweep spec")
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
    actions = _knob_actions()
    base = _normalise(src.get("base") or {}, actions, "base")
    grid = _normalise(src.get("grid") or {}, actions, "grid")
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
    listed = [_normalise(c, actions, "cases") for c in raw_cases]
    for k, v in base.items():
        _convert(actions[k], v)
    for k, values in grid.items():
        for v in values:
            _convert(actions[k], v)
    for c in listed:
        for k, v in c.items():
            _convert(actions[k], v)
    knobs = list(base)
    for k in [*grid, *(k for c in listed for k in c)]:
        if k not in knobs:
            knobs.append(k)
    if "schedule" not in knobs:
        knobs.insert(0, "schedule")
    cases = []
    if grid or not listed:
        for values in itertools.product(*grid.values()):
            c = {**base, **dict(zip(grid, values))}
            cases.append({k: c.get(k) for k in knobs})
    cases += [{k: {**base, **c}.get(k) for k in knobs} for c in listed]
    return Spec(tuple(knobs), tuple(cases))


def case_inputs(knobs: Mapping[str, Any]) -> SimCase:
    """One case's knobs as ``overlap-lab sim`` reads the same options, with the same checks (the
    memory check included): its :class:`~overlap_lab.simcase.SimCase`."""
    from overlap_lab import api
    from overlap_lab.cli import inputs
    from overlap_lab.cli.options import config_from, gpu_from, ranks_from, workload_from

    actions = _knob_actions()
    vals = dict(defaults())
    for k, v in knobs.items():
        if v is not None:
            vals[k] = _convert(actions[k], v)
    # a grid crosses schedules with knobs of one schedule (serial x --comm-sms): where a knob
    # does not apply to the case's schedule it keeps its default, and such cases merge
    schedule = str(vals.get("schedule", "serial")).strip().lower()
    plain = defaults()
    for dest, owners in inputs.KNOB_SCHEDULES.items():
        if dest in vals and schedule not in owners:
            vals[dest] = plain.get(dest)
    args = argparse.Namespace(**{**vals, "command": "sim", "out": ""})
    inputs.check_args(args)  # fills the mode's defaults; a bad case is an error row
    w, gpu = workload_from(args), gpu_from(args)
    inputs.check_workload(w, gpu, args)
    profile = api.resolve_profile(getattr(args, "profile", "auto"), gpu)
    return SimCase(
        args.schedule, w, gpu, config_from(args), ranks_from(args), profile, args.max_events
    )


def run_sweep(
    spec: Spec | str | Path | Mapping[str, Any],
    out: str | Path,
    *,
    processes: int = 2,
    backend: str = "local",
    address: str | None = None,
    progress: bool = True,
    limit: int | None = None,
    dedupe: bool = True,
    command: Sequence[str] | None = None,
) -> dict[str, int]:
    """:func:`overlap_lab.sweep.run_sweep` of a spec (a file, a mapping or a loaded
    :class:`~overlap_lab.sweep.Spec`), its cases read as ``sim``'s options; ``backend``:
    ``local`` (``processes`` workers; 1 runs here) or ``ray`` (at ``address``, else
    ``RAY_ADDRESS``, else a local Ray). The provenance file also records the default of every
    knob a case leaves out."""
    from overlap_lab import runner, sweep

    if processes < 1:
        raise ConfigError(f"sweep: --processes must be at least 1, got {processes}")
    if not isinstance(spec, Spec):
        spec = load_spec(spec)
    inputs = {"knobs": list(spec.knobs), "cases": list(spec.cases), "defaults": defaults()}
    return sweep.run_sweep(
        spec,
        out,
        case_inputs,
        backend=runner.backend_of(backend, processes=processes, address=address),
        progress=progress,
        limit=limit,
        dedupe=dedupe,
        command=command,
        inputs=inputs,
    )


# ---------------------------------------------------------------------------------------------
# The subcommand


def add_parser(sub) -> None:
    """Register ``sweep`` on the CLI's subparsers."""
    s = sub.add_parser(
        "sweep",
        help="simulate every case of a sweep spec (YAML/JSON) into a CSV or Parquet file",
        description="Simulate every case of SPEC; rows stream to --out as they finish, and "
        "running again on the same --out resumes where it stopped.",
    )
    s.add_argument("spec", help="the sweep spec: base, grid and/or cases of `sim` options")
    s.add_argument(
        "--out", default=None, help="results file, .csv or .parquet (default: SPEC's name .csv)"
    )
    s.add_argument("--backend", default="local", choices=("local", "ray"))
    s.add_argument(
        "--processes", type=int, default=os.cpu_count() or 1, help="local worker processes"
    )
    s.add_argument(
        "--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else local)"
    )
    s.add_argument("--limit", type=int, default=None, help="stop after N new cases")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_sweep)


def cmd_sweep(args) -> int:
    spec = load_spec(args.spec)
    out = Path(args.out) if args.out else Path(args.spec).with_suffix(".csv")
    try:
        stats = run_sweep(
            spec,
            out,
            processes=args.processes,
            backend=args.backend,
            address=args.address,
            progress=not args.no_progress,
            limit=args.limit,
            command=getattr(args, "command_line", None),
        )
    except KeyboardInterrupt:  # the rows written so far stay: running again resumes
        partial = out.with_name(out.name + ".partial.csv") if out.suffix == ".parquet" else out
        kept = len(read_rows(partial))
        print(
            f"overlap-lab sweep: interrupted; {kept} rows kept in {out}, run again to resume",
            file=sys.stderr,
        )
        return 130
    print(
        f"{out}: {stats['cases']} cases, {stats['done_before']} done before, "
        f"{stats['simulated']} simulated, {stats['duplicates']} duplicates, "
        f"{stats['errors']} errors",
        file=sys.stderr,
    )
    return 0
