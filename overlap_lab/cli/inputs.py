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
import math
import os
from dataclasses import dataclass

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import gpu_fields, host_cost_fields
from overlap_lab.shared.schedules import schedule_knobs

# ---- per-option limits ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Limit:
    """A numeric option's type and closed range ``lo..hi`` (``open_hi``: ``hi`` excluded)."""

    kind: type  # int or float
    lo: float
    hi: float
    open_hi: bool = False
    zero_ok: bool = False  # 0 allowed besides lo..hi (0 = "off" / "same as nominal")
    is_list: bool = False  # a comma-separated list, each value within the range
    unit: str = ""  # what the number counts or measures, shown in the option's help

    def text(self) -> str:
        def num(v):
            return str(int(v)) if self.kind is int else f"{v:g}"

        hi = num(self.hi) + (" (excluded)" if self.open_hi else "")
        return f"{'0 or ' if self.zero_ok else ''}{num(self.lo)}..{hi}"

    def check(self, v: float) -> bool:
        if self.zero_ok and v == 0:
            return True
        return self.lo <= v and (v < self.hi if self.open_hi else v <= self.hi)


MAX_TOKENS = 1 << 20  # tokens of one sequence (KV, extend or prefix)
MAX_SEQS = 1 << 16  # sequences per GPU
_I, _F = int, float


def _record_limits() -> dict[str, Limit]:
    """The limits of the schedule knobs, host costs (``host_`` options) and GPU fields: their
    knob records' ranges, declared once where the field is (the configuration checks the same)."""
    out = {}
    for prefix, records in (
        ("", schedule_knobs()),
        ("host_", host_cost_fields()),
        ("", gpu_fields()),
    ):
        for k in records:
            if k.scalar in (int, float) and k.lo is not None and k.hi is not None:
                out[prefix + k.name] = Limit(
                    k.scalar, k.lo, k.hi, zero_ok=k.zero_ok, is_list=k.is_tuple, unit=k.unit
                )
    return out


#: Option destination -> its limit: the workload's and ``run``'s here, every knob's from its
#: record. Hardware ranges bracket every real device with a wide margin and keep simulated times
#: far from floating-point trouble.
LIMITS: dict[str, Limit] = {
    # workload and parallelism
    "batch": Limit(_I, 1, MAX_SEQS),
    "kv_len": Limit(_I, 1, MAX_TOKENS),
    "kv_lens": Limit(_I, 1, MAX_TOKENS, is_list=True),
    "tokens_per_seq": Limit(_I, 1, 64),
    "extend_len": Limit(_I, 1, MAX_TOKENS),
    "extend_lens": Limit(_I, 1, MAX_TOKENS, is_list=True),
    "prefix_len": Limit(_I, 0, MAX_TOKENS),
    "prefix_lens": Limit(_I, 0, MAX_TOKENS, is_list=True),
    "layers": Limit(_I, 1, 1000),
    "mtp": Limit(_I, 0, 8, unit="modules"),
    "ep": Limit(_I, 1, 1024),
    "gpus_per_node": Limit(_I, 1, 72),
    "attn_tp": Limit(_I, 1, 1024),
    "pp_size": Limit(_I, 1, 16),
    "seed": Limit(_I, 0, 2**32 - 1),
    "dp_imbalance": Limit(_F, 0, 1, open_hi=True),
    "max_events": Limit(_I, 1, 10**10),
    # `run`
    "warmup": Limit(_I, 0, 1000),
    "repeats": Limit(_I, 1, 10000),
    "tolerance": Limit(_F, 1e-12, 1),
}
LIMITS.update(_record_limits())
#: `run` (CPU equivalence check and GPU) sizes: the real executor allocates them.
RUN_LIMITS = {"batch": 4096, "ranks": 16}


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


def limited(limit: Limit, *, is_list: bool = False):
    """An argparse type: one number (or a comma-separated list of them) within ``limit``."""

    def one(s: str):
        v = _number(limit.kind, s)
        if not limit.check(v):
            raise argparse.ArgumentTypeError(
                f"expected a value in {limit.text()}, got {s.strip()!r}"
            )
        return v

    def many(s: str):
        parts = s.split(",")
        if any(not p.strip() for p in parts):
            raise argparse.ArgumentTypeError(
                f"expected comma-separated values in {limit.text()} with none empty, got {s!r}"
            )
        if len(parts) > MAX_SEQS:
            raise argparse.ArgumentTypeError(f"expected at most {MAX_SEQS} values")
        return tuple(one(p) for p in parts)

    return many if is_list else one


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
    limits = {**LIMITS, **_record_limits()}
    for a in _actions(parser):
        if a.choices is not None and a.type is None and a.option_strings:
            a.type = str.lower  # names are case-insensitive, like --model and --gpu
        lim = limits.get(a.dest)
        if lim is None or not a.option_strings or a.nargs == 0:
            continue
        a.type = limited(lim, is_list=lim.is_list)
        unit = f" {lim.unit}" if lim.unit else ""
        a.help = f"{a.help or ''} [{'each ' if lim.is_list else ''}{lim.text()}{unit}]".strip()
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

