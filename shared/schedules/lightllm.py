"""LightLLM's two-micro-batch overlap for DeepSeek-V2/V3 [docs/schedules.md; upstream
lightllm/models/deepseek2/layer_infer/transformer_layer_infer.py].

Upstream: ModelTC/lightllm, ``Deepseek2TransformerLayerInfer.overlap_tpsp_token_forward`` (decode)
and ``overlap_tpsp_context_forward`` (prefill), driven layer by layer by the model's
``_overlap_tpsp_token_forward`` / ``_overlap_tpsp_context_forward``. One host thread issues every
op of both micro-batches in a fixed hand-written order on one compute stream; DeepEP's hooks carry
the overlap.

Splitting: the first ``cdiv(n, 2)`` requests form micro-batch 0, the rest micro-batch 1.
- decode: both micro-batches are padded with fake requests to the same ``cdiv(max_decode_num, 2)``
  requests (``microbatch_overlap_decode`` asserts equal batch sizes; one CUDA graph per size).
  ``max_decode_num`` is the DP-wide maximum (``--dp-peer-tokens``; symmetric ranks: this n).
- prefill: no common size; a micro-batch is padded with one fake 1-token request only when it is
  empty (``padded_req_num = 1 if len(req_objs) == 0 else 0``).

Decode, one MoE layer (DeepEP low-latency, all on the compute stream, captured in the CUDA graph)::

    0.attention  0.gate  [1.hook: previous layer's _1_hook_post]  0.shared  0.dispatch-send
    1.attention  1.gate  [0.hook: dispatch recv]                   1.shared  1.dispatch-send
    0.experts    [1.hook: dispatch recv]  0.combine-send
    1.experts    [0.hook: combine recv + finish]  1.combine-send  -> _1_hook_post deferred

Prefill, one MoE layer (DeepEP normal kernels on the micro-batch's own comm stream)::

    0.attention 0.gate [1.hook: wait 1.combine + finish] 0.select+quant capture(e0)
    1.attention 1.gate 0.dispatch(after e0) [0.hook: wait 0.dispatch] 1.select+quant capture(e1)
    0.shared 1.shared 0.experts 1.dispatch(after e1) [1.hook: wait 1.dispatch] capture(c0)
    0.combine(after c0) 1.experts [0.hook: wait 0.combine] capture(c1) 0.finish
    1.combine(after c1) -> _1_hook_post deferred

The last micro-batch's combine hook is deferred into the next layer (called after micro-batch 0's
router gate) and, after the last layer, by the post layer (``post_infer.overlap_tpsp_token_forward``
calls micro-batch 0's hook, computes its logits, then micro-batch 1's hook, then its logits).
Dense layers run micro-batch 0's whole layer, then micro-batch 1's (the Llama base class).

Op mapping to ``shared.ir.ops``: attention = comm_prepare_attn (``_att_norm``), attn.prepare
(``_tpsp_get_qkv`` + KV cache), attn.core (attention kernel, ``_tpsp_get_o``, residual add),
comm_prepare_mlp (``_ffn_norm``); gate = ``moe_gate.mm``; select_experts (inside
``low_latency_dispatch`` in decode, ``select_experts_and_quant_input`` in prefill); experts =
``masked_group_gemm`` / ``prefilled_group_gemm``; finish = output (``*= routed_scaling_factor``,
``+= shared``) and comm_postprocess_layer (``input_embdings.add_``).

Communication groups: ``dist_group_manager`` creates one group per micro-batch, so each
micro-batch's dispatch/combine are separate collectives (keys ``...mb<i>.dispatch``); in prefill
each group's DeepEP buffer has its own comm stream (``comm0``, ``comm1``), a high-priority one
(DeepEP's ``comm_stream``). LightLLM's kernels carry no SM cap here: whether LightLLM can run
DeepSeek's fixed 108 + 24 split is an open question, not modelled as a fact;
the compute kernels share the SMs with the normal kernels by the block scheduler's rules
(docs/sm-sharing.md).

Experts are launched as ``grouped_fused_moe_ep``'s kernels (``expert_kernels``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.inputs.knobs import knob
from overlap_lab.shared.inputs.workload import MicroBatch, Workload
from overlap_lab.shared.ir import ops_kernels as K
from overlap_lab.shared.ir.ops import mtp_ops
from overlap_lab.shared.ir.program import HIGH_PRIORITY, Op, Program
from overlap_lab.shared.schedules.common import MAX_TOKENS, ScheduleKnobs
from overlap_lab.shared.schedules.config import ScheduleConfig
from overlap_lab.shared.schedules.launch import (
    LIGHTLLM_ARGS,
    Deployment,
    Flag,
    ServerLaunch,
    lightllm,
)
from overlap_lab.shared.schedules.sbo import split_experts
from overlap_lab.shared.schedules.two_mb import (
    ATTENTION,
    FINISH,
    MAIN,
    Emitter,
    Hook,
    cdiv,
    step_program,
    system_deepep_mode,
)

UPSTREAM = "LightLLM lightllm/models/deepseek2/layer_infer/transformer_layer_infer.py (overlap_tpsp_token_forward, overlap_tpsp_context_forward)"
SUMMARY = (
    "LightLLM two-micro-batch overlap: hand-ordered ops on one stream, DeepEP LL hooks in decode, "
    "normal kernels on a comm stream per micro-batch in prefill, last combine deferred a layer"
)


@dataclass(frozen=True)
class Knobs(ScheduleKnobs):
    """LightLLM's own knob (``ScheduleConfig.of``)."""

    dp_peer_tokens: tuple[int, ...] = knob(
        (),
        "other DP ranks' decode tokens, for max_decode_num (empty: as this)",
        unit="tokens",
        lo=0,
        hi=MAX_TOKENS,
    )


