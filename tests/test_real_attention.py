"""Prefill attention (real/model.py ``prefill_attention``): causal over the new tokens and a cached
prefix without a dense mask on the hot path, equal to the masked form it replaced."""

import math

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from overlap_lab.real import model as M  # noqa: E402

SDPA = F.scaled_dot_product_attention  # the reference's own, never the patched one


def _masked(q, k, v, scale=None):
    """The dense-mask form: query i of T sits at position L - T + i of the L keys."""
    T, L = q.shape[-2], k.shape[-2]
    q_pos = torch.arange(L - T, L)
    mask = torch.arange(L)[None, :] <= q_pos[:, None]
    return SDPA(q, k, v, attn_mask=mask, scale=scale)


class _SdpaMasks(torch.overrides.TorchFunctionMode):
    """Records every SDPA call's mask kind and refuses a dense tensor mask."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is SDPA:
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            assert type(mask) is not torch.Tensor, "a dense mask on the prefill path"
            assert all(t.dim() == 4 for t in args[:3]), "the fused kernels take 4-D inputs only"
            self.seen.append((type(mask).__name__, bool(kwargs.get("is_causal", False))))
        return func(*args, **kwargs)


@pytest.fixture
def no_dense_mask():
    """SDPA refuses a tensor mask: the fused kernels must stay eligible."""
    return _SdpaMasks()


@pytest.mark.parametrize("T,L,dv", [(7, 7, 16), (5, 12, 16), (1, 9, 16), (6, 6, 8), (4, 20, 8)])
def test_prefill_attention_equals_the_masked_form(T, L, dv, no_dense_mask):
    g = torch.Generator().manual_seed(T * 100 + L)
    q = torch.randn(3, T, 16, generator=g)
    k = torch.randn(3, L, 16, generator=g)
    v = torch.randn(3, L, dv, generator=g)
    scale = 1 / math.sqrt(24)
    with no_dense_mask:
        got = M.prefill_attention(q, k, v, scale=scale)
    ref = _masked(q, k, v, scale=scale)
    assert got.shape == ref.shape == (3, T, dv)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)
    kind, causal = no_dense_mask.seen[-1]
    assert (kind, causal) == (("NoneType", True) if T == L else ("CausalBias", False))


def test_more_queries_than_keys_is_refused():
    with pytest.raises(ValueError, match="last keys"):
        M.prefill_attention(torch.zeros(1, 4, 8), torch.zeros(1, 3, 8), torch.zeros(1, 3, 8))


@pytest.mark.parametrize("attention", ["tiny-mla", "tiny-gqa"])
def test_model_attention_with_a_cached_prefix_equals_the_masked_form(attention, no_dense_mask):
    cfg = M.get_config(attention)
    lw = M.init_weights(cfg, seed=5).layers[0]
    g = torch.Generator().manual_seed(1)
    L, T = 11, 4  # 7 cached positions, 4 new tokens
    h = torch.randn(L, cfg.hidden, generator=g)
    pos = torch.arange(L)
    if attention == "tiny-mla":
        q_nope, q_pe, kv = M.mla_prepare(cfg, lw, h, pos)
        with no_dense_mask:
            got = M.mla_attend_expanded(cfg, lw, q_nope[-T:], q_pe[-T:], kv)
        # the absorbed form masks explicitly per query position: the reference
        ref = M.mla_attend_absorbed(
            cfg, lw, q_nope[-T:], q_pe[-T:], kv[None], torch.zeros(T, dtype=torch.long), pos[-T:]
        )
    else:
        q, kv = M.gqa_prepare(cfg, lw, h, pos)
        with no_dense_mask:
            got = M.gqa_attend(cfg, q[-T:], kv)
        rep = cfg.num_heads // cfg.num_kv_heads
        k = kv[:, 0].transpose(0, 1).repeat_interleave(rep, 0)
        v = kv[:, 1].transpose(0, 1).repeat_interleave(rep, 0)
        ref = _masked(q[-T:].transpose(0, 1), k, v).transpose(0, 1).reshape(T, -1)
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-5)
    seen = no_dense_mask.seen
    assert seen and all(k == "CausalBias" for k, _ in seen)


def test_a_chunked_prefill_run_reports_both_causal_alignments():
    from overlap_lab.real.check import default_workloads
    from overlap_lab.real.executor import execute
    from overlap_lab.shared import schedules as S
    from overlap_lab.shared.inputs.hardware import get_gpu

    prefills = [w for w in default_workloads() if w.batch.mode != "decode"]
    kinds = {}
    for w in prefills:
        tr = execute(S.build("serial", w, get_gpu("h100")), w).trace
        kinds.update(tr.meta.get("attention_kernels", {}))
    assert set(kinds) == {"sdpa causal", "sdpa causal lower-right (cached prefix)"}, kinds
