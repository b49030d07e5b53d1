"""The schedules, one module per system; each exposes UPSTREAM (the upstream code it follows),
SUMMARY and build(workload, gpu, cfg); docs/schedules.md states every schedule's rules.

A schedule is a pure function from a frozen configuration to a Program: it reads no environment,
probes no device and imports no torch.
"""

from __future__ import annotations

import importlib

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.schedules.common import ScheduleConfig

__all__ = ["SCHEDULES", "ScheduleConfig", "build", "describe", "module"]

SCHEDULES: dict[str, str] = {
    "serial": "overlap_lab.shared.schedules.serial",
    "sglang-overlap": "overlap_lab.shared.schedules.sglang_overlap",
    "sbo-off": "overlap_lab.shared.schedules.sbo_off",
    "sbo": "overlap_lab.shared.schedules.sbo",
    "tbo": "overlap_lab.shared.schedules.tbo",
    "tbo+sbo": "overlap_lab.shared.schedules.tbo_sbo",
    "lightllm": "overlap_lab.shared.schedules.lightllm",
    "vllm-dbo": "overlap_lab.shared.schedules.vllm_dbo",
    "deepseek": "overlap_lab.shared.schedules.deepseek",
    "pp": "overlap_lab.shared.schedules.pp",
}


def available() -> list[str]:
    """Schedule names whose module is present (all of them once the project is complete)."""
    out = []
    for name, mod in SCHEDULES.items():
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
            continue
        out.append(name)
    return out


def module(name: str):
    if name not in SCHEDULES:
        raise ConfigError(f"unknown schedule {name!r}; choose from {', '.join(SCHEDULES)}")
    try:
        return importlib.import_module(SCHEDULES[name])
    except ModuleNotFoundError as e:
        if e.name == SCHEDULES[name]:
            raise ConfigError(f"schedule {name!r} is not implemented yet") from None
        raise


def build(name: str, workload, gpu, cfg: ScheduleConfig | None = None):
    """Emit the Program of schedule ``name`` for a workload on a GPU (lowered: ``shared.lowering``)."""
    from overlap_lab.shared.lowering import host_wait_for_counts

    m = module(name)
    if workload.parallel.pp > 1 and not getattr(m, "SUPPORTS_PP", False):
        raise ConfigError(f"{name} runs one pipeline stage; use --schedule pp for --pp-size > 1")
    return host_wait_for_counts(m.build(workload, gpu, cfg or ScheduleConfig()))


def describe() -> list[tuple[str, str, str]]:
    """(name, upstream reference, one-line summary) for every implemented schedule."""
    out = []
    for name in available():
        m = module(name)
        out.append((name, m.UPSTREAM, m.SUMMARY))
    return out
