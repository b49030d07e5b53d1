"""The two budgets: events per simulation (``sim.budget``) and instructions per Program
(``shared.ir.validate.check_build_budget``)."""

from __future__ import annotations

import pytest

from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.ir.program import parse
from overlap_lab.shared.ir.validate import (
    BuildBudgetExceeded,
    ProgramError,
    check_build_budget,
    count_instructions,
    validate,
)
from overlap_lab.sim.budget import PER_INSTR, default_max_events
from overlap_lab.sim.cost import grid
from overlap_lab.sim.engine import Engine
from overlap_lab.sim.resources import timers

H200 = get_gpu("h200")
BIG = "flops=1.1e12 hbm_bytes=4e8 op_class=gemm dtype=bf16"
SMALL = "hbm_bytes=5.9e7"


def _small_kernels_beside_large_ones() -> str:
    """A stream of 1,060 memory-bound kernels beside 20 large waved GEMMs on another stream,
    issued interleaved: each small kernel's waves and the GEMM's end at instants of their own,
    ~130 events per launch (the old default, 25 per instruction plus 100,000, refused it). The
    small kernels' stream has the higher priority, so each takes SMs at the GEMM's next wave
    boundary (of one priority, a GEMM that reached the GPU first would keep them all)."""
    lines = ["program world=1 symmetric=true", "rank 0 streams=a@-1,b", "  thread t"]
    for i in range(20):
        lines.append(f"    launch b big{i} {BIG}")
        lines += [f"    launch a small{i}_{j} {SMALL}" for j in range(53)]
    return "\n".join(lines) + "\n"


def test_default_budget_lets_small_kernels_run_beside_large_waved_ones():
    program = parse(_small_kernels_beside_large_ones())
    old_default = 100_000 + PER_INSTR * count_instructions(program)
    engine = Engine(program, H200)  # the default: bounded by the Program's structure
    step, steps = engine.env.step, [0]

    def counted() -> None:
        steps[0] += 1
        step()

    engine.env.step = counted
    passes = timers(engine.env)
    run_passes = passes.run_passes

    def counted_passes() -> None:  # each instant's round of passes is one event of the budget
        steps[0] += 1
        run_passes()

    passes.run_passes = counted_passes
    assert engine.run().step_time_us > 0
    assert old_default < steps[0] <= engine.max_events


def test_default_budget_counts_cohorts_only_beside_other_streams():
    """A kernel alone on its rank's one stream is one cohort whatever its grid; beside another
    stream's kernels each of its waves of one SM may be a cohort of its own."""
    text = (
        "program world=1 symmetric=true\nrank 0 streams=a\n  thread t\n"
        f"    launch a big {BIG}\n    launch a small {SMALL}\n"
    )
    one = parse(text)
    two = parse(text.replace("launch a small", "launch b small").replace("=a\n", "=a,b\n"))
    base = default_max_events(one)
    assert default_max_events(one, H200.num_sms, grid) == base
    n_big = grid(one.ranks[0].threads[0].instrs[0].op, H200.num_sms)
    n_small = grid(one.ranks[0].threads[0].instrs[1].op, H200.num_sms)
    waves = -(-n_big.ctas // n_big.per_sm) + -(-n_small.ctas // n_small.per_sm)
    assert default_max_events(two, H200.num_sms, grid) == base + 2 * waves


def test_program_above_its_build_budget_is_refused_in_one_line():
    text = "program world=1 symmetric=true\nrank 0 streams=a\n  thread t\n" + "".join(
        f"    launch a k{i} flops=1e6\n" for i in range(50)
    )
    program = parse(text)
    check_build_budget(program, 50)
    with pytest.raises(BuildBudgetExceeded) as e:
        validate(program, 132, max_instructions=49)
    msg = str(e.value)
    assert msg == (
        "the Program has 50 instructions, more than its build budget of 49; simulate less "
        "(fewer layers, a smaller batch or fewer explicit ranks)"
    )
    assert not isinstance(e.value, ProgramError)  # no instruction is at fault


def test_build_budget_counts_graph_bodies():
    text = (
        "program world=1 symmetric=true\nrank 0 streams=a\n  thread t\n    graph g {\n"
        "      launch a x flops=1e6\n      launch a y flops=1e6\n    }\n    host h 1.0\n"
    )
    assert count_instructions(parse(text)) == 3
