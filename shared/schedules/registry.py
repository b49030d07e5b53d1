"""The schedules' registry: which schedules are installed, and every question about one answered
from its module (``shared.schedules`` re-exports all of it; docs/schedules.md, "What a schedule
module declares"). A name outside the registry gets the defaults (a trace read from a file).

Schedules register through the Python entry point group ``overlap_lab.schedules`` (name ->
module), the built-ins too (this project's pyproject.toml), so a schedule in a separate package
is found once that package is installed. The built-ins come first in their own order (the order
help texts list them in), other packages' schedules after, sorted by name. When the entry points
of this project are not installed (running from a source tree without ``pip install -e .``), the
built-in list below is used as it is.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.knobs import Knob, knobs
from overlap_lab.shared.plugins import Registry
from overlap_lab.shared.schedules.common import (
    DEFAULT_DRAWING,
    CommonKnobs,
    Drawing,
    ScheduleKnobs,
)

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
#: The schedule every other one is compared with (``compare``'s "vs serial") and checked
#: against (the CPU check computes what it computes).
BASELINE = "serial"

#: The optional hooks a schedule module may define, each a function (docs/schedules.md).
HOOKS = (
    "prepare_workload",
    "iterations_and_tokens",
    "batches_in_flight",
    "latency_iterations",
    "window_note",
    "cpu_check_config",
    "report",
    "launch_flags",
)


def _check(m: ModuleType) -> str | None:
    """What a schedule module must expose, and the form of what it may (None: all is well)."""
    missing = [a for a in ("UPSTREAM", "SUMMARY", "build") if not hasattr(m, a)]
    if missing:
        return f"lacks {', '.join(missing)}"
    if not callable(m.build):
        return "has a build that is not a function"
    bad = [h for h in HOOKS if hasattr(m, h) and not callable(getattr(m, h))]
    if bad:
        return f"has {', '.join(bad)} that is not a function"
    if not isinstance(getattr(m, "DRAWING", DEFAULT_DRAWING), Drawing):
        return "has a DRAWING that is not a shared.schedules.common.Drawing"
    return _check_knobs(getattr(m, "Knobs", None))


def _check_knobs(cls: Any) -> str | None:
    """A module's ``Knobs``: a dataclass of knob fields, none of them a knob every schedule reads."""
    if cls is None:
        return None
    if not (
        isinstance(cls, type)
        and issubclass(cls, ScheduleKnobs)
        and dataclasses.is_dataclass(cls)
        and cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
    ):
        return "has a Knobs that is not a frozen dataclass deriving from ScheduleKnobs"
    plain = [f.name for f in dataclasses.fields(cls) if "knob" not in f.metadata]
    if plain:
        return f"declares Knobs fields that are no knobs: {', '.join(plain)}"
    common = {k.name for k in common_knobs()} | {"own"}
    clash = sorted(common & {f.name for f in dataclasses.fields(cls)})
    if clash:
        return f"declares {', '.join(clash)}, which every schedule reads (ScheduleConfig's)"
    try:
        cls()
    except ConfigError as e:
        return f"has Knobs whose defaults are refused: {e}"
    return None


#: The schedules' registry (``shared.plugins``): found by entry point, loaded when used.
REGISTRY = Registry(GROUP, "schedule", BUILTINS, _check)


class _Names(Mapping[str, str]):
    """Schedule name -> module path, built-ins first: a live view of :data:`REGISTRY`, so that
    a package installed (and :func:`rescan` called) in a running process is listed."""

    def __getitem__(self, name: str) -> str:
        return REGISTRY.entries[name].target

    def __iter__(self) -> Iterator[str]:
        return iter(REGISTRY.entries)

    def __len__(self) -> int:
        return len(REGISTRY.entries)

    def __repr__(self) -> str:
        return repr(dict(self))


#: Schedule name -> module path, built-ins first.
SCHEDULES: Mapping[str, str] = _Names()


