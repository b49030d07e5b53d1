"""The options of the command line and the records built from them.

Option groups (workload, parallelism, schedule knobs, host costs, hardware overrides, ranks,
figure, profile) and the ``sim`` and ``run`` subcommands' option sets live here, with the
functions that turn parsed options into the API's records (:func:`workload_from`,
:func:`gpu_from`, :func:`config_from`, :func:`ranks_from`). Every subcommand module and the sweep
(whose spec keys are ``sim``'s options) build from this one place; it never imports
:mod:`overlap_lab.cli.main`, so the subcommands can use it without an import cycle.

Schedule knobs, host costs and hardware overrides are built from the knob records
(``shared.inputs.knobs``: ``schedule_knobs()``, ``host_cost_fields()``, ``gpu_fields()``), flag, parser
and help alike, so that a knob added to a configuration is on the command line at once and its
help is what the record says, not what the class source happens to read like.
"""

from __future__ import annotations

import argparse
import typing

from overlap_lab.cli import inputs
from overlap_lab.cli.inputs import _gpu_overrides, _overrides, flag, model_spec
from overlap_lab.cli.inputs import (
    gpu_from as gpu_from,  # (re-exported: every command reads it here)
)
from overlap_lab.shared import schedules
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import GPU, GPUS, HostCosts, host_cost_fields
from overlap_lab.shared.inputs.knobs import Knob
from overlap_lab.shared.inputs.workload import MODELS, Workload
from overlap_lab.shared.schedules import BASELINE, SCHEDULES, ScheduleConfig, schedule_knobs
from overlap_lab.sim.profile import BUILTIN, ROOFLINE, Profile, load_profile, resolve

if typing.TYPE_CHECKING:
    from overlap_lab.api import Ranks


class Parser(argparse.ArgumentParser):
    """argparse that reports bad input in one line and exits 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"overlap-lab: error: {message}\n")


def positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return v


def _int_list(s: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError("expected at least one length")
    return vals


def _str_list(s: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in s.split(",") if x.strip())


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


def _option_type(k: Knob) -> typing.Callable[[str], typing.Any] | None:
    """The parser of a knob's value as typed (None: the knob is no option, e.g. ``host``)."""
    tp = k.scalar
    if k.is_tuple:
        return {int: _int_list, str: _str_list}.get(tp)
    if tp is bool:
        return _bool
    return tp if tp in (int, float, str) else None


def _add_knob_options(
    group, records: tuple[Knob, ...], *, prefix: str = "", shown_default: str | None = None
) -> None:
    """One option per knob record: its flag, parser and help come from the record alone, so a
    knob added to a configuration is on the command line at once (ranges: ``inputs.LIMITS``)."""
    for k in records:
        parse = _option_type(k)
        if parse is None:
            continue
        default = shown_default if shown_default is not None else k.default
        kw = dict(nargs="?", const=True) if parse is _bool else {}
        # a default of None is said by the help itself ("None: the preset's"), not once more
        said = default is None and "None" in k.help
        group.add_argument(
            flag(prefix + k.name),
            dest=prefix + k.name,
            type=parse,
            default=None,
            metavar=k.name.split("_")[-1].upper() if parse is not _bool else "BOOL",
            help=k.help if said else f"{k.help} (default: {default})".strip(),
            **kw,
        )


#: The GPU fields that are no hardware override (a GPU is chosen by --gpu / --gpu-file).


