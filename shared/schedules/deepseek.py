"""DeepSeek's published two-micro-batch schedule [docs/schedules.md; DeepSeek-V3/R1 inference
system overview (day 6 blog); deepseek-ai/profile-data README].

Prefill (profile: EP32, 4K prompts, 16K tokens per GPU). Two micro-batches whose attention load
is balanced, so one prompt may be split between them. Computation runs on 108 SMs (ATTN = MLA and
the MoE routing gate, MLP = routed experts, SHARED), communication on the other 24 of an H800's 132
(DeepEP normal DISPATCH and COMBINE), each micro-batch's communication hidden under the other's
computation. On another GPU the split keeps the ratio: comm = round(24/132 * num_sms) (B200: 27),
or ``--comm-sms``. Two streams, ``main`` (computation) and ``comm`` (communication), tied by
events. One MoE layer (micro-batches 0 and 1; the blog figure's orange and green)::

    main (108 SMs) | ATTN0 | ATTN1 | MLP0  | MLP1 SHARED0 | SHARED1 ATTN0' ...
    comm  (24 SMs) |       | DISP0 | DISP1 | COMB0        | COMB1 ...

i.e. the four overlap windows of the figure: ATTN1 vs DISPATCH0, MLP0 vs DISPATCH1,
MLP1 + SHARED0 vs COMBINE0, SHARED1 + next ATTN0 vs COMBINE1. Each micro-batch's layer tail
(scale + shared add, residual add) waits for its combine right before its next ATTN.

Decode (profile: EP128, 4K context, 128 requests per GPU). The attention is split in two, ATTN-0
(MLA down-projection and what follows the previous layer's COMBINE) and ATTN-1 (core attention,
attention output projection and MoE routing gate), giving a 5-stage pipeline (ATTN-0, ATTN-1,
DISPATCH, MLP, COMBINE) with SHARED filling the window of a dispatch. Computation on all SMs;
DeepEP low-latency all-to-all "does not occupy GPU SMs: after RDMA messages are issued, all GPU
SMs are freed, and the system waits for the all-to-all communication to complete after the
computation has finished" (profile-data): the send is a short kernel, the receive is a hook
launched later. One stream::

    compute | SHARED1 ATTN-0 0 | MLP1  | ATTN-1 0 | SHARED0 ATTN-0 1 | MLP0  | ATTN-1 1 | ...
    in air  |   DISPATCH1      |       | COMBINE1 |    DISPATCH0     |       | COMBINE0 |

(SHARED + ATTN-0 vs DISPATCH, ATTN-1 vs COMBINE, MLP alone: the blog lists the compute blocks as
SHARED, ATTN-0, MLP, ATTN-1.) Micro-batch 1's MLP of layer L runs in layer L+1's window.

Mapping to ``shared.ir.ops`` (stated in the code too):
    ATTN-0 = [combine_b hook + output + comm_postprocess_layer of the previous layer]
             + comm_prepare_attn + attn.prepare          (MLA down/up q, kv_a down-proj, RoPE)
    ATTN-1 = attn.core + comm_prepare_mlp + gate + select_experts   (core attn, o_proj, gate)
    DISPATCH = dispatch_a (send) .. dispatch_b (recv hook); MLP = experts
    COMBINE  = combine_a (send) .. combine_b (recv hook, in the next ATTN-0)
    SHARED   = shared_experts
In prefill ATTN = ATTN-0 + ATTN-1 of one micro-batch, DISPATCH / COMBINE = dispatch_a+b /
combine_a+b on ``comm``.

Dense layers (the first three of V3) run micro-batch 0 then 1 on ``main``: no published schedule
covers them and they have no all-to-all. The schedule is DeepSeek's figure; DeepSeek's own host
framework is unpublished, so the host just launches in order (decode: one CUDA graph).
A batch that cannot be split (one token in prefill, one request in decode) runs as one
micro-batch in the same order, with a ``fallback_reason``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.inputs.workload import Batch, MicroBatch, Workload
from overlap_lab.shared.ir.ops import mtp_ops
from overlap_lab.shared.ir.program import HIGH_PRIORITY, Program
from overlap_lab.shared.schedules.common import ScheduleKnobs, comm_sms_knob, resolve_comm_sms
from overlap_lab.shared.schedules.config import ScheduleConfig
from overlap_lab.shared.schedules.launch import Deployment, ServerLaunch
from overlap_lab.shared.schedules.two_mb import (
    FINISH,
    MAIN,
    Emitter,
    Hook,
    step_program,
    system_deepep_mode,
)

UPSTREAM = "DeepSeek-V3/R1 inference system overview; github.com/deepseek-ai/profile-data"
SUMMARY = (
    "DeepSeek's published overlap: prefill 2 micro-batches on 108 compute + 24 comm SMs (scaled), "
    "decode 5-stage ATTN-0/ATTN-1/SHARED/MLP pipeline with SM-free DeepEP LL hooks"
)


@dataclass(frozen=True)
class Knobs(ScheduleKnobs):
    """DeepSeek's own knob (``ScheduleConfig.of``)."""

    comm_sms: int | None = comm_sms_knob(
        "prefill: SMs of the communication partition (None: 24 of an H800's 132, scaled)",
        tune=(16, 32),
    )


