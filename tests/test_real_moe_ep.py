"""LightLLM's expert kernels (real/moe_ep.py, the experts.* ops of real/kernels/moe.py) each do their
own part, and together compute what the unsplit experts op computes."""

import pytest

torch = pytest.importorskip("torch")

from overlap_lab.real import kernels as K  # noqa: E402
from overlap_lab.real import model as M  # noqa: E402
from overlap_lab.real.check import compare_steps, default_workloads  # noqa: E402
from overlap_lab.real.comm.base import DispatchResult  # noqa: E402
from overlap_lab.real.executor import execute  # noqa: E402
from overlap_lab.real.kernels.placeholders import FOLDED_OPS  # noqa: E402
from overlap_lab.real.moe_ep import ep_gather, ep_scatter, silu_and_mul  # noqa: E402
from overlap_lab.real.runlog import RunLog  # noqa: E402
from overlap_lab.shared import schedules as S  # noqa: E402
from overlap_lab.shared.inputs.hardware import get_gpu  # noqa: E402
from overlap_lab.shared.ir.program import Op, ops_of  # noqa: E402

GPU = get_gpu("h100")


@pytest.fixture(scope="module")
def tiny():
    cfg = M.get_config("tiny-mla")
    return cfg, M.init_weights(cfg, seed=5)


def _received(cfg, M_rows=11, seed=0):
    """A normal-layout receive: rows, local expert ids (-1: elsewhere), weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M_rows, cfg.hidden, generator=g)
    idx = torch.randint(-1, cfg.num_experts, (M_rows, cfg.top_k), generator=g)
    idx[3] = -1  # a row with no local expert
    w = torch.rand(M_rows, cfg.top_k, generator=g)
    return x, idx, w


def test_scatter_puts_each_local_slot_in_its_experts_rows(tiny):
    cfg, _ = tiny
    x, idx, _ = _received(cfg)
    sc = ep_scatter(x, idx, cfg.num_experts)
    assert sc.counts == [int((idx == e).sum()) for e in range(cfg.num_experts)]
    assert sc.rows.shape == (int((idx >= 0).sum()), cfg.hidden)
    for i in range(idx.shape[0]):
        for j in range(idx.shape[1]):
            e, r = int(idx[i, j]), int(sc.output_index[i, j])
            if e < 0:
                assert r == -1
                continue
            lo = sum(sc.counts[:e])
            assert lo <= r < lo + sc.counts[e] and int(sc.m_indices[r]) == e
            assert torch.equal(sc.rows[r], x[i])
    # rows of one expert keep token order (deterministic, unlike an atomic counter)
    for e in range(cfg.num_experts):
        lo = sum(sc.counts[:e])
        mine = sc.output_index[idx == e]
        assert mine.tolist() == list(range(lo, lo + sc.counts[e]))


def test_split_kernels_equal_the_unsplit_experts_path(tiny):
    cfg, w = tiny
    lw = w.layers[1]
    x, idx, wt = _received(cfg)
    ref = M.experts_weighted(x, idx, wt, lw["w13"], lw["w2"])
    sc = ep_scatter(x, idx, cfg.num_experts)
    gu = M.grouped_gemm_contiguous(sc.rows, lw["w13"], sc.counts)
    assert gu.shape[-1] == 2 * cfg.expert_inter  # the gate-up GEMM only: no activation in it
    y = M.grouped_gemm_contiguous(silu_and_mul(gu), lw["w2"], sc.counts)
    out = ep_gather(y, sc.output_index, wt, x.dtype)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[3], torch.zeros(cfg.hidden))


def _ctx(w, name, launched, state, piece=(0, 1), log=None):
    op = Op(name, layer=1, mb=0, step=0)
    step = K.StepState(layout=None, token_ids=None, kv={})
    step.mbs[0] = state
    ops = frozenset((n, 0, 1, 0) for n in launched)
    return K.KernelCtx(
        op=op,
        mb={"index": 0, "tok_lo": 0, "tok_hi": 0, "padded_tokens": 0},
        step=step,
        weights=w,
        backend=None,
        deepep_mode="normal",
        max_dispatch_tokens=0,
        program_ops=ops,
        piece=piece,
        piece_counts={("experts.down", 0, 1, 0): piece[1]},
        log=log if log is not None else RunLog(),
    )


LIGHTLLM_PREFILL = (
    "experts.scatter",
    "experts.gate_up",
    "experts.act_quant",
    "experts.down.0",
    "experts.gather",
)


def test_lightllm_prefill_ops_in_sequence_equal_the_experts_op(tiny):
    cfg, w = tiny
    x, idx, wt = _received(cfg, seed=1)
    recv = {"ll": False, "res": DispatchResult(x, idx, wt, None, None)}
    log = RunLog()
    whole = {"recv": recv}
    K.bind("experts")(_ctx(w, "experts", ["experts"], whole))
    state = {"recv": recv}
    for name in LIGHTLLM_PREFILL:
        K.bind(name)(_ctx(w, name, LIGHTLLM_PREFILL, state, log=log))
        if name == "experts.gate_up":  # the GEMM's raw output, activated by the next op
            assert state["expert_gate_up"].shape[-1] == 2 * cfg.expert_inter
            assert "expert_act" not in state
    assert torch.allclose(state["expert_out"], whole["expert_out"], rtol=1e-5, atol=1e-6)
    # the activation ran; the quantisation (BF16 GEMMs) is reported, not silently skipped
    assert list(log.notes) == ["experts.act_quant"]
    assert log.notes["experts.act_quant"].startswith(
        "quantisation not run: the expert GEMMs run in BF16"
    )


def test_gate_up_activates_when_the_program_has_no_activation_op(tiny):
    """SBO's gate-up + down slices: the activation stays in the gate-up op."""
    cfg, w = tiny
    x, idx, wt = _received(cfg, seed=2)
    recv = {"ll": False, "res": DispatchResult(x, idx, wt, None, None)}
    launched = ("experts.scatter", "experts.gate_up", "experts.down.0", "experts.gather")
    state = {"recv": recv}
    for name in launched:
        K.bind(name)(_ctx(w, name, launched, state))
    assert "expert_gate_up" not in state
    assert state["expert_act"].shape[-1] == cfg.expert_inter
    ref = M.experts_weighted(x, idx, wt, w.layers[1]["w13"], w.layers[1]["w2"])
    assert torch.allclose(state["expert_out"], ref, rtol=1e-5, atol=1e-6)


