"""The MLP half: the dense MLP, the router, routed experts (whole, or LightLLM's and SBO's split
kernels), the shared expert and their sum. Communication (dispatch, combine) is ``ep_comm``'s."""

from __future__ import annotations

import torch

from overlap_lab.real import fp8
from overlap_lab.real import model as M
from overlap_lab.real.kernels.context import KernelCtx
from overlap_lab.real.kernels.registry import KernelFamily
from overlap_lab.real.moe_ep import ep_gather, ep_scatter, silu_and_mul


def dense_mlp(ctx: KernelCtx) -> None:
    x = ctx.get("mlp_in")
    with ctx.sm_budget(x.device) as g:
        ctx.put("hidden", M.swiglu_mlp(x, ctx.lw["mlp_w13"], ctx.lw["mlp_w2"], mm=g.mm))


def gate(ctx: KernelCtx) -> None:
    x = ctx.get("mlp_in")
    with ctx.sm_budget(x.device) as g:
        ctx.put("router_logits", g.linear(x, ctx.lw["gate"]))


def select_experts(ctx: KernelCtx) -> None:
    idx, w = M.select_experts(ctx.cfg, ctx.get("router_logits"), ctx.lw.get("gate_bias"))
    ctx.put("topk_idx", idx)
    ctx.put("topk_w", w)


def experts(ctx: KernelCtx) -> None:
    d, lw = ctx.get("recv"), ctx.lw
    with ctx.sm_budget(lw["w13"].device) as g:
        if d["ll"]:
            rx = d["recv_x"]
            y = M.grouped_experts_masked(
                rx, d["count"], lw["w13"], lw["w2"], gemm=g, expected_m=_expected_m(ctx, rx)
            )
        else:
            r = d["res"]
            y = M.experts_weighted(
                r.recv_x, r.recv_topk_idx, r.recv_topk_weights, lw["w13"], lw["w2"], gemm=g
            )
    ctx.put("expert_out", y)


# SBO (shared/schedules/sbo.py, mode 1): the experts op split into the gate-up GEMM and slices
# of the down GEMM, each slice signalled (an event) to one slice of the combine on the alt stream.
# Slice k of the down GEMM covers local experts [k*E/n, (k+1)*E/n); combine slice k reads the
# rows of slice k (so the CPU check proves each is ordered after its signal) and the last slice
# issues the combine of all rows (DeepEP sends per signalled block; the data are the same).


def _expected_m(ctx: KernelCtx, rx: torch.Tensor) -> int:
    """DeepGEMM's ``expected_m`` for the low-latency layout: the routing's mean rows per local
    expert from host numbers (tokens of this micro-batch on every rank), not the padded rows."""
    from overlap_lab.real.gemm import expected_rows

    be = ctx.backend
    return expected_rows(ctx.real_rows(), ctx.cfg.top_k, ctx.cfg.num_experts, be.world, rx.shape[1])


