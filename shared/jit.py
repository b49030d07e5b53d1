"""Optional numba compilation of the loops that have a numpy twin (``pip install ".[fast]"``).

Each compiled loop is the same algorithm, operation for operation, as numpy code kept beside it,
and tests hold the two to bit-identical results, so whether numba is installed changes speed only.
Helpers shared by both (:func:`inline`) are plain numpy code on arrays and compiled into the loops
on scalars; :func:`as_float` and :func:`as_bits` are the ones whose compiled form differs (an LLVM
bit cast where numpy takes a view), with the same result.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def njit(fn: Callable, **options) -> Callable | None:
    """``fn`` compiled by numba, cached next to its module where that is writable (or under
    ``NUMBA_CACHE_DIR``), else compiled in each process; None when numba is not installed."""
    try:
        import numba
    except ImportError:
        return None
    try:
        return numba.njit(cache=True, **options)(fn)
    except RuntimeError:  # no writable cache location
        return numba.njit(**options)(fn)


def as_float(x):
    """The float64s whose IEEE bits are the uint64s ``x`` (a view in numpy; compiled, after
    :func:`inline`, a bit cast that vectorises where numba's frexp is a library call)."""
    return np.asarray(x, dtype=np.uint64).view(np.float64)


def as_bits(x):
    """The IEEE bits of the float64s ``x``, as uint64 (:func:`as_float`'s inverse)."""
    return np.asarray(x, dtype=np.float64).view(np.uint64)


_inlined: set = set()


def inline(*fns: Callable) -> bool:
    """Make ``fns`` (and :func:`as_float`, :func:`as_bits`) callable from compiled loops, where
    they are compiled on scalars and inlined; False (nothing done) without numba. Call it before
    the loops that use them are compiled."""
    try:
        from llvmlite import ir
        from numba import types
        from numba.extending import intrinsic, overload, register_jitable
    except ImportError:
        return False
    if not _inlined:
        for fn, to, ir_to in ((as_float, types.float64, ir.DoubleType()),
                              (as_bits, types.uint64, ir.IntType(64))):  # fmt: skip
            overload(fn)(_bitcast_overload(intrinsic, to, ir_to))
        _inlined.update((as_float, as_bits))
    for fn in fns:
        if fn not in _inlined:
            register_jitable(fn)
            _inlined.add(fn)
    return True


def _bitcast_overload(intrinsic, to, ir_to):
    """numba's implementation of :func:`as_float` / :func:`as_bits`: an LLVM bitcast to ``to``."""

    @intrinsic
    def bitcast(typingctx, x):
        return to(x), lambda context, builder, sig, args: builder.bitcast(args[0], ir_to)

    return lambda x: lambda x: bitcast(x)
