"""GPU paths (skipped without CUDA): streams/events timing, the emulated backend's kernels."""

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _tiny_workload(mode="decode"):
    from overlap_lab.real import model as M
    from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload

    b = Batch.decode(kv_lens=[64] * 8) if mode == "decode" else Batch.prefill(extend_lens=[96, 40])
    return Workload(M.get_model_config("tiny-mla"), b, Parallel(ep=4))


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_gpu_schedules_match_serial_and_time_every_op(mode):
    pytest.importorskip("triton")
    from overlap_lab.real.check import compare_steps, workload_variants
    from overlap_lab.real.comm import make_backend
    from overlap_lab.real.executor import execute
    from overlap_lab.shared import schedules as S
    from overlap_lab.shared.inputs.hardware import get_gpu

    w = _tiny_workload(mode)
    gpu = get_gpu("h100")
    outs = {}
    for name in S.available():
        wv = workload_variants(name, w)[0]  # pp refuses one stage: it runs on a pp=2 copy
        be = make_backend("emulated", rank=0, world=4, num_experts=8, hidden=64)
        res = execute(S.build(name, wv, gpu), wv, backend=be, device="cuda", warmup=1, repeats=3)
        assert res.trace.meta["backend"] == "emulated" and res.trace.meta["emulated"]
        assert all(s.end >= s.start for s in res.trace.spans)
        outs[name] = res.outputs
    ref = outs["serial"][0][0]
    for name, per_rank in outs.items():
        assert max(compare_steps(st, ref) for st in per_rank.values()) < 2e-2, name  # bf16


def test_emulated_link_kernel_holds_until_arrival():
    pytest.importorskip("triton")
    from overlap_lab.real.comm import make_backend
    from overlap_lab.real.comm.bytes import LinkParams

    link = LinkParams(nvlink_gbps=1.0, nvlink_lat_us=50.0)  # slow link: arrival dominates
    be = make_backend("emulated", rank=0, world=2, num_experts=8, hidden=1024, link=link, num_sms=4)
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, 8, (64, 2), device="cuda")
    w = torch.ones(64, 2, device="cuda")
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    r = be.dispatch(x, idx, w, async_finish=True)
    r.event.current_stream_wait()
    b.record()
    torch.cuda.synchronize()
    expected_us = be.launches[-1]["delay_us"]
    assert a.elapsed_time(b) * 1e3 >= 0.9 * expected_us


def test_triton_sm_limited_gemms_bf16_match_torch():
    pytest.importorskip("triton")
    from overlap_lab.real import gemm as G
    from overlap_lab.real.check import grouped_max_abs_diff

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(300, 512, device=dev, generator=g, dtype=torch.bfloat16)
    w = torch.randn(384, 512, device=dev, generator=g, dtype=torch.bfloat16)
    ref = a.float() @ w.float().t()
    for sms in (1, 8, 108):
        assert (G.matmul(a, w, num_sms=sms).float() - ref).abs().max() < 0.5
    x = torch.randn(4, 256, 512, device=dev, generator=g, dtype=torch.bfloat16)
    we = torch.randn(4, 384, 512, device=dev, generator=g, dtype=torch.bfloat16)
    cnt = torch.tensor([0, 17, 256, 100], device=dev, dtype=torch.int32)
    y = G.grouped_matmul_masked(x, we, cnt, num_sms=16)
    ref = torch.bmm(x.float(), we.float().transpose(1, 2))
    assert max(grouped_max_abs_diff(y, ref, cnt.tolist())) < 0.5  # expert 0: no rows
    counts = [0, 17, 256, 100]
    xs = torch.randn(sum(counts), 512, device=dev, generator=g, dtype=torch.bfloat16)
    y = G.grouped_matmul_contiguous(xs, we, counts, num_sms=16)
    segs = torch.split(xs.float(), counts)
    ref = torch.cat([s @ we[e].float().t() for e, s in enumerate(segs)])
    assert max(grouped_max_abs_diff(y, ref, counts)) < 0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    b = G.ComputeBudget(sms - 24, "cuda")
    assert b.mechanism in ("triton_persistent", "deep_gemm")
    full = G.ComputeBudget(None, "cuda")  # no limit: BF16 by cuBLAS on every SM
    assert full.mechanism == b.mechanism and full.sms == sms and b.limited and not full.limited
    with full as f:
        assert torch.equal(f.linear(a, w), a @ w.t())
    assert full.applied.get(G.TORCH_BF16)


