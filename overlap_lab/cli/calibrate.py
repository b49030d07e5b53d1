"""The calibration side of the command line: ``--profile`` and ``analyze``, ``calibrate``,
``validate``.

    overlap-lab sim --profile h800-published ...       # measured durations where rows apply
    overlap-lab analyze TRACE.json                       # busy, overlap, per-kernel-class table
    overlap-lab calibrate --from-trace TRACE.json ...    # a profile from a measured trace
    overlap-lab validate TRACE.json ...                  # measured vs predicted, op by op

Argument parsing and handlers live here (``--profile`` itself in :mod:`overlap_lab.cli.options`);
the work is in library modules (``sim.profile``, ``shared.outputs.analyze``,
:mod:`overlap_lab.calibrate`, :mod:`overlap_lab.validate`, :mod:`overlap_lab.provenance`) that
the real executor calls too. What each command writes records
what produced it (``shared.outputs.trace.provenance``): the ``--json`` output, ``predicted_trace.json``,
and ``<profile>.provenance.json`` beside a profile; a file read is named by its SHA-256.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from overlap_lab.cli.inputs import add_force_option
from overlap_lab.cli.options import (
    config_from,
    gpu_from,
    rank_options,
    ranks_from,
    workload_from,
    workload_options,
)
from overlap_lab.provenance import file_input, write_beside
from overlap_lab.shared.errors import ConfigError
from overlap_lab.sim.profile import BUILTIN, ROOFLINE, load_profile

# ---- commands ------------------------------------------------------------------------------------


def _out_dir(args) -> Path | None:
    """The figure folder, checked and made as sim's (``outdir.check_out_dir``); None for ''."""
    from overlap_lab.outdir import check_out_dir

    return check_out_dir(args.out, mine_only=not args.force) if args.out else None


def _provenance(args, inputs: dict[str, Any]) -> dict[str, Any]:
    """``shared.outputs.trace.provenance`` of this command line as typed (None: called from Python)."""
    from overlap_lab.shared.outputs.trace import provenance

    return provenance(getattr(args, "command_line", None), inputs)


def _workload_inputs(args) -> dict[str, Any]:
    """The workload, GPU, knobs and ranks the options name, under `sim`'s keys."""
    from overlap_lab.provenance import workload_inputs

    w, gpu, cfg = workload_from(args), gpu_from(args), config_from(args)
    return {**workload_inputs(w, gpu, cfg), "ranks": ranks_from(args)}


def cmd_analyze(args) -> int:
    from overlap_lab.report import write_analyzed
    from overlap_lab.shared.outputs.analyze import analyze, load_mapping, to_text
    from overlap_lab.validate import load_measured

    mapping = load_mapping(args.map)
    trace = load_measured(args.trace)
    a = analyze(trace, mapping, args.rank)
    res = a.to_json()
    out = _out_dir(args)
    if out is not None:
        fig = out / f"analyze_timeline.{args.figure_format}"
        write_analyzed(trace, mapping, a.rank, fig, title=f"{args.trace}, rank {a.rank}")
        res["files"] = [str(fig)]
    if args.json:
        inputs = {"trace": file_input(args.trace), "map": file_input(args.map), "rank": a.rank}
        print(json.dumps({**res, "provenance": _provenance(args, inputs)}, sort_keys=True))
        return 0
    sys.stdout.write(to_text(a))
    for f in res.get("files", []):
        print(f"wrote {f}")
    return 0


def _program_for(args, schedule: str):
    from overlap_lab.simcase import SimCase, build

    w, gpu, cfg = workload_from(args), gpu_from(args), config_from(args)
    w, program, _ = build(SimCase(schedule, w, gpu, cfg, ranks_from(args)))
    return program, w, gpu


def cmd_calibrate(args) -> int:
    from overlap_lab.outdir import check_out_file

    if (args.from_trace is None) == (args.device is None):
        raise ConfigError("calibrate needs exactly one of --from-trace TRACE or --device cuda")
    check_out_file(args.out, force=args.force)  # before the work: nothing replaced unasked
    if args.device is not None:
        from overlap_lab.calibrate import calibrate_on_device, parse_ints, parse_sizes

        w, gpu = workload_from(args), gpu_from(args)
        sizes = parse_sizes(args.sizes, w.batch.mode)
        budgets = parse_ints(args.sm_budgets, "--sm-budgets") or (gpu.num_sms,)
        inputs = {
            "device": args.device,
            **_workload_inputs(args),
            "sizes": sizes,
            "sm_budgets": budgets,
            "repeats": args.repeats,
        }
        profile = calibrate_on_device(
            w, gpu, config_from(args), sizes=sizes, budgets=budgets, repeats=args.repeats
        )
    else:
        from overlap_lab.calibrate import calibrate_from_trace
        from overlap_lab.validate import load_measured

        program, _, gpu = _program_for(args, args.schedule)
        trace = load_measured(args.from_trace, args.map, program)
        inputs = {
            "from_trace": file_input(args.from_trace),
            "map": file_input(args.map),
            "schedule": args.schedule,
            **_workload_inputs(args),
        }
        profile = calibrate_from_trace(
            trace,
            program,
            gpu,
            name=Path(args.out).stem,
            source=f"{args.from_trace} (schedule {args.schedule})",
        )
    path = profile.save(args.out)
    side = write_beside(path, _provenance(args, inputs))
    print(f"wrote {path}: {len(profile.rows)} rows from {profile.source} (provenance: {side})")
    return 0