#: DeepSeek's prefill profile: 24 of the H800's 132 SMs for DeepEP (DeepSeek's
#: profile-data); DeepEP's own Buffer.num_sms default is 20 (``GPU.deepep_normal_sms``).
H800_SMS, H800_COMM_SMS = 132, 24
COMM = "comm"

ATTN_0 = ("comm_prepare_attn", "attn.prepare")  # MLA down-projection etc. (after the combine)
ATTN_1 = ("attn.core", "comm_prepare_mlp", "gate", "select_experts")  # core attn, o_proj, gate
ATTN = ATTN_0 + ATTN_1  # prefill's ATTN: MLA and the routing gate


def comm_sms(gpu: GPU, cfg: ScheduleConfig) -> int:
    """Communication SMs of the prefill partition: 24 of an H800's 132, scaled to the GPU."""
    default = max(1, round(H800_COMM_SMS / H800_SMS * gpu.num_sms))
    return resolve_comm_sms(cfg.of(Knobs).comm_sms, gpu, default=default)


# ----------------------------------------------------------------------------------------------
# Splits
# ----------------------------------------------------------------------------------------------


def _attn_cost(prefix: int, j: int) -> float:
    """Causal attention cost of a sequence's first j new tokens over ``prefix`` cached ones:
    sum over k in 1..j of (prefix + k) query-key pairs."""
    return j * prefix + j * (j + 1) / 2


def split_prefill(batch: Batch) -> tuple[MicroBatch, ...]:
    """Two micro-batches with balanced attention load, cutting a prompt where needed.

    The cut is the token boundary t (1 <= t < tokens) minimising the difference of the causal
    attention pairs on either side (a later piece of a cut prompt attends over the earlier piece
    as its prefix); ties keep the earlier boundary. One token: unsplit.
    """
    offs = batch.token_offsets()
    n = offs[-1]
    if n < 2:
        return (MicroBatch(0, 0, batch.num_seqs, 0, n, n),)
    costs = [_attn_cost(batch.prefix_lens[i], batch.extend_lens[i]) for i in range(batch.num_seqs)]
    half = sum(costs) / 2
    best: tuple[float, int] | None = None
    acc = 0.0
    for i, c in enumerate(costs):
        if acc + c >= half or i == batch.num_seqs - 1:
            p, e = batch.prefix_lens[i], batch.extend_lens[i]
            # j^2/2 + (p + 1/2) j = half - acc: the real root, then its integer neighbours
            root = -(p + 0.5) + math.sqrt((p + 0.5) ** 2 + 2 * (half - acc))
            for j in {0, e, math.floor(root), math.ceil(root)}:
                t = offs[i] + min(max(j, 0), e)
                if not 1 <= t < n:
                    continue
                diff = abs(2 * (acc + _attn_cost(p, t - offs[i])) - 2 * half)
                if best is None or (diff, t) < best:
                    best = (diff, t)
            break
        acc += c
    assert best is not None
    t = best[1]
    seq_of_t = max(i for i in range(batch.num_seqs) if offs[i] <= t)  # seq holding token t
    cut = offs[seq_of_t] != t
    seq_hi0 = seq_of_t + 1 if cut else seq_of_t
    return (
        MicroBatch(0, 0, seq_hi0, 0, t, t, split_seq=cut),
        MicroBatch(1, seq_of_t, batch.num_seqs, t, n, n - t, split_seq=cut),
    )