def test_lightllm_runs_every_expert_kernel_and_reports_what_it_did_not_do():
    """Through the executor: prefill launches all five kernels (each doing its work: the
    numbers equal serial's), decode the masked three; the only note is the BF16 quant."""
    for w in default_workloads()[2:3] + default_workloads()[:1]:
        prog = S.build("lightllm", w, GPU)
        names = {K.split_piece(op.name)[0] for _, op in ops_of(prog)}
        expect = {"experts.gate_up", "experts.act_quant", "experts.down"}
        if w.batch.mode == "prefill":
            expect |= {"experts.scatter", "experts.gather"}
        assert expect <= names and "experts" not in names
        res = execute(prog, w)
        ref = execute(S.build("serial", w, GPU), w)
        diff = compare_steps(res.outputs[0], ref.outputs[0][0])
        assert diff < 1e-4, (w.batch.mode, diff)
        notes = res.trace.meta["kernel_notes"]
        notes = {k: v for k, v in notes.items() if k not in FOLDED_OPS}  # computed elsewhere
        assert list(notes) == ["experts.act_quant"] and "BF16" in notes["experts.act_quant"]


def test_sbo_signal_polling_combine_is_reported_as_not_overlapping():
    """SBO mode 1's combine polls the down GEMM's block signals on the GPU; the executor launches
    it after the last signal instead, and the run says so rather than measuring it as SBO."""
    from overlap_lab.shared.schedules import ScheduleConfig

    w = default_workloads()[0]  # decode: DeepEP's low-latency combine, SBO's case
    prog = S.build("sbo", w, GPU, ScheduleConfig(sbo_mode=1))
    assert any(op.waits for _, op in ops_of(prog))
    notes = execute(prog, w).trace.meta["kernel_notes"]
    assert "no down-GEMM/combine overlap" in notes.get("combine_a", "")
