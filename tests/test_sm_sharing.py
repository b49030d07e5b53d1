"""How kernels share the SMs: thread-block grids, wave quantisation, stream priorities, and the
tie-invariance property (the order SimPy processes simultaneous events decides nothing)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model, with_layers
from overlap_lab.shared.ir.builder import RankBuilder, program
from overlap_lab.shared.ir.program import HIGH_PRIORITY, Op, parse, to_text
from overlap_lab.shared.ir.validate import ProgramError, validate
from overlap_lab.shared.schedules import SCHEDULES, ScheduleConfig, build
from overlap_lab.sim import cost, simulate
from overlap_lab.sim.engine import Engine
from tests.invariants import check_all, kernels_on

GPU = get_gpu("h100", launch_us=0.0, graph_launch_us=0.0)
N = GPU.num_sms
#: a waved BF16 GEMM of 1000 CTAs (cuBLAS-like): 7 full waves of 132 and a tail of 76
WAVED = Op("gemm", flops=1000 * cost.WAVED_CTA_FLOPS, hbm_bytes=1e5, op_class="gemm")
#: DeepEP-like communication kernel: 24 coresident CTAs
COMM = Op("comm", kind="comm", op_class="comm", hbm_bytes=1e8, sms=24)


def run(build_fn, streams=("a", "b"), priorities=(), gpu=GPU):
    r = RankBuilder(0, streams, priorities=priorities)
    build_fn(r.thread("main"))
    p = program([r], world=1)
    return p, simulate(p, gpu)


def one(trace, lane):
    ((_, t0, t1),) = kernels_on(trace, 0, lane)
    return t0, t1


# ---- grids and wave quantisation ------------------------------------------------------------


def test_grid_kinds_follow_the_kernel_families():
    assert cost.grid(COMM, 24) == cost.Grid("coresident", 24, 1)
    fp8 = Op("experts", op_class="grouped_gemm", dtype="fp8", flops=1e12)
    assert cost.grid(fp8, 108) == cost.Grid("persistent", 108, 1)  # DeepGEMM: grid = its SMs
    assert cost.grid(WAVED, N) == cost.Grid("waved", 1000, 1)
    hook = dataclasses.replace(COMM, sms=0)
    assert cost.grid(hook, 0).ctas == 0


def test_waved_kernel_alone_runs_whole_waves():
    _, tr = run(lambda t: t.launch(WAVED, "a"))
    t0, t1 = one(tr, "stream:a")
    per_cta = cost.solo_duration_us(dataclasses.replace(WAVED, grid="persistent"), GPU) * N / 1000
    # compute-bound: 8 waves (ceil(1000/132)) of one CTA time each, not 1000/132 = 7.58
    assert t1 - t0 == pytest.approx(math.ceil(1000 / N) * per_cta, rel=1e-6)
    assert t1 - t0 == pytest.approx(cost.solo_duration_us(WAVED, GPU), rel=1e-9)


def test_waved_tail_wave_releases_the_sms_it_does_not_need():
    spans = [s for s in run(lambda t: t.launch(WAVED, "a"))[1].spans if s.lane == "stream:a"]
    assert [s.sms for s in spans] == [N, 1000 - 7 * N]


def test_persistent_kernel_on_fewer_sms_scales_smoothly():
    g = dataclasses.replace(WAVED, grid="persistent")
    assert cost.solo_duration_us(g, GPU, 33) == pytest.approx(4 * cost.solo_duration_us(g, GPU))


# ---- who gets the SMs -------------------------------------------------------------------------


def test_persistent_kernel_holds_its_sms_until_it_ends():
    g = dataclasses.replace(WAVED, grid="persistent")
    _, tr = run(
        lambda t: t.launch(g, "a").host("h", 1.0).launch(COMM, "b"),
        priorities=(("b", HIGH_PRIORITY),),
    )
    _, g_end = one(tr, "stream:a")
    c0, _ = one(tr, "stream:b")
    assert c0 == pytest.approx(g_end)  # even a high-priority stream waits for its end


def test_waved_kernel_yields_to_a_higher_priority_stream_at_its_next_wave_boundary():
    _, tr = run(
        lambda t: t.launch(WAVED, "a").host("h", 1.0).launch(COMM, "b"),
        priorities=(("b", HIGH_PRIORITY),),
    )
    c0, _ = one(tr, "stream:b")
    wave = cost.solo_duration_us(WAVED, GPU) / math.ceil(1000 / N)
    assert c0 == pytest.approx(wave, rel=1e-6)  # the first wave boundary, not the GEMM's end
    sms_a = [s.sms for s in tr.spans if s.lane == "stream:a"]
    assert sms_a[:2] == [N, N - 24]


def test_at_equal_priority_launch_order_decides():
    _, tr = run(lambda t: t.launch(WAVED, "a").launch(COMM, "b"))
    c0, _ = one(tr, "stream:b")
    # the comm kernel waits behind every full wave of the earlier GEMM and fills in at its tail
    wave = cost.solo_duration_us(WAVED, GPU) / math.ceil(1000 / N)
    assert c0 == pytest.approx(7 * wave, rel=1e-6)


def test_priority_beats_launch_order_for_kernels_ready_at_the_same_instant():
    big = dataclasses.replace(WAVED, sms=N)
    late = dataclasses.replace(COMM, sms=N)

    def build_fn(t):
        t.launch(big, "a").record("e", "a").wait("b", "e").wait("c", "e")
        t.launch(big, "b").launch(late, "c")  # both become ready when "e" fires

    _, tr = run(build_fn, streams=("a", "b", "c"), priorities=(("c", HIGH_PRIORITY),))
    ((_, b0, _),) = kernels_on(tr, 0, "stream:b")
    ((_, c0, c1),) = kernels_on(tr, 0, "stream:c")
    assert c0 < b0 and b0 == pytest.approx(c1)


def test_coresident_kernel_waits_for_all_of_its_sms():
    half = dataclasses.replace(WAVED, grid="persistent", sms=120)
    _, tr = run(lambda t: t.launch(half, "a").launch(COMM, "b"))
    _, h1 = one(tr, "stream:a")
    c0, _ = one(tr, "stream:b")
    assert c0 == pytest.approx(h1)  # 12 SMs free, 24 needed: it starts when the GEMM ends


# ---- priorities in the Program ------------------------------------------------------------------


def test_stream_priorities_round_trip_through_the_text_form():
    r = RankBuilder(0, ("main", "comm"), priorities=(("comm", HIGH_PRIORITY),))
    r.thread("main").launch(dataclasses.replace(WAVED, ctas=77, ctas_per_sm=2), "main")
    p = program([r], world=1)
    text = to_text(p)
    assert "streams=main,comm@-1" in text and "ctas=77" in text
    assert parse(text) == p
    assert parse(text).rank(0).priority("comm") == HIGH_PRIORITY


def test_priority_on_an_unknown_stream_is_refused():
    r = RankBuilder(0, ("main",), priorities=(("other", -1),))
    r.thread("main").launch(COMM, "main")
    with pytest.raises(ProgramError, match="unknown stream 'other'"):
        validate(program([r], world=1), N)


def test_unknown_grid_is_refused():
    r = RankBuilder(0, ("main",))
    r.thread("main").launch(dataclasses.replace(COMM, grid="cooperative"), "main")
    with pytest.raises(ProgramError, match="unknown grid"):
        validate(program([r], world=1), N)


# ---- tie invariance -------------------------------------------------------------------------------


def simulate_shuffled(p, gpu, env):
    validate(p, gpu.num_sms)
    return Engine(p, gpu, env=env).run()


_ops = st.builds(
    lambda f, b, s, kind, grid: Op(
        "k",
        kind=kind,
        flops=f,
        hbm_bytes=b,
        sms=(s or 8) if kind == "comm" else s,
        op_class="comm" if kind == "comm" else "gemm",
        grid=None if kind == "comm" else grid,
    ),
    st.sampled_from([1e6, 1e8, 1e10, 5e10]),
    st.sampled_from([0.0, 1e5, 1e7, 1e8]),
    st.one_of(st.none(), st.integers(1, N)),
    st.sampled_from(["compute", "compute", "comm"]),
    st.sampled_from([None, "persistent", "waved"]),
)


@st.composite
def programs(draw):
    """Random single-rank Programs whose kernels often become ready at the same instant: events
    released together, zero host costs, several streams of different priorities."""
    streams = ("s0", "s1", "s2", "s3")
    prios = tuple((s, draw(st.sampled_from([0, 0, -1, -2]))) for s in streams)
    r = RankBuilder(0, streams, priorities=prios)
    t = r.thread("main")
    recorded = []
    for i in range(draw(st.integers(2, 30))):
        action = draw(st.sampled_from(["launch"] * 4 + ["record", "wait", "wait", "host"]))
        s = draw(st.sampled_from(streams))
        if action == "launch":
            t.launch(dataclasses.replace(draw(_ops), name=f"k{i}"), s)
        elif action == "record":
            recorded.append(f"e{i}")
            t.record(f"e{i}", s)
        elif action == "wait" and recorded:
            t.wait(s, draw(st.sampled_from(recorded)))
        elif action == "host":
            t.host("h", draw(st.sampled_from([0.0, 5.0])))
    return program([r], world=1)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(), st.integers(0, 2**31))
def test_simultaneous_events_in_any_order_give_the_same_trace(tie_shuffled, p, tie_seed):
    ref = simulate(p, GPU)
    check_all(p, ref, N)
    assert simulate_shuffled(p, GPU, tie_shuffled(tie_seed)) == ref


def _schedule_cases():
    lite = with_layers(get_model("deepseek-v2-lite"), 3)
    v3 = with_layers(get_model("deepseek-v3"), 3)
    dec = Batch.decode(64, kv_len=1024)
    pre = Batch.prefill(4, extend_len=1024)
    for name in SCHEDULES:
        cfgs = [ScheduleConfig()]
        if name in ("sbo", "tbo+sbo"):
            cfgs = [ScheduleConfig(sbo_mode=m) for m in (1, 2, 3)]
        for model in (lite, v3):
            for batch in (dec, pre):
                par = Parallel(ep=8, pp=2) if name == "pp" else Parallel(ep=32)
                for cfg in cfgs:
                    yield name, Workload(model, batch, par), cfg


@pytest.mark.parametrize("gpu_name", ["h800", "b200"])
def test_every_schedule_is_tie_invariant(gpu_name, tie_shuffled):
    gpu = get_gpu(gpu_name)
    checked = 0
    for name, w, cfg in _schedule_cases():
        try:
            p = build(name, w, gpu, cfg)
        except ConfigError:
            continue  # a combination the system refuses
        ref = simulate(p, gpu)
        for seed in (1, 2):
            shuffled = simulate_shuffled(p, gpu, tie_shuffled(seed))
            assert shuffled == ref, f"{name} {w.batch.mode} {cfg}"
        checked += 1
    assert checked >= len(SCHEDULES) * 2


# ---- kernels that poll signals (Op.waits) ------------------------------------------------------


def test_a_polling_kernel_holds_its_sms_and_finishes_after_its_last_signal():
    part = dataclasses.replace(WAVED, grid="persistent", sms=N - 24, flops=WAVED.flops / 4)
    poll = dataclasses.replace(COMM, hbm_bytes=1e6, waits=("s0", "s1", "s2", "s3"))

    def build_fn(t):
        t.record("start", "a").wait("b", "start").launch(poll, "b")
        for k in range(4):
            t.launch(dataclasses.replace(part, name=f"down.{k}"), "a").record(f"s{k}", "a")

    p, tr = run(build_fn)
    assert parse(to_text(p)) == p  # waits round-trip through the text form
    c0, c1 = one(tr, "stream:b")
    last = max(e for n, _, e in kernels_on(tr, 0, "stream:a"))
    assert c0 == pytest.approx(0.0)  # resident from the start
    # its last quarter cannot run before the last signal, then takes a quarter of its time
    assert c1 == pytest.approx(last + cost.solo_duration_us(poll, GPU) / 4, rel=1e-6)
    assert [s.sms for s in tr.spans if s.lane == "stream:b"] == [24]


def test_a_signal_never_recorded_is_refused():
    r = RankBuilder(0, ("main",))
    r.thread("main").launch(dataclasses.replace(COMM, waits=("nowhere",)), "main")
    with pytest.raises(ProgramError, match="never recorded"):
        validate(program([r], world=1), N)


def test_tbo_refuses_without_expert_parallelism():
    w = Workload(get_model("deepseek-v2-lite"), Batch.decode(32), Parallel(ep=1))
    with pytest.raises(ConfigError, match="expert parallelism"):
        build("tbo", w, get_gpu("h800"))


def test_a_dynamic_persistent_kernel_shares_its_late_work_among_all_its_ctas():
    dyn = dataclasses.replace(WAVED, grid="dynamic")
    hold = dataclasses.replace(COMM, sms=32, hbm_bytes=2e8)
    _, tr = run(lambda t: t.launch(hold, "b").host("h", 1.0).launch(dyn, "a"))
    _, h1 = one(tr, "stream:b")
    d0, d1 = one(tr, "stream:a")
    # on 100 SMs until the comm kernel ends, then on 132: the work, not the CTAs, is conserved
    t100, t132 = (cost.solo_duration_us(dyn, GPU, s) for s in (100, N))
    assert d1 == pytest.approx(h1 + (1 - (h1 - d0) / t100) * t132, rel=1e-6)
    assert [s.sms for s in tr.spans if s.lane == "stream:a"] == [100, N]
    # a static persistent grid instead runs its 32 late CTAs to the end, one CTA-length later
    stat = dataclasses.replace(WAVED, grid="persistent")
    _, tr2 = run(lambda t: t.launch(hold, "b").host("h", 1.0).launch(stat, "a"))
    assert one(tr2, "stream:a")[1] == pytest.approx(h1 + t132, rel=1e-6)


@pytest.mark.parametrize("gpu", ["h100", "h800", "h200"])
def test_waved_kernel_beside_a_one_sm_kernel_is_not_faster_than_alone(gpu):
    """Beside a one-SM kernel the big memory-bound kernel's last, partial wave landed on ~107
    SMs instead of ~26 alone, pulling more HBM, and the kernel ended before its time alone."""
    g = get_gpu(gpu)
    text = (
        "program world=1 symmetric=true\nrank 0 streams=a,b\n  thread t\n"
        "    launch b small hbm_bytes=1e6 sms=1\n    launch a big hbm_bytes=1e9\n"
    )
    p = parse(text)
    ((_, start, end),) = kernels_on(simulate(p, g), 0, "stream:a")
    alone = cost.solo_duration_us(p.ranks[0].threads[0].instrs[1].op, g)
    assert end - start >= alone * (1 - 1e-12)
