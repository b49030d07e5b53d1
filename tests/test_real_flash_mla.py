"""FlashMLA decode attention (real/model.py ``mla_attend_flash``, the attn.core selection in
real/kernels/attention.py) on the CPU: a fake ``flash_mla`` asserts FlashMLA's preconditions
(paged cache of 64-row blocks, 576-wide q and cache rows, int32 block table and lengths,
head_dim_v 512, the metadata it returned) and computes with them; its output equals the SDPA
path's; a run says which attention kernel ran and why."""

import math
import types

import pytest

torch = pytest.importorskip("torch")

from overlap_lab.real import model as M  # noqa: E402

PAGE = 64


class FakeFlashMLA(types.ModuleType):
    def __init__(self):
        super().__init__("flash_mla")
        self.meta = None
        self.calls = 0

    def get_mla_metadata(self, cache_seqlens, num_heads_per_head_k, num_heads_k):
        assert cache_seqlens.dtype == torch.int32 and cache_seqlens.dim() == 1
        assert num_heads_k == 1  # MLA: one latent KV head
        self.meta = (torch.zeros(4, 8, dtype=torch.int32), torch.zeros(len(cache_seqlens) + 1))
        self.heads_per_k = num_heads_per_head_k
        return self.meta

    def flash_mla_with_kvcache(
        self, q, k_cache, block_table, cache_seqlens, head_dim_v, meta, splits,
        softmax_scale=None, causal=False,
    ):  # fmt: skip
        self.calls += 1
        B, s_q, h, d = q.shape
        assert d == 576 and q.is_contiguous() and q.dtype in (torch.bfloat16, torch.float16)
        assert k_cache.dtype == q.dtype and k_cache.shape[1:] == (PAGE, 1, 576)
        assert block_table.dtype == torch.int32 and block_table.shape[0] == B
        assert cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (B,)
        assert head_dim_v == 512 and (meta, splits) == self.meta
        assert self.heads_per_k == s_q * h
        return _decode(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal)


def _decode(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal):
    """FlashMLA's dense decode, asserting the preconditions both interfaces share."""
    B, s_q, h, d = q.shape
    assert d == 576 and q.is_contiguous() and q.dtype in (torch.bfloat16, torch.float16)
    assert k_cache.dtype == q.dtype and k_cache.shape[1:] == (PAGE, 1, 576)
    assert block_table.dtype == torch.int32 and block_table.shape[0] == B
    assert cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (B,)
    assert head_dim_v == 512 and causal == (s_q > 1)
    out = torch.empty(B, s_q, h, head_dim_v, dtype=q.dtype)
    for b in range(B):
        n = int(cache_seqlens[b])
        kv = k_cache[block_table[b].long()].reshape(-1, 576)[:n].float()
        sc = torch.einsum("qhd,ld->qhl", q[b].float(), kv) * softmax_scale
        lim = torch.arange(s_q)[:, None] + n - s_q  # causal: query i sees up to n - s_q + i
        sc = sc.masked_fill(torch.arange(n)[None, None, :] > lim[:, :, None], float("-inf"))
        out[b] = torch.einsum("qhl,lc->qhc", sc.softmax(-1), kv[:, :head_dim_v]).to(q.dtype)
    return out, None


class SchedMeta:
    """FlashMLA 1.0's FlashMLASchedMeta: empty until the first call fills it."""

    have_initialized = False


class FakeFlashMLA1(types.ModuleType):
    """FlashMLA 1.0's interface: get_mla_metadata() without arguments, num_splits None; with
    ``use_legacy`` (sgl-flash-mla 1.0: dense decoding behind use_legacy=True) or without it
    (FlashMLA's own 1.0 interface)."""

    def __init__(self, use_legacy: bool):
        super().__init__("flash_mla")
        self.calls = 0
        if use_legacy:
            self.flash_mla_with_kvcache = self._with_legacy
        else:
            self.flash_mla_with_kvcache = self._without_legacy

    def get_mla_metadata(self, *args, **kwargs):
        assert not args and not kwargs, "FlashMLA 1.0: get_mla_metadata takes no arguments"
        return SchedMeta(), None

    def _call(self, q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits,
              softmax_scale, causal):  # fmt: skip
        assert isinstance(meta, SchedMeta) and not meta.have_initialized  # one per call
        assert num_splits is None, "num_splits must be None"
        meta.have_initialized = True
        self.calls += 1
        return _decode(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal)

    def _with_legacy(
        self, q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
        num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False,
        use_legacy=False,
    ):  # fmt: skip
        assert use_legacy, "sgl-flash-mla 1.0: dense decoding needs use_legacy=True"
        assert not is_fp8_kvcache
        return self._call(q, k_cache, block_table, cache_seqlens, head_dim_v,
                          tile_scheduler_metadata, num_splits, softmax_scale, causal)  # fmt: skip

    def _without_legacy(
        self, q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
        num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False,
    ):  # fmt: skip
        assert not is_fp8_kvcache
        return self._call(q, k_cache, block_table, cache_seqlens, head_dim_v,
                          tile_scheduler_metadata, num_splits, softmax_scale, causal)  # fmt: skip


