"""The preset files read into records: the one loader behind ``GPUS`` and ``MODELS``.

It sits below ``hardware`` and ``workload`` (which hold the record types) and imports neither:
each passes its own record class in. Reading a researcher's own file by path, and the
HuggingFace ``config.json`` mapping, live above both in ``shared.inputs.presets``. Every file
is read through ``shared.files`` (bounded in size, nesting and YAML aliases).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, TypeVar

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.files import read_mapping
from overlap_lab.shared.inputs.knobs import knobs

PRESETS = Path(__file__).parent / "presets"

T = TypeVar("T")


_NOTED: set[str] = set()
#: The notes held back (:func:`hold_notes`), each ``(kind, message)``; None: said at once
_HELD: list[tuple[str, str]] | None = None


def note(message: str, kind: str = "note") -> None:
    """Say something the user may not expect, once per run, in one line on stderr (a default a
    file took; ``kind`` "warning": a value that looks typed in another unit): not an error, and
    not repeated for every case of a sweep. Held back while :func:`hold_notes` says so."""
    if message not in _NOTED:
        _NOTED.add(message)
        if _HELD is not None:
            _HELD.append((kind, message))
        else:
            print(f"overlap-lab: {kind}: {message}", file=sys.stderr)


def hold_notes(hold: bool) -> list[tuple[str, str]]:
    """Hold notes back from now on (``hold``), or say them at once again; returns the notes held
    until now, ``(kind, message)``. The command line holds them while a command runs and says
    them once it succeeded, so that a note never stands before the one line of an error; a
    command starting to hold says its notes again, once."""
    global _HELD
    held, _HELD = _HELD or [], [] if hold else None
    if hold:  # a new command: its notes are said once more
        _NOTED.clear()
    return held


def builtin(kind: str, cls: type[T], order: tuple[str, ...]) -> dict[str, T]:
    """The built-in ``models`` or ``gpus`` presets as ``cls`` records, by name: the names in
    ``order`` first (the order help texts list them in), any other file after, sorted."""
    found = {}
    for f in sorted((PRESETS / kind).glob("*.yaml")):
        data = read_mapping(f)
        found[data.get("name", f.stem)] = (data, f)
    names = [n for n in order if n in found] + sorted(set(found) - set(order))
    return {n: from_file(cls, *found[n]) for n in names}


def from_file(cls: type[T], data: dict[str, Any], path: str | Path) -> T:
    """The ``cls`` record of a file's fields, each held to its knob record's range first (the
    range its option has: a record built in code is checked for type and sign alone), so that
    a value out of range is one line naming the file, the field and the range."""
    records = {k.name: k for k in knobs(cls)}
    for name, value in data.items():
        why = records[name].refusal(value) if name in records else None
        if why:
            raise ConfigError(f"{path}: {name} {why}")
    try:
        return cls(**data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def pick(table: dict[str, T], what: str, name: str, overrides: dict[str, Any]) -> T:
    """The preset ``name`` of ``table`` (case-insensitive) with fields replaced, validated again
    by the record's own ``__post_init__``; ``what`` names the kind in errors (gpu, model)."""
    key = name.lower()
    if key not in table:
        raise ConfigError(f"unknown {what} {name!r}; choose from {', '.join(table)}")
    known = {f.name for f in dataclasses.fields(table[key])}
    for k in overrides:
        if k not in known:
            raise ConfigError(f"unknown {what} field {k!r}; fields are {', '.join(sorted(known))}")
    return dataclasses.replace(table[key], **overrides)
