"""Test aids shared by the test files."""

from __future__ import annotations

import heapq
import random

import pytest
import simpy


class TieShuffledEnvironment(simpy.Environment):
    """A SimPy environment that processes events of the same time and SimPy priority in a seeded
    random order (and runs each event's callbacks in a seeded random order). The simulator's
    result must not depend on that order; tests run Programs under it (``Engine(env=...)``) to
    prove so. It reaches into SimPy's queue as ``sim.simpy_fast`` does (checked by
    tests/test_simpy_fast.py)."""

    def __init__(self, seed: int):
        super().__init__()
        self._rng = random.Random(seed)

    def schedule(self, event, priority=simpy.core.NORMAL, delay=0) -> None:
        key = (self._rng.random(), next(self._eid))
        heapq.heappush(self._queue, (self._now + delay, priority, key, event))

    def step(self) -> None:
        if self._queue:
            event = self._queue[0][3]
            if event.callbacks and len(event.callbacks) > 1:
                self._rng.shuffle(event.callbacks)
        super().step()


@pytest.fixture(scope="session")
def tie_shuffled():
    """``TieShuffledEnvironment``: call it with a seed for a fresh environment (session-scoped,
    so hypothesis tests may take it)."""
    return TieShuffledEnvironment
