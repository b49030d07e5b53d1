"""What a command's outputs record of how they were made: the version, the command line as typed
and the full inputs (``shared.outputs.trace.provenance``), so that a results file alone says how
to reproduce it. One place for the records of a simulated run, a comparison, the CPU check and
a file read, which the command line, a notebook and the tests all write the same way."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from overlap_lab.shared.outputs.trace import provenance

if TYPE_CHECKING:
    from overlap_lab.shared.inputs.hardware import GPU
    from overlap_lab.shared.inputs.workload import Workload
    from overlap_lab.shared.schedules import ScheduleConfig


def workload_inputs(w: Workload, gpu: GPU, cfg: ScheduleConfig) -> dict[str, Any]:
    """One workload on one GPU as a provenance record's inputs: the model (its layers
    included), the batch, the layout, the GPU (overrides included) and every knob. One function
    for the measured run and every command that simulates or reads a workload (``sim``,
    ``compare``, ``calibrate``, ``validate``), so a measured trace and its prediction name their
    inputs under the same keys."""
    knobs = cfg.as_dict()  # every knob, each schedule's own included, defaults too
    return {"model": w.model, "batch": w.batch, "parallel": w.parallel, "gpu": gpu, "knobs": knobs}


Command = Sequence[str] | None


def run_record(command: Command, result: Any, ranks: Any) -> dict[str, Any]:
    """A simulated run's (``sim``'s trace and ``--json``; each trace ``compare`` writes): the
    schedule, the model with its layers, the GPU with its overrides, the batch and layout, every
    schedule knob, the ranks and the profile the durations came from. ``result``: an
    ``overlap_lab.api.Result``; ``ranks``: the ``Ranks`` it ran with."""
    from overlap_lab.sim.calibrate import profile_name

    inputs = {
        "schedule": result.schedule,
        **workload_inputs(result.workload, result.gpu, result.config),
        "ranks": ranks,
        "profile": profile_name(result.profile),
        "cost_model": result.trace.meta["cost_model"],
        "network": result.trace.meta["network"],
    }
    return provenance(command, inputs)


def program_record(command: Command, result: Any) -> dict[str, Any]:
    """``sim --program``'s (its trace and ``--json``): the Program file read (path and SHA-256),
    the GPU it ran on, the profile, cost model and network; no workload: the Program is all."""
    from overlap_lab.sim.calibrate import profile_name

    inputs = {
        "program": file_input(result.source),
        "gpu": result.gpu,
        "profile": profile_name(result.profile),
        "cost_model": result.trace.meta["cost_model"],
        "network": result.trace.meta["network"],
    }
    return provenance(command, inputs)


def compare_record(
    command: Command,
    names: Sequence[str],
    w: Any,
    gpu: Any,
    cfg: Any,
    *,
    ranks: Any,
    profile: Any,
    pp_stages: int | None,
    sensitivity: Any,
    cost_model: str | None = None,
    network: str | None = None,
) -> dict[str, Any]:
    """``compare --json``'s: the schedules compared and the one workload they share (the trace
    files record each schedule's own run, as :func:`run_record`)."""
    from overlap_lab.sim.calibrate import profile_name
    from overlap_lab.sim.profile import profile_for

    inputs = {
        "schedules": list(names),
        **workload_inputs(w, gpu, cfg),
        "ranks": ranks,
        "profile": profile_name(profile_for(profile, gpu)),
        "cost_model": cost_model,
        "network": network,
        "pp_stages": pp_stages,
        "sensitivity": sensitivity,
    }
    return provenance(command, inputs)


def check_record(
    command: Command,
    names: Sequence[str],
    *,
    model: str,
    gpu: str,
    ranks: int,
    seed: int,
    tolerance: float,
    cfg: Any = None,
    kernels: Sequence[str] = (),
) -> dict[str, Any]:
    """The CPU check's (``run --device cpu --check --json``): the schedules, the tiny model it
    ran, the GPU preset its costs assume, ranks, seed, tolerance and knobs as given; the
    workloads are the check's own (``real.check.default_workloads``), fixed by the model."""
    from overlap_lab.shared.inputs.hardware import get_gpu
    from overlap_lab.shared.schedules import ScheduleConfig

    inputs = {
        "schedules": list(names),
        "model": model,
        "gpu": get_gpu(gpu),
        "ranks": ranks,
        "seed": seed,
        "tolerance": tolerance,
        "knobs": (cfg if cfg is not None else ScheduleConfig()).as_dict(),
        "kernels": list(kernels),
    }
    return provenance(command, inputs)


def file_input(path: str | Path | None) -> dict[str, str] | None:
    """A file a command read: the path as typed and the SHA-256 of its bytes, so that the record
    names the trace (or mapping, or profile) itself and not only where it was; None for an
    option not given. Reading twice is the price: a trace read once more is cheap beside
    analysing it."""
    if path is None:
        return None
    return {"path": str(path), "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest()}


def write_beside(path: Path, record: Mapping[str, Any]) -> Path:
    """``<path>.provenance.json``, for a file whose format has no room for the record (a sweep's
    CSV, a profile, which must load in any version that reads the format). Sorted keys, no
    date: the same command writes the same bytes."""
    side = path.with_name(path.name + ".provenance.json")
    side.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return side
