"""``sim.simpy_fast`` relies on SimPy internals; these tests fail loudly if the installed SimPy
changes any of them (then ``sim.simpy_fast`` must follow, or go back to the public API)."""

from __future__ import annotations

import itertools

import simpy

from overlap_lab.sim.simpy_fast import InstantTimers, run_steps


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
    env.timeout(2.5)
    env.step()
    assert env._now == env.now == 2.5  # the clock ``_now``


def test_a_timer_is_the_event_and_queue_entry_of_env_schedule():
    """A timer is queued as ``env.schedule`` queues a triggered event (time ``now + delay``, its
    priority, the next event id), has a triggered event's attributes and is processed as one."""
    env = simpy.Environment()
    env.timeout(0.1 + 0.2)
    env.run()  # a clock whose sums round
    t = InstantTimers(env)
    assert t._plain
    fired = []
    t.call_later(0.7, lambda e: fired.append((env.now, e)))
    ref = env.event()
    ref._ok, ref._value = True, None
    env.schedule(ref, simpy.core.NORMAL, 0.7)
    (w1, p1, id1, ev), (w2, p2, id2, e2) = sorted(env._queue, key=lambda x: x[2])
    assert (w1, p1) == (w2, p2) and e2 is ref and id2 == id1 + 1
    assert w1 == env.now + 0.7
    assert set(vars(ev)) == set(vars(ref)) and (ev._ok, ev._value) == (True, None)
    t.call_later(0.7, lambda e: fired.append((env.now, e)))  # the same instant: the same event
    assert len(env._queue) == 2
    own = t.schedule(0.0, [], priority=2)
    assert env._queue[0][:2] == (env.now, 2) and env._queue[0][3] is own
    env.run()
    assert fired == [(w1, ev), (w1, ev)] and ev.processed


def test_a_subclass_or_instance_schedule_is_called(tie_shuffled):
    patched = simpy.Environment()
    calls = []

    def schedule(*a, **kw):
        calls.append(a)
        simpy.Environment.schedule(patched, *a, **kw)

    patched.schedule = schedule
    t = InstantTimers(patched)
    assert not t._plain
    t.call_later(1.0, lambda _e: None)
    t.schedule(2.0, [], priority=1)
    assert len(calls) == 2
    patched.run()
    assert patched.now == 2.0

    shuffled, fired = tie_shuffled(3), []
    st = InstantTimers(shuffled)
    assert not st._plain
    st.call_later(1.0, lambda _e: fired.append(shuffled.now))
    assert isinstance(shuffled._queue[0][2], tuple)  # the subclass's key: its schedule ran
    shuffled.run()
    assert fired == [1.0]


class _Work:
    def __init__(self, env: simpy.Environment, log: list):
        self.env, self.log, self.passes, self.at_end = env, log, None, None

    def run_passes(self) -> None:
        self.passes = None
        self.log.append(("work", self.env.now))


def test_run_steps_runs_the_work_after_the_instants_events_of_its_priority():
    env, log = simpy.Environment(), []
    work = _Work(env, log)
    t = InstantTimers(env)

    def first(_e):
        log.append(("first", env.now))
        work.passes = []  # work pending at the end of this instant

    t.call_later(1.0, first)
    t.schedule(1.0, [lambda _e: log.append(("prio 1", env.now))], priority=1)
    t.schedule(1.0, [lambda _e: log.append(("prio 3", env.now))], priority=3)
    t.call_later(2.0, lambda _e: log.append(("later", env.now)))
    assert run_steps(env, 100, work, 2)
    assert log == [
        ("first", 1.0),
        ("prio 1", 1.0),
        ("work", 1.0),  # before the priority 3 event of the same instant
        ("prio 3", 1.0),
        ("later", 2.0),
    ]
    env2 = simpy.Environment()
    InstantTimers(env2).call_later(1.0, lambda _e: None)
    assert not run_steps(env2, 0, _Work(env2, []), 2)  # steps ran out
    assert run_steps(env2, 1, _Work(env2, []), 2)
