"""`overlap-lab`: simulate, show, list, compare and run overlap schedules.

    overlap-lab sim --schedule serial --model deepseek-v3 --gpu h800 --mode decode --batch 128 --ep 32
    overlap-lab show --schedule tbo ...           # the Program's text form
    overlap-lab schedules                         # each schedule, with the upstream code it follows
    overlap-lab compare --schedules serial,tbo,sbo ...
    overlap-lab run --device cpu --check          # the real executor (GPU, or CPU equivalence)

Every option has a default. Schedule knobs are the fields of ScheduleConfig and hardware
overrides the fields of the GPU preset, both turned into options here so that a knob added to
either is on the command line at once. Bad input: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import sys
import types
import typing
from pathlib import Path

from overlap_lab.experiments.cli_calibrate import (
    add_profile_option,
    cost_comments,
    profile_from,
    register_calibration_commands,
)
from overlap_lab.shared import inputs
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.hardware import GPU, GPUS, HostCosts
from overlap_lab.shared.schedules import SCHEDULES, ScheduleConfig
from overlap_lab.shared.schedules import build as build_schedule
from overlap_lab.shared.workload import MODELS, Workload

#: `run` on a GPU keeps this many layers by default: a full-size model does not fit on one GPU
GPU_RUN_LAYERS = 4
#: The schedules `compare` runs by default: all of them.
DEFAULT_COMPARE = tuple(SCHEDULES)


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad input in one line and exits 2."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"overlap-lab: error: {message}\n")


def _positive_int(s: str) -> int:
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


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _option_type(tp):
    """A parser for a dataclass field annotation: scalars, optionals and comma-separated tuples."""
    if isinstance(tp, str):
        tp = eval(tp, {"HostCosts": object}, {})  # annotations are strings (PEP 563)
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _option_type(args[0]) if len(args) == 1 else None
    if typing.get_origin(tp) is tuple:
        inner = typing.get_args(tp)[0]
        if inner is int:
            return _int_list
        if inner is str:
            return lambda s: tuple(x.strip() for x in s.split(",") if x.strip())
        return None
    if tp is bool:
        return _bool
    return tp if tp in (int, float, str) else None


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


@functools.cache  # reading the source is most of building the parser
def _field_comments(cls) -> dict[str, str]:
    """The trailing ``# comment`` of each field in the class source: the option's help."""
    import inspect

    out = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+):[^#]*#\s*(.+)$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def _add_dataclass_options(group, cls, *, skip=(), prefix="") -> None:
    notes = _field_comments(cls)
    for f in dataclasses.fields(cls):
        parse = _option_type(f.type)
        if f.name in skip or parse is None:
            continue
        default = "preset" if cls is GPU else f.default
        kw = dict(nargs="?", const=True) if parse is _bool else {}
        group.add_argument(
            _flag(prefix + f.name),
            dest=prefix + f.name,
            type=parse,
            default=None,
            metavar=f.name.split("_")[-1].upper() if parse is not _bool else "BOOL",
            help=f"{notes.get(f.name, '')} (default: {default})".strip(),
            **kw,
        )


def _workload_options(p: argparse.ArgumentParser) -> None:
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
        type=_positive_int,
        default=None,
        help="sequences per GPU (rank) (default: 128 decode, 4 prefill)",
    )
    g.add_argument("--kv-len", type=_positive_int, default=4096, help="decode: KV length per seq")
    g.add_argument("--kv-lens", type=_int_list, default=None, help="decode: explicit KV lengths")
    g.add_argument(
        "--tokens-per-seq",
        type=_positive_int,
        default=1,
        help="decode: tokens per sequence (MTP / target verify)",
    )
    g.add_argument("--extend-len", type=_positive_int, default=4096, help="prefill: new tokens")
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
        type=_positive_int,
        default=None,
        help="keep N layers: one dense layer first (if the model has any), the rest MoE (default: all)",
    )
    g = p.add_argument_group("parallelism")
    g.add_argument("--ep", type=_positive_int, default=32, help="expert-parallel size")
    g.add_argument("--gpus-per-node", type=_positive_int, default=8)
    g.add_argument("--attn-tp", type=_positive_int, default=1, help="attention TP size")
    g.add_argument("--dp-attention", type=_bool, default=True, help="DP attention (true/false)")
    g.add_argument(
        "--pp-size",
        type=_positive_int,
        default=None,
        help="pipeline stages (default: 1; pp: 2)",
    )
    _add_dataclass_options(p.add_argument_group("schedule knobs"), ScheduleConfig)
    _add_dataclass_options(
        p.add_argument_group("host costs of the scheduler loop (µs)"), HostCosts, prefix="host_"
    )
    _add_dataclass_options(
        p.add_argument_group("hardware overrides (fields of the GPU preset)"),
        GPU,
        skip=("name", "arch"),
    )
    inputs.add_guard_options(p)


