"""The fast-forward over repeated layers (``sim.fastforward``) gives the full simulation's Trace:
every span, to 1e-9 of its times, for every schedule (decode and prefill, one rank and explicit
ranks), for random Programs of repeated layers, and with simultaneous events in any order."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from fuzz_helpers import fuzz_settings
from hypothesis import assume, given
from hypothesis import strategies as st

import overlap_lab as ol
from overlap_lab.shared import schedules
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model
from overlap_lab.shared.ir.builder import RankBuilder, program
from overlap_lab.shared.ir.program import Coll, Flow, Op
from overlap_lab.shared.ir.validate import validate
from overlap_lab.sim.engine import Engine
from overlap_lab.sim.repeats import shift_name
from tests import invariants

GPU = get_gpu("h800")
MODEL = get_model("deepseek-v3", num_layers=14)  # 3 dense layers, 11 MoE layers
BATCHES = {"decode": Batch.decode(128, kv_len=4096), "prefill": Batch.prefill(2, extend_len=4096)}
#: Schedules whose decode and prefill steps repeat from some layer on (the rest simulate every
#: layer: pp's stages are not in step, vllm-dbo's prefill names its events by a counter)
REPEATING = {
    (s, m)
    for s in ("serial", "sglang-overlap", "sbo-off", "sbo", "tbo", "tbo+sbo", "lightllm")
    + ("deepseek", "vllm-dbo")
    for m in ("decode", "prefill")
} - {("vllm-dbo", "prefill")}
REL = 1e-9


def assert_same_spans(full, fast) -> None:
    """Every span of ``full`` in ``fast``: equal but for times, which agree to ``REL``."""

    def groups(trace):
        g = defaultdict(list)
        for s in trace.spans:
            g[(s.rank, s.lane, s.op, s.kind, s.sms, s.mb, s.layer, s.step)].append((s.start, s.end))
        return {k: sorted(v) for k, v in g.items()}

    a, b = groups(full), groups(fast)
    assert a.keys() == b.keys()
    for key in a:
        assert len(a[key]) == len(b[key]), key
        for x, y in zip(a[key], b[key]):
            assert x == pytest.approx(y, rel=REL, abs=1e-9), key
    assert fast.step_time_us == pytest.approx(full.step_time_us, rel=REL)
    for r in full.ranks:  # the same tracks: no span moved onto a track of its own by round-off
        assert [(t.name, len(t.spans)) for t in fast.tracks(r)] == [
            (t.name, len(t.spans)) for t in full.tracks(r)
        ]


def _run(p, fast_forward: bool, **kw):
    return Engine(p, GPU, 0, fast_forward=fast_forward, **kw).run()


@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("name", schedules.SCHEDULES)
def test_every_schedule_gives_the_full_runs_spans(name, mode):
    par = Parallel(ep=16, pp=2) if name == "pp" else Parallel(ep=16)
    w = Workload(MODEL, BATCHES[mode], par)
    try:
        p = schedules.build(name, w, GPU)
    except ConfigError as e:
        pytest.skip(f"{name} refuses {mode}: {e}")
    full, fast = _run(p, False), _run(p, True)
    assert "fast_forward" not in full.meta
    assert_same_spans(full, fast)
    invariants.check_all(p, fast, GPU.num_sms)
    note = fast.meta["fast_forward"]
    if (name, mode) in REPEATING:
        assert " layers not simulated: layers " in note, note
    else:
        assert note.startswith("not used: "), note


@pytest.mark.parametrize(
    "name,batch",
    [("tbo", Batch.decode(3)), ("tbo", Batch.decode(16)), ("tbo+sbo", Batch.decode(16))],
)
def test_small_batches_on_a_small_model(name, batch):
    """Kernels of a few µs: a kernel and the next on its stream stay one instant apart (no
    round-off overlap across the copied periods), as the trace invariants require."""
    w = Workload(get_model("deepseek-v2-lite"), batch, Parallel(ep=8))
    p = schedules.build(name, w, GPU)
    full, fast = _run(p, False), _run(p, True)
    assert " layers not simulated" in fast.meta["fast_forward"]
    assert_same_spans(full, fast)
    invariants.check_all(p, fast, GPU.num_sms)


@pytest.mark.parametrize("name", ["tbo", "sbo", "deepseek"])
def test_explicit_ranks_reduced_and_fast_forwarded(name):
    """Balanced explicit ranks are simulated once (``shared.ir.symmetry``) and their layers
    fast-forwarded: the result is every rank's, every layer simulated."""
    w = Workload(MODEL, BATCHES["decode"], Parallel(ep=16))
    kw = dict(ranks="explicit", profile="roofline")
    full = ol.simulate(name, w, GPU, fast_forward=False, **kw)
    fast = ol.simulate(name, w, GPU, **kw)
    assert fast.trace.meta["reduction"].startswith("reduced")
    assert " layers not simulated" in fast.trace.meta["fast_forward"]
    assert_same_spans(full.trace, fast.trace)
    assert fast.metrics.iteration_us == pytest.approx(full.metrics.iteration_us, rel=REL)


