"""Host perf_counter spans and CUDA-event spans on one axis (real/clocks.py), checked on the CPU
with a fake host clock and fake events whose device clock is offset, runs at another rate and
records one launch latency after the host asks."""

import pytest

from overlap_lab.real.clocks import ClockMap, anchor


class FakeDevice:
    def __init__(self, offset_s=5000.0, rate=1.001, latency_s=4e-6):
        self.now = 100.0  # host perf_counter (s)
        self.offset, self.rate, self.latency = offset_s, rate, latency_s
        self.syncs = 0

    def clock(self) -> float:
        return self.now

    def sync(self) -> None:
        self.syncs += 1

    def event(self):
        dev = self

        class Event:
            t = None

            def record(self):  # runs on the device one launch latency after the host asks
                self.t = (dev.now + dev.latency) * dev.rate + dev.offset

            def elapsed_time(self, other) -> float:  # ms, as torch.cuda.Event
                assert self.t is not None and other.t is not None, "event not recorded"
                return (other.t - self.t) * 1e3

        return Event()


def _run(dev: FakeDevice):
    """A run: start anchor, a kernel launched 1 ms and ending 3 ms after the start, a host span
    at 2 ms, the end anchor at 10 ms."""
    start = anchor(dev.clock, dev.event, dev.sync)
    dev.now = 100.001
    a = dev.event()
    a.record()
    dev.now = 100.002
    host_us = (dev.clock() - start.host_s) * 1e6  # what the executor's host spans measure
    dev.now = 100.003
    b = dev.event()
    b.record()
    dev.now = 100.010
    end = anchor(dev.clock, dev.event, dev.sync)
    return ClockMap.between(start, end), a, b, host_us


def test_device_events_land_on_the_host_axis_despite_offset_and_rate():
    dev = FakeDevice()
    cm, a, b, host_us = _run(dev)
    assert dev.syncs == 2  # each anchor is taken on an idle device
    assert cm.host_us(a) == pytest.approx(1000.0, abs=1e-3)
    assert cm.host_us(b) == pytest.approx(3000.0, abs=1e-3)
    assert cm.host_us(a) < host_us < cm.host_us(b)  # the host span sits between them
    assert cm.scale == pytest.approx(1 / dev.rate)
    naive = cm.start.event.elapsed_time(b) * 1e3  # device time alone drifts at the clock's rate
    assert naive - 3000.0 == pytest.approx(3.0, abs=1e-3)


def test_same_clock_maps_one_to_one_and_describes_itself():
    cm, a, b, _ = _run(FakeDevice(offset_s=0.0, rate=1.0, latency_s=0.0))
    assert cm.scale == pytest.approx(1.0)
    assert (cm.host_us(a), cm.host_us(b)) == (pytest.approx(1000.0), pytest.approx(3000.0))
    d = cm.describe()
    assert "anchor" in d["device_to_host"] and d["rate"] == pytest.approx(1.0)