def cmd_validate(args) -> int:
    from overlap_lab import validate as V

    program, _, gpu = _program_for(args, args.schedule)
    measured = V.load_measured(args.trace, args.map, program)
    profile = None if args.profile == "from-trace" else load_profile(args.profile)
    v, predicted, profile = V.validate(measured, program, gpu, profile, getattr(args, "seed", 0))
    res: dict[str, Any] = {"schedule": args.schedule, "profile": profile.name, **v.to_json()}
    named = args.profile in ("from-trace", ROOFLINE, *BUILTIN)  # else a file: its bytes count
    prov = _provenance(
        args,
        {
            "trace": file_input(args.trace),
            "map": file_input(args.map),
            "schedule": args.schedule,
            "predict": args.predict,
            **_workload_inputs(args),
            "profile": profile.name,  # the one the prediction used (from-trace: the trace's)
            "profile_given": args.profile,
            "profile_file": None if named else file_input(args.profile),
            "seed": getattr(args, "seed", 0),
        },
    )
    extra = {}
    if args.predict:
        other, _, _ = _program_for(args, args.predict)
        tr = V.predict(other, gpu, profile)
        extra[f"predicted {args.predict}"] = tr
        res["what_if"] = V.what_if(args.predict, tr, measured, predicted)
    out = _out_dir(args)
    if out is not None:
        fig = V.figure(measured, predicted, out / f"validate.{args.figure_format}", extra)
        predicted.to_chrome(out / "predicted_trace.json", provenance=prov)
        res["files"] = [str(fig), str(out / "predicted_trace.json")]
    if args.json:
        print(json.dumps({**res, "provenance": prov}, sort_keys=True))
        return 0
    print(f"validate {args.trace}: schedule {args.schedule}, profile {profile.name}")
    sys.stdout.write(V.to_text(v, what_if=res.get("what_if")))
    for f in res.get("files", []):
        print(f"wrote {f}")
    return 0


def register_calibration_commands(sub) -> None:
    """Add ``analyze``, ``calibrate`` and ``validate`` to the ``overlap-lab`` subparsers."""
    from overlap_lab.shared.schedules import BASELINE, SCHEDULES

    s = sub.add_parser("analyze", help="overlap and kernel classes of a torch.profiler trace")
    s.add_argument("trace", help="Chrome trace JSON (torch.profiler / Kineto, or ours; .gz ok)")
    s.add_argument("--map", default=None, help="JSON kernel-class mapping, tried before built-ins")
    s.add_argument("--rank", type=int, default=None, help="rank to analyze (default: the first)")
    s.add_argument("--out", default="overlap-lab-out", help="directory for the timeline ('' none)")
    add_force_option(s)
    s.add_argument("--figure-format", default="png", choices=("png", "pdf", "svg"))
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_analyze)

    s = sub.add_parser("calibrate", help="build a profile from a measured trace or a GPU")
    s.add_argument("--from-trace", default=None, help="a measured trace of --schedule's Program")
    s.add_argument("--map", default=None, help="kernel mapping with 'op' entries (foreign traces)")
    s.add_argument("--device", default=None, choices=("cuda",), help="microbenchmark this GPU")
    s.add_argument("--schedule", default=BASELINE, help=f"one of {', '.join(SCHEDULES)}")
    s.add_argument("--sizes", default="16,32,64,128,256,512", help="--device: tokens per rank")
    s.add_argument("--sm-budgets", default=None, help="--device: SM counts (default: all SMs)")
    s.add_argument("--repeats", type=int, default=5, help="--device: timed runs per case")
    s.add_argument("--out", default="overlap-lab-out/profile.json", help="profile file to write")
    s.add_argument("--force", action="store_true", help="replace --out even if another wrote it")
    workload_options(s)
    rank_options(s)
    s.set_defaults(func=cmd_calibrate)

    s = sub.add_parser("validate", help="a measured trace against the simulator's prediction")
    s.add_argument("trace", help="measured trace (overlap-lab run, or torch.profiler with --map)")
    s.add_argument("--schedule", default=BASELINE, help="the schedule the trace ran")
    s.add_argument(
        "--profile",
        default="from-trace",
        help="from-trace (default: the profile the measured trace yields), a profile file, "
        f"{', '.join(BUILTIN)} or {ROOFLINE}",
    )
    s.add_argument("--predict", default=None, help="also predict this schedule from the profile")
    s.add_argument("--map", default=None, help="kernel mapping with 'op' entries (foreign traces)")
    s.add_argument("--out", default="overlap-lab-out", help="directory for the figure ('' none)")
    add_force_option(s)
    s.add_argument("--figure-format", default="png", choices=("png", "pdf", "svg"))
    s.add_argument("--json", action="store_true")
    workload_options(s)
    rank_options(s)
    s.set_defaults(func=cmd_validate)
