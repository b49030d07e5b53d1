"""The input-checking layer of the command line: every option checked before anything runs.

``apply_limits(parser)`` gives every option of the ``overlap-lab`` parser whose destination is in
``LIMITS`` a checking argparse type (finite, in range) and states the range in its ``-h`` text;
``check_args(args)`` then checks what one option alone cannot: options meaningful only for one
mode or schedule, names (case-insensitive, like ``--model`` and ``--gpu``), routing files, the
memory of the run (:mod:`overlap_lab.checks`) and the output folder
(:func:`overlap_lab.outdir.check_out_dir`), so that bad input fails in one line before any
simulation starts. Every failure is a ConfigError whose
message says what is allowed.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import typing
from pathlib import Path

from overlap_lab.limits import LIMITS, RUN_LIMITS, record_limits
from overlap_lab.limits import Limit as Limit  # (re-exported: experiments' options use it)
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import GPU, gpu_fields
from overlap_lab.shared.inputs.knobs import Knob
from overlap_lab.shared.schedules.common import MAX_SEQS

# ---- per-option limits ---------------------------------------------------------------------------
# (the ranges themselves are the library's: overlap_lab.limits)


def _number(kind: type, s: str):
    s = s.strip()
    if kind is int:
        try:
            return int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {s!r}")
    return v


def limited(limit: Knob, *, is_list: bool = False):
    """An argparse type: one number (or a comma-separated list of them) that ``limit`` (a knob
    record, :func:`Limit`) accepts, refused in its words."""

    item = dataclasses.replace(limit, type=limit.scalar)  # a list's: each value's record

    def one(s: str):
        v = _number(limit.scalar, s)
        why = item.refusal(v)
        if why:
            raise argparse.ArgumentTypeError(why)
        return v

    def many(s: str):
        parts = s.split(",")
        if any(not p.strip() for p in parts):
            raise argparse.ArgumentTypeError(
                f"expected comma-separated values in {limit.range_text()} with none empty, "
                f"got {s!r}"
            )
        if len(parts) > MAX_SEQS:
            raise argparse.ArgumentTypeError(f"expected at most {MAX_SEQS} values")
        return tuple(one(p) for p in parts)

    return many if is_list or limit.is_tuple else one


def _actions(parser: argparse.ArgumentParser):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in dict.fromkeys(a.choices.values()):
                yield from _actions(sub)
        else:
            yield a


def apply_limits(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give every limited option its checking type and state the range in its help (the knob
    records' ranges read now: a schedule installed since this module was imported has its own)."""
    limits = {**LIMITS, **record_limits()}
    for a in _actions(parser):
        if a.choices is not None and a.type is None and a.option_strings:
            a.type = str.lower  # names are case-insensitive, like --model and --gpu
        lim = limits.get(a.dest)
        if lim is None or not a.option_strings or a.nargs == 0:
            continue
        a.type = limited(lim)
        unit = f" {lim.unit}" if lim.unit else ""
        a.help = f"{a.help or ''} [{'each ' if lim.is_tuple else ''}{lim.range_text()}{unit}]"
        if a.dest in ("nvlink_gbps", "rdma_gbps"):
            a.help += (
                f"; scales the effective bandwidth too unless --{a.dest[:-5]}-eff-gbps is given"
            )
        if a.dest in MODE_DEFAULTS:  # None in the parser, so that check_args sees it given
            a.default = None
            a.help += f" (default: {MODE_DEFAULTS[a.dest]})"
    return parser


def add_guard_options(p: argparse.ArgumentParser) -> None:
    """The options of this layer itself (sim, show, compare, run)."""
    g = p.add_argument_group("limits")
    g.add_argument(
        "--allow-oversubscribe",
        action="store_true",
        help="go on when model weights plus KV cache exceed the GPU memory (--mem-gib)",
    )
    g.add_argument(
        "--max-events",
        type=int,
        default=None,
        help="simulation budget in SimPy events (default: 100000 + 25 per instruction + 2 per "
        "flow of the Program, + 2 per cohort a kernel can run as beside other streams' kernels: "
        "a bound on what a run can need, not an estimate)",
    )


