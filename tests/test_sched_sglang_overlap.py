"""SGLang's CPU-GPU overlap scheduler against its rules (docs/schedules.md).

Golden Programs: tests/golden/sglang-overlap_<case>.txt hold whole Programs of a two-layer
DeepSeek-V2-Lite (work numbers stripped). Regenerate them after an intended change with
``UPDATE_GOLDEN=1 pytest tests/test_sched_sglang_overlap.py``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import HostCosts, get_gpu
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model
from overlap_lab.shared.ir.ops import DENSE_OP_NAMES, MOE_OP_NAMES
from overlap_lab.shared.ir.ops_sched import (
    D2H_OPS,
    SCHED_OP_NAMES,
    SCHEDULE_DECODE_OPS,
    SCHEDULE_PREFILL_OPS,
)
from overlap_lab.shared.ir.program import (
    Graph,
    Host,
    Launch,
    Record,
    Sync,
    Wait,
    WaitStream,
    to_text,
)
from overlap_lab.shared.ir.validate import issue_order
from overlap_lab.shared.schedules import ScheduleConfig, build, module
from overlap_lab.shared.schedules.sglang_overlap import (
    FutureMapSize,
    FutureRing,
    FutureRingOverwrite,
    overlap_report,
    plan_iterations,
    walk_future_map,
)
from overlap_lab.sim import simulate
from tests.invariants import check_all
from tests.sched_helpers import collapse

GPU = get_gpu("h100")
GOLDEN = Path(__file__).parent / "golden"
_WORK = re.compile(r" (flops|hbm_bytes|flow)=\S+")
LITE = get_model("deepseek-v2-lite")
TINY = get_model("deepseek-v2-lite", num_layers=2)  # layer 0 dense, layer 1 MoE


def decode_w(n=8, model=LITE) -> Workload:
    return Workload(model, Batch.decode(n, kv_len=1024), Parallel(ep=8))


def prefill_w(n=2, ext=256, model=LITE) -> Workload:
    return Workload(model, Batch.prefill(n, extend_len=ext), Parallel(ep=8))


def prog(w, **kw):
    return build("sglang-overlap", w, GPU, ScheduleConfig(**kw))


def flat(p):
    """The scheduler thread's instructions, graph bodies inlined, with their graph name."""
    (th,) = p.rank(0).threads
    out = []
    for ins in th.instrs:
        if isinstance(ins, Graph):
            out += [(b, ins.name) for b in ins.body]
        else:
            out.append((ins, None))
    return [i for i, _ in out]


def launches(p, step=None):
    return [i for i in flat(p) if isinstance(i, Launch) and (step is None or i.op.step == step)]


def index(instrs, pred) -> int:
    return next(k for k, i in enumerate(instrs) if pred(i))


def is_model(op) -> bool:
    return op.name not in SCHED_OP_NAMES


# ----------------------------------------------------------------------------------------------
# Streams and the ops on them
# ----------------------------------------------------------------------------------------------


def test_registered_with_seed():
    m = module("sglang-overlap")
    assert "event_loop_overlap" in m.UPSTREAM
    assert "FutureMap" in m.SUMMARY


def test_three_streams_and_what_runs_on_each():
    p = prog(decode_w(), iterations=3)
    assert p.rank(0).streams == ("schedule", "forward", "copy")
    assert [t.name for t in p.rank(0).threads] == ["scheduler"]
    for ins in launches(p):
        name = ins.op.name
        if name in SCHEDULE_DECODE_OPS + SCHEDULE_PREFILL_OPS:
            assert ins.stream == "schedule", name
        elif name in D2H_OPS:
            assert ins.stream == "copy" and ins.op.kind == "copy", name
        else:  # resolve_future, the model forward, store_to_map
            assert ins.stream == "forward", name


