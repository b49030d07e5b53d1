"""The simulator's side of the loop: the calibration profile from recorded serial runs
(:func:`calibrate`), the prediction of each schedule with it as the executor ran it (plus rows
measured in the schedule's own run, so no roofline rows remain), and the comparison of predicted
with measured (:func:`judge`). Nothing here runs the executor: a live loop hands it the runs it
just recorded, a replay (``replay``) the runs an archive kept."""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from overlap_lab.experiments.gpu_validation.comm_only import COMM_ONLY, comm_only, comm_program
from overlap_lab.shared.ir.program import Graph, Host, Launch, Record, Sync, ops_of


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


@dataclass(frozen=True)
class CalibrationRun:
    """One recorded calibration run: the Program, the executor's trace of it (CUDA-event or
    host spans), its kernel records (a torch.profiler trace of the run, ``None`` where the
    device records none) and the unprofiled graph-replay step of the same Program (for the
    gap between a graph's kernels; ``None`` where it was not measured)."""

    program: object
    trace: object
    kernels: Mapping | None = None
    replay_step_us: float | None = None
    label: str = ""  # "serial 128": the schedule and its size, for the record
    #: per op name the host time of its eager launch in the unprofiled run of the same Program
    #: (the executor's trace meta ``host_launch_us``); None where it was not recorded
    host_launch_us: Mapping | None = None
    #: the executor's trace of the unprofiled run of the same Program (serial at the case's
    #: size: the loop's measured run), for the profiler's share of host time; None elsewhere
    unprofiled: object = None
    #: ``trace`` is itself that unprofiled run and ``kernels`` come from a separate profiled
    #: run of the same Program (an archive converted from before replays): the profiler's
    #: share from whole eager passes (:func:`pass_idle_scale`)
    trace_unprofiled: bool = False


