"""Test aids shared by the test files."""

from __future__ import annotations

import heapq
import random

import pytest
import simpy


class CallbacksShuffledEnvironment(simpy.Environment):
    """A SimPy environment that runs each event's callbacks in a seeded random order, with
    SimPy's own ``schedule`` (so instants the engine computes ahead land exactly, and its
    closed-form timing of lone kernels, ``sim.alone``, stays on). The simulator's result must
    not depend on that order."""

    def __init__(self, seed: int):
        super().__init__()
        self._rng = random.Random(seed)

    def step(self) -> None:
        if self._queue:
            event = self._queue[0][3]
            if event.callbacks and len(event.callbacks) > 1:
                self._rng.shuffle(event.callbacks)
        super().step()


class TieShuffledEnvironment(CallbacksShuffledEnvironment):
    """Also processes events of the same time and SimPy priority in a seeded random order. The
    simulator's result must not depend on that order; tests run Programs under it
    (``Engine(env=...)``) to prove so. It reaches into SimPy's queue as ``sim.simpy_fast`` does
    (checked by tests/test_simpy_fast.py)."""

    def schedule(self, event, priority=simpy.core.NORMAL, delay=0) -> None:
        key = (self._rng.random(), next(self._eid))
        heapq.heappush(self._queue, (self._now + delay, priority, key, event))


@pytest.fixture(scope="session")
def tie_shuffled():
    """``TieShuffledEnvironment``: call it with a seed for a fresh environment (session-scoped,
    so hypothesis tests may take it)."""
    return TieShuffledEnvironment


@pytest.fixture(scope="session")
def callbacks_shuffled():
    """``CallbacksShuffledEnvironment``: call it with a seed for a fresh environment."""
    return CallbacksShuffledEnvironment
