"""SGLang Two Batch Overlap (TBO) [docs/schedules.md; two_batch_overlap.py,
operations*.py].

The batch is split in two micro-batches (``tbo_split``); the dense first layers run on the whole
batch as usual, then the sparse MoE layers run as one operations list per micro-batch, chunked
into stages at the YIELDs and interleaved by ``execute_overlapped_operations``: A runs
``delta_stages`` stages alone, then A and B alternate one stage each, then B finishes. Everything
goes to one stream; the overlap comes from issuing one micro-batch's communication before the
other's computation (A's dispatch traffic flies while B computes its attention).

DeepSeek decode (delta 2), per layer:
    [comm_prepare_attn, attn.prepare] | [attn.core, comm_prepare_mlp, gate, select_experts] |
    [dispatch_a, shared_experts] | [dispatch_b, experts, combine_a] | [combine_b] |
    [output, comm_postprocess_layer]            (no YIELD after it: merges with the next layer's
                                                 first stage, as upstream's concat does)
DeepSeek prefill (delta 0, DeepGEMM limited to num_sms - DeepEP's SMs), per layer:
    [comm_prepare_attn .. select_experts, dispatch_a] | [dispatch_b, experts, combine_a] |
    [shared_experts, combine_b, output, comm_postprocess_layer]
Qwen3-MoE decode (delta 2; no shared experts; a trailing YIELD, so layers do not merge):
    [comm_prepare_attn, attn.prepare] | [attn.core, comm_prepare_mlp, gate, select_experts] |
    [dispatch_a] | [dispatch_b, experts, combine_a] | [combine_b, output, comm_postprocess_layer] |
Qwen3-MoE prefill (delta 0, DeepGEMM limited):
    [comm_prepare_attn .. dispatch_a] | [dispatch_b, experts, combine_a] |
    [combine_b, output, comm_postprocess_layer]

DeepEP: the low-latency kernels (decode) send in ``*_a`` and receive in the ``*_b`` hook, both on
the compute stream. The normal kernels (prefill) run on DeepEP's communication stream: ``*_a``
waits for the compute stream (``previous_event``), ``*_b`` makes the compute stream wait for
the kernel (``async_finish`` + ``event.current_stream_wait()``). Each micro-batch has its own
dispatcher (MaybeTboDeepEPDispatcher): its collectives carry the micro-batch index in their key.
A graph-captured decode step holds both micro-batches in one CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.inputs.knobs import knob
from overlap_lab.shared.inputs.workload import MicroBatch, Workload, dense_layers, moe_layers
from overlap_lab.shared.ir.builder import program
from overlap_lab.shared.ir.ops import head_ops, layer_ops, mtp_ops, parts, whole_batch
from overlap_lab.shared.ir.program import HIGH_PRIORITY, GpuInstr, Launch, Op, Program, Record, Wait
from overlap_lab.shared.schedules import serial
from overlap_lab.shared.schedules.config import ScheduleConfig
from overlap_lab.shared.schedules.frame import step_frame
from overlap_lab.shared.schedules.launch import Deployment, Flag, ServerLaunch, sglang, sglang_flag
from overlap_lab.shared.schedules.stages import YIELD, interleave, launches, to_stages
from overlap_lab.shared.schedules.tbo_split import SplitKnobs, TboSplit, tbo_split

UPSTREAM = "SGLang python/sglang/srt/two_batch_overlap.py, operations.py, operations_strategy.py"
SUMMARY = (
    "SGLang TBO: two micro-batches, sparse layers cut into stages at YIELDs and interleaved on "
    "one stream (DeepSeek decode 6 stages/delta 2, prefill 3/delta 0; Qwen3-MoE)"
)


@dataclass(frozen=True)
class Knobs(SplitKnobs):
    """TBO's own knobs (``ScheduleConfig.of``): its split's, and how far apart the micro-batches
    run; tbo+sbo reads them too."""

    delta_stages: int | None = knob(
        None,
        "None = the strategy's own (decode 2, prefill 0)",
        unit="stages",
        lo=0,
        hi=16,
        tune=(0, 1, 3),
    )


MAIN, COMM = "main", "comm"


@dataclass(frozen=True)
class Strategy:
    """An OperationsStrategy of operations_strategy.py, as op keys with YIELD separators."""

    name: str
    operations: tuple  # one sparse layer: op keys of shared.ir.ops and YIELD
    delta_stages: int
    limit_deep_gemm: bool  # deep_gemm_num_sms = num_sms - DeepEPConfig.num_sms

    def layer_stage_count(self) -> int:
        return sum(1 for x in self.operations if x is YIELD) + (self.operations[-1] is not YIELD)


Y = YIELD
DEEPSEEK_DECODE = Strategy(
    "deepseek-decode",
    ("comm_prepare_attn", "attn.prepare", Y,
     "attn.core", "comm_prepare_mlp", "gate", "select_experts", Y,
     "dispatch_a", "shared_experts", Y,
     "dispatch_b", "experts", "combine_a", Y,
     "combine_b", Y,
     "output", "comm_postprocess_layer"),
    delta_stages=2,
    limit_deep_gemm=False,
)  # fmt: skip
DEEPSEEK_PREFILL = Strategy(
    "deepseek-prefill",
    ("comm_prepare_attn", "attn.prepare", "attn.core", "comm_prepare_mlp", "gate",
     "select_experts", "dispatch_a", Y,
     "dispatch_b", "experts", "combine_a", Y,
     "shared_experts", "combine_b", "output", "comm_postprocess_layer"),
    delta_stages=0,
    limit_deep_gemm=True,
)  # fmt: skip
QWEN3_DECODE = Strategy(
    "qwen3-moe-decode",
    ("comm_prepare_attn", "attn.prepare", Y,
     "attn.core", "comm_prepare_mlp", "gate", "select_experts", Y,
     "dispatch_a", Y,
     "dispatch_b", "experts", "combine_a", Y,
     "combine_b", "output", "comm_postprocess_layer", Y),
    delta_stages=2,
    limit_deep_gemm=False,
)  # fmt: skip
QWEN3_PREFILL = Strategy(
    "qwen3-moe-prefill",
    ("comm_prepare_attn", "attn.prepare", "attn.core", "comm_prepare_mlp", "gate",
     "select_experts", "dispatch_a", Y,
     "dispatch_b", "experts", "combine_a", Y,
     "combine_b", "output", "comm_postprocess_layer"),
    delta_stages=0,
    limit_deep_gemm=True,
)  # fmt: skip

# OperationsStrategy.init_new_tbo dispatches on the decoder layer class.
_STRATEGIES = {
    "mla": ("DeepseekV2DecoderLayer", DEEPSEEK_DECODE, DEEPSEEK_PREFILL),
    "gqa": ("Qwen3MoeDecoderLayer", QWEN3_DECODE, QWEN3_PREFILL),
}


def strategy_for(w: Workload) -> Strategy:
    """DECODE and TARGET_VERIFY take the decode strategy, EXTEND the prefill one."""
    _, decode, prefill = _STRATEGIES[w.model.attention]
    return decode if w.batch.mode == "decode" else prefill


def deep_gemm_sms(gpu: GPU) -> int:
    """The prefill strategies' ``total_num_sms - DeepEPConfig.num_sms``."""
    return gpu.num_sms - gpu.deepep_normal_sms