def split_decode(batch: Batch) -> tuple[MicroBatch, ...]:
    """Two micro-batches of whole requests with balanced attention (KV tokens read); ties keep
    the earlier boundary (uniform contexts: the first floor(n/2) requests). One request: unsplit."""
    n, tps = batch.num_seqs, batch.tokens_per_seq
    if n < 2:
        return (MicroBatch(0, 0, n, 0, n * tps, n * tps),)
    total = sum(batch.kv_lens)
    acc, best = 0, None
    for k in range(1, n):
        acc += batch.kv_lens[k - 1]
        key = (abs(2 * acc - total), k)
        best = key if best is None or key < best else best
    k = best[1]
    return (
        MicroBatch(0, 0, k, 0, k * tps, k * tps),
        MicroBatch(1, k, n, k * tps, n * tps, (n - k) * tps),
    )


# ----------------------------------------------------------------------------------------------
# Decode: the 5-stage pipeline, one stream, LL hooks
# ----------------------------------------------------------------------------------------------


def _decode_mlp(e: Emitter, i: int, L: int) -> None:
    """MLP stage of micro-batch i: the dispatch recv hook, the experts, the combine send; the
    combine recv (and the layer tail) become the hook called by i's next ATTN-0."""
    if not e.has(i):
        return
    o = e.ops(i, L)
    e.run(i, L, ("dispatch_b", "experts", "combine_a"))
    e.set_hook(i, Hook(ops=(o["combine_b"],) + tuple(o[n] for n in FINISH)))


def decode_moe_layer(e: Emitter, L: int, prev_moe: int | None) -> None:
    """One window of the pipeline; micro-batch 1's MLP of the previous MoE layer runs inside it."""
    # [SHARED 1 of the previous layer ran last] ATTN-0 of 0: combine hook of its previous layer
    # (recv + scale/shared add + residual), then the MLA down-projection
    e.call_hook(0)
    e.run(0, L, ATTN_0)
    # MLP of 1 (previous layer): its dispatch flew under SHARED 1 + ATTN-0 0
    if prev_moe is not None:
        _decode_mlp(e, 1, prev_moe)
    # ATTN-1 of 0 (COMBINE 1 flies under it), then DISPATCH 0's send
    e.run(0, L, ATTN_1 + ("dispatch_a",))
    # SHARED 0, then ATTN-0 of 1 (DISPATCH 0 flies under both)
    e.run(0, L, ("shared_experts",))
    e.call_hook(1)
    e.run(1, L, ATTN_0)
    # MLP of 0
    _decode_mlp(e, 0, L)
    # ATTN-1 of 1 (COMBINE 0 flies under it), DISPATCH 1's send, SHARED 1
    e.run(1, L, ATTN_1 + ("dispatch_a",))
    e.run(1, L, ("shared_experts",))


# ----------------------------------------------------------------------------------------------
# Prefill: 108 + 24 SMs, compute and comm streams
# ----------------------------------------------------------------------------------------------


def _prefill_attn(e: Emitter, i: int, L: int) -> None:
    """ATTN of micro-batch i (after its previous combine and tail), then DISPATCH i on comm."""
    if not e.has(i):
        return
    e.call_hook(i)  # wait COMBINE i of the previous layer, then output + residual add
    e.run(i, L, ATTN)
    ready = f"L{L}.mb{i}.dispatch_ready"
    e.record(ready, MAIN)
    e.set_hook(i, Hook(event=e.normal_comm(i, L, "dispatch", ready, COMM, host_sync=False)))


def _prefill_mlp(e: Emitter, i: int, L: int) -> None:
    """MLP of micro-batch i once its DISPATCH is in, then COMBINE i on comm."""
    if not e.has(i):
        return
    e.call_hook(i)  # main waits DISPATCH i
    e.run(i, L, ("experts",))
    ready = f"L{L}.mb{i}.combine_ready"
    e.record(ready, MAIN)
    done = e.normal_comm(i, L, "combine", ready, COMM, host_sync=False)
    o = e.ops(i, L)
    e.set_hook(i, Hook(event=done, ops=tuple(o[n] for n in FINISH)))


def prefill_moe_layer(e: Emitter, L: int) -> None:
    # ATTN 0 | ATTN 1 (DISPATCH 0 under it)
    _prefill_attn(e, 0, L)
    _prefill_attn(e, 1, L)
    # MLP 0 (DISPATCH 1 under it) | MLP 1 (COMBINE 0 under it and SHARED 0)
    _prefill_mlp(e, 0, L)
    _prefill_mlp(e, 1, L)
    # SHARED 0, SHARED 1 (COMBINE 1 under it and the next ATTN 0)
    e.run(0, L, ("shared_experts",))
    e.run(1, L, ("shared_experts",))