def test_simultaneous_events_in_any_order(tie_shuffled):
    w = Workload(MODEL, BATCHES["decode"], Parallel(ep=16))
    p = schedules.build("tbo+sbo", w, GPU)
    full = _run(p, False)
    for seed in range(3):
        fast = _run(p, True, env=tie_shuffled(seed))
        assert " layers not simulated" in fast.meta["fast_forward"]
        assert_same_spans(full, fast)


def test_flows_in_the_network_are_not_fast_forwarded():
    """Explicit ranks with skewed routing: no two layers repeat (and no state is compared with
    flows in flight); every layer is simulated."""
    w = Workload(get_model("deepseek-v3", num_layers=6), BATCHES["decode"], Parallel(ep=8))
    r = ol.simulate("tbo", w, GPU, ranks="explicit", imbalance="zipf:1.2", profile="roofline")
    assert r.trace.meta["fast_forward"].startswith("not used: ")


def test_the_switch_and_the_result_say_what_was_done(capsys, tmp_path):
    w = Workload(MODEL, BATCHES["decode"], Parallel(ep=16))
    on, off = ol.simulate("tbo", w, GPU), ol.simulate("tbo", w, GPU, fast_forward=False)
    assert " layers not simulated: layers " in on.as_dict()["fast_forward"]
    assert "fast_forward" not in off.as_dict()
    assert on.metrics.iteration_us == pytest.approx(off.metrics.iteration_us, rel=REL)
    from overlap_lab.cli.main import main

    for flag, has in (([], True), (["--fast-forward", "false"], False)):
        args = ["sim", "--schedule", "tbo", "--layers", "14", "--ep", "16", "--json", "--out", ""]
        assert main(args + flag) == 0
        out = json.loads(capsys.readouterr().out)
        assert ("fast_forward" in out) is has
        assert out["provenance"]["inputs"]["ranks"]["fast_forward"] is has


@pytest.mark.parametrize(
    "name,d,want",
    [
        ("s0.L5.mb0.dispatch", 1, "s0.L6.mb0.dispatch"),
        ("L10.mb1.dispatch_ready", -3, "L7.mb1.dispatch_ready"),
        ("s1.L0.x", -2, "s1.L-2.x"),
        ("s1.L-2.x", 2, "s1.L0.x"),
        ("a.L3.b.L4", 1, "a.L4.b.L5"),
        ("step_done", 4, "step_done"),
        ("xL5.y", 1, "xL5.y"),  # not a token of its own
        ("a.L05", 1, "a.L05"),  # not a layer number as the schedules write one
        ("forward_done.3", 1, "forward_done.3"),
    ],
)
def test_layer_tokens_shift(name, d, want):
    assert shift_name(name, d) == want


# ----------------------------------------------------------------------------------------------
# Random Programs of repeated layers