def test_schedule_stream_ops_in_seed_order():
    p = prog(prefill_w(), iterations=3, iteration_modes=("prefill", "decode"))
    sched = lambda s: [i.op.name for i in launches(p, s) if i.stream == "schedule"]  # noqa: E731
    assert sched(0) == list(SCHEDULE_PREFILL_OPS)  # H2D input_ids, Triton req_to_token write
    assert sched(1) == list(SCHEDULE_DECODE_OPS)  # gather, +1, clone, cast, scatter, seq_lens+1
    h2d = launches(p, 0)[0].op
    assert h2d.kind == "copy" and h2d.hbm_bytes == 2 * 256 * 8  # int64 token ids


def test_forward_is_one_graph_launch_for_decode_and_eager_for_prefill():
    p = prog(prefill_w(), iterations=2, iteration_modes=("prefill", "decode"))
    (th,) = p.rank(0).threads
    graphs = [i for i in th.instrs if isinstance(i, Graph)]
    assert [g.name for g in graphs] == ["forward.1"]
    body = [b.op.name for b in graphs[0].body]
    assert body[0] == "embed" and body[-1] == "sample" and "resolve_future" not in body
    top = [i.op.name for i in th.instrs if isinstance(i, Launch) and i.op.step == 0]
    assert "embed" in top and "sample" in top  # prefill launches kernel by kernel


def test_ops_and_layers_match_the_model():
    p = prog(decode_w(), iterations=2)
    for step in (0, 1):
        ops = [i.op for i in launches(p, step) if is_model(i.op)]
        per_layer = {}
        for op in ops:
            if op.layer is not None:
                per_layer.setdefault(op.layer, []).append(op.name)
        assert sorted(per_layer) == list(range(LITE.num_layers))
        for layer, names in per_layer.items():
            want = MOE_OP_NAMES if LITE.is_moe_layer(layer) else DENSE_OP_NAMES
            assert tuple(collapse(names)) == want
        head = [op.name for op in ops if op.layer is None]
        assert head == ["embed", "final_norm", "logits", "sample"]


# ----------------------------------------------------------------------------------------------
# The loop: wait_stream, resolve, forward, store, D2H, the one host sync
# ----------------------------------------------------------------------------------------------


def test_wait_stream_then_resolve_future_then_forward():
    p = prog(decode_w(), iterations=3)
    ins = flat(p)
    for step in range(3):
        last_sched = max(
            k
            for k, i in enumerate(ins)
            if isinstance(i, Launch) and i.op.step == step and i.stream == "schedule"
        )
        ws = index(ins[last_sched:], lambda i: isinstance(i, WaitStream)) + last_sched
        assert ins[ws] == WaitStream("forward", "schedule")  # GPU-side wait, no host block
        assert ins[ws + 1].op.name == "resolve_future" and ins[ws + 1].stream == "forward"
        assert ins[ws + 2].op.name == "embed" and ins[ws + 2].op.step == step
        assert not any(isinstance(i, Sync) for i in ins[last_sched:ws])


def test_store_to_map_then_copy_after_forward_then_copy_done():
    p = prog(decode_w(), iterations=2, return_logprob=True)
    ins = flat(p)
    for step in range(2):
        k = index(
            ins,
            lambda i, s=step: isinstance(i, Launch) and i.op.name == "sample" and i.op.step == s,
        )
        tail = ins[k + 1 : k + 7]
        assert tail[0].op.name == "store_to_map" and tail[0].stream == "forward"
        assert tail[1] == Record(f"forward_done.{step}", "forward")
        assert tail[2] == Wait("copy", f"forward_done.{step}")
        assert [t.op.name for t in tail[3:5]] == ["d2h_next_token_ids", "d2h_next_token_logprobs"]
        assert tail[5] == Record(f"copy_done.{step}", "copy")


