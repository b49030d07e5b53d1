"""The network: per-rank egress and ingress ports per link kind, shared max-min fairly by flows.

Every rank has, for each link kind (NVLink, RDMA), one egress port (what it can push into the
fabric) and one ingress port (what it can take in), each with the preset's bandwidth. A flow from
``src`` to ``dst`` over kind ``k`` crosses egress(src, k) and ingress(dst, k) and nothing else (an
NVSwitch inside a node and a rail-optimised, non-blocking fabric across nodes). Live flows get the
max-min fair allocation over these ports (progressive filling / water-filling): all flows grow at
the same pace, a port that fills freezes the flows crossing it, the others go on growing. So two
flows on one egress each take half of it; a flow whose destination is shared with more senders
than its source is limited by the ingress side; N senders to one receiver share its ingress.

A fluid model like ``sim.resources.Fluid``, but vectorised (numpy) and coalesced, because an
explicit EP-32 step has ~1000 flows per all-to-all: sends issued at the same simulated time are
re-rated once; between two changes every flow's rate is constant, so one SimPy timer for the next
completion is all it needs. ``group_tol`` (default 0: exact) handles completions that fall within
``group_tol`` times the flows' age of the earliest one together, at the last of them: each flow
still ends at its own time (its ports idle until then) and is reported up to that much late. With
routing noise every flow of an all-to-all has a slightly different size, so the exact model
re-rates once per flow (~1000 per all-to-all at EP 32); 0.02 cuts that to a few dozen, an error
below 2 % of the all-to-all's duration, on the slow side; the same tolerance merges fill levels
of the water-filling (``max_min_rates``).

A finished flow is reported ``latency`` later (per kind) through ``on_done``; the engine turns those
into arrivals of collectives. In a symmetric program a flow's destination is its source (the
mirror peer): egress and ingress of the same rank then carry the same flows, which gives exactly
the equal split of one egress link.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import simpy

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.jit import inline, njit

_EPS = 1e-9
#: Bytes below which a flow counts as delivered (float round-off of rate * time).
_BYTE_EPS = 1e-3
_TIME_EPS = 1e-7
#: Re-rates of one Network after which the compiled progressive filling and per-change step loops
#: (numba, when installed) take over: below it, loading the compiled functions costs more than
#: they save.
_COMPILED_AFTER = 500


def max_min_rates(
    src_port: np.ndarray, dst_port: np.ndarray, cap: np.ndarray, level_tol: float = 0.0
) -> np.ndarray:
    """Max-min fair rates of flows each crossing two ports (progressive filling).

    Each round raises every unfrozen flow by the smallest fair increment of any port and freezes
    the flows of the ports that filled. ``level_tol`` > 0 also freezes, in the same round, ports
    whose fill level is within that fraction of the smallest (their flows get the smaller level:
    at most that fraction below the exact allocation), bounding the rounds when every port fills
    at a slightly different level.

    :func:`max_min_rates_compiled` is the same algorithm, operation for operation, as a compiled
    loop (numba): the two return bit-identical rates."""
    n, p = len(src_port), len(cap)
    rate = np.zeros(n)
    idx, sp, dp = np.arange(n), src_port, dst_port
    rem = cap.astype(np.float64).copy()
    eps_cap = _EPS * cap
    # flows per port, kept up to date as flows freeze (integers: the same counts as recounting)
    cnt = np.bincount(sp, minlength=p) + np.bincount(dp, minlength=p)
    share = np.empty(p)
    level = 0.0
    while len(idx):
        used = cnt > 0
        share.fill(np.inf)
        np.divide(rem, cnt, out=share, where=used)
        inc = float(share.min())
        level += inc
        rem -= inc * cnt
        full = used & (rem <= eps_cap)
        if level_tol > 0:
            full |= share <= inc * (1.0 + level_tol)
        fr = full[sp] | full[dp]
        rate[idx[fr]] = level
        keep = ~fr
        if keep.any():
            cnt -= np.bincount(sp[fr], minlength=p) + np.bincount(dp[fr], minlength=p)
        idx, sp, dp = idx[keep], sp[keep], dp[keep]
    return rate


def _max_min_loop(src, dst, cap, level_tol, eps):  # pragma: no cover - compiled by numba
    """:func:`max_min_rates` as scalar loops, the same float operations in the same order."""
    n, p = len(src), len(cap)
    rate = np.zeros(n)
    live = np.ones(n, dtype=np.bool_)
    rem = cap.astype(np.float64).copy()
    cnt = np.zeros(p, dtype=np.int64)
    share = np.empty(p)
    full = np.zeros(p, dtype=np.bool_)
    for i in range(n):
        cnt[src[i]] += 1
        cnt[dst[i]] += 1
    left, level = n, 0.0
    while left > 0:
        inc = np.inf
        for j in range(p):
            share[j] = rem[j] / cnt[j] if cnt[j] > 0 else np.inf
            if share[j] < inc:
                inc = share[j]
        level += inc
        bound = inc * (1.0 + level_tol)
        for j in range(p):
            rem[j] -= inc * cnt[j]
            full[j] = (cnt[j] > 0) and (rem[j] <= eps * cap[j])
            if level_tol > 0 and share[j] <= bound:
                full[j] = True
        for i in range(n):
            if live[i] and (full[src[i]] or full[dst[i]]):
                live[i] = False
                rate[i] = level
                cnt[src[i]] -= 1
                cnt[dst[i]] -= 1
                left -= 1
    return rate


_compiled = None  # None: not tried yet; False: numba missing


def max_min_rates_compiled(src_port, dst_port, cap, level_tol: float = 0.0):
    """:func:`max_min_rates` compiled with numba (bit-identical rates, ~20x faster on the ~1000
    flows of an EP-32 all-to-all); the numpy version when numba is not installed."""
    global _compiled
    if _compiled is None:
        _compiled = njit(_max_min_loop, nogil=True) or False
    if _compiled is False:
        return max_min_rates(src_port, dst_port, cap, level_tol)
    return _compiled(
        np.ascontiguousarray(src_port, dtype=np.int64),
        np.ascontiguousarray(dst_port, dtype=np.int64),
        np.ascontiguousarray(cap, dtype=np.float64),
        float(level_tol),
        _EPS,
    )


def _finish_loop(src, dst, kind, tag, left, rate, t0, due, byte_eps, time_eps):
    """:meth:`Network._changed`'s finish (compiled by numba): the flows done (bytes or time left
    within round-off, or ``due``) leave, the others are moved to the front in order, in place.
    Returns how many stay and the tags and kinds of those done, in flow order; the same tests
    on the same floats as the numpy code."""  # pragma: no cover - compiled by numba
    n = len(left)
    done_tag, done_kind = np.empty(n, np.int64), np.empty(n, np.int64)
    m, nd = 0, 0
    for i in range(n):
        t_left = left[i] / rate[i] if rate[i] > 0 else np.inf
        if left[i] <= byte_eps or t_left <= time_eps or due[i]:
            done_tag[nd], done_kind[nd] = tag[i], kind[i]
            nd += 1
        else:
            src[m], dst[m], kind[m], tag[m] = src[i], dst[i], kind[i], tag[i]
            left[m], t0[m] = left[i], t0[i]
            m += 1
    return m, done_tag[:nd], done_kind[:nd]


def _next_loop(left, rate, t0, now, group_tol):
    """:meth:`Network._changed`'s next timer (compiled by numba): the earliest completion and
    the flows due at it (grouped with ``group_tol``); the numpy code's float operations."""
    n = len(left)  # pragma: no cover - compiled by numba
    t_left = np.empty(n)
    nxt, first = np.inf, np.inf
    for i in range(n):
        t_left[i] = left[i] / rate[i] if rate[i] > 0 else np.inf
        nxt = min(nxt, t_left[i])
        first = min(first, t0[i])
    due = np.zeros(n, np.bool_)
    if not nxt < np.inf:
        return nxt, due
    bound = nxt
    if group_tol > 0:
        bound = nxt + group_tol * (now + nxt - first)
    last = nxt
    for i in range(n):
        if t_left[i] <= bound:
            due[i] = True
            last = max(last, t_left[i])
    return last, due


