"""What ``compare --sensitivity`` costs over a plain ``compare``, on the case it was built for.

    python -m overlap_lab.experiments.bench_sensitivity [--rounds N] [--out DIR]

times the two commands below in alternating rounds (plain, sensitivity, plain, ...: a loaded
machine slows both alike), each as a fresh process, wall time and CPU time, then runs the same
comparison once through the API for the ranges. Writes ``bench_sensitivity.json`` (the times of
every round, the commands, the ranges) and ``bench_sensitivity.md``, generated from that JSON.
The budget: the sensitivity command within 5x the plain one (docs/uncertainty.md says why only
costs vary, which is what keeps it there).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from statistics import median
from typing import Any

from overlap_lab.experiments.runner import REPO_RESULTS, git_commit, md_table
from overlap_lab.sensitivity import default_workers

NAME = "bench_sensitivity"
CASE = ["--model", "deepseek-v3", "--gpu", "h800", "--mode", "decode", "--batch", "128"]
CASE += ["--ep", "32"]
BUDGET = 5.0


def _command(sens: bool, out: str) -> list[str]:
    cmd = ["overlap-lab", "compare", *CASE, "--out", out]
    return cmd + (["--sensitivity"] if sens else [])


def _timed(cmd: list[str]) -> tuple[float, float, str]:
    """(wall s, CPU s of the child, its stdout)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, run.stdout


def measure(rounds: int) -> dict[str, Any]:
    """Alternating rounds of both commands, then the API's ranges."""
    import overlap_lab as ol

    times: dict[str, list[dict[str, float]]] = {"plain": [], "sensitivity": []}
    table = ""
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            for key in ("plain", "sensitivity"):
                wall, cpu, out = _timed(_command(key == "sensitivity", tmp))
                times[key].append({"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)})
                if key == "sensitivity":
                    table = out
    w = ol.workload("deepseek-v3", mode="decode", batch=128, ep=32)
    # in this process: wall s, and CPU s of this process and of the workers it forked
    api: dict[str, list[dict[str, float]]] = {"plain": [], "sensitivity": []}
    c = None
    for _ in range(rounds):
        for key in ("plain", "sensitivity"):
            kids = resource.getrusage(resource.RUSAGE_CHILDREN)
            t, cpu = time.perf_counter(), time.process_time()
            c = ol.compare(workload=w, gpu="h800", sensitivity=key == "sensitivity" or None)
            wall, cpu = time.perf_counter() - t, time.process_time() - cpu
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu += (after.ru_utime - kids.ru_utime) + (after.ru_stime - kids.ru_stime)
            api[key].append({"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)})
    api_med = {k: {m: median(r[m] for r in v) for m in ("wall_s", "cpu_s")} for k, v in api.items()}
    s = c.sensitivity
    med = {k: {m: median(r[m] for r in v) for m in ("wall_s", "cpu_s")} for k, v in times.items()}
    return {
        "experiment": NAME,
        "command": f"python -m overlap_lab.experiments.{NAME} --rounds {rounds}",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "commands": {k: " ".join(_command(k == "sensitivity", "DIR")) for k in times},
        "rounds": times,
        "median": med,
        "ratio_wall": med["sensitivity"]["wall_s"] / med["plain"]["wall_s"],
        "ratio_cpu": med["sensitivity"]["cpu_s"] / med["plain"]["cpu_s"],
        "workers": default_workers(),
        "api_rounds": api,
        "api_median": api_med,
        "ratio_api_wall": api_med["sensitivity"]["wall_s"] / api_med["plain"]["wall_s"],
        "ratio_api_cpu": api_med["sensitivity"]["cpu_s"] / api_med["plain"]["cpu_s"],
        "budget": BUDGET,
        "design": s.design.describe(),
        "points": len(s.points) + 1,
        "schedules": [r.as_dict() for r in s.ranges],
        "paired": {
            "tbo_over_tbo+sbo": s.paired_share("tbo", "tbo+sbo"),
            "deepseek_over_tbo": s.paired_share("deepseek", "tbo"),
        },
        "separated": {"tbo|tbo+sbo": s.separated("tbo", "tbo+sbo")},
        "table": table,
    }


def notes(doc: dict[str, Any]) -> str:
    """The notes, from the JSON alone."""
    med = doc["median"]
    rows = [
        [
            k,
            len(doc["rounds"][k]),
            ", ".join(f"{r['wall_s']:.2f}" for r in doc["rounds"][k]),
            f"{med[k]['wall_s']:.2f}",
            f"{med[k]['cpu_s']:.2f}",
            f"`{doc['commands'][k]}`",
        ]
        for k in ("plain", "sensitivity")
    ]
    ranges = [
        [
            r["schedule"],
            f"{r['nominal_us'] / 1e3:.3f}",
            f"{r['lo_us'] / 1e3:.3f}-{r['hi_us'] / 1e3:.3f}",
            f"{100 * r['wins']:.0f} %",
            ", ".join(r["not_separated"]) or "-",
        ]
        for r in doc["schedules"]
    ]
    sep = doc["separated"]["tbo|tbo+sbo"]
    verdict = "within" if doc["ratio_wall"] < doc["budget"] else "over"
    api_verdict = "within" if doc["ratio_api_wall"] < doc["budget"] else "over"
    api = doc["api_median"]
    return f"""# compare --sensitivity: what it costs

Command: `{doc["command"]}`  ·  {doc["date"][:10]}  ·  commit {doc["commit"]}

DeepSeek-V3 decode on H800, EP 32, 128 sequences per GPU, every schedule; {doc["design"]},
{doc["points"]} points with the nominal run, shared among {doc["workers"]} worker processes (one
per CPU this machine gave the process). Each command ran as a fresh process, the two
alternating; CPU time counts the workers' too. Wall time depends on what else the machine runs.

{md_table(["command", "rounds", "wall s per round", "median wall s", "median CPU s", "as run"], rows)}

Sensitivity over plain: {doc["ratio_wall"]:.2f}x wall, {doc["ratio_cpu"]:.2f}x CPU (median
rounds), {verdict} the {doc["budget"]:.0f}x budget. In one process through the API (no imports,
no figure or trace files; median of the rounds): {api["plain"]["wall_s"]:.2f} s plain,
{api["sensitivity"]["wall_s"]:.2f} s with the design, {doc["ratio_api_wall"]:.2f}x wall
({doc["ratio_api_cpu"]:.2f}x CPU), {api_verdict} the budget. The API's ratio is the higher one:
there a plain comparison is only its builds, validations and simulations, while each extra point
costs one simulation per schedule; the command's imports, figure and trace files are paid once
either way.

## What the ranges say

{md_table(["schedule", "ms/iter", "range", "wins", "not separated from"], ranges)}

TBO against TBO+SBO: {"separated" if sep else "not separated"}; TBO has more throughput at
{100 * doc["paired"]["tbo_over_tbo+sbo"]:.0f} % of the points. DeepSeek's schedule against TBO:
ahead at {100 * doc["paired"]["deepseek_over_tbo"]:.0f} % of the points.
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m overlap_lab.experiments.{NAME}")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO_RESULTS)
    args = ap.parse_args(argv)
    doc = measure(args.rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{NAME}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    path.with_suffix(".md").write_text(notes(doc))
    print(path.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
