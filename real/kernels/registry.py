"""Kernel families: which kernel runs each op name, found the way every plug-in is.

A kernel is ``fn(ctx: KernelCtx) -> None`` (``real.kernels.context``). A :class:`KernelFamily`
binds op names to kernels (``kernels``) and, for ops a schedule cuts into numbered slices
``"<base>.<k>"`` (SBO's ``experts.down.2``), a base name to the kernel of every slice
(``pieces``). Families register in the entry-point group ``overlap_lab.kernel_families``
(name -> ``"module:FAMILY"``), this project's built-ins too, through ``shared.plugins.Registry``.

:func:`bindings` resolves op name -> kernel for one run: the families named first (``prefer``,
by name or as objects: ``execute(kernels=...)``, ``overlap-lab run --kernels``) bind the ops
they hold ahead of everything else; every other registered family binds the rest. Two of those
binding one op name is refused when the op is used (a ConfigError naming both), never settled
by import order; a family that fails to load costs only the ops it would have bound.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.plugins import Registry

Kernel = Callable[[Any], None]

GROUP = "overlap_lab.kernel_families"
#: The built-in families, in listing order: the fallback when the entry points are not
#: installed (a source tree), and the order the installed ones keep.
BUILTINS: dict[str, str] = {
    "head": "overlap_lab.real.kernels.head:FAMILY",
    "copies": "overlap_lab.real.kernels.copies:FAMILY",
    "comm-prep": "overlap_lab.real.kernels.comm_prep:FAMILY",
    "attention": "overlap_lab.real.kernels.attention:FAMILY",
    "moe": "overlap_lab.real.kernels.moe:FAMILY",
    "ep-comm": "overlap_lab.real.kernels.ep_comm:FAMILY",
    "p2p": "overlap_lab.real.kernels.p2p:FAMILY",
    "placeholders": "overlap_lab.real.kernels.placeholders:FAMILY",
}


@dataclass(frozen=True)
class KernelFamily:
    """Kernels one module provides: ``kernels`` (op name -> kernel) and ``pieces`` (base name ->
    the kernel of each numbered slice ``"<base>.<k>"``; the executor sets ``ctx.piece = (k,
    n)``). ``name`` labels a family handed to :func:`bindings` as an object; a registered one
    goes by its entry-point name."""

    name: str
    summary: str
    kernels: Mapping[str, Kernel]
    pieces: Mapping[str, Kernel] = field(default_factory=dict)


def _check(obj: Any) -> str | None:
    """What a registered family must be (None: it is)."""
    if not isinstance(obj, KernelFamily):
        return f"is a {type(obj).__name__}, not a real.kernels.KernelFamily"
    bad = sorted(n for n, fn in (*obj.kernels.items(), *obj.pieces.items()) if not callable(fn))
    return f"binds {', '.join(bad)} to something not callable" if bad else None


#: The kernel families' registry (``shared.plugins``): found by entry point, loaded when used.
FAMILIES = Registry(GROUP, "kernel family", BUILTINS, _check)


@dataclass(frozen=True)
class Table:
    """One kind of binding (whole ops, or the slices of a base name): name -> kernel, the
    family that binds each, and why a name two families bind is unusable."""

    kernels: Mapping[str, Kernel]
    source: Mapping[str, str]
    clashes: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Bindings:
    """Op name -> kernel for one run: whole ops (``ops``) and numbered slices (``pieces``)."""

    ops: Table
    pieces: Table
    broken: tuple[str, ...] = ()  # the one-line errors of families that did not load

    def split_piece(self, name: str) -> tuple[str, int | None]:
        """``"experts.down.2"`` -> ``("experts.down", 2)``: a schedule's slice of an op whose
        base a family binds as pieces; ``(name, None)`` for anything else."""
        base, _, k = name.rpartition(".")
        if base and k.isdigit() and base in self.pieces.kernels:
            return base, int(k)
        return name, None

    def _entry(self, name: str) -> tuple[Table, str]:
        base, k = self.split_piece(name)
        return (self.ops, name) if k is None else (self.pieces, base)

    def bind(self, name: str) -> Kernel:
        """The kernel of op ``name``: KeyError naming the op when no family binds it,
        ConfigError when two registered families do."""
        table, key = self._entry(name)
        if key in table.clashes:
            raise ConfigError(table.clashes[key])
        try:
            return table.kernels[key]
        except KeyError:
            why = f"; and {'; '.join(self.broken)}" if self.broken else ""
            raise KeyError(
                f"op {name!r} has no kernel: no kernel family binds it (a package adds one in "
                f"the entry-point group {GROUP}: docs/architecture.md, Plug-ins){why}"
            ) from None

    def unbound(self, names: Iterable[str]) -> list[str]:
        """The op names of ``names`` no family binds, sorted."""
        return sorted({n for n in names if self._entry(n)[1] not in self._entry(n)[0].kernels})

    def families_of(self, names: Iterable[str]) -> dict[str, int]:
        """family -> how many of the op names ``names`` it binds (the run's trace meta)."""
        out: dict[str, int] = {}
        for n in set(names):
            table, key = self._entry(n)
            fam = table.source.get(key)
            if fam is not None:
                out[fam] = out.get(fam, 0) + 1
        return dict(sorted(out.items()))

    def bound_by(self, names: Iterable[str], family: str) -> list[str]:
        """The op names of ``names`` that ``family`` binds, sorted."""
        return sorted({n for n in names if self._source(n) == family})

    def _source(self, name: str) -> str | None:
        table, key = self._entry(name)
        return table.source.get(key)


def bindings(prefer: Sequence[str | KernelFamily] = ()) -> Bindings:
    """The kernels of a run: the families of ``prefer`` (registered names or
    :class:`KernelFamily` objects, the first of them winning) bind their ops ahead of every
    other registered family; those others bind the rest, and an op two of them bind is unusable
    (``Bindings.bind`` says which two). An unknown or broken family in ``prefer`` is a
    ConfigError at once; a broken one elsewhere only leaves its ops unbound (and is named when
    one of them is asked for)."""
    chosen: list[tuple[str, KernelFamily]] = []
    for p in prefer:
        chosen.append((p.name, p) if isinstance(p, KernelFamily) else (p, FAMILIES.load(p)))
    named = {n for n, _ in chosen}
    rest, broken = [], []
    for name in FAMILIES.names():
        if name in named:
            continue
        try:
            rest.append((name, FAMILIES.load(name)))
        except ConfigError as e:
            broken.append(str(e))
    ops, pieces = _table(chosen, rest, "kernels"), _table(chosen, rest, "pieces")
    return Bindings(ops, pieces, tuple(broken))


def _table(chosen, rest, part: str) -> Table:
    kernels: dict[str, Kernel] = {}
    source: dict[str, str] = {}
    clashes: dict[str, str] = {}
    for name, fam in chosen:
        for op, fn in getattr(fam, part).items():
            if op not in kernels:
                kernels[op], source[op] = fn, name
    named = {n for n, _ in chosen}
    for name, fam in rest:
        for op, fn in getattr(fam, part).items():
            prev = source.get(op)
            if prev is None:
                kernels[op], source[op] = fn, name
            elif prev not in named:
                clashes[op] = (
                    f"op {op!r} is bound by two kernel families, {prev} and {name}; name the "
                    "one to use (overlap-lab run --kernels NAME, execute(kernels=[NAME]))"
                )
    return Table(kernels, source, clashes)


#: (the registry, its bindings with no family preferred): rebuilt when FAMILIES is replaced
_DEFAULT: list = [None, None]


def _default() -> Bindings:
    """The bindings of every registered family, none preferred (made once per registry: kernel
    notes ask for an op's base name at every launch)."""
    if _DEFAULT[0] is not FAMILIES:
        _DEFAULT[:] = [FAMILIES, bindings()]
    return _DEFAULT[1]


def split_piece(name: str) -> tuple[str, int | None]:
    """:meth:`Bindings.split_piece` of every registered family."""
    return _default().split_piece(name)


def bind(name: str) -> Kernel:
    """:meth:`Bindings.bind` of every registered family (none preferred)."""
    return _default().bind(name)


def unbound(names: Iterable[str]) -> list[str]:
    """:meth:`Bindings.unbound` of every registered family (none preferred)."""
    return _default().unbound(names)
