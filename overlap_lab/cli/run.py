"""`overlap-lab run`: the real executor from the command line.

:func:`cmd_run` checks the options a run cannot honour and builds the workload as `sim` does;
:func:`run_main` turns the parsed options (any object with attributes; missing ones take the
defaults below: :data:`DEFAULTS`; ``workload`` is the GPU run's, built by :func:`cmd_run` like
`sim`'s) into the arguments of :mod:`overlap_lab.measure` and prints what comes back (``kernels``:
the kernel families preferred, ``real.kernels``).

- GPU: run the schedule, write the measured trace (Chrome JSON, its ``otherData.provenance``
  the command line and the inputs: ``measure.run_provenance``) and a timeline figure under
  ``out``, print the summary (the keys of `sim`, plus backend and device).
- ``--device cpu --check``: the equivalence check for every schedule (or the one named); with
  ``--json`` prints ``{"max_rel_diff_vs_serial": {schedule: diff}, ..., "provenance": ...}``;
  exit 1 if any difference exceeds the tolerance or a schedule fails (an unordered read counts).
- ``--device cpu --ranks N``: the same through N gloo processes with EP over them; schedules
  that refuse a workload or whose Program is not symmetric (``pp``) are listed in ``skipped``,
  a failing rank in ``errors`` (exit 1), never a traceback.
- No GPU and no ``--device cpu``: one line saying so, exit 2.
"""

from __future__ import annotations

import json as _json
import sys

from overlap_lab.cli import inputs
from overlap_lab.cli.options import config_from, subcommand_parser, workload_from
from overlap_lab.shared.errors import ConfigError

#: `run` on a GPU keeps this many layers by default: a full-size model does not fit on one GPU
GPU_RUN_LAYERS = 4

DEFAULTS = dict(
    schedule=None,
    model="deepseek-v3",
    gpu="h100",
    mode="decode",
    batch=None,
    workload=None,
    prefix_len=0,
    ep=None,
    layers=None,
    backend="auto",
    device="auto",
    check=False,
    ranks=1,
    json=False,
    out="results/run",
    warmup=2,
    repeats=5,
    seed=0,
    tolerance=None,
    cfg=None,
    kernels=(),
)

NO_GPU = (
    "no CUDA GPU found: `overlap-lab run` measures on a GPU; use --device cpu --check for the "
    "CPU equivalence check"
)


def _opt(args, name):
    v = getattr(args, name, None)
    return DEFAULTS[name] if v is None else v


def run_main(args) -> int:
    try:
        return _run(args)
    except (ConfigError, ImportError) as e:  # a missing torch says how to install it
        print(f"overlap-lab: error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    device = _opt(args, "device")
    if device == "cpu":
        return _run_cpu(args)
    import torch

    if not torch.cuda.is_available():
        print(NO_GPU)
        return 2
    return _run_gpu(args)


def _run_cpu(args) -> int:
    from overlap_lab.measure import check_on_cpu, schedules_to_run

    ranks = int(_opt(args, "ranks"))
    names = schedules_to_run(_opt(args, "schedule"))
    out = check_on_cpu(
        names,
        model=_opt(args, "model"),
        gpu=_opt(args, "gpu"),
        ranks=ranks,
        seed=_opt(args, "seed"),
        tolerance=_opt(args, "tolerance"),
        cfg=_opt(args, "cfg"),
        kernels=tuple(_opt(args, "kernels")),
        command=getattr(args, "command_line", None),
    )
    tol = out["tolerance"]
    key = "max_rel_diff_vs_one_process" if ranks > 1 else "max_rel_diff_vs_serial"
    if _opt(args, "json"):  # the check writes no file: this JSON, redirected, is its record
        print(_json.dumps(out, indent=2, sort_keys=True))
    else:
        from overlap_lab.report import check_text

        print(check_text(out, key, tol))
    return 0 if out["ok"] else 1


def _run_gpu(args) -> int:
    from overlap_lab.measure import run_on_gpu, schedules_to_run

    w = _opt(args, "workload")  # built by cmd_run, as for `sim`
    if w is None:
        raise ConfigError("a GPU run needs the workload (run it through `overlap-lab run`)")
    schedule = _opt(args, "schedule")
    names = schedules_to_run(schedule) if schedule in (None, "all") else [schedule]
    summaries = run_on_gpu(
        names,
        w,
        gpu=_opt(args, "gpu"),
        cfg=_opt(args, "cfg"),
        backend=_opt(args, "backend"),
        seed=_opt(args, "seed"),
        warmup=_opt(args, "warmup"),
        repeats=_opt(args, "repeats"),
        out_dir=_opt(args, "out"),
        command=getattr(args, "command_line", None),
        kernels=tuple(_opt(args, "kernels")),
    )
    if _opt(args, "json"):
        print(
            _json.dumps(
                summaries if len(summaries) > 1 else summaries[names[0]], indent=2, default=str
            )
        )
    else:
        from overlap_lab.report import gpu_run_text

        print(gpu_run_text(summaries))
    return 0


# -- the subcommand ----------------------------------------------------------------------------


def _given(args) -> set[str]:
    """The options of `run` set to something other than their default."""
    d = subcommand_parser("run").parse_args(["--device", "cpu", "--check"])
    d.command = "run"
    default_mode, d.mode = d.mode, args.mode
    inputs.check_args(d)  # the mode's defaults filled in, as they were for ``args``
    defaults = {**vars(d), "mode": default_mode}
    return {k for k, v in vars(args).items() if k in defaults and v != defaults[k]}


def cmd_run(args) -> int:
    from overlap_lab.measure import check_cpu_check_inputs, require_torch

    require_torch()
    if args.device == "cpu":
        given = _given(args)
        check_cpu_check_inputs(given, args.model if "model" in given else None)
    args.cfg = config_from(args)
    if args.layers is None and args.device != "cpu":
        args.layers = GPU_RUN_LAYERS
    # the same workload `sim` builds from the same options (the CPU check's tiny models have none)
    args.workload = None if inputs.tiny_cpu_model(args) else workload_from(args)
    return run_main(args)
