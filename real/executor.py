"""The executor: interprets a Program with real kernels (``real.kernels``), on the CPU or a GPU.

:func:`execute` = :func:`setup` (the Program validated by ``shared.ir.validate``, as the
simulator validates it; defaults, weights, the run's precision, the kernels bound, one
``RankRunner`` per rank) -> :func:`run` (warm-up, eager pass, timed runs, each logged into its
own ``RunLog``) -> ``real.timing.timing`` (the run the trace shows, how it was timed). The jobs
sit in their own modules: ``real.runner`` (one rank's interpreter, in ``shared.ir.issue``'s issue
order), ``real.graphs`` (CUDA-graph capture plans), ``real.hazards`` (the CPU's happens-before
check), ``real.timing`` (timing and the trace meta).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from overlap_lab.real import fp8
from overlap_lab.real import kernels as K
from overlap_lab.real import model as M
from overlap_lab.real.graphs import GraphPlan, plan_graph, plan_graphs
from overlap_lab.real.hazards import HazardError, HazardTracker
from overlap_lab.real.runlog import RunLog
from overlap_lab.real.runner import Mailbox, RankRunner, Setup, limit_status, run_once
from overlap_lab.real.timing import (
    ExecMeta,
    Run,
    Runs,
    gpu_meta,
    precision_meta,
    run_meta,
    setup_notes,
    timing,
    timing_meta,
)
from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.ir.program import Graph, Program, ops_of
from overlap_lab.shared.ir.validate import validate
from overlap_lab.shared.outputs.trace import Trace

#: The kernel family whose ops launch no kernel (no-ops, and ops computed inside another op):
#: the trace meta ``no_kernel_ops`` names the run's, so a prediction can leave them out.
PLACEHOLDERS = "placeholders"

__all__ = [
    "ExecMeta",
    "ExecResult",
    "GraphPlan",
    "HazardError",
    "HazardTracker",
    "Setup",
    "execute",
    "limit_status",
    "plan_graph",
    "plan_graphs",
    "precision_meta",
    "run",
    "setup",
    "timing",
    "timing_meta",
]


@dataclass
class ExecResult:
    """Outputs per rank and step, plus the Trace (timings only on a GPU)."""

    outputs: dict[int, dict[int, K.StepState]]
    trace: Trace
    violations: list[str] = field(default_factory=list)


def setup(
    program: Program,
    workload,
    *,
    weights: M.ModelWeights | None,
    backend,
    device: str,
    dtype: torch.dtype | None,
    seed: int,
    check_hazards: bool | None,
    ranks: list[int] | None,
    host_spin: bool,
    cuda_graphs: bool,
    gpu: GPU | None = None,
    kernels: Sequence[str | K.KernelFamily] = (),
) -> Setup:
    """The Program validated first (``shared.ir.validate.validate``, the check the simulator
    runs: ProgramError naming the faulty instruction; with ``gpu``, the GPU the Program was
    built for, its SM rules too), then defaults resolved, weights made (this rank's experts)
    and, for an FP8 run, quantised once here (never inside a step or a captured graph), the
    run's precision resolved, the kernels bound (``real.kernels.bindings(kernels)``), one
    RankRunner per rank this process runs."""
    validate(program, gpu.num_sms if gpu is not None else None)
    bound = K.bindings(kernels)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if dtype is None:
        dtype = torch.bfloat16 if cuda else torch.float32
    if check_hazards is None:
        check_hazards = not cuda
    cfg = M.from_model_config(workload.model)
    if backend is None:
        from overlap_lab.real.comm.loopback import LoopbackBackend

        backend = LoopbackBackend(rank=0, world=1, num_experts=cfg.num_experts, hidden=cfg.hidden)
    if weights is None:  # this rank's experts: all of them with the local backend
        weights = M.init_weights(
            cfg, seed=seed, dtype=dtype, device=dev, ep_rank=backend.rank, ep_size=backend.world
        )
    from overlap_lab.real.gemm import deep_gemm_module

    precision = fp8.resolve(
        workload.model.gemm_dtype, cuda=cuda, module=deep_gemm_module() if cuda else None
    )
    fp8_weights = fp8.load_weights(weights) if precision.fp8 else None
    mailbox = Mailbox()
    chosen = [rp for rp in program.ranks if ranks is None or rp.rank in ranks]
    runners = tuple(
        RankRunner(
            rp,
            program,
            weights=weights,
            backend=backend,
            workload=workload,
            device=dev,
            seed=seed,
            check_hazards=check_hazards,
            world=mailbox,
            host_spin=host_spin,
            cuda_graphs=cuda_graphs,
            precision=precision,
            fp8_weights=fp8_weights,
            kernels=bound,
        )
        for rp in chosen
    )
    has_graphs = any(isinstance(i, Graph) for rp in chosen for th in rp.threads for i in th.instrs)
    return Setup(
        dev, dtype, check_hazards, backend, precision, runners, has_graphs,
        graph_timed=cuda and has_graphs and cuda_graphs, kernels=bound,
    )  # fmt: skip


def run(su: Setup, *, warmup: int, repeats: int) -> Runs:
    """``warmup`` unrecorded runs, then (graph-timed) an eager pass of ``max(1, repeats)`` runs
    (op by op: per-op spans, and the kernels' bookkeeping, which a replay skips), then
    ``repeats`` timed runs, last, so the outputs left in the runners are theirs."""
    phases = ["warmup"] * warmup + ["eager"] * (max(1, repeats) if su.graph_timed else 0)
    phases += ["timed"] * repeats
    timed: list[Run] = []
    eager: list[Run] = []
    try:
        for phase in phases:
            for r in su.runners:
                r.force_eager = phase == "eager"
            log = RunLog()
            run_once(list(su.runners), log)
            if phase == "warmup":
                continue
            tr = Trace([s for r in su.runners for s in r.spans], {})
            rec = Run(tr, run_meta(list(su.runners), su.backend, log, su.precision))
            (eager if phase == "eager" else timed).append(rec)
    finally:
        for r in su.runners:
            r.force_eager = False
    return Runs(tuple(timed), tuple(eager))


def execute(
    program: Program,
    workload,
    *,
    weights: M.ModelWeights | None = None,
    backend=None,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
    check_hazards: bool | None = None,
    ranks: list[int] | None = None,
    warmup: int = 0,
    repeats: int = 1,
    host_spin: bool = False,
    meta: dict | None = None,
    cuda_graphs: bool = True,
    gpu: GPU | None = None,
    kernels: Sequence[str | K.KernelFamily] = (),
) -> ExecResult:
    """Run ``program`` for ``workload``, after validating it as the simulator does (``gpu``:
    the GPU it was built for, for the rules on SMs; a Program that fails is a ProgramError
    and nothing runs). ``kernels``: kernel families (registered names, or ``KernelFamily``
    objects) whose kernels bind their ops ahead of the other registered families (none by
    default: every registered family binds its ops). ``ranks``: which of the Program's ranks
    this process runs (default: all it holds). On the CPU hazards are checked by default; a violation raises
    HazardError listing them. On a GPU, ``warmup`` unrecorded runs, then ``repeats`` timed runs;
    the Trace is the repeat with the median step time (all step times in its meta). On a GPU
    with ``cuda_graphs``, each Graph runs op by op on its first run, is captured on its second
    and replayed from then on (``warmup >= 2`` times only replays); the trace meta
    ``cuda_graphs`` says, per graph, "captured" or why it ran op by op."""
    su = setup(
        program, workload, weights=weights, backend=backend, device=device, dtype=dtype,
        seed=seed, check_hazards=check_hazards, ranks=ranks, host_spin=host_spin,
        cuda_graphs=cuda_graphs, gpu=gpu, kernels=kernels,
    )  # fmt: skip
    runs = run(su, warmup=warmup, repeats=repeats)
    violations = [v for r in su.runners if r.tracker for v in r.tracker.violations]
    if violations and su.check_hazards:
        raise HazardError(
            f"{len(violations)} unordered read(s) in schedule {program.meta.schedule!r}:\n  "
            + "\n  ".join(violations[:10])
        )
    trace, tmeta, rmeta = timing(su, runs)
    em = ExecMeta(
        program=program.meta.as_dict(),
        backend=dict(su.backend.describe()),
        device=str(su.device),
        dtype=str(su.dtype).replace("torch.", ""),
        world=program.world,
        setup_notes=setup_notes(program, su),
        caller=dict(meta or {}),
        timing=tmeta,
        run=rmeta,
        step_times_us=tuple(r.trace.step_time_us for r in runs.timed),
        warmup=warmup,
        repeats=repeats,
        gpu=gpu_meta(su),
        kernel_families=su.kernels.families_of(op.name for _, op in ops_of(program)),
        no_kernel_ops=tuple(
            su.kernels.bound_by((op.name for _, op in ops_of(program)), PLACEHOLDERS)
        ),
    )
    trace.meta.update(em.as_dict())
    outputs = {r.rp.rank: r.states for r in su.runners}
    return ExecResult(outputs, trace, violations)
