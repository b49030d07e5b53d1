"""How fast the simulator is: one JSON line per case, every row of the speed issue's table.

    python -m overlap_lab.experiments.bench_sim [--repeats 5] [--cases NAME,...]
        [--out experiments/results/bench_sim.jsonl]

Each case runs in its own subprocess (so its peak memory, ``ru_maxrss``, is its own): it builds the
Program and lowers it to explicit ranks where asked (``build_*``), then simulates it ``repeats``
times (``sim_*``: the SimPy event loop) and post-processes the trace as ``overlap-lab sim --json``
does (``post_*``: the ``sim --json`` result (``Result.as_dict``) and the Chrome export). Times
are medians, in CPU time (``time.process_time``, robust to a shared machine) and wall time;
``total_cpu_ms`` is build + sim + post. ``events`` counts the SimPy events one simulation
processes and ``events_per_op`` divides them by the Program's ops (all ranks); ``pass_rounds``
counts the block scheduler's rounds of passes, which run between events with no SimPy event of
their own (``sim.budget``), and ``budget_events_per_op`` counts them as events, as the budget
does; ``timed_alone`` counts the kernels the engine timed in closed form with no event of their
own (``sim.alone``: plain kernels on a one-stream rank). ``raw_simpy`` is a bare ``env.timeout``
loop measured in the same run, the ceiling for events per CPU-second.
``*_reduced`` runs a balanced explicit case as ``overlap-lab sim`` now does: its ranks are
detected alike and simulated once (``shared.ir.symmetry``; build: + detection and the quotient's
validation, sim: + the Trace copied to every rank), where the case without the suffix simulates
every rank. ``*_numpy_rerate`` repeats a case with the network's compiled progressive filling switched off
(what the optional numba extra buys), ``routing_layer_64k_numpy`` the routing layer with the
race sampler's compiled loop off; ``sweep_1000_no_dedupe`` the sweep with every case simulated
(what deduplication buys).
``sweep_1000`` runs the issue's 1,000-case sweep (5 schedules x 5 batches x 4 EP sizes x 10
comm-SM values, full DeepSeek-V3 decode on H800) through ``overlap_lab.cli.sweep`` on 2
worker processes; its CPU time is this process's plus its workers'.
Every simulation runs as ``overlap-lab sim`` does, its repeated layers fast-forwarded where the
state repeats (``sim.fastforward``); ``*_no_ff`` repeats a case with every layer simulated. The
schedule's module is imported before the clock starts (a search imports it once, not per case).

Regressions: each case's CPU time (``total_cpu_ms``) is compared with the case's last line in the
committed results (``git show HEAD:`` of ``--baseline``, default this script's
``results/bench_sim.jsonl``; the file as it is outside a git checkout); a case more than
``REGRESSION`` times slower gets a line on stderr, the run exits with status 1
(``--allow-regressions``: 0) and every line carries its ratio (``vs_last_cpu``).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import simpy

#: name -> (schedule, mode, sequences per rank, ep, ranks, imbalance, repeats)
CASES: dict[str, tuple] = {
    "decode_tbo_b128_ep32_symmetric": ("tbo", "decode", 128, 32, "symmetric", "balanced", 5),
    "decode_tbo_b128_ep32_explicit_balanced": (
        "tbo",
        "decode",
        128,
        32,
        "explicit",
        "balanced",
        3,
    ),
    "decode_tbo_b128_ep32_explicit_zipf1.2": ("tbo", "decode", 128, 32, "explicit", "zipf:1.2", 1),
    # prefill: 4 x 4096 = 16K tokens per rank, 16 x 4096 = 64K
    "prefill_serial_16k_ep32_explicit_zipf1.2": (
        "serial",
        "prefill",
        4,
        32,
        "explicit",
        "zipf:1.2",
        1,
    ),
    "prefill_serial_64k_ep32_explicit_zipf1.2": (
        "serial",
        "prefill",
        16,
        32,
        "explicit",
        "zipf:1.2",
        1,
    ),
}
# balanced explicit ranks as `overlap-lab sim` runs them: detected alike (shared.ir.symmetry), the
# quotient simulated once (build_*: + detection and the quotient's validation; sim_*: + the
# Trace copied to every rank)
CASES["decode_tbo_b128_ep32_explicit_balanced_reduced"] = CASES[
    "decode_tbo_b128_ep32_explicit_balanced"
]
# the same zipf step with the network's compiled re-rate off (numpy progressive filling only)
CASES["decode_tbo_b128_ep32_explicit_zipf1.2_numpy_rerate"] = CASES[
    "decode_tbo_b128_ep32_explicit_zipf1.2"
]
# the same symmetric and reduced steps with every layer simulated (what the fast-forward buys)
CASES["decode_tbo_b128_ep32_symmetric_no_ff"] = CASES["decode_tbo_b128_ep32_symmetric"]
CASES["decode_tbo_b128_ep32_explicit_balanced_reduced_no_ff"] = CASES[
    "decode_tbo_b128_ep32_explicit_balanced"
]
SPECIAL = (
    "raw_simpy",
    "routing_layer_64k",
    "routing_layer_64k_numpy",
    "sweep_1000",
    "sweep_1000_no_dedupe",
)
#: the explicit network's grouping tolerance, as `overlap-lab sim` uses it
NET_GROUP_TOL = 0.02
#: a case whose CPU time is more than this many times its last committed one has regressed
REGRESSION = 1.5
RESULTS = Path(__file__).parent / "results" / "bench_sim.jsonl"


def _count_events(env: simpy.Environment) -> list[int]:
    """Wrap env.step to count processed events ([0]) and the block scheduler's rounds of passes
    that ``sim.budget.run_budgeted`` runs between events, with no SimPy event of their own ([1];
    the budget counts each as one event)."""
    from overlap_lab.sim.resources import timers

    count = [0, 0]
    step = env.step
    t = timers(env)
    passes = t.run_passes

    def counting_step():
        count[0] += 1
        step()

    def counting_passes():
        count[1] += 1
        passes()

    env.step = counting_step
    t.run_passes = counting_passes
    return count


def _clock() -> tuple[float, float]:
    return time.process_time(), time.perf_counter()


def _since(t: tuple[float, float]) -> tuple[float, float]:
    c, w = _clock()
    return c - t[0], w - t[1]


def run_case(name: str, repeats: int | None = None) -> dict:
    """One row of the table: build, simulate and post-process the case ``name``."""
    from overlap_lab.api import Ranks, Result, lower_ranks
    from overlap_lab.metrics import measure
    from overlap_lab.shared.inputs.hardware import get_gpu
    from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model
    from overlap_lab.shared.ir.program import Graph, Launch
    from overlap_lab.shared.ir.validate import validate
    from overlap_lab.shared.schedules import ScheduleConfig, build, module
    from overlap_lab.sim.engine import Engine

    schedule, mode, n, ep, ranks, imbalance, reps = CASES[name]
    module(schedule)  # imported once per process, as a search or a sweep does
    ff = not name.endswith("_no_ff")
    name = name.removesuffix("_no_ff")
    if name.endswith("_numpy_rerate"):
        from overlap_lab.sim import network

        network._COMPILED_AFTER = 10**18
    reps = repeats or reps
    gpu = get_gpu("h800")
    batch = Batch.decode(n, kv_len=4096) if mode == "decode" else Batch.prefill(n, extend_len=4096)
    w = Workload(get_model("deepseek-v3"), batch, Parallel(ep=ep))
    t = _clock()
    program = build(schedule, w, gpu)
    if not name.endswith("_reduced"):  # a reduced run validates what it simulates, below
        validate(program, gpu.num_sms)
    lowered = lower_ranks(program, w, gpu, Ranks(ranks, imbalance, 0.0, None, 0))
    red = None
    if name.endswith("_reduced"):
        from overlap_lab.shared.ir.symmetry import Reduction, expand_trace, reduce_program

        red = reduce_program(lowered, w.parallel.gpus_per_node)
        if not isinstance(red, Reduction):
            raise RuntimeError(f"{name}: not reduced: {red}")
        validate(red.program, gpu.num_sms)
    build_t = _since(t)
    ops = sum(
        len(i.body) if isinstance(i, Graph) else 1
        for rp in lowered.ranks
        for th in rp.threads
        for i in th.instrs
        if isinstance(i, (Launch, Graph))
    )
    sims, posts, events = [], [], 0
    for _ in range(reps):
        if red is not None:
            eng = Engine(red.program, gpu, 0, fast_forward=ff)
        else:
            tol = 0.0 if ranks == "symmetric" else NET_GROUP_TOL
            eng = Engine(lowered, gpu, 0, net_group_tol=tol, fast_forward=ff)
        counter = _count_events(eng.env)
        t = _clock()
        trace = eng.run()
        if red is not None:
            trace = expand_trace(trace, red)
        sims.append(_since(t))
        events, rounds = counter
        alone = eng.timed_alone
        t = _clock()
        metrics = measure(trace, lowered, w, gpu.num_sms)
        Result(schedule, w, gpu, ScheduleConfig(), lowered, trace, metrics).as_dict()
        trace.to_chrome()
        posts.append(_since(t))
    sim_cpu = statistics.median(c for c, _ in sims)
    post_cpu = statistics.median(c for c, _ in posts)
    return {
        "case": name if ff else f"{name}_no_ff",
        "tokens_per_rank": w.batch.num_tokens,
        "total_cpu_ms": round((build_t[0] + sim_cpu + post_cpu) * 1e3, 1),
        "total_wall_ms": round(
            (
                build_t[1]
                + statistics.median(w for _, w in sims)
                + statistics.median(w for _, w in posts)
            )
            * 1e3,
            1,
        ),
        "build_cpu_ms": round(build_t[0] * 1e3, 1),
        "sim_cpu_ms": round(sim_cpu * 1e3, 1),
        "post_cpu_ms": round(post_cpu * 1e3, 1),
        "events": events,
        "ops": ops,
        "events_per_op": round(events / ops, 2),
        "pass_rounds": rounds,
        "budget_events_per_op": round((events + rounds) / ops, 2),
        "timed_alone": alone,
        "events_per_cpu_s": round(events / sim_cpu) if sim_cpu > 0 else None,
        "repeats": reps,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "fast_forward": trace.meta.get("fast_forward", "off"),
    }


def raw_simpy(n: int = 300_000) -> dict:
    """A bare SimPy loop: one process yielding ``n`` timeouts (2 events each: timeout, resume)."""
    env = simpy.Environment()
    counter = _count_events(env)

    def proc(env):
        for _ in range(n):
            yield env.timeout(1)

    env.process(proc(env))
    t = _clock()
    env.run()
    cpu, wall = _since(t)
    return {
        "case": "raw_simpy",
        "events": counter[0],
        "total_cpu_ms": round(cpu * 1e3, 1),
        "total_wall_ms": round(wall * 1e3, 1),
        "events_per_cpu_s": round(counter[0] / cpu),
    }


def sweep_1000(dedupe: bool = True) -> dict:
    """The 1,000-case sweep through the sweep module, 2 local workers, to a fresh CSV."""
    import tempfile
    from pathlib import Path

    from overlap_lab.cli.sweep import load_spec, run_sweep

    spec = load_spec(
        {
            "base": {"model": "deepseek-v3", "gpu": "h800", "mode": "decode", "kv_len": 4096},
            "grid": {
                "schedule": ["serial", "sbo", "tbo", "tbo+sbo", "deepseek"],
                "batch": [16, 32, 64, 128, 256],
                "ep": [8, 16, 32, 64],
                "sbo_comm_sms": [4, 8, 12, 16, 20, 24, 28, 32, 36, 40],
            },
        }
    )
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "sweep.csv"
        t = _clock()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        stats = run_sweep(spec, out, processes=2, progress=False, dedupe=dedupe)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu, wall = _since(t)
    cpu += (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {
        "case": "sweep_1000" if dedupe else "sweep_1000_no_dedupe",
        "cases": stats["cases"],
        "simulated": stats["simulated"],
        "total_cpu_ms": round(cpu * 1e3, 1),
        "total_wall_ms": round(wall * 1e3, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def routing_layer(tokens_per_rank: int = 65536, compiled: bool = True) -> dict:
    """One MoE layer's sampled routing (zipf:1.2) at EP32: draw and per-rank counts of two
    micro-batch ranges, CPU time and peak traced memory (the prefill rows' memory bound).
    The race sampler's compiled loop (numba, when installed) is loaded by a one-token draw before
    the clock starts; ``compiled=False`` (``routing_layer_64k_numpy``) draws with numpy."""
    import tracemalloc

    from overlap_lab.shared.inputs import routing
    from overlap_lab.shared.inputs.routing import routing_for
    from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model

    if not compiled:
        routing._compiled = False
    loop = routing.compiled_race_loop()
    w = Workload(get_model("deepseek-v3"), Batch.prefill(1, extend_len=1), Parallel(ep=32))
    routing_for(w, "zipf:1.2").layer(0).topk  # noqa: B018 - loads (or compiles) the loop
    w = Workload(
        get_model("deepseek-v3"), Batch.prefill(1, extend_len=tokens_per_rank), Parallel(ep=32)
    )
    r = routing_for(w, "zipf:1.2")
    tracemalloc.start()
    t = _clock()
    r.layer(3).matrices(0, tokens_per_rank // 2)
    r.layer(3).matrices(tokens_per_rank // 2, tokens_per_rank)
    cpu, wall = _since(t)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {
        # (the numpy loop's case named apart: its last results are its own)
        "case": f"routing_layer_{tokens_per_rank // 1024}k_ep32_zipf1.2"
        + ("" if compiled else "_numpy"),
        "tokens_per_rank": tokens_per_rank,
        "compiled": loop is not None,
        "total_cpu_ms": round(cpu * 1e3, 1),
        "total_wall_ms": round(wall * 1e3, 1),
        "peak_traced_mb": round(peak / 2**20, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


def _one(name: str, repeats: int | None) -> dict:
    if name.startswith("routing_layer_64k"):
        return routing_layer(compiled=name == "routing_layer_64k")
    if name == "raw_simpy":
        return raw_simpy()
    if name.startswith("sweep_1000"):
        return sweep_1000(dedupe=name == "sweep_1000")
    return run_case(name, repeats)


def last_results(path: Path) -> dict[str, dict]:
    """Each case's last line in the committed ``path`` (``git show HEAD:``), or in the file as
    it is where git has none; {} when there is neither."""
    text = None
    try:
        top = subprocess.run(
            ["git", "-C", str(path.parent), "rev-parse", "--show-toplevel"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        rel = path.resolve().relative_to(Path(top).resolve()).as_posix()
        text = subprocess.run(
            ["git", "-C", top, "show", f"HEAD:{rel}"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, ValueError, subprocess.CalledProcessError):
        text = path.read_text() if path.exists() else ""
    last = {}
    for line in text.splitlines():
        if line.strip():
            res = json.loads(line)
            last[res.get("case")] = res
    return last


def regressions(results: list[dict], last: dict[str, dict], limit: float = REGRESSION) -> list:
    """Cases of ``results`` whose CPU time is more than ``limit`` times their line in ``last``:
    one line each, saying by how much (each result gets ``vs_last_cpu``, its ratio)."""
    out = []
    for res in results:
        old = last.get(res.get("case"), {})
        new_ms, old_ms = res.get("total_cpu_ms"), old.get("total_cpu_ms")
        if not new_ms or not old_ms:
            continue
        ratio = new_ms / old_ms
        res["vs_last_cpu"] = round(ratio, 2)
        if ratio > limit:
            at = ", ".join(str(old[k]) for k in ("date", "revision") if k in old)
            out.append(
                f"REGRESSION {res['case']}: {new_ms:.1f} ms CPU, {ratio:.2f}x its last committed "
                f"{old_ms:.1f} ms ({at}; limit {limit}x)"
            )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=None, help="override each case's repeats")
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--out", default=None, help="also append the lines to this file")
    ap.add_argument(
        "--baseline",
        default=str(RESULTS),
        help="results to compare CPU times with: each case's last committed line",
    )
    ap.add_argument(
        "--allow-regressions",
        action="store_true",
        help=f"exit 0 even when a case is more than {REGRESSION}x slower than its last results",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # run one case, print it
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_one(args.child, args.repeats)))
        return 0
    names = args.cases.split(",") if args.cases else [*SPECIAL[:3], *CASES, *SPECIAL[3:]]
    last = last_results(Path(args.baseline))
    lines, slow = [], []
    for name in names:
        cmd = [sys.executable, "-m", "overlap_lab.experiments.bench_sim", "--child", name]
        if args.repeats:
            cmd += ["--repeats", str(args.repeats)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            res = {"case": name, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
        else:
            res = json.loads(proc.stdout.strip().splitlines()[-1])
        res.update(
            machine=f"{platform.machine()} {platform.python_version()}",
            date=date.today().isoformat(),
        )
        slow += regressions([res], last)
        lines.append(json.dumps(res))
        print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")
    for line in slow:
        print(line, file=sys.stderr)
    if slow:
        print(
            f"bench_sim: {len(slow)} case(s) more than {REGRESSION}x slower in CPU time than "
            f"their last committed results",
            file=sys.stderr,
        )
    return 1 if slow and not args.allow_regressions else 0


if __name__ == "__main__":
    sys.exit(main())
