"""The schedules, one module per system; each exposes UPSTREAM (the upstream code it follows),
SUMMARY, KNOBS (the ScheduleConfig knobs it reads) and build(workload, gpu, cfg);
docs/schedules.md states every schedule's rules.

A schedule is a pure function from a frozen configuration to a Program: it reads no environment,
probes no device and imports no torch.

Schedules register through the Python entry point group ``overlap_lab.schedules`` (name ->
module), the built-ins too (this project's pyproject.toml), so a schedule in a separate package
is found once that package is installed. The built-ins come first in their own order (the order
help texts list them in), other packages' schedules after, sorted by name. When the entry points
of this project are not installed (running from a source tree without ``pip install -e .``), the
built-in list below is used as it is.
"""

from __future__ import annotations

from types import ModuleType

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.knobs import Knob, knobs
from overlap_lab.shared.plugins import Registry
from overlap_lab.shared.schedules.common import ScheduleConfig

__all__ = [
    "GROUP",
    "SCHEDULES",
    "ScheduleConfig",
    "available",
    "build",
    "describe",
    "knobs_of",
    "module",
    "schedule_knobs",
]

GROUP = "overlap_lab.schedules"
#: The built-in schedules in the order they are listed, with their modules: the fallback when
#: the entry points are not installed, and the order the installed ones keep.
BUILTINS: dict[str, str] = {
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


def _check(m: ModuleType) -> str | None:
    """What a schedule module must expose (None: all of it)."""
    missing = [a for a in ("UPSTREAM", "SUMMARY", "KNOBS", "build") if not hasattr(m, a)]
    if missing:
        return f"lacks {', '.join(missing)}"
    if not callable(m.build):
        return "has a build that is not a function"
    unknown = sorted(set(m.KNOBS) - {k.name for k in schedule_knobs()})
    if unknown:
        return f"declares unknown knobs {', '.join(unknown)}"
    return None


#: The schedules' registry (``shared.plugins``): found by entry point, loaded when used.
REGISTRY = Registry(GROUP, "schedule", BUILTINS, _check)
#: Schedule name -> module path, built-ins first.
SCHEDULES: dict[str, str] = {n: e.target for n, e in REGISTRY.entries.items()}


def available() -> list[str]:
    """Every registered schedule name, in listing order."""
    return list(SCHEDULES)


def module(name: str) -> ModuleType:
    """The module of schedule ``name``, checked to expose what a schedule must: a schedule of
    another package that fails to import, or lacks a part, is one ConfigError naming it."""
    return REGISTRY.load(name)


def supports_pp(name: str) -> bool:
    """Whether schedule ``name`` runs pipeline stages (its module sets ``SUPPORTS_PP = True``)."""
    return bool(getattr(module(name), "SUPPORTS_PP", False))


def build(name: str, workload, gpu, cfg: ScheduleConfig | None = None):
    """Emit the Program of schedule ``name`` for a workload on a GPU (lowered: ``shared.ir.lowering``).

    A schedule runs one pipeline stage unless its module sets ``SUPPORTS_PP = True``; the others
    are refused here for ``--pp-size > 1``.
    """
    from overlap_lab.shared.ir.lowering import host_wait_for_counts

    m = module(name)
    if workload.parallel.pp > 1 and not supports_pp(name):
        raise ConfigError(f"{name} runs one pipeline stage; use --schedule pp for --pp-size > 1")
    return host_wait_for_counts(m.build(workload, gpu, cfg or ScheduleConfig()))


def describe() -> list[tuple[str, str, str]]:
    """(name, upstream reference, one-line summary) for every schedule."""
    out = []
    for name in SCHEDULES:
        m = module(name)
        out.append((name, m.UPSTREAM, m.SUMMARY))
    return out


def schedule_knobs() -> tuple[Knob, ...]:
    """Every ScheduleConfig knob record, in field order (the command line's option order)."""
    return knobs(ScheduleConfig)


def knobs_of(name: str) -> tuple[Knob, ...]:
    """The knob records schedule ``name`` reads (its module's ``KNOBS``), in field order."""
    own = set(module(name).KNOBS)
    return tuple(k for k in schedule_knobs() if k.name in own)
