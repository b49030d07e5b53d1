"""real/comm: byte accounting (pure), loopback EP data path against a dense MoE, deps."""

import pytest

from overlap_lab.real.comm.bytes import LinkParams, all_to_all_bytes, message_bytes


def test_message_bytes_follow_deepep():
    assert message_bytes("ll_dispatch", 7168, use_fp8=True) == 16 + 7168 + 56 * 4
    assert message_bytes("ll_dispatch", 7168) == 16 + 2 * 7168
    assert message_bytes("ll_combine", 7168) == 2 * 7168
    assert message_bytes("normal_dispatch", 7168, num_topk=8) == 2 * 7168 + 8 * 12


def test_all_to_all_bytes_split_local_nvlink_rdma():
    # 16 experts over 4 ranks (4 each), 2 ranks per node; rank 0 sends token 0 to experts 0
    # (itself) and 9 (rank 2, other node), token 1 to experts 4, 5 (rank 1, same node).
    topk = [[0, 9], [4, 5]]
    ll = all_to_all_bytes(
        "ll_dispatch", topk, num_experts=16, rank=0, world=4, hidden=256, gpus_per_node=2
    )
    m = message_bytes("ll_dispatch", 256)
    assert (ll.local, ll.nvlink, ll.rdma, ll.messages) == (m, 2 * m, m, 4)
    nm = all_to_all_bytes(
        "normal_dispatch", topk, num_experts=16, rank=0, world=4, hidden=256, gpus_per_node=2
    )
    m = message_bytes("normal_dispatch", 256, num_topk=2)
    assert (nm.local, nm.nvlink, nm.rdma, nm.messages) == (m, m, m, 3)  # dedup per rank
    link = LinkParams(nvlink_gbps=100, nvlink_lat_us=2, rdma_gbps=10, rdma_lat_us=5)
    assert link.arrival_us(nm) == pytest.approx(max(2 + m / 1e5, 5 + m / 1e4))


torch = pytest.importorskip("torch")


@pytest.mark.parametrize("backend", ["local", "emulated"])
def test_dispatch_combine_match_dense_moe(backend):
    from overlap_lab.real import model as M
    from overlap_lab.real.comm import make_backend

    cfg = M.get_config("tiny-mla")
    w = M.init_weights(cfg, seed=1)
    lw = w.layers[1]
    h = torch.randn(10, cfg.hidden, generator=torch.Generator().manual_seed(0))
    ref = M.moe_reference(cfg, lw, h) - M.swiglu_mlp(h, lw["shared_w13"], lw["shared_w2"])
    idx, wt = M.select_experts(cfg, h @ lw["gate"].t(), lw["gate_bias"])
    be = make_backend(backend, rank=0, world=1, num_experts=cfg.num_experts, hidden=cfg.hidden)
    r = be.dispatch(h, idx, wt, async_finish=True)
    r.event.current_stream_wait()
    y = M.experts_weighted(r.recv_x, r.recv_topk_idx, r.recv_topk_weights, lw["w13"], lw["w2"])
    out, _, ev = be.combine(y, r.handle, async_finish=True)
    ev.current_stream_wait()
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    rx, cnt, handle, _, hook = be.low_latency_dispatch(
        h, idx, 16, cfg.num_experts, return_recv_hook=True
    )
    hook()
    assert int(cnt.sum()) == 10 * cfg.top_k and rx.shape == (8, 16, cfg.hidden)
    y = M.grouped_experts_masked(rx, cnt, lw["w13"], lw["w2"])
    out, _, hook = be.low_latency_combine(y, idx, wt, handle, return_recv_hook=True)
    hook()
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_emulated_mirror_counts_remote_bytes_and_ctas():
    from overlap_lab.real.comm import make_backend
    from overlap_lab.real.comm.emulated import ll_num_ctas

    be = make_backend("emulated", rank=0, world=4, num_experts=8, hidden=64, device_sms=132)
    x = torch.randn(3, 64)
    idx = torch.tensor([[0, 7], [2, 3], [4, 1]])
    rx, cnt, handle, _, hook = be.low_latency_dispatch(x, idx, 4, 8, return_recv_hook=True)
    hook()
    assert rx.shape == (2, 16, 64) and int(cnt.sum()) == 6  # every copy lands, relabelled
    rec = be.launches[-1]
    assert rec["remote_bytes"] == 4 * message_bytes("ll_dispatch", 64)  # experts 0, 1 are local
    assert rec["ctas"] == ll_num_ctas(8, 132) == 8
    assert be.describe()["emulated"] and be.describe()["backend"] == "emulated"


def test_deps_report_and_actionable_errors():
    from overlap_lab.real import deps

    info = deps.probe()
    assert info["torch"]["importable"]
    with pytest.raises(ImportError, match="tokenspeed-deepep|not importable"):
        deps.require("deep_ep", why="--backend deepep") if not deps.available("deep_ep") else (
            (_ for _ in ()).throw(ImportError("not importable"))
        )
    assert any(line.startswith("deep_gemm") for line in deps.report())
