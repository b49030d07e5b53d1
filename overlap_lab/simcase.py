"""One simulation's inputs as records (:class:`SimCase`: what ``overlap_lab.simulate`` takes,
checked) and the Program it runs for them (:func:`build`): what ``overlap-lab show`` prints and
each case of a sweep is keyed and simulated by."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.inputs.workload import Workload
from overlap_lab.shared.ir.program import Program


@dataclass(frozen=True)
class SimCase:
    """One case's checked inputs: what :func:`overlap_lab.simulate` would take. ``config`` is
    passed to the schedule as it is; ``profile`` is the resolved calibration profile (None: the
    roofline alone)."""

    schedule: str
    workload: Workload
    gpu: GPU
    config: Any
    ranks: Any  # overlap_lab.api.Ranks
    profile: Any = None
    max_events: int | None = None


def build(case: SimCase) -> tuple[Workload, Program, float]:
    """The case's workload as simulated, its lowered Program and its network tolerance, as
    ``overlap_lab.simulate`` makes them."""
    from overlap_lab import api
    from overlap_lab.shared.schedules import build as build_schedule
    from overlap_lab.shared.schedules import prepare_workload

    w, _ = prepare_workload(case.schedule, case.workload)  # as api.simulate does
    program = build_schedule(case.schedule, w, case.gpu, case.config)
    lowered = api.lower_ranks(program, w, case.gpu, case.ranks)
    return w, lowered, 0.0 if lowered is program else api.NET_GROUP_TOL


def shown(case: SimCase) -> Program:
    """What ``overlap-lab show`` prints: the lowered Program the simulator runs, validated as it
    would be (a ProgramError before anything is printed)."""
    from overlap_lab.shared.ir.validate import validate

    _, lowered, _ = build(case)
    validate(lowered, case.gpu.num_sms)
    return lowered
