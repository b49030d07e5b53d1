"""``overlap-lab kernels --device cuda|cpu``: the executor's kernels against the device's best on
the same shapes (``real.kernel_table``), as a table and, with ``--out DIR``, ``kernels.json`` and
its markdown ``kernels.md`` in that folder (checked as every ``--out`` folder is). The CPU run is a dry run of the same path on tiny shapes (CI runs it). The
JSON file's ``provenance`` (``shared.outputs.trace.provenance``) records the version, the command line
and the options; the shapes are the version's own (``real.kernel_table.SHAPES``)."""

from __future__ import annotations

import json
from pathlib import Path

from overlap_lab.shared.errors import ConfigError

#: The most timed and untimed calls per kernel of the CPU dry run: its host timings of tiny
#: shapes mean nothing, and at the GPU's maxima (10,000 and 1,000) it ran past two minutes.
CPU_REPEATS = 100
CPU_WARMUP = 10


def add_parser(sub) -> None:
    """Register ``kernels`` on the CLI's subparsers."""
    s = sub.add_parser(
        "kernels",
        help="the executor's kernels against the device's best on the same shapes",
        description="Time every op class the executor runs (GEMM, grouped GEMM, attention, "
        "elementwise) against the device's best kernel on the same shapes (cuBLAS torch.mm / "
        "bmm, SDPA is_causal, a device-to-device copy for bandwidth); the goal is at least 0.7 "
        "of the best for every class. --device cpu is a dry run on tiny shapes.",
    )
    s.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    s.add_argument("--out", default=None,
                   help="folder for kernels.json and kernels.md (default: print only)")  # fmt: skip
    s.add_argument("--force", action="store_true", help="write into --out even if it holds "
                   "other files")  # fmt: skip
    s.add_argument("--repeats", type=int, default=10, help="timed calls per kernel (median; "
                   f"--device cpu: at most {CPU_REPEATS})")  # fmt: skip
    s.add_argument("--warmup", type=int, default=3,
                   help=f"untimed calls first (--device cpu: at most {CPU_WARMUP})")  # fmt: skip
    s.set_defaults(func=cmd_kernels)


def cmd_kernels(args) -> int:
    try:
        import torch
    except ImportError:
        raise ConfigError("kernels needs torch") from None
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("kernels --device cuda needs a CUDA GPU; none is visible "
                          "(--device cpu for the dry run)")  # fmt: skip
    if args.repeats < 1 or args.warmup < 0:
        raise ConfigError("--repeats must be >= 1 and --warmup >= 0")
    if args.device == "cpu" and (args.repeats > CPU_REPEATS or args.warmup > CPU_WARMUP):
        raise ConfigError(
            f"kernels --device cpu is a dry run: --repeats at most {CPU_REPEATS} and --warmup at "
            f"most {CPU_WARMUP}, got {args.repeats} and {args.warmup}"
        )
    if args.out:  # before the timing: a folder of other files is refused without --force
        from overlap_lab.outdir import check_out_dir

        check_out_dir(args.out, mine_only=not args.force)
    from overlap_lab.real.kernel_table import kernel_table, table_text

    report = kernel_table(args.device, warmup=args.warmup, repeats=args.repeats)
    text = table_text(report)
    if args.out:
        from overlap_lab.shared.outputs.trace import provenance

        inputs = {"device": args.device, "repeats": args.repeats, "warmup": args.warmup}
        prov = provenance(getattr(args, "command_line", None), inputs)
        out, md = Path(args.out) / "kernels.json", Path(args.out) / "kernels.md"
        out.write_text(json.dumps({**report, "provenance": prov}, indent=2, sort_keys=True) + "\n")
        md.write_text(text)
        text = text.rstrip("\n")
        head, _, goal = text.rpartition("\n")
        text = f"{head}\nwrote {out}, {md}\n{goal}\n"
    print(text, end="")
    return 0
