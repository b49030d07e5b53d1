"""`overlap-lab`: simulate, show, list, compare and run overlap schedules.

    overlap-lab sim --schedule serial --model deepseek-v3 --gpu h800 --mode decode --batch 128 --ep 32
    overlap-lab show --schedule tbo ...           # the Program's text form
    overlap-lab schedules                         # one line per schedule, with its seed
    overlap-lab compare --schedules serial,tbo,sbo ...
    overlap-lab run --device cpu --check          # the real executor (GPU, or CPU equivalence)

Every option has a default. Schedule knobs are the fields of ScheduleConfig and hardware
overrides the fields of the GPU preset, both turned into options here so that a knob added to
either is on the command line at once. Bad input: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import types
import typing
from pathlib import Path

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.hardware import GPU, GPUS, HostCosts, get_gpu
from overlap_lab.shared.schedules import SCHEDULES, ScheduleConfig
from overlap_lab.shared.schedules import build as build_schedule
from overlap_lab.shared.schedules import module as schedule_module
from overlap_lab.shared.workload import MODELS, Batch, Parallel, Workload, get_model, with_layers

DEFAULT_BATCH = {"decode": 128, "prefill": 4}
#: `run` on a GPU keeps this many layers by default: a full-size model does not fit on one GPU
GPU_RUN_LAYERS = 4


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
    g.add_argument("--model", default="deepseek-v3", help=f"one of {', '.join(MODELS)}")
    g.add_argument("--gpu", default="h800", help=f"one of {', '.join(GPUS)}")
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
    g.add_argument("--pp-size", type=_positive_int, default=1, help="pipeline-parallel size")
    _add_dataclass_options(p.add_argument_group("schedule knobs"), ScheduleConfig)
    _add_dataclass_options(
        p.add_argument_group("host costs of the scheduler loop (µs)"), HostCosts, prefix="host_"
    )
    _add_dataclass_options(
        p.add_argument_group("hardware overrides (fields of the GPU preset)"),
        GPU,
        skip=("name", "arch"),
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


def lower_ranks(program, w: Workload, gpu: GPU, args):
    """The Program to simulate: the schedule's symmetric one, or every rank explicit."""
    from overlap_lab.shared.routing import dp_token_counts, parse_imbalance, routing_for

    mode = getattr(args, "ranks", "symmetric")
    imb = parse_imbalance(getattr(args, "imbalance", "balanced"))
    spread = getattr(args, "dp_imbalance", 0.0)
    if not 0.0 <= spread < 1.0:
        raise ConfigError(f"--dp-imbalance must lie in [0, 1), got {spread}")
    if mode == "symmetric":
        if imb.kind != "balanced" or spread > 0:
            raise ConfigError("--imbalance and --dp-imbalance need --ranks explicit")
        return program
    from overlap_lab.shared.ranks import expand_ranks

    seed = getattr(args, "seed", 0)
    dp = dp_token_counts(w.batch.num_tokens, w.parallel.ep, spread, seed)
    routing = routing_for(
        w, imb, seed=seed, dp_tokens=dp, group_limited=getattr(args, "group_limited", None)
    )
    return expand_ranks(program, w, gpu, routing)


def workload_from(args) -> Workload:
    if args.mode not in ("decode", "prefill"):
        raise ConfigError(f"--mode must be decode or prefill, got {args.mode!r}")
    model = get_model(args.model)
    model = with_layers(model, args.layers)
    n = args.batch
    if args.mode == "decode":
        if args.kv_lens is not None:
            batch = Batch.decode(n, kv_lens=args.kv_lens, tokens_per_seq=args.tokens_per_seq)
        else:
            batch = Batch.decode(
                n or DEFAULT_BATCH["decode"], kv_len=args.kv_len, tokens_per_seq=args.tokens_per_seq
            )
    elif args.extend_lens is not None:
        batch = Batch.prefill(n, extend_lens=args.extend_lens, prefix_lens=args.prefix_lens)
    else:
        batch = Batch.prefill(
            n or DEFAULT_BATCH["prefill"], extend_len=args.extend_len, prefix_len=args.prefix_len
        )
    par = Parallel(
        ep=args.ep,
        gpus_per_node=args.gpus_per_node,
        dp_attention=args.dp_attention,
        attn_tp=args.attn_tp,
        pp=args.pp_size,
    )
    return Workload(model, batch, par)


def _overrides(args, cls, skip=(), prefix="") -> dict:
    return {
        f.name: getattr(args, prefix + f.name)
        for f in dataclasses.fields(cls)
        if f.name not in skip and getattr(args, prefix + f.name, None) is not None
    }


def gpu_from(args) -> GPU:
    return get_gpu(args.gpu, **_overrides(args, GPU, skip=("name", "arch")))


def config_from(args) -> ScheduleConfig:
    kw = _overrides(args, ScheduleConfig)
    host = _overrides(args, HostCosts, prefix="host_")
    if host:
        kw["host"] = HostCosts(**host)
    return ScheduleConfig(**kw)