def test_low_latency_path_runs_without_host_sync_on_gpu():
    """DeepEP LL layout (fixed buffers + device counts) through an SM-limited masked GEMM: no
    synchronizing CUDA call between dispatch and combine (torch's sync debug mode raises)."""
    pytest.importorskip("triton")
    from overlap_lab.real import gemm as G
    from overlap_lab.real import model as M
    from overlap_lab.real.comm import make_backend

    cfg = M.get_config("tiny-mla")
    lw = M.init_weights(cfg, seed=1, dtype=torch.bfloat16, device="cuda").layers[1]
    h = torch.randn(16, cfg.hidden, device="cuda", dtype=torch.bfloat16)
    idx, wt = M.select_experts(cfg, h @ lw["gate"].t(), lw["gate_bias"])
    be = make_backend("emulated", rank=0, world=4, num_experts=cfg.num_experts, hidden=cfg.hidden)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rx, cnt, handle, _, hook = be.low_latency_dispatch(
            h, idx, 16, cfg.num_experts, return_recv_hook=True
        )
        hook()
        with G.ComputeBudget(sms - 3, "cuda") as g:
            y = M.grouped_experts_masked(rx, cnt, lw["w13"], lw["w2"], gemm=g)
        out, _, hook = be.low_latency_combine(y, idx, wt, handle, return_recv_hook=True)
        hook()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all() and be.host_waits == {}


@pytest.mark.parametrize("name", ["serial", "sbo", "vllm-dbo"])
def test_cuda_graphs_are_captured_and_replay_the_eager_numbers(name):
    pytest.importorskip("triton")
    from overlap_lab.real.check import compare_steps
    from overlap_lab.real.comm import make_backend
    from overlap_lab.real.executor import execute
    from overlap_lab.shared import schedules as S
    from overlap_lab.shared.inputs.hardware import get_gpu

    w = _tiny_workload("decode")
    prog = S.build(name, w, get_gpu("h100"))

    def run(graphs):
        be = make_backend("emulated", rank=0, world=4, num_experts=8, hidden=64)
        return execute(prog, w, backend=be, device="cuda", warmup=2, repeats=3, cuda_graphs=graphs)

    eager, graphed = run(False), run(True)
    modes = graphed.trace.meta["cuda_graphs"]
    assert modes and all(m == "captured" for m in modes.values()), modes
    m = graphed.trace.meta
    assert m["step_time_source"] == "graph_replay" and m["graph_replay_step_time_us"] > 0
    ops = {s.op for s in graphed.trace.spans}  # per-op spans from the eager pass
    assert "attn.core" in ops and not any(o.startswith("graph:") for o in ops)
    assert m["sm_budget_mechanisms"] and "torch" not in m["sm_budget_mechanisms"]
    assert compare_steps(graphed.outputs[0], eager.outputs[0][0]) < 1e-2


def test_deep_gemm_set_num_sms_is_restored_when_installed():
    from overlap_lab.real import gemm as G

    dg = G.deep_gemm_module()
    if dg is None:
        pytest.skip("deep_gemm not installed (see real/deps.py for the wheels)")
    prev = dg.get_num_sms()
    with G.deep_gemm_num_sms(prev - 24):
        assert dg.get_num_sms() == prev - 24
    assert dg.get_num_sms() == prev


def test_validation_loop_on_a_tiny_model(tmp_path):
    """The predicted-vs-measured loop end to end on the GPU, small: one archive, every run
    compared, decode step times from graph replay."""
    pytest.importorskip("triton")
    pytest.importorskip("simpy")
    import json
    import tarfile

    from overlap_lab.experiments import gpu_validation as GV

    rc = GV.main(
        ["--device", "cuda", "--model", "tiny-mla", "--layers", "3", "--ep", "4",
         "--batches", "8", "--prefill", "32", "--kv-len", "64", "--schedules", "serial,sbo,tbo",
         "--repeats", "2", "--warmup", "2", "--no-figures", "--out", str(tmp_path),
         "--name", "tiny"]
    )  # fmt: skip
    assert rc == 0
    with tarfile.open(tmp_path / "tiny.tar.gz") as tar:
        report = json.load(tar.extractfile("tiny/results.json"))
    assert report["complete"] and report["timing_meaningful"]
    runs = report["cases"]["decode_8"]["runs"]
    assert all("comparison" in r for r in runs.values()), runs
    assert all(r["measured_step_source"] == "graph replay" for r in runs.values()), runs


def test_deep_gemm_fp8_matches_bf16_when_installed():
    """Real DeepGEMM FP8 (where installed): the three entry points the executor calls, with its
    scale layouts, within FP8's error of the BF16 product; else the precision says why."""
    from overlap_lab.real import fp8
    from overlap_lab.real.gemm import deep_gemm_module

    dg = deep_gemm_module()
    p = fp8.resolve("fp8", cuda=True, module=dg)
    if not p.fp8:
        assert p.used == "bf16" and p.reason
        pytest.skip(p.reason)
    assert fp8.probe(p, dg, "cuda").fp8, fp8.probe(p, dg, "cuda").reason
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 128, 512, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(2, 256, 512, device="cuda", generator=g, dtype=torch.bfloat16)
    ref = torch.bmm(x.float(), w.float().transpose(1, 2))

    def rel(a, b):
        return float((a.float() - b).norm() / b.norm())

    cache = fp8.WeightCache().load([w])  # quantised once, as at the executor's setup
    assert rel(fp8.linear(dg, x[0], w[0], cache), ref[0]) < 0.08
    cnt = torch.tensor([128, 40], dtype=torch.int32, device="cuda")
    y = fp8.grouped_masked(dg, x, w, cnt, 84, cache)
    assert rel(y[0], ref[0]) < 0.08 and rel(y[1, :40], ref[1, :40]) < 0.08
    yc = fp8.grouped_contiguous(dg, torch.cat([x[0, :70], x[1, :40]]), w, [70, 40], cache)
    assert rel(yc, torch.cat([ref[0, :70], ref[1, :40]])) < 0.08
    assert cache.late == 0