def workload_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument(
        "--model", default="deepseek-v3", help=f"one of {', '.join(MODELS)}, or a model file"
    )
    g.add_argument(
        "--model-file",
        default=None,
        metavar="PATH",
        help="YAML/JSON of ModelConfig fields, or a HuggingFace config.json (DeepSeek-V2/V3, "
        "Qwen2/3-MoE, Mixtral); replaces --model",
    )
    g.add_argument("--gpu", default="h800", help=f"one of {', '.join(GPUS)}, or a GPU file")
    g.add_argument(
        "--gpu-file",
        default=None,
        metavar="PATH",
        help="YAML/JSON of GPU fields (the built-in presets are such files); replaces --gpu",
    )
    g.add_argument("--mode", default="decode", help="decode or prefill")
    g.add_argument(
        "--batch",
        type=positive_int,
        default=None,
        help="sequences per GPU (rank) (default: 128 decode, 4 prefill)",
    )
    g.add_argument("--kv-len", type=positive_int, default=4096, help="decode: KV length per seq")
    g.add_argument("--kv-lens", type=_int_list, default=None, help="decode: explicit KV lengths")
    g.add_argument(
        "--tokens-per-seq",
        type=positive_int,
        default=1,
        help="decode: tokens per sequence (MTP / target verify)",
    )
    g.add_argument("--extend-len", type=positive_int, default=4096, help="prefill: new tokens")
    g.add_argument(
        "--extend-lens",
        type=_int_list,
        default=None,
        help="prefill: explicit new-token counts, e.g. 4096,4096,1",
    )
    g.add_argument("--prefix-len", type=int, default=0, help="prefill: cached prefix per seq")
    g.add_argument("--prefix-lens", type=_int_list, default=None, help="prefill: explicit prefixes")
    g.add_argument(
        "--layers",
        type=positive_int,
        default=None,
        help="keep N layers: one dense layer first (if the model has any), the rest MoE (default: all)",
    )
    g.add_argument(
        "--mtp",
        type=int,
        default=None,
        help="decode: MTP draft steps, each a run of the model's MTP module; the step then "
        "verifies N+1 tokens per sequence (SGLang's --speculative-num-steps at top-k 1). "
        "Default: the model's module drafts --tokens-per-seq - 1 tokens; 0: no MTP",
    )
    g = p.add_argument_group("parallelism")
    g.add_argument("--ep", type=positive_int, default=32, help="expert-parallel size")
    g.add_argument("--gpus-per-node", type=positive_int, default=8)
    g.add_argument("--attn-tp", type=positive_int, default=1, help="attention TP size")
    g.add_argument("--dp-attention", type=_bool, default=True, help="DP attention (true/false)")
    g.add_argument(
        "--pp-size",
        type=positive_int,
        default=None,
        help=f"pipeline stages (default: 1{_stage_defaults()})",
    )
    common = {k.name for k in schedules.common_knobs()}
    records = schedule_knobs()
    _add_knob_options(
        p.add_argument_group("knobs every schedule reads"),
        tuple(k for k in records if k.name in common),
    )
    _add_knob_options(
        p.add_argument_group("knobs of some schedules (each says which, declared in its module)"),
        tuple(k for k in records if k.name not in common),
    )
    _add_knob_options(
        p.add_argument_group("host costs of the scheduler loop (µs)"),
        host_cost_fields(),
        prefix="host_",
    )
    _add_knob_options(
        p.add_argument_group("hardware overrides (fields of the GPU preset)"),
        _gpu_overrides(),
        shown_default="preset",
    )
    inputs.add_guard_options(p)


def figure_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("figure")
    g.add_argument("--figure-format", default="png", choices=("png", "pdf", "svg"))
    g.add_argument(
        "--window",
        default="auto",
        help="what the timeline shows: auto (two MoE layers of one-step schedules; the whole "
        f"window for {_drawn('whole_window')}), step (everything), layers:A-B (MoE layers "
        "A..B), or a time range in ms, e.g. 10-25",
    )
    g.add_argument(
        "--rank",
        type=int,
        default=None,
        help=f"draw this rank (default: every rank of a {_drawn('every_rank')} run, rank 0 "
        "otherwise)",
    )
    g.add_argument(
        "--width",
        default="double",
        help="figure width: single (3.3 in, one column), double (7 in, two columns) or inches",
    )
    g.add_argument("--title", default=None, help="the figure's heading ('': none; default: "
                   "the workload, and the window drawn)")  # fmt: skip


def figure_from(args) -> dict[str, typing.Any]:
    """The figure options, as ``report.write_run`` and ``report.write_comparison`` take them."""
    return {k: getattr(args, k) for k in ("figure_format", "window", "rank", "width", "title")}


