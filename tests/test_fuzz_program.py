"""Fuzz: random and mutated Program texts through parse → validate → simulate.

Every case must end in exactly one of: simulated, a ParseError naming the line, or a
ProgramError naming the instruction (or the declaration: the Program's header, a rank's or a
thread's line) and showing it marked ``<-- ERROR HERE``.
Never a crash, a stall or a hang (each simulation runs under a small event budget).
Sources: every schedule's golden Program in tests/golden and a small complete Program of every
schedule and mode; mutations: delete, duplicate, swap, rename, corrupt numbers, truncate.
Counts: OVERLAP_LAB_FUZZ_EXAMPLES (see tests/fuzz_helpers.py); outcomes are tallied in
``OUTCOMES`` and printed with ``-s``.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from functools import cache
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model, with_layers
from overlap_lab.shared.ir.program import GRIDS, ParseError, parse
from overlap_lab.shared.ir.validate import ProgramError, validate
from overlap_lab.shared.schedules import SCHEDULES, ScheduleConfig, build
from overlap_lab.sim.budget import SimulationBudgetExceeded
from overlap_lab.sim.engine import Engine
from tests.fuzz_helpers import fuzz_settings
from tests.invariants import critical_path_us, never_faster_than_alone

GPU = get_gpu("h800")
GOLDEN = Path(__file__).parent / "golden"
BUDGET = 200_000  # events per case: far above what these small Programs need
OUTCOMES: Counter = Counter()

#: Rules about a declaration (the Program's header line, a rank's or a thread's) name it so;
#: the text then shows that line marked, as an instruction's is.
_DECLARATION = re.compile(
    r"^(meta must|meta: |the program has no ranks|world must|symmetric must|rank -?\d+[: ]|rank .* outside)"
)


@cache
def sources() -> tuple[str, ...]:
    """Golden Programs plus one small complete Program per schedule and mode."""
    texts = [p.read_text() for p in sorted(GOLDEN.glob("*.txt"))]
    model = with_layers(get_model("deepseek-v2-lite"), 2)
    for mode in ("decode", "prefill"):
        batch = Batch.decode(4, kv_len=64) if mode == "decode" else Batch.prefill(2, extend_len=64)
        for name in SCHEDULES:
            par = Parallel(ep=8, pp=2 if name == "pp" else 1)
            try:
                texts.append(str(build(name, Workload(model, batch, par), GPU, ScheduleConfig())))
            except ConfigError:
                pass
    return tuple(texts)


CORRUPT = [
    "nan",
    "inf",
    "-inf",
    "-1",
    "0",
    "1e308",
    "1e-300",
    "-0.0",
    "x",
    "",
    "1.5",
    "99999999999",
]
NAMES = ["main", "alt", "comm", "zz", "ev", "s0.L1.mb0.dispatch", "0", "sym", "{", "}", "=", '"']


def _tokens(line: str) -> list[str]:
    return line.split(" ")


@st.composite
def mutated(draw) -> str:
    lines = draw(st.sampled_from(sources())).splitlines()
    for _ in range(draw(st.integers(1, 3))):
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(
            st.sampled_from(
                ["delete", "duplicate", "swap", "rename", "number", "truncate", "field"]
            )
        )
        if op == "delete":
            del lines[i]
        elif op == "duplicate":
            lines.insert(draw(st.integers(0, len(lines))), lines[i])
        elif op == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "truncate":
            lines[i] = lines[i][: draw(st.integers(0, len(lines[i])))]
        else:
            toks = _tokens(lines[i])
            k = draw(st.integers(0, len(toks) - 1))
            if op == "rename":
                toks[k] = draw(st.sampled_from(NAMES + sum((_tokens(x) for x in lines[:3]), [])))
            elif op == "number":
                toks[k] = re.sub(r"-?\d[\d.e+-]*", draw(st.sampled_from(CORRUPT)), toks[k], count=1)
            else:
                key = draw(
                    st.sampled_from(
                        [
                            "sms",
                            "flops",
                            "hbm_bytes",
                            "dtype",
                            "kind",
                            "coll",
                            "flow",
                            "op_class",
                            "layer",
                            "tokens",
                            "world",
                            "symmetric",
                        ]
                    )
                )
                toks.insert(
                    k + 1,
                    f"{key}={draw(st.sampled_from(CORRUPT + NAMES + ['send', 'nvlink:0:1.0', 'k:recv']))}",
                )
            lines[i] = " ".join(toks)
    return "\n".join(lines) + "\n"


STREAMS = ["main", "alt", "comm"]
EVENTS = ["e0", "e1", "e2"]


@st.composite
def random_program(draw) -> str:
    """A small Program from the grammar, with random references and numbers."""
    num = st.sampled_from(["0", "1", "1e6", "1e9", "2.5", "1e12", "nan", "inf", "-1"])
    lines = [
        f"program world={draw(st.sampled_from(['1', '2', '3']))} "
        f"symmetric={draw(st.sampled_from(['true', 'false']))}"
    ]
    for r in range(draw(st.integers(1, 2))):
        streams = [
            s + draw(st.sampled_from(["", "", "@-1", "@1"]))
            for s in STREAMS[: draw(st.integers(1, 3))]
        ]
        lines.append(f"rank {r} streams={','.join(streams)}")
        for t in range(draw(st.integers(1, 2))):
            lines.append(f"  thread t{t}")
            in_graph = False
            for _ in range(draw(st.integers(0, 8))):
                s, e = draw(st.sampled_from(STREAMS)), draw(st.sampled_from(EVENTS))
                verb = draw(
                    st.sampled_from(
                        [
                            "launch",
                            "launch",
                            "record",
                            "wait",
                            "wait_stream",
                            "host",
                            "sync",
                            "yield",
                            "graph",
                        ]
                    )
                )
                if verb == "launch":
                    op = f"launch {s} op{draw(st.integers(0, 9))} flops={draw(num)} hbm_bytes={draw(num)}"
                    if draw(st.booleans()):
                        op += f" kind=comm sms={draw(st.sampled_from(['0', '4', '24', '132']))}"
                    elif draw(st.booleans()):
                        op += f" sms={draw(st.sampled_from(['1', '8', '66', '132']))}"
                    if draw(st.integers(0, 3)) == 0:
                        op += f" op_class={draw(st.sampled_from(['gemm', 'attention']))}"
                    if draw(st.integers(0, 3)) == 0:
                        op += f" grid={draw(st.sampled_from(GRIDS))}"
                    if draw(st.integers(0, 2)) == 0:
                        op += f" ctas={draw(st.sampled_from(['1', '3', '132', '264', '1000']))}"
                        if draw(st.booleans()):
                            op += f" ctas_per_sm={draw(st.sampled_from(['1', '2', '8']))}"
                    if draw(st.integers(0, 3)) == 0:
                        evs = draw(st.lists(st.sampled_from(EVENTS), min_size=1, max_size=2))
                        op += " waits='" + json.dumps(evs) + "'"
                    if draw(st.booleans()):
                        role = draw(st.sampled_from(["send", "recv", "sendrecv"]))
                        op += f" coll=k{draw(st.integers(0, 1))}:{role}"
                        if role != "recv" and draw(st.booleans()):
                            dst = draw(st.sampled_from(["sym", "0", "1"]))
                            link = draw(st.sampled_from(["nvlink", "rdma", "pcie"]))
                            op += f" flow={link}:{dst}:{draw(num)}"
                    lines.append("    " + op)
                elif verb == "record":
                    lines.append(f"    record {e} {s}")
                elif verb == "wait":
                    lines.append(f"    wait {s} {e}")
                elif verb == "wait_stream":
                    lines.append(f"    wait_stream {s} {draw(st.sampled_from(STREAMS))}")
                elif verb == "host":
                    lines.append(f"    host h {draw(num)}")
                elif verb == "sync":
                    lines.append(f"    sync {e}")
                elif verb == "yield":
                    lines.append("    yield")
                elif not in_graph:
                    lines.append(f"    graph g{draw(st.integers(0, 2))} {{")
                    in_graph = True
                else:
                    lines.append("    }")
                    in_graph = False
            if in_graph:
                lines.append("    }")
    return "\n".join(lines) + "\n"


@st.composite
def sound_program(draw) -> str:
    """A well-formed Program of competing kernels (finite work, declared streams, each event
    recorded once): stream priorities, grids, CTAs, SM limits, signals polled while running,
    collectives within and across ranks. Most validate; the rest must be refused cleanly."""
    # work small enough that a run stays within the suite's event budget: beside other
    # streams a waved kernel can take an event per wave (``sim.budget``)
    flops = st.sampled_from(["0", "1e6", "3e7", "3e8", "1e9", "2e10"])
    nbytes = st.sampled_from(["0", "1e6", "3e7", "3e8"])
    ranks = draw(st.integers(1, 2))
    symmetric = ranks == 1 and draw(st.booleans())
    lines = [f"program world={ranks} symmetric={'true' if symmetric else 'false'}"]
    for r in range(ranks):
        streams = STREAMS[: draw(st.integers(1, 3))]
        decl = [s + draw(st.sampled_from(["", "", "@-1", "@1"])) for s in streams]
        lines.append(f"rank {r} streams={','.join(decl)}")
        lines.append("  thread t")
        events = [f"e{i}" for i in range(draw(st.integers(0, 3)))]
        body = []
        for _ in range(draw(st.integers(1, 8))):
            s = draw(st.sampled_from(streams))
            op = f"launch {s} k{len(body)} flops={draw(flops)} hbm_bytes={draw(nbytes)}"
            op += f" op_class={draw(st.sampled_from(['gemm', 'attention', 'elementwise']))}"
            op += f" dtype={draw(st.sampled_from(['bf16', 'fp8']))}"
            if draw(st.integers(0, 2)) == 0:
                op += f" kind=comm sms={draw(st.sampled_from(['0', '4', '24', '66']))}"
            elif draw(st.booleans()):
                op += f" sms={draw(st.sampled_from(['1', '8', '66', '132']))}"
            if draw(st.integers(0, 3)) == 0:
                op += f" grid={draw(st.sampled_from(GRIDS))}"
            if draw(st.integers(0, 2)) == 0:
                op += f" ctas={draw(st.sampled_from(['1', '3', '24', '132', '1000']))}"
                if draw(st.booleans()):
                    op += f" ctas_per_sm={draw(st.sampled_from(['1', '2', '8']))}"
            if events and draw(st.integers(0, 4)) == 0:
                evs = draw(st.lists(st.sampled_from(events), min_size=1, max_size=2, unique=True))
                op += " waits='" + json.dumps(evs) + "'"
            if draw(st.integers(0, 3)) == 0:
                key = f"c{draw(st.integers(0, 1))}"
                role = draw(st.sampled_from(["send", "recv", "sendrecv"]))
                op += f" coll={key}:{role}"
                if role != "recv":
                    dst = "sym" if symmetric else str(draw(st.integers(0, ranks - 1)))
                    op += f" flow={draw(st.sampled_from(['nvlink', 'rdma']))}:{dst}:1e6"
            body.append(op)
            if draw(st.integers(0, 3)) == 0:
                ev = draw(st.sampled_from(EVENTS))
                body.append(f"wait {draw(st.sampled_from(streams))} {ev}")
            if draw(st.integers(0, 5)) == 0:
                a, b = draw(st.sampled_from(streams)), draw(st.sampled_from(streams))
                body.append(f"wait_stream {a} {b}")
        for ev in events:  # recorded once each, somewhere in the thread
            at = draw(st.integers(0, len(body)))
            body.insert(at, f"record {ev} {draw(st.sampled_from(streams))}")
        body = [b for b in body if not b.startswith("wait ") or b.split()[2] in events]
        lines += ["    " + b for b in body]
    return "\n".join(lines) + "\n"


def outcome(text: str, check_timing: bool = False) -> str:
    """Run one text through parse → validate → simulate; the outcome, or an AssertionError.
    ``check_timing``: a simulated Program also has no kernel faster than alone and a step time
    at least its critical path (``tests.invariants``)."""
    try:
        program = parse(text)
    except ParseError as e:
        assert re.match(r"line \d+: \S", str(e)) and "\n" not in str(e), str(e)
        return "parse error"
    try:
        validate(program, GPU.num_sms)
    except ProgramError as e:
        msg = str(e)
        assert re.match(r"rank -?\d+, thread \S+, instruction \d+", msg) or _DECLARATION.match(
            msg
        ), msg
        assert msg.count("<-- ERROR HERE") == 1, msg  # the instruction or declaration, shown
        return "validation error"
    try:
        trace = Engine(program, GPU, max_events=BUDGET).run()
    except SimulationBudgetExceeded as e:  # a hang: the validator must have rejected it
        raise AssertionError(f"accepted Program hangs: {e}\n{text}") from None
    except Exception as e:  # a crash or a stall of a validated Program
        raise AssertionError(f"accepted Program fails: {type(e).__name__}: {e}\n{text}") from None
    for s in trace.spans:
        assert s.start <= s.end < float("inf"), (s, text)
    if check_timing:
        never_faster_than_alone(program, trace, GPU)
        bound = critical_path_us(program, GPU)
        assert trace.step_time_us >= bound * (1 - 1e-9) - 1e-6, (trace.step_time_us, bound, text)
    return "simulated"


@fuzz_settings(1000)
@given(mutated())
def test_mutated_programs_end_cleanly(text):
    OUTCOMES["mutated " + outcome(text)] += 1


@fuzz_settings(300)
@given(random_program())
def test_random_programs_end_cleanly(text):
    OUTCOMES["random " + outcome(text, check_timing=True)] += 1


@fuzz_settings(300)
@given(sound_program())
def test_sound_programs_simulate_no_kernel_faster_than_alone(text):
    """A validated Program simulates to completion, no kernel faster than alone, and a step
    time at least its critical path."""
    OUTCOMES["sound " + outcome(text, check_timing=True)] += 1


def test_sources_are_valid_programs():
    """The unmutated small Programs simulate (the goldens are layer windows: they may not)."""
    golden = len(list(GOLDEN.glob("*.txt")))
    for text in sources()[golden:]:
        assert outcome(text) == "simulated"


def teardown_module(module):
    if OUTCOMES:
        print("\nProgram fuzz outcomes:", dict(sorted(OUTCOMES.items())))
