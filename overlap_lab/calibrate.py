"""``overlap-lab calibrate --device cuda``: a profile of this GPU by microbenchmarks of the real
executor's kernels.

For each token count of ``--sizes`` and each SM budget of ``--sm-budgets`` it runs the serial
Program of the workload (``sim.calibrate.bench_plan``: compute ops narrowed to the budget) with
the real executor on the GPU, the communication emulated on one GPU, CUDA graphs off so that every
op is timed by its own CUDA events; the median of ``--repeats`` runs becomes the trace from which
``sim.calibrate.profile_from_trace`` takes the rows. The header records the device, the date and
the versions of torch, CUDA and the kernel libraries found.

Each op's duration is the sum of its kernels' device times (torch.profiler's CUPTI records,
mapped to ops by ``overlap_lab.device_time``), not its CUDA-event span: an event span holds the
launch gaps between an op's kernels, which the simulator charges itself (a launch per op where a
run is eager, one per graph where it is replayed), so a profile from spans would count them twice.

A library beside the API, not part of the command line: :func:`calibrate_on_device` takes the
workload, GPU and sizes as values (``overlap_lab.cli.calibrate`` parses them from the options).
torch and ``overlap_lab.real`` are imported inside the functions, so this module imports on a
machine without a GPU; only :func:`measure_on_gpu` needs one.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.inputs.workload import Batch, Workload
from overlap_lab.shared.ir.program import Program, ops_of
from overlap_lab.shared.outputs.trace import Trace
from overlap_lab.sim.calibrate import BenchCase, bench_plan, profile_from_trace
from overlap_lab.sim.profile import Profile

if TYPE_CHECKING:
    from overlap_lab.shared.schedules import ScheduleConfig


def parse_ints(text: str | None, what: str) -> tuple[int, ...]:
    if text is None:
        return ()
    try:
        vals = tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise ConfigError(f"{what} must be positive integers, got {text!r}")
    return vals


def parse_sizes(text: str, mode: str) -> tuple[int, ...]:
    """``--sizes``, each within what one workload may hold: a decode size is a batch of that
    many sequences, a prefill size one sequence of that many tokens (:func:`sized_workload`);
    beyond, building the batch overflows or exhausts memory before anything runs."""
    from overlap_lab.shared.schedules.common import MAX_SEQS, MAX_TOKENS

    sizes = parse_ints(text, "--sizes")
    limit, what = (MAX_SEQS, "sequences") if mode == "decode" else (MAX_TOKENS, "tokens")
    if max(sizes) > limit:
        raise ConfigError(f"--sizes: {max(sizes)} is beyond {limit} ({what} per rank in {mode})")
    return sizes


def sized_workload(w: Workload, tokens: int) -> Workload:
    """``w`` with ``tokens`` tokens per rank: decode keeps its KV length, prefill its layout
    (one sequence of ``tokens`` new tokens)."""
    b = w.batch
    if b.mode == "decode":
        kv = max(b.kv_lens) if b.kv_lens else 4096
        batch = Batch.decode(tokens, kv_len=kv)
    else:
        batch = Batch.prefill(1, extend_len=tokens)
    return Workload(w.model, batch, w.parallel)


def plan_for(
    w: Workload, gpu: GPU, sizes: Sequence[int], budgets: Sequence[int], cfg=None
) -> tuple[list[BenchCase], Callable[[int], Workload]]:
    """The cases to measure and the workload of each size (serial Programs)."""
    from overlap_lab.shared.schedules import BASELINE, ScheduleConfig, build

    cfg = cfg or ScheduleConfig()

    def make(tokens: int) -> Program:
        return build(BASELINE, sized_workload(w, tokens), gpu, cfg)

    return bench_plan(make, sizes, budgets or (gpu.num_sms,), gpu.num_sms), (
        lambda t: sized_workload(w, t)
    )


def measure_on_gpu(
    cases: Sequence[BenchCase],
    workload_of: Callable[[int], Workload],
    gpu: GPU,
    *,
    warmup: int = 2,
    repeats: int = 5,
    seed: int = 0,
    device_time: bool = True,
) -> list[tuple[Trace, Program]]:
    """Run each case with the real executor on the CUDA device; (median trace, Program) each.
    ``device_time``: each op's spans scaled to its kernels' device time (the module docstring);
    False keeps the CUDA-event spans."""
    try:
        import torch
    except ImportError as e:
        raise ConfigError(f"calibrate --device cuda needs torch ({e})") from None
    if not torch.cuda.is_available():
        raise ConfigError("calibrate --device cuda needs a CUDA GPU; none is visible")
    from overlap_lab.measure import comm_backend
    from overlap_lab.real.executor import execute

    out = []
    for c in cases:
        w = workload_of(c.tokens)

        def run(c=c, w=w):
            return execute(
                c.program,
                w,
                backend=comm_backend("emulated", w, gpu),
                device="cuda",
                seed=seed,
                warmup=warmup,
                repeats=repeats,
                host_spin=False,  # the real Python overhead is the host time: not counted twice
                cuda_graphs=False,
                gpu=gpu,
            ).trace

        out.append((device_timed(run).trace if device_time else run(), c.program))
    return out


@dataclass(frozen=True)
class DeviceTimed:
    """An executor run recorded for calibration: ``trace`` with each op's spans scaled to its
    kernels' device time, the run as the executor returned it (``executor_trace``: CUDA-event
    spans), the profiler's kernel records of it (``kernels``: what
    ``overlap_lab.device_time.map_kernels`` reads, trimmed by ``kernel_records``; kept so that a
    later calibration can map them again) and the mapping's summary."""

    trace: Trace
    executor_trace: Trace
    kernels: dict
    summary: dict


