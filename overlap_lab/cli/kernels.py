"""``overlap-lab kernels --device cuda|cpu``: the executor's kernels against the device's best on
the same shapes (``real.kernel_table``), as a table and, with ``--out DIR``, ``kernels.json`` and
its markdown ``kernels.md`` in that folder (checked as every ``--out`` folder is). The CPU run is a dry run of the same path on tiny shapes (CI runs it). The
JSON file's ``provenance`` (``shared.outputs.trace.provenance``) records the version, the command line
and the options; the shapes are the version's own (``real.kernel_table.SHAPES``)."""

from __future__ import annotations

from overlap_lab.measure import KERNELS_CPU_REPEATS, KERNELS_CPU_WARMUP


def add_parser(sub) -> None:
    """Register ``kernels`` on the CLI's subparsers."""
    s = sub.add_parser(
        "kernels",
        help="the executor's kernels against the device's best on the same shapes",
        description="Time every op class the executor runs (GEMM and grouped GEMM: BF16, on an "
        "SM budget, FP8; attention; RMSNorm), each call in a CUDA graph on a GPU, against the "
        "device's best on the same shapes (cuBLAS, DeepGEMM alone or torch._scaled_mm, SDPA, "
        "FlashMLA alone, a device-to-device copy; the roofline beside); the goal is 0.7 of the "
        "best for every class. --device cpu is a dry run on tiny shapes.",
    )
    s.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    s.add_argument("--out", default=None,
                   help="folder for kernels.json and kernels.md (default: print only)")  # fmt: skip
    s.add_argument("--force", action="store_true", help="write into --out even if it holds "
                   "other files")  # fmt: skip
    s.add_argument("--repeats", type=int, default=10, help="timings per kernel (median; "
                   f"--device cpu: at most {KERNELS_CPU_REPEATS})")  # fmt: skip
    s.add_argument("--warmup", type=int, default=3,
                   help=f"untimed calls first (--device cpu: at most {KERNELS_CPU_WARMUP})")  # fmt: skip
    s.set_defaults(func=cmd_kernels)


def cmd_kernels(args) -> int:
    from overlap_lab.measure import check_kernel_run, write_kernel_report

    check_kernel_run(args.device, warmup=args.warmup, repeats=args.repeats)
    if args.out:  # before the timing: a folder of other files is refused without --force
        from overlap_lab.outdir import check_out_dir

        check_out_dir(args.out, mine_only=not args.force)
    from overlap_lab.real.kernel_table import kernel_table, table_text

    report = kernel_table(args.device, warmup=args.warmup, repeats=args.repeats)
    text = table_text(report)
    if args.out:
        inputs = {"device": args.device, "repeats": args.repeats, "warmup": args.warmup}
        cmd = getattr(args, "command_line", None)
        out, md = write_kernel_report(report, text, args.out, cmd, inputs)
        head, _, goal = text.rstrip("\n").rpartition("\n")
        text = f"{head}\nwrote {out}, {md}\n{goal}\n"
    print(text, end="")
    return 0