def _figure_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("figure")
    g.add_argument("--figure-format", default="png", choices=("png", "pdf", "svg"))
    g.add_argument(
        "--window",
        default="auto",
        help="what the timeline shows: auto (two MoE layers of one-step schedules; the whole "
        "window for sglang-overlap and pp), step (everything), layers:A-B (MoE layers A..B), "
        "or a time range in ms, e.g. 10-25",
    )
    g.add_argument(
        "--rank",
        type=int,
        default=None,
        help="draw this rank (default: every rank of a pp run, rank 0 otherwise)",
    )
    g.add_argument(
        "--width",
        default="double",
        help="figure width: single (3.3 in, one column), double (7 in, two columns) or inches",
    )


def _rank_options(p: argparse.ArgumentParser) -> None:
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
        "see shared/routing.py); needs --ranks explicit unless balanced",
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
        "and copied to every rank, the same result (shared/symmetry.py); false: every rank",
    )


def _ranks(args):
    """The API's Ranks record from the rank options (symmetric for subcommands without them)."""
    from overlap_lab.api import Ranks

    return Ranks(
        getattr(args, "ranks", "symmetric"),
        getattr(args, "imbalance", "balanced"),
        getattr(args, "dp_imbalance", 0.0),
        getattr(args, "group_limited", None),
        getattr(args, "seed", 0),
        getattr(args, "reduce_ranks", True),
    )


def workload_from(args) -> Workload:
    """The workload of the workload options (``--model`` or ``--model-file``)."""
    from overlap_lab import api

    pp = args.pp_size
    if pp is None:  # pp's own default comes from the API; every other schedule runs one stage
        pp = 1
    return api.workload(
        getattr(args, "model_file", None) or args.model,
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
        ep=args.ep,
        gpus_per_node=args.gpus_per_node,
        attn_tp=args.attn_tp,
        dp_attention=args.dp_attention,
        pp=pp,
    )


def _overrides(args, cls, skip=(), prefix="") -> dict:
    return {
        f.name: getattr(args, prefix + f.name)
        for f in dataclasses.fields(cls)
        if f.name not in skip and getattr(args, prefix + f.name, None) is not None
    }


def gpu_from(args) -> GPU:
    """The preset or ``--gpu-file``, with the hardware overrides; a changed GPU is renamed
    (``h800+hbm-gbps=2000``) so no output calls it by the preset's name."""
    from overlap_lab import api

    spec = getattr(args, "gpu_file", None) or args.gpu
    return api.gpu(spec, **_overrides(args, GPU, skip=("name", "arch")))


def config_from(args) -> ScheduleConfig:
    kw = _overrides(args, ScheduleConfig)
    host = _overrides(args, HostCosts, prefix="host_")
    if host:
        kw["host"] = HostCosts(**host)
    return ScheduleConfig(**kw)


def _check_pp_size(schedule: str, args) -> None:
    if schedule == "pp" and args.pp_size == 1:
        raise ConfigError("pp needs --pp-size >= 2 (leave it out for 2 stages)")


# ---- commands ------------------------------------------------------------------------------------


def _print_summary(res: dict) -> None:
    print(
        f"{res['schedule']}: {res['model']} {res['mode']} on {res['gpu']}, "
        f"{res['batch']} seqs ({res['tokens']} tokens) per GPU, EP {res['ep']}"
        + (f", PP {res['pp']} ({res['gpus']} GPUs)" if res["pp"] > 1 else "")
    )
    it = res["iterations"]
    per = f" per iteration ({it} simulated)" if it > 1 else ""
    print(f"  step time        {res['iteration_us'] / 1e3:10.3f} ms{per}")
    print(f"  throughput       {res['tokens_per_s_gpu']:10.0f} tokens/s per GPU")
    print(f"  communication    {res['comm_us'] / it / 1e3:10.3f} ms{per}")
    print(f"  exposed comm     {res['exposed_comm_us'] / it / 1e3:10.3f} ms{per}")
    print(
        f"  SM time          {res['sm_compute'] * 100:9.1f} % compute, "
        f"{res['sm_comm'] * 100:.1f} % comm, {res['sm_idle'] * 100:.1f} % idle"
    )
    print(f"  ops              {res['num_ops']:10d}")
    if "cost_sources" in res:  # where the durations come from: a measurement or the roofline
        n = {
            s: sum(c.get(s, 0) for c in res["cost_sources"].values())
            for s in ("profile", "roofline", "link")
        }
        measured = f"{n['profile']} from profile {res['profile']}, " if n["profile"] else ""
        print(
            f"  op durations     {measured}{n['roofline']} from the roofline (no measurement), "
            f"{n['link']} from the link model"
        )
    if "straggler_cost_us" in res:
        steps = [r["window_us"] for r in res["per_rank"]]
        print(f"  ranks explicit   {len(steps):10d}  ({res['imbalance']})")
        print(f"  straggler cost   {res['straggler_cost_us'] / 1e3:10.3f} ms")
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
    for lane, busy in sorted(res["busy_us"].items()):
        print(f"  busy {lane:<22s} {busy / 1e3:10.3f} ms")


