"""Point to point between the in-process ranks of one Program (pipeline parallelism,
shared/schedules/pp.py): a micro-batch's tensors move through the executor's mailbox, keyed by
the collective's key (the send's ``Flow(dst=rank)`` and the recv on that rank share it). A
receive whose send has not run yet raises ``WouldBlock`` and the executor retries it after the
other ranks progressed."""

from __future__ import annotations

import torch

from overlap_lab.real.kernels.context import KernelCtx, WouldBlock
from overlap_lab.real.kernels.registry import KernelFamily

SEND_OPS = ("send",)  # a generic point-to-point pair (tests and hand-written Programs)
RECV_OPS = ("recv",)
PP_HIDDEN = ("hidden", "residual")  # DeepSeek's PPProxyTensors: what a stage hands on
PP_OUT = ("next_ids",)  # the last stage's sampled ids: back to rank 0, relayed round the ring


def _p2p_key(ctx: KernelCtx) -> str:
    return ctx.op.coll.key if ctx.op.coll is not None else ctx.op.name


def _post(ctx: KernelCtx, payload: dict) -> None:
    if ctx.world is None:
        raise RuntimeError(f"op {ctx.op.name}: point-to-point needs an in-process world")
    ts = [v for v in payload.values() if isinstance(v, torch.Tensor) and v.is_cuda]
    ts += [t for v in payload.values() if isinstance(v, tuple) for t in v if t.is_cuda]
    if ts:  # the receiving rank's stream waits for the sender's (ranks share one process)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(ts[0].device))
        payload = {**payload, "_event": ev}
    ctx.world.send(_p2p_key(ctx), ctx.rank, payload)


def _take(ctx: KernelCtx) -> dict:
    key = _p2p_key(ctx)
    payload = ctx.world.recv(key, ctx.rank) if ctx.world is not None else None
    if payload is None:
        raise WouldBlock(key)
    ev = payload.pop("_event", None)
    if ev is not None:
        torch.cuda.current_stream().wait_event(ev)
    return payload


def p2p_send(ctx: KernelCtx) -> None:
    keys = [k for k in ("hidden", "residual", "next_ids") if k in ctx.state]
    _post(ctx, {k: ctx.get(k) for k in keys})


def p2p_recv(ctx: KernelCtx) -> None:
    for k, v in _take(ctx).items():
        ctx.put(k, v)


def pp_send_hidden(ctx: KernelCtx) -> None:
    """A non-last stage hands the micro-batch's hidden state and residual (after its last
    layer) to the next stage."""
    _post(ctx, {k: ctx.get(k) for k in PP_HIDDEN})


def pp_send_out(ctx: KernelCtx) -> None:
    """The last stage sends the ids it sampled for this micro-batch to rank 0; a non-last stage
    relays the ids it received in an earlier iteration (SGLang's ``pp_outputs``: the latest
    ones, received in the previous micro-batch iteration) to the next stage."""
    if "next_ids" in ctx.state:  # sampled here (the last stage)
        _post(ctx, {k: ctx.get(k) for k in PP_OUT})
        return
    step, idx = _latest_received(ctx)
    _post(ctx, {k: ctx.get_at(step, idx, k) for k in PP_OUT})


def _latest_received(ctx: KernelCtx) -> tuple[int, int]:
    """(step, micro-batch) of the latest ids this rank received before the op's step."""
    steps = ctx.steps or {}
    here = ctx.op.step if ctx.op.step is not None else 0
    for s in sorted((s for s in steps if s < here), reverse=True):
        for idx, st in steps[s].mbs.items():
            if "next_ids" in st:
                return s, idx
    raise KeyError(
        f"op {ctx.op.name} (step {here}, mb {ctx.mb['index']}) relays next_ids, which this rank "
        "neither sampled nor received in an earlier iteration"
    )


def pp_allgather(ctx: KernelCtx) -> None:
    """send-allgather inside attention TP: each rank got its 1/attn_tp slice over the PP link
    and gathers the rest; in-process the receive already holds the whole tensors (read here so
    the CPU check orders the gather after the receive)."""
    for k in PP_HIDDEN if ctx.op.name.endswith("hidden") else PP_OUT:
        ctx.get(k)


FAMILY = KernelFamily(
    "p2p",
    "send/recv between in-process ranks: pp's hidden hand-over and sampled-id relay",
    {
        **dict.fromkeys(SEND_OPS, p2p_send),
        **dict.fromkeys((*RECV_OPS, "pp_recv_hidden", "pp_recv_out"), p2p_recv),
        "pp_send_hidden": pp_send_hidden,
        "pp_send_out": pp_send_out,
        "pp_allgather_hidden": pp_allgather,
        "pp_allgather_out": pp_allgather,
    },
)
