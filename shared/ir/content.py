"""Content keys: a value of the IR hashed by what it holds, so that equal Programs share a key.

A batch of simulations runs each distinct Program once (``overlap_lab.runner``); whether two
cases need one simulation is decided by comparing keys, computed where each Program is built,
never by comparing the objects across processes. :func:`content_key` is that key: a SHA-256 of a
canonical encoding that follows the values' own equality, field by field, with nothing in it
that mirrors one class's layout, so an op field or instruction added tomorrow is keyed with no
change here.

The encoding turns a value into a tree that ``marshal`` (format 2: values written with a type
code, floats as their 8 bytes, no references to shared or interned objects) writes byte for
byte the same in any process:

- ``str``, ``int``, ``float``, ``bool``, ``None`` and ``bytes`` as themselves (so ``16``,
  ``16.0`` and ``True`` differ, as they would in a Program's text form);
- a dataclass as a list of its class (module and qualified name) and the values of the fields
  that take part in its equality (``compare=True``), in field order;
- an enum member as a list of its class and its value;
- a tuple as a tuple; a list as a list headed by ``None``; a dict or a set as a list headed by
  ``False`` or ``True`` and its items sorted by their encoding, so insertion order is ignored
  as equality ignores it;
- a numpy scalar as the Python number it holds.

The heads (a class name, ``None``, ``False``, ``True``) tell every kind of node apart, so equal
bytes mean equal values of equal types. A value of any other type raises TypeError: it has no
exact encoding (a ``repr`` may cut a large array short). An object met twice (rank 0's ops shared
by every explicit rank, a flows tuple shared by stamped ops) is encoded once.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import marshal
from collections.abc import Callable, Mapping
from typing import Any

#: written by marshal as they are
_ATOMS = frozenset({str, int, float, bool, type(None), bytes})
#: the encoder of each dataclass met so far (``dataclasses.is_dataclass`` costs a call per node)
_ENCODERS: dict[type, Callable[[Any, Callable[[Any], Any]], list]] = {}


def _encoder(cls: type) -> Callable[[Any, Callable[[Any], Any]], list]:
    """A dataclass's encoder: ``(obj, enc) -> [head, value or enc(value) per compared field]``,
    made from its fields as ``dataclasses`` makes ``__init__`` (one call per object instead of
    a loop over its fields: a Program has ~10^4 of them per rank)."""
    names = [f.name for f in dataclasses.fields(cls) if f.compare]
    vals = ", ".join(
        f"v{i} if type(v{i} := o.{n}) in A else enc(v{i})" for i, n in enumerate(names)
    )
    src = f"def encode(o, enc):\n    return [head, {vals}]\n"
    scope: dict[str, Any] = {"head": _tag(cls), "A": _ATOMS, "type": type}
    exec(src, scope)  # noqa: S102 - generated from the dataclass's field names only
    return scope["encode"]


@functools.cache
def _tag(cls: type) -> bytes:
    """A class's head: 8 bytes of the BLAKE2b of its module and qualified name (short, as each
    node carries one; a ``bytes`` head never collides with the ``None``/``False``/``True`` heads
    of lists, dicts and sets)."""
    name = f"{cls.__module__}.{cls.__qualname__}".encode()
    return hashlib.blake2b(name, digest_size=8).digest()


def canonical(value: Any) -> bytes:
    """The canonical bytes of ``value`` (see the module's docstring); TypeError for a value of a
    type with no exact encoding."""
    memo: dict[int, Any] = {}

    def enc(v: Any) -> Any:
        t = type(v)
        if t in _ATOMS:
            return v
        seen = memo.get(id(v))
        if seen is not None:
            return seen
        if t is tuple:
            out: Any = tuple([x if type(x) in _ATOMS else enc(x) for x in v])
        elif t in _ENCODERS or dataclasses.is_dataclass(t):
            e = _ENCODERS.get(t)
            if e is None:
                e = _ENCODERS[t] = _encoder(t)
            out = e(v, enc)
        elif isinstance(v, enum.Enum):
            out = [_tag(t), enc(v.value)]
        elif t is list:
            out = [None, *[enc(x) for x in v]]
        elif isinstance(v, Mapping):
            items = [(enc(k), enc(x)) for k, x in v.items()]
            out = [False, *sorted(items, key=lambda kv: marshal.dumps(kv[0], 2))]
        elif isinstance(v, (set, frozenset)):
            out = [True, *sorted((enc(x) for x in v), key=lambda e: marshal.dumps(e, 2))]
        elif t.__module__ == "numpy" and getattr(v, "ndim", None) == 0:
            return enc(v.item())  # a numpy scalar: the Python number it holds
        elif isinstance(v, (int, float, str)):  # a subclass of one (enums are handled above)
            return next(b(v) for b in (int, float, str) if isinstance(v, b))
        else:
            raise TypeError(f"no content key for a value of type {t.__qualname__}")
        memo[id(v)] = out
        return out

    return marshal.dumps(enc(value), 2)


def content_key(value: Any) -> str:
    """A SHA-256 (hex) of :func:`canonical`: equal for equal values of equal types, different
    otherwise (up to SHA-256 collisions)."""
    return hashlib.sha256(canonical(value)).hexdigest()