COMM_STREAMS = ("comm0", "comm1")


# ----------------------------------------------------------------------------------------------
# Splitting and padding
# ----------------------------------------------------------------------------------------------


def split_decode(w: Workload, max_decode_num: int | None = None) -> tuple[MicroBatch, MicroBatch]:
    """``padded_overlap_prepare_decode_inputs``: requests [0, cdiv(n,2)) and [cdiv(n,2), n), each
    padded with fake requests to ``cdiv(max_decode_num, 2)`` (max over DP ranks; here n)."""
    b = w.batch
    n, tps = b.num_seqs, b.tokens_per_seq
    max_decode_num = n if max_decode_num is None else max_decode_num
    if max_decode_num < n:
        raise ConfigError(f"max_decode_num={max_decode_num} is below this rank's {n} requests")
    size = cdiv(max_decode_num, 2)  # micro_batch_size
    n0 = cdiv(n, 2)  # micro_batch1_req_num
    return (
        MicroBatch(0, 0, n0, 0, n0 * tps, size * tps),
        MicroBatch(1, n0, n, n0 * tps, n * tps, size * tps),
    )


def split_prefill(w: Workload) -> tuple[MicroBatch, MicroBatch]:
    """``padded_overlap_prepare_prefill_inputs``: requests [0, cdiv(n,2)) and the rest, split by
    request count (not tokens); an empty micro-batch gets one fake request of one token."""
    b = w.batch
    offs = b.token_offsets()
    n0 = cdiv(b.num_seqs, 2)
    out = []
    for i, (lo, hi) in enumerate(((0, n0), (n0, b.num_seqs))):
        tokens = offs[hi] - offs[lo]
        padded_req_num = 1 if hi == lo else 0
        out.append(MicroBatch(i, lo, hi, offs[lo], offs[hi], tokens + padded_req_num))
    return out[0], out[1]


