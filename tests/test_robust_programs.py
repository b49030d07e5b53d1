"""Every Program the tool emits is valid, and every malformed Program text gets one clear error.

The first test is the guard of issue 14: `overlap-lab show` output, in every schedule, mode and
rank layout, passes validation, round-trips through its text form and simulates. The rest pin
each parser and validator rule (docs/program.md, "Validation rules") with its reproducer.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from overlap_lab.cli.main import main
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.ir.program import ParseError, parse, to_text
from overlap_lab.shared.ir.program_meta import ProgramMeta
from overlap_lab.shared.ir.validate import ProgramError, validate
from overlap_lab.shared.schedules import SCHEDULES
from overlap_lab.sim import simulate
from overlap_lab.sim.engine import Engine
from tests.fuzz_helpers import fuzz_settings

H800 = get_gpu("h800")
SMALL = ["--model", "deepseek-v2-lite", "--layers", "2", "--ep", "8", "--batch", "4"]


def _show(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main(["show", *argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("ranks", ["symmetric", "explicit"])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_emitted_program_validates_round_trips_and_simulates(capsys, schedule, mode, ranks):
    extra = ["--pp-size", "2"] if schedule == "pp" else []
    code, text, err = _show(
        capsys, "--schedule", schedule, "--mode", mode, "--ranks", ranks, *SMALL, *extra
    )
    if schedule == "pp" and ranks == "explicit":  # pp is explicit already
        assert code == 2 and err.count("\n") == 1
        return
    assert code == 0, err
    program = parse(text)
    validate(program, H800.num_sms)
    assert to_text(program) == text
    assert program.symmetric == (ranks == "symmetric" and schedule != "pp")
    trace = Engine(program, H800).run()
    assert trace.step_time_us > 0


def test_issue14_explicit_prefill_show_output_validates(capsys):
    """The reproducer: explicit-rank Programs whose collectives both send and receive."""
    code, text, _ = _show(
        capsys, "--mode", "prefill", "--layers", "2", "--ep", "8", "--ranks", "explicit"
    )
    assert code == 0
    validate(parse(text))
    validate(parse(text), H800.num_sms)


# ---- parser: one ParseError naming the line ---------------------------------------------------

HEAD = "program world=1 symmetric=true\nrank 0 streams=main,alt\n  thread main\n"


@pytest.mark.parametrize(
    "text, line, fragment",
    [
        (HEAD + "    launch\n", 4, "launch takes"),
        (HEAD + "    record ev\n", 4, "record takes"),
        (HEAD + "    launch main x layer=abc\n", 4, "layer must be an integer"),
        (HEAD + "    launch main x flops=1e9x\n", 4, "flops must be a number"),
        (HEAD + "    launch main x coll=k\n", 4, "coll= takes"),
        (HEAD + "    launch main x coll=k:send flow=nvlink:3\n", 4, "flow= takes"),
        (HEAD + "    launch main x name='\"a\n", 4, "quotation"),
        (HEAD + "    host h 1.0 mb\n", 4, "host takes"),
        (HEAD + "    host h 1.0 foo=1\n", 4, "host takes"),
        (HEAD + "    host h x\n", 4, "host time must be a number"),
        (HEAD + "    yield now\n", 4, "yield takes"),
        (HEAD + "    frobnicate\n", 4, "unknown instruction"),
        ("program world=1\nmeta {bad json\n", 2, "meta"),
        ("program world=1\nmeta [1, 2]\n", 2, "meta must be a JSON object"),
        ("program world=1 symmetric=True\n", 1, "symmetric must be true or false"),
        ("program world=1 colour=red\n", 1, "program takes"),
        ("program world=x\n", 1, "world must be an integer"),
        ("program world=1\nrank x streams=main\n", 2, "rank must be an integer"),
        ("program world=1\nrank 0\n", 2, "rank takes"),
        ("program world=1\n  thread t\n", 2, "thread outside a rank"),
        (
            HEAD + "    graph g {\n    launch main x\n",
            6,
            "graph 'g' opened on line 4 is not closed",
        ),
        (HEAD + "    graph g {\n    launch main x\n  thread b\n", 6, "not closed"),
        (HEAD + "    graph g\n", 4, "graph takes NAME {"),
        (HEAD + "    graph g {\n    host h 1.0\n    }\n", 5, "cannot be captured in a graph"),
        (HEAD + "    graph g {\n    sync e\n    }\n", 5, "cannot be captured in a graph"),
        (HEAD + "    graph g {\n    yield\n    }\n", 5, "cannot be captured in a graph"),
        (HEAD + "    }\n", 4, "without graph"),
        (HEAD + "    launch main x flops=1 flops=2\n", 4, "given twice"),
        (HEAD + "    launch main x name=1\n", 4, "unknown op field"),
    ],
)
def test_parser_errors_name_the_line(text, line, fragment):
    with pytest.raises(ParseError) as e:
        parse(text)
    msg = str(e.value)
    assert msg.startswith(f"line {line}:") and fragment in msg and "\n" not in msg


# ---- validator: ProgramError naming the instruction -------------------------------------------


def _check(text: str, fragment: str, *, num_sms: int | None = 132, where: str | None = None):
    with pytest.raises(ProgramError) as e:
        validate(parse(text), num_sms)
    assert fragment in str(e.value)
    if where:
        assert str(e.value).startswith(where)
    return str(e.value)


OK_OP = "    launch main x flops=1e9\n"


@pytest.mark.parametrize(
    "text, fragment, marked",
    [
        (
            "program world=-3\nrank 0 streams=main\n  thread t\n" + OK_OP,
            "world must be",
            "program world=-3 symmetric=true",
        ),
        (
            "program world=1\nrank 0 streams=main\n  thread t\n" + OK_OP + "rank 5 streams=main\n",
            "rank 5 outside 0..0",
            "rank 5 streams=main",
        ),
        (
            "program world=2\nrank 0 streams=main\n  thread t\n" + OK_OP + "rank 0 streams=main\n",
            "rank 0 appears twice",
            "rank 0 streams=main",
        ),
        (
            HEAD + OK_OP + "  thread main\n" + OK_OP,
            "thread 'main' is declared twice",
            "  thread main",
        ),
        (
            "program world=1\nrank 0 streams=main,main\n  thread t\n" + OK_OP,
            "declared twice",
            "rank 0 streams=main,main",
        ),
    ],
)
def test_program_level_rules(text, fragment, marked):
    """Rules about a declaration show its line marked, as an instruction's are (issue 32: 252
    rejections of a fuzz named no line)."""
    msg = _check(text, fragment)
    assert fragment in msg.splitlines()[0]
    assert f"\n{marked}   <-- ERROR HERE" in msg and msg.count("<-- ERROR HERE") == 1, msg


def test_a_priority_of_an_undeclared_stream_marks_its_rank():
    import dataclasses

    p = parse(HEAD + OK_OP)
    rp = dataclasses.replace(p.ranks[0], priorities=(("zz", -1),))
    p = dataclasses.replace(p, ranks=(rp,))
    msg = _check_program_error(p, "priority given for unknown stream 'zz'")
    assert "\nrank 0 streams=main,alt   <-- ERROR HERE" in msg, msg


def _check_program_error(program, fragment: str) -> str:
    with pytest.raises(ProgramError) as e:
        validate(program, 132)
    assert fragment in str(e.value)
    return str(e.value)


@pytest.mark.parametrize(
    "line, fragment",
    [
        ("launch main x dtype=fp4", "unknown dtype 'fp4'"),
        ("launch main x op_class=magic", "unknown op class 'magic'"),
        ("launch main x flops=inf", "must be finite"),
        ("launch main x flops=nan", "must be finite"),
        ("launch main x hbm_bytes=1e308", "must be finite"),
        ("launch main x sms=-1", "negative SM demand"),
        ("launch main x sms=1000", "asks for 1000 SMs"),
        ("launch main x tokens=-4", "negative token count"),
        ("launch main x kind=copy hbm_bytes=1e6 coll=k:send flow=pcie:sym:1.0", "copy op cannot"),
        ("launch main x coll=k:send flow=nvlink:sym:inf", "bytes must be a finite number"),
        ("launch main x coll=k:send flow=nvlink:sym:nan", "bytes must be a finite number"),
        ("launch main x coll=k:send flow=nvlink:7:1.0", "flow to unknown rank 7"),
        ("launch main x coll=k:send flow=pcie:0:1.0", "may use only nvlink and rdma"),
        ("launch main x coll=k:send flow=pcie:sym:1.0 flow=nvlink:0:1.0", "may use only nvlink"),
        ("launch main x coll=k:recv", "without its issue half"),
        ("host h inf", "host time must be"),
        ("host h -1", "host time must be"),
        ("wait main ev", "never recorded"),
        ("launch nowhere x", "unknown stream 'nowhere'"),
    ],
)
def test_instruction_rules_name_the_instruction(line, fragment):
    msg = _check(HEAD + "    " + line + "\n", fragment)
    assert msg.startswith("rank 0, thread main, instruction 0:")
    assert "<-- ERROR HERE" in msg


@pytest.mark.parametrize(
    "line, fragment",
    [
        ("launch main x kind=gpu", "unknown op kind 'gpu'; expected one of compute, comm, copy"),
        ("launch main x coll=k:send flow=warp:sym:1.0", "unknown link kind 'warp'"),
        ("launch main x coll=k:shout", "unknown collective role 'shout'"),
    ],
)
def test_words_outside_the_ir_are_refused_by_the_parser(line, fragment):
    """Op kinds, roles and link kinds are typed when the record is built: the parser names the
    line, and no Program holding such a word exists to validate."""
    with pytest.raises(ParseError, match=f"line 4: {fragment}"):
        parse(HEAD + "    " + line + "\n")


def test_event_recorded_twice_inside_a_graph_names_the_body_instruction():
    text = HEAD + "    graph g {\n      record ev main\n      record ev alt\n    }\n"
    msg = _check(text, "recorded twice")
    assert msg.startswith("rank 0, thread main, instruction 0 (graph g, body instruction 1)")
    assert "record ev alt   <-- ERROR HERE" in msg


def test_receiver_holding_every_sm_starves_its_sender():
    """Issue 14: `a` (compute, whole GPU) waits for `b`'s data; `b` can never get an SM."""
    text = (
        "program world=1 symmetric=true\nrank 0 streams=x,y\n  thread main\n"
        "    launch x a flops=1e9 coll=k:sendrecv\n"
        "    launch y b flops=1e9 coll=k:send flow=nvlink:sym:1000.0\n"
    )
    _check(text, "may hold 132 of the 132 SMs", where="rank 0, thread main, instruction 0")
    # ordered the other way round (b first on the same stream) it runs
    ok = text.replace("launch y b", "launch x b").splitlines()
    ok[3], ok[4] = ok[4], ok[3]
    program = parse("\n".join(ok) + "\n")
    assert simulate(program, H800).step_time_us > 0
    # with SMs left beside the receiver it runs too
    assert simulate(parse(text.replace("sendrecv", "sendrecv sms=100")), H800).step_time_us > 0


