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
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from overlap_lab.shared.errors import ConfigError
from overlap_lab.simcase import SimCase
from overlap_lab.sweep import MAX_CASES, Spec, expand, rows_file, stats_text  # noqa: F401 - MAX_CASES: the CLI's too
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


def load_spec(src: str | Path | Mapping[str, Any]) -> Spec:
    """Read and expand a spec (a YAML/JSON file, or the mapping itself: ``sweep.expand``); every
    value is checked by its option's own parser before any simulation starts."""
    if not isinstance(src, Mapping):
        from overlap_lab.shared.files import read_mapping

        src = read_mapping(src, "sweep spec")
    actions = _knob_actions()
    return expand(src, actions, lambda where, k, v: _convert(actions[k], v))


def case_inputs(knobs: Mapping[str, Any]) -> SimCase:
    """One case's knobs as ``overlap-lab sim`` reads the same options, with the same checks (the
    memory check included): its :class:`~overlap_lab.simcase.SimCase`."""
    from overlap_lab import api
    from overlap_lab.checks import partial_knob_readers
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
    for dest, owners in partial_knob_readers().items():
        if dest in vals and schedule not in owners:
            vals[dest] = plain.get(dest)
    args = argparse.Namespace(**{**vals, "command": "sim", "out": ""})
    try:  # fills the mode's defaults; a bad case is an error row, in the options' words
        inputs.check_args(args)
    except ConfigError as e:
        raise ConfigError(inputs.as_options(str(e), e.names)) from None
    w, gpu = workload_from(args), gpu_from(args)
    cfg = config_from(args)
    inputs.check_workload(w, gpu, args, cfg)
    profile = api.resolve_profile(getattr(args, "profile", "auto"), gpu)
    return SimCase(args.schedule, w, gpu, cfg, ranks_from(args), profile, args.max_events)


def run_sweep(
    spec: Spec | str | Path | Mapping[str, Any],
    out: str | Path,
    *,
    processes: int = 2,
    backend: str = "local",
    address: str | None = None,
    **kw: Any,
) -> dict[str, int]:
    """:func:`overlap_lab.sweep.run_sweep` of a spec (a file, a mapping or a loaded
    :class:`~overlap_lab.sweep.Spec`), its cases read as ``sim``'s options; ``backend``:
    ``local`` (``processes`` workers; 1 runs here) or ``ray`` (at ``address``, else
    ``RAY_ADDRESS``, else a local Ray); ``kw``: that function's (``progress``, ``limit``,
    ``dedupe``, ``command``). The provenance file also records every knob's default."""
    from overlap_lab import runner, sweep

    spec = spec if isinstance(spec, Spec) else load_spec(spec)
    inputs = {"knobs": list(spec.knobs), "cases": list(spec.cases), "defaults": defaults()}
    where = runner.backend_of(backend, processes=processes, address=address)
    return sweep.run_sweep(spec, out, case_inputs, backend=where, inputs=inputs, **kw)


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
    from overlap_lab.shared.inputs.preset_files import hold_notes

    spec = load_spec(args.spec)
    for kind, msg in hold_notes(False):  # a case's notes are said as it is read, in its worker
        print(f"overlap-lab: {kind}: {msg}", file=sys.stderr)
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
        kept = len(read_rows(rows_file(out)))
        print(
            f"overlap-lab sweep: interrupted; {kept} rows kept in {out}, run again to resume",
            file=sys.stderr,
        )
        return 130
    print(stats_text(out, stats), file=sys.stderr)
    return 0
