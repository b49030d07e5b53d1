"""DeepSeek's published schedule against docs/schedules.md and the profile-data description:
prefill on 108 compute + 24 communication SMs of 132 (scaled to the GPU) with two streams,
decode as the 5-stage ATTN-0 / ATTN-1 / DISPATCH / MLP / COMBINE pipeline (+SHARED) with DeepEP
low-latency hooks holding no SMs while data flies.

Golden files: ``tests/golden/deepseek_<case>.txt`` (one MoE layer's window, work numbers
stripped); regenerate with ``UPDATE_GOLDEN=1 pytest tests/test_sched_deepseek.py``.
"""

from __future__ import annotations

import pytest

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model
from overlap_lab.shared.ir.ops import DENSE_OP_NAMES, KEY_OF, MOE_OP_NAMES, attn_work
from overlap_lab.shared.ir.program import Graph, Launch, Record, Wait, iter_gpu_instrs, ops_of
from overlap_lab.shared.schedules import ScheduleConfig, build
from overlap_lab.shared.schedules.deepseek import comm_sms, split_decode, split_prefill
from tests.sched_helpers import (
    check_golden,
    check_simulated,
    collapse,
    layer_window,
    main_thread,
    moe_mid_layer,
)

H800, H100, B200 = get_gpu("h800"), get_gpu("h100"), get_gpu("b200")
V3 = get_model("deepseek-v3")
LITE = get_model("deepseek-v2-lite")


def decode_w(n=128, ep=128, model=V3, **kw):
    return Workload(model, Batch.decode(n, **kw), Parallel(ep=ep))


def prefill_w(n=4, ep=32, model=V3, extend_len=4096, **kw):
    return Workload(model, Batch.prefill(n, extend_len=extend_len, **kw), Parallel(ep=ep))


# ----------------------------------------------------------------------------------------------
# SM partition of prefill
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "gpu, comm, compute",
    [(H800, 24, 108), (H100, 24, 108), (get_gpu("h200"), 24, 108), (B200, 27, 121)],
)
def test_prefill_sm_split_scales_24_of_132(gpu, comm, compute):
    p = build("deepseek", prefill_w(), gpu)
    assert (p.meta.comm_sms, p.meta.compute_sms) == (comm, compute)
    for ins in iter_gpu_instrs(main_thread(p).instrs):
        if not isinstance(ins, Launch):
            continue
        op = ins.op
        if op.name == "get_dispatch_layout":  # DeepEP's layout kernel, on its comm stream
            assert (ins.stream, op.sms) == ("comm", compute)
        elif op.kind == "compute":  # ATTN incl. gate, MLP, SHARED (and everything else computed)
            assert (ins.stream, op.sms) == ("main", compute), op.name
        elif op.name in ("dispatch_a", "combine_a", "cached_notify"):  # grids of the Buffer's SMs
            assert (ins.stream, op.sms, op.coll.role) == ("comm", comm, "sendrecv")
        elif op.name == "notify_dispatch":  # DeepEP's own grid, 1 + the nodes, in its SMs
            assert (ins.stream, op.sms, op.ctas) == ("comm", comm, 5)
        elif op.kind == "comm":
            assert (ins.stream, op.sms) == ("comm", 0)  # the empty completion markers


def test_comm_sms_override_and_its_bounds():
    assert comm_sms(H800, ScheduleConfig(comm_sms=16)) == 16
    p = build("deepseek", prefill_w(), H800, ScheduleConfig(comm_sms=16))
    assert (p.meta.comm_sms, p.meta.compute_sms) == (16, 116)
    for bad in (0, 132):
        with pytest.raises(ConfigError, match="comm[-_]sms"):
            build("deepseek", prefill_w(), H800, ScheduleConfig(comm_sms=bad))


def test_decode_computes_on_all_sms_and_hooks_hold_none_in_flight():
    p = build("deepseek", decode_w(), H800)
    assert p.rank(0).streams == ("main",)
    assert not p.meta.reported("comm_sms")
    ops = [op for _, op in ops_of(p)]
    assert all(op.sms is None for op in ops if op.kind == "compute")
    # every send is followed (on the one stream) by computation before its receive hook
    for i, op in enumerate(ops):
        if op.name in ("dispatch_a", "combine_a"):
            assert op.coll.role == "send"
            b = op.name[:-1] + "b"
            j = next(k for k in range(i + 1, len(ops)) if (ops[k].name, ops[k].mb) == (b, op.mb))
            assert ops[j].layer == op.layer and ops[j].coll.role == "recv"
            assert any(o.kind == "compute" for o in ops[i + 1 : j])
    graphs = [i for i in main_thread(p).instrs if isinstance(i, Graph)]
    assert len(graphs) == 1 and p.meta.cuda_graph is True