def dp_max_decode_num(w: Workload, cfg: ScheduleConfig) -> int:
    """``max_decode_num``: the router all-reduces ``len(decode_reqs)`` with MAX over the DP ranks
    so every rank pads to (and replays the CUDA graph of) the same size. The other ranks' decode
    tokens come from ``--dp-peer-tokens`` (requests = cdiv(tokens, tokens_per_seq)); without it
    the ranks are symmetric and the maximum is this rank's own count."""
    tps = w.batch.tokens_per_seq
    return max([w.batch.num_seqs, *(cdiv(t, tps) for t in cfg.of(Knobs).dp_peer_tokens)])


# ----------------------------------------------------------------------------------------------
# One MoE layer, as upstream writes it
# ----------------------------------------------------------------------------------------------


def expert_kernels(w: Workload, ops: dict[str, Op]) -> list[Op]:
    """The routed experts as the kernels of LightLLM's ``grouped_fused_moe_ep``.

    Prefill (contiguous layout): ``ep_scatter`` (Triton), the DeepGEMM grouped gate-up GEMM,
    ``silu_and_mul_masked_post_quant_fwd`` (Triton activation + FP8 quant), the DeepGEMM grouped
    down GEMM, ``ep_gather`` (Triton). Decode (masked layout, DeepEP LL): the masked gate-up GEMM,
    the activation + quant, the masked down GEMM. The kernel boundaries matter for SM sharing: the
    Triton kernels are waved, the DeepGEMM ones persistent. The passes are the layer's own
    (``shared.ir.ops_kernels``), the activation fused with its quantisation in both modes (SGLang
    runs the two apart in normal mode); the GEMMs are the ``experts`` op cut 2:1 into gate-up
    and down (``sbo.split_experts``: FLOPs and weights)."""
    gate_up, down = split_experts(ops["experts"])
    act = ops.get("experts.act_quant")
    if act is None:  # normal mode's two passes, fused as LightLLM runs them
        base = ops["experts.act"]
        rows = math.ceil(base.tokens / w.parallel.attn_tp)  # ops.moe_tokens
        fused = K.silu_and_mul_quant(K.copies_received(w, rows), w.model.expert_inter)
        flops, nbytes = float(fused.flops), float(fused.hbm_bytes)
        act = replace(base, name="experts.act_quant", flops=flops, hbm_bytes=nbytes)
    kernels = [gate_up, act, replace(down, name="experts.down.0")]
    if "experts.scatter" in ops:
        kernels = [ops["experts.scatter"], *kernels, ops["experts.gather"]]
    return kernels


def run_experts(e: Emitter, i: int, L: int) -> None:
    """Micro-batch ``i``'s routed experts at upstream kernel granularity (``expert_kernels``)."""
    if not e.has(i):
        return
    for op in expert_kernels(e.w, e.ops(i, L)):
        e.launch(op)


def decode_moe_layer(e: Emitter, L: int) -> None:
    """``overlap_tpsp_token_forward`` (is_moe): DeepEP low-latency, everything on ``main``."""
    o0, o1 = e.ops(0, L), e.ops(1, L)
    # 0 attention, then 0's router GEMM (moe_gate.mm)
    e.run(0, L, ATTENTION + ("gate",))
    # 1 hook: the previous layer's _1_hook_post (combine recv, scale + shared, residual add)
    e.call_hook(1)
    # 0 shared expert
    e.run(0, L, ("shared_experts",))
    # 0 dispatch: low_latency_dispatch = select_experts + the LL send; the recv is its hook
    e.run(0, L, ("select_experts", "dispatch_a"))
    e.set_hook(0, Hook(ops=(o0["dispatch_b"],)))
    # 1 attention, 1 router GEMM
    e.run(1, L, ATTENTION + ("gate",))
    # 0 hook: micro-batch 0's dispatch recv
    e.call_hook(0)
    # 1 shared expert
    e.run(1, L, ("shared_experts",))
    # 1 dispatch (send); recv deferred into its hook
    e.run(1, L, ("select_experts", "dispatch_a"))
    e.set_hook(1, Hook(ops=(o1["dispatch_b"],)))
    # moe calc: 0's masked grouped GEMM
    run_experts(e, 0, L)
    # 1 hook: micro-batch 1's dispatch recv
    e.call_hook(1)
    # 0 combine (LL send); its recv is the hook
    e.run(0, L, ("combine_a",))
    e.set_hook(0, Hook(ops=(o0["combine_b"],) + tuple(o0[n] for n in FINISH)))
    # 1's masked grouped GEMM
    run_experts(e, 1, L)
    # 0 hook: combine recv, then *= routed_scaling_factor, += shared, residual add
    e.call_hook(0)
    # 1 combine (LL send); _1_hook_post (recv + finish) is left to the next layer
    e.run(1, L, ("combine_a",))
    e.set_hook(1, Hook(ops=(o1["combine_b"],) + tuple(o1[n] for n in FINISH)))


