"""What a call of the executor measured and used: which run the trace shows, how it was timed
(op-by-op CUDA-event spans, graph replays, host wall-clock on the CPU), the kernels and SM
limits of that run, and the trace meta as one record (``ExecMeta``)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from overlap_lab.real import fp8
from overlap_lab.real.runlog import RunLog
from overlap_lab.real.runner import RankRunner, Setup
from overlap_lab.shared.ir.program import Program
from overlap_lab.shared.outputs.trace import Trace


def timing_meta(graph_traces: list[Trace], eager_traces: list[Trace]) -> tuple[Trace, dict]:
    """A graph-timed run's two measurements, kept apart: ``graph_traces`` (CUDA graphs
    replayed: the step time a serving engine sees; a replayed graph is one span) and
    ``eager_traces`` (the same Program op by op: one CUDA-event span per op, for per-op times
    and exposed communication). Returns the eager trace of median step time (the spans) and
    the meta that says which number is which."""
    g = [t.step_time_us for t in graph_traces]
    e = [t.step_time_us for t in eager_traces]
    med = sorted(range(len(e)), key=lambda i: e[i])[len(e) // 2]
    meta = {
        "step_time_source": "graph_replay",
        "graph_replay_step_times_us": g,
        "graph_replay_step_time_us": statistics.median(g) if g else None,
        "eager_step_times_us": e,
        "eager_step_time_us": statistics.median(e),
        "spans_source": "eager pass: op by op, one CUDA-event span per op (graphs not replayed)",
    }
    return eager_traces[med], meta


def replay_launch_meta(timed) -> dict:
    """What decides the wait before a replayed graph's first kernel (``overlap_lab.graph_launch``),
    per timed replay run: the host time of each ``graph.replay()`` (``graph_launch_host_us``,
    its ``cudaGraphLaunch`` without the profiler) and each graph's CUDA-event span
    (``graph_replay_spans_us``: start event to end event; the step less these is the host's
    work before and after the graphs)."""
    launches = [r.meta.get("graph_launch_host_us") or {} for r in timed]
    spans = [[s.duration for s in r.trace.spans if s.op.startswith("graph:")] for r in timed]
    return {"graph_launch_host_us": launches, "graph_replay_spans_us": spans}


def run_meta(runners: list[RankRunner], backend, log: RunLog, precision: fp8.Precision) -> dict:
    """What one timed run used: the GEMM kernels by label (counted for this run only), how each
    SM limit of the Program was honoured (compute ops here, all-to-alls by the backend)."""
    from overlap_lab.real.gemm import DEEP_GEMM_ERRORS

    limits: dict[str, dict] = {}
    for r in runners:
        for name, v in r.sm_limits.items():
            limits.setdefault(name, v)
    comm = {k: dict(v) for k, v in getattr(backend, "sm_limits", {}).items()}
    meta = {
        "sm_budget_mechanisms": dict(log.gemms),
        "sm_limits": {"compute": limits, "comm": comm},
    }
    meta["gemm_precision"] = precision_meta(log.gemms, precision)
    if log.notes:
        meta["kernel_notes"] = dict(log.notes)
    if "attention" in log.kernels:
        meta["attention_kernels"] = dict(log.kernels["attention"])
    if log.launches:  # per op name the median host time of its eager launches (µs)
        meta["host_launch_us"] = {n: statistics.median(v) for n, v in sorted(log.launches.items())}
    if log.graph_launches:  # per graph name the host time of each of its replays (µs)
        meta["graph_launch_host_us"] = {n: list(v) for n, v in sorted(log.graph_launches.items())}
    if DEEP_GEMM_ERRORS:
        meta["deep_gemm_errors"] = dict(DEEP_GEMM_ERRORS)
    return meta


def precision_meta(applied: dict[str, int], p: fp8.Precision) -> dict:
    """The run's GEMM precision: what the workload asked for (``p``), what ran (``fp8``, ``bf16``,
    or ``mixed`` when FP8 GEMMs fell back to BF16 after a DeepGEMM failure), why, and the counts."""
    n_fp8 = sum(n for k, n in applied.items() if k.startswith("deep_gemm.") and "fp8" in k)
    n_back = sum(n for k, n in applied.items() if k.startswith("bf16 fallback"))
    used = p.used
    if p.fp8 and n_back:
        used = "mixed" if n_fp8 else "bf16"
    return {"requested": p.requested, "used": used, "reason": p.reason,
            "fp8_gemms": n_fp8, "bf16_fallbacks": n_back}  # fmt: skip


@dataclass(frozen=True)
class Run:
    """One recorded run: its trace and what its kernels used (:func:`_run_meta`)."""

    trace: Trace
    meta: dict


@dataclass(frozen=True)
class Runs:
    """The recorded runs of a call: the timed ones and, for a graph-timed call, the eager pass."""

    timed: tuple[Run, ...]
    eager: tuple[Run, ...]


@dataclass(frozen=True)
class ExecMeta:
    """The trace meta of a call, as one record: :meth:`as_dict` lays it out key by key in the
    order consumers have always read it (the Program's meta, the backend's, the run's setup,
    the caller's ``meta``, then how it was timed, what its kernels used, its step times)."""

    program: dict
    backend: dict
    device: str
    dtype: str
    world: int
    setup_notes: dict  # the CPU's graph and timing notes, pp in one process
    caller: dict
    timing: dict  # step_time_source, spans_source (+ the graph-timed pair of measurements)
    run: dict  # run_meta of the run whose spans the trace holds
    step_times_us: tuple[float, ...]
    warmup: int
    repeats: int
    gpu: dict  # clocks, cuda_graphs (a GPU run)
    kernel_families: dict  # family -> how many of the Program's op names its kernels ran
    no_kernel_ops: tuple[str, ...] = ()  # op names bound to no kernel (placeholders)

    def as_dict(self) -> dict:
        d = dict(self.program)
        d.update(self.backend)
        d.update(device=self.device, dtype=self.dtype, world=self.world)
        d.update(self.setup_notes)
        d.update(self.caller)
        d.update(self.timing)
        d.update(self.run)
        d.update(
            step_times_us=list(self.step_times_us),
            median_step_time_us=statistics.median(self.step_times_us),
            warmup=self.warmup,
            repeats=self.repeats,
        )
        d.update(self.gpu)
        d["kernel_families"] = dict(self.kernel_families)
        d["no_kernel_ops"] = list(self.no_kernel_ops)
        return d


def setup_notes(program: Program, su: Setup) -> dict:
    notes: dict[str, str] = {}
    if su.has_graphs and not su.cuda:
        notes["cuda_graphs"] = "CPU: graph bodies run op by op"
    if not su.cuda:
        notes["timing"] = "none: CPU spans are host wall-clock of ordered execution"
    if (program.meta.pp_size or 1) > 1:
        notes["pp_in_one_process"] = (
            "every pipeline stage runs in this one process (one device): not the timing of one "
            "stage per GPU"
        )
    return notes


def timing(su: Setup, runs: Runs) -> tuple[Trace, dict, dict]:
    """The run the trace shows (median step time; of a graph-timed call, the eager pass's, see
    :func:`timing_meta`), how it was timed, and what its kernels used."""
    times = [r.trace.step_time_us for r in runs.timed]
    med = sorted(range(len(times)), key=lambda i: times[i])[len(times) // 2]
    if su.graph_timed:
        trace, tmeta = timing_meta([r.trace for r in runs.timed], [r.trace for r in runs.eager])
        tmeta.update(replay_launch_meta(runs.timed))
        # the eager pass's bookkeeping: replays run no Python kernels
        run_meta = next(r.meta for r in runs.eager if r.trace is trace)
        captured = any(
            g.get("mode") == "captured" for r in su.runners for g in r.gpu.graphs.values()
        )
        if not captured:  # every graph fell back to op by op: both passes were eager
            tmeta["step_time_source"] = "eager (no graph captured: see cuda_graphs)"
        return trace, tmeta, run_meta
    tmeta = {
        "step_time_source": "eager" if su.cuda else "cpu",
        "spans_source": "op by op, one CUDA-event span per op"
        if su.cuda
        else "host wall-clock of ordered execution",
    }
    return runs.timed[med].trace, tmeta, runs.timed[med].meta


def gpu_meta(su: Setup) -> dict:
    if not su.cuda:
        return {}
    cm = next((r.gpu.clock for r in su.runners if r.gpu.clock is not None), None)
    out: dict[str, Any] = {"clocks": cm.describe() if cm is not None else None}
    if su.has_graphs:
        out["cuda_graphs"] = {
            g["name"]: g["mode"] + (f" ({g['reason']})" if g.get("reason") else "")
            for r in su.runners
            for g in r.gpu.graphs.values()
        }
    return out
