"""One scheduler step around a forward pass, as every single-thread schedule frames it.

Host scheduling, the forward's launches (one CUDA graph for a graph-captured decode, every
micro-batch inside it), the non-blocking D2H of the sampled ids, the one host sync on it and the
host's result processing: the serial baseline's step, shared so that schedules differ only in
their forward body.
"""

from __future__ import annotations

from collections.abc import Iterable

from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.inputs.workload import Workload
from overlap_lab.shared.ir.builder import RankBuilder
from overlap_lab.shared.ir.ops import head_ops, whole_batch
from overlap_lab.shared.ir.program import Instr, Sync
from overlap_lab.shared.schedules.config import ScheduleConfig


def step_frame(
    w: Workload,
    gpu: GPU,
    cfg: ScheduleConfig,
    body: Iterable[Instr],
    *,
    streams: tuple[str, ...],
    step: int = 0,
    stream: str = "main",
    priorities: tuple[tuple[str, int], ...] = (),
) -> RankBuilder:
    """A rank whose host thread "main" runs one step around ``body`` (launches, records, waits;
    host syncs only outside a CUDA graph). The D2H copy and the step's end sit on ``stream``."""
    mb = whole_batch(w)
    rank = RankBuilder(0, streams, priorities=priorities)
    t = rank.thread("main")
    t.host("schedule", cfg.host.schedule_us(w.batch.num_seqs), step=step)
    graph = cfg.use_cuda_graph(w.batch.mode)
    if graph:
        t.begin_graph()
    for ins in body:
        if graph and isinstance(ins, Sync):
            raise ValueError("a host sync cannot sit inside a CUDA graph")
        t.emit(ins)
    if graph:
        t.end_graph("forward")
    t.launch(head_ops(w, gpu, mb, step=step)["d2h"], stream)
    t.record("step_done", stream)
    t.sync("step_done")
    t.host("process_result", cfg.host.process_result_us(w.batch.num_seqs), step=step)
    return rank