def calibrate(setup, runs: list[CalibrationRun], mode: str) -> tuple:
    """The profile of recorded calibration runs, and the setup to predict with: its GPU with
    what the runs measured of the executor's launches where they can (else the preset's, and
    the record says so): the gap between a replayed graph's kernels and the wait before its
    first kernel (``overlap_lab.device_time.graph_gap_us``, ``graph_launch_wait_us``: a run
    with replays and an unprofiled step), each eager op's host steps and read-backs
    (``device_time.host_launch``, ``op_host``) scaled by the profiler's share in serial's
    unprofiled run (:func:`profiler_scale`, else ``device_time.idle_scale``); and the emulated backend's
    data path per communication op (``emulated_comm.local_work``). Each op's duration is its
    kernels' device time (graph replays where it ran in one, the gaps between its own kernels
    included), or its span where there are no kernel records. Returns (profile, setup, info
    for the case's record)."""
    from overlap_lab.calibrate import apply_device_time
    from overlap_lab.device_time import (
        graph_gap_us,
        graph_launch_wait_us,
        host_launch,
        idle_scale,
        kernels_per_op,
        map_kernels,
    )
    from overlap_lab.experiments.gpu_validation import emulated_comm, host_pieces
    from overlap_lab.graph_launch import first_segment, fit_wait, unprofiled_launch

    gpu, preset = setup.gpu, f"the {setup.gpu.name} preset"
    source = wait_source = preset
    segment = unprofiled = None
    points = []  # (first segment, wait) of each run with an unprofiled replay step
    host, kernels, scale, scaled_by, shares = None, {}, None, "", {}
    for r in runs:
        if not r.kernels:
            continue
        km = map_kernels(r.kernels)
        kernels = kernels_per_op(km) | kernels  # the first run's counts win
        if host is None and (host := host_launch(r.kernels)) is not None:
            label = r.label
            if n := host_pieces.calibration_pieces(r.trace.meta.get("micro_batches")):
                shares = host_pieces.piece_shares(r.kernels, n)
            if r.host_launch_us:
                scale = profiler_scale(host, r.host_launch_us)
                scaled_by = (
                    "its unprofiled launch times over the profiled ones (ops without a read-back)"
                )
            elif r.unprofiled is not None:
                scale = idle_scale(r.trace, r.unprofiled, km)
                scaled_by = (
                    "the device's waits inside its ops in the unprofiled run over the "
                    "profiled one (CUDA-event spans less kernel time)"
                )
            elif r.trace_unprofiled:
                scale = pass_idle_scale(r.trace, r.kernels)
                scaled_by = (
                    "the device's waits in the unprofiled run's median eager step over those "
                    "in the profiled run's median eager pass (each less the pass's kernel time)"
                )
        if not r.replay_step_us:
            continue
        wait = graph_launch_wait_us(km, r.replay_step_us)
        points.append((first_segment(r.kernels), wait))
        gap = graph_gap_us(km, r.replay_step_us)
        if source != preset or gap is None or wait is None:
            continue
        gpu = dataclasses.replace(gpu, graph_kernel_gap_us=gap, graph_launch_us=wait)
        source = (f"measured: the lesser of (unprofiled replay step {r.replay_step_us:.1f} "
                  "us, profiled replay span) less the kernels' device time, per kernel")  # fmt: skip
        segment = points[-1][0]
        unprofiled = unprofiled_launch(r.unprofiled.meta if r.unprofiled is not None else None)
        wait_source = (f"measured: {r.label}'s unprofiled replay step {r.replay_step_us:.1f} us "
                       "less its profiled replays' span")  # fmt: skip
    graph_wait = fit_wait(points)
    if graph_wait is not None:
        wait_source += (f"; per graph: {graph_wait.fixed_us:.1f} us + {graph_wait.per_record_us:.3f}"
                        " us per device record before its first memset (all where none): "
                        f"{graph_wait.source}")  # fmt: skip
    launch = {"source": f"{preset}: launch_us {gpu.launch_us} per op"}
    if host is not None:
        host = dataclasses.replace(host, kernels=kernels)
        if scale is not None:
            host = dataclasses.replace(host, scale=scale)
        # a launch pays the last kernel's share; a Host before it the rest (as_executed)
        gpu = dataclasses.replace(gpu, launch_us=host.per_kernel * host.scale)
        launch = {
            "per_op": host.per_op, "per_kernel": host.per_kernel, "scale": host.scale,
            "ops": {n: dataclasses.asdict(h) for n, h in host.measured.items()},
            "per_piece": {n: dataclasses.asdict(p) for n, p in shares.items()},
            "source": (
                f"measured in {label}'s eager runs under the profiler (medians over "
                f"{host.ranges} op ranges, {host.intervals} launch intervals), "
                + (f"x {scale:.3f}: {scaled_by}" if scale is not None
                   else "not scaled: no unprofiled run to compare with")
                + "".join(f"; {n}: {p.share:.0%} of its host work once per sequence piece "
                          f"({p.pieces} in the calibration)" for n, p in shares.items())
            ),
        }  # fmt: skip
    timed = [
        (r.program, apply_device_time(r.trace, r.kernels, gpu.graph_kernel_gap_us))
        if r.kernels
        else (r.program, r.trace)
        for r in runs
    ]
    profile = calibrate_profile(dataclasses.replace(setup, gpu=gpu), timed, mode)
    work = emulated_comm.local_work(runs, gpu.graph_kernel_gap_us)
    dt = [tr.meta.get("device_time") for _, tr in timed]
    info = {
        "profile_rows": len(profile.rows),
        "calibration_durations": (
            "kernel device time (torch.profiler records mapped to ops; graph replays where the "
            "op ran in one)"
            if all(dt)
            else "CUDA-event / host spans (no kernel records on this device)"
            if not any(dt)
            else "kernel device time where a run has kernel records ("
            + ", ".join(r.label for r, d in zip(runs, dt) if d)
            + "), CUDA-event spans elsewhere ("
            + ", ".join(r.label for r, d in zip(runs, dt) if not d)
            + ")"
        ),
        "calibration_device_time": dt,
        "graph_kernel_gap_us": {"us": gpu.graph_kernel_gap_us, "source": source},
        "graph_launch_us": {
            "us": gpu.graph_launch_us,
            "source": wait_source,
            "fixed_us": None if graph_wait is None else graph_wait.fixed_us,
            "per_record_us": None if graph_wait is None else graph_wait.per_record_us,
            "first_segment": segment,
            "unprofiled": unprofiled,
        },
        "host_launch_us": launch,
        "op_kernels": kernels or None,
        "emulated_comm_local_us": emulated_comm.rows(work),
    }
    at = dataclasses.replace(setup, gpu=gpu, comm_local=work, host_launch=host,
                             graph_wait=graph_wait, host_pieces=shares)  # fmt: skip
    return profile, at, info