@st.composite
def layered_programs(draw):
    """A first layer of its own, then ``n`` identical layers on up to three streams, then a last
    step: launches of random size and SM limit, events between streams (a wait reads an event
    recorded earlier in issue order, possibly a layer before), wait_streams, symmetric
    collectives (the send before its receive) and host work between layers."""
    streams = ["main", "s1", "s2"][: draw(st.integers(1, 3))]
    prios = tuple((s, -1) for s in streams[1:] if draw(st.booleans()))
    n = draw(st.integers(5, 9))
    kinds = st.sampled_from(["gemm", "grouped_gemm", "attention", "elementwise"])
    block = []  # (what, args) drawn once, stamped per layer
    for i in range(draw(st.integers(2, 7))):
        what = draw(st.sampled_from(["op", "op", "op", "event", "event", "ws", "coll", "host"]))
        if what == "op":
            block.append(
                (
                    "op",
                    draw(st.sampled_from(streams)),
                    draw(kinds),
                    draw(st.sampled_from([1e9, 3e10, 1e11, 4e12])),
                    draw(st.sampled_from([1e6, 3e7, 2e8, 6e8])),
                    draw(st.sampled_from([None, 8, 24, 66, 100])),
                )
            )
        elif what == "event":
            a, b = draw(st.sampled_from(streams)), draw(st.sampled_from(streams))
            lag = draw(st.sampled_from([0, 0, 1]))
            block.append(("event", a, b, i, lag))
        elif what == "ws":
            block.append(("ws", draw(st.sampled_from(streams)), draw(st.sampled_from(streams))))
        elif what == "coll":
            block.append(
                (
                    "coll",
                    draw(st.sampled_from(streams)),
                    draw(st.sampled_from([20, 24, 32])),
                    draw(st.sampled_from([1e5, 4e6, 3e7])),
                    draw(st.sampled_from(["nvlink", "rdma"])),
                )
            )
        else:
            block.append(("host", draw(st.sampled_from([2.0, 15.0, 300.0]))))
    rb = RankBuilder(0, tuple(streams), priorities=prios)
    th = rb.thread("main")
    for step in range(draw(st.integers(1, 3))):  # scheduler iterations, each a run of layers
        th.launch(Op("embed", layer=0, step=step, flops=1e9, hbm_bytes=1e7), "main")
        for layer in range(1, n + 1):
            at = f"s{step}.L{layer}"
            for i, b in enumerate(block):
                if b[0] == "op":
                    _, s, cls, flops, nbytes, sms = b
                    kw = dict(flops=flops, hbm_bytes=nbytes, op_class=cls, sms=sms)
                    th.launch(Op(f"op{i}", layer=layer, step=step, **kw), s)
                elif b[0] == "event":
                    _, a, s, j, lag = b
                    th.record(f"{at}.e{j}", a)
                    if layer - lag >= 1:
                        th.wait(s, f"s{step}.L{layer - lag}.e{j}")
                elif b[0] == "ws":
                    th.wait_stream(b[1], b[2])
                elif b[0] == "coll":
                    _, s, sms, nbytes, link = b
                    send = Coll(f"{at}.c{i}", "send", (Flow(link, nbytes),))
                    recv = Coll(f"{at}.c{i}", "recv")
                    th.launch(Op(f"c{i}_a", "comm", layer, step=step, sms=sms, coll=send), s)
                    th.launch(Op(f"c{i}_b", "comm", layer, step=step, sms=sms, coll=recv), s)
                else:
                    th.host("schedule", b[1], layer=layer, step=step)
        th.launch(Op("logits", step=step, flops=4e10, hbm_bytes=2e8, op_class="gemm"), "main")
        th.record(f"done.{step}", "main")
        if draw(st.booleans()):
            th.sync(f"done.{step}")
    return program([rb], world=8)


@fuzz_settings(40)
@given(layered_programs())
def test_random_repeated_layers_give_the_full_runs_spans(p):
    try:
        validate(p, GPU.num_sms)
    except ConfigError:
        assume(False)
    full, fast = _run(p, False), _run(p, True)
    assert_same_spans(full, fast)
    invariants.check_all(p, fast, GPU.num_sms)


def test_a_late_read_of_an_early_layer_keeps_that_layer_simulated():
    """The last step waits for an event of layer 3: the blocks renamed after the skip read layer
    3 of the run as it was simulated, so the skip keeps every block from layer 3 on."""
    rb = RankBuilder(0, ("main", "side"))
    th = rb.thread("main")
    for layer in range(1, 13):
        op = Op("mlp", layer=layer, flops=3e11, hbm_bytes=4e8, op_class="gemm")
        th.launch(op, "main").record(f"L{layer}.done", "main")
        th.launch(Op("side", layer=layer, flops=2e10, hbm_bytes=1e8), "side")
    th.wait("side", "L3.done").launch(Op("late", flops=1e9, hbm_bytes=1e6), "side")
    p = program([rb], world=1)
    full, fast = _run(p, False), _run(p, True)
    assert_same_spans(full, fast)
