"""The two shared resources stock SimPy cannot express: the SMs of a GPU, handed to kernels'
thread blocks as the hardware block scheduler does (``Gpu``; rules and sources in ``sim.cost``
and docs/sm-sharing.md), and links whose bandwidth is split among live flows.

Both are fluid models: a job holds a remaining amount of work and a rate; whenever a job starts or
ends, every job's progress is brought up to date, rates are recomputed, and one timer is set for
the next completion (stale timers are ignored through a generation counter; a timer still due at
the same instant is kept rather than replaced). Timers of every resource that fall on the same
instant share one SimPy event (``Timers``: ranks in lockstep end their kernels together), so a run
costs about one SimPy event per instant at which something ends, not one per job.

A finished job is reported through a plain callback once the resource is consistent again (after
its re-rate), not through a SimPy event: nothing else waits on it, and the callback runs at the
same instant an event would have.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter

import simpy

from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.ir.program import Op
from overlap_lab.sim import cost
from overlap_lab.sim.models import CostModel
from overlap_lab.sim.simpy_fast import InstantTimers

_EPS = 1e-9
#: Time tolerance (µs): a job predicted to end within it of now has ended (float round-off). At
#: large clocks (above ~1e8 µs) a few ulps of the end time are wider and take over (``_tol``).
_TIME_EPS = 1e-7
_INF = float("inf")
#: Below this clock (µs) 4 ulps are narrower than ``_TIME_EPS`` (4 * 2**-27 < 1e-7).
_ULP_FROM = 2.0**26


def _tol(t: float) -> float:
    """How close to ``t`` a clock counts as having reached it: ``_TIME_EPS``, or 4 ulps of ``t``
    where that is wider (a clock of 1e16 µs cannot represent ``t - 1e-7``)."""
    return _TIME_EPS if t < _ULP_FROM else max(_TIME_EPS, 4 * math.ulp(t))


class Timers(InstantTimers):
    """The timers of one environment (``sim.simpy_fast.InstantTimers``: one SimPy event per
    instant) and the block scheduler's passes due at the end of the current instant."""

    def __init__(self, env: simpy.Environment):
        super().__init__(env)
        #: GPUs waiting for their block scheduler's pass at the end of this instant (``Gpu``)
        self.passes: list | None = None
        #: True while ``sim.budget.run_budgeted`` drives the environment: it runs the passes
        #: itself once the instant's ordinary events are done, so they need no SimPy event
        self.inline_passes = False
        #: called once the current instant is over (``sim.simpy_fast.run_steps``; the
        #: fast-forward compares states there), then cleared
        self.at_end = None

    def request_pass(self, gpu: Gpu) -> None:
        """Queue ``gpu``'s pass for the end of this instant. The first request of an instant
        schedules one SimPy event at ``GRANT_PRIORITY`` for all of them, unless the run loop
        runs them itself (``inline_passes``)."""
        if self.passes is None:
            self.passes = []
            if not self.inline_passes:
                self.schedule_passes()
        self.passes.append(gpu)

    def schedule_passes(self) -> None:
        """The SimPy event that runs the pending passes after every ordinary event of now."""
        self.schedule(0, [lambda _e: self.run_passes()], GRANT_PRIORITY)

    def run_passes(self) -> None:
        """The block scheduler's passes of this instant, GPU by GPU in creation order."""
        due, self.passes = self.passes, None
        if due is None:  # already run by ``sim.budget.run_budgeted``
            return
        if len(due) > 1:
            due.sort(key=_ORDER)
        for gpu in due:
            gpu._grant()


def timers(env: simpy.Environment) -> Timers:
    """The ``Timers`` of ``env`` (one per environment, shared by all its resources), kept on the
    environment itself: a weak-keyed table would keep every environment alive through its value."""
    t = getattr(env, "_overlap_lab_timers", None)
    if t is None:
        t = env._overlap_lab_timers = Timers(env)
    return t


def _call(fn: Callable, *args) -> None:
    """A timer's callback that drops the SimPy event (``partial(_call, fn, ...)``: no lambda)."""
    fn(*args[:-1])


