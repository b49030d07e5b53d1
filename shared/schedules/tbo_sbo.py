"""TBO and SBO at once [docs/schedules.md, "TBO and SBO together"]: TBO interleaves the two
micro-batches stage by stage; inside each micro-batch's MoE, SBO lowers the experts and combine operations onto two
streams with the SM partition of ``sbo.plan``.

Per micro-batch, in the stage TBO's strategy gives each operation:
    experts   -> mode 1: gate-up, then the down GEMM on the compute SMs with a signal per chunk;
                 mode 2: experts, then record_event_after_down
    combine_a -> on the alt stream with the comm SMs (mode 1: one piece per signal chunk)
    combine_b -> alt waits main, the receive hook on main, main waits alt
The shared experts stay where TBO's strategy puts them (decode: stage 2, right after dispatch_a,
which already is mode 3's "shared experts while the dispatch flies"), so mode 3 adds nothing to
TBO's decode and mode 2 only moves the combine to the alt stream. Both micro-batches share the
layer's one alt stream (SGLang creates one per model), so their combines queue on it.

SBO needs the low-latency combine: a prefill batch on DeepEP's normal kernels runs plain TBO
(``sbo_inactive_reason``). When TBO refuses to split, SGLang's normal forward still runs SBO, so
the unsplit fallback is the SBO program with TBO's ``fallback_reason``.

Note on upstream: SGLang registers SBO's hooks in ``DeepseekV2MoE.forward_deepep``; its TBO
``op_*`` path (op_experts / op_combine_a) does not pass overlap args in the versions read for this
module, whereas SGLang's design describes the two as composed. This module follows the design.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.inputs.workload import Workload
from overlap_lab.shared.ir.program import GpuInstr, Op, Program
from overlap_lab.shared.schedules import sbo, tbo
from overlap_lab.shared.schedules.config import ScheduleConfig
from overlap_lab.shared.schedules.launch import Deployment, ServerLaunch, sglang
from overlap_lab.shared.schedules.tbo_split import tbo_split

UPSTREAM = "SGLang two_batch_overlap.py + batch_overlap/single_batch_overlap.py"
SUMMARY = (
    "SGLang TBO + SBO: micro-batches interleaved by TBO, each one's MoE combine overlapped by SBO"
)


@dataclass(frozen=True)
class Knobs(tbo.Knobs, sbo.Knobs):
    """TBO's knobs and SBO's, as each declares them."""


SCHEDULE = "tbo+sbo"


def make_lowering(w: Workload, gpu: GPU, p: sbo.SboPlan):
    """TBO's per-operation lowering with SBO's two-stream version of the MoE operations."""

    def lower(key: str, ops: dict[str, Op]) -> list[GpuInstr]:
        signals = sbo.signal_count(w, gpu, ops["experts"].tokens)
        if key == "experts":
            return sbo.lower_experts(p, ops, signals)
        if key == "combine_a":
            return sbo.lower_combine_a(p, ops["combine_a"], ops["experts"], signals)
        if key == "combine_b":
            return sbo.lower_combine_b(p, ops["combine_b"], ops["experts"])
        return tbo.lower_op(key, ops)

    return lower


def build(w: Workload, gpu: GPU, cfg: ScheduleConfig) -> Program:
    mode = cfg.resolved_deepep_mode(w.batch.mode)
    p = sbo.plan(gpu, cfg)
    split = tbo_split(w, cfg, mode)
    if split.micro_batches is None:  # TBO refused: the normal forward, with SBO where it applies
        base = sbo.build(w, gpu, cfg, schedule=SCHEDULE)
        meta = base.meta.merged(fallback_reason=split.fallback_reason)
        if base.meta.fallback_reason is not None:
            meta = meta.merged(sbo_inactive_reason=base.meta.fallback_reason)
        return replace(base, meta=meta)
    if mode != "low_latency":
        reason = "SBO overlaps DeepEP's low-latency combine; this batch uses the normal kernels"
        return tbo.build(
            w, gpu, cfg, schedule=SCHEDULE, extra_meta=dict(sbo_inactive_reason=reason, **p.meta())
        )
    signals = [sbo.signal_count(w, gpu, mb.padded_tokens) for mb in split.micro_batches]
    extra = dict(p.meta(), sbo_signals=signals)
    # Under TBO only the combine side is SBO's: the shared experts stay in TBO's stages.
    extra["sbo_overlaps"] = {1: ["combine<->down_gemm"], 2: ["combine on alt after down"], 3: []}[
        p.mode
    ]
    return tbo.build(
        w,
        gpu,
        cfg,
        schedule=SCHEDULE,
        lower=make_lowering(w, gpu, p),
        extra_streams=(sbo.ALT,),
        extra_meta=extra,
    )


def launch_flags(d: Deployment) -> ServerLaunch:
    """SGLang with both overlaps: TBO's flags and SBO's (docs/tune.md)."""
    t_flags, t_none = tbo.tbo_launch(d)
    s_flags, s_none = sbo.sbo_launch(d)
    return sglang(d, t_flags + s_flags, t_none + s_none)
