"""Closed-form cases, invariants over random Programs, and determinism of the simulator."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys

import pytest
import simpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.ir.builder import RankBuilder, program
from overlap_lab.shared.ir.program import Coll, Flow, Op
from overlap_lab.sim import cost, simulate
from tests.invariants import check_all, kernels_on

GPU = get_gpu("h100", launch_us=0.0, graph_launch_us=0.0)
N = GPU.num_sms
#: compute-bound persistent GEMM: 1e11 FLOP of BF16 and little memory traffic
GEMM = Op("gemm", flops=1e11, hbm_bytes=1e5, op_class="gemm", grid="persistent")


def solo(op, sms=None):
    return cost.solo_duration_us(op, GPU, sms)


def run(build, streams=("a", "b"), gpu=GPU, world=1):
    r = RankBuilder(0, streams)
    build(r.thread("main"))
    p = program([r], world=world)
    return p, simulate(p, gpu)


def end_of(trace, lane):
    return max(s.end for s in trace.spans if s.lane == lane)


def test_two_equal_kernels_with_enough_sms_take_the_max():
    half = dataclasses.replace(GEMM, sms=N // 2)
    _, tr = run(lambda t: t.launch(half, "a").launch(half, "b"))
    assert tr.step_time_us == pytest.approx(solo(half, N // 2), rel=1e-9)


def test_sharing_sms_takes_longer_than_alone():
    _, tr = run(lambda t: t.launch(GEMM, "a").launch(GEMM, "b"))
    assert tr.step_time_us == pytest.approx(2 * solo(GEMM), rel=1e-9)
    assert tr.step_time_us > solo(GEMM) * 1.5


def test_fewer_sms_run_slower_in_proportion():
    assert solo(GEMM, N // 4) == pytest.approx(4 * solo(GEMM, N), rel=1e-9)


def test_memory_bound_kernels_share_hbm():
    copy = Op("norm", hbm_bytes=1e9, op_class="elementwise", sms=N // 2)
    _, tr = run(lambda t: t.launch(copy, "a").launch(copy, "b"))
    # each alone would take t; together they split the bandwidth and both take ~2t (capped)
    alone = solo(copy, N // 2)
    assert tr.step_time_us > 1.5 * alone


def test_event_wait_delays_exactly():
    def build(t):
        t.launch(GEMM, "a").record("e", "a").wait("b", "e").launch(Op("x", flops=1e9, sms=8), "b")

    _, tr = run(build)
    ((_, a0, a1),) = kernels_on(tr, 0, "stream:a")
    ((_, b0, _),) = kernels_on(tr, 0, "stream:b")
    assert b0 == pytest.approx(a1)


def test_wait_stream_orders_like_record_plus_wait():
    _, tr = run(lambda t: t.launch(GEMM, "a").wait_stream("b", "a").launch(GEMM, "b"))
    ((_, _, a1),) = kernels_on(tr, 0, "stream:a")
    ((_, b0, _),) = kernels_on(tr, 0, "stream:b")
    assert b0 == pytest.approx(a1)


def test_host_sync_blocks_its_thread():
    def build(t):
        t.launch(GEMM, "a").record("e", "a").sync("e").host("after", 7.0)

    _, tr = run(build)
    after = next(s for s in tr.spans if s.op == "after")
    assert after.start == pytest.approx(solo(GEMM))
    assert any(s.kind == "sync" for s in tr.spans)


def test_launch_costs_accumulate_on_one_host_thread():
    g = get_gpu("h100", launch_us=4.0)
    tiny = Op("t", flops=1.0, sms=1)
    _, tr = run(lambda t: [t.launch(tiny, "a") for _ in range(10)], gpu=g)
    host = [s for s in tr.spans if s.lane == "host:main"]
    assert len(host) == 1 and host[0].end == pytest.approx(40.0)
    # the last kernel cannot start before its launch has been paid
    assert kernels_on(tr, 0, "stream:a")[-1][1] >= 40.0 - 1e-9


def test_graph_launch_pays_once_and_each_replayed_kernel_its_gap():
    """One graph-launch cost on the host; on the device, a replayed graph starts each kernel
    ``graph_kernel_gap_us`` after its stream could run it (the gap between consecutive kernels
    of a replay); outside a graph no gap."""
    g = get_gpu("h100", launch_us=4.0, graph_launch_us=9.0, graph_kernel_gap_us=0.5)
    tiny = Op("t", flops=1.0, sms=1)

    def build(t):
        t.begin_graph()
        for _ in range(10):
            t.launch(tiny, "a")
        t.end_graph("g")

    _, tr = run(build, gpu=g)
    ks = kernels_on(tr, 0, "stream:a")
    assert ks[0][1] == pytest.approx(9.5)
    assert [b[1] - a[2] for a, b in zip(ks, ks[1:])] == pytest.approx([0.5] * 9)
    _, eager = run(lambda t: [t.launch(tiny, "a") for _ in range(2)], gpu=g)
    assert kernels_on(eager, 0, "stream:a")[0][1] == pytest.approx(4.0)


def test_collective_recv_waits_for_arrival_over_the_link():
    nbytes = 4e6
    send = Op(
        "dispatch_a",
        kind="comm",
        sms=8,
        hbm_bytes=1e3,
        coll=Coll("k", "send", (Flow("rdma", nbytes),)),
    )
    recv = Op("dispatch_b", kind="comm", sms=8, hbm_bytes=1e3, coll=Coll("k", "recv"))
    _, tr = run(lambda t: t.launch(send, "a").launch(recv, "a"), world=2)
    (_, s0, _), (_, _, r1) = kernels_on(tr, 0, "stream:a")
    transfer = nbytes / GPU.link_bytes_per_us("rdma", effective=True) + GPU.rdma_lat_us
    assert r1 >= s0 + transfer - 1e-9
    assert r1 == pytest.approx(s0 + transfer + solo(recv, 8), rel=1e-6)
    link = [s for s in tr.spans if s.lane == "link:rdma"]
    assert len(link) == 1 and link[0].end - link[0].start == pytest.approx(transfer)


def test_hook_holds_no_sms_while_data_flies():
    send = Op(
        "dispatch_a",
        kind="comm",
        sms=N,
        hbm_bytes=1e3,
        coll=Coll("k", "send", (Flow("rdma", 4e7),)),
    )
    hook = Op("dispatch_b", kind="comm", sms=0, coll=Coll("k", "recv"))
    _, tr = run(lambda t: t.launch(send, "a").launch(hook, "a").launch(GEMM, "b"), world=2)
    # GEMM on b is not delayed by the in-flight dispatch (the hook holds 0 SMs)
    ((_, g0, _),) = kernels_on(tr, 0, "stream:b")
    (_, _, s1), _ = kernels_on(tr, 0, "stream:a")
    assert g0 == pytest.approx(s1)


def test_explicit_ranks_meet_in_point_to_point():
    r0, r1 = RankBuilder(0, ("main",)), RankBuilder(1, ("main",))
    r0.thread("main").launch(GEMM, "main").launch(
        Op(
            "send",
            kind="comm",
            sms=1,
            hbm_bytes=1e3,
            coll=Coll("p", "send", (Flow("nvlink", 1e6, 1),)),
        ),
        "main",
    )
    r1.thread("main").launch(Op("recv", kind="comm", sms=1, coll=Coll("p", "recv")), "main")
    p = program([r0, r1], world=2, symmetric=False)
    tr = simulate(p, GPU)
    ((_, _, send_end),) = [k for k in kernels_on(tr, 0, "stream:main") if k[0] == "send"]
    ((_, _, recv_end),) = kernels_on(tr, 1, "stream:main")
    assert recv_end > solo(GEMM)  # rank 1 waited for rank 0's data


def test_a_kernel_split_into_cohorts_pulls_no_more_hbm_than_it_could_whole():
    """A waved memory-bound kernel that gets 131 SMs, then its last CTA on the SM a tiny kernel
    frees: its two cohorts together are held to the kernel's bandwidth cap (found by the random
    Programs below: each cohort had its own cap, and the kernel beat its own solo time)."""
    tiny = Op("tiny", flops=1e6, op_class="gemm")  # one CTA on one SM
    mem = Op("mem", flops=1e6, hbm_bytes=1e7, op_class="gemm")  # 132 CTAs, one per SM
    assert cost.grid(tiny, N).ctas == 1 and cost.grid(mem, N).ctas == N
    _, tr = run(lambda t: t.launch(tiny, "a").launch(mem, "b"))
    alone = mem.hbm_bytes / cost.bandwidth_cap(mem, GPU, N)
    assert end_of(tr, "stream:b") >= alone * (1 - 1e-9)
    assert len([s for s in tr.spans if s.op == "mem"]) > 1  # it did run as two cohorts


def test_deterministic():
    p, a = run(lambda t: t.launch(GEMM, "a").launch(GEMM, "b").record("e", "b").sync("e"))
    assert simulate(p, GPU) == a
    assert simulate(p, GPU).to_chrome() == a.to_chrome()


def test_importing_shared_and_sim_does_not_import_torch():
    code = (
        "import shared.ir.program, shared.ir.validate, shared.outputs.trace, shared.schedules, sim, sys; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- hypothesis: invariants over random Programs -----------------------------------------------

ops = st.builds(
    lambda f, b, s, kind: Op(
        "k", kind=kind, flops=f, hbm_bytes=b, sms=s, op_class="comm" if kind == "comm" else "gemm"
    ),
    st.sampled_from([1e6, 1e8, 1e10, 5e10]),  # no zero-work ops: their order within one
    # instant on a stream is not observable in a trace
    st.sampled_from([0.0, 1e5, 1e7, 1e8]),
    st.one_of(st.none(), st.integers(1, N)),
    st.sampled_from(["compute", "compute", "comm"]),
).map(
    lambda o: (
        o
        if o.kind == "compute" or o.sms is not None
        else Op(o.name, kind="comm", flops=o.flops, hbm_bytes=o.hbm_bytes, sms=3, op_class="comm")
    )
)


@st.composite
def programs(draw):
    streams = ("s0", "s1", "s2")
    r = RankBuilder(0, streams)
    t = r.thread("main")
    n_events = 0
    recorded = []
    for _ in range(draw(st.integers(1, 25))):
        action = draw(
            st.sampled_from(["launch", "launch", "launch", "record", "wait", "host", "sync"])
        )
        s = draw(st.sampled_from(streams))
        if action == "launch":  # unique names: kernels_on joins same-named contiguous segments
            t.launch(dataclasses.replace(draw(ops), name=f"k{len(t.instrs)}"), s)
        elif action == "record":
            n_events += 1
            recorded.append(f"e{n_events}")
            t.record(f"e{n_events}", s)
        elif action == "wait" and recorded:
            t.wait(s, draw(st.sampled_from(recorded)))
        elif action == "sync" and recorded:
            t.sync(draw(st.sampled_from(recorded)))
        elif action == "host":
            t.host("h", draw(st.sampled_from([0.0, 3.0, 50.0])))
    return program([r], world=1)


#: the per-kernel floor is a latency estimate, not work: kernels overlap it on a stream's neighbours
GPU_NO_FLOOR = dataclasses.replace(GPU, kernel_min_us=0.0)


def critical_bound(p):
    """No schedule beats its longest stream's op sum at full resources, nor its host time. Full
    resources without wave quantisation (a persistent grid on every SM): how a waved kernel's
    waves fall depends on the SMs it gets, and a packing other than N-SM waves can beat them."""
    per_stream, host = {}, 0.0
    for ins in p.ranks[0].threads[0].instrs:
        if hasattr(ins, "op"):
            op = ins.op if ins.op.kind == "comm" else dataclasses.replace(ins.op, grid="persistent")
            per_stream[ins.stream] = per_stream.get(ins.stream, 0.0) + cost.solo_duration_us(
                op, GPU_NO_FLOOR, N
            )
        elif hasattr(ins, "us"):
            host += ins.us
    return max([host, *per_stream.values()])


def sm_time_covers_the_work(p, tr):
    """Work is conserved: a kernel's SM-time (SMs held x time, over its spans) is at least what
    its FLOPs need at the compute roof. (Running kernels together may take longer than running
    them one after another, as on hardware: wave quantisation on the SMs left and persistent
    CTAs started late, so the serial sum is no upper bound.)"""
    ops = {
        ins.op.name: ins.op for th in p.ranks[0].threads for ins in th.instrs if hasattr(ins, "op")
    }
    held: dict = {}
    for s in tr.spans:
        if s.lane.startswith("stream:") and s.kind == "compute":
            held[s.op] = held.get(s.op, 0.0) + s.sms * (s.end - s.start)
    for name, sm_us in held.items():
        need = cost.compute_time_us(ops[name], GPU, N) * N
        assert sm_us >= need * (1 - 1e-6), f"{name}: {sm_us} SM-µs for {need} of work"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_invariants_hold_on_random_programs(p):
    tr = simulate(p, GPU)
    check_all(p, tr, N)
    if tr.spans:
        assert critical_bound(p) - 1e-6 <= tr.step_time_us
        sm_time_covers_the_work(p, tr)


class _EarlyTimers(simpy.Environment):
    """Fires every timer one ulp before the instant asked for: float round-off at its worst."""

    def schedule(self, event, priority=simpy.core.NORMAL, delay=0) -> None:
        if delay > 0:
            delay = math.nextafter(self._now + delay, 0.0) - self._now
        super().schedule(event, priority, delay)


@pytest.mark.parametrize("clock", [0.0, 1e6, 1e16])
def test_a_timer_ends_the_jobs_due_at_it_whatever_round_off_left(clock):
    """A fluid timer that fires short of its jobs' predicted end (by round-off) still ends them:
    they are remembered as due at it, not matched by comparing clocks. At 1e16 µs an ulp is 2 µs,
    so a flow of 10 µs had 20 % left at an early timer and re-armed it at that very instant
    forever."""
    from overlap_lab.sim.resources import Link

    env = _EarlyTimers(initial_time=clock)
    link, arrived = Link(env, 1.0, 0.0), []
    link.send(10.0, lambda: arrived.append(env.now))
    for _ in range(5):
        if env.peek() == float("inf"):
            break
        env.step()
    assert arrived and arrived[0] <= clock + 10.0
    assert env.peek() == float("inf")


def test_a_stalled_run_names_what_is_stuck():
    """A Program the validator would refuse (a wait and a sync on an event never recorded), run
    as is: the stall report names the blocked host thread, the held stream and its queue."""
    from overlap_lab.sim.engine import Engine, SimulationStalled

    r = RankBuilder(0, ("a", "b"))
    r.thread("main").wait("a", "never").launch(GEMM, "a").launch(GEMM, "b").sync("never")
    with pytest.raises(SimulationStalled) as e:
        Engine(program([r], world=1), GPU).run()
    msg = str(e.value)
    assert "rank 0 host blocked at thread main instruction 3" in msg
    assert "rank 0 stream a stuck waiting for event 'never'" in msg
    assert "rank 0 stream a has 1 unissued items" in msg
    assert "stream b" not in msg  # its GEMM ran


def test_a_finished_run_leaves_nothing_alive():
    """Sweeps run thousands of simulations in one process: an Engine's environment (and with it
    every kernel and span) is collectable once the run is over."""
    import gc
    import weakref

    from overlap_lab.sim.engine import Engine

    p, _ = run(lambda t: t.launch(GEMM, "a").launch(GEMM, "b").record("e", "b").sync("e"))
    eng = Engine(p, GPU)
    eng.run()
    env = weakref.ref(eng.env)
    del eng
    gc.collect()
    assert env() is None
