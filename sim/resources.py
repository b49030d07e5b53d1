"""The two shared resources stock SimPy cannot express: an SM pool whose kernels run at rates
re-set whenever concurrency changes, and links whose bandwidth is split among live flows.

Both are fluid models: a job holds a remaining amount of work and a rate; whenever a job starts or
ends, every job's progress is brought up to date, rates are recomputed, and one timer is set for
the next completion (stale timers are ignored through a generation counter). This keeps the
number of SimPy events at about one per job start and end.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import simpy

from overlap_lab.shared.hardware import GPU
from overlap_lab.shared.program import Op
from overlap_lab.sim import cost

_EPS = 1e-9
#: Time tolerance (µs): a job predicted to end within it of now has ended (float round-off).
_TIME_EPS = 1e-7


class Fluid:
    """Jobs sharing something, progressing at rates a subclass computes in ``_rates``."""

    def __init__(self, env: simpy.Environment):
        self.env = env
        self.jobs: list = []
        self._t = 0.0
        self._gen = 0

    def _rates(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._t
        for j in self.jobs:
            if j.rate > 0:
                j.left = 0.0 if now >= j.t_end - _TIME_EPS else max(0.0, j.left - j.rate * dt)
        self._t = now

    def changed(self) -> None:
        """Bring progress up to date, finish what is done, re-rate and set the next timer."""
        self._advance()
        while True:
            done = [j for j in self.jobs if j.left <= _EPS * j.total and j.ready]
            if not done:
                break
            for j in done:
                self.jobs.remove(j)
                self._finish(j)
        self._rates()
        self._gen += 1
        now = self.env.now
        for j in self.jobs:
            j.t_end = now + j.left / j.rate if j.rate > 0 else float("inf")  # rate inf: now
        nxt = min((j.t_end - now for j in self.jobs if j.rate > 0), default=None)
        if nxt is not None:
            gen = self._gen
            t = self.env.timeout(max(nxt, 0.0))
            t.callbacks.append(lambda _e, g=gen: g == self._gen and self.changed())

    def _finish(self, job) -> None:
        job.done.succeed()


@dataclass(eq=False)
class Flow:
    nbytes: float
    done: simpy.Event
    total: float = 0.0
    left: float = 0.0
    rate: float = 0.0
    t_end: float = float("inf")
    ready: bool = True


class Link(Fluid):
    """One rank's egress over one link kind: live flows split the bandwidth equally."""

    def __init__(self, env: simpy.Environment, bytes_per_us: float, latency_us: float):
        super().__init__(env)
        self.bw = bytes_per_us
        self.latency = latency_us

    def send(self, nbytes: float) -> simpy.Event:
        """Start a flow; the returned event fires when its last byte has arrived."""
        arrived = self.env.event()
        self._advance()
        self.jobs.append(Flow(nbytes, arrived, nbytes, nbytes))
        self.changed()
        return arrived

    def _rates(self) -> None:
        for j in self.jobs:
            j.rate = self.bw / len(self.jobs)

    def _finish(self, job: Flow) -> None:
        if self.latency > 0:
            t = self.env.timeout(self.latency)
            t.callbacks.append(lambda _e: job.done.succeed())
        else:
            job.done.succeed()


@dataclass(eq=False)
class Kernel:
    op: Op
    limit: int  # most SMs it may hold
    fixed: bool  # communication kernels hold exactly ``limit``
    done: simpy.Event
    waiting_data: bool = False  # a receive makes no progress until its data has arrived
    gated: bool = False  # a sendrecv works from its start but cannot finish before arrival
    sms: int = 0
    total: float = 1.0
    left: float = 1.0
    rate: float = 0.0
    t_end: float = float("inf")
    segments: list = field(default_factory=list)  # (start, sms) each time its grant changes

    _demand: tuple = (-1, None)  # (sms, KernelDemand) cache: demand changes only with the SMs

    @property
    def ready(self) -> bool:
        return not (self.waiting_data or self.gated)

    def demand(self, gpu: GPU, profile=None) -> cost.KernelDemand:
        if self._demand[0] != self.sms:
            self._demand = (self.sms, cost.demand(self.op, gpu, self.sms, profile))
        return self._demand[1]


class Gpu(Fluid):
    """The SMs and HBM of one GPU.

    Compute kernels take what is free up to their limit (at least one SM) and grow as SMs are
    released; communication kernels wait until their fixed count is free; requests are served in
    arrival order, and SMs the head request cannot use yet go to running compute kernels. A kernel's rate is 1/duration at its current SMs and HBM share (``sim.cost``).
    """

    def __init__(self, env: simpy.Environment, gpu: GPU, profile=None):
        super().__init__(env)
        self.gpu = gpu
        self.profile = profile  # sim.profile.Profile: measured durations (None: the roofline)
        self.free = gpu.num_sms
        self.waiting: deque[tuple[Kernel, simpy.Event]] = deque()
        self.holding: list[Kernel] = []  # granted and not finished (started or about to)
        self.on_segment = None  # callback(kernel, start, end, sms) set by the engine

    def acquire(self, k: Kernel) -> simpy.Event:
        """An event that fires once ``k`` holds its SMs (it then runs from that moment)."""
        granted = self.env.event()
        self.waiting.append((k, granted))
        self._grant()
        return granted

    def start(self, k: Kernel) -> None:
        self._advance()
        self.jobs.append(k)
        self.changed()

    def data_arrived(self, k: Kernel) -> None:
        self._advance()
        k.waiting_data = k.gated = False
        self.changed()

    def _grant(self) -> None:
        grew = False
        while self.waiting:
            k, ev = self.waiting[0]
            need = k.limit if k.fixed else min(1, k.limit)
            if self.free < need:
                break
            self.waiting.popleft()
            k.sms = k.limit if k.fixed else min(k.limit, self.free)
            self.free -= k.sms
            k.segments.append((self.env.now, k.sms))
            self.holding.append(k)
            ev.succeed()
        # SMs that no waiting request can use yet go to running kernels below their limit (a
        # kernel's remaining CTAs spread onto freed SMs), so no SM idles while work could use it
        if self.free > 0:
            for k in self.holding:
                if not k.fixed and k.sms < k.limit and self.free > 0:
                    self._advance()
                    extra = min(k.limit - k.sms, self.free)
                    k.sms += extra
                    self.free -= extra
                    k.segments.append((self.env.now, k.sms))
                    grew = True
        if grew:
            self.changed()

    def _finish(self, k: Kernel) -> None:
        self.free += k.sms
        self.holding.remove(k)
        k.done.succeed()
        self._grant_after = True

    def changed(self) -> None:
        self._grant_after = False
        super().changed()
        if self._grant_after:
            self._grant()

    def _rates(self) -> None:
        running = [k for k in self.jobs if not k.waiting_data and k.left > _EPS]
        for k in self.jobs:
            k.rate = 0.0
        if not running:
            return
        demands = [k.demand(self.gpu, self.profile) for k in running]
        if len(running) == 1:  # alone: the plain roofline (water-filling one demand is its cap)
            shares = [min(demands[0].cap, cost.hbm_bytes_per_us(self.gpu) * cost.HBM_USABLE)]
        else:
            shares = cost.hbm_shares(demands, self.gpu)
        for k, d, s in zip(running, demands, shares):
            dur = cost.duration_us(d, s)
            k.rate = 1.0 / dur if dur > 0 else float("inf")  # a pure wait ends at once
