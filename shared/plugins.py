"""One way to register every kind of plug-in: a named entry-point group per kind.

Schedules, cost models, network models, EP communication backends, real-kernel families and
subcommands are each found the same way: a package declares
``[project.entry-points."overlap_lab.<kind>"] name = "module"`` (or ``"module:attr"``), this
project's built-ins included, and a :class:`Registry` of that group lists them by name and loads
one when it is used. Loading is lazy and per name, so a plug-in that fails to import, or two
packages that claim one name, make that name unusable with a one-line error naming the package,
while every other name keeps working (``Registry.broken`` lists what is wrong, for the commands
that list plug-ins).

When this project runs from a source tree without ``pip install -e .``, its entry points are not
installed; each registry then takes the built-in table it was given, as it is.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from overlap_lab.shared.errors import ConfigError

#: This project's distribution (the one whose entry points are the built-ins).
PROJECT = "overlap-lab"


@dataclass(frozen=True)
class Entry:
    """One registered name: where it points and which package registered it."""

    name: str
    target: str  # "module" or "module:attribute"
    package: str
    conflict: str | None = None  # why the name cannot be used (two packages claim it)


class Registry:
    """The plug-ins of one entry-point group, built-ins first in their own order, then the
    others sorted by name. ``check`` (optional) inspects a loaded object and returns what is
    wrong with it (None: nothing), so a malformed plug-in is refused by name when used."""

    def __init__(
        self,
        group: str,
        kind: str,
        builtins: Mapping[str, str],
        check: Callable[[Any], str | None] | None = None,
    ) -> None:
        self.group, self.kind, self.builtins, self._check = group, kind, dict(builtins), check
        self._entries: dict[str, Entry] | None = None
        self._loaded: dict[str, Any] = {}

    # --- discovery -------------------------------------------------------------------------
    @property
    def entries(self) -> dict[str, Entry]:
        if self._entries is None:
            self._entries = self._discover()
        return self._entries

    def _discover(self) -> dict[str, Entry]:
        found: dict[str, Entry] = {}
        for ep in metadata.entry_points(group=self.group):
            dist = ep.dist.name if ep.dist is not None else "an unknown package"
            prev = found.get(ep.name)
            if prev is not None and prev.target != ep.value:
                why = f"is registered twice, by {prev.package} and {dist}"
                found[ep.name] = Entry(ep.name, prev.target, prev.package, why)
                continue
            found[ep.name] = Entry(ep.name, ep.value, dist)
        if PROJECT not in {e.package for e in found.values()}:  # a source tree
            for name, target in self.builtins.items():
                if name in found:
                    why = f"of {found[name].package} shadows a built-in one"
                    found[name] = Entry(name, target, PROJECT, why)
                else:
                    found[name] = Entry(name, target, PROJECT)
        order = [n for n in self.builtins if n in found] + sorted(set(found) - set(self.builtins))
        return {n: found[n] for n in order}

    def rescan(self) -> None:
        """Find the group's entry points again (a package installed while this process runs)
        and forget what was loaded."""
        self._entries = None
        self._loaded.clear()

    def names(self) -> list[str]:
        """Every registered name, in listing order (broken ones included)."""
        return list(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    # --- loading -----------------------------------------------------------------------------
    def where(self, name: str) -> str:
        e = self.entries[name]
        return f"{self.kind} {name!r} ({e.target}, package {e.package})"

    def load(self, name: str) -> Any:
        """The object registered as ``name``; ConfigError (one line) when it is unknown, claimed
        twice, fails to import or fails the registry's check."""
        if name in self._loaded:
            return self._loaded[name]
        if name not in self.entries:
            raise ConfigError(
                f"unknown {self.kind} {name!r}; choose from {', '.join(self.usable())}"
            )
        e = self.entries[name]
        if e.conflict:
            raise ConfigError(f"{self.kind} {name!r} {e.conflict}")
        module, _, attr = e.target.partition(":")
        try:
            obj = importlib.import_module(module)
            for part in filter(None, attr.split(".")):
                obj = getattr(obj, part)
        except Exception as err:  # noqa: BLE001 - any failure of a plug-in is its own
            msg = str(err).splitlines()[0] if str(err) else ""
            raise ConfigError(
                f"{self.where(name)} cannot be loaded: {type(err).__name__}: {msg}"
            ) from None
        if self._check is not None:
            try:
                problem = self._check(obj)
            except Exception as err:  # noqa: BLE001
                problem = f"{type(err).__name__}: {err}"
            if problem:
                raise ConfigError(f"{self.where(name)} {problem}")
        self._loaded[name] = obj
        return obj

    def broken(self) -> dict[str, str]:
        """name -> the one-line error that makes it unusable, for every broken registration."""
        out = {}
        for name in self.entries:
            try:
                self.load(name)
            except ConfigError as err:
                out[name] = str(err)
        return out

    def usable(self) -> list[str]:
        """The names that load (without loading any: broken ones are found when used)."""
        return [n for n, e in self.entries.items() if e.conflict is None]