# ----------------------------------------------------------------------------------------------
# Decode: the 5-stage pipeline
# ----------------------------------------------------------------------------------------------

ATTN_0 = ["comm_prepare_attn", "attn.prepare"]
ATTN_1 = ["attn.core", "comm_prepare_mlp", "gate", "select_experts"]
DECODE_WINDOW = (
    [(0, 0, n) for n in ATTN_0]  # ATTN-0 of 0 (its combine hook closed the previous window)
    + [(1, -1, "dispatch_b"), (1, -1, "experts"), (1, -1, "combine_a")]  # MLP of 1, layer L-1
    + [(0, 0, n) for n in ATTN_1]  # ATTN-1 of 0 (COMBINE 1 flies)
    + [(0, 0, "dispatch_a")]  # DISPATCH 0 send
    + [(0, 0, "shared_experts")]  # SHARED 0 ...
    + [(1, -1, "combine_b"), (1, -1, "output"), (1, -1, "comm_postprocess_layer")]
    + [(1, 0, n) for n in ATTN_0]  # ... + ATTN-0 of 1 (DISPATCH 0 flies)
    + [(0, 0, "dispatch_b"), (0, 0, "experts"), (0, 0, "combine_a")]  # MLP of 0
    + [(1, 0, n) for n in ATTN_1]  # ATTN-1 of 1 (COMBINE 0 flies)
    + [(1, 0, "dispatch_a"), (1, 0, "shared_experts")]  # DISPATCH 1 send, SHARED 1
    + [(0, 0, "combine_b"), (0, 0, "output"), (0, 0, "comm_postprocess_layer")]  # next ATTN-0
)


def test_decode_window_is_the_published_pipeline():
    p = build("deepseek", decode_w(), H800)
    L = moe_mid_layer(V3)
    got = collapse([(op.mb, op.layer - L, op.name) for _, op in layer_window(p, L)])
    assert got == DECODE_WINDOW


def test_decode_mb1_mlp_lags_into_the_next_layer_window():
    """Micro-batch 1's MLP of layer L runs after micro-batch 0's ATTN-0 of layer L+1: the
    pipeline offsets the two micro-batches by half a layer."""
    p = build("deepseek", decode_w(), H800)
    seq = collapse([(op.mb, op.layer, op.name) for _, op in ops_of(p)])
    for L in range(V3.first_k_dense, V3.num_layers - 1):
        assert seq.index((0, L + 1, "attn.prepare")) < seq.index((1, L, "experts"))
        assert seq.index((1, L, "experts")) < seq.index((0, L + 1, "attn.core"))
    last = V3.num_layers - 1
    i = seq.index((1, last, "dispatch_b"))  # the drain: 0's tail, 1's MLP, 0's logits, 1's tail
    assert seq[i - 3 : i + 8] == [
        (0, last, "combine_b"),
        (0, last, "output"),
        (0, last, "comm_postprocess_layer"),
        (1, last, "dispatch_b"),
        (1, last, "experts"),
        (1, last, "combine_a"),
        (0, None, "logits"),  # in 0's ATTN-1 slot: COMBINE 1 flies under it
        (1, last, "combine_b"),
        (1, last, "output"),
        (1, last, "comm_postprocess_layer"),
        (1, None, "logits"),
    ]


@pytest.mark.parametrize(
    "kv, want",
    [
        ((4096,) * 128, 64),
        ((4096,) * 5, 2),  # tie: the earlier boundary (floor(n/2))
        ((8000, 100, 100, 100, 7000), 1),  # balanced KV tokens, not request counts
    ],
)
def test_decode_split_balances_kv_tokens(kv, want):
    mbs = split_decode(Batch.decode(kv_lens=kv))
    assert mbs[0].seq_hi == want == mbs[1].seq_lo
    assert all(mb.padded_tokens == mb.tokens for mb in mbs)


def test_decode_single_request_runs_unsplit_with_reason():
    p = build("deepseek", decode_w(1, ep=8, model=LITE), H800)
    assert len(p.meta.micro_batches) == 1
    assert "cannot be split" in p.meta.fallback_reason


# ----------------------------------------------------------------------------------------------
# Prefill: streams, events and the four overlap windows
# ----------------------------------------------------------------------------------------------

ATTN = ATTN_0 + ATTN_1


def _key(ins, L):
    if isinstance(ins, Launch):
        return (ins.stream, ins.op.mb, ins.op.layer - L, ins.op.name)
    return (type(ins).__name__.lower(), getattr(ins, "stream", None), ins.event)


