"""One time axis for host spans (``time.perf_counter``) and GPU spans (CUDA events).

CUDA events only measure time between events (``elapsed_time``, ms), on the device's clock; host
spans are perf_counter readings. A run brackets its work with two anchors, each a host timestamp
taken on an idle device (after a synchronize) followed at once by an event record: the event
then runs one launch latency after the timestamp, the same latency at both ends. Device times
are mapped onto the host axis through the two anchors (offset at the start, rate from the pair,
so a device clock running at a slightly different rate is corrected too); what is left is the
difference of the two launch latencies, well under a microsecond on an idle device.

Pure logic, so the mapping is tested on the CPU with a fake clock and fake events
(tests/test_real_clocks.py); the executor passes ``time.perf_counter``, ``torch.cuda.Event``
and ``torch.cuda.synchronize``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Anchor:
    """A host timestamp (s) and the event recorded right after it."""

    host_s: float
    event: Any


def anchor(clock: Callable[[], float], make_event: Callable[[], Any], sync: Callable[[], None]):
    """Synchronize (the device idle), read the host clock, record an event at once."""
    sync()
    h = clock()
    e = make_event()
    e.record()
    return Anchor(h, e)


@dataclass(frozen=True)
class ClockMap:
    """Device events -> µs on the host axis, zero at the start anchor's host timestamp."""

    start: Anchor
    scale: float  # host seconds per device second, from the two anchors

    @classmethod
    def between(cls, start: Anchor, end: Anchor) -> ClockMap:
        """The map of a run bracketed by ``start`` and ``end`` (the device synchronized after
        ``end``, so elapsed times can be read)."""
        dev_ms = start.event.elapsed_time(end.event)
        host_ms = (end.host_s - start.host_s) * 1e3
        scale = host_ms / dev_ms if dev_ms > 0 and host_ms > 0 else 1.0
        return cls(start, scale)

    def host_us(self, event) -> float:
        """Where ``event`` ran, in µs on the host axis (0 = the start anchor's timestamp)."""
        return self.start.event.elapsed_time(event) * 1e3 * self.scale

    def describe(self) -> dict:
        return {
            "axis": "host perf_counter, zero at the run's start anchor (µs)",
            "device_to_host": "CUDA event times mapped through two anchors (a host timestamp on "
            "an idle device, an event recorded right after it) at the start and end of the run",
            "rate": self.scale,
        }