def rescan() -> None:
    """Find the installed schedules again (a package installed while this process runs), and
    forget what was learnt from the previous set (knob tables, loaded modules)."""
    REGISTRY.rescan()
    _knob_table.cache_clear()


def available() -> list[str]:
    """Every registered schedule name, in listing order."""
    return list(SCHEDULES)


def module(name: str) -> ModuleType:
    """The module of schedule ``name``, checked to expose what a schedule must: a schedule of
    another package that fails to import, or lacks a part, is one ConfigError naming it."""
    return REGISTRY.load(name)


def _hook(name: str | None, attr: str, default: Any = None) -> Any:
    """``attr`` of schedule ``name``'s module, or ``default`` where it defines none or ``name``
    is no registered schedule (a trace read from a file, a Program built by hand)."""
    if name is None or name not in REGISTRY:
        return default
    return getattr(module(name), attr, default)


# ---- layout and workload -------------------------------------------------------------------


def supports_pp(name: str) -> bool:
    """Whether schedule ``name`` runs pipeline stages (its module sets ``SUPPORTS_PP = True``)."""
    return bool(getattr(module(name), "SUPPORTS_PP", False))


def pipeline_schedules() -> list[str]:
    """The schedules that run pipeline stages, in listing order (those that load)."""
    out = []
    for name in REGISTRY.usable():
        try:
            if supports_pp(name):
                out.append(name)
        except ConfigError:  # a broken plug-in is reported where it is used, not here
            continue
    return out


def prepare_workload(name: str, workload) -> tuple[Any, tuple[str, ...]]:
    """The workload schedule ``name`` runs for ``workload`` (its module's ``prepare_workload``:
    pp's two stages where the workload asks for one), with a note per change it made. The API,
    ``show`` and the sweep build through this, so the rule is written once, in the module."""
    hook = getattr(module(name), "prepare_workload", None)
    if hook is None:
        return workload, ()
    ready, notes = hook(workload)
    return ready, tuple(notes)


def describe() -> list[tuple[str, str | None, str]]:
    """(name, upstream reference, one-line summary) for every schedule; a schedule that cannot
    be used (a plug-in that fails to load or lacks a part) is listed with upstream None and its
    one-line error as the summary, and every other one all the same."""
    out: list[tuple[str, str | None, str]] = []
    for name in SCHEDULES:
        try:
            m = module(name)
        except ConfigError as e:
            out.append((name, None, str(e)))
            continue
        out.append((name, m.UPSTREAM, m.SUMMARY))
    return out


def loadable() -> list[str]:
    """The schedules that load and pass their module's check, in listing order (what "every
    schedule" runs: a broken plug-in is reported by name where it is named, and skipped here)."""
    out = []
    for name in REGISTRY.usable():
        try:
            module(name)
        except ConfigError:
            continue
        out.append(name)
    return out


# ---- what a run reports and how it is drawn ------------------------------------------------


def iterations_and_tokens(name: str | None, program, workload) -> tuple[int, int]:
    """(scheduler iterations of one rank in the window, tokens one GPU completes through the
    whole model in it) for a Program of schedule ``name``: its module's rule, else one
    iteration of the workload's batch (docs/metrics.md)."""
    hook = _hook(name, "iterations_and_tokens")
    if hook is None:
        return 1, workload.batch.num_tokens
    return hook(program, workload)


def batches_in_flight(name: str | None, workload, cfg: CommonKnobs) -> int:
    """Batches of the workload's size a GPU of schedule ``name`` holds at once (its module's
    ``batches_in_flight(workload, cfg)``: pp's micro-batches, each a whole batch), else one:
    what the memory check counts the KV cache of (``overlap_lab.checks.check_memory``)."""
    hook = _hook(name, "batches_in_flight")
    return 1 if hook is None else int(hook(workload, cfg))


