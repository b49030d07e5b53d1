"""The simulator's side of the loop: the calibration profile from measured serial runs, the
prediction of each schedule with it (plus rows measured in the schedule's own run, so no
roofline rows remain), and the comparison of predicted with measured."""

from __future__ import annotations

import dataclasses
import statistics

from overlap_lab.experiments.gpu_validation.context import Context
from overlap_lab.shared.ir.program import ops_of


def prediction_workload(w, measured_meta: dict):
    """``w`` as the measured run ran it: a run whose FP8 GEMMs fell back to BF16 (``mixed`` or
    ``bf16`` in ``gemm_precision``) is predicted with gemm_dtype="bf16"."""
    used = (measured_meta.get("gemm_precision") or {}).get("used", w.model.gemm_dtype)
    if w.model.gemm_dtype == "fp8" and used != "fp8":
        return dataclasses.replace(w, model=dataclasses.replace(w.model, gemm_dtype="bf16"))
    return w


def measured_step(tr) -> tuple[float, str]:
    g = tr.meta.get("graph_replay_step_time_us")
    if g and tr.meta.get("step_time_source") == "graph_replay":
        return g, "graph replay"
    return tr.meta.get("median_step_time_us", tr.step_time_us), "eager"


def calibrate_profile(ctx: Context, runs: list, mode: str):
    """The simulator's calibration path (``sim.calibrate.profile_from_trace``) on measured
    ``serial`` runs [(Program, Trace)]: per profiled compute op, its measured duration by token
    count and SMs. Ops outside ``sim.profile.PROFILED_OPS`` get no row (the roofline times
    them; ``cost_sources`` says so)."""
    from overlap_lab.sim.calibrate import profile_from_trace

    env = ctx.env
    return profile_from_trace(
        [(tr, p) for p, tr in runs], num_sms=ctx.device_sms, name=f"gpu-validation-{mode}",
        device=str(env.get("device")), date=str(env.get("date", "unknown"))[:10],
        software={k: str(v) for k, v in env.get("versions", {}).items() if v},
        source=f"gpu_validation: serial {mode} runs of the real executor on {env.get('device')}",
    )  # fmt: skip


def predict(ctx: Context, name: str, w, profile, transform=None):
    """The simulator's prediction of schedule ``name`` with the calibration ``profile``
    (``overlap_lab.simulate(..., profile=...)``; ``transform`` rewrites the Program first):
    (trace, cost sources per op class)."""
    from overlap_lab.api import simulate
    from overlap_lab.sim.calibrate import cost_sources

    res = simulate(name, w, ctx.gpu, profile=profile, transform=transform)
    return res.trace, cost_sources(res.program, ctx.gpu, profile)


def own_rows(ctx: Context, name: str, profile, prog, w, measured) -> tuple:
    """``profile`` plus rows for the compute ops of ``prog`` that it cannot time (no roofline
    rows in a validation): class rows for names a profile cannot carry (SBO's and LightLLM's
    split expert kernels), name rows for known names serial does not run (SGLang's
    overlap-scheduler ops), measured in a run of ``prog`` itself: on a GPU a short extra run
    under torch.profiler (device time; the timed run stays unprofiled), on the CPU the measured
    run's spans. Ops whose kernels took no time (bound as no-ops in the executor) stay on the
    roofline and are listed. Returns (profile, {row key: [op names]} of the rows added)."""
    from overlap_lab.calibrate import unprofiled_rows, with_rows

    names = set(roofline_ops(ctx, prog, profile))
    if not names:
        return profile, {}
    tr = measured
    if ctx.device == "cuda":
        tr = ctx.measure(prog, w, device_time=True, warmup=1, repeats=1)
    rows = unprofiled_rows([(tr, prog)], num_sms=ctx.device_sms, names=names,
                           source=f"gpu_validation: {name}'s own run")  # fmt: skip
    if not rows:
        return profile, {}
    keys = {r["op"] for r in rows}
    own: dict[str, set[str]] = {}
    for _, op in ops_of(prog):
        if op.name in names and (op.name in keys or op.op_class in keys):
            own.setdefault(op.name if op.name in keys else op.op_class, set()).add(op.name)
    return with_rows(profile, rows), {c: sorted(n) for c, n in sorted(own.items())}


def roofline_ops(ctx: Context, prog, profile) -> list[str]:
    """Compute ops of the simulated Program ``prog`` that no profile row times (the roofline
    does): a validation should have none. Ops without work (the communication-only case's
    stand-ins) take no time either way and are not listed."""
    from overlap_lab.sim.cost import duration_source

    return sorted(
        {op.name for _, op in ops_of(prog)
         if op.kind == "compute" and (op.flops > 0 or op.hbm_bytes > 0)
         and duration_source(op, ctx.gpu, profile) == "roofline"}
    )  # fmt: skip


def comparison(measured, predicted, measured_step_us: float) -> dict:
    """``overlap_lab.validate.compare`` (the simulator's validation), against the step time the
    run reports (graph replay where captured), with each op's error summarised per op name."""
    from overlap_lab.validate import compare

    v = dataclasses.replace(compare(measured, predicted), measured_step_us=measured_step_us)
    by_op: dict[str, list[float]] = {}
    for o in v.ops:
        if o.measured_us > 0:
            by_op.setdefault(o.key[1], []).append(o.error)
    errs = [abs(e) for es in by_op.values() for e in es]
    return {
        "step_time_us": {"predicted": v.predicted_step_us, "measured": v.measured_step_us,
                         "rel_error": v.step_error if v.measured_step_us else None},
        "exposed_comm_us": {"predicted": v.predicted_exposed_us,
                            "measured": v.measured_exposed_us, "abs_error_us": v.exposed_error_us},
        "per_op": {n: {"median_rel_error": statistics.median(es), "n": len(es)}
                   for n, es in sorted(by_op.items())},
        "per_op_median_abs_rel_error": statistics.median(errs) if errs else None,
        "ops_aligned": len(v.ops),
        "ops_only_predicted": v.only_predicted,
        "ops_only_measured": v.only_measured,
    }  # fmt: skip


def sources_text(sources: dict) -> str:
    """``{"gemm": {"profile": 12}, "elementwise": {"profile": 4, "roofline": 6}}`` ->
    "gemm: profile 12; elementwise: profile 4, roofline 6"."""
    return "; ".join(
        f"{c}: " + ", ".join(f"{s} {n}" for s, n in sorted(v.items()))
        for c, v in sorted(sources.items())
    )