# ----------------------------------------------------------------------------------------------
# The forward and build
# ----------------------------------------------------------------------------------------------


def forward_body(e: Emitter) -> None:
    model = e.w.model
    decode = e.w.batch.mode == "decode"
    mbs = range(len(e.mbs))
    for i in mbs:
        e.launch(e.head(i)["embed"])
    prev_moe = None
    for L in range(model.num_layers):
        if not model.is_moe_layer(L):
            for i in mbs:  # no all-to-all: 0's layer, then 1's
                e.call_hook(i)
                e.run(i, L, tuple(e.ops(i, L)))
            continue
        if decode:
            decode_moe_layer(e, L, prev_moe)
        else:
            prefill_moe_layer(e, L)
        prev_moe = L
    # after the last layer the pipeline drains in the same slots: 0's combine hook (its next
    # ATTN-0), (decode) 1's last MLP, 0's logits in its ATTN-1 slot while COMBINE 1 flies, then
    # 1's combine hook and logits
    e.call_hook(0)
    if decode and prev_moe is not None:
        _decode_mlp(e, 1, prev_moe)
    e.launch_head(0, "logits")
    if e.has(1):
        e.call_hook(1)
        e.launch_head(1, "logits")
    assert not e.hooks, f"hooks left pending after the last layer: {sorted(e.hooks)}"
    for i in mbs:
        e.launch(e.head(i)["sample"])
    for i in mbs:  # the MTP draft forward after the verify, per micro-batch (none without MTP)
        for op in mtp_ops(e.w, e.gpu, e.mbs[i], deepep_mode=e.deepep_mode, step=e.step):
            e.launch(e._narrow(op))


def build(w: Workload, gpu: GPU, cfg: ScheduleConfig) -> Program:
    mode = w.batch.mode
    deepep = system_deepep_mode(cfg, mode, "deepseek")
    meta: dict = {}
    if mode == "prefill":
        mbs = split_prefill(w.batch)
        comm = comm_sms(gpu, cfg)
        compute = gpu.num_sms - comm
        e = Emitter(w, gpu, mbs, deepep, compute_sms=compute, comm_sms=comm)
        streams = (MAIN, COMM)
        meta.update(
            comm_sms=comm,
            compute_sms=compute,
            stream_roles={
                MAIN: f"computation ({compute} SMs)",
                COMM: f"communication ({comm} SMs)",
            },
            split="balanced attention (causal pairs); a prompt may be cut",
        )
        if len(mbs) == 1:
            meta["fallback_reason"] = "a one-token batch cannot be split into two micro-batches"
    else:
        mbs = split_decode(w.batch)
        e = Emitter(w, gpu, mbs, deepep)
        streams = (MAIN,)
        meta.update(
            stream_roles={
                MAIN: "computation on all SMs; DeepEP LL send/recv hooks hold none in flight"
            },
            stages="ATTN-0, ATTN-1, DISPATCH, MLP, COMBINE (+SHARED)",
            split="whole requests, balanced KV tokens",
        )
        if len(mbs) == 1:
            meta["fallback_reason"] = "a one-request batch cannot be split into two micro-batches"
    forward_body(e)
    return step_program(
        w,
        gpu,
        cfg,
        e.body,
        streams=streams,
        # DeepEP's kernels run on its Buffer's comm_stream, a high-priority stream
        # (csrc/deep_ep.cpp: at::cuda::getStreamFromPool(true))
        priorities=((COMM, HIGH_PRIORITY),) if COMM in streams else (),
        schedule="deepseek",
        deepep_mode=deepep,
        micro_batches=[mb.as_meta() for mb in mbs],
        **meta,
    )


def launch_flags(d: Deployment) -> ServerLaunch:
    """None: DeepSeek's inference system is not public, so no server takes this configuration
    (docs/tune.md). SGLang's tbo is the closest public schedule."""
    return ServerLaunch(
        None,
        unmapped=(
            (
                "schedule",
                "DeepSeek's inference system is not public: no launch flags (the closest public "
                "schedule: SGLang's tbo)",
            ),
        ),
    )
