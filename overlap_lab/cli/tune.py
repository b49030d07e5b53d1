"""``overlap-lab tune`` (the best configuration for a deployment under a latency target) and
``overlap-lab plot`` (two columns of a results file): options parsed, the API called
(:func:`overlap_lab.tune.tune`, :func:`overlap_lab.figures.results_figure`), what it returns
printed. docs/tune.md describes both."""

from __future__ import annotations

import sys
from pathlib import Path

from overlap_lab.cli.options import _int_list, _str_list, add_profile_option, positive_int


def add_parsers(sub) -> None:
    """Register ``tune`` and ``plot`` on the CLI's subparsers."""
    from overlap_lab.shared.inputs.hardware import GPUS
    from overlap_lab.shared.inputs.workload import MODELS

    s = sub.add_parser(
        "tune",
        help="search schedules, batch, layout and knobs for the most tokens/s per GPU under a "
        "latency target",
        description="Search every schedule that runs the workload, the batch, the EP layout and "
        "each schedule's knobs for the most tokens/s per GPU within --max-ms (decode) or "
        "--max-prefill-ms (prefill); print each schedule's Pareto frontier, the best "
        "configuration with its win share over perturbed costs, and its launch flags; draw the "
        "frontier. docs/tune.md says how it searches.",
    )
    g = s.add_argument_group("deployment")
    g.add_argument("--model", default="deepseek-v3", help=f"one of {', '.join(MODELS)}")
    g.add_argument(
        "--model-file", default=None, metavar="PATH", help="a model file; replaces --model"
    )
    g.add_argument("--gpu", default="h800", help=f"one of {', '.join(GPUS)}")
    g.add_argument("--gpu-file", default=None, metavar="PATH", help="a GPU file; replaces --gpu")
    g.add_argument("--gpus", type=positive_int, default=32, help="GPUs of the deployment")
    g.add_argument("--gpus-per-node", type=positive_int, default=8)
    g.add_argument(
        "--mode",
        dest="phase",
        default="decode",
        choices=("decode", "prefill", "both"),
        help="the phase to tune; both: a prefill-decode disaggregated pair, each on its GPUs",
    )
    g.add_argument("--prefill-gpus", type=positive_int, default=None,
                   help="--mode both: the prefill side's GPUs (default: --gpus)")  # fmt: skip
    g.add_argument("--kv-len", type=positive_int, default=None, help="decode: tokens per sequence")
    g.add_argument("--extend-len", type=positive_int, default=None, help="prefill: prompt tokens")
    g.add_argument("--layers", type=positive_int, default=None, help="cut the model (quick looks)")
    g.add_argument("--model-path", default=None,
                   help="what the launch command loads (default: the model's name)")  # fmt: skip
    g = s.add_argument_group("target")
    g.add_argument("--max-ms", type=float, default=None, help="decode: most ms between a "
                   "sequence's tokens (one step; pp: a round of its micro-batches)")  # fmt: skip
    g.add_argument("--max-prefill-ms", type=float, default=None,
                   help="prefill: most ms per prefill step")  # fmt: skip
    g = s.add_argument_group("search space (default: learnt from the schedules' knob records)")
    g.add_argument("--schedules", type=_str_list, default=None, help="default: every schedule")
    g.add_argument("--batches", type=_int_list, default=None,
                   help="sequences (decode) or prompts (prefill) per GPU to try")  # fmt: skip
    g.add_argument("--ep", dest="ep_sizes", type=_int_list, default=None,
                   help="EP sizes to try (default: each that divides the experts and --gpus)")  # fmt: skip
    g.add_argument("--pp-stages", type=_int_list, default=None,
                   help="pipeline stages to try where a schedule runs them (default: 2,4)")  # fmt: skip
    g.add_argument("--mtp-drafts", type=_int_list, default=None,
                   help="MTP draft tokens per step to try besides 0 (default: 1)")  # fmt: skip
    g.add_argument("--try", dest="tries", action="append", default=[], metavar="KNOB=V1,V2",
                   help="the values to try for a knob, replacing its record's; KNOB= holds it at "
                   "its default (repeatable)")  # fmt: skip
    g.add_argument("--exhaustive", action="store_true",
                   help="every knob combination instead of the coarse-to-fine search")  # fmt: skip
    g.add_argument("--per-schedule", action="store_true",
                   help="prune a batch only with points of its own schedule: every schedule's "
                   "frontier complete, not only the overall one (more simulations)")  # fmt: skip
    g.add_argument("--mtp-accept", type=float, default=None,
                   help="share of MTP draft tokens accepted, per position (default: 0.85)")  # fmt: skip
    g = s.add_argument_group("outputs and runs")
    g.add_argument("--sensitivity", default=None, metavar="DESIGN",
                   help="the design the best is re-run over (docs/uncertainty.md), or off "
                   "(default: oat=1,lhs=0,inputs=hbm+bf16_rate+rdma+profile)")  # fmt: skip
    g.add_argument("--rivals", type=int, default=2,
                   help="other schedules' best configurations in the sensitivity run")  # fmt: skip
    add_profile_option(s)
    g.add_argument("--out", default="overlap-lab-tune",
                   help="folder for tune.csv (resumable), the frontier figure, tune.json and "
                   "launch.sh")  # fmt: skip
    g.add_argument("--force", action="store_true",
                   help="write into --out even if it holds other files")  # fmt: skip
    g.add_argument("--figure-format", default="png", choices=("png", "pdf", "svg"))
    g.add_argument("--backend", default="local", choices=("local", "ray"))
    g.add_argument("--processes", type=positive_int, default=None,
                   help="local worker processes (default: one per CPU)")  # fmt: skip
    g.add_argument("--address", default=None, help="Ray cluster address")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--json", action="store_true", help="print tune.json's record instead")
    s.set_defaults(func=cmd_tune)

    p = sub.add_parser(
        "plot",
        help="draw two columns of a sweep's (or tune's) results file, one line per --hue",
        description="Draw column --y against column --x of a results file (a sweep's or a "
        "tune's CSV, or its Parquet file), one line per value of --hue.",
    )
    p.add_argument("results", help="the results file")
    p.add_argument("--x", required=True, help="column on the x axis, e.g. batch")
    p.add_argument("--y", required=True, help="column on the y axis, e.g. tokens_per_s_gpu")
    p.add_argument("--hue", type=_str_list, default=(), help="column(s) whose values are lines")
    p.add_argument("--out", default=None,
                   help="figure path, .png, .pdf or .svg (default: beside RESULTS)")  # fmt: skip
    p.add_argument("--width", default="single", help="single, double or inches")
    p.add_argument("--title", default=None)
    p.set_defaults(func=cmd_plot)


