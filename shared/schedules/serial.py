"""The serial baseline: one stream, every op of every layer in order, dense then MoE.

The host launches every kernel (or one graph launch for a CUDA-graph decode step) and processes
the step's result only after the step has finished: nothing overlaps but what one stream allows.
"""

from __future__ import annotations

from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.inputs.workload import MicroBatch, Workload
from overlap_lab.shared.ir.builder import ThreadBuilder, program
from overlap_lab.shared.ir.ops import head_ops, layer_ops, mtp_ops, parts, whole_batch
from overlap_lab.shared.ir.program import Launch, Op, Program
from overlap_lab.shared.schedules.config import ScheduleConfig
from overlap_lab.shared.schedules.frame import step_frame
from overlap_lab.shared.schedules.launch import Deployment, ServerLaunch, sglang, sglang_flag

UPSTREAM = "SGLang Scheduler.event_loop_normal (python/sglang/srt/managers/scheduler.py)"
SUMMARY = "one stream, ops of each layer in order; the host waits for each step's result"


def layer_sequence(
    w: Workload, gpu: GPU, mb: MicroBatch, layers: range, *, deepep_mode: str, step: int | None
) -> list[Op]:
    """Every op of ``layers`` for one micro-batch, in the order the upstream models run them."""
    ops: list[Op] = []
    for layer in layers:
        ops += layer_ops(w, gpu, layer, mb, deepep_mode=deepep_mode, step=step).values()
    return ops


def forward_sequence(
    w: Workload, gpu: GPU, mb: MicroBatch, *, deepep_mode: str, step: int | None = None
) -> list[Op]:
    """embed, every layer, logits, sample: one forward pass of one micro-batch in order; then,
    in a decode step that verifies draft tokens, the MTP module proposing the next ones
    (``shared.ir.ops.mtp_ops``: SGLang's EAGLE worker runs the draft forward after the verify)."""
    head = head_ops(w, gpu, mb, step=step)
    body = layer_sequence(w, gpu, mb, range(w.model.num_layers), deepep_mode=deepep_mode, step=step)
    mtp = mtp_ops(w, gpu, mb, deepep_mode=deepep_mode, step=step)
    return [head["embed"], *body, *parts(head, "logits"), head["sample"], *mtp]


def launch_all(t: ThreadBuilder, ops: list[Op], stream: str, *, graph: str | None) -> None:
    """Launch ``ops`` in order on ``stream``, captured in one CUDA graph when ``graph`` names one."""
    if graph:
        t.begin_graph()
    for op in ops:
        t.launch(op, stream)
    if graph:
        t.end_graph(graph)


def build(w: Workload, gpu: GPU, cfg: ScheduleConfig) -> Program:
    mode = cfg.resolved_deepep_mode(w.batch.mode)
    mb = whole_batch(w)
    ops = forward_sequence(w, gpu, mb, deepep_mode=mode, step=0)
    rank = step_frame(w, gpu, cfg, (Launch(op, "main") for op in ops), streams=("main",))
    return program(
        [rank],
        world=w.parallel.ep,
        schedule="serial",
        deepep_mode=mode,
        micro_batches=[mb.as_meta()],
    )


def launch_flags(d: Deployment) -> ServerLaunch:
    """SGLang with its overlap scheduler off: ``--disable-overlap-schedule`` runs
    ``event_loop_normal``, the host waiting for each step's result (docs/tune.md)."""
    return sglang(d, (sglang_flag("disable_overlap_schedule", carries="schedule"),))
