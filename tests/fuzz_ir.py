"""The IR fuzz of issue 32: Programs through parse -> validate -> simulate, failures counted.

    python -m tests.fuzz_ir --programs 5000        # from the repository root

Draws ``--programs`` texts from the Program-fuzz suite's generators (``tests/test_fuzz_program``:
mutated goldens and schedule Programs, random grammar, sound competing kernels), reproducibly for
one ``--seed``, and counts what must never happen:

- ``crash``: any exception but a ParseError or ProgramError before the simulation, or any but the
  budget's during it (a stall included: the validator accepted the Program);
- ``hang``: a simulation past ``--events`` events, or a Program whose parse, validation and
  simulation together take more than ``--seconds`` seconds;
- ``below critical path``: a step time below ``tests.invariants.critical_path_us``;
- ``faster than alone``: a kernel that ran faster than alone (``never_faster_than_alone``);
- ``rejection without location``: a ProgramError that does not show one line marked
  ``<-- ERROR HERE``, or a ParseError that is not one line naming its line.

Writes the counts, the command and the first Program of each failure to ``--out`` (by default
``tests/fuzz_ir_results.md``, beside this file) and exits 1 if anything failed. The times are
printed, not written: the file is the same for the same arguments.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import time
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from overlap_lab.shared.ir.program import ParseError, parse
from overlap_lab.shared.ir.validate import ProgramError, validate
from overlap_lab.sim.budget import SimulationBudgetExceeded
from overlap_lab.sim.engine import Engine
from tests.invariants import critical_path_us, never_faster_than_alone
from tests.test_fuzz_program import GPU, mutated, random_program, sound_program

RESULTS = Path(__file__).with_name("fuzz_ir_results.md")
FAILURES = (
    "crash",
    "hang",
    "below critical path",
    "faster than alone",
    "rejection without location",
)


class _OverTime(Exception):
    """The Program's time budget ran out (raised by SIGALRM inside whatever was running)."""


def _alarm(_sig, _frame):
    raise _OverTime


def classify(text: str, events: int, seconds: float) -> str:
    """One Program's outcome: ``parsed out``, ``refused``, ``simulated`` or one of FAILURES."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return _classify(text, events)
    except _OverTime:
        return "hang"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _classify(text: str, events: int) -> str:
    try:
        program = parse(text)
    except ParseError as e:
        ok = re.match(r"line \d+: \S", str(e)) and "\n" not in str(e)
        return "parsed out" if ok else "rejection without location"
    except _OverTime:
        raise
    except Exception:
        return "crash"
    try:
        validate(program, GPU.num_sms)
    except ProgramError as e:
        return "refused" if str(e).count("<-- ERROR HERE") == 1 else "rejection without location"
    except _OverTime:
        raise
    except Exception:
        return "crash"
    try:
        trace = Engine(program, GPU, max_events=events).run()
    except SimulationBudgetExceeded:
        return "hang"
    except _OverTime:
        raise
    except Exception:
        return "crash"
    if trace.step_time_us < critical_path_us(program, GPU) * (1 - 1e-9) - 1e-6:
        return "below critical path"
    try:
        never_faster_than_alone(program, trace, GPU)
    except AssertionError:
        return "faster than alone"
    return "simulated"


def run(programs: int, seed_: int, events: int, seconds: float) -> tuple[Counter, dict[str, str]]:
    """Outcome counts of ``programs`` drawn texts, and the first text of each failure."""
    counts: Counter = Counter()
    first: dict[str, str] = {}

    @seed(seed_)
    @settings(
        max_examples=programs,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.one_of(mutated(), random_program(), sound_program()))
    def draw(text):
        what = classify(text, events, seconds)
        counts[what] += 1
        if what in FAILURES:
            first.setdefault(what, text)

    draw()
    return counts, first


def report(counts: Counter, first: dict[str, str], command: str) -> str:
    lines = [
        "# IR fuzz: parse -> validate -> simulate (issue 32)",
        "",
        f"Command: `{command}`",
        "",
        f"Programs: {sum(counts.values())}",
        "",
        "| outcome | Programs |",
        "|---|---:|",
    ]
    lines += [f"| {k} | {counts.get(k, 0)} |" for k in ("parsed out", "refused", "simulated")]
    lines += [f"| **{k}** | {counts.get(k, 0)} |" for k in FAILURES]
    for k, text in first.items():
        lines += ["", f"First {k}:", "", "```", text.rstrip("\n"), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", type=int, default=5000, help="Programs to draw")
    ap.add_argument("--seed", type=int, default=0, help="the draw's seed")
    ap.add_argument("--events", type=int, default=200_000, help="event budget per simulation")
    ap.add_argument("--seconds", type=float, default=30.0, help="time budget per Program")
    ap.add_argument("--out", type=Path, default=RESULTS, help="the results file")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    counts, first = run(args.programs, args.seed, args.events, args.seconds)
    command = (
        f"python -m tests.fuzz_ir --programs {args.programs} --seed {args.seed} "
        f"--events {args.events} --seconds {args.seconds:g}"
    )
    text = report(counts, first, command)
    args.out.write_text(text)
    print(text, end="", flush=True)
    print(f"{time.perf_counter() - t0:.0f} s; results in {args.out}", file=sys.stderr)
    return 1 if any(counts.get(k) for k in FAILURES) else 0


if __name__ == "__main__":
    sys.exit(main())
