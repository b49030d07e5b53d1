"""The Program's text form parses back to the same Program; validation names the fault."""

import pytest

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.ir.builder import RankBuilder, program
from overlap_lab.shared.ir.program import Coll, Flow, LinkKind, Op, OpKind, Role, parse, to_text
from overlap_lab.shared.ir.validate import ProgramError, issue_order, validate


def sample_program():
    r = RankBuilder(0, ("main", "alt"))
    t = r.thread("t0")
    t.host("schedule", 12.5, step=0)
    t.launch(
        Op("attn.core", layer=3, mb=0, flops=1.5e9, hbm_bytes=2e6, op_class="attention"), "main"
    )
    t.record("ev", "main")
    t.wait("alt", "ev")
    t.launch(
        Op(
            "dispatch_a",
            kind="comm",
            layer=3,
            mb=0,
            sms=24,
            coll=Coll(
                "L3.mb0.dispatch", "send", (Flow("rdma", 1e6), Flow("nvlink", 5e5, dst=None))
            ),
        ),
        "alt",
    )
    t.yield_()
    u = r.thread("t1")
    u.begin_graph()
    u.launch(Op("dispatch_b", kind="comm", sms=0, coll=Coll("L3.mb0.dispatch", "recv")), "alt")
    u.wait_stream("main", "alt")
    u.end_graph("g0")
    u.record("done", "main")
    u.sync("done")
    return program([r], world=8, schedule="test", micro_batches=[{"index": 0}])


def test_round_trip_text():
    p = sample_program()
    text = to_text(p)
    assert parse(text) == p
    assert to_text(parse(text)) == text
    assert "<-- ERROR" not in text and "graph g0 {" in text


def test_issue_order_hands_over_at_yield():
    p = sample_program()
    order = [(i.thread, type(i.instr).__name__) for i in issue_order(p.ranks[0])]
    assert order[:6] == [
        ("t0", "Host"),
        ("t0", "Launch"),
        ("t0", "Record"),
        ("t0", "Wait"),
        ("t0", "Launch"),
        ("t0", "Yield"),
    ]
    assert [t for t, _ in order[6:]] == ["t1"] * 3


def test_valid_program_passes():
    validate(sample_program(), num_sms=132)


def one_thread(*calls, streams=("main",)):
    r = RankBuilder(0, streams)
    t = r.thread("main")
    for name, *args in calls:
        getattr(t, name)(*args)
    return program([r], world=1)


G = Op("gemm", flops=1e9)


@pytest.mark.parametrize(
    "prog, message",
    [
        (one_thread(("wait", "main", "nope")), "'nope' is never recorded"),
        (one_thread(("sync", "nope")), "never recorded"),
        (one_thread(("launch", G, "side")), "unknown stream 'side'"),
        (one_thread(("launch", Op("x", kind="comm", sms=200), "main")), "asks for 200 SMs"),
        (one_thread(("record", "e", "main"), ("record", "e", "main")), "recorded twice"),
        (
            one_thread(("launch", Op("d_b", kind="comm", sms=0, coll=Coll("k", "recv")), "main")),
            "without its issue half",
        ),
        (one_thread(("sync", "e"), ("launch", G, "main"), ("record", "e", "main")), "wait cycle"),
        (
            one_thread(("wait", "main", "e"), ("launch", G, "main"), ("record", "e", "main")),
            "wait cycle",
        ),
    ],
)
def test_validation_errors_name_the_instruction(prog, message):
    with pytest.raises(ProgramError) as e:
        validate(prog, num_sms=132)
    assert message in str(e.value)
    assert "<-- ERROR HERE" in str(e.value)


def test_cross_stream_cycle_is_caught():
    r = RankBuilder(0, ("a", "b"))
    t = r.thread("main")
    t.wait("a", "eb").launch(G, "a").record("ea", "a")
    t.wait("b", "ea").launch(G, "b").record("eb", "b")
    with pytest.raises(ProgramError, match="wait cycle"):
        validate(program([r], world=1))


