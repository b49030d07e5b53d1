"""real/gemm.py: SM-budgeted GEMMs. The Triton kernels run under Triton's CPU interpreter in a
subprocess: TRITON_INTERPRET=1 must be set before ``import triton`` (triton.language's own
helpers, tl.cdiv for one, are @jit functions decorated at import), so one child process with the
variable set runs every ``_interp_*`` check below. The mechanism choice and DeepGEMM's scoped
set_num_sms (with a fake module) are pure. bf16 does not survive the interpreter (even a copy),
so numerics use fp32 and fp16; bf16 is checked on a GPU (tests/test_real_gpu.py)."""

import sys
import types

import pytest

from tests.triton_interp import interpreted, report

torch = pytest.importorskip("torch")

from overlap_lab.real import gemm as G  # noqa: E402
from overlap_lab.real import model as M  # noqa: E402

BLOCKS = (16, 16, 16)  # tl.dot's smallest tile: keeps the interpreter fast
TOL = {torch.float32: 1e-4, torch.float16: 2e-2}


@pytest.fixture(scope="module")
def interpreter_results():
    return interpreted(__file__)


@pytest.mark.parametrize(
    "check",
    [
        "gemms_fp32",
        "gemms_fp16",
        "model_experts_through_a_limited_budget",
        "sbo_signalled_down_gemm_then_polling_combine",
        "sbo_combine_without_signal_sends_stale_blocks",
        "sbo_mode1_executor_polls_the_signal",
    ],
)
def test_triton_kernels_under_the_interpreter(interpreter_results, check):
    assert interpreter_results[check] == "ok", interpreter_results[check]


def _close(a, b, dtype):
    return (a.float() - b.float()).abs().max().item() <= TOL[dtype] * max(1.0, b.abs().max())


