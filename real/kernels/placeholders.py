"""Ops with no numerical effect here: host-side scheduler work launched on the GPU, copies of
inputs the executor already holds, and the attention half's own GEMMs this backend computes
inside another op. Bound so every schedule's Program runs, and each says so in the run's
``kernel_notes`` or real/README.md."""

from __future__ import annotations

from overlap_lab.real.kernels.context import KernelCtx
from overlap_lab.real.kernels.registry import KernelFamily

NOOP_OPS = (
    "noop",  # hand-written Programs and tests
    # SGLang's overlap scheduler (shared/ir/ops_sched.py): metadata kernels on the schedule stream
    # and the FutureMap's resolve/store. The executor's inputs and token ids are already on the
    # device, so these compute nothing here; on a GPU their (small) kernel time is therefore not
    # measured (real/README.md).
    "h2d_input_ids",
    "out_cache_loc_cast",
    "req_to_token_gather",
    "req_to_token_scatter",
    "resolve_future",
    "seq_lens_add",
    "seq_lens_clone",
    "seq_lens_next",
    "store_to_map",
    "write_req_to_token_pool_triton",
)


def noop(ctx: KernelCtx) -> None:
    return None


#: The attention half's own GEMMs, the quantisation kernels in front of FP8 GEMMs and the small
#: kernels a deployment runs around them (``shared.ir.ops.PARTS``, ``shared.ir.ops_kernels``):
#: the simulator times each; this backend computes them inside another op (the op of their key,
#: whose FP8 GEMMs quantise their own inputs: real/fp8.py; DeepEP's layout and notify kernels run
#: inside the backend's ``dispatch``/``combine``, which moves the activation in its own dtype),
#: so here each is an empty kernel that says where.
FOLDED_OPS: dict[str, str] = {
    "attn.quant": "attn.prepare",
    "attn.norm": "attn.prepare",
    "attn.uk_quant": "attn.prepare",
    "attn.absorb_k": "attn.prepare",
    "attn.rope": "attn.prepare",
    "attn.kv_write": "attn.prepare",
    "attn.uv_quant": "attn.core",
    "attn.absorb_v": "attn.core",
    "attn.o_quant": "attn.core",
    "attn.o_proj": "attn.core",
    "select_experts.ids": "select_experts",
    "dispatch.quant": "dispatch_a",
    "get_dispatch_layout": "dispatch_a",
    "notify_dispatch": "dispatch_a",
    "cached_notify": "combine_a",
    "shared_experts.quant": "shared_experts",
    "shared_experts.act": "shared_experts",
    "mlp.quant": "mlp",
    "mlp.act": "mlp",
    "final_norm": "logits",
}


def folded(ctx: KernelCtx) -> None:
    ctx.note(f"computed inside {FOLDED_OPS[ctx.op.name]} on this backend")


FAMILY = KernelFamily(
    "placeholders",
    "no-op kernels (SGLang's scheduler metadata ops) and ops folded into another op",
    {**dict.fromkeys(NOOP_OPS, noop), **dict.fromkeys(FOLDED_OPS, folded)},
)
