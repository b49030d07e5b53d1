"""real/model.py: MLA forms agree, routing, grouped experts, EP weight slices."""

import pytest

torch = pytest.importorskip("torch")

from overlap_lab.real import model as M  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    cfg = M.get_config("tiny-mla")
    return cfg, M.init_weights(cfg, seed=3)


def test_mla_absorbed_equals_expanded(tiny):
    cfg, w = tiny
    lw = w.layers[1]
    g = torch.Generator().manual_seed(0)
    L = 9
    h = torch.randn(L, cfg.hidden, generator=g)
    pos = torch.arange(L)
    q_nope, q_pe, kv = M.mla_prepare(cfg, lw, h, pos)
    a = M.mla_attend_expanded(cfg, lw, q_nope, q_pe, kv)
    b = M.mla_attend_absorbed(
        cfg, lw, q_nope, q_pe, kv[None], torch.zeros(L, dtype=torch.long), pos
    )
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def test_group_limited_routing(tiny):
    cfg, w = tiny
    logits = torch.randn(32, cfg.num_experts, generator=torch.Generator().manual_seed(1))
    idx, wt = M.select_experts(cfg, logits, w.layers[1]["gate_bias"])
    per_group = cfg.num_experts // cfg.n_group
    groups = (idx // per_group).tolist()
    assert all(len(set(r)) <= cfg.topk_group for r in groups)
    assert torch.allclose(wt.sum(-1), torch.full((32,), cfg.routed_scaling))


def test_grouped_layouts_agree(tiny):
    cfg, w = tiny
    lw = w.layers[1]
    h = torch.randn(6, cfg.hidden, generator=torch.Generator().manual_seed(2))
    ref = M.moe_reference(cfg, lw, h) - M.swiglu_mlp(h, lw["shared_w13"], lw["shared_w2"])
    idx, wt = M.select_experts(cfg, h @ lw["gate"].t(), lw["gate_bias"])
    E = cfg.num_experts
    x = torch.zeros(E, 6, cfg.hidden)
    cnt = torch.zeros(E, dtype=torch.int32)
    slot = {}
    for t in range(6):
        for k in range(cfg.top_k):
            e = int(idx[t, k])
            slot[(t, k)] = (e, int(cnt[e]))
            x[e, cnt[e]] = h[t]
            cnt[e] += 1
    y = M.grouped_experts_masked(x, cnt, lw["w13"], lw["w2"])
    out = torch.zeros_like(h)
    for (t, k), (e, s) in slot.items():
        out[t] += wt[t, k] * y[e, s]
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_ep_slices_match_full_model(tiny):
    cfg, full = tiny
    half = M.init_weights(cfg, seed=3, ep_rank=1, ep_size=2)
    assert torch.equal(half.layers[1]["w13"], full.layers[1]["w13"][4:])
    assert torch.equal(half.embed, full.embed)


def test_layer_cut_keeps_one_dense_layer():
    mc = M.get_model_config_layers("deepseek-v3", 4)
    assert (mc.num_layers, mc.first_k_dense) == (4, 1)
    rc = M.from_model_config(mc)
    assert rc.scoring == "sigmoid" and rc.routed_scaling == 2.5 and rc.q_lora_rank == 1536