def _step_loop(src, dst, kind, tag, left, rate, t0, due, cap, level_tol, eps, byte_eps, time_eps,
               now, group_tol):  # fmt: skip
    """One change of :meth:`Network._changed_compiled` in one compiled call (a call into
    numba costs microseconds, a change three of them): :func:`_finish_loop`, then
    :func:`_max_min_loop` over the flows left, then :func:`_next_loop`. Returns how many flows
    stay, the tags and kinds of those done, the new rates, the next timer and the flows due at
    it."""  # pragma: no cover - compiled by numba
    m, done_tag, done_kind = _finish_loop(src, dst, kind, tag, left, rate, t0, due, byte_eps,
                                          time_eps)  # fmt: skip
    new_rate = _max_min_loop(src[:m], dst[:m], cap, level_tol, eps)
    nxt, next_due = _next_loop(left[:m], new_rate, t0[:m], now, group_tol)
    return m, done_tag, done_kind, new_rate, nxt, next_due


_step_loops = None  # None: not tried yet; False: numba missing; else the compiled step


def _compiled_step_loops():
    """:func:`_step_loop` compiled (numba), None without numba."""
    global _step_loops
    if _step_loops is None:
        _step_loops = inline(_finish_loop, _max_min_loop, _next_loop) and njit(
            _step_loop, nogil=True
        )
        _step_loops = _step_loops or False
    return _step_loops or None


