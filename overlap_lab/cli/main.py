"""`overlap-lab`: simulate, show, list, compare and run overlap schedules.

    overlap-lab sim --schedule serial --model deepseek-v3 --gpu h800 --mode decode --batch 128 --ep 32
    overlap-lab show --schedule tbo ...           # the Program's text form
    overlap-lab schedules                         # each schedule, with the upstream code it follows
    overlap-lab compare --schedules serial,tbo,sbo ...
    overlap-lab run --device cpu --check          # the real executor (GPU, or CPU equivalence)

The entry point: the parser of every subcommand and the handlers of ``sim``, ``show``,
``schedules`` and ``compare``; the options are built in :mod:`overlap_lab.cli.options`, the other
subcommands in their own modules. Every option has a default. Bad input: one line on stderr, exit
code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from overlap_lab.cli import inputs
from overlap_lab.cli.calibrate import cost_comments, register_calibration_commands
from overlap_lab.cli.options import (
    Parser,
    add_model_options,
    add_profile_option,
    add_run_options,
    add_sim_options,
    check_pp_size,
    config_from,
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
from overlap_lab.measure import workload_inputs
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.ir.validate import ProgramError
from overlap_lab.shared.schedules import BASELINE, SCHEDULES, prepare_workload
from overlap_lab.shared.schedules import build as build_schedule

if TYPE_CHECKING:
    from overlap_lab.shared.inputs.hardware import GPU
    from overlap_lab.shared.inputs.workload import Workload
    from overlap_lab.shared.schedules import ScheduleConfig


# ---- commands ------------------------------------------------------------------------------------


def _print_summary(res: dict) -> None:
    stages = res["gpus"] // res["ep"]  # pipeline stages of EP-sized groups of GPUs
    print(
        f"{res['schedule']}: {res['model']} {res['mode']} on {res['gpu']}, "
        f"{res['batch']} seqs ({res['tokens']} tokens) per GPU, EP {res['ep']}"
        + (f", PP {stages} ({res['gpus']} GPUs)" if stages > 1 else "")
    )
    it = res["iterations"]
    per = f" per iteration ({it} simulated)" if it > 1 else ""
    print(f"  step time        {res['iteration_us'] / 1e3:10.3f} ms{per}")
    print(f"  throughput       {res['tokens_per_s_gpu']:10.0f} tokens/s per GPU")
    print(f"  communication    {res['comm_us'] / 1e3:10.3f} ms{per}")
    print(f"  exposed comm     {res['exposed_comm_us'] / 1e3:10.3f} ms{per}")
    print(
        f"  SM time          {res['sm_compute'] * 100:9.1f} % compute, "
        f"{res['sm_comm'] * 100:.1f} % comm, {res['sm_idle'] * 100:.1f} % idle"
    )
    print(f"  ops              {res['num_ops']:10d}")
    if "cost_sources" in res:  # where the durations come from: a measurement or the roofline
        n: dict[str, int] = {}
        for by in res["cost_sources"].values():
            for s, k in by.items():
                n[s] = n.get(s, 0) + k
        measured = f"{n['profile']} from profile {res['profile']}, " if n.get("profile") else ""
        if n.keys() <= {"profile", "roofline", "link"}:
            print(
                f"  op durations     {measured}{n.get('roofline', 0)} from the roofline "
                f"(no measurement), {n.get('link', 0)} from the link model"
            )
        else:  # a plugged cost model's own sources
            print(f"  op durations     {', '.join(f'{k} from {s}' for s, k in sorted(n.items()))}")
    if "straggler_cost_us" in res:
        steps = [r["window_us"] for r in res["per_rank"]]
        print(f"  ranks explicit   {len(steps):10d}  ({res['imbalance']})")
        print(f"  straggler cost   {res['straggler_cost_us'] / 1e3:10.3f} ms{per}")
        print(f"  rank window ms   {min(steps) / 1e3:10.3f} .. {max(steps) / 1e3:.3f}")
    for mb in res["micro_batches"]:
        cut = ", splits a sequence" if mb.get("split_seq") else ""
        print(
            f"  micro-batch {mb['index']}: seqs [{mb['seq_lo']}, {mb['seq_hi']}), "
            f"{mb['tokens']} tokens padded to {mb['padded_tokens']}{cut}"
        )
    if "comm_sms" in res:
        print(f"  communication SMs {res['comm_sms']}")
    for note in res.get("notes", []):
        print(f"  note: {note}")
    for caveat in res.get("caveats", []):
        print(f"  {caveat}")
    for lane, busy in sorted(res["busy_us"].items()):
        print(f"  busy {lane:<22s} {busy / 1e3:10.3f} ms{per}")


def cmd_sim(args) -> int:
    from overlap_lab import api

    check_pp_size(args.schedule, args)
    w, gpu, cfg = workload_from(args), gpu_from(args), config_from(args)
    result = api.simulate(
        args.schedule,
        w,
        gpu,
        cfg,
        ranks=ranks_from(args),
        profile=args.profile,
        max_events=args.max_events,
        cost_model=args.cost_model,
        network=args.network,
    )
    res = result.as_dict()
    if args.out:
        from overlap_lab.figures import save_timeline

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result.trace.to_chrome(out / "trace.json", provenance=_provenance(args, result))
        fig = out / f"timeline.{args.figure_format}"
        save_timeline(
            result.trace,
            fig,
            window=args.window,
            rank=args.rank,
            width=args.width,
            title=_title(result),
        )
        res["files"] = [str(out / "trace.json"), str(fig)]
    if args.json:  # the record beside the result, not in it: Result.as_dict() is the API's
        print(inputs.to_json({**res, "provenance": _provenance(args, result)}))
    else:
        _print_summary(res)
        for f in res.get("files", []):
            print(f"  wrote {f}")
    return 0


def _provenance(args, result) -> dict:
    """What a written trace and ``sim --json`` record of their run: the version, the command
    line as typed and the full inputs as simulated (the model with its layers, the GPU with its
    overrides, the batch and layout, every schedule knob, the ranks and the profile the durations
    came from), so that a results file alone says how to reproduce it."""
    from overlap_lab.shared.outputs.trace import provenance
    from overlap_lab.sim.calibrate import profile_name

    inputs = {
        "schedule": result.schedule,
        **workload_inputs(result.workload, result.gpu, result.config),
        "ranks": ranks_from(args),
        "profile": profile_name(result.profile),
        "cost_model": result.trace.meta["cost_model"],
        "network": result.trace.meta["network"],
    }
    return provenance(getattr(args, "command_line", None), inputs)


def _compare_provenance(
    args: argparse.Namespace, names: list[str], w: Workload, gpu: GPU, cfg: ScheduleConfig
) -> dict[str, Any]:
    """``compare --json``'s record: the schedules compared and the one workload they share (the
    trace files record each schedule's own run, as ``sim``'s does)."""
    from overlap_lab.shared.outputs.trace import provenance
    from overlap_lab.sim.calibrate import profile_name
    from overlap_lab.sim.profile import profile_for

    inputs = {
        "schedules": names,
        **workload_inputs(w, gpu, cfg),
        "ranks": ranks_from(args),
        "profile": profile_name(profile_for(args.profile, gpu)),
        "cost_model": args.cost_model,
        "network": args.network,
        "pp_stages": args.pp_size,
        "sensitivity": args.sensitivity,
    }
    return provenance(getattr(args, "command_line", None), inputs)


def _title(result) -> str:
    """The workload in a figure's title: model, mode, batch, layout, GPU."""
    w = result.workload
    lay = f"EP{w.parallel.ep}" + (f" PP{w.parallel.pp}" if w.parallel.pp > 1 else "")
    return (
        f"{result.schedule}: {w.model.label} {w.batch.mode}, {w.batch.num_seqs} seqs/GPU "
        f"({w.batch.num_tokens} tok), {lay}, {result.gpu.name}"
    )


