"""The schedules, one module per system, and the registry that answers every question about one.

A schedule module owns everything about its schedule (docs/schedules.md, "What a schedule module
declares"): ``UPSTREAM``, ``SUMMARY`` and ``build(workload, gpu, cfg)`` always; where it has them,
its own knobs (``Knobs``), whether it runs pipeline stages (``SUPPORTS_PP``), its workload
defaults (``prepare_workload``), how its window's iterations and tokens are counted
(``iterations_and_tokens``), the batches it holds at once (``batches_in_flight``), the iterations a sequence waits between
tokens (``latency_iterations``), how figures draw it (``DRAWING``), what a comparison says of its
window (``window_note``), the configuration the CPU check runs it with (``cpu_check_config``),
its own summary of a trace (``report``) and how a configuration is launched on the system that
runs it (``launch_flags``). Code outside this package asks the functions below
(:mod:`~overlap_lab.shared.schedules.registry`) and never names a schedule: a schedule in another
package does everything a built-in one does.

A schedule is a pure function from a frozen configuration to a Program: it reads no environment,
probes no device and imports no torch.
"""

from __future__ import annotations

import dataclasses

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.schedules.config import ScheduleConfig
from overlap_lab.shared.schedules.registry import (
    BASELINE,
    BUILTINS,
    GROUP,
    HOOKS,
    REGISTRY,
    SCHEDULES,
    available,
    batches_in_flight,
    check_own_knobs,
    common_knobs,
    cpu_check_config,
    describe,
    drawing,
    iteration_unit,
    iterations_and_tokens,
    knob_default,
    knob_readers,
    knobs_of,
    latency_iterations,
    launch_flags,
    loadable,
    module,
    own_knobs,
    pipeline_schedules,
    prepare_workload,
    rescan,
    schedule_knobs,
    supports_pp,
    window_note,
)

__all__ = [
    "BASELINE",
    "BUILTINS",
    "GROUP",
    "HOOKS",
    "REGISTRY",
    "SCHEDULES",
    "ScheduleConfig",
    "available",
    "batches_in_flight",
    "build",
    "check_own_knobs",
    "common_knobs",
    "cpu_check_config",
    "describe",
    "drawing",
    "iteration_unit",
    "iterations_and_tokens",
    "knob_default",
    "knob_readers",
    "knobs_of",
    "latency_iterations",
    "launch_flags",
    "loadable",
    "module",
    "own_knobs",
    "pipeline_schedules",
    "prepare_workload",
    "rescan",
    "schedule_knobs",
    "supports_pp",
    "window_note",
]


def build(name: str, workload, gpu, cfg: ScheduleConfig | None = None):
    """Emit the Program of schedule ``name`` for a workload on a GPU (lowered: ``shared.ir.lowering``).

    A schedule runs one pipeline stage unless its module sets ``SUPPORTS_PP = True``; the others
    are refused here for ``--pp-size > 1``. The Program's ``meta.schedule`` is ``name``, also
    for a module that builds through another schedule's ``build``, so that the metric rules and
    figures of the schedule run are those applied."""
    from overlap_lab.shared.ir.lowering import host_wait_for_counts
    from overlap_lab.shared.ir.program import Program

    m = module(name)
    if workload.parallel.pp > 1 and not supports_pp(name):
        use = " or ".join(f"--schedule {n}" for n in pipeline_schedules()) or "a schedule that does"
        raise ConfigError(f"{name} runs one pipeline stage; use {use} for --pp-size > 1")
    program = m.build(workload, gpu, cfg or ScheduleConfig())
    if not isinstance(program, Program):  # a plug-in's fault, named, rather than a traceback
        raise ConfigError(
            f"{REGISTRY.where(name)}: build() returned {type(program).__name__}, not a Program"
        )
    if program.meta.schedule != name:
        program = dataclasses.replace(program, meta=program.meta.merged(schedule=name))
    return host_wait_for_counts(program)