def cmd_sim(args) -> int:
    from overlap_lab import api

    _check_pp_size(args.schedule, args)
    w, gpu, cfg = workload_from(args), gpu_from(args), config_from(args)
    result = api.simulate(
        args.schedule,
        w,
        gpu,
        cfg,
        ranks=_ranks(args),
        profile=args.profile,
        max_events=args.max_events,
    )
    res = result.as_dict()
    if args.out:
        from overlap_lab.experiments.figures import save_timeline

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result.trace.to_chrome(out / "trace.json")
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
    if args.json:
        print(inputs.to_json(res))
    else:
        _print_summary(res)
        for f in res.get("files", []):
            print(f"  wrote {f}")
    return 0


def _title(result) -> str:
    """The workload in a figure's title: model, mode, batch, layout, GPU."""
    w = result.workload
    lay = f"EP{w.parallel.ep}" + (f" PP{w.parallel.pp}" if w.parallel.pp > 1 else "")
    return (
        f"{result.schedule}: {w.model.name} {w.batch.mode}, {w.batch.num_seqs} seqs/GPU "
        f"({w.batch.num_tokens} tok), {lay}, {result.gpu.name}"
    )


def cmd_show(args) -> int:
    from overlap_lab import api
    from overlap_lab.shared.validate import validate

    _check_pp_size(args.schedule, args)
    w, gpu, cfg = workload_from(args), gpu_from(args), config_from(args)
    if args.schedule == "pp" and w.parallel.pp == 1:
        w = dataclasses.replace(
            w, parallel=dataclasses.replace(w.parallel, pp=api.PP_DEFAULT_STAGES)
        )
    program = build_schedule(args.schedule, w, gpu, cfg)
    lowered = api._lower_ranks(program, w, gpu, _ranks(args))
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
        ranks=_ranks(args),
        profile=args.profile,
        max_events=args.max_events,
    )
    files = []
    if args.out:
        from overlap_lab.experiments.figures import compare_timelines

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
        for n, tr in table.traces().items():
            tr.to_chrome(out / f"trace_{n.replace('+', '_')}.json")
    if args.json:
        print(inputs.to_json({"results": table.as_dicts()}))
        return 0
    print(table.text())
    for f in files:
        print(f"wrote {f}")
    return 0


#: The install command the real executor needs, with the CPU torch wheel pinned (without the pin,
#: pip pulls several GB of CUDA packages onto a machine that has no GPU).
INSTALL_REAL = 'pip install "torch==2.13.0" -e ".[real]"'
#: Options the CPU equivalence check cannot honour: it runs its own small workloads (tiny models,
#: fixed decode and prefill batches: real/check.py), on the local or gloo backend, measures
#: nothing and writes no files. Each is refused when given, never silently dropped.
CPU_CHECK_REFUSES = {
    "mode": "the check runs decode and prefill batches of its own",
    "max_events": "the check simulates nothing",
    "allow_oversubscribe": "the check's tiny models fit in any memory",
    "batch": "the check's batches are fixed (real/check.py)",
    "kv_len": "the check's batches are fixed",
    "kv_lens": "the check's batches are fixed",
    "tokens_per_seq": "the check's batches are fixed (one has 2 tokens per sequence)",
    "extend_len": "the check's batches are fixed",
    "extend_lens": "the check's batches are fixed",
    "prefix_len": "the check's batches are fixed",
    "prefix_lens": "the check's batches are fixed",
    "layers": "the check's tiny models have their own layers",
    "model_file": "the check runs its tiny models",
    "ep": "the check's EP size is max(2, --ranks)",
    "gpus_per_node": "the check runs no network",
    "attn_tp": "the check runs without attention TP",
    "dp_attention": "the check runs DP attention",
    "pp_size": "the check runs pp with 2 and 3 stages itself",
    "backend": "the check runs the local backend (gloo with --ranks N); --backend applies on a GPU",
    "warmup": "the check measures nothing",
    "repeats": "the check measures nothing",
    "out": "the check writes no files (use --json > FILE)",
}