def cmd_show(args) -> int:
    from overlap_lab import api
    from overlap_lab.shared.ir.validate import validate

    check_pp_size(args.schedule, args)
    w, gpu, cfg = workload_from(args), gpu_from(args), config_from(args)
    w, _ = prepare_workload(args.schedule, w)  # the schedule's workload defaults, as simulated
    program = build_schedule(args.schedule, w, gpu, cfg)
    lowered = api.lower_ranks(program, w, gpu, ranks_from(args))
    validate(lowered, gpu.num_sms)  # what is shown is what is simulated: the lowered Program
    sys.stdout.write(str(lowered))
    if args.profile != "auto":  # durations only when asked: the default output is the Program
        sys.stdout.write(cost_comments(lowered, gpu, profile_from(args, gpu)))
    return 0


def cmd_schedules(args) -> int:
    from overlap_lab.shared.schedules import describe

    rows = describe()
    width = max(len(n) for n, _, _ in rows)
    for name, upstream, summary in rows:
        print(f"{name:<{width}}  {summary}")
        print(f"{'':<{width}}  upstream: {upstream}")
    print("\nRules and references of each: docs/schedules.md in the repository.")
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
    if args.out and table.sensitivity is not None:  # the ranges figure (docs/uncertainty.md)
        from overlap_lab.figures import sensitivity_ranges

        Path(args.out).mkdir(parents=True, exist_ok=True)
        files.append(Path(args.out) / f"sensitivity.{args.figure_format}")
        sensitivity_ranges(
            table.sensitivity, files[-1], title=_title(table.baseline).split(": ", 1)[1]
        )
    if args.out:
        from overlap_lab.figures import compare_timelines

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        fig = out / f"compare.{args.figure_format}"
        compare_timelines(
            table,
            fig,
            window=args.window,
            rank=args.rank,
            width=args.width,
            title=_title(table.baseline).split(": ", 1)[1],
        )
        files.append(fig)
        for row in table.rows:
            if row.result is not None:
                row.result.trace.to_chrome(
                    out / f"trace_{row.schedule.replace('+', '_')}.json",
                    provenance=_provenance(args, row.result),
                )
    if args.json:
        sens = {} if table.sensitivity is None else {"sensitivity": table.sensitivity.as_dict()}
        prov = _compare_provenance(args, names, w, gpu, cfg)
        doc = {"results": table.as_dicts(), "caveats": table.caveats(), **sens}
        print(inputs.to_json({**doc, "provenance": prov}))
        return 0
    print(table.text())
    for f in files:
        print(f"wrote {f}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="overlap-lab", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", parser_class=Parser)
    sub.required = True

    s = sub.add_parser("sim", help="simulate one schedule and write its trace and timeline")
    add_sim_options(s)
    add_model_options(s)
    inputs.add_force_option(s)
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
    args = parser().parse_args(argv)
    # as typed: what the results files record (provenance)
    args.command_line = ["overlap-lab", *(sys.argv[1:] if argv is None else argv)]
    try:
        inputs.check_args(args)  # every option, alone and together, before anything runs
        if args.command in ("sim", "compare", "run") and not inputs.tiny_cpu_model(args):
            w, gpu = workload_from(args), gpu_from(args)
            inputs.check_workload(w, gpu, args)
        return args.func(args)
    except ConfigError as e:
        msg = str(e).strip()
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
        print(f"overlap-lab: error: {e.filename or ''}: {e.strerror}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