def test_flash_mla_matches_sdpa_when_installed():
    """FlashMLA's decode kernel (where flash_mla imports) against the batched SDPA path."""
    from overlap_lab.real import model as M
    from overlap_lab.real.kernels.attention import flash_mla_module

    fm = flash_mla_module()
    cfg = M.RealModelConfig(
        name="mla-512", num_layers=1, first_k_dense=1, hidden=64, vocab=16, num_heads=16,
        q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128,
    )  # fmt: skip
    cache = torch.randn(4, 256, 576, device="cuda", dtype=torch.bfloat16)
    why = M.flash_mla_unusable(cfg, cache, fm)
    if why is not None:
        pytest.skip(why)
    lw = M.init_weights(cfg, seed=1, dtype=torch.bfloat16, device="cuda").layers[0]
    q_pos = torch.tensor([[99], [5], [255], [128]], device="cuda")
    q_nope = torch.randn(4, 16, 128, device="cuda", dtype=torch.bfloat16)
    q_pe = torch.randn(4, 16, 64, device="cuda", dtype=torch.bfloat16)
    table = torch.arange(16, dtype=torch.int32, device="cuda").view(4, 4)
    a = M.mla_attend_flash(cfg, lw, q_nope, q_pe, cache, q_pos, fm, table)
    b = M.mla_attend_absorbed_batched(cfg, lw, q_nope, q_pe, cache, q_pos)
    assert float((a.float() - b.float()).norm() / b.float().norm()) < 2e-2


def test_fused_fp8_activation_quantisation_matches_torch():
    """The one-kernel per-token-group quantisation (real/_triton_quant.py) on the GPU: scales
    bit for bit torch's, values torch's round-to-nearest-even casts, DeepGEMM's layout."""
    pytest.importorskip("triton")
    from overlap_lab.real import fp8

    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in [(1, 7168), (37, 7168), (8, 64, 2048)]:
        x = torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16) * 3
        q, s = fp8.quant_tokens_fused(x)
        qr, sr = fp8.quant_tokens_torch(x)
        assert torch.equal(s, sr)
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
        assert fp8.sf_for_deep_gemm(s).data_ptr() == s.data_ptr()


def test_prefill_attention_with_a_prefix_matches_the_masked_form_on_gpu():
    """The lower-right causal SDPA path (and MLA's V padded to q's head size) on CUDA BF16."""
    import torch.nn.functional as F

    from overlap_lab.real import model as M

    g = torch.Generator(device="cuda").manual_seed(0)
    for T, L, dv in [(512, 512, 128), (300, 1324, 128), (1, 900, 192)]:
        q = torch.randn(16, T, 192, device="cuda", generator=g, dtype=torch.bfloat16)
        k = torch.randn(16, L, 192, device="cuda", generator=g, dtype=torch.bfloat16)
        v = torch.randn(16, L, dv, device="cuda", generator=g, dtype=torch.bfloat16)
        mask = (
            torch.arange(L, device="cuda")[None, :]
            <= torch.arange(L - T, L, device="cuda")[:, None]
        )
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
        got = M.prefill_attention(q, k, v)
        assert (got.float() - ref).abs().max() < 2e-2


def test_the_norm_kernels_match_the_formula_on_gpu():
    """torch's fused RMSNorm (F.rms_norm -> _fused_rms_norm) and the Triton add+RMSNorm in bf16
    against the eager fp32 formula: the sum bit for bit, the norm within one bf16 rounding."""
    from overlap_lab.real import norm

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 7168, device="cuda", generator=g, dtype=torch.bfloat16) * 3
    r = torch.randn(300, 7168, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(7168, device="cuda", generator=g)).to(torch.bfloat16)
    ref = norm.rms_norm_reference(x, w)
    torch.testing.assert_close(norm.rms_norm(x, w), ref, rtol=1e-2, atol=1e-2)
    y, s = norm.fused_add_rms_norm(x, r, w)
    assert torch.equal(s, x + r)
    torch.testing.assert_close(y, norm.rms_norm_reference(x + r, w), rtol=1e-2, atol=1e-2)


def test_the_kernel_tables_references_compute_what_the_executor_computes():
    """Every reference of the kernel table that computes the executor's output (cuBLAS, SDPA,
    DeepGEMM's FP8 GEMM on the same pre-quantised operands, torch._scaled_mm) gives its numbers
    on the GPU: a ratio between two kernels is only fair if they do the same work."""
    from overlap_lab.real.kernel_table import build_cases

    checked = 0
    for c in build_cases("cuda"):
        if c.skipped or c.executor is None:
            continue
        a = c.executor()
        for r in c.refs:
            if r.same_work:
                b = r.fn()
                err = (a.float().reshape(b.shape) - b.float()).norm() / b.float().norm()
                assert err < 0.05, (c.name, r.label, float(err))
                checked += 1
    assert checked >= 5