def device_timed(run: Callable[[], Trace], gap_us: float = 0.0) -> DeviceTimed:
    """``run()`` (an executor run on a CUDA device, returning its trace) under torch.profiler,
    its spans scaled to device time by :func:`apply_device_time`."""
    from overlap_lab.device_time import kernel_records, profile_device_time

    trace, chrome = profile_device_time(run)
    kernels = kernel_records(chrome)
    timed = apply_device_time(trace, kernels, gap_us)
    return DeviceTimed(timed, trace, kernels, timed.meta["device_time"])


def apply_device_time(trace: Trace, kernels: Mapping, gap_us: float = 0.0) -> Trace:
    """``trace`` (an executor run) with each op's stream spans scaled to its kernels' device
    time in ``kernels`` (a torch.profiler Chrome trace of that run: ``overlap_lab.device_time``),
    an op replayed from a graph as several kernels with ``gap_us`` between each two (the
    simulator charges the gap before each op: ``GPU.graph_kernel_gap_us``); the mapping's
    summary in the meta ``device_time`` (per-run kernel totals, replay kernels matched and
    unmatched, the gap)."""
    from overlap_lab.device_time import map_kernels, op_device_us, with_device_time

    km = map_kernels(kernels)
    times = op_device_us(km, gap_us)
    out = with_device_time(trace, times)
    summary = {k: v for k, v in km.as_dict().items() if k != "ops"}
    summary["ops_timed"] = len(times)
    summary["ops_from_replay"] = sum(1 for t in km.ops.values() if t.replay_us is not None)
    summary["graph_kernel_gap_us"] = gap_us
    out.meta["device_time"] = summary
    return out


def unprofiled_rows(
    pairs: Sequence[tuple[Trace, Program]],
    *,
    num_sms: int,
    source: str,
    names: Collection[str] | None = None,
) -> list[dict]:
    """Profile rows, keyed by op CLASS, for the compute ops of ``pairs`` whose names a profile
    row cannot carry (outside ``sim.profile.PROFILED_OPS``: SBO's split down GEMMs
    ``experts.down.<k>`` and its ``experts.gate_up``, LightLLM's ``experts.scatter`` /
    ``gate_up`` / ``act_quant`` / ``down.<k>`` / ``gather``), measured in the given runs of the
    Programs that emit them. Why class rows: the simulator looks an op up by its name, then by
    its class (``sim.profile.Profile.keys_for``), and accepts only known names; ops that have
    a name row (serial's) never reach the class row. Rows of one (class, dtype, tokens, SMs)
    pool into a mean duration and mean FLOPs (a throughput where every op has FLOPs), as
    ``sim.calibrate.profile_from_trace`` pools name rows.
    ``names``: the ops to give rows (default: every compute op outside PROFILED_OPS); a name
    inside PROFILED_OPS (an op serial does not run, e.g. SGLang's overlap-scheduler ops) gets a
    row under its own name. Ops without work, or whose kernels took no time (bound as no-ops
    in the executor), get none."""
    from collections import defaultdict

    from overlap_lab.sim.calibrate import measured_ops, program_ops
    from overlap_lab.sim.profile import PROFILED_CLASSES, PROFILED_OPS

    groups: dict[tuple[str, str, float, int], list[tuple[float, float, str]]] = defaultdict(list)
    for trace, prog in pairs:
        found = measured_ops(trace)
        first = trace.ranks[0] if trace.ranks else 0
        for (rank, *rest), op in program_ops(prog).items():
            if op.kind != "compute" or op.tokens <= 0:
                continue
            if (op.name not in names) if names is not None else (op.name in PROFILED_OPS):
                continue
            if op.flops <= 0 and op.hbm_bytes <= 0:  # no work: the simulator gives it no time
                continue
            named = op.name in PROFILED_OPS
            if not named and op.op_class not in PROFILED_CLASSES:
                continue
            m = found.get((rank, *rest)) or found.get((first, *rest))
            if m is None or m.us <= 0:
                continue
            sms = round(m.sms) if m.sms > 0 else (op.sms or num_sms)
            key = (op.name if named else op.op_class, op.dtype, float(op.tokens), int(sms))
            groups[key].append((m.us, op.flops, op.name))
    rows = []
    for (cls, dt, tokens, sms), ms in sorted(groups.items()):
        names = sorted({n for _, _, n in ms})
        row = {"op": cls, "dtype": dt, "size": tokens, "sms": sms,
               "us": sum(u for u, _, _ in ms) / len(ms),
               "source": f"{source}: mean of {len(ms)} measurement(s) of "
               f"{', '.join(names)}"}  # fmt: skip
        if all(f > 0 for _, f, _ in ms):
            row["flops"] = sum(f for _, f, _ in ms) / len(ms)
        rows.append(row)
    return rows