def test_one_host_sync_per_iteration_right_before_processing():
    n = 4
    p = prog(decode_w(), iterations=n)
    ins = flat(p)
    syncs = [k for k, i in enumerate(ins) if isinstance(i, Sync)]
    assert [ins[k].event for k in syncs] == [f"copy_done.{s}" for s in range(n)]
    for k in syncs:
        step = int(ins[k].event.split(".")[1])
        assert ins[k + 1] == Host("process_batch_result", ins[k + 1].us, step=step)
        assert ins[k + 2].name == "send_to_detokenizer" and ins[k + 2].step == step
    # Position: batch N-1 is processed after batch N's forward and copy are issued.
    for step in range(n - 1):
        last_of_next = max(
            k
            for k, i in enumerate(ins)
            if getattr(getattr(i, "op", None), "step", None) == step + 1
        )
        assert syncs[step] > last_of_next
        assert ins[last_of_next + 1] == Record(f"copy_done.{step + 1}", "copy")


def test_host_is_one_step_ahead_at_most():
    """Before batch N is launched, batch N-2's result has been synced: never two in flight."""
    n = 5
    p = prog(decode_w(), iterations=n)
    ins = flat(p)
    sync_at = {i.event: k for k, i in enumerate(ins) if isinstance(i, Sync)}
    for step in range(2, n):
        launch = index(ins, lambda i, s=step: isinstance(i, Launch) and i.op.step == s)
        assert sync_at[f"copy_done.{step - 2}"] < launch
        assert sync_at[f"copy_done.{step - 1}"] > launch  # ...but N-1 is still pending
    in_flight, most = 0, 0
    for i in ins:
        if isinstance(i, Record) and i.event.startswith("copy_done."):
            in_flight += 1
        elif isinstance(i, Sync):
            in_flight -= 1
        most = max(most, in_flight)
    assert most == 2  # batch N running, N-1 awaiting processing


def test_normal_loop_processes_each_batch_before_the_next():
    p = prog(decode_w(), iterations=3, disable_overlap_schedule=True)
    assert p.rank(0).streams == ("schedule",)
    assert all(i.stream == "schedule" for i in launches(p))
    ins = flat(p)
    for step in range(2):
        sync = index(ins, lambda i, s=step: isinstance(i, Sync) and i.event == f"result_ready.{s}")
        nxt = index(ins, lambda i, s=step: isinstance(i, Host) and i.step == s + 1)
        assert sync < nxt
    assert not any(i.op.name in ("resolve_future", "store_to_map") for i in launches(p))
    assert p.meta.extra["overlap"] is False


# ----------------------------------------------------------------------------------------------
# FutureMap
# ----------------------------------------------------------------------------------------------


def test_future_map_sizing_as_upstream():
    s = FutureMapSize.of(128, 8192, 163840)
    assert s.max_num_chunks == 20
    assert s.future_limit == 128 * (3 + 20)
    assert s.future_buffer_len == s.future_limit + 2 * 128
    assert FutureMapSize.of(64, None, 4096).future_limit == 64 * 3
    p = prog(decode_w(8), iterations=3, max_running_requests=32, context_len=10000)
    fm = p.meta.extra["future_map"]
    assert fm["max_num_chunks"] == 2  # ceil(10000 / 8192)
    assert fm["future_limit"] == 32 * 5 and fm["future_buffer_len"] == 32 * 7
    with pytest.raises(ConfigError, match="max-running-requests"):
        prog(decode_w(8), iterations=2, max_running_requests=4)


def test_future_map_placeholders_resolved_by_the_next_decode():
    p = prog(prefill_w(2), iterations=5, iteration_modes=("prefill", "prefill", "decode"))
    slots = p.meta.extra["future_map"]["slots"]
    assert slots[0] == {"step": 0, "alloc": [1, 3], "resolves": []}  # slot 0 is never used
    assert slots[1] == {"step": 1, "alloc": [3, 5], "resolves": []}  # prefills resolve nothing
    assert slots[2]["resolves"] == [0, 1] and slots[2]["alloc"] == [5, 9]  # decode of 4 reqs
    assert slots[3]["resolves"] == [2] and slots[4]["resolves"] == [3]