def test_prefill_window_streams_and_events():
    p = build("deepseek", prefill_w(), H800)
    L = moe_mid_layer(V3)
    got = collapse([_key(i, L) for i in layer_window(p, L, instrs=True)])
    e = lambda mb, what: f"L{L}.mb{mb}.{what}"  # noqa: E731

    def counts(mb):  # the host waits for DeepEP's received-token counts (shared.ir.lowering)
        ev = f"s0.L{L}.mb{mb}.dispatch.counts"
        return [("record", "comm", ev), ("sync", None, ev)]

    want = (
        [("main", 0, 0, n) for n in ATTN]  # ATTN 0
        + [("record", "main", e(0, "dispatch_ready")), ("wait", "comm", e(0, "dispatch_ready"))]
        + [("comm", 0, 0, "dispatch_a")]  # get_dispatch_layout, notify_dispatch
        + counts(0)
        + [("comm", 0, 0, "dispatch_a"), ("comm", 0, 0, "dispatch_b")]  # DISPATCH 0 (24 SMs)
        + [("record", "comm", e(0, "dispatch_done"))]
        + [("wait", "main", f"L{L - 1}.mb1.combine_done")]  # 1's previous COMBINE, then its tail
        + [("main", 1, -1, "output"), ("main", 1, -1, "comm_postprocess_layer")]
        + [("main", 1, 0, n) for n in ATTN]  # ATTN 1 (DISPATCH 0 under it)
        + [("record", "main", e(1, "dispatch_ready")), ("wait", "comm", e(1, "dispatch_ready"))]
        + [("comm", 1, 0, "dispatch_a")]
        + counts(1)
        + [("comm", 1, 0, "dispatch_a"), ("comm", 1, 0, "dispatch_b")]
        + [("record", "comm", e(1, "dispatch_done"))]
        + [("wait", "main", e(0, "dispatch_done")), ("main", 0, 0, "experts")]  # MLP 0
        + [("record", "main", e(0, "combine_ready")), ("wait", "comm", e(0, "combine_ready"))]
        + [("comm", 0, 0, "combine_a"), ("comm", 0, 0, "combine_b")]
        + [("record", "comm", e(0, "combine_done"))]
        + [("wait", "main", e(1, "dispatch_done")), ("main", 1, 0, "experts")]  # MLP 1
        + [("record", "main", e(1, "combine_ready")), ("wait", "comm", e(1, "combine_ready"))]
        + [("comm", 1, 0, "combine_a"), ("comm", 1, 0, "combine_b")]
        + [("record", "comm", e(1, "combine_done"))]
        + [("main", 0, 0, "shared_experts"), ("main", 1, 0, "shared_experts")]  # SHARED 0, 1
        + [("wait", "main", e(0, "combine_done"))]  # 0's tail right before its next ATTN
        + [("main", 0, 0, "output"), ("main", 0, 0, "comm_postprocess_layer")]
    )
    assert got == want
    assert p.rank(0).streams == ("main", "comm")
    assert not any(isinstance(i, Graph) for i in main_thread(p).instrs)


def _brute_cut(batch):
    offs = batch.token_offsets()
    pairs = lambda lo, hi: attn_work(batch, lo, hi).pairs  # noqa: E731
    n = offs[-1]
    return min(range(1, n), key=lambda t: (abs(pairs(0, t) - pairs(t, n)), t))


@pytest.mark.parametrize(
    "lens, prefixes",
    [
        ((4096,) * 4, (0,) * 4),  # the profile: two prompts each, no cut
        ((4096,) * 3, (0,) * 3),  # odd count: the middle prompt is cut
        ((1000,), (0,)),  # one prompt: cut inside, later piece attends over the earlier
        ((300, 50, 700), (0, 900, 20)),
        ((5, 1), (0, 0)),
    ],
)
def test_prefill_split_balances_attention_pairs(lens, prefixes):
    batch = Batch.prefill(extend_lens=lens, prefix_lens=prefixes)
    mb0, mb1 = split_prefill(batch)
    assert mb0.tok_hi == mb1.tok_lo == _brute_cut(batch)
    offs = batch.token_offsets()
    cut = mb0.tok_hi not in offs
    assert mb0.split_seq == mb1.split_seq == cut
    assert (mb0.seq_hi - 1 == mb1.seq_lo) if cut else (mb0.seq_hi == mb1.seq_lo)
    assert mb0.padded_tokens == mb0.tokens and mb1.padded_tokens == mb1.tokens