def limit_deep_gemm(op: Op, sms: int) -> Op:
    """configure_deep_gemm_num_sms: DeepGEMM's kernels (the FP8 GEMMs and grouped GEMMs) take at
    most ``sms`` SMs; other kernels are untouched."""
    if op.kind == "compute" and op.dtype == "fp8" and op.op_class in ("gemm", "grouped_gemm"):
        return replace(op, sms=sms if op.sms is None else min(op.sms, sms))
    return op


# ----------------------------------------------------------------------------------------------
# Lowering one op to instructions (plain TBO); tbo+sbo overrides the MoE keys
# ----------------------------------------------------------------------------------------------

Lowering = Callable[[str, dict[str, Op]], list[GpuInstr]]


def _ev(op: Op, what: str) -> str:
    return f"s{op.step}.L{op.layer}.mb{op.mb}.{op.name}.{what}"


def lower_op(key: str, ops: dict[str, Op]) -> list[GpuInstr]:
    """One operation of a stage: its parts (``shared.ir.ops.PARTS``) in order. A normal-mode
    DeepEP ``*_a`` goes through DeepEP's comm stream with its parts (``get_dispatch_layout`` and
    ``notify_dispatch``, ``cached_notify``: ``Buffer.get_dispatch_layout`` / ``dispatch`` /
    ``combine`` with ``previous_event`` and ``allocate_on_comm_stream``)."""
    op = ops[key]
    if op.coll is not None and op.coll.role == "sendrecv":  # normal *_a on DeepEP's stream
        return [
            Record(_ev(op, "previous"), MAIN),
            Wait(COMM, _ev(op, "previous")),
            *launches(parts(ops, key), COMM),
            Record(_ev(op, "done"), COMM),
        ]
    partner = {"dispatch_b": "dispatch_a", "combine_b": "combine_a"}.get(key)
    if partner and ops[partner].coll is not None and ops[partner].coll.role == "sendrecv":
        return [Wait(MAIN, _ev(ops[partner], "done")), Launch(op, MAIN)]
    return launches(parts(ops, key))