def test_ring_too_small_would_overwrite_an_unresolved_slot():
    plan = plan_iterations(prefill_w(2), ScheduleConfig(iterations=3, iteration_modes=("prefill",)))
    size = FutureMapSize(max_running_requests=6, max_num_chunks=0)
    walk_future_map(plan, FutureRing(size))  # upstream's 3 * mrr: fine
    with pytest.raises(FutureRingOverwrite, match="not yet resolved"):
        walk_future_map(plan, FutureRing(size, limit=2))


@settings(max_examples=60, deadline=None)
@given(
    modes=st.lists(st.sampled_from(["prefill", "decode"]), min_size=1, max_size=30),
    cohort=st.integers(1, 6),
    chunked=st.sampled_from([None, 64, 256]),
)
def test_ring_never_overwrites_an_unresolved_slot(modes, cohort, chunked):
    modes = ["prefill", *modes]
    w = Workload(LITE, Batch.prefill(cohort, extend_len=32), Parallel(ep=8))
    cfg = ScheduleConfig(
        iterations=len(modes), iteration_modes=tuple(modes), chunked_prefill_size=chunked
    )
    plan = plan_iterations(w, cfg)
    mrr = max(it.running for it in plan)
    ring = FutureRing(FutureMapSize.of(mrr, chunked, 4096))
    walk_future_map(plan, ring)  # raises FutureRingOverwrite on a collision
    assert len(ring.pending) <= mrr


# ----------------------------------------------------------------------------------------------
# Forced serial cases and delayed sampling
# ----------------------------------------------------------------------------------------------


def _process_pos(ins, step):
    return index(ins, lambda i: isinstance(i, Sync) and i.event == f"copy_done.{step}")


def _launch_pos(ins, step):
    return index(
        ins, lambda i: isinstance(i, Launch) and i.op.name == "resolve_future" and i.op.step == step
    )


def test_consecutive_prefill_switch_processes_last_batch_first():
    modes = ("prefill", "prefill", "decode")
    on = prog(
        prefill_w(), iterations=4, iteration_modes=modes, disable_consecutive_prefill_overlap=True
    )
    off = prog(prefill_w(), iterations=4, iteration_modes=modes)
    ins_on, ins_off = flat(on), flat(off)
    assert _process_pos(ins_on, 0) < _launch_pos(ins_on, 1)  # forced serial
    assert _process_pos(ins_off, 0) > _launch_pos(ins_off, 1)  # default: overlapped
    assert _process_pos(ins_on, 1) > _launch_pos(ins_on, 2)  # decode after prefill: overlapped
    loop = {r["step"]: r for r in on.meta.extra["loop"]}
    assert "consecutive prefill" in loop[1]["forced_serial"]
    assert loop[2]["forced_serial"] is None and loop[0]["forced_serial"] is None


@pytest.mark.parametrize(
    ("spec", "grammar", "forced"), [(True, True, True), (True, False, False), (False, True, False)]
)
def test_spec_v2_grammar_decode_is_serial(spec, grammar, forced):
    p = prog(decode_w(), iterations=3, spec_v2=spec, grammar=grammar)
    ins = flat(p)
    assert _process_pos(ins, 0) > _launch_pos(ins, 0)  # empty result queue at step 0
    for step in (1, 2):
        assert (_process_pos(ins, step - 1) < _launch_pos(ins, step)) is forced


def test_grammar_delays_sampling_until_the_last_result_is_processed():
    p = prog(decode_w(), iterations=3, grammar=True)
    ins = flat(p)
    (th,) = p.rank(0).threads
    assert all(
        "sample" not in [b.op.name for b in g.body] for g in th.instrs if isinstance(g, Graph)
    )
    for step in (1, 2):
        sample = index(
            ins,
            lambda i, s=step: isinstance(i, Launch) and i.op.name == "sample" and i.op.step == s,
        )
        assert ins[sample - 1] == WaitStream("forward", "schedule")
        assert _process_pos(ins, step - 1) < sample
        assert ins[sample + 1].op.name == "store_to_map"
    assert p.meta.extra["loop"][0]["delayed_sample"] is True