def _expert_groups(num_local: int, n: int) -> list[range]:
    return [range(k * num_local // n, (k + 1) * num_local // n) for k in range(n)]


# LightLLM's grouped_fused_moe_ep kernels (shared/schedules/lightllm.py, expert_kernels): each
# op does its own part (real/moe_ep.py): scatter (normal layout: received rows -> expert-contiguous
# rows), the gate-up GEMM only, SiLU-and-mul (+ FP8 quantisation of the down GEMM's input when the
# GEMMs run in FP8), the down GEMM only, the weighted gather back to token order. A Program with
# no activation op of its own (SBO's gate-up + down slices) gets the activation in the gate-up op;
# one with no scatter takes the received rows through the unsplit path.


def _folded(ctx: KernelCtx) -> bool:
    """Whether the Program runs the grouped GEMMs whole (``experts``): then that op computes
    the whole MoE (``M.experts_weighted`` / ``grouped_experts_masked``) and the passes around
    its GEMMs (scatter, activation, quantisation, gather) are folded into it here."""
    if ctx.launched("experts"):
        ctx.note("computed inside experts on this backend")
        return True
    return False


def experts_scatter(ctx: KernelCtx) -> None:
    if _folded(ctx):
        return
    d = ctx.get("recv")
    if d["ll"]:  # the low-latency layout is already expert-major: nothing to permute
        ctx.note("no-op: DeepEP's low-latency layout is already expert-contiguous")
        return
    r = d["res"]
    ctx.put("expert_scatter", ep_scatter(r.recv_x, r.recv_topk_idx, ctx.lw["w13"].shape[0]))


def _put_gate_up(ctx: KernelCtx, y: torch.Tensor) -> None:
    if ctx.launched("experts.act_quant") or ctx.launched("experts.act"):
        ctx.put("expert_gate_up", y)
    else:
        ctx.put("expert_act", silu_and_mul(y))


def experts_gate_up(ctx: KernelCtx) -> None:
    d, lw = ctx.get("recv"), ctx.lw
    sc = None if d["ll"] else ctx.get("expert_scatter", None)
    with ctx.sm_budget(lw["w13"].device) as gm:
        if d["ll"]:
            rx = d["recv_x"]
            y = M.grouped_gemm_masked(rx, lw["w13"], d["count"], gm, _expected_m(ctx, rx))
        elif sc is not None:
            y = M.grouped_gemm_contiguous(sc.rows, lw["w13"], sc.counts, gm)
        else:  # normal layout, no scatter op: both GEMMs run per down slice (below)
            ctx.put("expert_act", None)
            return
    _put_gate_up(ctx, y)


def experts_act_quant(ctx: KernelCtx) -> None:
    """``silu_and_mul_masked_post_quant_fwd``: the activation; the FP8 quantisation only where
    the down GEMM runs in FP8 (else reported: the GEMMs take BF16 inputs)."""
    if _folded(ctx):
        return
    act = silu_and_mul(ctx.get("expert_gate_up"))
    if ctx.precision.fp8:  # the down GEMM takes FP8 + per-token scales
        ctx.put("expert_act", fp8.quant_tokens(act))
        return
    ctx.note(f"quantisation not run: the expert GEMMs run in BF16 ({ctx.precision.reason})")
    ctx.put("expert_act", act)


def experts_act(ctx: KernelCtx) -> None:
    """``silu_and_mul`` alone (its quantisation, where the GEMMs run in FP8, is
    ``experts.quant``'s)."""
    if _folded(ctx):
        return
    ctx.put("expert_act", silu_and_mul(ctx.get("expert_gate_up")))


def experts_quant(ctx: KernelCtx) -> None:
    """``per_token_group_quant_fp8`` of the down GEMM's input."""
    if _folded(ctx):
        return
    if ctx.precision.fp8:
        ctx.put("expert_act", fp8.quant_tokens(ctx.get("expert_act")))
    else:
        ctx.note(f"quantisation not run: the expert GEMMs run in BF16 ({ctx.precision.reason})")


def experts_down(ctx: KernelCtx) -> None:
    k, n = ctx.piece
    d, lw, act = ctx.get("recv"), ctx.lw, ctx.get("expert_act")
    grp = _expert_groups(lw["w13"].shape[0], n)[k]
    sl = slice(grp.start, grp.stop)
    sc = None if d["ll"] else ctx.get("expert_scatter", None)
    if d["ll"] and ctx.sbo_signal:
        ctx.put(f"expert_out.{k}", (grp, _signalled_down(ctx, act, sl)))
        return
    with ctx.sm_budget(lw["w2"].device) as g:
        if d["ll"]:
            em = _expected_m(ctx, _rows_of(act))
            y = M.grouped_gemm_masked(_rows(act, sl), lw["w2"][sl], d["count"][sl], g, em)
        elif sc is not None:  # expert-contiguous rows: this slice's experts are one row range
            lo, hi = sum(sc.counts[: grp.start]), sum(sc.counts[: grp.stop])
            y = M.grouped_gemm_contiguous(_rows(act, slice(lo, hi)), lw["w2"][sl], sc.counts[sl], g)
        else:
            r = d["res"]
            idx = r.recv_topk_idx
            mine = (idx >= grp.start) & (idx < grp.stop)
            y = M.experts_weighted(
                r.recv_x,
                torch.where(mine, idx, -1),
                r.recv_topk_weights,
                lw["w13"],
                lw["w2"],
                gemm=g,
            )
    ctx.put(f"expert_out.{k}", (grp, y))
    if sc is None and n == 1 and not ctx.op.waits:  # LightLLM's one down GEMM (no SBO signals)
        ctx.put("expert_out", assemble_expert_out(ctx, 1))


def _signalled_down(ctx: KernelCtx, act, sl: slice) -> torch.Tensor:
    """SBO mode 1's down GEMM slice ``sl`` of local experts, through the Triton masked kernel
    that writes SBO's signal (DeepGEMM's BF16 masked kernel has none) within the op's SM
    budget, into the layer's one output and signal tensor (made by the first slice), so the
    combine can send each 64-row block as soon as its signal completes."""
    from overlap_lab.real import gemm as G

    d, w2 = ctx.get("recv"), ctx.lw["w2"]
    x = fp8.dequant(_rows(act, sl))
    rows = _rows_of(act).shape[1]
    down = ctx.get("sbo_down", None)
    if down is None or down["layer"] != ctx.op.layer:
        E = _rows_of(act).shape[0]
        y = torch.empty(E, rows, w2.shape[1], dtype=x.dtype, device=x.device)
        sig = torch.zeros(*G.signal_shape(E, rows), dtype=torch.int32, device=x.device)
        down = {"layer": ctx.op.layer, "y": y, "signal": sig, "block_m": G.BLOCK_M}
        down["threshold"] = G.signal_threshold(w2.shape[1])
        ctx.put("sbo_down", down)
    with ctx.sm_budget(w2.device) as g:
        sms = g.sms or ctx.op.sms or 1
        G.grouped_matmul_masked(
            x, w2[sl], d["count"][sl], num_sms=sms, out=down["y"][sl], signal=down["signal"][sl]
        )
        g.note("triton_persistent (SBO signal)")
    return down["y"][sl]


def _rows_of(act):
    """The activation tensor (an FP8 activation is a (values, scales) pair)."""
    return act[0] if isinstance(act, tuple) else act


def _rows(act, sl: slice):
    return tuple(t[sl] for t in act) if isinstance(act, tuple) else act[sl]


def experts_gather(ctx: KernelCtx) -> None:
    """``ep_gather``: each received row's expert outputs, weighted, summed in token order."""
    if _folded(ctx):
        return
    d = ctx.get("recv")
    if d["ll"]:  # the low-latency combine reduces; nothing to gather here
        ctx.note("no-op: DeepEP's low-latency combine does the weighted reduction")
        return
    sc, r = ctx.get("expert_scatter"), d["res"]
    n = ctx.pieces("experts.down")
    y = torch.cat([ctx.get(f"expert_out.{j}")[1] for j in range(n)])
    ctx.put("expert_out", ep_gather(y, sc.output_index, r.recv_topk_weights, r.recv_x.dtype))


def assemble_expert_out(ctx: KernelCtx, n: int) -> torch.Tensor:
    parts = [ctx.get(f"expert_out.{j}") for j in range(n)]
    if ctx.get("recv")["ll"]:
        return torch.cat([y for _, y in parts])
    return sum(y for _, y in parts)


def shared_experts(ctx: KernelCtx) -> None:
    lw = ctx.lw
    x = ctx.get("mlp_in")
    if "shared_w13" not in lw:  # Qwen3: no shared expert, the op carries no work
        ctx.put("shared_out", None)
        return
    with ctx.sm_budget(x.device) as g:
        ctx.put("shared_out", M.swiglu_mlp(x, lw["shared_w13"], lw["shared_w2"], mm=g.mm))


def output(ctx: KernelCtx) -> None:
    # A schedule may drop shared_experts when the model has none (its op carries no work);
    # dropping it for a model that has one shows up as a difference from serial.
    y, s = ctx.get("moe_out"), ctx.get("shared_out", None)
    ctx.put("hidden", y if s is None else y + s)


FAMILY = KernelFamily(
    "moe",
    "dense MLP, router, routed experts (whole or split: LightLLM, SBO), shared expert, output",
    {
        "mlp": dense_mlp,
        "gate": gate,
        "select_experts": select_experts,
        "experts": experts,
        "experts.scatter": experts_scatter,
        "experts.gate_up": experts_gate_up,
        "experts.act": experts_act,
        "experts.quant": experts_quant,
        "experts.act_quant": experts_act_quant,
        "experts.gather": experts_gather,
        "shared_experts": shared_experts,
        "output": output,
    },
    {"experts.down": experts_down},
)
