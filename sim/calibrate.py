"""Profiles from measurements: a measured trace of a known Program becomes profile rows.

``profile_from_trace`` takes a Trace whose kernel spans carry op name, layer and micro-batch (our
own traces: ``overlap-lab run`` on a GPU, the simulator, or an imported trace labelled with
``shared.outputs.analyze.label_ops``) and the Program that produced it. The spans of each op are summed
per (rank, op, layer, micro-batch, step) — an op may be several kernels, or one kernel cut where
its SM grant changed — and joined with the Program's op (tokens, FLOPs, dtype). Ops of one
(name, dtype, tokens, SMs) pool into one row: mean duration and mean FLOPs, so the simulator reads
the row as the measured throughput (``sim.profile``), and an op with more FLOPs (a hotter expert
rank) takes proportionally longer.

``bench_plan`` is the CPU half of ``overlap-lab calibrate --device cuda``: which Programs to run
(a serial Program per token count, every compute op narrowed to each SM budget); the GPU half
runs them with the real executor (``overlap_lab.calibrate.measure_on_gpu``) and hands the traces
back here. Only compute ops become rows: communication is the link model's.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.ir.program import (
    Graph,
    Launch,
    Op,
    Program,
    map_ops,
    ops_of,
)
from overlap_lab.shared.outputs.trace import Trace
from overlap_lab.sim.profile import (
    FORMAT,
    PROFILED_CLASSES,
    ROOFLINE,
    Profile,
    from_json,
    profiled,
    profiled_ops,
)

OpKey = tuple[int, str, int | None, int | None, int | None]  # rank, op, layer, mb, step


def op_key(rank: int, op: Op) -> OpKey:
    return (rank, op.name, op.layer, op.mb, op.step)


def program_ops(program: Program) -> dict[OpKey, Op]:
    """Every launched op by (rank, name, layer, mb, step); ConfigError if a key repeats."""
    out: dict[OpKey, Op] = {}
    for rp in program.ranks:
        for th in rp.threads:
            for ins in th.instrs:
                for part in ins.body if isinstance(ins, Graph) else (ins,):
                    if isinstance(part, Launch):
                        k = op_key(rp.rank, part.op)
                        if k in out:
                            raise ConfigError(f"op {k} is launched twice; cannot align it")
                        out[k] = part.op
    return out


@dataclass(frozen=True)
class Measured:
    """One op's measured time: its kernels' durations summed, and the most SMs they held at once
    (0 when the trace does not say). The most, not a mean: a waved kernel's measured time already
    contains its partial last wave on fewer SMs, and the wave model (``sim.cost``) replays that
    tail from the SMs the kernel could use."""

    us: float
    sms: float


def measured_ops(trace: Trace) -> dict[OpKey, Measured]:
    """Kernel time per (rank, op, layer, mb, step) from the stream spans of ``trace``."""
    us: dict[OpKey, float] = defaultdict(float)
    most: dict[OpKey, float] = defaultdict(float)
    for s in trace.spans:
        if not s.lane.startswith("stream:") or s.kind == "sync":
            continue
        k = (s.rank, s.op, s.layer, s.mb, s.step)
        us[k] += s.duration
        most[k] = max(most[k], s.sms)
    return {k: Measured(v, most[k]) for k, v in us.items()}


def _profiled(op: Op) -> bool:
    return profiled(op) and op.name in profiled_ops()


def profile_from_trace(
    traces: Trace | Iterable[tuple[Trace, Program]],
    program: Program | None = None,
    *,
    num_sms: int,
    name: str = "measured",
    device: str = "unknown",
    date: str = "unknown",
    software: dict[str, str] | None = None,
    source: str = "measured trace",
) -> Profile:
    """A profile whose rows are the ops measured in ``traces`` (one trace with ``program``, or
    pairs of them): see the module docstring. ``num_sms`` stands for ops whose trace gives no
    SM count."""
    pairs = [(traces, program)] if isinstance(traces, Trace) else list(traces)
    groups: dict[tuple[str, str, float, int], list[tuple[float, float]]] = defaultdict(list)
    for trace, prog in pairs:
        if prog is None:
            raise ConfigError("profile_from_trace needs the Program the trace ran")
        ops = program_ops(prog)
        found = measured_ops(trace)
        for k, op in ops.items():
            m = found.get(_trace_key(k, trace, prog))
            if m is None or not _profiled(op) or m.us <= 0 or op.tokens <= 0:
                continue
            sms = round(m.sms) if m.sms > 0 else (op.sms or num_sms)
            groups[(op.name, op.dtype, float(op.tokens), int(sms))].append((m.us, op.flops))
    if not groups:
        raise ConfigError(
            "no compute op of the Program was found in the trace (are its spans labelled with "
            "op names, layers and micro-batches?)"
        )
    with_flops = defaultdict(lambda: True)  # per (op, dtype, sms): throughput rows if all FLOPs > 0
    for (op, dt, _, sms), ms in groups.items():
        with_flops[(op, dt, sms)] &= all(f > 0 for _, f in ms)
    rows = []
    for (op, dt, tokens, sms), ms in sorted(groups.items()):
        row = {"op": op, "dtype": dt, "size": tokens, "sms": sms,
               "us": sum(u for u, _ in ms) / len(ms),
               "source": f"{source}: mean of {len(ms)} measurement(s)"}  # fmt: skip
        if with_flops[(op, dt, sms)]:
            row["flops"] = sum(f for _, f in ms) / len(ms)
        rows.append(row)
    doc = {"format": FORMAT, "device": device, "date": date, "software": software or {},
           "source": source, "rows": rows}  # fmt: skip
    return from_json(doc, name)


def _trace_key(k: OpKey, trace: Trace, program: Program) -> OpKey:
    """A symmetric Program's rank-0 ops are found under the trace's first rank."""
    if program.symmetric and trace.ranks and k[0] not in trace.ranks:
        return (trace.ranks[0],) + k[1:]
    return k


# ---------------------------------------------------------------------------------------------
# Microbenchmark plan (the CPU half of `calibrate --device cuda`)


@dataclass(frozen=True)
class BenchCase:
    """One Program to run on the GPU: ``tokens`` per micro-batch, compute ops on ``sms`` SMs."""

    tokens: int
    sms: int
    program: Program


def narrow_sms(program: Program, sms: int) -> Program:
    """Every compute op limited to ``sms`` SMs (communication and copies as they are)."""
    return map_ops(
        program, lambda op: dataclasses.replace(op, sms=sms) if op.kind == "compute" else op
    )


def bench_plan(
    build, sizes: Sequence[int], sm_budgets: Sequence[int], num_sms: int
) -> list[BenchCase]:
    """The Programs to measure: ``build(tokens)`` (a serial Program of that many tokens) for
    each size, with compute ops narrowed to each SM budget. Bad sizes or budgets: ConfigError."""
    if not sizes or any(int(s) <= 0 for s in sizes):
        raise ConfigError(f"calibration sizes must be positive token counts, got {list(sizes)}")
    if not sm_budgets or any(not 0 < int(b) <= num_sms for b in sm_budgets):
        raise ConfigError(f"SM budgets must lie in 1..{num_sms}, got {list(sm_budgets)}")
    out = []
    for t in sorted(set(int(s) for s in sizes)):
        prog = build(t)
        for b in sorted(set(int(x) for x in sm_budgets)):
            out.append(BenchCase(t, b, prog if b == num_sms else narrow_sms(prog, b)))
    return out


__all__ = [
    "PROFILED_CLASSES",
    "BenchCase",
    "Measured",
    "bench_plan",
    "measured_ops",
    "narrow_sms",
    "op_key",
    "profile_from_trace",
    "program_ops",
]


def profile_name(profile: Profile | None) -> str:
    return ROOFLINE if profile is None else profile.name


def source_of(gpu: GPU, profile: Profile | None, model: Any = None) -> Callable[[Op], str]:
    """Where a run's op durations come from, as a function of the op. For the roofline model
    (``model`` None or ``roofline``: the one of ``profile``; or a ``RooflineCostModel`` object,
    with its own profile): the profile, the roofline or the link model (communication kernels
    and copies, ``sim.cost.duration_source``). For any other cost model, given by name or as an
    object, that model (its name, or its class's)."""
    from overlap_lab.sim.cost import RooflineCostModel, cost_key, duration_source
    from overlap_lab.sim.models import DEFAULT_COST_MODEL, class_name

    if type(model) is RooflineCostModel:  # a subclass may cost otherwise: named by its class
        profile, model = model.profile, None
    if model is not None and model != DEFAULT_COST_MODEL:
        label = model if isinstance(model, str) else class_name(model)
        return lambda op: label
    seen: dict[tuple, str] = {}  # by what the op costs: every layer's copy is one lookup

    def source(op) -> str:
        k = cost_key(op)
        s = seen.get(k)
        if s is None:
            s = seen[k] = duration_source(op, gpu, profile)
        return s

    return source


def cost_sources(
    program: Program, gpu: GPU, profile: Profile | None, model: Any = None
) -> dict[str, dict[str, int]]:
    """Per op class, how many launched ops take their duration from where (:func:`source_of`).
    Each distinct op object's source is looked up once: explicit ranks share most of their ops
    (``shared.ir.ranks``), and a lookup is a profile search."""
    source = source_of(gpu, profile, model)
    every = [op for _, op in ops_of(program)]  # holds every op while their ids are keys
    ops = {id(op): op for op in every}
    counts: dict[str, Counter] = {}
    for key, n in Counter(map(id, every)).items():
        op = ops[key]
        counts.setdefault(op.op_class, Counter())[source(op)] += n
    return {c: dict(sorted(n.items())) for c, n in sorted(counts.items())}


def add_provenance(res: dict[str, Any], program: Program, gpu: GPU, profile) -> None:
    """The keys a result row gets from calibration: ``profile`` and ``cost_sources``."""
    res["profile"] = profile_name(profile)
    res["cost_sources"] = cost_sources(program, gpu, profile)