def test_refusals():
    with pytest.raises(ConfigError, match="pipeline"):
        build("sglang-overlap", Workload(LITE, Batch.decode(4), Parallel(ep=8, pp=2)), GPU)
    with pytest.raises(ConfigError, match="start --iteration-modes with prefill"):
        prog(prefill_w(), iterations=2, iteration_modes=("decode",))
    with pytest.raises(ConfigError, match="iteration[-_]modes"):
        ScheduleConfig(iteration_modes=("extend",))
    with pytest.raises(ConfigError, match="iteration[-_]modes"):
        ScheduleConfig(iterations=1, iteration_modes=("prefill", "decode"))


def test_plan_grows_the_running_batch_with_each_prefill():
    plan = plan_iterations(
        decode_w(4), ScheduleConfig(iterations=4, iteration_modes=("decode", "prefill", "decode"))
    )
    assert [it.mode for it in plan] == ["decode", "prefill", "decode", "decode"]
    assert plan[1].batch.extend_lens == (1024,) * 4  # new prompts shaped like the workload
    assert plan[2].batch.num_seqs == 8  # merged into the running batch
    assert plan[2].batch.kv_lens == (1025,) * 4 + (1024,) * 4
    assert plan[3].batch.kv_lens == (1026,) * 4 + (1025,) * 4


# ----------------------------------------------------------------------------------------------
# Simulated traces
# ----------------------------------------------------------------------------------------------


def _host_span(tr, name, step):
    return next(
        s for s in tr.spans if s.lane.startswith("host:") and s.op == name and s.step == step
    )


@pytest.mark.parametrize(
    "kw",
    [
        dict(iterations=3),
        dict(iterations=3, disable_overlap_schedule=True),
        dict(iterations=3, grammar=True),
    ],
)
def test_trace_invariants(kw):
    p = prog(decode_w(), **kw)
    tr = simulate(p, GPU)
    check_all(p, tr, GPU.num_sms)
    # between the critical-path bound (the busiest lane) and the serial sum of all spans
    busy = tr.busy_us()
    total = tr.step_time_us
    assert max(busy.values()) <= total + 1e-6
    assert total <= sum(s.duration for s in tr.spans) + 1e-6


def test_prefill_trace_invariants():
    p = prog(prefill_w(), iterations=3, iteration_modes=("prefill", "decode"))
    tr = simulate(p, GPU)
    check_all(p, tr, GPU.num_sms)


def _host_us_per_iteration(h: HostCosts, n: int, launch_us: float) -> float:
    # recv + schedule + 6 schedule-stream launches + resolve + graph + store + d2h + process + send
    return (
        h.recv_requests_us
        + h.schedule_us(n)
        + h.process_result_us(n)
        + h.detokenizer_send_us
        + 9 * launch_us
    )


@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_iteration_time_is_max_not_sum(scale):
    """Overlap: iteration = max(GPU, host); --disable-overlap-schedule: about GPU + host."""
    h = HostCosts(**{k: v * scale for k, v in dataclasses.asdict(HostCosts()).items()})
    w = decode_w(16)
    ov = overlap_report(simulate(prog(w, iterations=5, host=h), GPU))
    no = overlap_report(simulate(prog(w, iterations=5, host=h, disable_overlap_schedule=True), GPU))
    gpu_us = ov["iterations"][2]["forward_us"]
    host_us = _host_us_per_iteration(h, 16, GPU.launch_us)
    assert ov["steady_period_us"] == pytest.approx(max(gpu_us, host_us), rel=0.03)
    assert no["steady_period_us"] == pytest.approx(gpu_us + host_us, rel=0.03)
    assert ov["steady_period_us"] < no["steady_period_us"]
    if scale == 1.0:  # GPU-bound: the forward stream never waits for the host
        assert all(r["forward_gap_us"] < 10 for r in ov["iterations"])