class Fluid:
    """Jobs sharing something, progressing at rates a subclass computes in ``_rates``."""

    def __init__(self, env: simpy.Environment):
        self.env = env
        self.jobs: list = []
        #: the clock progress is up to date to: the time ``_advance`` last ran, so now wherever
        #: code runs after it at the same instant (``_settle``, a pass, ``_finish``), where it
        #: is read instead of the clock (``env.now`` is a property call; these run per event)
        self._t = 0.0
        self._gen = 0
        self._timers = timers(env)
        self._armed: float | None = None  # when the pending timer fires (None: none pending)
        self._due: list = []  # the jobs that end at the pending timer
        self._after: list = []  # callbacks of jobs finished, run once the re-rate is done

    def _rates(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._t
        for j in self.jobs:
            if j.rate > 0:
                floor = j.floor
                if now >= j.t_snap:
                    j.left = floor
                else:  # ``max(floor, left)`` without its call: floor unless left is above it
                    left = j.left - j.rate * dt
                    j.left = left if left > floor else floor
        self._t = now

    def changed(self) -> None:
        """Bring progress up to date, finish what is done, re-rate and set the next timer; then
        report the finished jobs (their callbacks may start new work on this resource)."""
        self._advance()
        self._settle()

    def _settle(self) -> None:
        """``changed`` once progress is up to date at this instant. Callers that have just run
        ``_advance`` and since only added jobs at rate 0, brought due jobs to their floor or
        changed readiness call this directly: a second ``_advance`` at the same clock would leave
        every job as it is (``dt`` is 0 and each job is already at or above its floor)."""
        jobs = self.jobs
        eps = _EPS
        if len(jobs) == 1:  # most changes leave one job: the loops below, unrolled for it
            j = jobs[0]
            if j.left <= eps * j.total and j.ready:
                jobs.pop()
                self._finish(j)
        elif jobs:
            for j in jobs:  # (a loop, not a comprehension: most often nothing is done)
                if j.left <= eps * j.total and j.ready:
                    done = [j for j in jobs if j.left <= eps * j.total and j.ready]
                    while done:
                        for j in done:
                            jobs.remove(j)
                            self._finish(j)
                        done = [j for j in jobs if j.left <= eps * j.total and j.ready]
                    break
        now = self._t
        first = _INF
        if len(jobs) == 1:
            self._rates()
            j = jobs[0]
            rate = j.rate
            if rate > 0:
                t = j.t_end = now + (j.left - j.floor) / rate
                j.t_snap = t - (_TIME_EPS if t < _ULP_FROM else _tol(t))
                first = t
                due = jobs[:]  # its t_end is ``first``: within ``last`` below
            else:
                j.t_end = j.t_snap = _INF
        elif jobs:  # (none: no rates, no timer)
            self._rates()
            for j in jobs:
                # rate inf: now; a job stops at its floor (a kernel waiting on a signal)
                rate = j.rate
                if rate > 0:
                    t = j.t_end = now + (j.left - j.floor) / rate
                    j.t_snap = t - (_TIME_EPS if t < _ULP_FROM else _tol(t))
                    if t < first:
                        first = t
                else:
                    j.t_end = j.t_snap = _INF
            if first < _INF:
                last = first + (_TIME_EPS if first < _ULP_FROM else _tol(first))
                due = [j for j in jobs if j.t_end <= last]
        if first < _INF:
            self._due = due
            delay = first - now
            if 0.0 > delay:  # ``max(first - now, 0.0)`` without its call
                delay = 0.0
            when = now + delay  # the instant SimPy will compute for it
            if when != self._armed:  # else the pending timer, due then, serves
                self._armed = when
                self._gen += 1
                self._timers.call_later(delay, partial(self._fire, self._gen))
        elif self._armed is not None:
            self._armed, self._due = None, []
            self._gen += 1
        after = self._after
        if after:
            self._after = []
            for fn in after:
                fn()

    def _fire(self, gen: int, _ev=None) -> None:
        """The timer: the jobs due at it end now, whatever float round-off left of their work."""
        if gen != self._gen:
            return
        self._armed = None
        self._advance()
        for j in self._due:
            j.left = j.floor
        self._settle()

    def _finish(self, job) -> None:
        self._after.append(job.on_done)


@dataclass(eq=False, slots=True)
class Flow:
    nbytes: float
    on_done: Callable[[], None]
    total: float = 0.0
    left: float = 0.0
    rate: float = 0.0
    t_end: float = _INF
    t_snap: float = _INF  # from this clock on the flow has ended (``_tol`` before ``t_end``)
    ready: bool = True
    floor: float = 0.0


class Link(Fluid):
    """One rank's egress over one link kind: live flows split the bandwidth equally."""

    def __init__(self, env: simpy.Environment, bytes_per_us: float, latency_us: float):
        super().__init__(env)
        self.bw = bytes_per_us
        self.latency = latency_us

    def send(self, nbytes: float, on_arrived: Callable[[], None]) -> None:
        """Start a flow; ``on_arrived()`` is called when its last byte has arrived."""
        self._advance()
        self.jobs.append(Flow(nbytes, on_arrived, nbytes, nbytes))
        self._settle()

    def _rates(self) -> None:
        rate = self.bw / len(self.jobs)  # the float each flow's own division gave
        for j in self.jobs:
            j.rate = rate

    def _finish(self, job: Flow) -> None:
        if self.latency > 0:
            self._timers.call_later(self.latency, partial(_call, job.on_done))
        else:
            self._after.append(job.on_done)


_GPU_ORDER = itertools.count()
_ORDER = attrgetter("order")

#: Precedence among pending CTAs: stream priority (lower first), then the time the kernel reached
#: the GPU (its stream's turn came: first come, first served), then launch order (``Kernel.key``).
_precedence = attrgetter("prio", "ready", "seq")

#: SimPy priority of the block scheduler's pass: after every ordinary event of the same instant
#: (SimPy's URGENT is 0, NORMAL 1), so all kernels that become ready at one instant compete by the
#: rule (stream priority, then launch order), never by the order SimPy processes their events.
#: ``sim.budget.run_budgeted`` keeps the rule without the event: it runs the instant's passes when
#: the next queued event is later (or of a lower priority), exactly when this event would run.
GRANT_PRIORITY = 2


@dataclass(eq=False, slots=True)
class Kernel:
    """One launched kernel: its grid, its precedence and the CTAs not dispatched yet."""

    op: Op
    limit: int  # most SMs it may hold (Op.sms, or the GPU)
    stream: str = ""  # the stream that launched it (for the engine's ``on_grant``/``on_done``)
    prio: int = 0  # CUDA stream priority (lower is higher)
    seq: int = 0  # launch (issue) order on its rank
    ready: float = 0.0  # when it reached the block scheduler (``Gpu.acquire``)
    waiting_data: bool = False  # a receive makes no progress until its data has arrived
    gated: bool = False  # a sendrecv works from its start but cannot finish before arrival
    grid: cost.Grid | None = None
    pending: int = 0  # CTAs not dispatched yet
    held: int = 0  # SMs held by its running cohorts
    reserved: int = 0  # SMs held idle by CTAs of a coresident kernel not yet all resident
    cohorts: int = 0  # cohorts running or staged
    started: bool = False  # the engine has started it (collective flags set)
    staged: list = field(default_factory=list)  # cohorts dispatched before ``start``
    fired: int = 0  # how many of ``op.waits`` have fired
    t0: float = 0.0  # when it got its first SMs
    segments: list = field(default_factory=list)  # (start, sms) each time its SMs change
    ckey: int = -1  # the number ``CostCache.numbers`` gives its cost key (what the model reads)

    @property
    def key(self) -> tuple[int, float, int]:
        """Precedence among pending CTAs: stream priority, then the time the kernel reached the
        block scheduler, then launch order. A kernel queued behind others on its stream reaches
        the GPU only when its predecessor ends, so a kernel issued earlier on the host does not
        jump ahead of one of another stream already waiting there (docs/sm-sharing.md)."""
        return (self.prio, self.ready, self.seq)


@dataclass(eq=False, slots=True)
class Cohort:
    """CTAs of one kernel dispatched together onto ``sms`` SMs: ``waves`` uniform waves of
    ``per_wave`` CTAs (one wave for a persistent or coresident kernel). Progress is counted in
    waves, so a run of uniform waves costs one event, not one per wave."""

    kernel: Kernel
    sms: int
    per_wave: int
    waves: int
    total: float = 1.0
    left: float = 1.0
    rate: float = 0.0
    t_end: float = _INF
    t_snap: float = _INF  # from this clock on the cohort has ended (``_tol`` before ``t_end``)
    floor: float = 0.0  # work it may not go below yet: parts whose signals have not fired

    @property
    def ready(self) -> bool:
        k = self.kernel
        return not (k.waiting_data or k.gated)

    def set_floor(self) -> None:
        n = len(self.kernel.op.waits)
        self.floor = self.total * (n - self.kernel.fired) / n if n else 0.0


def _rate(dur: float) -> float:
    """A cohort's rate (waves per µs) from its duration; a pure wait (0 µs) ends at once."""
    return 1.0 / dur if dur > 0 else _INF


@dataclass(eq=False, slots=True)
class CostCache:
    """The cost model's answers in one run, shared by every rank's ``Gpu`` (explicit ranks
    launch the same kernel once per rank; layers repeat): each distinct question is asked once.
    ``grids`` and ``demands`` are keyed by the small number ``numbers`` gives a cost key, so a
    lookup hashes two ints, not the whole key again."""

    numbers: dict[Hashable, int] = field(default_factory=dict)  # ``CostModel.key(op)`` -> number
    grids: dict[tuple[int, int], cost.Grid] = field(default_factory=dict)  # (number, limit)
    demands: dict[tuple[int, int], cost.KernelDemand] = field(default_factory=dict)  # (n, SMs)


class Gpu(Fluid):
    """The SMs and HBM of one GPU, shared among kernels as the hardware block scheduler does.

    Kernels are grids of CTAs (``sim.cost.grid``). At the end of every instant at which SMs were
    freed or kernels launched, free SMs go to pending CTAs by (stream priority, the time the kernel
    reached the GPU, launch order):
    a waved or persistent kernel takes what is free up to its limit; a coresident kernel starts
    once all its CTAs fit, and until then keeps the free SMs from kernels behind it (the
    reservation is re-made at every pass, so it always belongs to the first coresident kernel in
    precedence order and two such kernels never wait on each other). Dispatched CTAs form a
    cohort that runs whole waves; a cohort of several waves is cut back to its current wave when
    a kernel that precedes it is pending, or when SMs are free that its own later waves could use,
    so SMs change hands exactly at wave boundaries. A cohort's rate is set by ``sim.cost`` at its
    SMs and HBM share: one wave of ``n`` of the kernel's ``C`` CTAs takes ``n / C`` of the whole
    kernel's duration on those SMs, which makes duration follow ``ceil(C / slots)``.
    """

    def __init__(
        self,
        env: simpy.Environment,
        gpu: GPU,
        model: CostModel | None = None,
        on_grant: Callable[[Kernel], None] = lambda k: None,
        on_done: Callable[[Kernel], None] = lambda k: None,
        cache: CostCache | None = None,
    ):
        """``on_grant(k)``: ``k`` holds its first SMs (the engine starts it); ``on_done(k)``: it
        has ended. ``model``: what kernels cost (default: ``cost.RooflineCostModel()``, the
        roofline alone); ``cache``: its answers, which GPUs of the same model may share."""
        super().__init__(env)
        self.gpu = gpu
        self.model = cost.RooflineCostModel() if model is None else model
        self.on_grant, self.on_done = on_grant, on_done
        self.cache = CostCache() if cache is None else cache
        self._key = self.model.key  # (bound once: it runs per launch)
        self.free = gpu.num_sms
        self._hbm_usable = self.model.hbm_bytes_per_us(gpu)  # what kernels may pull together
        self.pending: list[Kernel] = []
        self._grant_due = False
        self.order = next(_GPU_ORDER)  # creation order: the order of passes within an instant
        self._touched: set = set()  # kernels whose SMs changed this instant (for segments)
        self._jobs_changed = False  # a grant pass changed running cohorts: re-rate
        self._unstarted: set = set()  # kernels granted but not yet started by the engine
        self._granted: list = []  # kernels given their first SMs in this pass
        self._granting_now = False
        self._reshaped = False  # this pass cut or grew a cohort (``_grant``)
        self._solo: dict[tuple, float] = {}  # a cohort's rate alone, by what it reads (``_rates``)
        self._solo_t: dict[tuple[int, int], float] = {}  # a kernel's time alone (``solo_us``)

    # -- the engine's interface ------------------------------------------------------------------

    def acquire(self, k: Kernel) -> None:
        """Queue ``k``'s CTAs; ``on_grant(k)`` is called once it holds its first SMs (it runs
        from that moment)."""
        op, cache = k.op, self.cache
        k.ready = self.env._now  # (the clock without the property call: this runs per launch)
        numbers = cache.numbers
        k.ckey = ck = numbers.setdefault(self._key(op), len(numbers))
        gk = (ck, k.limit)
        g = cache.grids.get(gk)
        if g is None:
            g = cache.grids[gk] = self.model.grid(op, k.limit)
        k.grid = g
        if g.ctas == 0:  # a hook: holds no SMs, needs none, so no rule orders it
            k.cohorts = 1
            k.staged.append(Cohort(k, 0, 0, 1))
            k.segments.append((self.env.now, 0))
            k.t0 = self.env.now
            self.on_grant(k)
            return
        k.pending = g.ctas
        self.pending.append(k)
        if not self._grant_due:  # ``_request_grant``, inline (once per launch)
            self._grant_due = True
            self._timers.request_pass(self)

    def start(self, k: Kernel) -> None:
        """Run the cohorts dispatched to ``k`` before the engine started it."""
        if not self._granting_now:
            self._advance()
        k.started = True
        self._unstarted.discard(k)
        if k.op.waits:
            for c in k.staged:
                c.set_floor()
        self.jobs.extend(k.staged)
        k.staged = []
        if self._granting_now:
            self._jobs_changed = True  # re-rated once at the end of the pass
        else:
            self._settle()

    def signal(self, k: Kernel) -> None:
        """One of the events ``k`` consumes while running has fired."""
        self._advance()
        k.fired += 1
        for c in self.jobs:
            if c.kernel is k:
                c.set_floor()
        self.changed()

    def data_arrived(self, k: Kernel) -> None:
        """``k``'s data has arrived. Inside a pass (the engine starting a granted kernel sends
        flows that can arrive at once) the pass re-rates at its end."""
        k.waiting_data = k.gated = False
        if self._granting_now:
            self._jobs_changed = True
            return
        self._advance()
        self._settle()

    # -- the block scheduler ---------------------------------------------------------------------

    def _request_grant(self) -> None:
        """Ask for a pass at the end of this instant. One SimPy event serves every GPU of the
        simulation that asks in the same instant (ranks acting in lockstep), in creation order."""
        if not self._grant_due:
            self._grant_due = True
            self._timers.request_pass(self)

    def _grant(self, _ev=None) -> None:
        self._grant_due = False
        if not (self.pending or self._touched or any(c.waves > 1 for c in self.jobs)):
            return  # SMs were freed and no CTAs wait for them: nothing changes hands
        self._advance()
        self._jobs_changed = self._reshaped = False
        # cut first where SMs are free and a kernel waits that a multi-wave cohort's kernel
        # precedes: its later waves are CTAs still pending in the hardware, and they take the
        # free SMs before that kernel (else the later kernel took them, as if it came first)
        if self.free and self.pending and (self._unstarted or any(c.waves > 1 for c in self.jobs)):
            self._cut_cohorts(ahead=True)
        while True:
            self._dispatch()
            if not self._cut():
                break
        now = self._t
        touched = self._touched
        for k in touched:  # each kernel's segments are its own: any order
            segs = k.segments
            if not (k.cohorts or segs):
                continue  # never ran yet (a coresident kernel gathering its SMs)
            if segs and segs[-1][0] == now:  # changed again within this instant
                segs.pop()
            if not segs or segs[-1][1] != k.held:
                segs.append((now, k.held))
        touched.clear()
        granted = self._granted
        if granted:  # start them in precedence order, re-rating once
            self._granted = []
            if len(granted) > 1:
                granted.sort(key=_precedence)  # stable, as sorted() was
            self._granting_now = True
            try:
                on_grant = self.on_grant
                for k in granted:
                    on_grant(k)
            finally:
                self._granting_now = False
        if self._jobs_changed:
            # progress is up to date from the ``_advance`` above unless a cohort was cut or grew
            # (its work left was rewritten): a second ``_advance`` at this clock would then
            # reapply the floors and snaps, as ``changed`` always did; else it would leave every
            # job as it is, and ``_settle`` is all that is left to do
            if self._reshaped:
                self.changed()
            else:
                self._settle()

    def _dispatch(self) -> None:
        # reservations are re-made every pass, so they always belong to the first coresident
        # kernel in precedence order (two half-resident kernels never wait on each other)
        pending = self.pending
        if not pending:
            return
        for k in pending:
            if k.reserved:
                self.free += k.reserved
                k.reserved = 0
        if len(pending) > 1:
            pending.sort(key=_precedence)
        for k in list(pending):
            if self.free == 0:
                break
            g = k.grid
            if g.kind == "coresident":
                need = g.sms_needed
                take = min(need - k.reserved, self.free)
                k.reserved += take
                self.free -= take
                if k.reserved == need:
                    self.free += k.reserved  # the reservation becomes the cohort's SMs
                    k.reserved = 0
                    self._cohort(k, need, k.pending, 1)
                continue
            take = min(k.limit - k.held, math.ceil(k.pending / g.per_sm), self.free)
            if take <= 0:
                continue
            if g.kind == "dynamic":
                if not (k.cohorts and self._grow(k, take)):
                    self._dynamic_cohort(k, take)
                continue
            slots = take * g.per_sm
            if k.pending >= slots:
                self._cohort(k, take, slots, self._share(k, take, k.pending // slots))
            else:
                self._cohort(k, take, k.pending, 1)

    def _dynamic_cohort(self, k: Kernel, sms: int) -> None:
        """A dynamic persistent kernel's first CTAs (FlashAttention-3's
        ``DynamicPersistentTileScheduler``: CTAs take tiles from an atomic counter): the cohort
        owns the kernel's whole work, whatever CTAs are resident, so on the SMs it got it runs
        the work over those SMs. The CTAs that found no SM stay pending with no work of their
        own: they join the cohort if SMs free up before the tiles run out (``_grow``) and are
        dropped when it ends (``_finish``), rather than running as a second wave."""
        n = min(k.pending, sms * k.grid.per_sm)
        work = k.pending  # every CTA's share: the tiles all of them would have taken
        self._cohort(k, sms, work, 1)
        k.pending = work - n
        if k.pending and k not in self.pending:
            self.pending.append(k)

    def _share(self, k: Kernel, take: int, waves: int) -> int:
        """How many of ``waves`` whole waves a new cohort of ``k`` on ``take`` SMs runs: all of
        them when ``k`` holds no SMs yet, else as many as each of its SMs has left when the CTAs
        still to run are spread over all of them (the hardware hands a CTA to whichever of the
        kernel's SMs frees first, so they all run out together). Giving every pending CTA to the
        first SMs to come free made the next boundary cut them back and hand them over again:
        one event per wave, without bound in the CTA count."""
        if not k.held:
            return waves
        running = sum(c.left * c.per_wave for c in self.jobs if c.kernel is k)
        running += sum(c.left * c.per_wave for c in k.staged)
        each = (running + k.pending) / ((k.held + take) * k.grid.per_sm)
        return max(1, min(waves, int(each + 1e-9)))

    def _grow(self, k: Kernel, sms: int) -> bool:
        """A dynamic persistent kernel's late CTAs join its cohort (running, or dispatched but
        not yet started) and share the work left: the cohort's rate follows its SMs, and its work
        is the kernel's (``_dynamic_cohort``), so it ends when all of them run out of tiles.
        False if it has none."""
        c = next((c for c in self.jobs if c.kernel is k), None)
        if c is None:
            c = next(iter(k.staged), None)
        if c is None:
            return False
        n = min(k.pending, sms * k.grid.per_sm)
        c.sms += sms
        k.pending -= n
        k.held += sms
        self.free -= sms
        if k.pending == 0:
            self.pending.remove(k)
        self._touched.add(k)
        self._jobs_changed = self._reshaped = True
        return True

    def _cohort(self, k: Kernel, sms: int, per_wave: int, waves: int) -> None:
        c = Cohort(k, sms, per_wave, waves, float(waves), float(waves))
        if k.op.waits:
            c.set_floor()
        k.pending -= per_wave * waves
        k.held += sms
        k.cohorts += 1
        self.free -= sms
        if k.pending == 0:
            self.pending.remove(k)
        self._touched.add(k)
        if k.started:
            self.jobs.append(c)
            self._jobs_changed = True
        else:
            k.staged.append(c)
            if k not in self._unstarted:
                self._unstarted.add(k)
                self._granted.append(k)
                k.t0 = self._t

    def _cut(self) -> bool:
        """Cut multi-wave cohorts back to their current wave where SMs must change hands at the
        next wave boundary; True if any was cut (their CTAs are pending again)."""
        return self._cut_cohorts(ahead=False)

    def _cut_cohorts(self, ahead: bool) -> bool:
        """``_cut``; ``ahead``: before a dispatch, only cohorts of kernels that precede every
        pending kernel and could use the free SMs (cutting the others would only split them into
        more cohorts)."""
        if self.free == 0 and not self.pending:
            return False
        multi = [c for c in self.jobs if c.waves > 1]
        multi += [c for k in self._unstarted for c in k.staged if c.waves > 1]
        if not multi:
            return False
        first = min(
            (k.key for k in self.pending if k.grid.kind == "coresident" or k.held < k.limit),
            default=None,
        )
        cut = False
        for c in sorted(multi, key=lambda c: c.kernel.key):
            k = c.kernel
            done = c.waves - c.left
            boundary = max(1, math.ceil(done - 1e-9))
            if boundary >= c.waves:
                continue
            # (its own pending CTAs take free SMs first, spread by ``_share``: cutting it too
            # would hand the same CTAs back and forth at every boundary)
            wants_more = self.free > 0 and k.held < k.limit and not k.pending
            if ahead:
                # (``<=``: its own pending CTAs, the rest of its grid, do not come after it)
                if not (wants_more and first is not None and k.key <= first):
                    continue
            elif not (wants_more or (first is not None and first < k.key)):
                continue
            back = (c.waves - boundary) * c.per_wave
            c.waves, c.total = boundary, float(boundary)
            c.left = max(0.0, boundary - done)
            c.set_floor()
            k.pending += back
            if k not in self.pending:
                self.pending.append(k)
            cut = self._jobs_changed = self._reshaped = True
        return cut

    def _finish(self, c: Cohort) -> None:
        k = c.kernel
        self.free += c.sms
        k.held -= c.sms
        k.cohorts -= 1
        if k.pending and k.grid.kind == "dynamic":  # the tiles ran out before they got SMs
            k.pending = 0
            self.pending.remove(k)
        if k.pending == 0 and k.cohorts == 0:
            # the launch-to-finish floor is the kernel's, however its CTAs were dispatched, and
            # so is its time alone: sharing never makes a kernel faster (``solo_us``)
            rest = k.t0 + self.solo_us(k) - self._t if k.op.flops or k.op.hbm_bytes else 0
            if rest > _TIME_EPS:  # its SMs are free; it is drawn with none until it ends
                segs, now = k.segments, self._t
                if segs and segs[-1][0] == now:
                    segs.pop()
                segs.append((now, 0))
                self._timers.call_later(rest, partial(_call, self.on_done, k))
            else:
                self._after.append(partial(self.on_done, k))
        else:
            self._touched.add(k)
        # freed SMs matter only to CTAs waiting now (a kernel launched later in this instant
        # asks for its own pass) and to running cohorts that could grow
        if (
            c.sms
            and not self._grant_due
            and (self.pending or self._touched or any(j.waves > 1 for j in self.jobs))
        ):
            self._grant_due = True  # ``_request_grant``, inline
            self._timers.request_pass(self)

    def solo_us(self, k: Kernel) -> float:
        """``k``'s duration alone on this GPU from its first SMs (``cost.solo_duration_us``,
        through this GPU's cost model), at least the launch-to-finish floor.

        The fluid model splits a kernel's CTAs into cohorts wherever SMs change hands, and a
        cohort's rate follows the SMs it holds; beside a competitor the last, partial wave can
        then land on more SMs than alone (a memory-bound kernel's tail wave on few SMs pulls
        less HBM), which made a kernel end slightly earlier beside another kernel than alone.
        No mechanism of the hardware makes it faster, so its end is held to this floor."""
        key = (k.ckey, k.limit)
        t = self._solo_t.get(key)
        if t is None:
            g, usable = k.grid, self._hbm_usable

            def whole(n: int) -> float:
                d = self._demand_on(k, n)
                return cost.duration_us(d, min(d.cap, usable))

            t = 0.0
            if g.ctas:
                s = k.limit
                slots = s * g.per_sm
                if g.kind == "coresident":  # one wave, every CTA resident
                    t = whole(g.sms_needed)
                else:  # whole waves, then a last partial wave on the SMs its CTAs need
                    waves, rest = divmod(g.ctas, slots)
                    t = waves * slots / g.ctas * whole(s) if waves else 0.0
                    if rest:
                        t += rest / g.ctas * whole(math.ceil(rest / g.per_sm))
            t = self._solo_t[key] = max(t, self.gpu.kernel_min_us)
        return t

    def solo_rate(self, k: Kernel, sms: int, per_wave: int) -> float:
        """The rate (waves per µs) of a cohort of ``k`` alone on the GPU: ``per_wave`` CTAs on
        ``sms`` SMs. What it reads (the kernel's cost, whose key's number names its grid too, its
        SMs and its wave's CTAs) gives the same float each time, so it is kept."""
        solo = (k.ckey, sms, per_wave)
        rate = self._solo.get(solo)
        if rate is None:
            d = self._demand_on(k, sms)
            dur = cost.duration_us(d, min(d.cap, self._hbm_usable))
            dur *= per_wave / k.grid.ctas if k.grid.ctas else 1.0
            rate = self._solo[solo] = 1.0 / dur if dur > 0 else _INF  # a pure wait: at once
        return rate

    def _demand_on(self, k: Kernel, sms: int):
        """The model's demand of ``k`` on ``sms`` SMs, through the shared cache."""
        key = (k.ckey, sms or 1)
        demands = self.cache.demands
        d = demands.get(key)
        if d is None:
            d = demands[key] = self.model.demand(k.op, self.gpu, sms or 1)
        return d

    def _rates(self) -> None:
        eps, running = _EPS, []
        for c in self.jobs:
            c.rate = 0.0
            if not c.kernel.waiting_data and c.left > c.floor + eps * c.total:
                running.append(c)
        if not running:
            return
        if len(running) == 1:  # alone: the plain roofline (water-filling one demand is its cap)
            c = running[0]
            k = c.kernel
            rate = self._solo.get((k.ckey, c.sms, c.per_wave))
            c.rate = self.solo_rate(k, c.sms, c.per_wave) if rate is None else rate
            return
        groups: dict[Kernel, list[Cohort]] = {}  # a kernel's running cohorts, in job order
        for c in running:
            groups.setdefault(c.kernel, []).append(c)
        kernels = list(groups)
        demands = [self._demand_on(k, sum(c.sms for c in groups[k])) for k in kernels]
        shares = cost.water_fill([d.cap for d in demands], self._hbm_usable)
        if any(d.headroom for d in demands):  # DeepEP's copies beside the others' HBM load
            demands = cost.loaded_demands(demands, shares, kernels, self._hbm_usable)
        for k, d, s in zip(kernels, demands, shares):
            cohorts, ctas = groups[k], k.grid.ctas
            if len(cohorts) == 1:
                c = cohorts[0]
                c.rate = _rate(cost.duration_us(d, s) * (c.per_wave / ctas if ctas else 1.0))
                continue
            # one kernel on several cohorts pulls its HBM as one: every CTA runs at the pace of
            # the whole kernel on all their SMs (a straggler cohort on one SM used to get that
            # SM's own cap, ~3x its even share, and the kernel ran faster beside a competitor)
            n = sum(c.sms for c in cohorts)
            dur = cost.duration_us(d, s)
            for c in cohorts:
                c.rate = _rate(dur * n * c.per_wave / (max(c.sms, 1) * ctas))