def cmd_tune(args) -> int:
    from overlap_lab import runner
    from overlap_lab.outdir import check_out_dir
    from overlap_lab.tune import SENSITIVITY, tune
    from overlap_lab.tune_space import MTP_ACCEPT, MTP_DRAFTS, PP_STAGES, Space, parse_tries

    values = parse_tries(args.tries)
    space = Space(
        schedules=tuple(s.lower() for s in args.schedules) if args.schedules else None,
        batches=args.batches,
        ep=args.ep_sizes,
        pp=args.pp_stages or PP_STAGES,
        drafts=args.mtp_drafts if args.mtp_drafts is not None else MTP_DRAFTS,
        values=values,
    )
    sens = args.sensitivity or SENSITIVITY
    if str(sens).lower() in ("off", "none", "0", "false"):
        sens = False
    if args.out:
        check_out_dir(args.out, mine_only=not args.force)
    backend = runner.backend_of(args.backend, processes=args.processes, address=args.address)
    try:
        result = tune(
            args.model_file or args.model,
            args.gpu_file or args.gpu,
            args.gpus,
            args.phase,
            args.max_ms,
            max_prefill_ms=args.max_prefill_ms,
            space=space,
            exhaustive=args.exhaustive,
            per_schedule=args.per_schedule,
            gpus_per_node=args.gpus_per_node,
            prefill_gpus=args.prefill_gpus,
            kv_len=args.kv_len or 4096,  # None: the option's default (cli.inputs.MODE_DEFAULTS)
            extend_len=args.extend_len or 4096,
            layers=args.layers,
            profile=args.profile,
            mtp_accept=MTP_ACCEPT if args.mtp_accept is None else args.mtp_accept,
            sensitivity=sens,
            rivals=args.rivals,
            out=args.out or None,
            figure_format=args.figure_format,
            processes=args.processes,
            backend=backend,
            progress=not args.no_progress and not args.json,
            model_path=args.model_path,
            command=getattr(args, "command_line", None),
        )
    except KeyboardInterrupt:
        print(
            f"overlap-lab tune: interrupted; run the same command again to resume from {args.out}",
            file=sys.stderr,
        )
        return 130
    if args.json:
        import json

        print(json.dumps(result.as_dict(), indent=1, default=str))
        return 0
    print(result.text())
    for f in result.files:
        print(f"wrote {f}")
    return 0


def cmd_plot(args) -> int:
    from overlap_lab.figures.curves import results_figure
    from overlap_lab.sweep_csv import read_table

    src = Path(args.results)
    out, notes = results_figure(
        read_table(src),
        args.x,
        args.y,
        tuple(args.hue),
        args.out or src.with_name(f"{src.stem}.{args.x}-{args.y}.png"),
        width=args.width,
        title=args.title,
        source=str(src),
    )
    for n in notes:
        print(f"overlap-lab plot: {n}", file=sys.stderr)
    print(f"wrote {Path(out)}")
    return 0