def rank_options(p: argparse.ArgumentParser) -> None:
    """Explicit ranks, routing imbalance and DP-attention imbalance (sim, show, compare)."""
    g = p.add_argument_group("ranks and imbalance")
    g.add_argument(
        "--ranks",
        default="symmetric",
        choices=("symmetric", "explicit"),
        help="simulate one mirrored rank (fast) or every EP rank explicitly",
    )
    g.add_argument(
        "--imbalance",
        default="balanced",
        help="expert load: balanced, zipf:S or file:PATH (JSON/CSV routing sample, "
        "see shared/inputs/routing.py); needs --ranks explicit unless balanced",
    )
    g.add_argument(
        "--dp-imbalance",
        type=float,
        default=0.0,
        help="DP attention: ranks hold a seeded uniform share in [1-F, 1] of the "
        "padded batch of real tokens (0: all full); needs --ranks explicit",
    )
    g.add_argument(
        "--group-limited",
        type=_bool,
        default=None,
        help="DeepSeek-V3 group-limited routing (default: the model's own gating)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of routing and DP imbalance")
    g.add_argument(
        "--reduce-ranks",
        type=_bool,
        default=True,
        help="explicit ranks that provably cannot differ (balanced routing) are simulated once "
        "and copied to every rank, the same result (shared/ir/symmetry.py); false: every rank",
    )
    g.add_argument(
        "--fast-forward",
        type=_bool,
        default=True,
        help="once the simulation's state at a layer repeats an earlier layer's, the layers "
        "that follow are copied, not simulated: the same result to float round-off "
        "(sim/fastforward.py); false: simulate every layer",
    )


def ranks_from(args) -> Ranks:
    """The API's Ranks record from the rank options (symmetric for subcommands without them)."""
    from overlap_lab.api import Ranks

    return Ranks(
        getattr(args, "ranks", "symmetric"),
        getattr(args, "imbalance", "balanced"),
        getattr(args, "dp_imbalance", 0.0),
        getattr(args, "group_limited", None),
        getattr(args, "seed", 0),
        getattr(args, "reduce_ranks", True),
        getattr(args, "fast_forward", True),
    )


def workload_from(args) -> Workload:
    """The workload of the workload options (``--model`` or ``--model-file``)."""
    from overlap_lab import api

    pp = args.pp_size
    if pp is None:  # one stage; a schedule's own default applies in the API (prepare_workload)
        pp = 1
    return api.workload(
        model_spec(args),
        mode=args.mode,
        batch=args.batch,
        kv_len=args.kv_len,
        kv_lens=args.kv_lens,
        tokens_per_seq=args.tokens_per_seq,
        extend_len=args.extend_len,
        extend_lens=args.extend_lens,
        prefix_len=args.prefix_len,
        prefix_lens=args.prefix_lens,
        layers=args.layers,
        mtp=args.mtp,
        ep=args.ep,
        gpus_per_node=args.gpus_per_node,
        attn_tp=args.attn_tp,
        dp_attention=args.dp_attention,
        pp=pp,
    )


def config_from(args) -> ScheduleConfig:
    """The schedule knobs and host costs given (the rest: ScheduleConfig's defaults)."""
    kw = _overrides(args, schedule_knobs())
    host = _overrides(args, host_cost_fields(), prefix="host_")
    if host:
        kw["host"] = HostCosts(**host)
    return ScheduleConfig(**kw)


def check_pp_size(schedule: str, args) -> None:
    """A ``--pp-size`` typed is run as typed (``checks.check_stages``)."""
    from overlap_lab.checks import check_stages

    check_stages(schedule, workload_from(args), args.pp_size)


def _stage_defaults() -> str:
    """``; pp: 2`` for every schedule whose workload defaults set the stages (the help text)."""
    from overlap_lab.api import default_stages

    return "".join(f"; {name}: {n}" for name, n in default_stages().items())


def _drawn(rule: str) -> str:
    """The schedules whose figures follow ``rule`` (a ``Drawing`` field), for help texts."""
    from overlap_lab.figures.windows import drawn_by

    return " and ".join(drawn_by(rule)) or "no"


def add_profile_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--profile",
        default="auto",
        help=f"measured kernel durations: a profile file, {', '.join(BUILTIN)}, or {ROOFLINE} "
        "(analytic only); auto: the GPU's built-in profile (h800 -> h800-published, "
        f"h200 -> h200-measured), else {ROOFLINE} (default: auto)",
    )


