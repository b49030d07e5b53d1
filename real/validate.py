"""Predicted vs measured: calibrate the simulator on the executor's own kernels, predict every
schedule, measure it, compare. Library functions (no I/O); the loop that runs them on a device
and writes one archive is ``python -m overlap_lab.experiments.gpu_validation``.

1. **Calibration** (:func:`profile_from_runs`): the ``serial`` schedule measured at the token
   counts the schedules use (the batch, and its halves for micro-batched schedules). Serial runs
   one op at a time on one stream with every SM, so each compute op's span is its isolated
   duration. The profile holds, per op (name without piece index), (tokens, median µs) points.
2. **Prediction** (:func:`calibrated_program`, :func:`predict`): each compute op of a schedule's
   Program gets its work (flops and HBM bytes) scaled so that the simulator's solo duration on
   every SM equals the profile's duration at its token count (log-log interpolation between
   measured sizes, the nearest segment's slope outside them); the simulator then shares SMs and
   HBM between concurrent kernels and limits budgets as it always does. Ops with no profile row
   (communication: the α-β link model the emulated backend also uses; host work) keep the
   roofline; the counts say how many came from where.
3. **Comparison** (:func:`compare`): step time, exposed communication and per-op durations
   (aligned by rank, op, layer, micro-batch and step), with relative errors.

CPU runs go through the same functions: their times are host wall-clock, meaningless as
GPU timings, and every result says so (``timing_meaningful: False``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import defaultdict

from overlap_lab.shared.program import Graph, Launch, Op, Program, map_ops
from overlap_lab.shared.trace import Trace

Profile = dict[str, list[tuple[int, float]]]  # op name -> sorted (tokens, µs)


def base_name(name: str) -> str:
    """``experts.down.2`` -> ``experts.down``; other names unchanged."""
    head, _, tail = name.rpartition(".")
    return head if head and tail.isdigit() else name


def op_key(rank: int, op: str, layer, mb, step) -> tuple:
    return (rank, op, layer, mb, step)


def launched_ops(program: Program) -> dict[tuple, Op]:
    """Every launched op keyed like a span: (rank, name, layer, mb, step)."""
    out = {}
    for rp in program.ranks:
        for th in rp.threads:
            for ins in th.instrs:
                body = ins.body if isinstance(ins, Graph) else (ins,)
                for i in body:
                    if isinstance(i, Launch):
                        o = i.op
                        out[op_key(rp.rank, o.name, o.layer, o.mb, o.step)] = o
    return out


def stream_durations(trace: Trace) -> dict[tuple, float]:
    """Duration of every stream span, keyed (rank, op, layer, mb, step); a key seen twice
    (a repeated op) keeps the sum."""
    out: dict[tuple, float] = defaultdict(float)
    for s in trace.spans:
        if s.lane.startswith("stream:") and not s.op.startswith("graph:"):
            out[op_key(s.rank, s.op, s.layer, s.mb, s.step)] += s.end - s.start
    return dict(out)


def profile_from_runs(runs: list[tuple[Program, Trace]], num_sms: int) -> Profile:
    """The calibration profile of measured serial runs: per compute op that ran on every SM
    (no limit, or one at the device's SMs), its duration by token count (median over layers,
    micro-batches and runs)."""
    pts: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for program, trace in runs:
        ops = launched_ops(program)
        for key, dur in stream_durations(trace).items():
            op = ops.get(key)
            if op is None or op.kind != "compute" or (op.sms and op.sms < num_sms):
                continue
            pts[base_name(op.name)][int(op.tokens)].append(dur)
    return {
        name: sorted((t, statistics.median(v)) for t, v in by_tok.items())
        for name, by_tok in pts.items()
    }


def interpolate(points: list[tuple[int, float]], tokens: int) -> float:
    """Duration at ``tokens`` from sorted (tokens, µs) points: exact on a point, log-log linear
    between two, the nearest segment's log-log slope (clamped to [0, 1]) outside them, the value
    itself for a single point."""
    if len(points) == 1:
        return points[0][1]
    t = max(int(tokens), 1)
    for tk, us in points:
        if tk == t:
            return us
    xs = [max(tk, 1) for tk, _ in points]
    if t < xs[0]:
        i = 0
    elif t > xs[-1]:
        i = len(points) - 2
    else:
        i = max(j for j in range(len(xs) - 1) if xs[j] <= t)
    (t0, y0), (t1, y1) = (xs[i], points[i][1]), (xs[i + 1], points[i + 1][1])
    if y0 <= 0 or y1 <= 0 or t0 == t1:
        return max(y0, y1)
    slope = math.log(y1 / y0) / math.log(t1 / t0)
    if not xs[0] <= t <= xs[-1]:
        slope = min(max(slope, 0.0), 1.0)
    return y0 * (t / t0) ** slope


def calibrated_program(program: Program, gpu, profile: Profile) -> tuple[Program, dict]:
    """``program`` with each profiled compute op's flops and bytes scaled so the simulator's
    solo duration on every SM equals the profile's; returns it and per-op-name counts
    ``{"profile": n, "roofline": m}`` (the source of each compute op's duration)."""
    from overlap_lab.sim.cost import solo_duration_us

    counts: dict[str, dict[str, int]] = defaultdict(lambda: {"profile": 0, "roofline": 0})

    def fix(op: Op) -> Op:
        if op.kind != "compute" or (op.flops <= 0 and op.hbm_bytes <= 0):
            return op
        name = base_name(op.name)
        pts = profile.get(name)
        if not pts:
            counts[name]["roofline"] += 1
            return op
        target = interpolate(pts, op.tokens)
        counts[name]["profile"] += 1
        out = op
        for _ in range(6):  # the model is linear in the work above its launch floor: few rounds
            model = solo_duration_us(out, gpu, gpu.num_sms)
            if model <= 0 or target <= 0 or abs(model - target) <= 1e-3 * target:
                break
            f = target / model
            out = dataclasses.replace(out, flops=out.flops * f, hbm_bytes=out.hbm_bytes * f)
        return out

    program = map_ops(program, fix)
    meta = dict(program.meta)
    meta["calibrated"] = "op durations from a measured profile (real.validate)"
    return dataclasses.replace(program, meta=meta), {k: dict(v) for k, v in counts.items()}


def predict(program: Program, gpu) -> Trace:
    """The simulator's trace of ``program`` (simpy needed)."""
    from overlap_lab.sim.engine import simulate

    return simulate(program, gpu)


def _rel(pred: float, meas: float) -> float | None:
    return None if not meas else (pred - meas) / meas


def compare(pred: Trace, meas: Trace, *, measured_step_us: float | None = None) -> dict:
    """Predicted vs measured. ``measured_step_us``: the step time to compare with (default the
    measured trace's span extent; a graph-timed run passes its graph-replay step time). Per op:
    the stream spans present in both traces, aligned by (rank, op, layer, mb, step)."""
    step_m = measured_step_us if measured_step_us is not None else meas.step_time_us
    step_p = pred.step_time_us
    exp_p, exp_m = pred.exposed_comm_us(0), meas.exposed_comm_us(0)
    dp, dm = stream_durations(pred), stream_durations(meas)
    common = sorted(set(dp) & set(dm), key=str)
    by_op: dict[str, list[float]] = defaultdict(list)
    for k in common:
        if dm[k] > 0:
            by_op[k[1]].append((dp[k] - dm[k]) / dm[k])
    per_op = {
        name: {"median_rel_error": statistics.median(v), "n": len(v)}
        for name, v in sorted(by_op.items())
    }
    all_err = [abs(e) for v in by_op.values() for e in v]
    return {
        "step_time_us": {
            "predicted": step_p,
            "measured": step_m,
            "rel_error": _rel(step_p, step_m),
        },
        "exposed_comm_us": {"predicted": exp_p, "measured": exp_m, "abs_error_us": exp_p - exp_m},
        "per_op": per_op,
        "per_op_median_abs_rel_error": statistics.median(all_err) if all_err else None,
        "ops_aligned": len(common),
        "ops_only_predicted": len(set(dp) - set(dm)),
        "ops_only_measured": len(set(dm) - set(dp)),
    }


def ranking(step_us: dict[str, float]) -> list[str]:
    """Schedule names, fastest first."""
    return sorted(step_us, key=lambda n: step_us[n])
