"""GEMM precision on the CPU (real/fp8.py, the FP8 paths of real/gemm.py): which precision a run
selects and why, DeepGEMM's FP8 entry points called as its API wants them (a fake deep_gemm
asserts the preconditions: dtypes, shapes, K-major operands, MN-major TMA-aligned activation
scales, 128x128 weight scales, contiguous-layout alignment, masked counts), fallbacks labelled,
and the GPU loop predicting with the precision the run actually used."""

import dataclasses
import types

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip("this torch has no float8_e4m3fn", allow_module_level=True)

from overlap_lab.real import fp8  # noqa: E402
from overlap_lab.real import gemm as G  # noqa: E402
from overlap_lab.real import kernels as K  # noqa: E402
from overlap_lab.real.executor import precision_meta  # noqa: E402

F8 = torch.float8_e4m3fn


def _check_lhs(a, M, K):
    q, sf = a
    assert q.dtype == F8 and q.is_contiguous() and q.shape[-2:] == (M, K)
    assert K % 128 == 0
    assert sf.dtype == torch.float32 and sf.shape[-2:] == (M, K // 128)
    assert sf.stride(-2) == 1, "activation scales must be MN-major"
    assert sf.stride(-1) % 4 == 0 and sf.stride(-1) >= M, "scales' M must be TMA-aligned (4)"


def _check_rhs(b, N, K):
    q, sf = b
    assert q.dtype == F8 and q.is_contiguous() and q.shape[-2:] == (N, K)
    assert sf.dtype == torch.float32 and sf.shape[-2:] == (-(-N // 128), K // 128)


def _deq_lhs(a):
    q, sf = a
    return (q.float().unflatten(-1, (-1, 128)) * sf[..., None]).flatten(-2)


def _deq_rhs(b):
    q, sf = b
    N = q.shape[-2]
    s = sf.repeat_interleave(128, -2)[..., :N, :].repeat_interleave(128, -1)
    return q.float() * s


class FakeDeepGemm(types.ModuleType):
    """deep_gemm's FP8 API (2.x names) on the CPU: asserts what DeepGEMM requires, computes
    with the dequantised operands."""

    def __init__(self, fail: str | None = None):
        super().__init__("deep_gemm")
        self.calls: list[str] = []
        self.fail = fail

    def _enter(self, name):
        self.calls.append(name)
        if name == self.fail:
            raise RuntimeError("nvcc: JIT compilation failed")

    def get_num_sms(self):
        return 132

    def set_num_sms(self, n):
        pass

    def get_mk_alignment_for_contiguous_layout(self):
        return 128

    def fp8_gemm_nt(self, a, b, d):
        self._enter("fp8_gemm_nt")
        M, K = a[0].shape
        N = b[0].shape[0]
        _check_lhs(a, M, K)
        _check_rhs(b, N, K)
        assert d.dtype == torch.bfloat16 and d.shape == (M, N) and d.is_contiguous()
        d.copy_(_deq_lhs(a) @ _deq_rhs(b).t())

    def m_grouped_fp8_gemm_nt_masked(self, a, b, d, masked_m, expected_m):
        self._enter("m_grouped_fp8_gemm_nt_masked")
        Gn, M, K = a[0].shape
        N = b[0].shape[1]
        _check_lhs(a, M, K)
        _check_rhs(b, N, K)
        assert b[0].shape[0] == Gn and d.shape == (Gn, M, N) and d.dtype == torch.bfloat16
        assert masked_m.dtype == torch.int32 and masked_m.shape == (Gn,)
        assert isinstance(expected_m, int) and 1 <= expected_m <= M
        y = torch.bmm(_deq_lhs(a), _deq_rhs(b).transpose(1, 2))
        for g in range(Gn):
            n = int(masked_m[g])
            d[g, :n] = y[g, :n].to(d.dtype)

    def m_grouped_fp8_gemm_nt_contiguous(self, a, b, d, layout):
        self._enter("m_grouped_fp8_gemm_nt_contiguous")
        M, K = a[0].shape
        N = b[0].shape[1]
        _check_lhs(a, M, K)
        _check_rhs(b, N, K)
        assert layout.dtype == torch.int32 and layout.shape == (M,) and M % 128 == 0
        lay = layout.tolist()
        for i, e in enumerate(lay):  # every expert segment starts on the alignment
            if e >= 0 and (i == 0 or lay[i - 1] != e):
                assert i % 128 == 0, f"expert {e} starts at row {i}"
        x, w = _deq_lhs(a), _deq_rhs(b)
        for i, e in enumerate(lay):
            if e >= 0:
                d[i] = (x[i] @ w[e].t()).to(d.dtype)


@pytest.fixture
def fp8_run(monkeypatch):
    dg = FakeDeepGemm()
    monkeypatch.setattr(G, "DEEP_GEMM_ERRORS", {})
    return dg


def _budget(dg, dtype="fp8", log=None, fp8_weights=None):
    b = G.ComputeBudget(
        100,
        mechanism="deep_gemm",
        dtype=dtype,
        log=log,
        precision=fp8.resolve("fp8", cuda=True, module=dg),
        fp8_weights=fp8_weights,
    )
    b._dg = dg  # what __enter__ sets from deep_gemm_num_sms on a GPU
    return b


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_precision_is_fp8_only_where_it_can_run_and_says_why():
    full = FakeDeepGemm()
    assert fp8.resolve("bf16", cuda=True, module=full).used == "bf16"
    p = fp8.resolve("fp8", cuda=True, module=full)
    assert p.fp8 and "DeepGEMM FP8" in p.reason
    cpu = fp8.resolve("fp8", cuda=False, module=full)
    assert cpu.used == "bf16" and "CPU" in cpu.reason
    none = fp8.resolve("fp8", cuda=True, module=None)
    assert none.used == "bf16" and "not installed" in none.reason
    old = types.SimpleNamespace(fp8_gemm_nt=full.fp8_gemm_nt)  # a build without the grouped ones
    part = fp8.resolve("fp8", cuda=True, module=old)
    assert part.used == "bf16" and "m_grouped_fp8_gemm_nt_masked" in part.reason


def test_quantisation_round_trips_and_scales_have_deep_gemms_layout():
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    q, s = fp8.quant_tokens(x)
    assert q.dtype == F8 and s.shape == (5, 2)
    assert _rel(fp8.dequant((q, s)), x) < 0.05
    sf = fp8.sf_for_deep_gemm(s)
    assert sf.shape == (5, 2) and sf.stride() == (1, 8) and torch.equal(sf, s)
    w = torch.randn(200, 256, generator=torch.Generator().manual_seed(1))
    wq, ws = fp8.quant_blocks(w)
    assert ws.shape == (2, 2) and _rel(_deq_rhs((wq, ws)), w) < 0.05
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8.quant_tokens(torch.randn(2, 100))


def test_fp8_gemms_go_through_deep_gemm_as_its_api_wants(fp8_run):
    g = torch.Generator().manual_seed(2)
    b = _budget(fp8_run)
    x, w = (
        torch.randn(6, 256, generator=g).bfloat16(),
        torch.randn(384, 256, generator=g).bfloat16(),
    )
    assert _rel(b.linear(x, w), x.float() @ w.float().t()) < 0.08
    xm = torch.randn(3, 16, 256, generator=g).bfloat16()
    wm = torch.randn(3, 128, 256, generator=g).bfloat16()
    cnt = torch.tensor([5, 0, 16], dtype=torch.int32)
    y = b.grouped_masked(xm, wm, cnt, expected_m=7)
    ref = torch.bmm(xm.float(), wm.float().transpose(1, 2))
    assert _rel(y[0, :5], ref[0, :5]) < 0.08 and _rel(y[2], ref[2]) < 0.08
    xc = torch.randn(9, 256, generator=g).bfloat16()
    yc = b.grouped_contiguous(xc, wm, [4, 0, 5])
    refc = torch.cat([xc[:4].float() @ wm[0].float().t(), xc[4:].float() @ wm[2].float().t()])
    assert yc.shape == (9, 128) and _rel(yc, refc) < 0.08
    assert fp8_run.calls == [
        "fp8_gemm_nt",
        "m_grouped_fp8_gemm_nt_masked",
        "m_grouped_fp8_gemm_nt_contiguous",
    ]
    meta = precision_meta(b.applied, b.precision)
    assert meta["used"] == "fp8" and meta["fp8_gemms"] == 3 and meta["bf16_fallbacks"] == 0


def test_a_bf16_op_never_takes_the_fp8_path(fp8_run, monkeypatch):
    """The router GEMM (Op.dtype bf16) stays BF16 in an FP8 run, as the simulator models it."""
    monkeypatch.setattr(G, "matmul", lambda x, w, num_sms: x @ w.t())
    b = _budget(fp8_run, dtype="bf16")
    fp8_run.bf16_gemm_nt = None  # this build: no BF16 entry point -> the Triton kernel
    x, w = torch.randn(4, 256).bfloat16(), torch.randn(8, 256).bfloat16()
    assert torch.equal(b.linear(x, w), x @ w.t()) and fp8_run.calls == []


def test_a_failing_fp8_call_runs_bf16_and_the_run_says_so(monkeypatch):
    dg = FakeDeepGemm(fail="m_grouped_fp8_gemm_nt_masked")
    monkeypatch.setattr(G, "DEEP_GEMM_ERRORS", {})
    monkeypatch.setattr(
        G,
        "grouped_matmul_masked",
        lambda x, w, counts, num_sms: torch.bmm(x.float(), w.float().transpose(1, 2)).to(x.dtype),
    )
    b = _budget(dg)
    x, w = torch.randn(2, 8, 256).bfloat16(), torch.randn(2, 128, 256).bfloat16()
    q = fp8.quant_tokens(x)  # the activation kernel already quantised: dequantised back
    for inp in (x, q):
        y = b.grouped_masked(inp, w, torch.tensor([8, 3], dtype=torch.int32), 5)
        assert _rel(y[0], x[0].float() @ w[0].float().t()) < 0.08
    assert dg.calls == ["m_grouped_fp8_gemm_nt_masked"]  # failed once, not retried
    assert "m_grouped_fp8_gemm_nt_masked" in G.DEEP_GEMM_ERRORS
    labels = b.applied
    assert not any(k.startswith("deep_gemm.") for k in labels), labels
    meta = precision_meta(labels, b.precision)
    assert meta["used"] == "bf16" and meta["bf16_fallbacks"] == 2
    b.linear(torch.randn(4, 256).bfloat16(), torch.randn(128, 256).bfloat16())
    assert precision_meta(b.applied, b.precision)["used"] == "mixed"


def test_probe_turns_a_jit_failure_into_a_bf16_loop():
    ok = fp8.resolve("fp8", cuda=True, module=FakeDeepGemm())
    assert fp8.probe(ok, FakeDeepGemm(), "cpu").fp8
    bad = fp8.probe(ok, FakeDeepGemm(fail="m_grouped_fp8_gemm_nt_contiguous"), "cpu")
    assert bad.used == "bf16" and "probe failed" in bad.reason


def test_act_quant_hands_the_down_gemm_fp8_values_and_scales(fp8_run):
    from overlap_lab.shared.ir.program import Op

    step = K.StepState(layout=None, token_ids=None, kv={})
    gu = torch.randn(2, 4, 512).bfloat16()
    step.mbs[0] = {"expert_gate_up": gu}
    ctx = K.KernelCtx(
        op=Op("experts.act_quant", layer=1, mb=0, step=0),
        mb={"index": 0},
        step=step,
        weights=None,
        backend=None,
        deepep_mode="low_latency",
        max_dispatch_tokens=0,
        precision=fp8.resolve("fp8", cuda=True, module=fp8_run),
    )
    K.bind("experts.act_quant")(ctx)
    q, s = step.mbs[0]["expert_act"]
    assert q.dtype == F8 and s.shape == (2, 4, 2) and ctx.log.notes == {}
    g, u = gu.float().chunk(2, -1)
    assert _rel(fp8.dequant((q, s)), torch.nn.functional.silu(g) * u) < 0.05


def test_the_loop_predicts_with_the_precision_the_run_used():
    from overlap_lab.experiments import gpu_validation as GV
    from overlap_lab.real import model as M
    from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload

    mc = dataclasses.replace(M.get_model_config("tiny-mla"), gemm_dtype="fp8")
    w = Workload(mc, Batch.decode(4, kv_len=8), Parallel(ep=2))
    fp8_meta = {"gemm_precision": {"used": "fp8"}}
    assert GV.prediction_workload(w, fp8_meta).model.gemm_dtype == "fp8"
    for used in ("mixed", "bf16"):
        assert GV.prediction_workload(w, {"gemm_precision": {"used": used}}).model.gemm_dtype == (
            "bf16"
        )
    cpu = GV.loop_precision("fp8", "cpu")
    assert cpu.used == "bf16" and "CPU" in cpu.reason
