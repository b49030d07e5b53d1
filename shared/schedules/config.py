"""The knobs of one run: :class:`ScheduleConfig`, those every schedule reads and each schedule's
own, given by name and checked against the schedules that declare them (``shared.schedules.
registry``)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from overlap_lab.shared.inputs.hardware import HOST_COSTS, HostCosts
from overlap_lab.shared.schedules.common import CommonKnobs, KnobValues
from overlap_lab.shared.schedules.registry import (
    check_own_knobs,
    common_knobs,
    knob_default,
    knob_readers,
)

K = TypeVar("K")


@dataclass(frozen=True, init=False)
class ScheduleConfig(CommonKnobs):
    """The knobs of one run: those every schedule reads, as fields (:class:`~overlap_lab.shared.
    schedules.common.CommonKnobs`: each a :func:`~overlap_lab.shared.inputs.knobs.knob`, its
    help, unit, range and validator declared there once), and the schedules' own knobs, given by
    name (``ScheduleConfig(micro_batches=4)``) and held in ``own``.

    A name in ``own`` must be a knob some registered schedule declares, with a value one of them
    accepts (``shared.schedules.registry.check_own_knobs``): a knob several schedules declare (``comm_sms``:
    sbo, deepseek, vllm-dbo) means what each declares, and a value only one of them takes
    (``comm_sms=0``: vllm-dbo's "SM control off") is refused when another one reads it. A
    schedule reads its own record with :meth:`of`; code outside the schedules reads a value
    given, or the default the declaring schedules agree on, as an attribute (``cfg.iterations``).

    None means "the system's own default" (taken from upstream or the hardware preset).
    """

    #: the schedules' own knobs given, by name (no knob record: each module declares its own)
    own: KnobValues = dataclasses.field(default_factory=KnobValues)

    def __init__(
        self,
        deepep_mode: str = "auto",
        cuda_graph: bool | None = None,
        host: HostCosts = HOST_COSTS,
        own: Mapping[str, Any] | Iterable[tuple[str, Any]] = (),
        **knobs: Any,
    ) -> None:
        given = dict(own)
        given.update(knobs)
        for name, value in (("deepep_mode", deepep_mode), ("cuda_graph", cuda_graph)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "host", host)
        object.__setattr__(self, "own", KnobValues())
        self.__post_init__()
        if given:
            checked = check_own_knobs(given)
            object.__setattr__(self, "own", KnobValues(sorted(checked.items())))

    def __getattr__(self, name: str) -> Any:
        """A schedule's own knob as an attribute: the value given, else the default every
        schedule declaring it agrees on (AttributeError where they differ or none declares it)."""
        if name.startswith("_") or name == "own":  # pickle and copy probe before ``own`` is set
            raise AttributeError(name)
        if name in self.own:
            return self.own[name]
        return knob_default(name)

    def of(self, cls: type[K]) -> K:
        """A schedule's own knob record ``cls`` (its module's ``Knobs``) from the values given:
        the others take ``cls``'s defaults, and ``cls`` validates the values as it declares
        them (a value another schedule declaring the knob takes may be refused here)."""
        own = self.own
        try:
            return _record(cls, own)
        except TypeError:  # a value that does not hash (a plug-in's knob): built uncached
            return _record.__wrapped__(cls, own)

    def as_dict(self) -> dict[str, Any]:
        """Every knob as run, in one flat mapping (what provenance records hold): those every
        schedule reads, then every registered schedule's own, as given or at the default its
        declarers agree on (one whose declarers' defaults differ is left out unless given)."""
        out = {k.name: getattr(self, k.name) for k in common_knobs()}
        for name in knob_readers():
            try:
                out[name] = self.own[name] if name in self.own else knob_default(name)
            except AttributeError:
                continue
        return out


@functools.lru_cache(maxsize=1024)
def _record(cls: type[K], own: KnobValues) -> K:
    """``cls`` from the values of ``own`` it declares: schedules read their knobs in many
    places of one build, and a sweep builds the same configuration many times."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in own.items() if k in names})