def _cfg():
    return M.RealModelConfig(
        name="mla-512", num_layers=1, first_k_dense=1, hidden=64, vocab=16, num_heads=2,
        q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16,
    )  # fmt: skip


FAKES = {
    "legacy": FakeFlashMLA,
    "sched_meta+use_legacy": lambda: FakeFlashMLA1(use_legacy=True),
    "sched_meta": lambda: FakeFlashMLA1(use_legacy=False),
}


@pytest.mark.parametrize("api", list(FAKES))
@pytest.mark.parametrize("r", [1, 2])  # plain decode, and two tokens per sequence (MTP)
def test_flash_mla_path_equals_the_sdpa_path(r, api):
    cfg = _cfg()
    lw = M.init_weights(cfg, seed=1, dtype=torch.bfloat16).layers[0]
    g = torch.Generator().manual_seed(0)
    S, L = 3, 2 * PAGE
    cache = torch.randn(S, L, 576, generator=g).bfloat16()
    lens = [70, 5, 128]
    q_pos = torch.tensor([[n - r + i for i in range(r)] for n in lens])
    q_nope = torch.randn(S * r, 2, 16, generator=g).bfloat16()
    q_pe = torch.randn(S * r, 2, 64, generator=g).bfloat16()
    fm = FAKES[api]()
    table = torch.arange(S * 2, dtype=torch.int32).view(S, 2)
    a = M.mla_attend_flash(cfg, lw, q_nope, q_pe, cache, q_pos, fm, table)
    b = M.mla_attend_absorbed_batched(cfg, lw, q_nope, q_pe, cache, q_pos)
    assert fm.calls == 1 and a.shape == b.shape
    assert float((a.float() - b.float()).norm() / b.float().norm()) < 2e-2


def test_flash_mla_is_used_only_where_it_can_run_and_says_why():
    cfg, fm = _cfg(), FakeFlashMLA()
    cache = torch.zeros(2, PAGE, 576, dtype=torch.bfloat16)
    assert "not installed" in M.flash_mla_unusable(cfg, cache, None)
    assert "CPU" in M.flash_mla_unusable(cfg, cache, fm)

    def gpu_cache(shape=(2, PAGE, 576), dtype=torch.bfloat16):  # what the checks read
        return types.SimpleNamespace(is_cuda=True, dtype=dtype, shape=shape)

    assert M.flash_mla_unusable(cfg, gpu_cache(), fm) is None
    assert "pages of 64" in M.flash_mla_unusable(cfg, gpu_cache((2, 100, 576)), fm)
    tiny = M.get_config("tiny-mla")
    assert "512 + 64" in M.flash_mla_unusable(tiny, gpu_cache(), fm)
    fp32 = gpu_cache(dtype=torch.float32)
    assert "bf16/fp16" in M.flash_mla_unusable(cfg, fp32, fm)


def test_the_interface_is_read_from_the_signatures():
    assert M.flash_mla_api(FakeFlashMLA()) == M.FlashMLAApi("legacy")
    assert M.flash_mla_api(FakeFlashMLA1(True)) == M.FlashMLAApi("sched_meta", use_legacy=True)
    assert M.flash_mla_api(FakeFlashMLA1(False)) == M.FlashMLAApi("sched_meta")
    assert M.flash_mla_api(FakeFlashMLA1(True)).label == "flash_mla (sched_meta API)"
    odd = FakeFlashMLA1(False)
    odd.get_mla_metadata = lambda seqlens, heads: None  # neither interface
    assert "neither known interface" in M.flash_mla_api(odd)
    builtin = FakeFlashMLA1(False)
    builtin.get_mla_metadata = min  # a C function: no signature to read
    cfg = _cfg()
    gpu = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, shape=(2, PAGE, 576))
    assert "no readable signature" in M.flash_mla_unusable(cfg, gpu, builtin)
    assert "lacks" in M.flash_mla_unusable(cfg, gpu, types.ModuleType("flash_mla"))


def test_a_decode_run_says_which_attention_kernel_ran():
    from overlap_lab.real.check import default_workloads
    from overlap_lab.real.executor import execute
    from overlap_lab.shared import schedules as S
    from overlap_lab.shared.inputs.hardware import get_gpu

    w = default_workloads()[0]  # decode
    res = execute(S.build("serial", w, get_gpu("h100")), w)
    kernels = res.trace.meta["attention_kernels"]
    assert len(kernels) == 1 and next(iter(kernels)).startswith("sdpa (")
    assert sum(kernels.values()) == w.model.num_layers
    kv = next(iter(res.outputs[0][0].kv.values()))
    assert kv.shape[1] % PAGE == 0  # MLA caches are whole 64-row pages
    assert math.isfinite(float(res.outputs[0][0].final.float().abs().sum()))