DECODE_ONLY = ("kv_len", "kv_lens", "tokens_per_seq", "mtp")
PREFILL_ONLY = ("extend_len", "extend_lens", "prefix_len", "prefix_lens")


def knob_schedules() -> dict[str, tuple[str, ...]]:
    """Schedule knobs read by only some schedules -> those schedules (each schedule module
    declares its own, ``shared.schedules.knob_readers``; the registry loads every schedule
    module once, and only when a command is checked): giving one to none of them is refused."""
    from overlap_lab.shared.schedules import SCHEDULES, knob_readers

    return {n: r for n, r in knob_readers().items() if len(r) < len(SCHEDULES)}


def __getattr__(name: str):
    """``KNOB_SCHEDULES`` (:func:`knob_schedules`), computed on first use."""
    if name == "KNOB_SCHEDULES":
        return knob_schedules()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: Option defaults this layer applies itself (None in the parser, so that "given" is visible).
MODE_DEFAULTS = {"kv_len": 4096, "tokens_per_seq": 1, "extend_len": 4096, "prefix_len": 0}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


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
            args.mode = args.mode.lower()
            if args.mode not in ("decode", "prefill"):
                raise ConfigError(f"--mode must be decode or prefill, got {args.mode!r}")
            _check_mode_options(args)
        return
    _check_names(args, cmd)
    _check_mode_options(args)
    if cmd != "run":
        _check_knobs(args, _schedules(args, cmd))
    _check_hardware(args)
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
    from overlap_lab.shared.schedules import SCHEDULES

    mode = str(args.mode).lower()
    if mode not in ("decode", "prefill"):
        raise ConfigError(f"--mode must be decode or prefill, got {args.mode!r}")
    args.mode = mode
    if getattr(args, "deepep_mode", None) is not None:
        args.deepep_mode = args.deepep_mode.lower()
    choices = ", ".join(SCHEDULES)
    if cmd == "compare":
        names = [s.strip().lower() for s in args.schedules.split(",")]
        names = [n for n in names if n]
        if not names:
            raise ConfigError(f"--schedules needs at least one schedule, from {choices}")
        for n in names:
            if n not in SCHEDULES:
                raise ConfigError(f"unknown schedule {n!r}; choose from {choices}")
        args.schedules = ",".join(dict.fromkeys(names))
    elif args.schedule is not None:
        name = args.schedule.strip().lower()
        if name not in SCHEDULES and not (cmd == "run" and name == "all"):
            raise ConfigError(f"unknown schedule {args.schedule!r}; choose from {choices}")
        args.schedule = name


def _schedules(args, cmd: str) -> list[str]:
    return args.schedules.split(",") if cmd == "compare" else [args.schedule]


def _check_mode_options(args) -> None:
    wrong = PREFILL_ONLY if args.mode == "decode" else DECODE_ONLY
    for dest in wrong:
        if _given(args, dest):
            other = "prefill" if args.mode == "decode" else "decode"
            raise ConfigError(f"{_flag(dest)} applies to --mode {other} only, not {args.mode}")
    for dest, v in MODE_DEFAULTS.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, v)
    if args.mode == "decode" and args.kv_lens is not None and _given(args, "batch"):
        if args.batch != len(args.kv_lens):
            raise ConfigError(f"--batch {args.batch} but {len(args.kv_lens)} --kv-lens")
    if args.mode == "prefill" and args.extend_lens is not None:
        n = len(args.extend_lens)
        if _given(args, "batch") and args.batch != n:
            raise ConfigError(f"--batch {args.batch} but {n} --extend-lens")
        if args.prefix_lens is not None and len(args.prefix_lens) != n:
            raise ConfigError(f"{len(args.prefix_lens)} --prefix-lens for {n} --extend-lens")
    elif args.mode == "prefill" and args.prefix_lens is not None:
        raise ConfigError("--prefix-lens needs --extend-lens (one prefix per sequence)")


