"""Expert-parallel communication: DeepEP's two halves of dispatch and combine through the run's
backend (``real.comm``), and SBO's combine slices that wait on the down GEMM's signals."""

from __future__ import annotations

from overlap_lab.real.kernels.context import KernelCtx
from overlap_lab.real.kernels.moe import assemble_expert_out
from overlap_lab.real.kernels.registry import KernelFamily


def dispatch_a(ctx: KernelCtx) -> None:
    """Issue the dispatch: DeepEP low-latency with a receive hook (role send), or normal mode
    with async_finish (role sendrecv). Nothing is received here."""
    x, idx, w = ctx.get("mlp_in"), ctx.get("topk_idx"), ctx.get("topk_w")
    be = ctx.backend
    ll = ctx.ll_mode("a")
    if ctx.op.sms:
        be.set_num_sms(ctx.op.sms, kind="ll_dispatch" if ll else "normal_dispatch")
    if ll:
        rx, cnt, handle, _ev, hook = be.low_latency_dispatch(
            x, idx, ctx.max_dispatch_tokens, ctx.cfg.num_experts, return_recv_hook=True
        )
        ctx.put(
            "dispatch", {"ll": True, "recv_x": rx, "count": cnt, "handle": handle, "done": hook}
        )
    else:
        r = be.dispatch(x, idx, w, async_finish=True)
        ctx.put("dispatch", {"ll": False, "res": r, "done": r.event})


def dispatch_b(ctx: KernelCtx) -> None:
    """Complete the dispatch: the hook (LL) or the event wait (normal)."""
    d = ctx.get("dispatch")
    d["done"]()
    ctx.put("recv", d)


def combine_a_piece(ctx: KernelCtx) -> None:
    k, n = ctx.piece
    ctx.get(f"expert_out.{k}")  # this slice waits for its signal
    if k < n - 1:
        return
    ctx.put("expert_out", assemble_expert_out(ctx, n))
    combine_a(ctx)


def combine_a(ctx: KernelCtx) -> None:
    sbo = None
    if ctx.op.waits and ctx.sbo_signal:  # SBO mode 1, polling: see _signalled_down
        down = ctx.get("sbo_down")
        ctx.note(
            f"launched after the start event, not after the signals' events: the "
            f"{ctx.backend.name} combine polls the down GEMM's per-block signals in-kernel on "
            f"{ctx.op.sms} SMs (overlap possible on a GPU; the CPU interpreter runs it after)",
        )
        ctx.put("expert_out", down["y"])
        sbo = {k: down[k] for k in ("signal", "block_m", "threshold")}
        sbo.update(num_sms=ctx.op.sms, packed_recv_count=ctx.get("recv")["count"])
    elif ctx.op.waits:  # SBO mode 1: one combine over the signalled slices of the down GEMM
        ctx.note(
            "launched after the whole down GEMM: the executor does not poll SBO's per-block "
            "signals inside a kernel, so no down-GEMM/combine overlap is measured",
        )
        ctx.put("expert_out", assemble_expert_out(ctx, len(ctx.op.waits)))
    y, d = ctx.get("expert_out"), ctx.get("dispatch")
    be = ctx.backend
    if ctx.op.sms:
        be.set_num_sms(ctx.op.sms, kind="ll_combine" if d["ll"] else "normal_combine")
    if d["ll"]:
        extra = {"sbo": sbo} if sbo is not None else {}
        out, _ev, hook = be.low_latency_combine(
            y, ctx.get("topk_idx"), ctx.get("topk_w"), d["handle"], return_recv_hook=True, **extra
        )
        ctx.put("combine", {"out": out, "done": hook})
    else:
        out, _, ev = be.combine(y, d["res"].handle, async_finish=True)
        ctx.put("combine", {"out": out, "done": ev})


def combine_b(ctx: KernelCtx) -> None:
    c = ctx.get("combine")
    c["done"]()
    ctx.put("moe_out", c["out"])


FAMILY = KernelFamily(
    "ep-comm",
    "DeepEP dispatch and combine, issue and completion halves (normal or low-latency)",
    {
        "dispatch_a": dispatch_a,
        "dispatch_b": dispatch_b,
        "combine_a": combine_a,
        "combine_b": combine_b,
    },
    {"combine_a": combine_a_piece},
)