def latency_iterations(name: str | None, workload, cfg: CommonKnobs) -> int:
    """Iterations of schedule ``name``'s window between two of a sequence's tokens in decode (a
    prompt's whole prefill step in prefill): what a latency target is compared with, as a number
    of its iterations (its module's ``latency_iterations(workload, cfg)``: pp's round of
    micro-batches), else one: a one-batch schedule's iteration is its step."""
    hook = _hook(name, "latency_iterations")
    return 1 if hook is None else int(hook(workload, cfg))


def iteration_unit(name: str | None) -> str:
    """What one iteration of schedule ``name``'s window is, in the few letters a table's
    iteration count carries (its module's ``ITERATION``, beside its ``iterations_and_tokens``;
    '': one scheduler step, the default)."""
    return str(_hook(name, "ITERATION", ""))


def drawing(name: str | None) -> Drawing:
    """How figures draw a trace of schedule ``name`` (its module's ``DRAWING``)."""
    return _hook(name, "DRAWING", DEFAULT_DRAWING)


def window_note(name: str, cfg: CommonKnobs) -> str | None:
    """What a comparison's footnote says of schedule ``name``'s window (None: one iteration),
    given the run's ScheduleConfig ``cfg``."""
    hook = _hook(name, "window_note")
    return None if hook is None else hook(cfg)


def cpu_check_config(name: str, cfg: CommonKnobs) -> CommonKnobs:
    """The ScheduleConfig the CPU check (``real.check``) runs schedule ``name`` with: its
    module's ``cpu_check_config`` (vllm-dbo lowers its split thresholds so that the check's tiny
    workloads reach its split path), else ``cfg``."""
    hook = _hook(name, "cpu_check_config")
    return cfg if hook is None else hook(cfg)


def launch_flags(name: str, deployment: Any) -> Any:
    """How a configuration of schedule ``name`` is launched on the system that runs it (its
    module's ``launch_flags(deployment)``: a ``shared.schedules.launch.ServerLaunch``); a schedule
    whose module declares none gets a Launch that says so (docs/tune.md)."""
    from overlap_lab.shared.schedules.launch import no_launch

    hook = _hook(name, "launch_flags")
    return no_launch(name) if hook is None else hook(deployment)


# ---- knobs -----------------------------------------------------------------------------------


def common_knobs() -> tuple[Knob, ...]:
    """The knob records every schedule reads (ScheduleConfig's fields), in field order."""
    return knobs(CommonKnobs)


def own_knobs(name: str) -> tuple[Knob, ...]:
    """The knob records schedule ``name`` declares itself (its module's ``Knobs``)."""
    cls = getattr(module(name), "Knobs", None)
    return () if cls is None else knobs(cls)


def knobs_of(name: str) -> tuple[Knob, ...]:
    """The knob records schedule ``name`` reads: every schedule's, then its own."""
    return common_knobs() + own_knobs(name)


@functools.cache
def _knob_table() -> dict[str, tuple[tuple[str, Knob], ...]]:
    """Own knob name -> (schedule, its record) for every schedule declaring it, in listing order
    (schedules that fail to load are left out: they are reported where they are used)."""
    table: dict[str, list[tuple[str, Knob]]] = {}
    for name in REGISTRY.usable():
        try:
            records = own_knobs(name)
        except ConfigError:
            continue
        for k in records:
            table.setdefault(k.name, []).append((name, k))
    return {n: tuple(v) for n, v in table.items()}


def knob_readers() -> dict[str, tuple[str, ...]]:
    """Own knob name -> the schedules that declare (and read) it, in listing order."""
    return {n: tuple(s for s, _ in v) for n, v in _knob_table().items()}


def knob_default(name: str) -> Any:
    """The default of own knob ``name`` that every schedule declaring it agrees on;
    AttributeError where none declares it or their defaults differ."""
    decl = _knob_table().get(name)
    if not decl:
        raise AttributeError(f"no schedule declares a knob {name!r}")
    defaults = {repr(k.default): k.default for _, k in decl}
    if len(defaults) > 1:
        raise AttributeError(
            f"knob {name!r} has no one default: " + ", ".join(f"{s} {k.default!r}" for s, k in decl)
        )
    return next(iter(defaults.values()))