def _interp_gemms(dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(37, 48, generator=g).to(dtype)
    w = torch.randn(40, 48, generator=g).to(dtype)
    ref = a.float() @ w.float().t()
    for sms in (1, 3, 64):  # fewer programs than tiles (persistent loop), and more
        assert _close(G.matmul(a, w, num_sms=sms, blocks=BLOCKS), ref, dtype)

    # masked (DeepEP low-latency layout): counts on the device; rows past a count unwritten
    x = torch.randn(3, 20, 48, generator=g).to(dtype)
    we = torch.randn(3, 24, 48, generator=g).to(dtype)
    cnt = torch.tensor([5, 0, 20], dtype=torch.int32)
    out = torch.full((3, 20, 24), 7.0, dtype=dtype)
    y = G.grouped_matmul_masked(x, we, cnt, num_sms=2, out=out, blocks=BLOCKS)
    ref = torch.bmm(x.float(), we.float().transpose(1, 2))
    assert _close(y[0, :5], ref[0, :5], dtype) and _close(y[2], ref[2], dtype)
    assert (y[0, 5:] == 7).all() and (y[1] == 7).all()

    # SBO's signalled down GEMM: same output; each (e, b) with rows counted once per N tile
    sig = torch.zeros(*G.signal_shape(3, 20, BLOCKS), dtype=torch.int32)
    for sms in (1, 2, 64):
        sig.zero_()
        out2 = torch.full((3, 20, 24), 7.0, dtype=dtype)
        y2 = G.grouped_matmul_masked(x, we, cnt, num_sms=sms, out=out2, blocks=BLOCKS, signal=sig)
        assert torch.equal(y2, y)
        thr = G.signal_threshold(24, BLOCKS)
        assert thr == 2 and sig.shape == (3, 2)  # 20 rows / BM 16; 24 cols / BN 16
        assert sig.tolist() == [[thr, 0], [0, 0], [thr, thr]], sig.tolist()  # rowless: 0

    # contiguous (normal layout): rows sorted by expert, host counts; tiles never span experts
    counts = [5, 0, 17]
    xs = torch.randn(22, 48, generator=g).to(dtype)
    y = G.grouped_matmul_contiguous(xs, we, counts, num_sms=2, blocks=BLOCKS)
    ref = torch.cat([xs[:5].float() @ we[0].float().t(), xs[5:].float() @ we[2].float().t()])
    assert _close(y, ref, dtype)


def _interp_model_experts_through_a_limited_budget():
    """The registry's path on a GPU with op.sms below the device's SMs, forced on the CPU."""
    G.BLOCK_M = G.BLOCK_N = G.BLOCK_K = 16
    cfg = M.get_config("tiny-mla")
    lw = M.init_weights(cfg, seed=3).layers[1]
    g = torch.Generator().manual_seed(1)
    budget = G.ComputeBudget(4, mechanism="triton_persistent")
    with budget as b:
        assert b.limited and b.mm is not None
        x = torch.randn(3, 10, cfg.hidden, generator=g)
        cnt = torch.tensor([4, 0, 10])
        y = M.grouped_experts_masked(x, cnt, lw["w13"][:3], lw["w2"][:3], gemm=b)
        ref = M.grouped_experts_masked(x, cnt, lw["w13"][:3], lw["w2"][:3])
        assert torch.allclose(y[0, :4], ref[0, :4], atol=1e-4) and torch.allclose(
            y[2], ref[2], atol=1e-4
        )
        h = torch.randn(6, cfg.hidden, generator=g)
        assert torch.allclose(
            M.swiglu_mlp(h, lw["shared_w13"], lw["shared_w2"], mm=b.mm),
            M.swiglu_mlp(h, lw["shared_w13"], lw["shared_w2"]),
            atol=1e-4,
        )
        idx = torch.tensor([[0, 2], [1, -1], [2, 0], [3, 1], [0, 1], [2, 3]])
        wt = torch.rand(6, 2, generator=g)
        got = M.experts_weighted(h, idx, wt, lw["w13"], lw["w2"], gemm=b)
        assert torch.allclose(got, M.experts_weighted(h, idx, wt, lw["w13"], lw["w2"]), atol=1e-4)
    assert budget.applied.get("triton_persistent", 0) >= 1


def test_contiguous_tiles_never_span_experts():
    assert G.contiguous_tiles([3, 0, 5], 4) == ([0, 2, 2], [0, 3, 7], [3, 8, 8])


def test_mechanism_follows_limit_device_and_libraries():
    c = dict(device_sms=132, cuda=True, deep_gemm=False, triton=True)
    # every op runs the same kernel family on a GPU, limited or not (only the grid differs)
    assert G.choose_mechanism(None, **c) == "triton_persistent"
    assert G.choose_mechanism(132, **c) == "triton_persistent"
    assert G.choose_mechanism(None, **{**c, "triton": False}) == "torch"
    assert G.choose_mechanism(108, **c) == "triton_persistent"  # DeepSeek prefill's 132 - 24
    assert G.choose_mechanism(129, **{**c, "deep_gemm": True}) == "deep_gemm"  # SBO compute
    assert G.choose_mechanism(108, **{**c, "triton": False}) == "torch_unlimited"
    assert G.choose_mechanism(108, **{**c, "cuda": False}) == "none"  # the CPU
    assert G.ComputeBudget(108).mechanism == "none"  # CPU tensors: plain torch


def _fake_deep_gemm(start=132):
    state = {"sms": start, "calls": []}
    mod = types.ModuleType("deep_gemm")
    mod.get_num_sms = lambda: state["sms"]

    def set_num_sms(n):
        state["calls"].append(n)
        state["sms"] = n

    mod.set_num_sms = set_num_sms
    return mod, state


def _on_gpu(budget, device_sms=132):
    """A budget as __init__ sets it up on a GPU of ``device_sms`` SMs (its device is the CPU)."""
    budget.device_sms = device_sms
    budget.sms = min(budget.requested or device_sms, device_sms)
    return budget


def test_bf16_on_every_sm_runs_cublas_fp8_and_sm_limits_the_budget_kernels(monkeypatch):
    """SGLang's rule per dtype: BF16 GEMMs on every SM by cuBLAS (torch), FP8 by DeepGEMM on
    any budget; an SM limit below the device's takes the budget kernels, the only ones that
    honour it. Each is counted in the run's log under its own label."""
    from overlap_lab.real import fp8

    monkeypatch.setattr(G, "matmul", lambda x, w, num_sms: x @ w.t())  # Triton's, on a GPU
    for mech in ("deep_gemm", "triton_persistent"):
        for sms, limited in ((None, False), (132, False), (200, False), (108, True)):
            b = _on_gpu(G.ComputeBudget(sms, mechanism=mech))
            assert b.limited is limited and (b.mm is not None) is limited, (mech, sms)
    with _on_gpu(G.ComputeBudget(None, mechanism="triton_persistent")) as b:
        a, w = torch.randn(3, 8), torch.randn(5, 8)
        assert torch.equal(b.linear(a, w), a @ w.t())
    assert b.applied == {G.TORCH_BF16: 1}
    with _on_gpu(G.ComputeBudget(108, mechanism="triton_persistent")) as b:
        torch.testing.assert_close(b.linear(a, w), a @ w.t())  # each budget GEMM counts itself
        b.linear(a, w)
    assert b.applied == {"triton_persistent": 2}
    dg = types.SimpleNamespace(**dict.fromkeys(fp8.ENTRY_POINTS, print))
    b = _on_gpu(G.ComputeBudget(None, mechanism="deep_gemm", dtype="fp8",
                                precision=fp8.resolve("fp8", cuda=True, module=dg)))  # fmt: skip
    b._dg = dg  # what __enter__ sets from deep_gemm_num_sms on a GPU
    assert b.fp8 and b.limited  # FP8 on every SM: DeepGEMM's kernels


def test_deep_gemm_num_sms_is_scoped_and_restored(monkeypatch):
    mod, state = _fake_deep_gemm()
    monkeypatch.setitem(sys.modules, "deep_gemm", mod)
    with G.deep_gemm_num_sms(108):
        assert state["sms"] == 108
        with G.deep_gemm_num_sms(129):  # nested
            assert state["sms"] == 129
        assert state["sms"] == 108
    assert state["sms"] == 132
    with pytest.raises(RuntimeError), G.deep_gemm_num_sms(100):
        raise RuntimeError("kernel failed")
    assert state["sms"] == 132  # restored on error too
    with G.deep_gemm_num_sms(None):
        assert state["sms"] == 132
    with G.ComputeBudget(108, mechanism="deep_gemm") as b:  # what the registry enters on a GPU
        assert state["sms"] == 108 and b.limited
    assert state["sms"] == 132 and state["calls"] == [108, 129, 108, 132, 100, 132, 108, 132]


def _sbo_setup():
    """A 2-rank emulated low-latency dispatch of tiny-mla and its experts' activations."""
    from overlap_lab.real.comm import make_backend

    cfg = M.get_config("tiny-mla")
    lw = M.init_weights(cfg, seed=5).layers[1]
    h = torch.randn(12, cfg.hidden, generator=torch.Generator().manual_seed(2))
    idx, wt = M.select_experts(cfg, h @ lw["gate"].t(), lw["gate_bias"])
    be = make_backend("emulated", rank=0, world=2, num_experts=cfg.num_experts, hidden=cfg.hidden)
    rx, cnt, handle, _, hook = be.low_latency_dispatch(
        h, idx, 16, cfg.num_experts, return_recv_hook=True
    )
    hook()
    E = rx.shape[0]
    gu, up = M.grouped_gemm_masked(rx, lw["w13"][:E], cnt).chunk(2, dim=-1)
    act = (torch.nn.functional.silu(gu) * up).contiguous()
    return be, idx, wt, handle, cnt, act, lw["w2"][:E]


def _combine(be, y, idx, wt, handle, sbo=None):
    out, _, hook = be.low_latency_combine(y, idx, wt, handle, return_recv_hook=True, sbo=sbo)
    hook()
    return out


def _interp_sbo_signalled_down_gemm_then_polling_combine():
    """SBO mode 1 on the interpreter: the signalled down GEMM, then the combine that polls its
    signal per (expert, block) on 3 CTAs: the same combine output as the plain combine."""
    be, idx, wt, handle, cnt, act, w2 = _sbo_setup()
    E, Mx = act.shape[:2]
    sig = torch.zeros(*G.signal_shape(E, Mx, BLOCKS), dtype=torch.int32)
    y = G.grouped_matmul_masked(act, w2, cnt, num_sms=5, blocks=BLOCKS, signal=sig)
    thr = G.signal_threshold(w2.shape[1], BLOCKS)
    rows = -(-cnt.long() // BLOCKS[0])  # signalled blocks per expert
    assert sig.sum().item() == thr * rows.sum().item() > 0
    ref = _combine(be, y, idx, wt, handle)
    args = dict(signal=sig, block_m=BLOCKS[0], threshold=thr, num_sms=3, packed_recv_count=cnt)
    out = _combine(be, y, idx, wt, handle, sbo=args)
    assert torch.equal(out, ref)
    assert be.sbo_sends == [{"kind": "ll_combine_sbo", "ctas": 3, "polled": True, "stale": 0}]


def _interp_sbo_combine_without_signal_sends_stale_blocks():
    """The combine really waits on the signal: with none written, every block with rows is
    polled to the spin bound and reported stale (never silently sent)."""
    from overlap_lab.real.comm import emulated

    be, idx, wt, handle, cnt, act, w2 = _sbo_setup()
    E, Mx = act.shape[:2]
    y = M.grouped_gemm_masked(act, w2, cnt)
    sig = torch.zeros(*G.signal_shape(E, Mx, BLOCKS), dtype=torch.int32)
    args = dict(signal=sig, block_m=BLOCKS[0], threshold=1, num_sms=3, packed_recv_count=cnt)
    spins, emulated.SBO_MAX_SPINS = emulated.SBO_MAX_SPINS, 3
    try:
        _combine(be, y, idx, wt, handle, sbo=args)
    finally:
        emulated.SBO_MAX_SPINS = spins
    assert be.sbo_sends[0]["stale"] == int((-(-cnt.long() // BLOCKS[0])).sum()) > 0


def _interp_sbo_mode1_executor_polls_the_signal():
    """SBO mode 1 through the executor with the emulated backend: the down GEMM slices write
    the signal, the combine is launched without waiting for their events and polls it; the
    outputs equal the serial schedule's and the run says the combine polled."""
    from overlap_lab.real.check import compare_steps, default_workloads
    from overlap_lab.real.comm import make_backend
    from overlap_lab.real.executor import execute
    from overlap_lab.shared import schedules as S
    from overlap_lab.shared.inputs.hardware import get_gpu
    from overlap_lab.shared.schedules import ScheduleConfig

    w, gpu = default_workloads()[0], get_gpu("h100")  # decode: the low-latency combine

    def run(name, **cfg):
        be = make_backend("emulated", rank=0, world=1, num_experts=8, hidden=64, device_sms=132)
        prog = S.build(name, w, gpu, ScheduleConfig(**cfg) if cfg else None)
        return execute(prog, w, backend=be), be

    res, be = run("sbo", sbo_mode=1)
    ref, _ = run("serial")
    assert compare_steps(res.outputs[0], ref.outputs[0][0]) < 1e-4
    note = res.trace.meta["kernel_notes"]["combine_a"]
    assert "polls the down GEMM's per-block signals in-kernel" in note, note
    sends = be.sbo_sends
    assert sends and all(r["polled"] and r["stale"] == 0 and r["ctas"] == 3 for r in sends)


if __name__ == "__main__":  # the interpreter child (see interpreter_results)
    assert G.interpreting(), "run with TRITON_INTERPRET=1"
    checks = {
        "gemms_fp32": lambda: _interp_gemms(torch.float32),
        "gemms_fp16": lambda: _interp_gemms(torch.float16),
        "model_experts_through_a_limited_budget": _interp_model_experts_through_a_limited_budget,
        "sbo_signalled_down_gemm_then_polling_combine": (
            _interp_sbo_signalled_down_gemm_then_polling_combine
        ),
        "sbo_combine_without_signal_sends_stale_blocks": (
            _interp_sbo_combine_without_signal_sends_stale_blocks
        ),
        "sbo_mode1_executor_polls_the_signal": _interp_sbo_mode1_executor_polls_the_signal,
    }
    report(checks)


def test_gpu_kernels_compile_for_hopper_without_a_gpu():
    """Every Triton kernel of real/ (GEMMs and the emulated link kernels) compiles to an sm_90
    cubin with triton's bundled ptxas: no GPU needed, catches what the interpreter accepts but
    the compiler does not (dtypes of loop bounds, inline asm, constexpr use)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # the private kernel modules themselves: what is compiled is their Triton source
    import overlap_lab.real._triton_gemm as TG
    import overlap_lab.real.comm._triton_emulated as TE
    from overlap_lab.real.comm.emulated import SEND_BLOCK

    i32 = "i32"
    mm = {k: i32 for k in ("M", "N", "K", "sam", "sak", "sbn", "sbk", "scm", "scn")}
    masked = {
        k: i32
        for k in ("E", "M", "N", "K", "sae", "sam", "sak", "sbe", "sbn", "sbk", "sce", "scm", "scn")
    }
    contig = {k: i32 for k in ("MT", "N", "K", "sam", "sak", "sbe", "sbn", "sbk", "scm", "scn")}
    ab = dict(a="*bf16", b="*bf16", c="*bf16")
    blocks = {"BM": 64, "BN": 128, "BK": 64}
    link = dict(src="*i32", dst="*i32", stats="*i64", t_arrive="*i64")
    link |= {k: "fp32" for k in ("nv_lat_ns", "nv_ns_per_byte", "rd_lat_ns", "rd_ns_per_byte",
                                 "nv_chan_ns_per_byte", "rd_chan_ns_per_byte")}  # fmt: skip
    link |= {"t_start": "*i64"}
    cases = [
        (TG.persistent_mm, {**ab, **mm}, {**blocks, "GM": 8}, 8),
        (
            TG.grouped_masked_mm,
            {**ab, "counts": "*i32", "signal": "*i32", **masked},
            {**blocks, "SIGNAL": True},
            8,
        ),  # fmt: skip
        (
            TG.grouped_contig_mm,
            {**ab, **{f"tile_{x}": "*i32" for x in ("e", "lo", "hi")}, **contig},
            blocks,
            8,
        ),  # fmt: skip
        (TE.send_kernel, link, {"SPIN": True, "BLOCK": SEND_BLOCK, "HAS_START": False}, 32),
        (TE.send_kernel, link, {"SPIN": False, "BLOCK": SEND_BLOCK, "HAS_START": True}, 32),
        (TE.stamp_kernel, {"t_start": "*i64"}, {}, 1),
        (
            TE.sbo_combine_kernel,
            {
                **dict(src="*bf16", dst="*bf16", counts="*i32", signal="*i32", stale="*i32"),
                **{k: i32 for k in ("E", "M", "H", "threshold", "max_spins")},
                **{k: i32 for k in ("sse", "ssm", "dse", "dsm")},
            },
            {"BM": 64, "BH": 128},
            4,
        ),
        (TE.recv_kernel, {"t_arrive": "*i64", "unset": i32, "limit_ns": i32}, {}, 32),
    ]
    for fn, sig, consts, warps in cases:
        sig = {**sig, **{k: "constexpr" for k in consts}}
        try:
            k = triton.compile(
                ASTSource(fn=fn, signature=sig, constexprs=consts),
                target=GPUTarget("cuda", 90, 32),
                options={"num_warps": warps},
            )
        except (FileNotFoundError, ImportError) as e:  # no bundled ptxas on this platform
            pytest.skip(f"cannot compile for sm_90 here: {e}")
        assert k.asm.get("cubin"), fn.__name__


def test_a_failing_deep_gemm_call_falls_back_to_triton_and_is_labelled_so(monkeypatch):
    """A DeepGEMM entry point that raises (JIT failure) is reported and not retried; the GEMM
    runs through the Triton kernel with the same budget, never counted as deep_gemm."""
    calls = []

    def bf16_gemm_nt(a, b, d):
        calls.append(1)
        raise RuntimeError("nvcc: JIT compilation failed")

    dg = types.SimpleNamespace(bf16_gemm_nt=bf16_gemm_nt)
    monkeypatch.setattr(G, "matmul", lambda x, w, num_sms: x @ w.t())
    monkeypatch.setattr(G, "DEEP_GEMM_ERRORS", {})
    b = G.ComputeBudget(100, mechanism="deep_gemm")
    b._dg = dg  # what __enter__ sets from deep_gemm_num_sms on a GPU
    x, w = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(6, 8, dtype=torch.bfloat16)
    for _ in range(3):
        assert torch.equal(b.linear(x, w), x @ w.t())
    assert len(calls) == 1 and "bf16_gemm_nt" in G.DEEP_GEMM_ERRORS
    labels = b.applied
    assert not any(k.startswith("deep_gemm") for k in labels), labels
    assert sum(labels.values()) == 3


def test_expected_m_is_the_routings_mean_not_the_padded_rows():
    # DeepSeek-V3 decode, batch 128 per rank, EP 32: 8 local experts, 4096 padded rows each
    assert G.expected_rows(128, 8, 256, 32, 4096) == 128
    assert G.expected_rows(1, 1, 256, 2, 64) == 1
    assert G.expected_rows(1000, 8, 8, 4, 64) == 64  # clamped to the padded rows


def test_grouped_error_of_an_expert_without_rows_is_zero_not_the_max_of_nothing():
    from overlap_lab.real.check import grouped_max_abs_diff

    y = torch.zeros(3, 4, 2)
    ref = y.clone()
    ref[1, 1, 0] = 0.5  # expert 1's second valid row
    ref[2, 3, 1] = 9.0  # past expert 2's count: padding, never compared
    assert grouped_max_abs_diff(y, ref, [0, 2, 3]) == [0.0, 0.5, 0.0]
    flat = torch.zeros(5, 2)
    fref = flat.clone()
    fref[4, 0] = -0.25  # the last row: expert 2's segment [2, 5)
    assert grouped_max_abs_diff(flat, fref, [0, 2, 3]) == [0.0, 0.0, 0.25]
    assert grouped_max_abs_diff(flat[:0], fref[:0], [0, 0]) == [0.0, 0.0]
