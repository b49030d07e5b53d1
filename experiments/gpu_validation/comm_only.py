"""The communication-only case: dispatch and combine of every MoE layer and nothing else, the
link model alone on both sides (target: within 5 %)."""

from __future__ import annotations

from functools import cache

COMM_ONLY = "comm-only"
COMM_OPS = frozenset({"dispatch_a", "dispatch_b", "combine_a", "combine_b"})


def _comm_inputs(ctx) -> None:
    """The micro-batch's rows and a fixed balanced routing: token t's slot j goes to expert
    (t*k + j) mod E."""
    import torch

    n, cfg, final = ctx.mb["padded_tokens"], ctx.cfg, ctx.step.final
    k = cfg.top_k
    slots = torch.arange(n * k, device=final.device)
    ctx.put("mlp_in", torch.zeros(n, cfg.hidden, dtype=final.dtype, device=final.device))
    ctx.put("topk_idx", (slots % cfg.num_experts).view(n, k))
    ctx.put("topk_w", torch.full((n, k), 1.0 / k, dtype=torch.float32, device=final.device))


def _comm_expert_out(ctx) -> None:
    """The received rows handed back to the combine as they are."""
    d = ctx.get("recv")
    ctx.put("expert_out", d["recv_x"] if d["ll"] else d["res"].recv_x)


@cache
def comm_kernels():
    """The kernel family (``real.kernels.KernelFamily``) of the two zero-work ops the
    communication-only Program has in place of the MoE layer's compute, ``comm.inputs`` and
    ``comm.expert_out``: run it with ``execute(..., kernels=[comm_kernels()])``. The simulator
    sees ops without work (no time)."""
    from overlap_lab.real.kernels import KernelFamily

    return KernelFamily(
        COMM_ONLY,
        "stand-ins of the MoE compute around dispatch and combine (the comm-only case)",
        {"comm.inputs": _comm_inputs, "comm.expert_out": _comm_expert_out},
    )


def comm_program(w, gpu):
    """The communication-only Program of ``w`` (:func:`comm_only` of serial's)."""
    from overlap_lab.shared import schedules as S

    return comm_only(S.build("serial", w, gpu))


def comm_only(prog):
    """``prog`` with every launch dropped but dispatch and combine (both halves, with their
    flows: the simulator's bytes), ``comm.inputs`` before each dispatch and ``comm.expert_out``
    before each combine; records, waits and host work kept. Predicted, it is the link model
    (plus the comm kernels' local work); measured, the emulated backend's kernels and data
    path (with :func:`comm_kernels`). Also a ``transform`` for ``overlap_lab.simulate``."""
    import dataclasses as dc

    from overlap_lab.shared.ir.program import Graph, Launch, Op

    def zero(op, name: str) -> Op:
        return Op(name, layer=op.layer, mb=op.mb, step=op.step, tokens=op.tokens)

    def body(instrs):
        out = []
        for ins in instrs:
            if isinstance(ins, Graph):
                out.append(dc.replace(ins, body=tuple(body(ins.body))))
            elif isinstance(ins, Launch):
                if ins.op.name == "dispatch_a":
                    out.append(Launch(zero(ins.op, "comm.inputs"), ins.stream))
                elif ins.op.name == "combine_a":
                    out.append(Launch(zero(ins.op, "comm.expert_out"), ins.stream))
                if ins.op.name in COMM_OPS:
                    out.append(ins)
            else:
                out.append(ins)
        return out

    ranks = tuple(
        dc.replace(
            rp, threads=tuple(dc.replace(th, instrs=tuple(body(th.instrs))) for th in rp.threads)
        )  # fmt: skip
        for rp in prog.ranks
    )
    return dc.replace(prog, ranks=ranks, meta=prog.meta.merged(schedule=COMM_ONLY))
