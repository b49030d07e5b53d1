"""SGLang Single Batch Overlap (SBO) [docs/schedules.md; single_batch_overlap.py,
deepseek_v2.py].

Inside each MoE layer of one (unsplit) batch, with DeepEP's low-latency kernels:

    SM partition (compute_overlap_args): comm = SGLANG_DEEPEP_LL_COMBINE_SEND_NUM_SMS, else the
    GPU preset (3 Hopper, 32 Blackwell); compute = total - comm.

    mode 1, combine <-> down GEMM (two streams, signal tensor):
      main: dispatch_a | dispatch_b | gate_up GEMM | act+quant | rec start | down[0] rec sig0 | ...
      alt:                                                  wait start | combine (polls sig0, ...)
      The down GEMM runs on the compute SMs and raises a signal per finished block (Hopper:
      num_local_experts x ceil(rows/64) int32, block_m 64; Blackwell: one uint32 per local
      expert); the combine is one kernel, resident on the comm SMs from the start event on, that
      sends each block as soon as it is signalled (``Op.waits``).
    mode 2, combine <-> shared experts (two streams):
      main: experts | rec down | shared experts (compute SMs)
      alt:                wait down | combine (comm SMs)
    mode 3, dispatch <-> shared experts (one stream): the shared experts run in DeepEP's dispatch
      hook, between the send (dispatch_a) and the receive hook (dispatch_b).
    combine_b (with the combine on alt): alt waits main, hook() waits for the traffic, main
      waits alt.

SGLang switches the three on by hardware (SboFlags): mode 1 with DeepGEMM on Hopper or CuteDSL,
mode 3 on every non-Blackwell GPU, mode 2 where mode 3 is off. Mode 1 never runs alone there:
its shared experts go where the GPU's companion mode puts them (Hopper: the dispatch hook of
mode 3; Blackwell: after the down GEMM on the compute SMs, mode 2's pre-combine hook). So
``--sbo-mode 1`` is SGLang's Hopper+DeepGEMM (1+3) or Blackwell+CuteDSL (1+2) configuration,
``2`` its Blackwell+DeepGEMM one and ``3`` Hopper without a signalling down GEMM; modes 2 on
Hopper and 3 on Blackwell are what-ifs SGLang itself does not run (meta ``sbo_upstream``).

Modelling choice, stated once: the down GEMM is one slice per signal (its blocks, each recorded
as the signal's event once done), and the combine one resident kernel that waits on those
signals in order (``Op.waits``: part i of its work and traffic cannot go before signal i), at
upstream's granularity and with no tuning constant. Rows per local expert are the expected token
copies it receives
(``moe_tokens * top_k / local_experts``, = the batch's tokens for DeepSeek-V3 at EP 32); the
static signal tensor is larger (the LL buffer's capacity) but only blocks holding tokens signal.

SBO needs DeepEP's low-latency combine: a batch on the normal kernels (prefill) runs unchanged
with a ``fallback_reason``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.inputs.knobs import knob
from overlap_lab.shared.inputs.workload import MicroBatch, Workload
from overlap_lab.shared.ir.builder import program
from overlap_lab.shared.ir.ops import head_ops, layer_ops, mtp_ops, parts, whole_batch
from overlap_lab.shared.ir.program import (
    Coll,
    Flow,
    GpuInstr,
    Launch,
    Op,
    Program,
    Record,
    Wait,
    WaitStream,
)
from overlap_lab.shared.schedules import serial
from overlap_lab.shared.schedules.common import ScheduleKnobs, comm_sms_knob, resolve_comm_sms
from overlap_lab.shared.schedules.config import ScheduleConfig
from overlap_lab.shared.schedules.frame import step_frame
from overlap_lab.shared.schedules.launch import (
    Deployment,
    Flag,
    ServerLaunch,
    sglang,
    sglang_env,
    sglang_flag,
)
from overlap_lab.shared.schedules.stages import launches

UPSTREAM = "SGLang python/sglang/srt/batch_overlap/single_batch_overlap.py, models/deepseek_v2.py"
SUMMARY = (
    "SGLang SBO: inside each MoE layer, combine on an alt stream with few SMs against the down "
    "GEMM (1, block signals) or shared experts (2); shared experts in the dispatch hook (3)"
)


@dataclass(frozen=True)
class Knobs(ScheduleKnobs):
    """SBO's own knobs (``ScheduleConfig.of``); tbo+sbo reads them too."""

    comm_sms: int | None = comm_sms_knob(
        "SMs of DeepEP's low-latency combine send (SGLANG_DEEPEP_LL_COMBINE_SEND_NUM_SMS; "
        "None: the GPU preset's sbo_comm_sms)",
        tune=(2, 6, 12),
    )
    sbo_mode: int = knob(
        1,
        "1 combine<->down GEMM, 2 combine<->shared, 3 dispatch<->shared",
        lo=1,
        hi=3,
        tune=(1, 2, 3),
    )