# ----------------------------------------------------------------------------------------------
# build
# ----------------------------------------------------------------------------------------------


def micro_batch_operations(
    w: Workload,
    gpu: GPU,
    strategy: Strategy,
    mb: MicroBatch,
    *,
    mode: str,
    step: int,
    lower: Lowering,
) -> list:
    """The concatenated operations of every sparse layer for one micro-batch (OperationsStrategy
    .concat), each operation already lowered to its instructions (its parts included)."""
    out: list = []
    for layer in moe_layers(w.model):
        ops = layer_ops(w, gpu, layer, mb, deepep_mode=mode, step=step)
        if strategy.limit_deep_gemm:
            ops = {k: limit_deep_gemm(op, deep_gemm_sms(gpu)) for k, op in ops.items()}
        for key in strategy.operations:  # a key lowers with its parts (lower_op)
            if key is YIELD:
                out.append(YIELD)
            elif key in ops:
                out.append(lower(key, ops))
    return out


def tbo_body(
    w: Workload,
    gpu: GPU,
    cfg: ScheduleConfig,
    split: TboSplit,
    *,
    mode: str,
    step: int,
    lower: Lowering,
) -> tuple[list[GpuInstr], Strategy, int]:
    """embed and dense layers on the whole batch, the interleaved sparse layers, logits, sample."""
    strategy = strategy_for(w)
    own = cfg.of(Knobs).delta_stages
    delta = strategy.delta_stages if own is None else own
    whole = whole_batch(w)
    head = head_ops(w, gpu, whole, step=step)
    body: list[GpuInstr] = [Launch(head["embed"], MAIN)]
    for layer in dense_layers(w.model):  # the first dense layers run normally, unsplit
        body += launches(layer_ops(w, gpu, layer, whole, deepep_mode=mode, step=step).values())
    stages = [
        to_stages(micro_batch_operations(w, gpu, strategy, mb, mode=mode, step=step, lower=lower))
        for mb in split.micro_batches
    ]
    if not 0 <= delta <= len(stages[0]):
        raise ConfigError(f"--delta-stages must lie in 0..{len(stages[0])}, got {delta}")
    for _mb, stage in interleave(stages[0], stages[1], delta):
        for instrs in stage:
            body += instrs
    body += launches([*parts(head, "logits"), head["sample"]])
    body += launches(mtp_ops(w, gpu, whole, deepep_mode=mode, step=step))  # the draft, unsplit
    return body, strategy, delta


