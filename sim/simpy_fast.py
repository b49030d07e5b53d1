"""SimPy's private internals, used here and nowhere else in the package.

The event loop processes about one SimPy event per instant at which something ends, and for
those events SimPy's public API costs more than the work: ``simpy.Event(env)`` plus ``succeed``
runs two Python calls and a check to fill four attributes, and ``env.schedule`` is a bound call
around one ``heappush``. The run loop (``sim.budget``) must also know whether the next queued
event still belongs to this instant at a given priority, which SimPy's ``peek`` (time only) does
not say. Those are the two things done here, behind functions named for what they do.

What they rely on, in SimPy 4 (``tests/test_simpy_fast.py`` checks every item against the
installed SimPy and fails loudly if one changes):

- ``Environment._queue``: a heap (list) of ``(time, priority, event id, event)`` entries, the
  entry ``Environment.schedule`` pushes; ``Environment._eid``: the counter of event ids;
  ``Environment._now``: the clock;
- an event is triggered once it has ``_ok`` (True: succeeded) and ``_value`` set; SimPy
  processes a queued, triggered event by calling its ``callbacks`` with it and setting them to
  None (the public ``processed`` reads that).
"""

from __future__ import annotations

from collections.abc import Callable
from heapq import heappush

import simpy

NORMAL = simpy.core.NORMAL
_Event = simpy.Event


class Scheduler:
    """Schedules triggered events (timers) on one environment without SimPy's per-call costs."""

    __slots__ = ("env", "_queue", "_eid", "_plain")

    def __init__(self, env: simpy.Environment):
        self.env = env
        self._queue, self._eid = env._queue, env._eid
        #: SimPy's own ``schedule`` (not a subclass's, such as a test's tie-shuffling one, nor
        #: one set on the instance): the entry is pushed directly, exactly the one it would push
        self._plain = getattr(env.schedule, "__func__", None) is simpy.Environment.schedule

    def schedule_timer(
        self,
        delay: float,
        callbacks: list[Callable[[simpy.Event], None]],
        priority: int = NORMAL,
    ) -> simpy.Event:
        """A triggered event, processed ``delay`` µs from now (``delay`` >= 0) at SimPy
        ``priority``, whose ``callbacks`` (the list itself: the caller may append to it until
        it is processed) are then called with it: ``env.timeout(delay)`` with its callbacks,
        without the cost of building one."""
        env = self.env
        ev = _Event.__new__(_Event)  # ``simpy.Event(env)`` without its __init__ call
        ev.env, ev.callbacks = env, callbacks
        ev._ok, ev._value = True, None  # triggered: processed when its time comes
        if self._plain:  # exactly ``env.schedule(ev, priority, delay)``: the same entry
            heappush(self._queue, (env._now + delay, priority, next(self._eid), ev))
        else:
            env.schedule(ev, priority, delay)
        return ev


def nothing_due_now(env: simpy.Environment, priority: int) -> bool:
    """True when no queued event is due at the current time with ``priority`` or a higher
    (lower-numbered) SimPy priority: what is queued, if anything, comes after them."""
    queue = env._queue
    if not queue:
        return True
    head = queue[0]
    return head[0] > env._now or head[1] > priority