SIGNAL_BLOCK_M = 64  # Hopper: DeepGEMM's MIN_BLOCK_M, one int32 signal per 64-row block
MAIN, ALT = "main", "alt"


# ----------------------------------------------------------------------------------------------
# The plan: which overlaps run and on how many SMs
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SboPlan:
    """What compute_overlap_args and SboFlags decide for one GPU and mode."""

    mode: int
    arch: str
    num_sms: int
    comm_sms: int
    stream_down_gemm: bool  # mode 1: combine streams blocks of the down GEMM
    combine_on_alt: bool  # modes 1 and 2: combine on the alt stream with comm_sms
    shared_in_dispatch_hook: bool  # mode 3 (and mode 1's Hopper companion)
    shared_after_down: bool  # mode 2 (and mode 1's Blackwell companion), on compute SMs

    @property
    def compute_sms(self) -> int:
        return self.num_sms - self.comm_sms

    @property
    def overlaps(self) -> list[str]:
        out = []
        if self.stream_down_gemm:
            out.append("combine<->down_gemm")
        if self.shared_after_down:
            out.append("combine<->shared_experts")
        if self.shared_in_dispatch_hook:
            out.append("dispatch<->shared_experts")
        return out

    @property
    def upstream(self) -> bool:
        """Whether SGLang itself runs this combination on this architecture (SboFlags)."""
        return not (self.mode == 2 and self.arch != "blackwell") and not (
            self.mode == 3 and self.arch == "blackwell"
        )

    def meta(self) -> dict:
        return {
            "sbo_mode": self.mode,
            "sbo_overlaps": self.overlaps,
            "sbo_upstream": self.upstream,
            "comm_sms": self.comm_sms,
            "compute_sms": self.compute_sms,
        }


def comm_sms(gpu: GPU, cfg: ScheduleConfig) -> int:
    """--comm-sms (SGLANG_DEEPEP_LL_COMBINE_SEND_NUM_SMS) or the preset (3 Hopper, 32 Blackwell)."""
    return resolve_comm_sms(cfg.of(Knobs).comm_sms, gpu, default=gpu.sbo_comm_sms)


def plan(gpu: GPU, cfg: ScheduleConfig) -> SboPlan:
    mode, hopper = cfg.of(Knobs).sbo_mode, gpu.arch != "blackwell"
    return SboPlan(
        mode=mode,
        arch=gpu.arch,
        num_sms=gpu.num_sms,
        comm_sms=comm_sms(gpu, cfg),
        stream_down_gemm=mode == 1,
        combine_on_alt=mode in (1, 2),
        shared_in_dispatch_hook=mode == 3 or (mode == 1 and hopper),
        shared_after_down=mode == 2 or (mode == 1 and not hopper),
    )


def signal_count(w: Workload, gpu: GPU, padded_tokens: int) -> int:
    """Signals the down GEMM raises for a (micro-)batch of ``padded_tokens``: Blackwell one per
    local expert; Hopper one per 64-row block of each local expert (experts x ceil(rows / 64))."""
    if gpu.arch == "blackwell":
        return w.local_experts
    moe_rows = math.ceil(padded_tokens / w.parallel.attn_tp)  # ops.moe_tokens
    rows = math.ceil(moe_rows * w.model.top_k / w.local_experts)
    return w.local_experts * math.ceil(rows / SIGNAL_BLOCK_M)


def stream_chunks(signals: int) -> list[float]:
    """Fractions of the down GEMM in each signalled slice: one per signal, equal (the blocks of
    one micro-batch hold the same expected rows)."""
    return [1.0 / signals] * signals


# ----------------------------------------------------------------------------------------------
# Splitting ops' work (never inventing it)
# ----------------------------------------------------------------------------------------------


def split_experts(op: Op) -> tuple[Op, Op]:
    """The routed-experts op as its gate-up GEMM (+ SiLU-and-mul) and its down GEMM.

    Per token copy a SwiGLU expert does gate+up = 2·h·i·2 FLOPs and down = h·i·2, so the down
    GEMM is 1/3 of the FLOPs; it also holds 1/3 of the weights (h·i of 3·h·i), which dominate the
    bytes, so the HBM bytes are split in the same 2:1 ratio.
    """
    gate_up = replace(
        op, name=f"{op.name}.gate_up", flops=op.flops * 2 / 3, hbm_bytes=op.hbm_bytes * 2 / 3
    )
    down = replace(op, name=f"{op.name}.down", flops=op.flops / 3, hbm_bytes=op.hbm_bytes / 3)
    return gate_up, down