def unsplit(w: Workload, gpu: GPU, cfg: ScheduleConfig, schedule: str, split: TboSplit) -> Program:
    """SGLang's refusal: the batch runs through the normal (non-TBO) forward, unsplit."""
    base = serial.build(w, gpu, cfg)
    meta = base.meta.merged(schedule=schedule, fallback_reason=split.fallback_reason)
    return replace(base, meta=meta)


def build(
    w: Workload,
    gpu: GPU,
    cfg: ScheduleConfig,
    *,
    schedule: str = "tbo",
    lower: Lowering = lower_op,
    extra_streams: tuple[str, ...] = (),
    extra_meta: dict | None = None,
) -> Program:
    if w.parallel.ep <= 1:
        # SGLang's server args refuse --enable-two-batch-overlap without an expert-parallel
        # all-to-all backend (--moe-a2a-backend deepep): there is no dispatch/combine to overlap
        raise ConfigError(
            "tbo needs expert parallelism (SGLang requires --moe-a2a-backend deepep): --ep must "
            "be > 1"
        )
    mode = cfg.resolved_deepep_mode(w.batch.mode)
    split = tbo_split(w, cfg, mode)
    if split.micro_batches is None:
        return unsplit(w, gpu, cfg, schedule, split)
    body, strategy, delta = tbo_body(w, gpu, cfg, split, mode=mode, step=0, lower=lower)
    streams = (MAIN,) + ((COMM,) if mode == "normal" else ()) + extra_streams
    # DeepEP normal kernels run on the Buffer's high-priority comm_stream (csrc/deep_ep.cpp:
    # at::cuda::getStreamFromPool(true)); SGLang's alt stream (SBO) is a default-priority
    # torch.cuda.Stream()
    prio = ((COMM, HIGH_PRIORITY),) if COMM in streams else ()
    rank = step_frame(w, gpu, cfg, body, streams=streams, priorities=prio)
    meta = dict(
        schedule=schedule,
        deepep_mode=mode,
        micro_batches=[mb.as_meta() for mb in split.micro_batches],
        strategy=strategy.name,
        delta_stages=delta,
        tbo_threshold=cfg.of(Knobs).tbo_threshold,
        deep_gemm_sms=deep_gemm_sms(gpu) if strategy.limit_deep_gemm else None,
        cuda_graph=cfg.use_cuda_graph(w.batch.mode),
        **split.as_meta(),
    )
    meta.update(extra_meta or {})
    return program([rank], world=w.parallel.ep, **meta)


def tbo_launch(d: Deployment) -> tuple[tuple[Flag, ...], tuple[tuple[str, str], ...]]:
    """TBO's flags and what has none: ``--enable-two-batch-overlap`` and
    ``--tbo-token-distribution-threshold``; ``delta_stages`` is the operations strategy's own
    (``operations_strategy.py``), with no flag. tbo+sbo adds these."""
    k = d.cfg.of(Knobs)
    flags = (
        sglang_flag("enable_two_batch_overlap", carries="tbo"),
        sglang_flag("tbo_token_distribution_threshold", k.tbo_threshold, "tbo_threshold"),
    )
    unmapped = ()
    if k.delta_stages is not None:
        unmapped = (
            (
                "delta_stages",
                "fixed per model and mode by SGLang's operations strategy "
                "(python/sglang/srt/operations_strategy.py): running another means editing it",
            ),
        )
    return flags, unmapped


def launch_flags(d: Deployment) -> ServerLaunch:
    """SGLang with Two Batch Overlap (:func:`tbo_launch`; docs/tune.md)."""
    return sglang(d, *tbo_launch(d))