CROSS_RANK_STARVATION = """program world=2 symmetric=false
rank 0 streams=a
  thread t
    launch a r0 kind=comm sms=8 coll=g6:recv
    launch a s0 kind=comm sms=8 coll=g7:send flow=rdma:1:1024.0
rank 1 streams=a,b
  thread t
    launch a r1 kind=comm sms=132 coll=g7:recv
    launch b s1 kind=comm sms=8 coll=g6:send flow=rdma:0:1024.0
"""


def _stalls(text: str) -> bool:
    """Whether the Program, run without validation, stops with work left."""
    from overlap_lab.sim.engine import SimulationStalled

    try:
        Engine(parse(text), H800, max_events=10_000).run()
    except SimulationStalled:
        return True
    return False


def test_receiver_starving_a_sender_through_another_rank_is_refused():
    """Rank 1's receive holds all 132 SMs waiting for rank 0, whose send waits for rank 1's
    send, which cannot get SMs: a chain the same-rank rule did not follow."""
    assert _stalls(CROSS_RANK_STARVATION)
    _check(CROSS_RANK_STARVATION, "s1 needs 8 SMs", where="rank 1, thread t, instruction 0")
    ok = CROSS_RANK_STARVATION.replace("sms=132", "sms=124")
    validate(parse(ok), 132)
    assert simulate(parse(ok), H800).step_time_us > 0