# ---- cross-option checks -------------------------------------------------------------------------

#: Option defaults this layer applies itself (None in the parser, so that "given" is visible).
MODE_DEFAULTS = {"kv_len": 4096, "tokens_per_seq": 1, "extend_len": 4096, "prefix_len": 0}


def flag(name: str) -> str:
    """The option spelling of a field or ``dest`` name (``kv_len`` -> ``--kv-len``)."""
    return "--" + name.replace("_", "-")


def _given(args, dest: str) -> bool:
    return getattr(args, dest, None) is not None


def check_args(args) -> None:
    """Check a parsed ``overlap-lab`` command line as a whole; fill the mode defaults. Values
    that pass but look like a unit mix-up are warned about last, once every check has passed (a
    refusal stays one line)."""
    typed = {k.name: getattr(args, k.name, None) for k in gpu_fields()}  # before derived ones
    _check_args(args)
    warn_implausible(typed)


def _check_args(args) -> None:
    cmd = getattr(args, "command", None)
    if getattr(args, "profile", None) not in (None, "from-trace"):
        from overlap_lab.checks import check_profile_file

        check_profile_file(args.profile)
    if cmd not in ("sim", "show", "compare", "run"):
        if isinstance(getattr(args, "mode", None), str):  # calibrate, validate: workload options
            from overlap_lab.checks import mode_of

            args.mode = mode_of(args.mode)
            _check_mode_options(args)
        return
    _check_names(args, cmd)
    _check_mode_options(args)
    if cmd != "run":
        from overlap_lab.checks import check_knobs_read

        check_knobs_read(vars(args), _schedules(args, cmd))
    from overlap_lab.checks import check_comm_sms

    check_comm_sms(vars(args), gpu_from(args).num_sms)  # --gpu, --gpu-file, --num-sms
    if cmd == "run":
        _check_run(args)
        return
    _check_ranks(args)
    if cmd == "compare" and args.sensitivity is not None:
        from overlap_lab.sensitivity import design_from

        design_from(args.sensitivity)  # its bounds, before the nominal runs
    if getattr(args, "out", None):
        from overlap_lab.outdir import check_out_dir

        check_out_dir(args.out, mine_only=not getattr(args, "force", False))


def _check_names(args, cmd: str) -> None:
    from overlap_lab.checks import mode_of, schedule_names

    args.mode = mode_of(args.mode)
    if getattr(args, "deepep_mode", None) is not None:
        args.deepep_mode = args.deepep_mode.lower()
    if cmd == "compare":
        args.schedules = ",".join(schedule_names(args.schedules.split(",")))
    elif args.schedule is not None:
        extra = ("all",) if cmd == "run" else ()
        (args.schedule,) = schedule_names([args.schedule], extra=extra)


def _schedules(args, cmd: str) -> list[str]:
    return args.schedules.split(",") if cmd == "compare" else [args.schedule]


def _check_mode_options(args) -> None:
    from overlap_lab.checks import check_batch_fields

    check_batch_fields(args.mode, vars(args))  # before the defaults: what was given
    for dest, v in MODE_DEFAULTS.items():
        mtp = dest == "tokens_per_seq" and getattr(args, "mtp", None)
        if getattr(args, dest, None) is None and not mtp:
            setattr(args, dest, v)  # --mtp N: N + 1 tokens per sequence (api.workload)


def warn_implausible(values: dict[str, float | None]) -> None:
    """One line on stderr for each hardware option given (``values``: GPU field -> the value
    typed, None: not given) that looks typed in another unit (``checks.implausible``); each is
    said once per run (a sweep checks every case)."""
    from overlap_lab.checks import implausible
    from overlap_lab.shared.inputs.preset_files import note

    for msg in implausible(values):
        note(as_options(msg, tuple(values)), "warning")


#: The real executor's scaled-down models (``real.model.TINY_NAMES``), for `run --device cpu`.
TINY_MODELS = ("tiny-mla", "tiny-gqa")


def tiny_cpu_model(args) -> bool:
    """`run --device cpu` with one of the CPU check's tiny models (no simulator workload)."""
    return (
        getattr(args, "command", None) == "run"
        and args.device == "cpu"
        and str(args.model).lower() in TINY_MODELS
    )


