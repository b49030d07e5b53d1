"""The linear SM-starvation check (``shared/ir/starvation.py``, issue 31 item 3) refuses exactly
what the check it replaced refused (``tests/starvation_oracle.py``, kept as the oracle): the same
verdict, to the character of the error, on random Programs of competing kernels across ranks,
on the fuzz suites' Programs, and on every schedule's Programs with explicit ranks."""

from __future__ import annotations

import json

import pytest
from hypothesis import find, given
from hypothesis import strategies as st

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model, with_layers
from overlap_lab.shared.ir import validate as v
from overlap_lab.shared.ir.program import ParseError, parse
from tests import starvation_oracle
from tests.fuzz_helpers import fuzz_settings
from tests.test_fuzz_program import mutated, random_program, sound_program

GPU = get_gpu("h800")
STREAMS = ("a", "b", "c")
FLOPS = ("0", "1e6", "1e9")


def verdict(text_or_program, check=None) -> str:
    """The validator's verdict on a Program (text or built), with the starvation check
    ``check`` (None: the module's own, the linear one)."""
    program = text_or_program
    if isinstance(program, str):
        try:
            program = parse(program)
        except ParseError as e:
            return f"ParseError: {e}"
    own = v.starvation_fault
    if check is not None:
        v.starvation_fault = check
    v._SOUND.clear()  # a verdict remembered by identity would hide the other check's
    try:
        v.validate(program, GPU.num_sms)
    except ConfigError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        v.starvation_fault = own
        v._SOUND.clear()
    return "ok"


def same_verdict(text_or_program) -> str:
    new = verdict(text_or_program)
    old = verdict(text_or_program, starvation_oracle.starvation_fault)
    assert new == old, (new, old, str(text_or_program))
    return new


@st.composite
def contended_program(draw) -> str:
    """Ranks whose receivers, signal pollers and senders compete for SMs: collectives that send,
    receive or both, across ranks and within one, kernels that poll signals, stream priorities,
    holds from a few SMs to the whole GPU, events, wait_streams, several host threads and
    graphs. Every event is recorded once, a stream waits on an event only after its record and
    every received key has a sender, so most Programs reach the starvation rule."""
    world = draw(st.integers(1, 3))
    keys = [f"c{i}" for i in range(draw(st.integers(1, 4)))]
    sms = st.sampled_from(["", " sms=4", " sms=24", " sms=66", " sms=108", " sms=124", " sms=132"])
    ranks = []  # per rank: (stream declarations, thread bodies)
    sent: set[str] = set()
    n = 0

    def launch(streams, events, role=None) -> str:
        nonlocal n
        n += 1
        op = f"launch {draw(st.sampled_from(streams))} k{n} flops={draw(st.sampled_from(FLOPS))}"
        if draw(st.booleans()):
            op += " kind=comm" + draw(sms)
        else:
            op += draw(sms)
            if draw(st.integers(0, 3)) == 0:
                op += f" ctas={draw(st.sampled_from(['1', '8', '66']))}"
        if events and draw(st.integers(0, 5)) == 0:
            evs = draw(st.lists(st.sampled_from(events), min_size=1, max_size=2, unique=True))
            op += " waits='" + json.dumps(evs) + "'"
        if role is None and draw(st.integers(0, 2)) > 0:
            role = draw(st.sampled_from(["send", "recv", "sendrecv"]))
        if role is not None:
            key = draw(st.sampled_from(keys)) if not role.startswith("c") else role
            role = "send" if role.startswith("c") else role
            op += f" coll={key}:{role}"
            if role != "recv":
                sent.add(key)
                for dst in draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=2)):
                    op += f" flow={draw(st.sampled_from(['nvlink', 'rdma']))}:{dst}:1e6"
        return op

    for _r in range(world):
        streams = STREAMS[: draw(st.integers(1, 3))]
        decl = [s + draw(st.sampled_from(["", "", "@-1", "@1"])) for s in streams]
        events = [f"e{i}" for i in range(draw(st.integers(0, 3)))]
        bodies: list[list[str]] = [[] for _ in range(draw(st.integers(1, 2)))]
        for _ in range(draw(st.integers(1, 8))):
            body = draw(st.sampled_from(bodies))
            body.append(launch(streams, events))
            extra = draw(st.integers(0, 6))
            if extra == 0:
                a, b = draw(st.sampled_from(streams)), draw(st.sampled_from(streams))
                body.append(f"wait_stream {a} {b}")
            elif extra == 1 and len(bodies) > 1:
                body.append("yield")
            elif extra == 2:
                body.append("host h 1.0")
        for ev in events:  # recorded once each; a stream may wait on it after the record
            body = draw(st.sampled_from(bodies))
            at = draw(st.integers(0, len(body)))
            body.insert(at, f"record {ev} {draw(st.sampled_from(streams))}")
            if draw(st.booleans()):
                after = draw(st.integers(at + 1, len(body)))
                body.insert(after, f"wait {draw(st.sampled_from(streams))} {ev}")
        ranks.append((streams, decl, bodies))
    for key in keys:  # a sender for every key some rank receives
        if key not in sent:
            streams, _decl, bodies = draw(st.sampled_from(ranks))
            body = draw(st.sampled_from(bodies))
            body.insert(draw(st.integers(0, len(body))), launch(streams, [], role=key))
    lines = [f"program world={world} symmetric=false"]
    for r, (_streams, decl, bodies) in enumerate(ranks):
        lines.append(f"rank {r} streams={','.join(decl)}")
        for t, body in enumerate(bodies):
            if len(body) > 2 and draw(st.integers(0, 3)) == 0:  # a run of GPU items as a graph
                i = draw(st.integers(0, len(body) - 2))
                j = draw(st.integers(i + 1, len(body)))
                run = body[i:j]
                if all(b.split()[0] in ("launch", "record", "wait", "wait_stream") for b in run):
                    body[i:j] = ["graph g {"] + ["  " + b for b in run] + ["}"]
            lines.append(f"  thread t{t}")
            lines += ["    " + b for b in body]
    return "\n".join(lines) + "\n"


