"""Fast-forward over identical layers: exact, from the simulation's own state.

A model's layers are the same work with another layer index, so a Program's issue order is, past
its first layers and before its last, one block of instructions repeated with the layer numbers
shifted (``sim.repeats``). The simulation is
deterministic and invariant under a shift of time and a consistent renaming of events, so once
its whole state at the start of one block equals its state at the start of an earlier block,
shifted by a period ``P`` in time and by the blocks between them in layers, every later block
repeats those blocks' spans shifted again: the state is what the future depends on, and the
future input is the same shifted. The engine then need not simulate them.

What "the whole state" is, at the end of the instant at which the block's first launch left
its stream's queue (a *cut*; ``snapshot``): per rank, where the host and every stream are in the
issue order (relative to the block), what each stream waits on, the host's open launch span and
what it blocks on, every fired event and completed collective that an instruction not yet taken
still reads, events waited on before they fired, every kernel in the block scheduler (its grid,
CTAs pending and held, precedence, segments, signals) with every cohort's work left, rate and
timer, every flow on a rank's links, the collectives whose flows have partly arrived and the
kernels waiting for them, and every timer in SimPy's queue (stale ones are no-ops and left out).
Times are taken relative to the cut; names and positions relative to the block. Anything the
comparison cannot express (a flow in the network, a kernel of the first or last layers still
running, an unknown callback) makes the cut not comparable, and the run goes on in full. Float
parts of two states are equal when within round-off (``TIME_TOL`` of the clock, ``VALUE_TOL``
relative): the same state reached at another clock differs in its last bits.

When cut ``c`` equals cut ``c - q``, the ``m`` (a multiple of ``q``) blocks just before the
region's end are not simulated: the instructions of those blocks are taken out of the streams'
queues and the host's steps, the instructions after the region are renamed ``m`` blocks back,
and the run goes on from cut ``c``. That run is the full run's from cut ``c + m`` shifted back by
``m`` blocks (its input is the full run's remaining input shifted back, its state the full run's
at ``c + m`` shifted back, by induction over the repeated blocks). The spans the skipped blocks
make are those between cuts ``c - q`` and ``c`` shifted by ``P`` (and ``q`` blocks of layers)
once per ``q`` blocks; every span ended after the cut is shifted by the ``m`` blocks. The Trace
holds every span as if simulated. ``Engine(fast_forward=False)`` simulates every layer;
``tests/test_fast_forward.py`` checks the two agree for every schedule.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from functools import partial
from operator import itemgetter

import numpy as np
import simpy

from overlap_lab.shared.ir.program import Launch, Record, Wait
from overlap_lab.sim import network as _network
from overlap_lab.sim import resources as _resources
from overlap_lab.sim.host_plan import LAUNCH
from overlap_lab.sim.repeats import (
    MIN_BLOCKS,
    RankIndex,
    Region,
    atoms_of,
    index_rank,
    shift_instr,
    shift_name,
)

#: Times (relative to the cut) of two states agree within this fraction of the clock, plus
#: ``TIME_ABS``: the same instant reached at another clock differs in its last bits.
TIME_TOL = 1e-13
TIME_ABS = 1e-12
#: Work left, rates and sizes of two states agree within this relative difference.
VALUE_TOL = 1e-9
_RESUME = simpy.events.Process._resume  # a host process's resumption (its timeout's callback)
_FIRST = itemgetter(0)
_POS = itemgetter(3)  # a host step's position (``sim.host_plan``)


class _NotComparable(Exception):
    """The state holds something the comparison cannot express: this cut is skipped."""


class FastForward:
    """Watches one simulation's cuts and skips repeated blocks once the state repeats.

    The ranks' runs of repeated blocks are taken in order (the ``i``-th run of every rank at
    once, e.g. one per scheduler iteration); block starts of the first rank are the cuts."""

    def __init__(self, engine, index: dict[int, RankIndex]):
        self.engine = engine
        self.index = index
        self.first = min(index)
        self.n_runs = len(index[self.first].regions)
        self.run = -1  # which run of repeated blocks the cuts are in
        self.timers = _resources.timers(engine.env)
        self.table: dict = {}  # discrete state -> [(cut, clock, times, values, spans)]
        self.cut_at = -1  # the block whose cut is due at the end of this instant
        self.alive: dict = {rank: {} for rank in index}  # event -> last position reading it
        self.alive_keys: dict = {}  # (collective key, dst) -> last position receiving it
        #: renamed event or collective -> its name in the Program (``rename``)
        self.original: dict[str, str] = {}
        #: spans from index ``i`` on are shifted by (µs, layers): [(i, µs, layers), ...]
        self.segments: list[tuple[int, float, int]] = [(0, 0.0, 0)]
        #: (spans between the two cuts, their shift, period µs, layers per period, periods)
        self.copies: list[tuple] = []
        self.skips: list[tuple[int, str]] = []  # layers each skip left out, and how: ``note``
        self.reason = "no state repeated"
        self._res_id = {}
        for rank, r in engine.ranks.items():
            self._res_id[id(r.gpu)] = ("gpu", rank)
            for kind, link in r.links.items():
                self._res_id[id(link)] = ("link", rank, kind)
            r.log = []
        engine._arrived_log = []
        self._next_run()

    @classmethod
    def attach(cls, engine) -> FastForward | str:
        """The fast-forward of ``engine``'s Program, or why it has none."""
        if not isinstance(engine.net, _network.Network) and any(
            f.dst is not None
            for rp in engine.program.ranks
            for ins in atoms_of(rp)
            if type(ins) is Launch and ins.op.coll is not None
            for f in ins.op.coll.flows
        ):
            return "a plugged network model carries flows"
        index = {}
        for rank, r in engine.ranks.items():  # (every rank must repeat: stop at one that does not)
            ix = index[rank] = index_rank(r.plan, r.rp.streams)
            if not ix.regions:
                return f"rank {rank}: no {MIN_BLOCKS} repeated layers"
        if len({len(ix.regions) for ix in index.values()}) > 1:
            return "ranks repeat differently"
        if len({reg.d for ix in index.values() for reg in ix.regions}) > 1:
            return "runs repeat at different layer steps"
        return cls(engine, index)

    def _region(self, rank: int) -> Region:
        return self.index[rank].regions[self.run]

    def _next_run(self) -> None:
        """Watch the next run of repeated blocks (its first block's cut), if any."""
        self.run += 1
        self.table.clear()
        r0 = self.engine.ranks[self.first]
        r0.anchor = self._region(self.first).anchor if self.run < self.n_runs else -1
        if self.run >= self.n_runs:
            for r in self.engine.ranks.values():
                r.log = None
            self.engine._arrived_log = None

    # -- cuts ------------------------------------------------------------------------------------

    def cut(self, r) -> None:
        """The first rank took a block's first launch from its queue: compare states once this
        instant is over."""
        reg = self._region(self.first)
        j = (r.anchor - reg.anchor) // reg.p
        self.cut_at = j
        if j + 1 < reg.k:
            r.anchor = reg.anchor + (j + 1) * reg.p
        else:
            self._next_run()
            self.cut_at = -1  # the last block: nothing after it to skip
            return
        self.timers.at_end = self._at_cut

    def _at_cut(self) -> None:
        j, self.cut_at = self.cut_at, -1
        if j < 0:
            return
        eng = self.engine
        try:
            disc, times, values, hist = self.snapshot(j)
        except _NotComparable as e:
            self.reason = f"the state at block {j} not comparable: {e}"
            return
        now = eng.env.now
        seen = self.table.setdefault(disc, [])
        for c0, t0, ts, vs, hs, n_spans in seen:
            if _close(ts, times, now) and _close_values(vs, values):
                same = _history(hs, t0, hist, now)
                if same is None:
                    continue
                if self._skip(c0, t0, j, now, n_spans, same):
                    return
                break
        seen.append((j, now, times, values, hist, len(eng.spans)))

    # -- the state -------------------------------------------------------------------------------

    def snapshot(self, j: int) -> tuple[tuple, list[float], list[float], list[tuple]]:
        """The state at the end of this instant, at block ``j``'s cut: its discrete part, its
        times relative to now, its other floats and its starts of history (``_history``).
        Raises _NotComparable."""
        eng = self.engine
        now = eng.env.now
        self._j, self._kernels = j, {}
        items: list = []  # (discrete, times, values)
        hist: list = []  # starts of history (``_history``)
        for rank, r in eng.ranks.items():
            reg = self._region(rank)
            ix = self.index[rank]
            base, end, sh = reg.a + j * reg.p, reg.end, -j * reg.d

            def pos(x: int, reg=reg, base=base, end=end):
                if x < reg.a:
                    raise _NotComparable(f"an instruction before the repeated blocks ({x})")
                return x - base if x < end else ("S", x)

            def name(n, sh=sh, pos=pos):
                if type(n) is tuple:  # a wait_stream's event: named by its position
                    return ("ws", pos(n[1]), n[2])
                return shift_name(n, sh)

            # the host: its next step, what it blocks on, its open run of launches
            hpos = pos(r.plan[r.pc][3]) if r.pc < len(r.plan) else None
            # (when a sync blocked or a run of launches began is read only by its span: a
            # start of history, ``_history``)
            hw = r.host_wait
            if hw is not None and hw[0] == "sync":
                hist.append(("sync", rank, hw[2]))
                hw = ("sync", name(hw[1]))
            elif hw is not None:
                hw = ("t",)  # (the timeout is in SimPy's queue)
            items.append((("host", rank, hpos, hw), (), ()))
            step = r.plan[r.pc - 1] if r.pc else None
            for lane in sorted(r.launch_run):
                s0, s1 = r.launch_run[lane]
                launching = (
                    step is not None
                    and step[0] == LAUNCH
                    and step[2] == lane
                    and r.host_wait is not None
                    and r.host_wait[1] == s1
                )
                if s1 < now and not launching:  # no launch can extend it: its span is final
                    eng._launch_span(r, lane, r.launch_run.pop(lane))
                    continue
                hist.append(("run", rank, lane, s0))
                items.append((("run", rank, lane), (s1 - now,), ()))
            # the streams: where each is in the issue order and what holds it
            for s in r.rp.streams:
                ps = ix.stream_pos[s]
                i = bisect.bisect_right(ps, r.popped[s])
                nxt = pos(ps[i]) if i < len(ps) else None
                held = r.busy.get(s)
                if held is None:
                    hold = None
                elif type(held) is Wait:
                    hold = ("w", name(held.event))
                else:
                    hold = ("k", pos(r.popped[s]))
                items.append((("stream", rank, s, nxt, hold), (), ()))
            # events fired that an instruction not taken yet reads, events waited on
            lo = self._low_water(r, ix)
            alive = self.alive[rank]
            for n in r.log:
                lr = n[1] if type(n) is tuple else ix.last_ref.get(self.original.get(n, n))
                if lr is not None:
                    alive[n] = lr
            r.log.clear()
            for n in [n for n, lr in alive.items() if lr < lo]:
                del alive[n]
            items.append((("fired", rank, tuple(sorted(repr(name(n)) for n in alive))), (), ()))
            waited = sorted(
                (repr(name(n)), len(ev.callbacks)) for n, ev in r.waited.items() if n not in r.fired
            )
            items.append((("waited", rank, tuple(waited)), (), ()))
            # the GPU: free SMs, kernels pending and running, and each rank's links
            g = r.gpu
            if g._grant_due or g._touched or g._unstarted or g._granted or g._after:
                raise _NotComparable("the block scheduler is mid-pass")
            pend = tuple(
                self._kernel_pos(k, rank) for k in sorted(g.pending, key=_resources._precedence)
            )
            items.append((("gpu", rank, g.free, pend), (), ()))
            items.append(self._fluid(("gpu", rank), g, now, rank))
            for kind in sorted(r.links):
                items.append(self._fluid(("link", rank, kind), r.links[kind], now, rank))
        items.append(self._collectives(j))
        net = eng.net
        if isinstance(net, _network.Network) and (net.live or net._pending):
            raise _NotComparable("flows in the network")
        items.extend(self._queue(now))
        for (rank, p), k in sorted(self._kernels.items(), key=lambda kv: repr(kv[0])):
            items.append(self._kernel(rank, p, k, now))
        disc = tuple(d for d, _, _ in items)
        times = [t for _, ts, _ in items for t in ts]
        values = [v for _, _, vs in items for v in vs]
        return disc, times, values, hist

    def _low_water(self, r, ix: RankIndex) -> float:
        """The first position of the rank not done yet, by its host or any stream."""
        lo = r.plan[r.pc][3] if r.pc < len(r.plan) else math.inf
        for s, ps in ix.stream_pos.items():
            i = bisect.bisect_right(ps, r.popped[s])
            if i < len(ps):
                lo = min(lo, r.popped[s] if s in r.busy else ps[i])
        return lo

    def _collectives(self, j: int) -> tuple:
        """Collectives partly arrived, waited for, or arrived and still to be received."""
        eng = self.engine
        for key in eng._arrived_log:
            ix = self.index.get(key[1])
            if ix is not None:
                lr = ix.last_recv.get(self.original.get(key[0], key[0]))
                if lr is not None:
                    self.alive_keys[key] = lr
        eng._arrived_log.clear()
        lows = {rank: self._low_water(eng.ranks[rank], ix) for rank, ix in self.index.items()}
        for key in [k for k, lr in self.alive_keys.items() if lr < lows[k[1]]]:
            del self.alive_keys[key]
        out = []
        for key, dst in self.alive_keys:
            out.append(("arrived", dst, self._key(key, dst, j)))
        for key, dst in eng._partial:
            out.append(("partial", dst, self._key(key, dst, j), eng._expected[(key, dst)]))
        for (key, dst), fns in eng._on_arrival.items():
            ks = []
            for fn in fns:
                if type(fn) is not partial or fn.func.__func__ is not _resources.Gpu.data_arrived:
                    raise _NotComparable("an unknown arrival callback")
                ks.append(self._kernel_pos(fn.args[0], dst))
            out.append(("on_arrival", dst, self._key(key, dst, j), tuple(sorted(ks))))
        return (("collectives", tuple(sorted(out, key=repr))), (), ())

    def _key(self, key: str, dst: int, j: int) -> str:
        return shift_name(key, -j * self._region(dst).d)

    def _pos(self, rank: int, x: int) -> int:
        """Position ``x`` of work in flight, relative to the cut's block."""
        reg = self._region(rank)
        if not reg.a <= x < reg.end:
            raise _NotComparable("work outside the repeated blocks is in flight")
        return x - (reg.a + self._j * reg.p)

    def _kernel_pos(self, k, rank: int) -> int:
        """``k``'s position relative to the cut's block (its state is compared once)."""
        p = self._pos(rank, k.seq)
        self._kernels[(rank, p)] = k
        return p

    def _fluid(self, rid: tuple, f, now: float, rank: int) -> tuple:
        """A fluid resource's jobs (cohorts or flows), its pending timer and the jobs due at it."""
        jobs = f.jobs
        # (with no job, when progress was last brought up to date is no part of the state)
        disc, ts, vs = [], [f._t - now] if jobs else [], []
        for c in jobs:
            if type(c) is _resources.Cohort:
                disc.append(("c", self._kernel_pos(c.kernel, rank), c.sms, c.per_wave, c.waves))
                vs += (c.total, c.left, c.rate, c.floor)
            else:
                disc.append(("f", self._callback(c.on_done, now, ts)))
                vs += (c.nbytes, c.total, c.left, c.rate, c.floor)
            ts += (c.t_end - now, c.t_snap - now)
        armed = None
        if f._armed is not None:
            ts.append(f._armed - now)
            armed = tuple(jobs.index(c) for c in f._due)
        return ((rid, tuple(disc), armed), tuple(ts), tuple(vs))

    def _kernel(self, rank: int, p: int, k, now: float) -> tuple:
        segs = k.segments
        disc = (
            "kernel",
            rank,
            p,
            k.limit,
            k.stream,
            k.prio,
            k.waiting_data,
            k.gated,
            tuple(k.grid),
            k.pending,
            k.held,
            k.reserved,
            k.cohorts,
            k.started,
            k.fired,
            tuple(sms for _, sms in segs),
            len(k.staged),
        )
        return (disc, (k.ready - now, k.t0 - now, *(t - now for t, _ in segs)), ())

    def _callback(self, fn, now: float, ts: list) -> tuple:
        """What a flow's callback will do, relative to this cut (its start into ``ts``)."""
        eng = self.engine
        f = getattr(fn.func, "__func__", None) if type(fn) is partial else None
        if f is type(eng)._flow_arrived:
            r, _op, link, t0, p = fn.args
            ts.append(t0 - now)
            return ("flow", r.rp.rank, link, self._pos(r.rp.rank, p))
        if f is type(eng)._copied:
            r, stream, _op, t0, p = fn.args
            ts.append(t0 - now)
            return ("copy", r.rp.rank, stream, self._pos(r.rp.rank, p))
        raise _NotComparable(f"an unknown callback {fn!r}")

    def _queue(self, now: float) -> list:
        """Every live callback in SimPy's queue: when, and what it will do."""
        eng = self.engine
        procs = {id(r.host_proc): rank for rank, r in eng.ranks.items()}
        out = []
        for t, prio, _eid, ev in eng.env._queue:
            for cb in ev.callbacks or ():
                ts: list = [t - now]
                f = getattr(cb.func, "__func__", cb.func) if type(cb) is partial else None
                if f is _resources._call:
                    inner, args = cb.args[0], cb.args[1:]
                    g = getattr(inner.func, "__func__", None) if type(inner) is partial else None
                    if g is type(eng)._kernel_done:
                        rank = inner.args[0].rp.rank
                        what = ("done", rank, self._kernel_pos(args[0], rank))
                    else:
                        what = ("call", self._callback(inner, now, ts))
                elif f is type(eng)._gap_over:  # a replayed graph's gap before a kernel
                    rank = cb.args[0].rp.rank
                    what = ("gap", rank, cb.args[1], self._pos(rank, cb.args[3]))
                elif f is _resources.Fluid._fire:
                    if cb.args[0] != cb.func.__self__._gen:
                        continue  # stale: it does nothing
                    what = ("fire", self._res_id[id(cb.func.__self__)])
                elif f is _network.Network._timer:
                    if cb.args[0] != cb.func.__self__._gen:
                        continue
                    raise _NotComparable("flows in the network")
                elif getattr(cb, "__func__", None) is _RESUME and id(cb.__self__) in procs:
                    what = ("host", procs[id(cb.__self__)])
                else:
                    raise _NotComparable(f"an unknown timer {cb!r}")
                out.append(((what, prio), tuple(ts), ()))
        out.sort(key=lambda x: repr(x[0]))
        return out

    # -- the skip --------------------------------------------------------------------------------

    def _skip(
        self, c0: int, t0: float, c: int, now: float, n_spans: int, same: list[tuple]
    ) -> bool:
        """Cut ``c`` repeats cut ``c0``: take out as many periods of blocks as every rank's run
        still holds past what it has taken, and go on; False if not one fits. ``same``: the
        starts of history that are one start at both cuts (``_history``)."""
        eng = self.engine
        q = c - c0
        most = math.inf
        for rank, ix in self.index.items():
            reg = self._region(rank)
            r = eng.ranks[rank]
            front = -1  # the furthest position taken in the run
            for s, ps in ix.stream_pos.items():
                if r.popped[s] < reg.end and bisect.bisect_left(ps, reg.a) < bisect.bisect_left(
                    ps, reg.end
                ):
                    front = max(front, r.popped[s])
            if r.pc > 0 and r.plan[r.pc - 1][3] < reg.end:
                front = max(front, r.plan[r.pc - 1][3])
            most = min(most, (reg.end - 1 - front) // (q * reg.p))
            # an instruction after the run reads what the run's block at ``read_after`` wrote:
            # renamed back ``m`` blocks, it reads the block ``m`` before, which must be one
            most = min(most, (reg.read_after - reg.a) // (q * reg.p))
        n = int(most)
        if n < 1:
            return False
        m = n * q
        for rank in self.index:
            reg = self._region(rank)
            if not self._can_take_out(eng.ranks[rank], reg.end - m * reg.p, reg.end):
                return False
        reg0 = self._region(self.first)
        m, period, dl = n * q, now - t0, q * reg0.d
        _i, base_dt, base_dl = self.segments[-1]
        self.copies.append((tuple(eng.spans[n_spans:]), base_dt, base_dl, period, dl, n))
        self.segments.append((len(eng.spans), base_dt + n * period, base_dl + n * dl))
        for what in same:
            # one span that began before both cuts: its start is not shifted with the rest
            r = eng.ranks[what[1]]
            if what[0] == "sync":
                r.host_wait = (*r.host_wait[:2], r.host_wait[2] - n * period)
            else:
                r.launch_run[what[2]][0] -= n * period
        for rank in self.index:
            reg = self._region(rank)
            self._take_out(eng.ranks[rank], reg.end - m * reg.p, reg.end, -m * reg.d)
        if any(self._region(rank).read_after < self._region(rank).end for rank in self.index):
            # instructions after the run read events of it: renamed, they read the blocks
            # before the cut, which later runs' cuts cannot tell apart from their own
            self.n_runs = self.run + 1
        atoms = self.index[self.first].atoms
        first = atoms[reg0.anchor + c * reg0.p].op.layer
        back = atoms[reg0.anchor + c0 * reg0.p].op.layer
        src = f"layer {back}" if back == first - 1 else f"layers {back}-{first - 1}"
        self.skips.append(
            (
                m * reg0.d,
                f"layers {first}-{first + m * reg0.d - 1} copied from {src} ({period:.6g} µs)",
            )
        )
        self._next_run()
        return True

    def _can_take_out(self, r, lo: int, hi: int) -> bool:
        """Whether no graph the host of ``r`` has still to launch straddles ``lo`` or ``hi``
        (its body would be cut in two)."""
        plan = r.plan
        for bound in (lo, hi):
            i = bisect.bisect_left(plan, bound, lo=r.pc, key=_POS) - 1
            if i >= r.pc and plan[i][4] and plan[i][4][-1][0] >= bound:
                return False
        return True

    def _take_out(self, r, lo: int, hi: int, d: int) -> None:
        """Take positions ``[lo, hi)`` out of what rank ``r`` has not taken yet (its streams'
        queues, its host's steps) and rename what comes after them by ``d`` layers: lazily, as
        each is taken (``rename``), and at once in the flows each collective expects."""
        eng = self.engine
        rank = r.rp.rank
        expected = eng._expected
        for s, q in r.queues.items():
            if q and q[-1][0] >= lo:
                items = list(q)
                i = bisect.bisect_left(items, lo, key=_FIRST)
                j = bisect.bisect_left(items, hi, key=_FIRST)
                r.queues[s] = deque(items[:i] + items[j:])
        i = bisect.bisect_left(r.plan, lo, lo=r.pc, key=_POS)
        j = bisect.bisect_left(r.plan, hi, lo=r.pc, key=_POS)
        del r.plan[i:j]
        # the collectives whose sending halves were taken out or renamed
        ix = self.index[rank]
        before = self._offset(r, hi)
        for p in ix.sends[bisect.bisect_left(ix.sends, lo) :]:
            op = ix.atoms[p].op
            if p <= r.popped[ix.atoms[p].stream]:
                continue  # (taken already, by a stream past the blocks)
            parts = max(1, len(op.waits))
            key = shift_name(op.coll.key, before)
            for f in op.coll.flows:
                dst = rank if f.dst is None else f.dst
                expected[(key, dst)] -= parts
                if p >= hi:
                    expected[(shift_name(op.coll.key, before + d), dst)] += parts
        r.renames.append((hi, before + d))
        r.rename_from = r.renames[0][0]

    def _offset(self, r, p: int) -> int:
        """The layers instructions at position ``p`` of ``r`` are renamed by (skips so far)."""
        out = 0
        for at, d in r.renames:
            if p >= at:
                out = d
        return out

    def rename(self, r, p: int, ins):
        """``ins``, at position ``p`` of rank ``r``, renamed by the skips before it; the
        original of each event and collective it writes is remembered (``original``)."""
        d = self._offset(r, p)
        new = shift_instr(ins, d)
        t = type(new)
        if t is Record and type(new.event) is str:
            self.original[new.event] = ins.event
        elif t is Launch and new.op.coll is not None:
            self.original[new.op.coll.key] = ins.op.coll.key
        return new

    # -- the result ------------------------------------------------------------------------------

    def note(self) -> str:
        """What ``meta["fast_forward"]`` says: which layers were copied, or why none were."""
        if not self.skips:
            return f"not used: {self.reason}"
        n = sum(k for k, _ in self.skips)
        return f"{n} layers not simulated: " + "; ".join(s for _, s in self.skips)

    def spans(self, spans: list) -> list:
        """Every span: those simulated (shifted past the blocks skipped before them) and the
        skipped blocks' (the period's spans, shifted once per period)."""
        if not self.copies:
            return spans
        out: list = []
        ends = [i for i, _, _ in self.segments[1:]] + [len(spans)]
        for (i, dt, dl), j in zip(self.segments, ends):
            out += _shift_spans(spans[i:j], dt, dl) if dt or dl else spans[i:j]
        for period_spans, dt, dl, period, dlp, n in self.copies:
            for i in range(1, n + 1):
                out += _shift_spans(period_spans, dt + i * period, dl + i * dlp)
        return _snap(out)


def _shift_spans(spans, dt: float, dl: int) -> list:
    """``spans`` later by ``dt`` and ``dl`` layers on (copies; not validated again: a shift keeps
    every field valid)."""
    new, set_dict = object.__new__, object.__setattr__
    span_type = type(spans[0]) if spans else None
    out = []
    for s in spans:
        d = s.__dict__.copy()
        d["start"] += dt
        d["end"] += dt
        if d["layer"] is not None:
            d["layer"] += dl
        if d["kind"] == "sync":  # "sync <event>": the event's layer tokens move too
            d["op"] = "sync " + shift_name(d["op"][5:], dl)
        c = new(span_type)
        set_dict(c, "__dict__", d)
        out.append(c)
    return out


#: Times within this many ulps of each other are one instant (``_snap``).
SNAP_ULPS = 64


def _snap(spans: list) -> list:
    """``spans`` with times that differ by round-off made one float (the smallest of them).

    A span shifted by ``i`` periods ends at ``end + i * P`` and the span after it, made in the
    next period or after the cut, starts at a time computed from another clock: the two are one
    instant but may differ in their last bits. Left so, a kernel and the next on its stream
    would overlap by an ulp, and the layout would put one on a track of its own."""
    if not spans:
        return spans
    t = np.fromiter(
        (x for s in spans for x in (s.start, s.end)), dtype=np.float64, count=2 * len(spans)
    )
    order = np.argsort(t, kind="stable")
    v = t[order]
    # a new instant where the gap to the previous time exceeds the round-off of either
    gap = np.diff(v) > SNAP_ULPS * np.spacing(np.maximum(np.abs(v[1:]), np.abs(v[:-1])))
    first = np.concatenate(([0], np.flatnonzero(gap) + 1))
    rep = v[first][np.cumsum(np.concatenate(([True], gap))) - 1]
    snapped = np.empty_like(t)
    snapped[order] = rep
    moved = np.flatnonzero(snapped != t)
    if not len(moved):
        return spans
    out = list(spans)
    new, set_dict = object.__new__, object.__setattr__
    for i in np.unique(moved // 2).tolist():
        s = out[i]
        d = s.__dict__.copy()
        d["start"], d["end"] = float(snapped[2 * i]), float(snapped[2 * i + 1])
        c = new(type(s))
        set_dict(c, "__dict__", d)
        out[i] = c
    return out


def _history(a: list[tuple], t_a: float, b: list[tuple], t_b: float) -> list[tuple] | None:
    """Which starts of history (a blocked sync's, an open run of launches') are one start at
    cuts ``a`` (at ``t_a``) and ``b``: those equal at both began before both cuts and are not
    shifted by a skip; the others must sit where the rest of the state does, at the same time
    relative to their cut. None if one does neither. Such a start is read only by its span."""
    same = []
    tol = TIME_TOL * abs(t_b) + TIME_ABS
    for x, y in zip(a, b):
        if x[-1] == y[-1]:
            same.append(y)
        elif not abs((x[-1] - t_a) - (y[-1] - t_b)) <= tol:
            return None
    return same


def _close(a: list[float], b: list[float], now: float) -> bool:
    tol = TIME_TOL * abs(now) + TIME_ABS
    for x, y in zip(a, b):
        if x != y and not abs(x - y) <= tol:
            return False
    return True


def _close_values(a: list[float], b: list[float]) -> bool:
    for x, y in zip(a, b):
        if x != y and not abs(x - y) <= VALUE_TOL * max(abs(x), abs(y)):
            return False
    return True