def _check_knobs(args, names: list[str]) -> None:
    for dest, owners in knob_schedules().items():
        v = getattr(args, dest, None)
        if v is None or v == () or v is False:
            continue
        if not set(names) & set(owners):
            raise ConfigError(
                f"{_flag(dest)} applies to --schedule {' or '.join(owners)} only, "
                f"not {', '.join(names)}"
            )


def _check_hardware(args) -> None:
    """Communication SMs below the GPU's (a nominal link override carries over to DeepEP's
    achievable rate in ``overlap_lab.api.gpu``)."""
    from overlap_lab.shared.inputs.hardware import get_gpu

    gpu = get_gpu(args.gpu)
    num_sms = getattr(args, "num_sms", None) or gpu.num_sms
    for dest in ("comm_sms", "sbo_comm_sms", "deepep_normal_sms"):
        v = getattr(args, dest, None)
        if v is not None and v >= num_sms:
            raise ConfigError(f"{_flag(dest)} {v} must be below the GPU's {num_sms} SMs")


_WARNED: set[str] = set()


def warn_implausible(values: dict[str, float | None]) -> None:
    """One line on stderr for each hardware option given (``values``: GPU field -> the value
    typed, None: not given) that looks typed in another unit (``checks.implausible``); each is
    said once per run (a sweep checks every case)."""
    import sys

    from overlap_lab.checks import implausible

    for msg in implausible(values):
        if msg not in _WARNED:
            _WARNED.add(msg)
            print(f"overlap-lab: warning: {msg}", file=sys.stderr)


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
    from overlap_lab.measure import comm_backends, kernel_families

    args.device = str(args.device).lower()
    backends = comm_backends()  # registered plug-ins too (real.comm)
    b = str(args.backend)
    args.backend = b.lower() if b not in backends and b.lower() in backends else b
    if args.backend not in backends:
        raise ConfigError(f"--backend must be one of {', '.join(backends)}, got {args.backend!r}")
    if isinstance(args.kernels, str):
        args.kernels = tuple(k for k in args.kernels.split(",") if k)
    families = kernel_families()
    unknown = [k for k in args.kernels if k not in families]
    if unknown:
        raise ConfigError(
            f"--kernels: unknown kernel family {unknown[0]!r}; choose from {', '.join(families)}"
        )
    devices = ("auto", "cuda", "cpu")
    if args.device not in devices:
        raise ConfigError(f"--device must be one of {', '.join(devices)}, got {args.device!r}")
    if _given(args, "batch") and args.batch > RUN_LIMITS["batch"]:
        raise ConfigError(f"run: --batch must be at most {RUN_LIMITS['batch']}, got {args.batch}")
    if args.ranks > RUN_LIMITS["ranks"]:
        raise ConfigError(f"run: --ranks must be at most {RUN_LIMITS['ranks']}, got {args.ranks}")
    if args.device != "cpu":  # a GPU run needs a GPU: say so on stderr, before anything else
        try:
            import torch
        except ImportError:
            raise ConfigError("run: the real executor needs torch (pip install torch)") from None
        if not torch.cuda.is_available():
            raise ConfigError(
                "no CUDA GPU found: `overlap-lab run` measures on a GPU; use --device cpu --check "
                "for the CPU equivalence check"
            )


def _check_ranks(args) -> None:
    from overlap_lab.shared.inputs.routing import parse_imbalance
    from overlap_lab.shared.inputs.workload import get_model

    model = get_model(args.model)
    if args.group_limited and model.n_group <= 1:
        raise ConfigError(
            f"--group-limited true needs a model with expert groups; {model.name} has none "
            "(n_group 1)"
        )
    imb = parse_imbalance(args.imbalance)
    if imb.kind == "file":
        from overlap_lab.checks import check_routing_file

        check_routing_file(imb.path, model.num_experts, model.top_k)


# ---- files ---------------------------------------------------------------------------------------


def add_force_option(s: argparse.ArgumentParser) -> None:
    """--force: write into an --out folder that holds files the tool did not write (refused
    without it: :func:`check_out_dir`). Not among the sim options a sweep spec may set."""
    s.add_argument(
        "--force", action="store_true", help="write into --out even if it holds other files"
    )


def check_workload(w, gpu, args) -> None:
    """The memory checks of a built workload (sim, compare, run): ``overlap_lab.checks``."""
    from overlap_lab import checks

    checks.check_memory(w, gpu, getattr(args, "allow_oversubscribe", False))
    if getattr(args, "command", None) in ("sim", "compare"):
        ranks = getattr(args, "ranks", "symmetric")
        checks.check_sim_memory(w, ranks, getattr(args, "imbalance", "balanced"))


# ---- output --------------------------------------------------------------------------------------


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
