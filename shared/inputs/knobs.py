"""Knob records: each field of a frozen configuration described once, where it is declared.

A configuration field declared with ``knob(default, help, ...)`` carries a :class:`Knob` spec in
its ``dataclasses.field`` metadata; :func:`knobs` returns the full records (name and type added
from the class). Everything that presents or checks a field reads the record: the configuration's
own ``__post_init__`` runs :meth:`Knob.validate`, and a command line can build its options (flag,
parser, help, range) from the records instead of reading the class source.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from overlap_lab.shared.errors import ConfigError


@dataclass(frozen=True)
class Knob:
    """One field of a configuration: its meaning, unit and allowed values.

    ``help`` is the option's help text without the ``(default: ...)`` a command line appends.
    ``lo..hi`` is the allowed range of a number (of each element, for a tuple field); ``zero_ok``
    allows 0 besides it (0 = "off" / "same as nominal"). ``choices`` lists the allowed words.
    ``optional``: None is allowed and means the system's own default. ``check(value, owner)``
    returns why a value is refused given the rest of the configuration (None: accepted).
    ``tune``: the values a deployment search tries for it (``overlap-lab tune``, besides the
    default); empty where the knob is no deployment choice (it describes the workload, or sizes
    the simulated window).
    """

    name: str
    type: Any  # the resolved annotation: int, float, bool, str, tuple[int, ...], a record type
    default: Any  # dataclasses.MISSING for a field every record must give (GPU presets)
    help: str
    unit: str = ""
    lo: float | None = None
    hi: float | None = None
    zero_ok: bool = False
    choices: tuple = ()
    optional: bool = False
    check: Callable[[Any, Any], str | None] | None = None
    tune: tuple = ()

    @property
    def flag(self) -> str:
        """The command-line spelling: ``comm_sms`` -> ``--comm-sms``."""
        return "--" + self.name.replace("_", "-")

    @functools.cached_property  # the checks run on every configuration built: resolve once
    def scalar(self) -> type:
        """The type of the value (of each element, for a tuple field), None stripped."""
        tp = self.type
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if typing.get_origin(tp) in (typing.Union, _UnionType) and len(args) == 1:
            tp = args[0]
        if typing.get_origin(tp) is tuple:
            tp = typing.get_args(tp)[0]
        return tp

    @functools.cached_property
    def is_tuple(self) -> bool:
        tp = self.type
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if typing.get_origin(tp) in (typing.Union, _UnionType) and len(args) == 1:
            tp = args[0]
        return typing.get_origin(tp) is tuple

    def range_text(self) -> str:
        """``lo..hi`` as the command line shows it (``0..1023``, ``0 or 1..100000``), or ''."""
        if self.lo is None or self.hi is None:
            return ""

        def num(v: float) -> str:
            return str(int(v)) if self.scalar is int else f"{v:g}"

        return f"{'0 or ' if self.zero_ok else ''}{num(self.lo)}..{num(self.hi)}"

    def expects(self) -> str:
        """What the knob takes, in words, for error messages."""
        tp = self.scalar
        if self.choices:
            what = "one of " + ", ".join(map(str, self.choices))
        elif tp is bool:
            what = "true or false"
        elif tp in (int, float):
            what = ("an integer" if tp is int else "a number") + (
                f" in {self.range_text()}" if self.range_text() else ""
            )
        else:
            what = f"a {getattr(tp, '__name__', tp)}"
        if self.is_tuple:
            what = f"a list, each {what}"
        return what + (" or None" if self.optional else "")

    def _fits(self, v: Any, ranged: bool = True) -> bool:
        tp = self.scalar
        if tp is bool:
            return isinstance(v, bool)
        if tp in (int, float):
            if isinstance(v, bool) or not isinstance(v, int if tp is int else (int, float)):
                return False
            if self.zero_ok and v == 0:
                return True
            if not ranged:  # the sign alone: positive where the range starts above 0
                return self.lo is None or (v > 0 if self.lo > 0 else v >= 0)
            return (self.lo is None or v >= self.lo) and (self.hi is None or v <= self.hi)
        if self.choices:
            return v in self.choices
        return isinstance(v, tp) if isinstance(tp, type) else True

    def refusal(self, value: Any, owner: Any = None, *, ranged: bool = True) -> str | None:
        """Why a value is refused (``must be ..., got ...``; None: accepted), without the knob's
        name, so that an option, a preset file and an API call can each name it their way.
        ``ranged=False`` checks the type and sign alone: a record built in code may explore a
        value outside what a person may type or a file may hold (the simulator must cope)."""
        if value is None and self.optional:
            return None
        items = value if self.is_tuple and isinstance(value, tuple) else (value,)
        fits = all(self._fits(v, ranged) for v in items)
        if (self.is_tuple and not isinstance(value, tuple)) or not fits:
            if not ranged and self.lo is not None:
                sign = "a positive" if self.lo > 0 else "a non-negative"
                what = sign + (" integer" if self.scalar is int else " number")
                return f"must be {what}, got {value!r}"
            return f"must be {self.expects()}, got {value!r}"
        return self.check(value, owner) if self.check else None

    def validate(
        self, value: Any, owner: Any = None, *, label: str | None = None, ranged: bool = True
    ) -> None:
        """Refuse a value outside the knob's type, range or choices, or its ``check``; the
        message names it as ``label`` (default: its field name, ``comm_sms``, which a command
        line shows as its option: ``ConfigError.names``)."""
        why = self.refusal(value, owner, ranged=ranged)
        if why:
            names = () if label else (self.name,)
            raise ConfigError(f"{label or self.name} {why}", names=names)


_UnionType = type(int | None)


def knob(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    unit: str = "",
    lo: float | None = None,
    hi: float | None = None,
    zero_ok: bool = False,
    choices: tuple = (),
    check: Callable[[Any, Any], str | None] | None = None,
    tune: tuple = (),
) -> Any:
    """A dataclass field carrying its knob spec (``optional`` follows from the annotation)."""
    spec = dict(
        help=help, unit=unit, lo=lo, hi=hi, zero_ok=zero_ok, choices=choices, check=check, tune=tune
    )
    return dataclasses.field(default=default, metadata={"knob": spec})


@functools.cache
def knobs(cls: type) -> tuple[Knob, ...]:
    """The knob records of a configuration class, in field order (fields declared without
    ``knob`` are left out). Annotations are resolved with ``typing.get_type_hints``."""
    hints = typing.get_type_hints(cls)
    return tuple(
        Knob(
            name=f.name,
            type=hints[f.name],
            default=f.default,
            optional=type(None) in typing.get_args(hints[f.name]),
            **f.metadata["knob"],
        )
        for f in dataclasses.fields(cls)
        if "knob" in f.metadata
    )


def validate_all(record: Any, owner: str | None = None, *, ranged: bool = True) -> None:
    """Run every knob's validator on a configuration record (its ``__post_init__`` calls this);
    a list given for a tuple knob is stored as a tuple first. ``owner`` (``gpu h800``) names a
    refused field ``gpu h800: hbm_gbps`` (a preset's field) instead of by its option;
    ``ranged=False``: type and sign alone (:meth:`Knob.refusal`)."""
    for k in knobs(type(record)):
        v = getattr(record, k.name)
        if k.is_tuple and isinstance(v, list):
            v = tuple(v)
            object.__setattr__(record, k.name, v)
        k.validate(v, record, label=f"{owner}: {k.name}" if owner else None, ranged=ranged)