def test_prefill_result_is_delivered_exactly_one_iteration_later():
    """The prefill's first token leaves at the end of loop iteration p+1 under overlap, at the
    end of iteration p in the normal loop: deferred by exactly one iteration."""
    w = prefill_w()
    cfg = dict(iterations=4, iteration_modes=("prefill", "decode"))
    ov = simulate(prog(w, **cfg), GPU)
    no = simulate(prog(w, **cfg, disable_overlap_schedule=True), GPU)
    # overlap: send(0) ends exactly where iteration 2 begins (two loop iterations after recv(0))
    assert _host_span(ov, "send_to_detokenizer", 0).end == pytest.approx(
        _host_span(ov, "recv_requests", 2).start
    )
    # normal loop: it ends exactly where iteration 1 begins
    assert _host_span(no, "send_to_detokenizer", 0).end == pytest.approx(
        _host_span(no, "recv_requests", 1).start
    )
    # and its processing is issued after batch 1's forward has been launched
    order = [it.instr for it in issue_order(prog(w, **cfg).ranks[0])]
    launch_fwd_1 = next(
        i
        for i, x in enumerate(order)
        if getattr(getattr(x, "op", None), "step", None) == 1 and x.op.name == "resolve_future"
    )
    process_0 = next(
        i
        for i, x in enumerate(order)
        if isinstance(x, Host) and x.name == "process_batch_result" and x.step == 0
    )
    assert process_0 > launch_fwd_1
    rep = overlap_report(ov, baseline=no)
    row = rep["iterations"][0]
    assert row["deferred"] is True and row["iterations_late"] == 1
    assert rep["baseline"]["iterations"][0]["iterations_late"] == 0
    assert "ttft_cost_us" in row


def test_host_bound_deferral_costs_the_next_iterations_host_work():
    """With the GPU far faster than the host, the prefill's result waits for the whole host
    work of the next iteration before it is processed: wait = that work + its own processing."""
    h = HostCosts(**{k: v * 50 for k, v in dataclasses.asdict(HostCosts()).items()})
    w = prefill_w(1, 64)
    tr = simulate(prog(w, iterations=3, iteration_modes=("prefill", "decode"), host=h), GPU)
    assert not any(
        s.kind == "sync" for s in tr.spans if s.end > _host_span(tr, "recv_requests", 1).start
    )
    recv1 = _host_span(tr, "recv_requests", 1)
    proc0 = _host_span(tr, "process_batch_result", 0)
    between = sum(
        s.duration
        for s in tr.spans
        if s.lane.startswith("host:") and recv1.start <= s.start < proc0.start
    )
    assert proc0.start - recv1.start == pytest.approx(between)
    assert between >= h.recv_requests_us + h.schedule_us(1)


# ----------------------------------------------------------------------------------------------
# Golden Programs
# ----------------------------------------------------------------------------------------------

GOLDEN_CASES = {
    "decode": (dict(model=TINY), dict(iterations=3)),
    "prefill_decode_normal": (
        dict(model=TINY, prefill=True),
        dict(iterations=3, iteration_modes=("prefill", "decode"), disable_overlap_schedule=True),
    ),
    "consecutive_prefill_serial": (
        dict(model=TINY, prefill=True),
        dict(
            iterations=3,
            iteration_modes=("prefill", "prefill", "decode"),
            disable_consecutive_prefill_overlap=True,
        ),
    ),
    "grammar": (dict(model=TINY), dict(iterations=2, grammar=True)),
}


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_golden(case):
    wkw, ckw = GOLDEN_CASES[case]
    w = prefill_w(2, 64, model=wkw["model"]) if wkw.get("prefill") else decode_w(4, wkw["model"])
    text = _WORK.sub("", to_text(prog(w, **ckw)))
    path = GOLDEN / f"sglang-overlap_{case}.txt"
    if os.environ.get("UPDATE_GOLDEN") == "1" or not path.exists():
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs (UPDATE_GOLDEN=1 to accept)"