def test_kernel_polling_a_signal_that_waits_for_its_sms_is_refused():
    """A kernel that polls a signal holds its SMs until it fires; the signal's producer, on
    another stream and not ordered before it, then never gets an SM."""
    text = (
        "program world=1 symmetric=true\nrank 0 streams=x,y\n  thread main\n"
        """    launch x a flops=1e9 op_class=gemm waits='["e"]'\n"""
        "    launch y b flops=1e9\n"
        "    record e y\n"
    )
    assert _stalls(text)
    _check(text, "b needs 1 SMs", where="rank 0, thread main, instruction 0")
    validate(parse(text.replace("gemm waits", "gemm sms=131 waits")), 132)


@pytest.mark.parametrize(
    "op, fragment",
    [
        ("kind=comm ctas=1000", "needs 1000 SMs for its 1000 coresident CTAs"),
        ("kind=comm flops=1e9 sms=1 ctas=132", "needs 132 SMs for its 132 coresident CTAs"),
        ("grid=coresident ctas=266 ctas_per_sm=2", "needs 133 SMs"),
        ("kind=comm sms=0 ctas=4", "sms=0"),
    ],
)
def test_coresident_ctas_that_cannot_all_be_resident_are_refused(op, fragment):
    """A coresident kernel starts only when all its CTAs are resident: ``ctas`` (over
    ``ctas_per_sm``) beyond its ``sms`` or the GPU can never start, or contradicts ``sms``."""
    _check(HEAD + f"    launch main k {op}\n", fragment, where="rank 0, thread main")


