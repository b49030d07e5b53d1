"""vllm-dbo against docs/schedules.md and upstream vLLM (ubatching.py, dp_utils.py, modular_kernel.py).

Golden files: tests/golden/vllm_dbo_*.txt; regenerate with ``UPDATE_GOLDEN=1 pytest tests/test_sched_vllm_dbo.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model
from overlap_lab.shared.ir.ops import KEY_OF, layer_ops, whole_batch
from overlap_lab.shared.ir.program import HIGH_PRIORITY, Graph, Launch, Yield, ops_of
from overlap_lab.shared.ir.validate import issue_order
from overlap_lab.shared.schedules import ScheduleConfig, build
from overlap_lab.shared.schedules.vllm_dbo import decide, is_last_ubatch_empty, split
from overlap_lab.sim import simulate
from tests.invariants import check_all

GPU = get_gpu("h100")
GOLDEN = Path(__file__).parent / "golden"
LITE = get_model("deepseek-v2-lite")

# The published order (docs/schedules.md) with its labels; subscript p is vLLM's ubatch 1 - p.
PUBLISHED = [
    "D1 send", "A0_0", "A1_0", "D1 recv", "D0 send", "MLP1", "D0 recv", "C1 send", "S1",
    "MLP0", "C1 recv", "C0 send", "S0", "A0_1", "A1_1", "C0 recv",
]  # fmt: skip
A0 = ("output", "comm_postprocess_layer", "comm_prepare_attn", "attn.prepare")
A1 = ("attn.core", "comm_prepare_mlp", "gate", "select_experts")
NAMES = {"dispatch_a": "D{} send", "dispatch_b": "D{} recv", "combine_a": "C{} send",
         "combine_b": "C{} recv", "experts": "MLP{}", "shared_experts": "S{}"}  # fmt: skip


def wl(batch, ep=8, model=LITE, **par):
    return Workload(model, batch, Parallel(ep=ep, **par))


def dbo(w, **kw):
    return build("vllm-dbo", w, GPU, ScheduleConfig(**kw))


def label(op) -> str:
    p, name = 1 - op.mb, KEY_OF.get(op.name, op.name)  # a key's parts count as the key
    if name in A0:
        return f"A0_{p}"
    if name in A1:
        return f"A1_{p}"
    return NAMES[name].format(p)


def issued_launches(p):
    rp = p.ranks[0]
    out = []
    for it in issue_order(rp):
        for ins in it.instr.body if isinstance(it.instr, Graph) else (it.instr,):
            if isinstance(ins, Launch):
                out.append((it.thread, ins))
    return out


# -- the published order and the ping-pong ------------------------------------------------------


def test_steady_state_is_the_published_order():
    w = wl(Batch.decode(64))
    p = dbo(w, cuda_graph=False)
    ops = [ins.op for _, ins in issued_launches(p)]
    layer = 5
    lo = next(i for i, o in enumerate(ops) if (o.name, o.layer, o.mb) == ("dispatch_a", layer, 0))
    hi = next(i for i, o in enumerate(ops) if (o.name, o.layer, o.mb) == ("combine_b", layer, 1))
    seq = []
    for o in ops[lo : hi + 1]:
        lab = label(o)
        if not seq or seq[-1] != lab:
            seq.append(lab)
    assert seq == PUBLISHED


def test_two_threads_one_shared_compute_stream_in_low_latency():
    p = dbo(wl(Batch.decode(64)), cuda_graph=False)
    rp = p.ranks[0]
    assert [t.name for t in rp.threads] == ["ubatch0", "ubatch1"]
    assert rp.streams == ("main",) and rp.priorities == ()  # LL kernels on the caller's stream
    for t in rp.threads:
        mbs = {ins.op.mb for ins in t.instrs if isinstance(ins, Launch) and ins.op.mb is not None}
        assert mbs <= {0, 1}


def test_yields_per_moe_layer():
    moe = LITE.num_layers - LITE.first_k_dense
    ll = dbo(wl(Batch.decode(64)), cuda_graph=False).ranks[0]
    for t in ll.threads:
        assert sum(isinstance(i, Yield) for i in t.instrs) == 2 * moe  # _prepare, _finalize
    ht = dbo(wl(Batch.prefill(2, extend_len=1024))).ranks[0]
    for t in ht.threads:
        assert sum(isinstance(i, Yield) for i in t.instrs) == 3 * moe  # to comm x2, to compute


def test_recv_hooks_run_by_the_other_thread():
    p = dbo(wl(Batch.decode(64)), cuda_graph=False)
    n = 0
    for thread, ins in issued_launches(p):
        if ins.op.name in ("dispatch_b", "combine_b"):
            n += 1
            assert thread == f"ubatch{1 - ins.op.mb}", (thread, ins.op)
    assert n == 2 * 2 * (LITE.num_layers - LITE.first_k_dense)
    # the last combine hook of ubatch 1 is run by ubatch 0 at UBatchContext.__exit__
    t0 = p.ranks[0].threads[0].instrs
    last = [i.op for i in t0 if isinstance(i, Launch) and i.op.mb is not None][-1]
    assert (last.name, last.mb, last.layer) == ("combine_b", 1, LITE.num_layers - 1)


def test_ubatch0_runs_first_and_every_op_once():
    p = dbo(wl(Batch.decode(64)), cuda_graph=False)
    first = issued_launches(p)[0]
    assert first[0] == "ubatch0" and first[1].op.name == "embed"
    names = [(o.name, o.layer, o.mb) for _, o in ops_of(p) if o.mb is not None]
    assert len(names) == len(set(names))
    per_mb = [sum(1 for n in names if n[2] == m) for m in (0, 1)]
    moe = LITE.num_layers - LITE.first_k_dense
    w = wl(Batch.decode(64))
    mb = whole_batch(w)
    dense_ops, moe_ops = (len(layer_ops(w, GPU, L, mb)) for L in (0, LITE.first_k_dense))
    # embed, the layers, and the final norm that ends each ubatch's forward
    assert per_mb == [1 + dense_ops * LITE.first_k_dense + moe_ops * moe + 1] * 2


# -- thresholds, DP agreement, padding, abort ---------------------------------------------------


@pytest.mark.parametrize("n,split_", [(31, False), (32, True)])
def test_decode_threshold_is_inclusive(n, split_):
    d = decide(wl(Batch.decode(n)), ScheduleConfig())
    assert d.ubatch is split_
    if not split_:
        assert "dbo_decode_token_threshold 32" in d.reason


@pytest.mark.parametrize("n,split_", [(511, False), (512, True)])
def test_prefill_threshold(n, split_):
    d = decide(wl(Batch.prefill(extend_lens=[n])), ScheduleConfig())
    assert d.ubatch is split_


def test_defaults_are_vllms():
    cfg = ScheduleConfig()
    assert (cfg.dbo_decode_token_threshold, cfg.dbo_prefill_token_threshold) == (32, 512)


def test_all_dp_ranks_must_agree():
    w = wl(Batch.decode(64), ep=4)
    p = dbo(w, dp_peer_tokens=(64, 16, 64))
    assert "DP rank 2 has 16 tokens" in p.meta.fallback_reason
    assert [t.name for t in p.ranks[0].threads] == ["main"]


def test_tokens_padded_to_the_max_across_ranks():
    w = wl(Batch.decode(64), ep=4)
    d = decide(w, ScheduleConfig(dp_peer_tokens=(100, 64, 80)))
    assert d.ubatch and d.padded_tokens == 100
    mb0, mb1 = split(w, d.padded_tokens)
    assert (mb0.tok_lo, mb0.tok_hi, mb0.padded_tokens) == (0, 50, 50)
    assert (mb1.tok_lo, mb1.tok_hi, mb1.padded_tokens) == (50, 64, 50)
    assert (mb0.seq_lo, mb0.seq_hi, mb1.seq_lo, mb1.seq_hi) == (0, 50, 50, 64)


def test_abort_when_a_second_micro_batch_would_be_empty():
    assert is_last_ubatch_empty(40, 80) and not is_last_ubatch_empty(41, 80)
    w = wl(Batch.decode(40), ep=2)
    p = dbo(w, dp_peer_tokens=(100,))
    assert "second micro-batch would be empty" in p.meta.fallback_reason
    # the unsplit graph-captured step is still DP-padded (synced cudagraph mode)
    assert p.meta.micro_batches[0]["padded_tokens"] == 100


def test_prefill_split_can_cut_a_sequence():
    w = wl(Batch.prefill(extend_lens=[700, 500]))
    mb0, mb1 = split(w, 1200)
    assert (mb0.tok_hi, mb0.seq_hi, mb0.split_seq) == (600, 1, True)
    assert (mb1.tok_lo, mb1.seq_lo, mb1.split_seq) == (600, 0, True)


def test_requires_dp_with_ep():
    with pytest.raises(ConfigError, match="data-parallel-size"):
        dbo(wl(Batch.decode(64), ep=1))
    with pytest.raises(ConfigError, match="data-parallel-size"):
        dbo(wl(Batch.decode(64), ep=8, attn_tp=8))


# -- streams, SMs, graphs -----------------------------------------------------------------------


def test_high_throughput_uses_the_comm_stream_and_sm_control():
    p = dbo(wl(Batch.prefill(2, extend_len=1024)))
    assert p.ranks[0].streams == ("main", "comm") and p.meta.comm_sms == 20
    # the HT kernels run on DeepEP's Buffer comm_stream (getStreamFromPool(true)); main is vLLM's
    assert p.ranks[0].priority("comm") == HIGH_PRIORITY and p.ranks[0].priority("main") == 0
    for _, ins in issued_launches(p):
        op = ins.op
        if op.name in ("dispatch_a", "combine_a"):
            assert ins.stream == "comm" and op.sms == 20
        elif op.op_class in ("gemm", "grouped_gemm") and op.mb is not None:
            assert ins.stream == "main" and op.sms == GPU.num_sms - 20
    assert dbo(wl(Batch.prefill(2, extend_len=1024)), comm_sms=8).meta.comm_sms == 8


def test_decode_replays_one_graph_from_one_thread():
    w = wl(Batch.decode(64))
    eager = [ins for _, ins in issued_launches(dbo(w, cuda_graph=False))]
    g = dbo(w)
    rp = g.ranks[0]
    assert [t.name for t in rp.threads] == ["main"]
    graphs = [i for i in rp.threads[0].instrs if isinstance(i, Graph)]
    assert len(graphs) == 1
    body = [i for i in graphs[0].body if isinstance(i, Launch)]
    assert body == [ins for ins in eager if ins.op.mb is not None]
    with pytest.raises(ConfigError, match="CUDA-graph"):
        dbo(wl(Batch.decode(64)), deepep_mode="normal", cuda_graph=True)


# -- simulation invariants and goldens ----------------------------------------------------------


@pytest.mark.parametrize(
    "batch,kw",
    [
        (Batch.decode(64), {}),
        (Batch.decode(64), {"cuda_graph": False}),
        (Batch.prefill(2, extend_len=1024), {}),
        (Batch.decode(16), {}),
    ],
)
def test_simulated_trace_invariants(batch, kw):
    p = dbo(wl(batch), **kw)
    tr = simulate(p, GPU)
    check_all(p, tr, GPU.num_sms)
    assert tr.step_time_us > 0


def test_overlap_beats_unsplit_at_large_decode():
    w = wl(Batch.decode(256, kv_len=4096), ep=16, model=get_model("deepseek-v3"))
    on = simulate(dbo(w), GPU).step_time_us
    off = simulate(dbo(w, dbo_decode_token_threshold=10**6), GPU).step_time_us
    assert on < off


@pytest.mark.parametrize(
    "case,batch,kw",
    [
        ("decode_ll", Batch.decode(64), {"cuda_graph": False}),
        ("prefill_ht", Batch.prefill(2, extend_len=1024), {}),
    ],
)
def test_golden(case, batch, kw):
    """One MoE layer of the program text (model deepseek-v2-lite)."""
    p = dbo(wl(batch), **kw)
    text = "\n".join(
        line
        for line in str(p).splitlines()
        if " layer=" not in line or " layer=3 " in line or line.startswith("meta")
    )
    path = GOLDEN / f"vllm_dbo_{case}.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text + "\n")
    assert path.exists(), f"missing golden {path}; run with UPDATE_GOLDEN=1"
    assert text + "\n" == path.read_text()