def add_model_options(p: argparse.ArgumentParser) -> None:
    """``--cost-model`` and ``--network``: the simulator's models by the names they are
    registered under (``sim.models``; another package's by entry point)."""
    from overlap_lab.sim.models import COST_MODELS, DEFAULT_COST_MODEL, DEFAULT_NETWORK, NETWORKS

    p.add_argument(
        "--cost-model",
        default=DEFAULT_COST_MODEL,
        metavar="NAME",
        help=f"what a kernel costs: one of {', '.join(COST_MODELS.names())}, by the name a "
        f"package registers in the entry point group {COST_MODELS.group}; {DEFAULT_COST_MODEL}: "
        f"the roofline with --profile's measured rows (default: {DEFAULT_COST_MODEL})",
    )
    p.add_argument(
        "--network",
        default=DEFAULT_NETWORK,
        metavar="NAME",
        help=f"what carries explicit ranks' flows: one of {', '.join(NETWORKS.names())}, by the "
        f"name a package registers in the entry point group {NETWORKS.group}; "
        f"{DEFAULT_NETWORK}: per-rank ports shared max-min fairly (default: {DEFAULT_NETWORK})",
    )


def profile_from(args, gpu: GPU) -> Profile | None:
    """The profile ``args.profile`` names for ``gpu`` (None: the roofline alone)."""
    return load_profile(resolve(getattr(args, "profile", "auto"), gpu))


def add_sim_options(s: argparse.ArgumentParser) -> None:
    """The options of ``sim``: also the knobs of a sweep spec (:mod:`overlap_lab.cli.sweep`)."""
    s.add_argument("--schedule", default=BASELINE, help=f"one of {', '.join(SCHEDULES)}")
    s.add_argument(
        "--out",
        default="overlap-lab-out",
        help="directory for trace.json and the timeline figure ('' to write nothing)",
    )
    s.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    figure_options(s)
    workload_options(s)
    rank_options(s)
    add_profile_option(s)


def add_run_options(s: argparse.ArgumentParser) -> None:
    """The options of ``run``: the real executor's."""
    s.add_argument("--schedule", default=None, help="a schedule, or all (default) with --check")
    from overlap_lab.measure import comm_backends, kernel_families

    s.add_argument(
        "--backend",
        default="auto",
        help=f"communication backend: {', '.join(comm_backends())} (a package may register more)",
    )
    s.add_argument(
        "--kernels",
        default="",
        metavar="FAMILIES",
        help="kernel families whose kernels bind their ops first, comma-separated (registered: "
        f"{', '.join(kernel_families())}; default: none first, every family binds its own ops)",
    )
    s.add_argument("--device", default="auto", help="cuda, cpu or auto")
    s.add_argument("--check", action="store_true", help="CPU: equivalence with serial")
    s.add_argument("--ranks", type=positive_int, default=1, help="CPU: gloo processes")
    s.add_argument("--warmup", type=int, default=2)
    s.add_argument("--repeats", type=positive_int, default=5)
    s.add_argument("--tolerance", type=float, default=None)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", default="overlap-lab-out")
    inputs.add_force_option(s)
    s.add_argument("--json", action="store_true")
    workload_options(s)


def given_options(args, name: str) -> set[str]:
    """The options of subcommand ``name`` that ``args`` sets to other than their defaults."""
    defaults = vars(subcommand_parser(name).parse_args([]))
    return {k for k, v in vars(args).items() if k in defaults and v != defaults[k]}


#: What ``sim --program`` still reads: the GPU the Program runs on (and its overrides), how
#: durations and flows are costed, the budget, the outputs. Every other option builds or lowers
#: a schedule's Program (schedule, workload, knobs, host costs, ranks) and is refused.
PROGRAM_OPTIONS = frozenset(
    {"gpu", "gpu_file", "profile", "cost_model", "network", "max_events", "fast_forward", "out",
     "json", "figure_format", "window", "rank", "width", "title"}
)  # fmt: skip


def check_program_options(args) -> None:
    """``sim --program``: refuse, in one line naming them, the options it cannot honour."""
    gpu = {k.name for k in _gpu_overrides()}
    bad = sorted(given_options(args, "sim") - PROGRAM_OPTIONS - gpu)
    if bad:
        raise ConfigError(
            f"sim --program runs the Program as written; {', '.join(map(flag, bad))} build or "
            "lower a schedule's Program (overlap-lab show takes them): leave them out"
        )


#: the subcommands whose options are built here, by name
_SUBCOMMAND_OPTIONS = {"sim": add_sim_options, "run": add_run_options}


def subcommand_parser(name: str) -> argparse.ArgumentParser:
    """A parser of one subcommand's options alone, limits applied as on the command line: what
    the sweep reads its knobs from and what ``run`` compares given options with."""
    p = Parser(prog=f"overlap-lab {name}")
    _SUBCOMMAND_OPTIONS[name](p)
    return inputs.apply_limits(p)