def _check_run(args) -> None:
    from overlap_lab.measure import run_choices

    if _given(args, "batch") and args.batch > RUN_LIMITS["batch"]:
        raise ConfigError(f"run: --batch must be at most {RUN_LIMITS['batch']}, got {args.batch}")
    if args.ranks > RUN_LIMITS["ranks"]:
        raise ConfigError(f"run: --ranks must be at most {RUN_LIMITS['ranks']}, got {args.ranks}")
    # (the options' own limits first: on a machine without a GPU they are said all the same)
    args.device, args.backend, args.kernels = run_choices(args.device, args.backend, args.kernels)
    if args.device != "cpu" and args.out:  # the GPU run writes traces there, as sim does
        from overlap_lab.outdir import check_out_dir

        check_out_dir(args.out, mine_only=not args.force)


def _check_ranks(args) -> None:
    from overlap_lab.checks import check_ranks
    from overlap_lab.shared.inputs.presets import load_model

    check_ranks(load_model(model_spec(args)), args.group_limited, args.imbalance)


# ---- files ---------------------------------------------------------------------------------------


def add_force_option(s: argparse.ArgumentParser) -> None:
    """--force: write into an --out folder that holds files the tool did not write (refused
    without it: :func:`check_out_dir`). Not among the sim options a sweep spec may set."""
    s.add_argument(
        "--force", action="store_true", help="write into --out even if it holds other files"
    )


def check_workload(w, gpu, args, cfg) -> None:
    """The memory checks of a built workload (sim, compare, run): ``checks.check_workload``."""
    from overlap_lab import checks

    cmd = getattr(args, "command", None)
    named = args.schedules.split(",") if cmd == "compare" else [getattr(args, "schedule", None)]
    sim = (getattr(args, "ranks", "symmetric"), getattr(args, "imbalance", "balanced"))
    allow = getattr(args, "allow_oversubscribe", False)
    checks.check_workload(w, gpu, cfg, named, allow, sim if cmd in ("sim", "compare") else None)


# ---- output --------------------------------------------------------------------------------------


def as_options(message: str, names: tuple[str, ...]) -> str:
    """An API message as the command line says it: each parameter it names (``names``:
    ``ConfigError.names``) shown as its option (``comm_sms`` -> ``--comm-sms``)."""
    import re

    for n in names:
        message = re.sub(rf"(?<![\w-]){re.escape(n)}(?![\w-])", flag(n), message)
    return message


def closed_stdout() -> int:
    """The reader of stdout went away (``| head``): no traceback, exit 1 (Python's advice)."""
    import sys

    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (tests capture it)
        pass
    return 1


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports bad input in one line on stderr and exits 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


# ---- what the options name ---------------------------------------------------------------------

_GPU_IDENTITY = ("name", "arch")


def _gpu_overrides() -> tuple[Knob, ...]:
    return tuple(k for k in gpu_fields() if k.name not in _GPU_IDENTITY)


def _overrides(args, records: tuple[Knob, ...], prefix: str = "") -> dict[str, typing.Any]:
    """The knobs of ``records`` given on the command line (None: left out), by field name."""
    return {
        k.name: getattr(args, prefix + k.name)
        for k in records
        if getattr(args, prefix + k.name, None) is not None
    }


def gpu_from(args) -> GPU:
    """The preset or ``--gpu-file``, with the hardware overrides; a changed GPU is renamed
    (``h800+hbm-gbps=2000``) so no output calls it by the preset's name."""
    from overlap_lab import api

    return api.gpu(_spec(args, "gpu"), **_overrides(args, _gpu_overrides()))


def _spec(args, what: str) -> str | Path:
    """``--model``/``--gpu`` as typed (a preset's name, or a path to a file), or the path
    ``--model-file``/``--gpu-file`` gives: a path always, so a file is never read as a name."""
    file = getattr(args, f"{what}_file", None)
    return Path(file) if file else getattr(args, what)


def model_spec(args) -> str | Path:
    """The model the options name: :func:`_spec` of ``--model``/``--model-file``."""
    return _spec(args, "model")
