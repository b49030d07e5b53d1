"""The GPU path's host-sync discipline and CUDA-graph plans, checked on the CPU.

- Low-latency dispatch -> masked experts -> combine (local and emulated backends) calls nothing
  that reads a device value on the host (tolist, item, nonzero, bincount, boolean indexing, ...):
  a TorchFunctionMode records every such call, also inside the executor's MoE kernels for every
  schedule on a decode batch. The normal path takes exactly its one named host wait.
- plan_graph: capture stream, forked streams, skipped external waits, exported events, and the
  cases that must run op by op.
"""

import pytest

torch = pytest.importorskip("torch")

from torch.overrides import TorchFunctionMode  # noqa: E402

from overlap_lab.real import kernels as K  # noqa: E402
from overlap_lab.real import model as M  # noqa: E402
from overlap_lab.real.check import default_workloads  # noqa: E402
from overlap_lab.real.comm import make_backend  # noqa: E402
from overlap_lab.real.executor import execute, plan_graph, plan_graphs  # noqa: E402
from overlap_lab.shared import schedules as S  # noqa: E402
from overlap_lab.shared.inputs.hardware import get_gpu  # noqa: E402
from overlap_lab.shared.ir.program import Graph, Launch, Op, Record, Wait, WaitStream  # noqa: E402

GPU = get_gpu("h100")
SYNCING = {
    "tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "bincount",
    "unique", "masked_select", "cpu", "numpy", "_local_scalar_dense", "equal", "allclose",
}  # fmt: skip