def _arrived(on_done: Callable, tags: np.ndarray, kinds: np.ndarray, _e=None) -> None:
    """Flows' arrival, reported a link latency after their last byte left."""
    on_done(tags, kinds)


class Network:
    """Flows between ranks over link kinds; ``send`` injects, ``on_done`` reports arrivals."""

    def __init__(
        self,
        env: simpy.Environment,
        world: int,
        kinds: dict[str, tuple[float, float]],
        on_done: Callable[[np.ndarray, np.ndarray], None],
        group_tol: float = 0.0,
    ):
        """``kinds``: link kind -> (bytes per µs per port, latency µs). ``on_done(tags, kinds)``
        is called with the tags and kind indices of the flows that arrive at the same time."""
        self.env, self.world, self.on_done, self.group_tol = env, world, on_done, group_tol
        nk = len(kinds)
        bw = np.array([kinds[k][0] for k in kinds], dtype=np.float64)
        self.latency = np.array([kinds[k][1] for k in kinds], dtype=np.float64)
        self.cap = np.concatenate([np.repeat(bw, world), np.repeat(bw, world)])
        self._ingress_base = nk * world
        # live flows, as parallel arrays
        self.src = np.zeros(0, dtype=np.int64)  # egress port
        self.dst = np.zeros(0, dtype=np.int64)  # ingress port
        self.kind = np.zeros(0, dtype=np.int64)
        self.left = np.zeros(0)
        self.rate = np.zeros(0)
        self.tag = np.zeros(0, dtype=np.int64)
        self.t0 = np.zeros(0)  # start times
        self._pending: list[tuple] = []
        self._flush_set = False
        self._t = 0.0
        self._gen = 0
        self.rerates = 0

    @property
    def live(self) -> int:
        return len(self.left)

    def send(self, src: int, dsts, kinds, nbytes, tags) -> None:
        """Start flows from rank ``src`` to ranks ``dsts`` over kind indices ``kinds``; ``nbytes``
        must be >= 0 (an infinite flow never arrives: the simulation reports a stall)."""
        if not (np.asarray(nbytes, dtype=np.float64) >= 0).all():
            raise ConfigError(f"rank {src}: flow sizes must be numbers >= 0, got {list(nbytes)}")
        self._pending.append((src, dsts, kinds, nbytes, tags))
        if not self._flush_set:
            self._flush_set = True
            t = self.env.timeout(0)
            t.callbacks.append(self._flush)

    # -- the fluid -------------------------------------------------------------------------------

    def _flush(self, _e=None) -> None:
        self._flush_set = False
        self._advance()
        w = self.world
        srcs, dsts, kinds, nbytes, tags = [], [], [], [], []
        for src, d, k, b, t in self._pending:
            k = np.asarray(k, dtype=np.int64)
            srcs.append(k * w + src)
            dsts.append(self._ingress_base + k * w + np.asarray(d, dtype=np.int64))
            kinds.append(k)
            nbytes.append(np.asarray(b, dtype=np.float64))
            tags.append(np.asarray(t, dtype=np.int64))
        self._pending.clear()
        self.src = np.concatenate([self.src, *srcs])
        self.dst = np.concatenate([self.dst, *dsts])
        self.kind = np.concatenate([self.kind, *kinds])
        self.left = np.concatenate([self.left, *nbytes])
        self.rate = np.concatenate([self.rate, np.zeros(sum(len(b) for b in nbytes))])
        self.tag = np.concatenate([self.tag, *tags])
        self.t0 = np.concatenate([self.t0, np.full(len(self.left) - len(self.t0), self.env.now)])
        self._changed()

    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._t
        if dt > 0 and len(self.left):
            self.left = np.maximum(self.left - self.rate * dt, 0.0)
        self._t = now

    def _timer(self, gen: int, due: np.ndarray, _e=None) -> None:
        """The timer of the next completion (stale unless ``gen`` is the current re-rate's)."""
        if gen == self._gen:
            self._advance()
            self._changed(due)

    def _changed(self, due: np.ndarray | None = None) -> None:
        """Finish what is done, re-rate the rest, set the timer for the next completion.

        Progress is guaranteed: the timer is armed for the flows ``due`` at it (the earliest
        completion, or with ``group_tol`` every completion grouped with it), and when it fires
        with no change in between those flows finish, whatever bytes float round-off leaves them.
        Their residue is round-off, not work: the timer fires at ``t + d`` with ``d`` their time
        left, so each has moved ``rate * ((t + d) - t)`` bytes of its ``rate * d``, which differ
        by at most rate * ulp(t + d) / 2 plus the rounding of ``left - rate * dt``. That is
        below ``_BYTE_EPS`` for ordinary sizes, but not when the clock is large (``t`` = 1e16 µs
        after a huge host or kernel time: ``t + d`` may round to ``t`` itself, ``dt`` = 0 and no
        byte moves) or the flow is (1e12 bytes: ulp of 1e-4 bytes, rate * time adds more). Without
        this rule such a flow re-armed the same timer forever. With it, every timer that fires
        finishes at least one flow, so a Network handles at most as many timers as flows and
        always terminates; flows not due still finish early only by the ``_BYTE_EPS`` and
        ``_TIME_EPS`` round-off rules.

        Past ``_COMPILED_AFTER`` re-rates (numba installed) the per-flow work runs as compiled
        loops (:meth:`_changed_compiled`): the same floats, so the same times and order.
        """
        if self.rerates >= _COMPILED_AFTER:
            step = _compiled_step_loops()
            if step is not None:
                return self._changed_compiled(due, step)
        if len(self.left):
            t_left = self._time_left()
            done = (self.left <= _BYTE_EPS) | (t_left <= _TIME_EPS)
            if due is not None:
                done |= due
            if done.any():
                self._finish(done)
        self.rerates += 1
        rates = max_min_rates_compiled if self.rerates > _COMPILED_AFTER else max_min_rates
        self.rate = rates(self.src, self.dst, self.cap, self.group_tol)
        self._gen += 1
        if not len(self.left):
            return
        t_left = self._time_left()
        nxt = float(t_left.min())
        if not nxt < np.inf:  # no flow can finish (infinite bytes, no bandwidth): a stall
            return
        if self.group_tol > 0:
            # completions within group_tol of the flows' age are handled together, at the last of
            # them: each flow still ends at its own time (its port then idles until the timer),
            # and arrivals are reported at the timer, up to group_tol * age late
            age = self.env.now + nxt - float(self.t0.min())
            due = t_left <= nxt + self.group_tol * age
            nxt = float(t_left[due].max())
        else:
            due = t_left <= nxt
        t = self.env.timeout(max(nxt, 0.0))
        t.callbacks.append(partial(self._timer, self._gen, due))

    def _changed_compiled(self, due, step) -> None:
        """:meth:`_changed` with its loops over flows compiled into one ``step`` (~1000 live
        flows at EP 32, where a dozen numpy passes a change cost more than the re-rate itself)."""
        n = len(self.left)
        d = np.zeros(n, dtype=np.bool_) if due is None else due
        m, tags, kinds, rate, nxt, due = step(
            self.src, self.dst, self.kind, self.tag, self.left, self.rate, self.t0, d, self.cap,
            float(self.group_tol), _EPS, _BYTE_EPS, _TIME_EPS, self.env.now, float(self.group_tol),
        )  # fmt: skip
        if m < n:
            self.src, self.dst, self.kind = self.src[:m], self.dst[:m], self.kind[:m]
            self.left, self.tag, self.t0 = self.left[:m], self.tag[:m], self.t0[:m]
            self._report(tags, kinds)
        self.rerates += 1
        self.rate = rate
        self._gen += 1
        if not m:
            return
        if not nxt < np.inf:  # a stall, as in _changed
            return
        t = self.env.timeout(max(nxt, 0.0))
        t.callbacks.append(partial(self._timer, self._gen, due))

    def _time_left(self) -> np.ndarray:
        """Each flow's time to its last byte at its rate (inf where it has none)."""
        t_left = np.full(len(self.left), np.inf)
        np.divide(self.left, self.rate, out=t_left, where=self.rate > 0)
        return t_left

    def _finish(self, done: np.ndarray) -> None:
        tags, kinds = self.tag[done], self.kind[done]
        keep = ~done
        self.src, self.dst, self.kind = self.src[keep], self.dst[keep], self.kind[keep]
        self.left, self.rate, self.tag = self.left[keep], self.rate[keep], self.tag[keep]
        self.t0 = self.t0[keep]
        self._report(tags, kinds)

    def _report(self, tags: np.ndarray, kinds: np.ndarray) -> None:
        """``on_done`` for flows that finished now, one call per kind (ascending), after the
        kind's latency."""
        if not len(kinds):
            return
        if (kinds == kinds[0]).all():  # the usual case: one kind (np.unique costs ~20 µs)
            groups = [(int(kinds[0]), tags, kinds)]
        else:  # kinds in ascending order, as np.unique gave them
            sels = [kinds == k for k in range(len(self.latency))]
            groups = [(k, tags[sel], kinds[sel]) for k, sel in enumerate(sels) if sel.any()]
        for k, a, b in groups:
            lat = float(self.latency[k])
            if lat > 0:
                t = self.env.timeout(lat)
                t.callbacks.append(partial(_arrived, self.on_done, a, b))
            else:
                self.on_done(a, b)