def profiler_scale(host, unprofiled: Mapping[str, float]) -> float | None:
    """The unprofiled host time of the executor's eager launches over the profiled one: the
    sum over the ops without a read-back that both measured (``unprofiled``: per op name, the
    executor's trace meta ``host_launch_us``, which holds any wait for a read-back; ``host``:
    a ``device_time.HostLaunch``). None where they share no such op."""
    both = [n for n, h in host.measured.items() if not h.syncs and h.us > 0 and n in unprofiled]
    if not both:
        return None
    return sum(float(unprofiled[n]) for n in both) / sum(host.measured[n].us for n in both)


def pass_idle_scale(unprofiled, kernels) -> float | None:
    """How much less the device waits for the host without the profiler, from whole eager
    passes: the unprofiled run's median eager step (``unprofiled``, the executor's trace)
    less the profiled passes' median kernel time (the union of their kernels' intervals), over
    the profiled passes' median span (first kernel to last; ``kernels``, the profiler records
    of a separate run of the same Program) less the same. The waits inside ops and between
    them are taken together: such a recording has no CUDA-event spans of its profiled run
    (``device_time.idle_scale`` compares those). On the H200, 2026-11-26, serial prefill 4096:
    3,025 µs of 237,982 unprofiled, 9,256 of 244,213 profiled (x 0.327). None without an
    eager pass or an eager step, or where the profiled passes never waited."""
    from overlap_lab.device_time import split_runs

    m = unprofiled.meta
    step = m.get("eager_step_time_us") or (
        m.get("median_step_time_us") if m.get("step_time_source") == "eager" else None
    )
    spans, busy = [], []
    for r in split_runs(kernels)[0]:
        ks = sorted((k.ts, k.ts + k.dur) for v in r.ops.values() for k in v)
        if r.replay or not ks:
            continue
        spans.append(max(b for _, b in ks) - ks[0][0])
        total, end = 0.0, ks[0][0]
        for a, b in ks:
            total += max(0.0, b - max(a, end))
            end = max(end, b)
        busy.append(total)
    if not step or not spans:
        return None
    waited = statistics.median(spans) - statistics.median(busy)
    return max(float(step) - statistics.median(busy), 0.0) / waited if waited > 0 else None


def calibrate_profile(ctx, runs: list, mode: str):
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


def predict(ctx, name: str, w, profile, transform=None, comm_local=None):
    """The simulator's prediction of schedule ``name`` with the calibration ``profile``
    (``overlap_lab.simulate(..., profile=...)``; ``transform`` rewrites the Program first;
    ``comm_local``: the emulated backend's data path per communication op, charged by
    ``emulated_comm.EmulatedCommCost`` over the roofline with ``profile``): (trace, cost
    sources per op class)."""
    from overlap_lab.api import simulate
    from overlap_lab.sim.calibrate import cost_sources

    cost = None
    if comm_local:
        from overlap_lab.experiments.gpu_validation.emulated_comm import EmulatedCommCost
        from overlap_lab.sim.cost import RooflineCostModel

        cost = EmulatedCommCost(RooflineCostModel(profile), comm_local)
    res = simulate(name, w, ctx.gpu, profile=profile, transform=transform, cost_model=cost)
    return res.trace, cost_sources(res.program, ctx.gpu, profile)