def prefill_moe_layer(e: Emitter, L: int) -> None:
    """``overlap_tpsp_context_forward`` (is_moe): DeepEP normal kernels, ``Buffer.capture()``
    events, the comm of micro-batch i on ``comm<i>``."""
    o1 = e.ops(1, L) if e.has(1) else {}
    comm0, comm1 = COMM_STREAMS
    # 0 attention, 0 router GEMM
    e.run(0, L, ATTENTION + ("gate",))
    # wait last 1 combine (_1_hook_post of the previous layer)
    e.call_hook(1)
    # 0 select_experts_and_quant_input, then _0_overlap_event = Buffer.capture()
    e.run(0, L, ("select_experts",))
    e.record(f"L{L}.mb0.dispatch_ready")
    # 1 attention, 1 router GEMM
    e.run(1, L, ATTENTION + ("gate",))
    # 0 dispatch execute (previous_event=_0_overlap_event); the hook waits its event
    done = e.normal_comm(0, L, "dispatch", f"L{L}.mb0.dispatch_ready", comm0, host_sync=True)
    e.set_hook(0, Hook(event=done))
    # wait 0 dispatch
    e.call_hook(0)
    # 1 select + quant, _1_overlap_event = Buffer.capture()
    e.run(1, L, ("select_experts",))
    if e.has(1):
        e.record(f"L{L}.mb1.dispatch_ready")
    # 0 shared expert, 1 shared expert
    e.run(0, L, ("shared_experts",))
    e.run(1, L, ("shared_experts",))
    # 0 moe calc (prefilled_group_gemm)
    run_experts(e, 0, L)
    # 1 dispatch execute (previous_event=_1_overlap_event)
    done = e.normal_comm(1, L, "dispatch", f"L{L}.mb1.dispatch_ready", comm1, host_sync=True)
    e.set_hook(1, Hook(event=done))
    # wait 1 dispatch
    e.call_hook(1)
    # _0_combine_event = Buffer.capture(), then 0 combine execute on comm0
    e.record(f"L{L}.mb0.combine_ready")
    done = e.normal_comm(0, L, "combine", f"L{L}.mb0.combine_ready", comm0, host_sync=False)
    e.set_hook(0, Hook(event=done))
    # 1 moe calc
    run_experts(e, 1, L)
    # wait 0 combine
    e.call_hook(0)
    # _1_combine_event = Buffer.capture() (before 0's finish, so 1's combine does not wait for it)
    if e.has(1):
        e.record(f"L{L}.mb1.combine_ready")
    # 0 finish: *= routed_scaling_factor, += shared, residual add
    e.run(0, L, FINISH)
    # 1 combine execute; _1_hook_post (wait + finish) deferred into the next layer
    done = e.normal_comm(1, L, "combine", f"L{L}.mb1.combine_ready", comm1, host_sync=False)
    if e.has(1):
        e.set_hook(1, Hook(event=done, ops=tuple(o1[n] for n in FINISH)))


