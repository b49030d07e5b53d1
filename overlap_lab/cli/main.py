"""`overlap-lab`: simulate, show, list, compare and run overlap schedules.

    overlap-lab sim --schedule serial --model deepseek-v3 --gpu h800 --mode decode --batch 128 --ep 32
    overlap-lab show --schedule tbo ...           # the Program's text form
    overlap-lab schedules                         # each schedule, with the upstream code it follows
    overlap-lab compare --schedules serial,tbo,sbo ...
    overlap-lab run --device cpu --check          # the real executor (GPU, or CPU equivalence)
    overlap-lab tune --gpus 32 --max-ms 50        # the best schedule, batch and knobs

The entry point: the parser of every subcommand and the handlers of ``sim``, ``show``,
``schedules`` and ``compare``; the options are built in :mod:`overlap_lab.cli.options`, the other
subcommands in their own modules. Every option has a default. Bad input: one line on stderr, exit
code 2.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from overlap_lab import report
from overlap_lab.cli import inputs
from overlap_lab.cli.calibrate import register_calibration_commands
from overlap_lab.cli.options import (
    Parser,
    add_model_options,
    add_profile_option,
    add_run_options,
    add_sim_options,
    check_pp_size,
    check_program_options,
    config_from,
    figure_from,
    figure_options,
    gpu_from,
    profile_from,
    rank_options,
    ranks_from,
    workload_from,
    workload_options,
)
from overlap_lab.cli.run import cmd_run
from overlap_lab.cli.sweep import add_parser as add_sweep
from overlap_lab.cli.tune import add_parsers as add_tune
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.preset_files import hold_notes
from overlap_lab.shared.ir.validate import ProgramError
from overlap_lab.shared.schedules import BASELINE, SCHEDULES

# ---- commands ------------------------------------------------------------------------------------


def cmd_sim(args) -> int:
    from overlap_lab import api, program_sim, provenance

    if args.program is not None:  # the Program as written: parsed, validated, simulated
        result = program_sim.simulate_program(
            args.program, gpu_from(args), profile=args.profile, max_events=args.max_events,
            cost_model=args.cost_model, network=args.network, fast_forward=args.fast_forward,
        )  # fmt: skip
        prov = provenance.program_record(getattr(args, "command_line", None), result)
        text = report.program_summary
    else:
        check_pp_size(args.schedule, args)
        result = api.simulate(
            args.schedule,
            workload_from(args),
            gpu_from(args),
            config_from(args),
            ranks=ranks_from(args),
            profile=args.profile,
            max_events=args.max_events,
            cost_model=args.cost_model,
            network=args.network,
        )
        prov, text = _provenance(args, result), report.summary
    res = result.as_dict()
    if args.out:
        files = report.write_run(result, Path(args.out), provenance=prov, **figure_from(args))
        res["files"] = [str(f) for f in files]
    if args.json:  # the record beside the result, not in it: Result.as_dict() is the API's
        print(report.to_json({**res, "provenance": prov}))
    else:
        print(text(res))
        for f in res.get("files", []):
            print(f"  wrote {f}")
    return 0


def _provenance(args, result) -> dict:
    """What a written trace and ``sim --json`` record of their run (``provenance.run_record``)."""
    from overlap_lab.provenance import run_record

    return run_record(getattr(args, "command_line", None), result, ranks_from(args))


def cmd_show(args) -> int:
    from overlap_lab.simcase import SimCase, shown

    check_pp_size(args.schedule, args)
    w, gpu, cfg = workload_from(args), gpu_from(args), config_from(args)
    lowered = shown(SimCase(args.schedule, w, gpu, cfg, ranks_from(args)))
    sys.stdout.write(str(lowered))
    if args.profile != "auto":  # durations only when asked: the default output is the Program
        from overlap_lab.calibrate import cost_comments

        sys.stdout.write(cost_comments(lowered, gpu, profile_from(args, gpu)))
    return 0


def cmd_schedules(args) -> int:
    from overlap_lab.shared.schedules import describe

    print(report.schedules_text(describe()))
    return 0


def cmd_compare(args) -> int:
    from overlap_lab import api

    w, gpu, cfg = workload_from(args), gpu_from(args), config_from(args)
    names = [n.strip() for n in args.schedules.split(",") if n.strip()]
    table = api.compare(
        names,
        w,
        gpu,
        cfg,
        pp_stages=args.pp_size,
        progress=not args.json,
        ranks=ranks_from(args),
        profile=args.profile,
        max_events=args.max_events,
        cost_model=args.cost_model,
        network=args.network,
        sensitivity=args.sensitivity,
    )
    files = []
    if args.out:
        files = report.write_comparison(
            table,
            Path(args.out),
            provenance_of=lambda result: _provenance(args, result),
            **figure_from(args),
        )
    if args.json:
        from overlap_lab.provenance import compare_record

        sens = {} if table.sensitivity is None else {"sensitivity": table.sensitivity.as_dict()}
        prov = compare_record(
            getattr(args, "command_line", None),
            names,
            w,
            gpu,
            cfg,
            ranks=ranks_from(args),
            profile=args.profile,
            pp_stages=args.pp_size,
            sensitivity=args.sensitivity,
            cost_model=args.cost_model,
            network=args.network,
        )
        doc = {"results": table.as_dicts(), "caveats": table.caveats(), **sens}
        print(report.to_json({**doc, "provenance": prov}))
        return 0
    print(table.text())
    for f in files:
        print(f"wrote {f}")
    return 0


def parser() -> argparse.ArgumentParser:
    from overlap_lab.shared.outputs.trace import provenance

    p = Parser(prog="overlap-lab", description=__doc__.split("\n\n")[0])
    version = provenance(None)["version"]  # the installed version, as every results file records
    p.add_argument("--version", action="version", version=f"overlap-lab {version}")
    sub = p.add_subparsers(dest="command", parser_class=Parser)
    sub.required = True

    s = sub.add_parser("sim", help="simulate one schedule and write its trace and timeline")
    add_sim_options(s)
    add_model_options(s)
    inputs.add_force_option(s)
    s.add_argument("--program", default=None, metavar="FILE", help="simulate this Program text "
                   "(as `overlap-lab show` prints it, edited or not) instead of building "
                   "--schedule's; see docs/program.md")  # fmt: skip
    s.set_defaults(func=cmd_sim)

    s = sub.add_parser("show", help="print the Program's text form")
    s.add_argument("--schedule", default=BASELINE)
    workload_options(s)
    rank_options(s)
    add_profile_option(s)
    s.set_defaults(func=cmd_show)

    s = sub.add_parser("schedules", help="list the schedules and the upstream code each follows")
    s.set_defaults(func=cmd_schedules)

    s = sub.add_parser("compare", help="simulate several schedules on one workload")
    s.add_argument("--schedules", default=",".join(SCHEDULES), help="the schedules to compare")
    s.add_argument(
        "--out", default="overlap-lab-out", help="directory for the stacked figure and traces"
    )
    inputs.add_force_option(s)
    s.add_argument("--json", action="store_true")
    figure_options(s)
    workload_options(s)
    rank_options(s)
    add_profile_option(s)
    add_model_options(s)
    s.add_argument(
        "--sensitivity",
        nargs="?",
        const=True,
        default=None,
        metavar="DESIGN",
        help="re-run over perturbed costs and print each schedule's range, wins and the "
        "schedules it is not separated from (docs/uncertainty.md); DESIGN: e.g. "
        "lhs=8,seed=1,oat=0,inputs=hbm+rdma (default: one-at-a-time + lhs=4, seed 0)",
    )
    s.set_defaults(func=cmd_compare)

    s = sub.add_parser("run", help="run a schedule with the real executor (GPU, or --device cpu)")
    add_run_options(s)
    s.set_defaults(func=cmd_run)
    register_calibration_commands(sub)
    add_sweep(sub)
    add_tune(sub)
    __import__("overlap_lab.cli.kernels", fromlist=["add_parser"]).add_parser(sub)
    _add_plugins(sub)
    return inputs.apply_limits(p)


#: Entry point group of subcommands that live above the command line (``experiments``): each
#: entry is a function that adds its subparser to the ``overlap-lab`` subparsers.
PLUGINS = "overlap_lab.commands"


def _add_plugins(sub) -> None:
    """Add the subcommands of the :data:`PLUGINS` entry points, by name. One that fails to load
    or register is one line on stderr; the other commands work all the same."""
    from overlap_lab.shared.plugins import Registry

    commands = Registry(PLUGINS, "command", {})
    for name in sorted(commands.names()):
        try:
            commands.load(name)(sub)
        except Exception as e:  # noqa: BLE001 - any failure of a plugin is its own
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            kind = "" if isinstance(e, ConfigError) else f"{type(e).__name__}: "
            print(f"overlap-lab: error: {commands.where(name)} is broken: {kind}{first}",
                  file=sys.stderr)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from overlap_lab.checks import ImplausibleValue

    warnings.simplefilter("ignore", ImplausibleValue)  # said once checks pass (check_args)
    args = parser().parse_args(argv)
    # as typed: what the results files record (provenance)
    args.command_line = ["overlap-lab", *(sys.argv[1:] if argv is None else argv)]
    hold_notes(True)  # said once the command succeeded: never a line before an error's
    program = getattr(args, "program", None) is not None  # sim --program: no workload
    try:
        if program:
            check_program_options(args)
        inputs.check_args(args)  # every option, alone and together, before anything runs
        if args.command in ("sim", "compare", "run") and not (
            inputs.tiny_cpu_model(args) or program
        ):
            w, gpu = workload_from(args), gpu_from(args)
            inputs.check_workload(w, gpu, args, config_from(args))
        code = args.func(args)
        for kind, msg in hold_notes(False):
            print(f"overlap-lab: {kind}: {msg}", file=sys.stderr)
        return code
    except ConfigError as e:
        msg = inputs.as_options(str(e).strip(), e.names)
        if isinstance(e, ProgramError):
            # a built-in schedule's Program: the instructions listed under the first line point
            # a schedule's author at the fault (the API keeps them); a user typed options
            msg = msg.splitlines()[0]
        print(f"overlap-lab: error: {msg}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return inputs.closed_stdout()
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's code for SIGINT
        print(f"overlap-lab {args.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as e:  # writing the outputs failed after the checks (disk full, say)
        where = f"{e.filename}: " if e.filename else ""
        print(f"overlap-lab: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    finally:
        hold_notes(False)


if __name__ == "__main__":
    sys.exit(main())