@fuzz_settings(600)
@given(contended_program())
def test_contended_programs_get_the_old_checks_verdict(text):
    same_verdict(text)


@fuzz_settings(200)
@given(st.one_of(sound_program(), random_program(), mutated()))
def test_fuzz_programs_get_the_old_checks_verdict(text):
    same_verdict(text)


def _direct_senders_only(text: str) -> str:
    """The old check's verdict with its fallback for ranks too large for bitsets: only the
    holder's direct senders count, no chain through other ranks, records or waits."""
    old = starvation_oracle.MAX_BITSET_NODES
    starvation_oracle.MAX_BITSET_NODES = 0
    try:
        return verdict(text, starvation_oracle.starvation_fault)
    finally:
        starvation_oracle.MAX_BITSET_NODES = old


def test_the_contended_programs_reach_every_part_of_the_rule():
    """The strategy above tests the rule only if it draws Programs the rule refuses, some of
    them only through a chain (across ranks, through records and waits) that the direct
    senders do not show, and Programs whose receivers hold the whole GPU yet are accepted."""
    settings = fuzz_settings(3000)
    find(contended_program(), lambda t: "SM starvation" in verdict(t), settings=settings)
    find(
        contended_program(),
        lambda t: "SM starvation" in verdict(t) and _direct_senders_only(t) == "ok",
        settings=settings,
    )
    find(
        contended_program(),
        lambda t: "world=1" not in t and ":recv" in t and verdict(t) == "ok",
        settings=settings,
    )


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_every_schedules_explicit_ranks_get_the_old_checks_verdict(mode):
    from overlap_lab.api import Ranks, lower_ranks
    from overlap_lab.shared.schedules import SCHEDULES, ScheduleConfig, build, supports_pp

    model = with_layers(get_model("deepseek-v3"), 3)
    batch = Batch.decode(32, kv_len=1024) if mode == "decode" else Batch.prefill(2, extend_len=512)
    ranks = Ranks("explicit", "zipf:1.2", 0.0, None, 1, True)
    seen = 0
    for name in SCHEDULES:
        w = Workload(model, batch, Parallel(ep=8, pp=2 if supports_pp(name) else 1))
        try:
            program = build(name, w, GPU, ScheduleConfig())
            lowered = lower_ranks(program, w, GPU, ranks) if not supports_pp(name) else program
        except ConfigError:
            continue
        for p in (program, lowered):
            assert same_verdict(p) == "ok"
            seen += 1
    assert seen >= 10
