"""`overlap-lab sweep SPEC`: the sweep subcommand (library: ``overlap_lab.experiments.sweep``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


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
    from overlap_lab.experiments.sweep import load_spec, run_sweep

    spec = load_spec(args.spec)
    out = Path(args.out) if args.out else Path(args.spec).with_suffix(".csv")
    stats = run_sweep(
        spec,
        out,
        processes=args.processes,
        backend=args.backend,
        address=args.address,
        progress=not args.no_progress,
        limit=args.limit,
    )
    print(
        f"{out}: {stats['cases']} cases, {stats['done_before']} done before, "
        f"{stats['simulated']} simulated, {stats['duplicates']} duplicates, "
        f"{stats['errors']} errors",
        file=sys.stderr,
    )
    return 0