def with_rows(profile: Profile, rows: Sequence[dict], name: str | None = None) -> Profile:
    """``profile`` plus ``rows`` (a new Profile; the rows checked as any profile's)."""
    from overlap_lab.sim.profile import from_json

    doc = profile.to_json()
    doc["rows"] = [*doc["rows"], *rows]
    return from_json(doc, name or profile.name)


def software_versions() -> dict[str, str]:
    """torch, CUDA and the kernel libraries the real executor found (lazily imported)."""
    import torch

    from overlap_lab.real.deps import probe

    found = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    for k, v in probe().items():
        if v.get("version"):
            found[k] = str(v["version"])
    return found


def calibrate_on_device(
    w: Workload,
    gpu: GPU,
    cfg: ScheduleConfig | None = None,
    *,
    sizes: Sequence[int],
    budgets: Sequence[int],
    repeats: int = 5,
) -> Profile:
    """The profile of this GPU (the ``calibrate --device cuda`` command's; see the module
    docstring): ``w``'s serial Programs at ``sizes`` tokens per rank on ``budgets`` SMs."""
    cases, workload_of = plan_for(w, gpu, sizes, budgets, cfg)
    pairs = measure_on_gpu(cases, workload_of, gpu, repeats=repeats)
    import torch

    return profile_from_trace(
        pairs,
        num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
        name="device",
        device=torch.cuda.get_device_name(0),
        date=datetime.now(UTC).date().isoformat(),
        software=software_versions(),
        source=f"overlap-lab calibrate --device cuda: {w.model.name} {w.batch.mode}, serial "
        f"Programs at {list(sizes)} tokens on {list(budgets)} SMs, median of {repeats}",
    )


def calibrate_from_trace(
    trace: Trace, program: Program, gpu: GPU, *, name: str, source: str
) -> Profile:
    """A profile from a measured trace of ``program`` (``overlap-lab calibrate --from-trace``):
    its header from the trace's own record of the machine (SMs, device, software) where it has
    one, else from ``gpu``; dated today."""
    meta = trace.meta
    return profile_from_trace(
        trace,
        program,
        num_sms=int(meta.get("num_sms") or gpu.num_sms),
        name=name,
        device=str(meta.get("device_name") or meta.get("gpu") or meta.get("device") or gpu.name),
        date=datetime.now(UTC).date().isoformat(),
        software={k: str(v) for k, v in (meta.get("software") or {}).items()},
        source=source,
    )


def cost_comments(program: Program, gpu: GPU, profile: Profile | None) -> str:
    """``show --profile``: each op's solo duration and where it comes from, as ``#`` lines the
    Program parser skips (first rank only)."""
    from overlap_lab.sim.cost import duration_source, solo_duration_us

    if profile is None:
        return ""
    lines = [f"# durations alone on the GPU, profile {profile.name} (rank {program.ranks[0].rank})"]
    rank = program.ranks[0].rank
    for r, op in ops_of(program):
        if r != rank:
            continue
        src = duration_source(op, gpu, profile)
        us = solo_duration_us(op, gpu, profile=profile if src == "profile" else None)
        lines.append(f"# {op.name} layer={op.layer} mb={op.mb} {us:.3f} us {src}")
    return "\n".join(lines) + "\n"