class HostReads(TorchFunctionMode):
    """Records torch calls that make the host wait for the device on CUDA."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in SYNCING:
            self.calls.append(name)
        elif name in ("__getitem__", "__setitem__", "index_put_", "index_put"):
            idx = args[1] if len(args) > 1 else None
            items = idx if isinstance(idx, (tuple, list)) else (idx,)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items):
                self.calls.append(f"{name}[bool mask]")
        elif name == "repeat_interleave" and "output_size" not in kwargs:
            self.calls.append(name)
        elif name in ("to", "copy_") and args and isinstance(args[0], torch.Tensor):
            dst = [a for a in (*args[1:], kwargs.get("device")) if a is not None]
            src = args[0].device
            if any(
                (isinstance(a, (str, torch.device)) and torch.device(a) != src)
                or (isinstance(a, torch.Tensor) and a.device != src)
                for a in dst
            ):
                self.calls.append(f"{name}(other device)")
        return func(*args, **kwargs)


@pytest.mark.parametrize("backend", ["local", "emulated"])
def test_low_latency_path_has_no_host_reads(backend):
    cfg = M.get_config("tiny-mla")
    lw = M.init_weights(cfg, seed=1).layers[1]
    h = torch.randn(10, cfg.hidden, generator=torch.Generator().manual_seed(0))
    idx, wt = M.select_experts(cfg, h @ lw["gate"].t(), lw["gate_bias"])
    idx[3, 1] = -1  # a masked slot
    ref = M.experts_weighted(h, idx, wt, lw["w13"], lw["w2"])
    be = make_backend(backend, rank=0, world=1, num_experts=cfg.num_experts, hidden=cfg.hidden)
    with HostReads() as hr:
        rx, cnt, handle, _, hook = be.low_latency_dispatch(
            h, idx, 16, cfg.num_experts, return_recv_hook=True
        )
        hook()
        y = M.grouped_experts_masked(rx, cnt, lw["w13"], lw["w2"])
        out, _, hook = be.low_latency_combine(y, idx, wt, handle, return_recv_hook=True)
        hook()
    assert hr.calls == []
    assert be.host_waits == {}
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    assert cnt.dtype == torch.int32 and int(cnt.sum()) == int((idx >= 0).sum())
    # the normal path keeps one named host wait per dispatch (DeepEP's moe_recv_counter)
    r = be.dispatch(h, idx, wt)
    be.combine(M.experts_weighted(r.recv_x, r.recv_topk_idx, r.recv_topk_weights, lw["w13"], lw["w2"]), r.handle)  # fmt: skip
    assert be.host_waits == {"normal_dispatch: recv counts": 1}
    t = be.traffic.by_kind  # device-side accounting, read back after the run
    assert t["ll_dispatch"]["messages"] == int((idx >= 0).sum()) == t["ll_combine"]["messages"]


def test_mirror_layout_keeps_arrival_order_and_bytes():
    """World 4, 8 experts: rank 0 receives, per local expert, the rows of each mirrored source
    rank in order (source rank, token, slot); counts and remote bytes as DeepEP would see."""
    from overlap_lab.real.comm.bytes import message_bytes

    be = make_backend("local", rank=0, world=4, num_experts=8, hidden=4)
    x = torch.arange(3, dtype=torch.float32)[:, None].repeat(1, 4)  # row t holds t
    idx = torch.tensor([[0, 7], [2, 3], [4, 1]])
    rx, cnt, handle, _, _ = be.low_latency_dispatch(x, idx, 4, 8)
    assert rx.shape == (2, 16, 4) and cnt.tolist() == [3, 3]
    # local expert 0 <- experts 0 (src 0: token 0), 2 (src 1: token 1), 4 (src 2: token 2)
    assert rx[0, :3, 0].tolist() == [0.0, 1.0, 2.0]
    # local expert 1 <- experts 3 (src 1: token 1), 7 (src 3: token 0) and 1 (src 0: token 2)
    assert rx[1, :3, 0].tolist() == [2.0, 1.0, 0.0]
    assert be.last_bytes.remote == 4 * message_bytes("ll_dispatch", 4)


def test_moe_kernels_of_every_schedule_read_nothing_back_in_low_latency_mode():
    """dispatch_a .. combine_b of each schedule on a decode batch, under HostReads."""
    hr = HostReads()
    moe = ("dispatch_a", "dispatch_b", "experts", "experts.gate_up", "combine_a", "combine_b")

    def watched(fn):
        def run(ctx):
            if ctx.ll_mode("a") if ctx.op.name.startswith("dispatch_a") else True:
                with hr:
                    return fn(ctx)
            return fn(ctx)

        return run

    b = K.bindings()
    watching = K.KernelFamily(
        "watched",
        "the MoE kernels under HostReads",
        {n: watched(b.ops.kernels[n]) for n in moe},
        {n: watched(b.pieces.kernels[n]) for n in ("experts.down", "combine_a")},
    )
    w = default_workloads()[0]
    assert w.batch.mode == "decode"
    ran = []
    for name in S.available():
        try:
            prog = S.build(name, w, GPU)
        except Exception:  # a schedule may refuse a workload
            continue
        execute(prog, w, kernels=[watching])
        ran.append(name)
    assert {"serial", "sbo", "tbo"} <= set(ran)
    assert hr.calls == [], sorted(set(hr.calls))


# -- CUDA graph capture plans --------------------------------------------------------------------


def _op(name, **kw):
    return Op(name, layer=kw.pop("layer", 1), mb=0, step=kw.pop("step", 0), **kw)


def test_capture_plan_forks_side_streams_and_skips_external_waits():
    body = (
        Wait("main", "before"),  # recorded outside the graph: satisfied by the join-in
        Launch(_op("experts.gate_up"), "main"),
        Record("sig0", "main"),
        Wait("alt", "sig0"),  # recorded inside: kept
        Launch(_op("combine_a"), "alt"),
        Record("sent", "alt"),
        WaitStream("main", "alt"),
        Launch(_op("combine_b"), "main"),
    )
    p = plan_graph(Graph("forward", body))
    assert p.capture_stream == "main" and p.streams == ("main", "alt")
    assert p.skip_waits == (0,) and p.exported_events == ("sent", "sig0")
    assert p.eager_reason is None and p.step == 0
    # a kernel with tensors before the graph in its step feeds it: not static, run op by op
    p = plan_graph(Graph("forward", body), before=[_op("embed", layer=None)])
    assert p.eager_reason and "embed" in p.eager_reason
    # metadata kernels with no tensors may precede it
    assert plan_graph(Graph("g", body), before=[_op("h2d_input_ids")]).eager_reason is None
    assert plan_graph(Graph("g", ())).eager_reason == "empty body"


def test_every_decode_graph_of_every_schedule_is_capturable_as_planned():
    w = default_workloads()[0]
    n = 0
    for name in S.available():
        try:
            prog = S.build(name, w, GPU)
        except Exception:
            continue
        for rp in prog.ranks:
            for plan in plan_graphs(rp).values():
                assert plan.eager_reason is None, (name, plan)
                n += 1
    assert n >= 5