def as_executed(
    measured, comm_local=None, num_sms: int = 0, host_launch=None, pieces: Mapping | None = None
) -> Callable:
    """A Program transform: the Program as the executor ran it, read off its ``measured``
    trace (:func:`executed_changes` lists what it changes). Host work takes what the
    executor's host spans took (it runs no scheduler: under a microsecond each, where the
    Program carries SGLang's scheduler costs), 0 where it has no span; a compute op whose SM
    limit the run reports ``not enforced`` (attention, norms and elementwise kernels run on
    every SM: DeepSeek's prefill gives attention 108) runs on every SM, as it ran; an op the
    run launched no kernel for (``no_kernel_ops``: no-ops, and ops computed inside another op,
    whose measured time holds theirs) or did not run at all is left out; with ``comm_local``
    (the emulated backend's data path: ``emulated_comm``), a DeepEP receive that holds no SMs
    but ran kernels runs them on ``num_sms``; with ``host_launch`` (``device_time.HostLaunch``,
    the GPU's ``launch_us`` its scaled ``per_kernel``), an eager launch of an op holds the
    host for the executor's time to launch it, in the steps the calibration measured
    (``HostLaunch.op``, ``device_time.OpHost``): ``Host``s named ``launch`` for its host work,
    a ``Record`` and a ``Sync`` on the op's stream where it reads device data back, and the
    launch itself where half of its device time has been launched (it pays the last kernel's
    share of the host work before it); with ``pieces`` (per op name a
    ``host_pieces.PieceShare``), an op the executor runs once per sequence piece holds the host
    for its micro-batch's pieces (the measured run's ``micro_batches``), not the calibration's.
    A launch inside a ``Graph`` costs nothing per kernel (the graph's launch,
    ``GPU.graph_launch_us``, is the wait before its first kernel). The simulator's
    defaults (``sim``) keep SGLang's host costs, one ``launch_us`` per op and every limit."""
    from overlap_lab.experiments.gpu_validation import emulated_comm, host_pieces

    host: dict[tuple, list[float]] = {}
    for s in measured.spans:
        if s.lane.startswith("host:") and s.kind == "host":
            host.setdefault((s.op, s.mb, s.layer, s.step), []).append(s.duration)
            host.setdefault((s.op,), []).append(s.duration)
    free, gone = executed_changes(measured)
    per_mb = host_pieces.pieces_per_mb(measured.meta.get("micro_batches"))

    def host_us(h: Host) -> float:
        got = host.get((h.name, h.mb, h.layer, h.step)) or host.get((h.name,))
        return statistics.median(got) if got else 0.0

    def unlimited(op):
        base = op.name.rsplit(".", 1)[0] if op.name.rsplit(".", 1)[-1].isdigit() else op.name
        if op.kind == "compute" and op.sms and (op.name in free or base in free):
            return dataclasses.replace(op, sms=None)
        return op

    readbacks = itertools.count()

    def launched(ins: Launch) -> list:
        """An eager launch with what its host does around it (the docstring)."""
        op, h = ins.op, host_launch.op(ins.op.name)
        if (p := (pieces or {}).get(op.name)) is not None and op.mb in per_mb:
            h = h.scaled(p.factor(per_mb[op.mb]))
        last = host_launch.per_kernel * host_launch.scale  # the launch's own cost
        out: list = []
        for kind, us in h.steps:
            if kind == "host":
                out.append(Host("launch", us, op.mb, op.layer, op.step))
            elif kind == "sync":
                ev = f"readback.{next(readbacks)}.{op.name}.L{op.layer}.mb{op.mb}"
                out += [Record(ev, ins.stream), Sync(ev)]
            else:
                if out and isinstance(out[-1], Host):  # the launch pays the last kernel's share
                    out[-1] = dataclasses.replace(out[-1], us=max(out[-1].us - last, 0.0))
                out.append(ins)
        return out

    def instrs(seq, eager: bool = True) -> tuple:
        out: list = []
        for ins in seq:
            if isinstance(ins, Host):
                ins = dataclasses.replace(ins, us=host_us(ins))
            elif isinstance(ins, Graph):
                ins = dataclasses.replace(ins, body=instrs(ins.body, eager=False))
            elif isinstance(ins, Launch):
                if gone(ins.op.name):
                    continue
                op = unlimited(ins.op)
                if comm_local:
                    op = emulated_comm.as_executed(op, comm_local, num_sms)
                ins = dataclasses.replace(ins, op=op)
                if eager and host_launch is not None:
                    out += launched(ins)
                    continue
            out.append(ins)
        return tuple(out)

    def transform(prog):
        ranks = tuple(
            dataclasses.replace(rp, threads=tuple(
                dataclasses.replace(th, instrs=instrs(th.instrs)) for th in rp.threads))
            for rp in prog.ranks
        )  # fmt: skip
        return dataclasses.replace(prog, ranks=ranks)

    return transform


