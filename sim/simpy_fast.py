"""SimPy's private internals, used here and nowhere else in the package.

The event loop processes about one SimPy event per instant at which something ends, and for
those events SimPy's public API costs more than the work: ``simpy.Event(env)`` plus ``succeed``
runs two Python calls and a check to fill four attributes, ``env.schedule`` is a bound call
around one ``heappush``, and ``env.run`` cannot stop after a number of events or run work of
its own between two events. So this module gives:

- ``InstantTimers``: callbacks due at future instants, one triggered SimPy event per instant
  (built and queued without SimPy's per-call costs) rather than one per caller;
- ``run_steps``: ``env.run()`` bounded to a number of steps, which runs end-of-instant work
  (``EndOfInstant``) once the instant's events of a priority are done, with no event of its own.

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
from typing import Protocol

import simpy

NORMAL = simpy.core.NORMAL
_Event = simpy.Event

#: ``InstantTimers`` keeps the events of past instants until it holds this many (or twice what
#: the last pruning kept) rather than give each event a callback that forgets it; then drops them
#: at once.
AT_PRUNE = 64


class InstantTimers:
    """Callbacks due at future instants, one SimPy event per instant rather than per caller.

    Resources in lockstep (explicit ranks running the same kernels) set timers for the very same
    instant; each would be its own SimPy event. Here the first caller for an instant schedules a
    triggered event (SimPy's NORMAL priority, like ``env.timeout``) and later callers append their
    callbacks to it, in call order, as separate timeouts would run in creation order. An event
    that SimPy is processing (its ``callbacks`` are None) takes no more: a caller then gets a new
    one, so a callback that keeps re-arming the same instant still costs one event each time and
    stays inside a bounded run's steps (``run_steps``)."""

    def __init__(self, env: simpy.Environment):
        self.env = env
        self._queue, self._eid = env._queue, env._eid
        #: SimPy's own ``schedule`` (not a subclass's, such as a test's tie-shuffling one, nor
        #: one set on the instance): a new event is pushed directly, the entry it would push
        self._plain = getattr(env.schedule, "__func__", None) is simpy.Environment.schedule
        #: ``call_at`` lands on the very instant asked for (an environment with a ``schedule``
        #: of its own adds a delay to now, which can be an ulp off)
        self.exact = self._plain
        self._at: dict[float, simpy.Event] = {}  # instant -> its event (some past: ``AT_PRUNE``)
        self._prune_at = AT_PRUNE

    def call_later(self, delay: float, fn: Callable[[simpy.Event], None]) -> None:
        """Call ``fn(event)`` ``delay`` µs from now (``delay`` >= 0)."""
        # the float SimPy itself computes for the event's time
        self.call_at(self.env._now + delay, fn, delay)

    def call_at(
        self, when: float, fn: Callable[[simpy.Event], None], delay: float | None = None
    ) -> None:
        """Call ``fn(event)`` at the instant ``when`` (>= now), that very float where the
        environment schedules as SimPy does (``exact``): an instant computed ahead
        (``sim.alone``) is not moved by the round-off of ``now + (when - now)``. ``delay``:
        ``when - now`` as the caller computed it, when ``now + delay`` gave ``when``."""
        env = self.env
        at = self._at
        ev = at.get(when)
        if ev is None or ev.callbacks is None:  # none yet, or processed (callbacks None)
            if len(at) >= self._prune_at:  # drop instants already processed
                self._at = at = {w: e for w, e in at.items() if e.callbacks is not None}
                self._prune_at = max(AT_PRUNE, 2 * len(at))  # amortised: O(1) per call
            # ``schedule`` inline: this is the hot path
            ev = _Event.__new__(_Event)  # ``simpy.Event(env)`` without its __init__ call
            ev.env, ev.callbacks = env, [fn]
            ev._ok, ev._value = True, None  # triggered: processed when its time comes
            if self._plain:  # exactly ``env.schedule(ev, NORMAL, delay)``: the same entry
                heappush(self._queue, (when, NORMAL, next(self._eid), ev))
            else:
                env.schedule(ev, NORMAL, when - env._now if delay is None else delay)
            at[when] = ev
            return
        ev.callbacks.append(fn)

    def schedule(
        self, delay: float, callbacks: list[Callable[[simpy.Event], None]], priority: int
    ) -> simpy.Event:
        """A triggered event of its own, processed ``delay`` µs from now at SimPy ``priority``,
        whose ``callbacks`` are then called with it (``env.timeout`` at any priority)."""
        env = self.env
        ev = _Event.__new__(_Event)
        ev.env, ev.callbacks = env, callbacks
        ev._ok, ev._value = True, None
        if self._plain:
            heappush(self._queue, (env._now + delay, priority, next(self._eid), ev))
        else:
            env.schedule(ev, priority, delay)
        return ev


class EndOfInstant(Protocol):
    """Work ``run_steps`` runs at the end of an instant, between SimPy events."""

    #: None when nothing is pending
    passes: list | None
    #: called once the current instant is over (no event of now, no pass left), then cleared
    at_end: Callable[[], None] | None

    def run_passes(self) -> None:
        """Run what is pending (it may make more pending, or schedule events)."""
        ...


def run_steps(env: simpy.Environment, max_steps: int, work: EndOfInstant, priority: int) -> bool:
    """Process up to ``max_steps`` steps of ``env``; True once nothing is left (no event queued,
    no work pending), False if steps ran out first. A step is one SimPy event (``env.step``), or
    one call of ``work.run_passes()``, made while ``work.passes`` is pending as soon as no event
    of the current time with ``priority`` or a higher (lower-numbered) one is queued: exactly
    when an event of its own at ``priority``, scheduled now, would have been processed.
    ``work.at_end``, when set, is called (as a step) once the instant is over: no event of now
    is queued and no pass is pending."""
    queue, step = env._queue, env.step
    for _ in range(max_steps):
        if work.passes is not None and (
            not queue or queue[0][0] > env._now or queue[0][1] > priority
        ):
            work.run_passes()
        elif queue:
            if work.at_end is not None and queue[0][0] > env._now:
                at_end, work.at_end = work.at_end, None
                at_end()
                continue
            step()
        else:
            return True
    return not queue and work.passes is None