def test_coresident_ctas_within_sms_run_on_those_sms():
    text = HEAD + "    launch main k kind=comm flops=1e9 sms=8 ctas=16 ctas_per_sm=2\n"
    validate(parse(text), 132)
    trace = simulate(parse(text), H800)
    assert {s.sms for s in trace.spans if s.op == "k"} == {8}


def test_wait_cycle_still_rejected():
    text = HEAD + "    wait main ev\n    record ev main\n"
    _check(text, "wait cycle", where="rank 0, thread main, instruction 0")


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        ({"schedule": "x"}, "meta must be a ProgramMeta, got dict"),  # the bare dict, built in code
        (ProgramMeta(comm_sms="3"), "meta: comm_sms must be int, got '3'"),
        (ProgramMeta(extra={"schedule": "x"}), r"extra repeats the field\(s\) \['schedule'\]"),
        (ProgramMeta(schedule="x", order=("y",)), r"meta: order \['y'\] is not the reported keys"),
    ],
)
def test_meta_not_a_record_in_code(meta, match):
    import dataclasses

    p = parse(HEAD + OK_OP)
    p = dataclasses.replace(p, meta=meta)
    with pytest.raises(ProgramError, match=match) as e:
        validate(p)
    assert str(e.value).endswith("\nprogram world=1 symmetric=true   <-- ERROR HERE")


def test_zero_work_and_zero_bytes_simulate_to_finite_times():
    text = (
        HEAD
        + "    launch main a\n    launch alt b kind=comm sms=4 coll=k:send flow=nvlink:sym:0.0\n"
        + "    launch main c kind=comm sms=0 coll=k:recv\n    host h 0.0\n"
    )
    trace = simulate(parse(text), H800)
    assert all(s.end >= s.start for s in trace.spans)
    assert trace.step_time_us >= 0


def test_parse_error_is_a_config_error():
    assert issubclass(ParseError, ConfigError) and issubclass(ProgramError, ConfigError)