def check_own_knobs(given: Mapping[str, Any]) -> dict[str, Any]:
    """The own knobs ``given`` to a ScheduleConfig, checked: each must be declared by a registered
    schedule, and every value must be one that some schedule declaring it accepts together with
    the other values given (each module's ``Knobs`` validates, cross-field checks included).
    Returns the values as the records store them (lists as tuples). ConfigError otherwise."""
    table = _knob_table()
    unknown = sorted(set(given) - set(table))
    if unknown:
        raise ConfigError(
            f"unknown schedule knob {unknown[0]!r}; the schedules' own knobs are "
            f"{', '.join(table)} (and every schedule reads {', '.join(k.name for k in common_knobs())})"
        )
    accepted: dict[str, Any] = {}
    refusal: dict[str, str] = {}
    for schedule in dict.fromkeys(s for n in given for s, _ in table[n]):
        cls = module(schedule).Knobs
        mine = [f.name for f in dataclasses.fields(cls) if f.name in given]
        why = _refused(cls, {n: given[n] for n in mine})
        if why:  # the knobs at fault: those refused alone, else (a cross-field check) all
            alone = {n: _refused(cls, {n: given[n]}) for n in mine}
            at_fault = {n: w for n, w in alone.items() if w} or dict.fromkeys(mine, why)
            for n, w in at_fault.items():
                refusal.setdefault(n, f"{w} ({schedule})" if len(table[n]) > 1 else w)
            mine = [n for n in mine if n not in at_fault]
            if _refused(cls, {n: given[n] for n in mine}):
                continue
        rec = cls(**{n: given[n] for n in mine})
        accepted.update({n: getattr(rec, n) for n in mine})
    for n in given:
        if n not in accepted:  # refused by every schedule declaring it: by the span of their
            why = _merged(n, table[n]).refusal(given[n])  # ranges if that refuses it too
            raise ConfigError(f"{n} {why}" if why else refusal[n], names=tuple(given))
    return accepted


def _refused(cls: type, values: Mapping[str, Any]) -> str | None:
    """Why knob record ``cls`` refuses ``values`` (None: it takes them)."""
    try:
        cls(**values)
    except ConfigError as e:
        return str(e)
    return None


def schedule_knobs() -> tuple[Knob, ...]:
    """One record per knob the command line offers: every schedule's (ScheduleConfig's), then
    each own knob once, in the order the schedules are listed and declare them. A knob several
    schedules declare is one option: its help says what it means to each (``sbo, tbo+sbo:
    ...; deepseek: ...``), its range spans theirs; each schedule checks its own range."""
    return common_knobs() + tuple(_merged(n, decl) for n, decl in _knob_table().items())


def _merged(name: str, decl: tuple[tuple[str, Knob], ...]) -> Knob:
    first = decl[0][1]
    same_default = len({repr(k.default) for _, k in decl}) == 1
    by_help: dict[str, list[str]] = {}
    for s, k in decl:
        text = k.help if same_default else f"{k.help} (default {k.default!r})"
        by_help.setdefault(text, []).append(s)
    helps = "; ".join(f"{', '.join(ss)}: {text}" for text, ss in by_help.items())
    los = [k.lo for _, k in decl if k.lo is not None]
    his = [k.hi for _, k in decl if k.hi is not None]
    return dataclasses.replace(
        first,
        help=helps,
        default=first.default if same_default else None,
        lo=min(los) if los else None,
        hi=max(his) if his else None,
        zero_ok=any(k.zero_ok for _, k in decl),
        choices=tuple(dict.fromkeys(c for _, k in decl for c in k.choices)),
        optional=any(k.optional for _, k in decl) or not same_default,
        check=None,
    )
