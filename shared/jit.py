"""Optional numba compilation of the loops that have a numpy twin (``pip install ".[fast]"``).

Each compiled loop is the same algorithm, operation for operation, as numpy code kept beside it,
and tests hold the two to bit-identical results, so whether numba is installed changes speed only.
Helpers shared by both (:func:`inline`) are plain numpy code on arrays and compiled into the loops
on scalars; :func:`bit_length` is the one whose compiled form differs (an instruction, not a
float conversion), with the same result.
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


def bit_length(a):
    """Bits of the integers 0 < a < 2**53 (uint64): frexp's exponent of a as a float, exact
    there. Compiled (after :func:`inline`): 64 minus its leading zeros, one instruction where
    numba's frexp is a library call several times the cost of the rest of a random number."""
    return np.frexp(np.float64(a))[1]


_inlined: set = set()


def inline(*fns: Callable) -> bool:
    """Make ``fns`` (and :func:`bit_length`) callable from compiled loops, where they are
    compiled on scalars and inlined; False (nothing done) without numba. Call it before the
    loops that use them are compiled."""
    try:
        from numba.cpython.unsafe.numbers import leading_zeros
        from numba.extending import overload, register_jitable
    except ImportError:
        return False
    if bit_length not in _inlined:

        @overload(bit_length)
        def _bit_length(a):
            return lambda a: np.int64(64) - np.int64(leading_zeros(a))

        _inlined.add(bit_length)
    for fn in fns:
        if fn not in _inlined:
            register_jitable(fn)
            _inlined.add(fn)
    return True