def executed_changes(measured) -> tuple[set[str], Callable[[str], bool]]:
    """What :func:`as_executed` reads off ``measured``: the compute ops (by base name) whose
    SM limit was not enforced, and a test of an op name: whether the run launched no kernel
    for it or never ran it."""
    limits = (measured.meta.get("sm_limits") or {}).get("compute") or {}
    free = {n for n, v in limits.items() if str(v.get("status", "")).startswith("not enforced")}
    none = set(measured.meta.get("no_kernel_ops") or ())
    ran = {s.op for s in measured.spans if s.lane.startswith("stream:")}

    def gone(name: str) -> bool:
        return name in none or name not in ran

    return free, gone


def own_rows(ctx, name: str, profile, prog, own_run) -> tuple:
    """``profile`` plus rows for the compute ops of ``prog`` that it cannot time (no roofline
    rows in a validation): class rows for names a profile cannot carry (SBO's and LightLLM's
    split expert kernels), name rows for known names serial does not run (SGLang's
    overlap-scheduler ops), measured in ``own_run``, a run of ``prog`` itself: on a GPU a short
    extra run recorded with its kernels (device time, like the calibration's: an eager span
    holds the launch gaps between an op's kernels), on the CPU the measured run. Ops whose
    kernels took no time (bound as no-ops in the executor) stay on the roofline and are listed.
    Returns (profile, {row key: [op names]} of the rows added)."""
    from overlap_lab.calibrate import unprofiled_rows, with_rows

    names = set(roofline_ops(ctx, prog, profile))
    if not names or own_run is None:
        return profile, {}
    rows = unprofiled_rows([(own_run, prog)], num_sms=ctx.device_sms, names=names,
                           source=f"gpu_validation: {name}'s own run")  # fmt: skip
    if not rows:
        return profile, {}
    keys = {r["op"] for r in rows}
    own: dict[str, set[str]] = {}
    for _, op in ops_of(prog):
        if op.name in names and (op.name in keys or op.op_class in keys):
            own.setdefault(op.name if op.name in keys else op.op_class, set()).add(op.name)
    return with_rows(profile, rows), {c: sorted(n) for c, n in sorted(own.items())}


def roofline_ops(ctx, prog, profile) -> list[str]:
    """Compute ops of the simulated Program ``prog`` that no profile row times (the roofline
    does): a validation should have none. Ops without work (the communication-only case's
    stand-ins) take no time either way and are not listed."""
    from overlap_lab.sim.cost import duration_source

    return sorted(
        {op.name for _, op in ops_of(prog)
         if op.kind == "compute" and (op.flops > 0 or op.hbm_bytes > 0)
         and duration_source(op, ctx.gpu, profile) == "roofline"}
    )  # fmt: skip