# ---- commands ------------------------------------------------------------------------------------


def result_dict(name: str, w: Workload, gpu: GPU, program, trace) -> dict:
    """The JSON a `sim` run prints: the keys documented in README.md."""
    from overlap_lab.shared.program import ops_of

    meta = program.meta
    out = {
        "schedule": name,
        "model": w.model.name,
        "gpu": gpu.name,
        "mode": w.batch.mode,
        "batch": w.batch.num_seqs,
        "tokens": w.batch.num_tokens,
        "ep": w.parallel.ep,
        "step_time_us": trace.step_time_us,
        "busy_us": trace.busy_us(),
        "exposed_comm_us": trace.exposed_comm_us(),
        "comm_only_us": trace.comm_only_us(),
        "sm_utilisation": trace.sm_utilisation(gpu.num_sms),
        "micro_batches": meta.get("micro_batches", []),
        "num_ops": len(ops_of(program)),
    }
    for key in ("comm_sms", "fallback_reason", "deepep_mode", "ranks", "imbalance", "dp_tokens"):
        if key in meta:
            out[key] = meta[key]
    if not program.symmetric:
        per_rank = trace.per_rank_step_us()
        out["per_rank"] = [
            {
                "rank": r,
                "step_time_us": per_rank.get(r, 0.0),
                "link_busy_us": {
                    lane.split(":", 1)[1]: busy
                    for lane, busy in trace.busy_us(r).items()
                    if lane.startswith("link:")
                },
            }
            for r in sorted(per_rank)
        ]
    report = getattr(schedule_module(name), "report", None)
    if report is not None:
        out["report"] = report(trace, program)
    return out


#: Network grouping tolerance for explicit ranks (sim.network: completions within 2 % of the
#: flows' age are handled together; exact for balanced routing, where all flows end together).
NET_GROUP_TOL = 0.02


def simulate_one(name: str, w: Workload, gpu: GPU, cfg: ScheduleConfig, args=None):
    """Build, lower (explicit ranks when asked), validate and simulate one schedule."""
    from overlap_lab.shared.validate import validate
    from overlap_lab.sim import simulate
    from overlap_lab.sim.engine import Engine

    program = build_schedule(name, w, gpu, cfg)
    lowered = lower_ranks(program, w, gpu, args) if args is not None else program
    if lowered is program:
        return program, simulate(program, gpu)
    # expand_ranks keeps the validated symmetric structure; validate that one (the explicit
    # Program's cycle check is quadratic in ranks) and run the explicit one
    validate(program, gpu.num_sms)
    seed = getattr(args, "seed", 0)
    return lowered, Engine(lowered, gpu, seed, net_group_tol=NET_GROUP_TOL).run()


def add_straggler_cost(res: dict, name: str, w: Workload, gpu: GPU, cfg: ScheduleConfig) -> None:
    """Straggler cost of an explicit run: its step time minus the balanced (symmetric) one."""
    if res.get("ranks") != "explicit":
        return
    from overlap_lab.sim import simulate

    balanced = simulate(build_schedule(name, w, gpu, cfg), gpu).step_time_us
    res["balanced_step_time_us"] = balanced
    res["straggler_cost_us"] = res["step_time_us"] - balanced


def _print_summary(res: dict) -> None:
    print(
        f"{res['schedule']}: {res['model']} {res['mode']} on {res['gpu']}, "
        f"{res['batch']} seqs ({res['tokens']} tokens) per GPU, EP {res['ep']}"
    )
    print(f"  step time        {res['step_time_us'] / 1e3:10.3f} ms")
    print(f"  exposed comm     {res['exposed_comm_us'] / 1e3:10.3f} ms")
    print(f"  SM utilisation   {res['sm_utilisation'] * 100:10.1f} %")
    print(f"  ops              {res['num_ops']:10d}")
    if "straggler_cost_us" in res:
        steps = [r["step_time_us"] for r in res["per_rank"]]
        print(f"  ranks explicit   {len(steps):10d}  ({res['imbalance']})")
        print(f"  straggler cost   {res['straggler_cost_us'] / 1e3:10.3f} ms")
        print(f"  rank step ms     {min(steps) / 1e3:10.3f} .. {max(steps) / 1e3:.3f}")
    for mb in res["micro_batches"]:
        cut = ", splits a sequence" if mb.get("split_seq") else ""
        print(
            f"  micro-batch {mb['index']}: seqs [{mb['seq_lo']}, {mb['seq_hi']}), "
            f"{mb['tokens']} tokens padded to {mb['padded_tokens']}{cut}"
        )
    if "comm_sms" in res:
        print(f"  communication SMs {res['comm_sms']}")
    if res.get("fallback_reason"):
        print(f"  ran unsplit: {res['fallback_reason']}")
    for lane, busy in sorted(res["busy_us"].items()):
        print(f"  busy {lane:<22s} {busy / 1e3:10.3f} ms")