def _scaled_coll(c: Coll | None, f: float) -> Coll | None:
    if c is None:
        return None
    return Coll(c.key, c.role, tuple(Flow(x.link, x.nbytes * f, x.dst) for x in c.flows))


def split_op(op: Op, fractions: list[float], **kw) -> list[Op]:
    """``op`` cut into pieces named ``name.k`` doing ``fractions[k]`` of its work and traffic
    (flows keep the collective key, so a receive half waits for every piece)."""
    return [
        replace(
            op,
            name=f"{op.name}.{k}",
            flops=op.flops * f,
            hbm_bytes=op.hbm_bytes * f,
            coll=_scaled_coll(op.coll, f),
            **kw,
        )
        for k, f in enumerate(fractions)
    ]


# ----------------------------------------------------------------------------------------------
# Lowering of the MoE ops: shared by sbo and tbo+sbo
# ----------------------------------------------------------------------------------------------


def _ev(op: Op, what: str) -> str:
    return f"s{op.step}.L{op.layer}.mb{op.mb}.sbo.{what}"


def lower_experts(p: SboPlan, ops: dict[str, Op], signals: int) -> list[GpuInstr]:
    """Routed experts on main, with the passes around the grouped GEMMs (``parts`` of
    ``experts``; in low-latency mode the activation, fused with the down GEMM's input
    quantisation). Mode 1: gate-up on all SMs, the activation, DownGemmOverlapArgs.start_event,
    then the down GEMM on the compute SMs, a signal (event) after each chunk. Mode 2: the
    experts' kernels, then ``record_event_after_down`` (recorded in the pre-combine hook)."""
    experts = ops["experts"]
    if p.stream_down_gemm:
        gate_up, down = split_experts(experts)
        before, between, after = _around(ops)
        out: list[GpuInstr] = launches([*before, gate_up, *between])
        out.append(Record(_ev(experts, "start"), MAIN))
        for k, piece in enumerate(split_op(down, stream_chunks(signals), sms=p.compute_sms)):
            out += [Launch(piece, MAIN), Record(_ev(experts, f"sig{k}"), MAIN)]
        return out + launches(after)
    out = launches(parts(ops, "experts"))
    if p.combine_on_alt:
        out.append(Record(_ev(experts, "down_done"), MAIN))
    return out


#: The passes upstream runs between the gate-up and the down GEMM.
BETWEEN_GEMMS = ("experts.act", "experts.quant", "experts.act_quant")


def _around(ops: dict[str, Op]) -> tuple[list[Op], list[Op], list[Op]]:
    """The parts of ``experts`` before its GEMMs, between the gate-up and the down GEMM once the
    two are split (the activation and its quantisation), and after them."""
    ps = parts(ops, "experts")
    i = ps.index(ops["experts"])
    between = [op for op in ps[i + 1 :] if op.name in BETWEEN_GEMMS]
    return ps[:i], between, [op for op in ps[i + 1 :] if op.name not in BETWEEN_GEMMS]


def lower_combine_a(p: SboPlan, combine_a: Op, experts: Op, signals: int) -> list[GpuInstr]:
    """combine_a: on alt with the comm SMs after ``alt.wait_event(wait_event)``; in mode 1 one
    resident kernel polling every signal of the down GEMM. Mode 3 alone: on main, unchanged."""
    if not p.combine_on_alt:
        return [Launch(combine_a, MAIN)]
    if not p.stream_down_gemm:
        return [
            Wait(ALT, _ev(experts, "down_done")),
            Launch(replace(combine_a, sms=p.comm_sms), ALT),
        ]
    waits = tuple(_ev(experts, f"sig{k}") for k in range(signals))
    return [
        Wait(ALT, _ev(experts, "start")),
        Launch(replace(combine_a, sms=p.comm_sms, waits=waits), ALT),
    ]


def lower_combine_b(p: SboPlan, combine_b: Op, experts: Op) -> list[GpuInstr]:
    """combine_b: alt.wait_stream(main); hook() on main waits for the traffic; main waits alt."""
    if not p.combine_on_alt:
        return [Launch(combine_b, MAIN)]
    return [WaitStream(ALT, MAIN), Launch(combine_b, MAIN), WaitStream(MAIN, ALT)]