def dense_layer(e: Emitter, L: int) -> None:
    """The Llama base class: micro-batch 0's whole layer, then micro-batch 1's. (A pending hook
    cannot reach a dense layer in these models, whose dense layers come first; it is flushed
    anyway so the Program stays correct for any layout.)"""
    e.call_hook(0)
    e.run(0, L, tuple(e.ops(0, L)))
    e.call_hook(1)
    e.run(1, L, tuple(e.ops(1, L)))


def forward_body(e: Emitter) -> None:
    """The whole forward: pre layer, every layer, post layer, sampling."""
    model = e.w.model
    decode = e.w.batch.mode == "decode"
    # pre_infer.overlap_tpsp_*_forward: embeddings of 0 then 1
    for i in range(len(e.mbs)):
        e.launch(e.head(i)["embed"])
    for L in range(model.num_layers):
        if not model.is_moe_layer(L):
            dense_layer(e, L)
        elif decode:
            decode_moe_layer(e, L)
        else:
            prefill_moe_layer(e, L)
    # post_infer.overlap_tpsp_token_forward: hook 0, logits 0, hook 1 (the deferred combine of the
    # last layer), logits 1
    for i in range(len(e.mbs)):
        e.call_hook(i)
        e.launch_head(i, "logits")
    assert not e.hooks, f"hooks left pending after the post layer: {sorted(e.hooks)}"
    for i in range(len(e.mbs)):
        e.launch(e.head(i)["sample"])
    for i in range(len(e.mbs)):  # the MTP draft forward after the verify (none without MTP)
        for op in mtp_ops(e.w, e.gpu, e.mbs[i], deepep_mode=e.deepep_mode, step=e.step):
            e.launch(e._narrow(op))


def build(w: Workload, gpu: GPU, cfg: ScheduleConfig) -> Program:
    mode = w.batch.mode
    deepep = system_deepep_mode(cfg, mode, "lightllm")
    mbs = split_decode(w, dp_max_decode_num(w, cfg)) if mode == "decode" else split_prefill(w)
    e = Emitter(w, gpu, mbs, deepep)
    forward_body(e)
    streams = (MAIN,) if mode == "decode" else (MAIN, *COMM_STREAMS)
    extra: dict = {}
    groups = [
        {
            "mb": mb.index,
            "group": mb.index,
            "collectives": f"s0.L*.mb{mb.index}.dispatch|combine",
            "stream": MAIN if mode == "decode" else COMM_STREAMS[mb.index],
        }
        for mb in mbs
    ]
    if deepep == "normal":
        extra["deepep_normal_sms"] = gpu.deepep_normal_sms  # Buffer.num_sms of each comm stream
    return step_program(
        w,
        gpu,
        cfg,
        e.body,
        streams=streams,
        # each micro-batch's DeepEP Buffer runs its normal kernels on its own comm_stream, a
        # high-priority stream (DeepEP csrc/deep_ep.cpp: at::cuda::getStreamFromPool(true))
        priorities=tuple((s, HIGH_PRIORITY) for s in streams if s in COMM_STREAMS),
        schedule="lightllm",
        deepep_mode=deepep,
        micro_batches=[mb.as_meta() for mb in mbs],
        comm_groups=groups,
        **({"max_decode_num": dp_max_decode_num(w, cfg)} if mode == "decode" else {}),
        padding=(
            "decode: both micro-batches padded to cdiv(max_decode_num, 2) requests"
            if mode == "decode"
            else "prefill: one fake 1-token request only in an empty micro-batch"
        ),
        **extra,
    )


def launch_flags(d: Deployment) -> ServerLaunch:
    """LightLLM's server with its micro-batch overlap for the workload's phase
    (``--enable_decode_microbatch_overlap`` or ``--enable_prefill_microbatch_overlap``,
    ``lightllm/server/api_cli.py``; docs/tune.md)."""
    name = f"--enable_{d.workload.batch.mode}_microbatch_overlap"
    return lightllm(d, (Flag(name, None, LIGHTLLM_ARGS, "lightllm"),))