def graphs_per_run(prog) -> int:
    """The CUDA graphs one run of ``prog`` replays on its first rank (one per step of a
    several-step Program): how many replays make the run's timeline
    (``overlap_lab.kernel_timeline.replay_trace``)."""

    def count(seq) -> int:
        return sum(1 if isinstance(i, Graph) else 0 for i in seq)

    return sum(count(th.instrs) for th in prog.ranks[0].threads)


def build(ctx, name: str, w):
    """The Program of ``name`` (the communication-only case's for ``comm-only``) for ``w``."""
    from overlap_lab.shared import schedules as S

    return comm_program(w, ctx.gpu) if name == COMM_ONLY else S.build(name, w, ctx.gpu)


def judge(ctx, name: str, w, measured, profile, own_run=None, replayed=None,
          own_kernels=None) -> tuple:  # fmt: skip
    """Predict schedule ``name`` on ``w`` as the executor ran it (:func:`as_executed` of its
    ``measured`` trace; rows of its ``own_run`` where the profile has none, and the host steps
    of its eager ops the calibration never ran from ``own_kernels``, that run's profiler
    records) and compare with the measurement (its exposed communication from ``replayed``,
    the timeline of the run's kernels, where given: ``overlap_lab.kernel_timeline``):
    (the run's record for the report, the predicted trace)."""
    comm = name == COMM_ONLY
    ctx, wait = graph_wait(ctx, own_kernels)
    prog = build(ctx, name, w)
    wp = prediction_workload(w, measured.meta)
    prof, own = own_rows(ctx, name, profile, prog, own_run if own_run is not None else measured)
    # the emulated backend's data path, where the run's communication was emulated
    local = ctx.comm_local if measured.meta.get("emulated") else {}
    host, own_host = own_host_steps(ctx.host_launch, prog, own_kernels)
    executed = as_executed(measured, local, ctx.device_sms, host, ctx.host_pieces)
    pred, sources = predict(
        ctx, "serial" if comm else name, wp, prof,
        transform=(lambda p: executed(comm_only(p))) if comm else executed, comm_local=local,
    )  # fmt: skip
    missing = roofline_ops(ctx, executed(build(ctx, name, wp)), prof)
    step_m, source = measured_step(measured)
    # a timeline is the run's where it holds every graph the run replays, or its eager pass
    whole = replayed is not None and (
        replayed.meta.get("replays", 1) == graphs_per_run(prog)
        if source == "graph replay"
        else "eager_runs" in replayed.meta
    )
    m = measured.meta
    own_dt = own_run.meta.get("device_time") if own and own_run is not None else None
    return {
        "comparison": comparison(measured, pred, step_m, replayed if whole else None),
        "measured_step_source": source,
        "eager_step_time_us": m.get("eager_step_time_us", m.get("median_step_time_us")),
        "step_times_us": m.get("step_times_us"),
        "cuda_graphs": m.get("cuda_graphs"),
        "sm_budget_mechanisms": m.get("sm_budget_mechanisms"),
        "sm_limits": m.get("sm_limits"),
        "kernel_notes": m.get("kernel_notes"),
        "attention_kernels": m.get("attention_kernels"),
        "gemm_precision": m.get("gemm_precision"),
        "predicted_gemm_dtype": wp.model.gemm_dtype,
        "deep_gemm_errors": m.get("deep_gemm_errors"),
        "cost_sources": sources,
        "rows_from_own_run": own,
        "host_steps_from_own_run": own_host,
        "own_run_durations": None if not own else (
            "kernel device time" if own_dt else "CUDA-event / host spans of the measured run"
        ),
        "roofline_ops": missing,
        "graph_launch_us": wait,
        "predicted_as_executed": executed_note(measured, prog),
        "predicted_comm": (
            "link model + the emulated backend's data path measured in the calibration "
            f"({len(local)} op sizes; experiments/gpu_validation/emulated_comm.py)"
            if local else "link model"
        ),
    }, pred  # fmt: skip


