"""The event loop's fast paths give what the general paths give (issue 12): spans written as one
``__dict__``, timer events pushed straight onto SimPy's queue, a pass that cut or grew nothing
settled without a second ``_advance``."""

from __future__ import annotations

import dataclasses

import pytest
import simpy

from overlap_lab.shared import schedules
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.hardware import get_gpu
from overlap_lab.shared.trace import Span, new_span
from overlap_lab.shared.workload import Batch, Parallel, Workload, get_model
from overlap_lab.sim import resources
from overlap_lab.sim.engine import Engine, TieShuffledEnvironment

GPU = get_gpu("h800")
MODEL = get_model("deepseek-v3", num_layers=4)


@pytest.mark.parametrize(
    "args",
    [
        (0, "stream:main", "gemm", "compute", 1.5, 2.25, 132, 0, 3, 1),
        (3, "host:t0", "launch", "host", 0.0, 4.0),
        (1, "link:rdma", "dispatch", "link", 2.0, 2.0, 0, None, 7),
    ],
)
def test_new_span_is_a_span(args):
    a, b = Span(*args), new_span(*args)
    assert type(b) is Span
    assert a == b and hash(a) == hash(b) and repr(a) == repr(b)
    assert [getattr(b, f.name) for f in dataclasses.fields(Span)] == [
        getattr(a, f.name) for f in dataclasses.fields(Span)
    ]
    assert list(vars(b)) == list(vars(a))  # same field order: same pickles and exports
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.end = 9.0


def test_new_span_is_checked_as_a_span():
    with pytest.raises(ConfigError, match="end"):
        new_span(0, "stream:main", "gemm", "compute", 2.0, 1.0)
    with pytest.raises(ConfigError, match="kind"):
        new_span(0, "stream:main", "gemm", "nonsense", 1.0, 2.0)


def test_timer_events_are_queued_as_env_schedule_queues_them():
    """A new instant's event is the entry ``env.schedule`` pushes (time ``now + delay``, NORMAL,
    the next event id); a subclass's ``schedule`` (tie shuffling) is still called."""
    env = simpy.Environment()
    env.timeout(0.1 + 0.2)
    env.run()  # a clock whose sums round
    assert env.now == 0.1 + 0.2 and not env._queue
    t = resources.timers(env)
    assert t._plain
    t.call_later(0.7, lambda _e: None)
    assert len(env._queue) == 1
    when, prio, eid, _ev = env._queue[0]
    assert (when, prio) == (env.now + 0.7, simpy.core.NORMAL)
    ref = env.event()
    ref._ok, ref._value = True, None  # triggered, as the timer's event is
    env.schedule(ref, simpy.core.NORMAL, 0.7)
    entry = next(e for e in env._queue if e[3] is ref)
    assert entry[0] == when and entry[2] == eid + 1
    fired = []
    t.call_later(0.7, lambda _e: fired.append(env.now))  # the same instant: the same event
    assert len(env._queue) == 2
    env.run()
    assert fired == [when]

    patched = simpy.Environment()
    patched.schedule = lambda *a, **kw: simpy.Environment.schedule(patched, *a, **kw)
    assert not resources.timers(patched)._plain  # a schedule set on the instance is called

    shuffled = TieShuffledEnvironment(3)
    st = resources.timers(shuffled)
    assert not st._plain
    st.call_later(1.0, lambda _e: fired.append(shuffled.now))
    assert isinstance(shuffled._queue[0][2], tuple)  # the subclass's key: its schedule ran
    shuffled.run()
    assert fired[-1] == 1.0


@pytest.mark.parametrize("name", ["tbo", "sbo", "deepseek", "serial", "sglang-overlap"])
@pytest.mark.parametrize(
    "batch", [Batch.decode(128, kv_len=4096), Batch.prefill(2, extend_len=4096)], ids=str
)
def test_a_pass_settles_as_changed_would(name, batch, monkeypatch):
    """``Gpu._grant`` skips the second ``_advance`` unless a cohort was cut or grew: the trace is
    the one of a run where every pass goes through ``changed`` (``_advance`` again, then
    ``_settle``), as before the fast path."""
    program = schedules.build(name, Workload(MODEL, batch, Parallel(ep=8)), GPU)
    fast = Engine(program, GPU, 0).run()
    calls = {"settled": 0}
    cut = resources.Gpu._cut

    def always_reshaped(self):
        self._reshaped = True  # every pass takes the general path: changed()
        calls["settled"] += 1
        return cut(self)

    monkeypatch.setattr(resources.Gpu, "_cut", always_reshaped)
    assert Engine(program, GPU, 0).run() == fast
    assert calls["settled"] > 0