def test_recv_before_send_on_one_stream_is_a_cycle():
    r = RankBuilder(0, ("main",))
    t = r.thread("main")
    t.launch(Op("d_b", kind="comm", sms=0, coll=Coll("k", "recv")), "main")
    t.launch(Op("d_a", kind="comm", sms=4, coll=Coll("k", "send", (Flow("rdma", 10.0),))), "main")
    with pytest.raises(ProgramError, match="wait cycle"):
        validate(program([r], world=2))


def test_op_rewrites_keep_stream_priorities_and_reach_graph_bodies():
    """map_ops, and the passes built on it (calibrate's SM narrowing), rewrite ops only: a
    rank's stream priorities survive."""
    import dataclasses

    from overlap_lab.shared.inputs.hardware import get_gpu
    from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model, with_layers
    from overlap_lab.shared.ir.program import map_ops, ops_of
    from overlap_lab.shared.schedules import build
    from overlap_lab.sim.calibrate import narrow_sms

    gpu = get_gpu("h800")
    w = Workload(
        with_layers(get_model("deepseek-v3"), 2), Batch.prefill(1, extend_len=512), Parallel(ep=8)
    )
    p = build("deepseek", w, gpu)
    assert any(rp.priorities for rp in p.ranks)  # DeepEP's comm streams are high priority
    for q in (
        map_ops(p, lambda op: dataclasses.replace(op, layer=op.layer)),
        narrow_sms(p, 66),
    ):
        assert [rp.priorities for rp in q.ranks] == [rp.priorities for rp in p.ranks]
        assert len(ops_of(q)) == len(ops_of(p))
    assert {op.sms for _, op in ops_of(narrow_sms(p, 66)) if op.kind == "compute"} == {66}


def test_ir_words_are_checked_and_typed_once_at_construction():
    """kind, role and link are enum members from the record's construction on, equal to their
    words (so text, JSON and comparisons are unchanged); a word outside the IR is refused there."""
    op = Op("x", kind="comm", coll=Coll("k", "send", (Flow("rdma", 1.0),)))
    assert op.kind is OpKind.COMM and op.kind == "comm" and f"{op.kind}" == "comm"
    assert op.coll.role is Role.SEND and op.coll.flows[0].link is LinkKind.RDMA
    assert repr(op.coll.flows[0]) == "Flow(link='rdma', nbytes=1.0, dst=None)"
    assert parse(to_text(one_thread(("launch", op, "main")))).ranks[0].threads[0].instrs[0].op == op
    for make, message in (
        (
            lambda: Op("x", kind="bogus"),
            "unknown op kind 'bogus'; expected one of compute, comm, copy",
        ),
        (lambda: Coll("k", "shout"), "unknown collective role 'shout'"),
        (lambda: Flow("warp", 1.0), "unknown link kind 'warp'"),
    ):
        with pytest.raises(ConfigError, match=message):
            make()


def test_meta_record_gives_back_the_report_key_for_key():
    """``as_dict`` is the dict the schedule reported, in its order and with its ``None``s (the
    text form and traces stay byte-identical); the text form reads it back as an equal record."""
    from overlap_lab.shared.ir.program_meta import ProgramMeta

    report = {"strategy": "x", "schedule": "tbo", "deep_gemm_sms": None, "micro_batches": []}
    m = ProgramMeta.from_dict(report)
    assert list(m.as_dict().items()) == list(report.items())
    assert m.schedule == "tbo" and m.extra == {"strategy": "x", "deep_gemm_sms": None}
    assert m.reported("deep_gemm_sms") and not m.reported("fallback_reason")
    assert m.fallback_reason is None and m.fault() is None
    merged = m.merged(fallback_reason="why", schedule="tbo+sbo")
    assert list(merged.as_dict()) == [*report, "fallback_reason"]  # as dict.update orders them
    assert merged.schedule == "tbo+sbo" and m.schedule == "tbo"
    p = program([RankBuilder(0, ("main",))], world=1, **report)
    assert p.meta == m and parse(to_text(p)).meta == m
    assert ProgramMeta(comm_sms=3).as_dict() == {"comm_sms": 3} and not ProgramMeta()