def graph_wait(ctx, own_kernels) -> tuple:
    """``ctx`` with its GPU's graph launch set to the wait of this schedule's graph: the
    calibrated rule (``ctx.graph_wait``, ``overlap_lab.graph_launch.LaunchWait``) for the
    records of the graph's first segment in ``own_kernels``, the profiler records of a run of
    the schedule itself; else ``ctx`` as it is (serial's wait per replay, or the preset's).
    Returns (ctx, the record of which)."""
    from overlap_lab.graph_launch import first_segment

    rule = ctx.graph_wait
    segment = first_segment(own_kernels) if own_kernels is not None else None
    if rule is None or segment is None:
        return ctx, {"us": ctx.gpu.graph_launch_us, "source": "the case's graph launch" + (
            "" if rule is None else ": no profiled replay of this schedule")}  # fmt: skip
    us = rule.us(segment)
    gpu = dataclasses.replace(ctx.gpu, graph_launch_us=us)
    return dataclasses.replace(ctx, gpu=gpu), {
        "us": us, "first_segment": segment,
        "source": f"{rule.fixed_us:.1f} us + {rule.per_record_us:.3f} us x {segment} device "
                  "records of its graph's first segment (before its first memset) in its "
                  "profiled replays",
    }  # fmt: skip


def own_host_steps(host, prog, own_kernels) -> tuple:
    """``host`` (a ``device_time.HostLaunch``) with the host steps of the ops of ``prog`` it
    has none for (SBO's and LightLLM's split experts) taken from ``own_kernels``, the profiler
    records of a run of ``prog`` itself (``device_time.op_host``), as :func:`own_rows` takes
    their device time; (that, the names so taken)."""
    from overlap_lab.device_time import op_host

    if host is None or not own_kernels:
        return host, []
    names = {op.name for _, op in ops_of(prog)}
    extra = {n: h for n, h in op_host(own_kernels).items()
             if n in names and n not in host.measured}  # fmt: skip
    if not extra:
        return host, []
    return dataclasses.replace(host, measured={**host.measured, **extra}), sorted(extra)


def executed_note(measured, prog) -> str:
    """What :func:`as_executed` changes in ``prog``, in words (the run's record)."""
    free, gone = executed_changes(measured)
    names = {op.name for _, op in ops_of(prog)}
    out = sorted(n for n in names if gone(n))
    limited = sorted(free)
    host = sum(s.duration for s in measured.spans if s.lane.startswith("host:")
               and s.kind == "host")  # fmt: skip
    return (f"host work as the executor's spans ({host:.1f} us per run in all)"
            + (f"; on every SM (limit not enforced): {', '.join(limited)}" if limited else "")
            + (f"; left out (no kernel in this run): {', '.join(out)}" if out else ""))  # fmt: skip


def comparison(measured, predicted, measured_step_us: float, replayed=None) -> dict:
    """``overlap_lab.validate.compare`` (the simulator's validation), against the step time the
    run reports (graph replay where captured), with each op's error summarised per op name.
    ``replayed``: the timeline of the run's kernels (a graph replay's or an eager pass's,
    ``overlap_lab.kernel_timeline``), whose exposed communication is the prediction's
    definition; else the measured trace's CUDA-event spans (they hold the stream's waits for the
    host: ``exposed_comm_source`` says which)."""
    from overlap_lab.validate import compare

    v = dataclasses.replace(compare(measured, predicted), measured_step_us=measured_step_us)
    exposed_from = "the measured trace's spans"
    if replayed is not None and replayed.spans:
        v = dataclasses.replace(v, measured_exposed_us=replayed.exposed_comm_us(replayed.ranks[0]))
        exposed_from = ("an eager run's kernels (torch.profiler)" if "eager_runs" in replayed.meta
                        else "a graph replay's kernels (torch.profiler)")  # fmt: skip
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
        "exposed_comm_source": exposed_from,
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