def moe_layer(p: SboPlan, ops: dict[str, Op], signals: int) -> list[GpuInstr]:
    """One MoE layer as DeepseekV2MoE.forward_deepep issues it with SBO on."""
    shared = parts(ops, "shared_experts")  # the input quantisation, then the MLP
    attn = ("comm_prepare_attn", "attn.prepare", "attn.core")
    body = launches(op for k in attn for op in parts(ops, k))
    body += launches(
        op for k in ("comm_prepare_mlp", "gate", "select_experts") for op in parts(ops, k)
    )
    body.append(Launch(ops["dispatch_a"], MAIN))  # LL send: the traffic is in flight from here
    if p.shared_in_dispatch_hook:  # _deepep_dispatch_hook: shared experts while dispatch flies
        body += launches(shared)
    body.append(Launch(ops["dispatch_b"], MAIN))  # the receive hook
    body += lower_experts(p, ops, signals)
    if p.shared_after_down:  # _pre_combine_hook, DeepGEMM limited to the compute SMs
        body += launches(replace(op, sms=p.compute_sms) for op in shared)
    body += lower_combine_a(p, ops["combine_a"], ops["experts"], signals)
    body += lower_combine_b(p, ops["combine_b"], ops["experts"])
    if not (p.shared_in_dispatch_hook or p.shared_after_down):
        body += launches(shared)  # not reached by modes 1-3; kept for completeness
    body += launches(ops[k] for k in ("output", "comm_postprocess_layer"))
    return body


# ----------------------------------------------------------------------------------------------
# build
# ----------------------------------------------------------------------------------------------


def forward_body(
    w: Workload,
    gpu: GPU,
    mb: MicroBatch,
    moe: Callable[[dict[str, Op]], list[GpuInstr]],
    *,
    mode: str,
    step: int,
) -> list[GpuInstr]:
    """embed, the dense layers as serial runs them, each MoE layer as ``moe`` lowers its ops,
    logits, sample (shared by sbo and sbo-off, which differ only in the MoE layer)."""
    head = head_ops(w, gpu, mb, step=step)
    body: list[GpuInstr] = [Launch(head["embed"], MAIN)]
    for layer in range(w.model.num_layers):
        ops = layer_ops(w, gpu, layer, mb, deepep_mode=mode, step=step)
        body += moe(ops) if w.model.is_moe_layer(layer) else launches(ops.values())
    body += launches([*parts(head, "logits"), head["sample"]])
    body += launches(mtp_ops(w, gpu, mb, deepep_mode=mode, step=step))  # the MTP draft forward
    return body


def build(w: Workload, gpu: GPU, cfg: ScheduleConfig, *, schedule: str = "sbo") -> Program:
    mode = cfg.resolved_deepep_mode(w.batch.mode)
    p = plan(gpu, cfg)
    mb = whole_batch(w)
    if mode != "low_latency":
        base = serial.build(w, gpu, cfg)
        reason = "SBO overlaps DeepEP's low-latency combine; this batch uses the normal kernels"
        meta = base.meta.merged(schedule=schedule, fallback_reason=reason, **p.meta())
        return replace(base, meta=meta)
    signals = signal_count(w, gpu, mb.padded_tokens)
    body = forward_body(w, gpu, mb, lambda ops: moe_layer(p, ops, signals), mode=mode, step=0)
    rank = step_frame(w, gpu, cfg, body, streams=(MAIN, ALT))
    return program(
        [rank],
        world=w.parallel.ep,
        schedule=schedule,
        deepep_mode=mode,
        micro_batches=[mb.as_meta()],
        sbo_signals=signals,
        **p.meta(),
    )


def sbo_launch(d: Deployment) -> tuple[tuple[Flag, ...], tuple[tuple[str, str], ...]]:
    """SBO's flags and what has none: ``--enable-single-batch-overlap``; the combine's SMs as
    ``SGLANG_DEEPEP_LL_COMBINE_SEND_NUM_SMS`` (set where ``comm_sms`` was given); the mode has no
    flag (SGLang's ``SboFlags`` picks the overlaps by GPU and MoE kernels). tbo+sbo adds these."""
    k = d.cfg.of(Knobs)
    flags = [sglang_flag("enable_single_batch_overlap", carries="sbo")]
    if k.comm_sms is not None:
        flags.append(sglang_env("SGLANG_DEEPEP_LL_COMBINE_SEND_NUM_SMS", k.comm_sms, "comm_sms"))
    p = plan(d.gpu, d.cfg)
    why = (
        "SGLang's SboFlags (python/sglang/srt/batch_overlap/single_batch_overlap.py) picks the "
        "overlaps from the GPU and the MoE kernels (Hopper with DeepGEMM: mode 1)"
    )
    if not p.upstream:
        why += f"; mode {p.mode} on {p.arch} is a what-if SGLang does not run"
    return tuple(flags), (("sbo_mode", why),)


def launch_flags(d: Deployment) -> ServerLaunch:
    """SGLang with Single Batch Overlap (:func:`sbo_launch`; docs/tune.md)."""
    return sglang(d, *sbo_launch(d))
