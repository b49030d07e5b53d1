"""How fast the simulator is: one JSON line per case (`case`, `wall_ms`, `events_per_s`).

    python -m overlap_lab.experiments.bench_sim [--repeats 5] [--out experiments/results/bench_sim.jsonl]

Each case builds a Program once and simulates it ``repeats`` times; ``wall_ms`` is the median
simulation time (building excluded), ``events_per_s`` counts SimPy events processed per second.
Targets (issue 2): a whole 61-layer DeepSeek-V3 decode step under 50 ms on a 2-core machine;
(issue 4) the same TBO step with all 32 EP ranks explicit under 2 s.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import date

import simpy

from overlap_lab.shared.hardware import get_gpu
from overlap_lab.shared.ranks import expand_ranks
from overlap_lab.shared.routing import routing_for
from overlap_lab.shared.schedules import build
from overlap_lab.shared.validate import validate
from overlap_lab.shared.workload import Batch, Parallel, Workload, get_model
from overlap_lab.sim.engine import Engine


def _count_events(env: simpy.Environment) -> list[int]:
    """Wrap env.step to count processed events."""
    count = [0]
    step = env.step

    def counting_step():
        count[0] += 1
        step()

    env.step = counting_step
    return count


def cases():
    v3 = get_model("deepseek-v3")
    yield (
        "deepseek-v3 decode serial b128 ep32 h800",
        "serial",
        Workload(v3, Batch.decode(128, kv_len=4096), Parallel(ep=32)),
    )
    yield (
        "deepseek-v3 prefill serial 4x4096 ep32 h800",
        "serial",
        Workload(v3, Batch.prefill(4, extend_len=4096), Parallel(ep=32)),
    )
    yield (
        "deepseek-v3 decode tbo b128 ep32 h800",
        "tbo",
        Workload(v3, Batch.decode(128, kv_len=4096), Parallel(ep=32)),
    )
    # issue 4: every EP rank explicit (balanced routing: flows of an all-to-all end together)
    yield (
        "deepseek-v3 decode tbo b128 ep32 h800 explicit-ranks",
        "tbo",
        Workload(v3, Batch.decode(128, kv_len=4096), Parallel(ep=32)),
    )


def run_case(name: str, schedule: str, w: Workload, repeats: int) -> dict:
    gpu = get_gpu("h800")
    program = build(schedule, w, gpu)
    validate(program, gpu.num_sms)
    if name.endswith("explicit-ranks"):  # lowering excluded from the timing, as building is
        program = expand_ranks(program, w, gpu, routing_for(w, "balanced"))
    walls, events = [], 0
    for _ in range(repeats):
        eng = Engine(program, gpu, net_group_tol=0.02)
        counter = _count_events(eng.env)
        t0 = time.perf_counter()
        eng.run()
        walls.append(time.perf_counter() - t0)
        events = counter[0]
    wall = statistics.median(walls)
    return {"case": name, "wall_ms": round(wall * 1e3, 2), "events_per_s": round(events / wall)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="also append the lines to this file")
    args = ap.parse_args(argv)
    lines = []
    for name, schedule, w in cases():
        res = run_case(name, schedule, w, args.repeats)
        res.update(
            machine=f"{platform.machine()} {platform.python_version()}",
            date=date.today().isoformat(),
        )
        lines.append(json.dumps(res))
        print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