@pytest.mark.parametrize(
    "body",
    [
        # two receivers together hold more than the GPU leaves the sender
        "    launch x a kind=comm sms=100 coll=k:recv\n    launch y b kind=comm sms=100 coll=k:recv\n",
        # one receiver, and a large request granted in order ahead of the sender
        "    launch x a kind=comm sms=100 coll=k:recv\n    launch y b kind=comm sms=100 flops=1e6\n",
    ],
)
def test_sm_starvation_through_several_kernels(body):
    text = (
        "program world=1 symmetric=true\nrank 0 streams=x,y,z\n  thread main\n"
        + body
        + "    launch z s kind=comm sms=10 coll=k:send flow=nvlink:sym:1000.0\n"
    )
    _check(text, "SM starvation")
    # the same with the sender issued first and everything on one stream runs
    lines = text.replace("launch y", "launch x").splitlines()
    send = lines.pop().replace("launch z", "launch x")
    lines.insert(3, send)
    assert simulate(parse("\n".join(lines) + "\n"), H800).step_time_us > 0


def _two_rank_flow(host_us: str, nbytes: str) -> str:
    return (
        "program world=2 symmetric=false\nrank 0 streams=x\n  thread main\n"
        f"    host h {host_us}\n"
        f"    launch x a kind=comm sms=4 coll=k:send flow=nvlink:1:{nbytes} flow=rdma:1:{nbytes}\n"
        "rank 1 streams=x\n  thread main\n    launch x b kind=comm sms=0 coll=k:recv\n"
    )


@pytest.mark.parametrize("host_us, nbytes", [("1e16", "1e6"), ("1.0", "inf"), ("1.0", "nan")])
def test_hang_classes_of_issue_14_are_refused(host_us, nbytes):
    """A host time of 1e16 before an explicit flow, a flow of inf or NaN bytes: refused."""
    with pytest.raises(ProgramError, match="host time must be|bytes must be a finite"):
        validate(parse(_two_rank_flow(host_us, nbytes)), H800.num_sms)


@fuzz_settings(60)
@given(
    host_exp=st.floats(-3, 9),
    bytes_exp=st.one_of(st.floats(-9, 18), st.just(None)),
)
def test_accepted_extremes_finish_within_the_budget(host_exp, bytes_exp):
    """Every host time and flow size the validator accepts finishes (no float progress hang)."""
    nbytes = "0.0" if bytes_exp is None else repr(10.0**bytes_exp)
    text = _two_rank_flow(repr(10.0**host_exp), nbytes)
    trace = simulate(parse(text), H800, max_events=100_000)
    assert trace.step_time_us >= 10.0**host_exp


@pytest.mark.parametrize("ranks", ["symmetric", "explicit"])
@pytest.mark.parametrize("schedule", ["tbo", "sglang-overlap", "deepseek"])
def test_default_event_budget_has_a_margin_of_five(capsys, schedule, ranks):
    """Each run fits in a fifth of its default budget (the default bounds what a run can need,
    sim/budget.py; these schedules need about a seventh of it or less)."""
    from overlap_lab.sim.budget import SimulationBudgetExceeded, default_max_events

    code, text, err = _show(capsys, "--schedule", schedule, "--ranks", ranks, *SMALL)
    assert code == 0, err
    program = parse(text)
    Engine(program, H800, max_events=default_max_events(program) // 5).run()
    with pytest.raises(SimulationBudgetExceeded, match="raise --max-events"):
        # (kernels timed alone take no event: TBO's two layers on one stream need ~45)
        Engine(program, H800, max_events=10).run()


@pytest.mark.parametrize("gpu", ["h800", "b200"])
@pytest.mark.parametrize(
    "schedule, knobs",
    [
        ("sbo", ["--sbo-mode", "2"]),
        ("sbo", ["--sbo-mode", "3"]),
        ("tbo+sbo", ["--sbo-mode", "2"]),
        ("tbo+sbo", ["--sbo-mode", "3"]),
        ("sglang-overlap", ["--spec-v2", "true", "--grammar", "true"]),
        ("pp", ["--pp-size", "2", "--micro-batches", "4", "--return-logprob", "true"]),
        ("vllm-dbo", ["--cuda-graph", "false"]),
        ("deepseek", ["--comm-sms", "20"]),
    ],
)
def test_knob_variants_validate_on_every_gpu(capsys, schedule, knobs, gpu):
    code, text, err = _show(capsys, "--schedule", schedule, "--gpu", gpu, *SMALL, *knobs)
    assert code == 0, err
    program = parse(text)
    validate(program, get_gpu(gpu).num_sms)
    assert simulate(program, get_gpu(gpu)).step_time_us > 0
