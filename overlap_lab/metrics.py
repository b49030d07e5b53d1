"""The headline numbers of a run, each with one definition (docs/metrics.md says why each is so).

Schedules simulate different windows: a one-step schedule (serial, SBO, TBO, LightLLM, vLLM DBO,
DeepSeek) one scheduler iteration, ``sglang-overlap`` ``iterations`` of them (its point is the
host running one iteration ahead), ``pp`` ``iterations × micro_batches`` micro-batch iterations on
every stage. Each schedule module says how its window is counted (its ``iterations_and_tokens``;
one iteration of the batch where it says nothing). A trace's wall time
(:attr:`Trace.step_time_us`) therefore means different things for different schedules; the
numbers here do not:

- ``iterations``: scheduler-loop iterations of one rank in the window (one forward of one batch:
  a micro-batch of pp on its stage's layers, the whole batch otherwise).
- ``window_us``: the wall time of the window, first span to last, every rank.
- ``iteration_us``: ``window_us / iterations``, the mean time per iteration (pipeline fill and
  drain included: they are part of what a schedule costs over that many iterations).
- ``tokens``: tokens one GPU pushes through the whole model in the window (decode: sequences ×
  tokens per sequence per iteration; prefill: new tokens); for pp, the tokens its pipeline
  completes divided by its ``pp`` stages, since every stage holds a slice of the layers.
- ``tokens_per_s_gpu`` = ``tokens / window_us``, and ``tokens_per_s_node`` that times
  ``gpus_per_node``: throughput at equal GPU count, what compare ranks by.
- ``comm_window_us``: wall time of the window with communication in flight (DeepEP/NCCL kernels
  or link transfers) on rank 0; ``exposed_comm_window_us`` the part of it with no compute kernel
  running on that rank; the rest is hidden. ``comm_us`` and ``exposed_comm_us`` are the same per
  iteration (divided by ``iterations``): every time without ``window`` in its name is per
  iteration, so a number means one thing whatever the schedule's window.
- SM time on rank 0, as fractions of ``num_sms × window_us``: ``sm_compute`` (compute kernels'
  SMs × duration), ``sm_comm`` (communication kernels' SMs; hooks that wait on traffic hold
  none), ``sm_idle`` the rest. Their first two add up to what used to be printed as "SM
  utilisation", which counted a DeepEP kernel spinning on RDMA as a busy SM.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from overlap_lab.shared import schedules
from overlap_lab.shared.inputs.workload import Workload
from overlap_lab.shared.ir.program import Program
from overlap_lab.shared.outputs.trace import COMM_KINDS, Trace, length, union


@dataclass(frozen=True)
class Metrics:
    """What one simulated (or measured) run reports; see the module docstring for definitions."""

    iterations: int
    window_us: float
    iteration_us: float
    tokens: int
    tokens_per_s_gpu: float
    tokens_per_s_node: float
    gpus: int
    comm_us: float
    exposed_comm_us: float
    comm_window_us: float
    exposed_comm_window_us: float
    sm_compute: float
    sm_comm: float
    sm_idle: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def iterations_and_tokens(program: Program, w: Workload) -> tuple[int, int]:
    """(iterations of one rank in the window, tokens one GPU completes through the model): the
    rule of the schedule that built ``program`` (``shared.schedules.iterations_and_tokens``)."""
    return schedules.iterations_and_tokens(program.meta.schedule, program, w)


def sm_time(trace: Trace, num_sms: int, rank: int = 0) -> tuple[float, float, float]:
    """(compute, comm, idle) shares of ``num_sms × window`` SM-time on ``rank``'s streams."""
    window = trace.step_time_us
    if window <= 0:
        return 0.0, 0.0, 1.0
    comp = comm = 0.0
    for s in trace.spans_of(rank):  # canonical order, as over all spans: the same float sums
        if not s.lane.startswith("stream:"):
            continue
        if s.kind == "compute":
            comp += s.sms * s.duration
        elif s.kind == "comm":
            comm += s.sms * s.duration
    total = num_sms * window
    comp, comm = comp / total, comm / total
    return comp, comm, max(0.0, 1.0 - comp - comm)


def comm_us(trace: Trace, rank: int = 0) -> float:
    """Wall time of ``rank`` with any communication kernel or link transfer in flight."""
    return length(union((s.start, s.end) for s in trace.spans_of(rank) if s.kind in COMM_KINDS))


def compute_kernel_us(trace: Trace, rank: int = 0) -> float:
    """GPU time spent in compute kernels of ``rank``: the sum over kernels (kernels running
    together on different streams each count). A column of the experiments' and the sweep's
    results alike, so it is defined once, here."""
    return sum(s.duration for s in trace.spans if s.rank == rank and s.kind == "compute")


def measure(trace: Trace, program: Program, w: Workload, num_sms: int) -> Metrics:
    """The :class:`Metrics` of one run of ``program`` for ``w`` (rank 0 for per-rank numbers)."""
    iters, tokens = iterations_and_tokens(program, w)
    window = trace.step_time_us
    rank = min(trace.ranks, default=0)
    tps = tokens / window * 1e6 if window > 0 else 0.0
    comp, comm, idle = sm_time(trace, num_sms, rank)
    comm_window, exposed_window = comm_us(trace, rank), trace.exposed_comm_us(rank)
    return Metrics(
        iterations=iters,
        window_us=window,
        iteration_us=window / iters,
        tokens=tokens,
        tokens_per_s_gpu=tps,
        tokens_per_s_node=tps * w.parallel.gpus_per_node,
        gpus=w.parallel.world,
        comm_us=comm_window / iters,
        exposed_comm_us=exposed_window / iters,
        comm_window_us=comm_window,
        exposed_comm_window_us=exposed_window,
        sm_compute=comp,
        sm_comm=comm,
        sm_idle=idle,
    )
