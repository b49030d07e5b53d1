"""real/fp8.py's fused activation quantisation (one Triton kernel per token and 128-column group,
as SGLang's per_token_group_quant_fp8) against the torch reference, under Triton's CPU
interpreter in a child process (TRITON_INTERPRET=1 must be set before ``import triton``); the
weights quantised once at load, never inside a step (a counting fake of the block quantiser)."""

import json

import pytest

from tests.triton_interp import interpreted

torch = pytest.importorskip("torch")

# fp8._fused_here tested directly: when the fused Triton quantisation is taken
from overlap_lab.real import fp8  # noqa: E402

F8 = getattr(torch, "float8_e4m3fn", None)
pytestmark = pytest.mark.skipif(F8 is None, reason="torch without float8_e4m3fn")


def _check_against_torch(x: torch.Tensor) -> None:
    q, s = fp8.quant_tokens(x)  # the fused kernel here (interpreter)
    qr, sr = fp8.quant_tokens_torch(x)
    assert q.dtype == F8 and q.shape == x.shape and s.dtype == torch.float32
    assert s.shape == sr.shape == (*x.shape[:-1], x.shape[-1] // 128)
    assert torch.equal(s, sr), "scales must be bit-exact: amax / 448 per group"
    # the values before the cast are torch's; the cast itself is the interpreter's (which rounds
    # without carrying into the exponent: on a GPU the hardware's RNE, see test_real_gpu.py)
    K = x.shape[-1]
    y = (x.float().reshape(*x.shape[:-1], K // 128, 128) / sr[..., None]).clamp(-448, 448)
    assert torch.equal(q.view(torch.uint8), _interp_cast(y.reshape(x.shape)).view(torch.uint8))
    # DeepGEMM's layout as written: MN-major, M padded to 4, handed over without a copy
    M, kg = s.shape[-2:]
    pad = -(-M // 4) * 4
    assert s.stride()[-2:] == (1, pad), s.stride()
    assert fp8.sf_for_deep_gemm(s).data_ptr() == s.data_ptr()
    assert torch.equal(fp8.sf_for_deep_gemm(s), fp8.sf_for_deep_gemm(sr))


def _interp_quant_matches_torch() -> None:
    from overlap_lab.real.deps import interpreting

    assert interpreting() and fp8._fused_here(torch.zeros(1))
    g = torch.Generator().manual_seed(0)
    for shape in [(1, 128), (5, 256), (8, 384), (3, 6, 256)]:
        for dtype in (torch.float32, torch.float16):
            x = (torch.randn(*shape, generator=g) * 3).to(dtype)
            x[..., :128].view(-1, 128)[0] = 0  # an all-zero group: the smallest scale
            x.view(-1)[-1] = 900.0  # an outlier: its group's scale
            _check_against_torch(x)
    x = torch.randn(7, 512, generator=g)[:, ::2]  # rows strided (a view)
    _check_against_torch(x)


def _interp_act_quant_kernel_runs_fused() -> None:
    """The LightLLM act_quant op quantises through the fused kernel on the run's FP8 path."""
    calls = []
    real = fp8.quant_tokens_fused

    def counting(x):
        calls.append(tuple(x.shape))
        return real(x)

    fp8.quant_tokens_fused = counting
    try:
        q, s = fp8.quant_tokens(torch.randn(2, 4, 256))
    finally:
        fp8.quant_tokens_fused = real
    assert calls == [(2, 4, 256)] and s.shape == (2, 4, 2)


@pytest.fixture(scope="module")
def interpreter_results():
    return interpreted(__file__)


@pytest.mark.parametrize("check", ["quant_matches_torch", "act_quant_kernel_runs_fused"])
def test_fused_quantisation_under_the_interpreter(interpreter_results, check):
    assert interpreter_results[check] == "ok", interpreter_results[check]


def test_the_cpu_without_the_interpreter_takes_the_torch_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(fp8, "quant_tokens_fused", lambda x: pytest.fail("fused on the CPU"))
    q, s = fp8.quant_tokens(torch.randn(3, 256))
    assert q.dtype == F8 and s.shape == (3, 2)


# -- weights: quantised once, at load ------------------------------------------------------------


@pytest.fixture
def counted_blocks(monkeypatch):
    calls = []
    real = fp8.quant_blocks

    def counting(w):
        calls.append(tuple(w.shape))
        return real(w)

    monkeypatch.setattr(fp8, "quant_blocks", counting)
    return calls


def _fp8_weights(hidden=128, inter=128, experts=4):
    g = torch.Generator().manual_seed(0)
    return {
        "w13": torch.randn(experts, 2 * inter, hidden, generator=g).bfloat16(),
        "w2": torch.randn(experts, hidden, inter, generator=g).bfloat16(),
        "shared_w13": torch.randn(2 * inter, hidden, generator=g).bfloat16(),
        "shared_w2": torch.randn(hidden, inter, generator=g).bfloat16(),
    }


def test_gemms_after_load_never_quantise_a_weight(counted_blocks):
    from test_real_fp8 import FakeDeepGemm  # the fake asserting DeepGEMM's preconditions

    from overlap_lab.real import gemm as G

    lw = _fp8_weights()
    weights = type("W", (), {"layers": {1: lw}})()
    cache = fp8.load_weights(weights)
    assert len(counted_blocks) == 4  # every FP8 GEMM weight, once
    dg = FakeDeepGemm()
    b = G.ComputeBudget(
        100, mechanism="deep_gemm", dtype="fp8", fp8_weights=cache,
        precision=fp8.resolve("fp8", cuda=True, module=dg),
    )  # fmt: skip
    b._dg = dg
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 128, generator=g).bfloat16()
    xm = torch.randn(4, 8, 128, generator=g).bfloat16()
    cnt = torch.tensor([8, 0, 3, 5], dtype=torch.int32)
    for _ in range(2):  # two steps
        b.linear(x, lw["shared_w13"])
        b.grouped_masked(xm, lw["w13"], cnt, 4)
        b.grouped_masked(xm[1:3], lw["w2"][1:3], cnt[1:3], 4)  # SBO's slice of experts
        b.linear(x, lw["w2"][2])  # one expert of a loop
        b.grouped_contiguous(x, lw["w13"], [2, 0, 4, 0])
    assert len(counted_blocks) == 4 and cache.late == 0
    assert dg.calls.count("m_grouped_fp8_gemm_nt_masked") == 4
    # the slice is the slice of the loaded quantisation (blocks never straddle experts)
    q, s = cache.get(lw["w2"][1:3])
    qa, sa = cache.get(lw["w2"])
    assert torch.equal(q.float(), qa[1:3].float()) and torch.equal(s, sa[1:3])
    cache.get(torch.randn(128, 128).bfloat16())  # a weight the load missed: counted
    assert cache.late == 1


def test_the_executor_quantises_fp8_weights_at_setup_only(counted_blocks, monkeypatch):
    from overlap_lab.real import executor as X
    from overlap_lab.real import model as M
    from overlap_lab.real.check import default_workloads
    from overlap_lab.shared import schedules as S
    from overlap_lab.shared.inputs.hardware import get_gpu

    w = default_workloads()[0]
    prog = S.build("serial", w, get_gpu("h100"))
    weights = M.init_weights(M.from_model_config(w.model), seed=0)
    monkeypatch.setattr(  # this run resolved FP8 (the CPU's GEMMs stay torch: mechanism none)
        fp8, "resolve", lambda *a, **k: fp8.Precision("fp8", "fp8", "test")
    )
    n = sum(k in lw for lw in weights.layers.values() for k in fp8.GEMM_WEIGHTS)
    for lw in weights.layers.values():  # tiny-mla's K of 64 cannot quantise: widened to 128
        for k in fp8.GEMM_WEIGHTS:
            if k in lw:
                lw[k] = torch.nn.functional.pad(lw[k], (0, 128 - lw[k].shape[-1] % 128))
    su = X.setup(
        prog, w, weights=weights, backend=None, device="cpu", dtype=None, seed=0,
        check_hazards=None, ranks=None, host_spin=False, cuda_graphs=True,
    )  # fmt: skip
    assert su.precision.fp8 and len(counted_blocks) == n
    cache = su.runners[0].fp8_weights
    assert cache is not None and all(r.fp8_weights is cache for r in su.runners)
    monkeypatch.setattr(fp8, "resolve", lambda *a, **k: fp8.BF16)
    su16 = X.setup(
        prog, w, weights=weights, backend=None, device="cpu", dtype=None, seed=0,
        check_hazards=None, ranks=None, host_spin=False, cuda_graphs=True,
    )  # fmt: skip
    assert su16.runners[0].fp8_weights is None and len(counted_blocks) == n  # BF16: none


if __name__ == "__main__":  # the interpreter child (see interpreter_results)
    import triton
    import triton.language as tl

    @triton.jit
    def _cast_fp8(y, q, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(q + i, tl.load(y + i, mask=i < n).to(q.dtype.element_ty), mask=i < n)

    def _interp_cast(y: torch.Tensor) -> torch.Tensor:
        """FP32 -> e4m3 by the interpreter's own conversion."""
        y = y.contiguous()
        q = torch.empty(y.shape, dtype=F8)
        _cast_fp8[(-(-y.numel() // 128),)](y, q, y.numel(), BLOCK=128)
        return q

    checks = {
        "quant_matches_torch": _interp_quant_matches_torch,
        "act_quant_kernel_runs_fused": _interp_act_quant_kernel_runs_fused,
    }
    out = {}
    for name, fn in checks.items():
        try:
            fn()
            out[name] = "ok"
        except Exception as e:  # reported per check in the parent
            import traceback

            out[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
    print(json.dumps(out))