def test_prefill_three_prompts_cut_the_middle_one_unevenly_in_tokens():
    mb0, mb1 = split_prefill(Batch.prefill(3, extend_len=4096))
    assert mb0.split_seq and mb0.seq_hi == 2 and mb1.seq_lo == 1
    # the second piece of the cut prompt attends over the first: balance needs fewer tokens there
    assert mb0.tokens > 6144 > mb1.tokens


def test_prefill_one_token_runs_unsplit_with_reason():
    w = Workload(LITE, Batch.prefill(1, extend_len=1), Parallel(ep=8))
    p = build("deepseek", w, H800)
    assert len(p.meta.micro_batches) == 1 and "cannot be split" in p.meta.fallback_reason
    check_simulated(p, H800)


# ----------------------------------------------------------------------------------------------
# Counts, refusals, goldens, simulation
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "w", [decode_w(6, ep=8, model=LITE), prefill_w(3, ep=8, model=LITE, extend_len=64)]
)
def test_every_op_of_every_layer_once_per_micro_batch(w):
    p = build("deepseek", w, H800)
    counts: dict = {}
    for _, op in ops_of(p):
        counts[(op.mb, op.layer, op.name)] = counts.get((op.mb, op.layer, op.name), 0) + 1
    assert set(counts.values()) == {1}
    for mb in (0, 1):
        for L in range(w.model.num_layers):
            names = MOE_OP_NAMES if w.model.is_moe_layer(L) else DENSE_OP_NAMES
            got = {KEY_OF.get(n, n) for (m, layer, n) in counts if m == mb and layer == L}
            assert got == set(names)


def test_events_recorded_once_and_waited_after_record():
    p = build("deepseek", prefill_w(), H800)
    recorded = set()
    for ins in iter_gpu_instrs(main_thread(p).instrs):
        if isinstance(ins, Record):
            assert ins.event not in recorded
            recorded.add(ins.event)
        elif isinstance(ins, Wait):
            assert ins.event in recorded


def test_explicit_deepep_mode_other_than_the_systems_is_refused():
    with pytest.raises(ConfigError, match="deepseek runs DeepEP low_latency"):
        build("deepseek", decode_w(), H800, ScheduleConfig(deepep_mode="normal"))
    with pytest.raises(ConfigError, match="deepseek runs DeepEP normal"):
        build("deepseek", prefill_w(), H800, ScheduleConfig(deepep_mode="low_latency"))


@pytest.mark.parametrize("case", ["decode", "prefill"])
def test_golden_one_layer(case):
    w = decode_w() if case == "decode" else prefill_w()
    check_golden(f"deepseek_{case}", build("deepseek", w, H800), moe_mid_layer(V3))


@pytest.mark.parametrize(
    "w, gpu",
    [
        (decode_w(6, ep=8, model=LITE), H800),
        (decode_w(1, ep=8, model=LITE), H800),
        (prefill_w(3, ep=8, model=LITE, extend_len=256), H800),
        (decode_w(128, ep=128), H800),
        (prefill_w(4, ep=32), H800),
        (prefill_w(2, ep=16, extend_len=2048), B200),
    ],
    ids=[
        "lite-decode",
        "lite-decode-1",
        "lite-prefill",
        "v3-decode",
        "v3-prefill",
        "v3-prefill-b200",
    ],
)
def test_simulated_trace_invariants(w, gpu):
    check_simulated(build("deepseek", w, gpu), gpu)


def test_simulated_prefill_comm_never_takes_compute_sms():
    """With the static partition, compute kernels never hold more than 108 SMs and the comm
    kernel always gets its 24 the moment it may start."""
    p = build("deepseek", prefill_w(2, ep=16, extend_len=1024), H800)
    tr = check_simulated(p, H800)
    for s in tr.spans:
        if s.lane == "stream:main" and s.kind == "compute":
            assert s.sms <= 108
        if s.lane == "stream:comm" and s.op in ("dispatch_a", "combine_a"):
            assert s.sms == 24


@pytest.mark.parametrize("name", ["deepseek", "lightllm"])
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_program_text_round_trips(name, mode):
    from overlap_lab.shared.ir.program import parse, to_text

    w = decode_w(6, ep=8, model=LITE) if mode == "decode" else prefill_w(3, ep=8, model=LITE)
    p = build(name, w, H800)
    assert parse(to_text(p)) == p


def test_listed_with_upstream_and_summary():
    from overlap_lab.shared.schedules import describe

    rows = {name: (upstream, summary) for name, upstream, summary in describe()}
    assert "profile-data" in rows["deepseek"][0] and "lightllm/" in rows["lightllm"][0]
    assert "108" in rows["deepseek"][1] and "LL" in rows["lightllm"][1]
