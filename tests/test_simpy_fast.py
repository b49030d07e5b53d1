"""``sim.simpy_fast`` relies on SimPy internals; these tests fail loudly if the installed SimPy
changes any of them (then ``sim.simpy_fast`` must follow, or go back to the public API)."""

from __future__ import annotations

import itertools

import simpy

from overlap_lab.sim import resources
from overlap_lab.sim.simpy_fast import Scheduler, nothing_due_now


def test_simpy_internals_are_what_simpy_fast_relies_on():
    env = simpy.Environment()
    assert isinstance(env._queue, list) and env._queue == []
    assert isinstance(env._eid, itertools.count)
    assert env._now == env.now == 0
    ev = env.event()
    ev.succeed("v")  # schedules it: the entry ``Environment.schedule`` pushes
    assert len(env._queue) == 1
    when, prio, eid, queued = env._queue[0]
    assert (when, prio, queued) == (0, simpy.core.NORMAL, ev) and isinstance(eid, int)
    assert (ev._ok, ev._value) == (True, "v")  # triggered: ``_ok`` and ``_value``
    assert set(vars(ev)) == {"env", "callbacks", "_ok", "_value"}
    seen = []
    ev.callbacks.append(seen.append)
    env.step()
    assert seen == [ev] and ev.callbacks is None and ev.processed  # processed: callbacks None


def test_a_timer_is_the_event_and_queue_entry_of_env_schedule():
    """A timer is queued as ``env.schedule`` queues a triggered event (time ``now + delay``, its
    priority, the next event id), has a triggered event's attributes and is processed as one."""
    env = simpy.Environment()
    env.timeout(0.1 + 0.2)
    env.run()  # a clock whose sums round
    s = Scheduler(env)
    assert s._plain
    fired = []
    ev = s.schedule_timer(0.7, [lambda e: fired.append((env.now, e))])
    ref = env.event()
    ref._ok, ref._value = True, None
    env.schedule(ref, simpy.core.NORMAL, 0.7)
    (w1, p1, id1, e1), (w2, p2, id2, e2) = sorted(env._queue, key=lambda x: x[2])
    assert (w1, p1, e1) == (w2, p2, ev) and e2 is ref and id2 == id1 + 1
    assert w1 == env.now + 0.7
    assert set(vars(ev)) == set(vars(ref)) and (ev._ok, ev._value) == (True, None)
    s.schedule_timer(0.0, [], priority=2)
    assert env._queue[0][:2] == (env.now, 2)
    env.run()
    assert fired == [(w1, ev)] and ev.processed


def test_a_subclass_or_instance_schedule_is_called():
    patched = simpy.Environment()
    calls = []

    def schedule(*a, **kw):
        calls.append(a)
        simpy.Environment.schedule(patched, *a, **kw)

    patched.schedule = schedule
    s = Scheduler(patched)
    assert not s._plain
    s.schedule_timer(1.0, [])
    assert len(calls) == 1
    patched.run()
    assert patched.now == 1.0


def test_nothing_due_now_reads_the_head_of_the_queue():
    env = simpy.Environment()
    assert nothing_due_now(env, 1)
    Scheduler(env).schedule_timer(0.0, [], priority=2)
    assert nothing_due_now(env, 1) and not nothing_due_now(env, 2)
    env.run()
    env.timeout(1.0)
    assert nothing_due_now(env, 2)  # later than now
    env.run()


def test_timers_share_an_instant(tie_shuffled):
    env = simpy.Environment()
    t = resources.timers(env)
    fired = []
    t.call_later(0.5, lambda _e: fired.append(1))
    t.call_later(0.5, lambda _e: fired.append(2))
    assert len(env._queue) == 1
    env.run()
    assert fired == [1, 2]
    shuffled = tie_shuffled(3)
    resources.timers(shuffled).call_later(1.0, lambda _e: fired.append(shuffled.now))
    assert isinstance(shuffled._queue[0][2], tuple)  # the subclass's key: its schedule ran
    shuffled.run()
    assert fired[-1] == 1.0
