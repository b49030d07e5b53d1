"""Lowering passes: literal before/after Programs."""

from overlap_lab.shared.ir.builder import RankBuilder, program
from overlap_lab.shared.ir.lowering import host_wait_for_counts
from overlap_lab.shared.ir.program import Coll, Flow, Op, Record, Sync

NORMAL = Op("dispatch_a", kind="comm", sms=24, coll=Coll("k", "sendrecv", (Flow("rdma", 1e6),)))
LL = Op("dispatch_a", kind="comm", sms=8, coll=Coll("j", "send", (Flow("rdma", 1e6),)))


def one(build):
    r = RankBuilder(0, ("main", "comm"))
    build(r.thread("main"))
    return program([r], world=2)


def test_normal_dispatch_gets_a_host_wait_for_its_counts():
    before = one(lambda t: t.launch(Op("gate"), "main").launch(NORMAL, "comm"))
    after = host_wait_for_counts(before)
    instrs = after.ranks[0].threads[0].instrs
    assert instrs[1:3] == (Record("k.counts", "comm"), Sync("k.counts"))
    assert instrs[3].op is NORMAL and len(instrs) == 4


def test_low_latency_captured_or_already_synced_dispatches_are_left_alone():
    ll = one(lambda t: t.launch(LL, "main"))
    assert host_wait_for_counts(ll) == ll

    def captured(t):
        t.begin_graph()
        t.launch(NORMAL, "main")
        t.end_graph("g")

    g = one(captured)
    assert host_wait_for_counts(g) == g
    synced = one(lambda t: t.record("r", "main").sync("r").wait("comm", "r").launch(NORMAL, "comm"))
    assert host_wait_for_counts(synced) == synced