def _given(args) -> set[str]:
    """The options of `run` set to something other than their default."""
    d = parser().parse_args(["run", "--device", "cpu", "--check"])
    default_mode, d.mode = d.mode, args.mode
    inputs.check_args(d)  # the mode's defaults filled in, as they were for ``args``
    defaults = {**vars(d), "mode": default_mode}
    return {k for k, v in vars(args).items() if k in defaults and v != defaults[k]}


def cmd_run(args) -> int:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise ConfigError(
            f"the real executor needs torch; from the repository: {INSTALL_REAL} "
            "(the CPU wheel; on a GPU machine install the torch build for its CUDA driver)"
        )
    from overlap_lab.real.cli import run_main

    if args.device == "cpu":
        given = _given(args)
        bad = [k for k in CPU_CHECK_REFUSES if k in given]
        if bad:
            why = "; ".join(f"{_flag(k)}: {CPU_CHECK_REFUSES[k]}" for k in bad)
            raise ConfigError(f"run --device cpu --check does not take {why}")
        if "model" in given:
            from overlap_lab.real.model import TINY_NAMES

            if args.model not in TINY_NAMES:
                raise ConfigError(
                    f"run --device cpu --check runs the tiny models ({', '.join(TINY_NAMES)}); "
                    f"--model {args.model} runs on a GPU"
                )
    args.cfg = config_from(args)
    if args.layers is None and args.device != "cpu":
        args.layers = GPU_RUN_LAYERS
    # the same workload `sim` builds from the same options (the CPU check's tiny models have none)
    args.workload = None if inputs.tiny_cpu_model(args) else workload_from(args)
    return run_main(args)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="overlap-lab", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    sub.required = True

    s = sub.add_parser("sim", help="simulate one schedule and write its trace and timeline")
    s.add_argument("--schedule", default="serial", help=f"one of {', '.join(SCHEDULES)}")
    s.add_argument(
        "--out",
        default="overlap-lab-out",
        help="directory for trace.json and the timeline figure ('' to write nothing)",
    )
    s.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    _figure_options(s)
    _workload_options(s)
    _rank_options(s)
    add_profile_option(s)
    s.set_defaults(func=cmd_sim)

    s = sub.add_parser("show", help="print the Program's text form")
    s.add_argument("--schedule", default="serial")
    _workload_options(s)
    _rank_options(s)
    add_profile_option(s)
    s.set_defaults(func=cmd_show)

    s = sub.add_parser("schedules", help="list the schedules and the upstream code each follows")
    s.set_defaults(func=cmd_schedules)

    s = sub.add_parser("compare", help="simulate several schedules on one workload")
    s.add_argument("--schedules", default=",".join(DEFAULT_COMPARE))
    s.add_argument(
        "--out", default="overlap-lab-out", help="directory for the stacked figure and traces"
    )
    s.add_argument("--json", action="store_true")
    _figure_options(s)
    _workload_options(s)
    _rank_options(s)
    add_profile_option(s)
    s.set_defaults(func=cmd_compare)

    s = sub.add_parser("run", help="run a schedule with the real executor (GPU, or --device cpu)")
    s.add_argument("--schedule", default=None, help="a schedule, or all (default) with --check")
    s.add_argument("--backend", default="auto", help="emulated, torch, deepep or auto")
    s.add_argument("--device", default="auto", help="cuda, cpu or auto")
    s.add_argument("--check", action="store_true", help="CPU: equivalence with serial")
    s.add_argument("--ranks", type=_positive_int, default=1, help="CPU: gloo processes")
    s.add_argument("--warmup", type=int, default=2)
    s.add_argument("--repeats", type=_positive_int, default=5)
    s.add_argument("--tolerance", type=float, default=None)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", default="overlap-lab-out")
    s.add_argument("--json", action="store_true")
    _workload_options(s)
    s.set_defaults(func=cmd_run)
    register_calibration_commands(sub, _workload_options, _rank_options)

    from overlap_lab.experiments.cli_sweep import add_parser as add_sweep

    add_sweep(sub)
    return inputs.apply_limits(p)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        inputs.check_args(args)  # every option, alone and together, before anything runs
        if args.command in ("sim", "compare", "run") and not inputs.tiny_cpu_model(args):
            w, gpu = workload_from(args), gpu_from(args)
            inputs.check_workload(w, gpu, args)
        return args.func(args)
    except ConfigError as e:
        msg = str(e).strip()
        print(f"overlap-lab: error: {msg}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return inputs.closed_stdout()
    except OSError as e:  # writing the outputs failed after the checks (disk full, say)
        print(f"overlap-lab: error: {e.filename or ''}: {e.strerror}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
