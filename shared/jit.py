"""Optional numba compilation of the loops that have a numpy twin (``pip install ".[fast]"``).

Each compiled loop is the same algorithm, operation for operation, as numpy code kept beside it,
and tests hold the two to bit-identical results, so whether numba is installed changes speed only.
"""

from __future__ import annotations

from collections.abc import Callable


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