def cmd_sim(args) -> int:
    w, gpu, cfg = workload_from(args), gpu_from(args), config_from(args)
    program, trace = simulate_one(args.schedule, w, gpu, cfg, args)
    res = result_dict(args.schedule, w, gpu, program, trace)
    add_straggler_cost(res, args.schedule, w, gpu, cfg)
    if args.out:
        from overlap_lab.experiments.figures import moe_window, save_timeline

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        trace.to_chrome(out / "trace.json")
        save_timeline(trace, out / f"timeline.{args.figure_format}", window=moe_window(trace))
        res["files"] = [str(out / "trace.json"), str(out / f"timeline.{args.figure_format}")]
    if args.json:
        print(json.dumps(res, sort_keys=True))
    else:
        _print_summary(res)
        for f in res.get("files", []):
            print(f"  wrote {f}")
    return 0


def cmd_show(args) -> int:
    w, gpu, cfg = workload_from(args), gpu_from(args), config_from(args)
    from overlap_lab.shared.validate import validate

    program = build_schedule(args.schedule, w, gpu, cfg)
    validate(program, gpu.num_sms)
    sys.stdout.write(str(lower_ranks(program, w, gpu, args)))
    return 0


def cmd_schedules(args) -> int:
    from overlap_lab.shared.schedules import describe

    rows = describe()
    width = max(len(n) for n, _, _ in rows)
    for name, seed, summary in rows:
        print(f"{name:<{width}}  [{seed}]  {summary}")
    return 0


def cmd_compare(args) -> int:
    from tqdm import tqdm

    w, gpu, cfg = workload_from(args), gpu_from(args), config_from(args)
    names = [s.strip() for s in args.schedules.split(",") if s.strip()]
    for n in names:
        if n not in SCHEDULES:
            raise ConfigError(f"unknown schedule {n!r}; choose from {', '.join(SCHEDULES)}")
    runs = {}
    todo = names if "serial" in names else ["serial", *names]
    for n in tqdm(todo, desc="simulating", unit="schedule", disable=args.json, file=sys.stderr):
        runs[n] = simulate_one(n, w, gpu, cfg, args)
    base = runs["serial"][1].step_time_us
    rows = []
    for n in names:
        p, tr = runs[n]
        res = result_dict(n, w, gpu, p, tr)
        res["speedup_vs_serial"] = base / tr.step_time_us
        add_straggler_cost(res, n, w, gpu, cfg)
        rows.append(res)
    if args.out:
        from overlap_lab.experiments.figures import compare_timelines, moe_window

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        traces = {n: runs[n][1] for n in names}
        fig = out / f"compare.{args.figure_format}"
        compare_timelines(traces, fig, window=moe_window(runs[names[-1]][1]))
        for n in names:
            runs[n][1].to_chrome(out / f"trace_{n.replace('+', '_')}.json")
    if args.json:
        print(json.dumps({"results": rows}, sort_keys=True))
        return 0
    head = (
        f"{'schedule':<16}{'step ms':>10}{'speed-up':>10}{'exposed comm ms':>17}"
        f"{'comm-only ms':>14}  note"
    )
    print(head)
    for r in rows:
        note = r.get("fallback_reason") or ""
        print(
            f"{r['schedule']:<16}{r['step_time_us'] / 1e3:>10.3f}{r['speedup_vs_serial']:>10.3f}"
            f"{r['exposed_comm_us'] / 1e3:>17.3f}{r['comm_only_us'] / 1e3:>14.3f}  {note}"
        )
    if args.out:
        print(f"wrote {Path(args.out) / ('compare.' + args.figure_format)}")
    return 0


def cmd_run(args) -> int:
    from overlap_lab.real.cli import run_main

    args.cfg = config_from(args)
    if args.layers is None and args.device != "cpu":
        args.layers = GPU_RUN_LAYERS
    args.workload = workload_from(args)  # the same workload `sim` builds from the same options
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
    s.add_argument("--figure-format", default="png", choices=("png", "pdf", "svg"))
    s.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    _workload_options(s)
    _rank_options(s)
    s.set_defaults(func=cmd_sim)

    s = sub.add_parser("show", help="print the Program's text form")
    s.add_argument("--schedule", default="serial")
    _workload_options(s)
    _rank_options(s)
    s.set_defaults(func=cmd_show)

    s = sub.add_parser("schedules", help="list the schedules and their seeds")
    s.set_defaults(func=cmd_schedules)

    s = sub.add_parser("compare", help="simulate several schedules on one workload")
    s.add_argument("--schedules", default="serial,sbo,tbo,tbo+sbo,lightllm,vllm-dbo,deepseek")
    s.add_argument("--out", default="overlap-lab-out", help="directory for the stacked figure")
    s.add_argument("--figure-format", default="png", choices=("png", "pdf", "svg"))
    s.add_argument("--json", action="store_true")
    _workload_options(s)
    _rank_options(s)
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

    from overlap_lab.experiments.cli_sweep import add_parser as add_sweep

    add_sweep(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        msg = str(e).strip()
        print(f"overlap-lab: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
