"""How ``overlap-lab tune`` searches: which configurations to simulate, round by round, and the
Pareto frontier of what it found (docs/tune.md, "The search").

Apart from simulation: the search asks an ``evaluate`` function for a round of (setting, batch)
pairs and reads back a :class:`Point` (time per iteration, tokens/s per GPU) or the reason a
pair failed. A family is a schedule on one layout; its series are its knob settings, each over
the batch ladder. Per family, coarse to fine:

1. **coarse**: the default setting at the ladder's ends;
2. **target**: the largest ladder batch within the target, the family's probe batch: iteration
   time grows with the batch, nearly affinely, so each step simulates the ladder batch nearest
   where the line between the closest points inside and outside the target crosses it;
3. **knobs**, at the probe batch: first the knobs every schedule reads and MTP, on each layout
   of a schedule within :data:`LAYOUT_SLACK` of its best layout; then each schedule's own
   knobs and the GPU's DeepEP normal-kernel fields (where normal kernels run), on the families
   within :data:`CONTENTION` of the best one. Each value alone, away from the chosen setting,
   then the best value of each knob that helped, together; the best of these is kept. Then
   **fine**: midpoints beside the chosen value of a numeric knob, on the same families, and a
   walk along the ladder to the probe batch of each new setting;
4. **fill**: the chosen setting over the whole ladder, skipping every batch whose best possible
   point is already dominated (below).

**Pruning.** Within a series, if the time per iteration does not fall as the batch grows and
the tokens of an iteration are proportional to the batch (both checked on the series' own
points; a series that breaks either is never pruned), a batch ``b`` above a simulated batch
``b_i`` takes at least ``ms(b_i)`` and so yields at most ``tokens(b) / ms(b_i)`` tokens/s: if a
simulated point dominates that corner, no point of batch ``b`` can be on the frontier, and it is
not simulated. This never drops a point of the overall frontier (tests/test_tune.py compares
with brute force); a schedule's own frontier may miss batches other schedules dominate, unless
``per_schedule`` prunes with each schedule's own points only.
The knob steps are a heuristic: a knob combination whose values do not each help alone can be
missed; ``exhaustive=True`` searches every combination (each with the pruned fill).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from overlap_lab.shared import schedules as registry
from overlap_lab.tune_space import Deployment, Dim, Setting, Space, deepep_normal, dims, fits

#: A family is tuned further (fine knob values) while its best point under the target is within
#: this share of the best family's throughput.
CONTENTION = 0.15
#: Knobs are searched on each layout of a schedule whose best default point within the target
#: is within this share of the schedule's best layout (the others keep their defaults).
LAYOUT_SLACK = 0.10
#: Relative tolerance of the pruning bound's checks (floating-point noise of the metrics).
TOL = 1e-9


@dataclass(frozen=True)
class Point:
    """One simulated configuration: ``ms``, the latency a target bounds (decode: the time
    between two of a sequence's tokens; prefill: a prompt's prefill step), which is
    ``iterations`` of its window's iterations (the schedule's ``latency_iterations``: pp's
    micro-batches in flight; one for a schedule whose iteration is its step); ``tps``,
    tokens/s per GPU (with MTP, the accepted ones)."""

    setting: Setting
    batch: int
    ms: float
    tps: float
    iterations: int = 1

    @property
    def iteration_ms(self) -> float:
        """ms per iteration of the simulated window (docs/metrics.md)."""
        return self.ms / self.iterations


def dominates(a: Point, b: Point) -> bool:
    """``a`` is at least as fast and has at least the throughput, and is better in one."""
    return a.ms <= b.ms and a.tps >= b.tps and (a.ms < b.ms or a.tps > b.tps)


#: ``fell_back(point)``: whether a point's schedule ran as another (a fallback its Program
#: records: ``tune._notes``), so that of points with the same numbers one that ran as its name
#: is the answer, not a row labelled ``[ran as serial, without SBO]``.
FellBack = Callable[[Point], bool]


def _order(p: Point, fell_back: FellBack | None = None) -> tuple:
    """Ties broken the same way every time: a point that ran as its schedule's name before one
    that fell back, then the setting with fewer knobs set, then by label."""
    s = p.setting
    fb = fell_back is not None and fell_back(p)
    return (fb, len(s.knobs) + len(s.gpu) + (s.drafts > 0), s.label(), p.batch)


def pareto(points: Iterable[Point], fell_back: FellBack | None = None) -> list[Point]:
    """The points no other point dominates, by time per iteration (identical points all stay,
    in :func:`_order`)."""
    out: list[Point] = []
    best = -math.inf
    for p in sorted(points, key=lambda p: (p.ms, -p.tps, *_order(p, fell_back))):
        if p.tps > best:
            out.append(p)
            best = p.tps
        elif out and p.tps == best and p.ms == out[-1].ms:
            out.append(p)
    return out


def best_under(
    points: Iterable[Point], target: float | None, fell_back: FellBack | None = None
) -> Point | None:
    """The most tokens/s per GPU within ``target`` ms per iteration (None: any), ties to the
    faster, then as :func:`_order` (one that ran as its name first): one answer for the same
    points."""
    ok = [p for p in points if target is None or p.ms <= target]
    return min(ok, key=lambda p: (-p.tps, p.ms, *_order(p, fell_back)), default=None)


def distinct(points: Sequence[Point]) -> list[tuple[Point, int]]:
    """``points`` (in order) with identical (ms, tokens/s) ones merged: each first point with
    how many others gave exactly the same numbers (settings a simulation does not tell apart)."""
    out: list[tuple[Point, int]] = []
    for p in points:
        if out and (out[-1][0].ms, out[-1][0].tps) == (p.ms, p.tps):
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((p, 0))
    return out


Pair = tuple[Setting, int]
#: ``evaluate(pairs)``: each pair's Point, or why it failed (a str)
Evaluate = Callable[[Sequence[Pair]], dict[Pair, "Point | str"]]


class Search:
    """One search (see the module docstring): ``run()`` fills :attr:`results`; ``rounds``
    counts the calls of ``evaluate``. ``target``: the most ms a point's latency may be
    (:attr:`Point.ms`; None: none).
    ``per_schedule``: prune a batch only where a point of its own schedule dominates it, so
    that each schedule's frontier, not only the overall one, is what brute force finds."""

    def __init__(
        self,
        d: Deployment,
        space: Space,
        schedules: Sequence[str],
        target: float | None,
        evaluate: Evaluate,
        *,
        exhaustive: bool = False,
        layouts: Callable[[str], Sequence[tuple[int, int]]],
        ladder: Sequence[int],
        per_schedule: bool = False,
    ) -> None:
        self.d, self.space, self.target = d, space, target
        self.evaluate, self.exhaustive = evaluate, exhaustive
        self.per_schedule = per_schedule
        self.results: dict[Pair, Point | str] = {}
        self.rounds = 0
        #: configurations asked for, by the step that asked (coarse, target, knobs, fine, fill)
        self.asked: dict[str, int] = {}
        self.step = "coarse"
        self.ladder = tuple(sorted(ladder))
        self.families = [(s, ep, pp) for s in schedules for ep, pp in layouts(s)]
        self.chosen: dict[tuple[str, int, int], Setting] = {}
        #: the knobs tried first, on every schedule: those every schedule reads, and MTP
        self.common = {k.name for k in registry.common_knobs()} | {"drafts"}
        self._fits: dict[Pair, bool] = {}

    # ---- what is known ------------------------------------------------------------------------

    def points(self, setting: Setting | None = None) -> list[Point]:
        return [
            p
            for (s, _), p in self.results.items()
            if isinstance(p, Point) and (setting is None or s == setting)
        ]

    def feasible(self, s: Setting) -> tuple[int, ...]:
        """The ladder's batches whose weights and KV cache (of every batch in flight) fit in
        the GPU."""
        out = []
        for b in self.ladder:
            key = (s, b)
            if key not in self._fits:
                self._fits[key] = fits(self.d, s, b)
            if self._fits[key]:
                out.append(b)
        return tuple(out)

    def score(self, p: Point | str | None) -> tuple[int, float]:
        """Within the target first, then throughput; outside it, the faster first."""
        if not isinstance(p, Point):
            return (-1, 0.0)
        if self.target is None or p.ms <= self.target:
            return (1, p.tps)
        return (0, -p.ms)

    def _round(self, wanted: Iterable[Pair]) -> None:
        todo = list(dict.fromkeys(p for p in wanted if p not in self.results))
        if not todo:
            return
        self.rounds += 1
        self.asked[self.step] = self.asked.get(self.step, 0) + len(todo)
        self.results.update(self.evaluate(todo))

    # ---- the phases ---------------------------------------------------------------------------

    def run(self) -> None:
        defaults = [Setting(s, ep, pp) for s, ep, pp in self.families]
        if self.exhaustive:
            series = [x for s in defaults for x in self._every_setting(s)]
            self.step = "fill"
            self._round((s, self.feasible(s)[0]) for s in series if self.feasible(s))
            self._fill(series)
            return
        self.step = "coarse"
        self._coarse(defaults)
        self.step = "target"
        self._bisect(defaults)
        for base in defaults:
            self.chosen[(base.schedule, base.ep, base.pp)] = base
        contending = [(s.schedule, s.ep, s.pp) for s in self._contending(defaults)]
        self.step = "knobs"
        self._knobs(contending, lambda x: x.name in self.common)
        self._knobs(self._in_contention(), lambda x: x.name not in self.common)
        self.step = "target"
        self._refresh(list(self.chosen.values()))
        self.step = "fine"
        self._fine()
        self.step = "fill"
        self._fill(list(self.chosen.values()))

    def _coarse(self, series: Sequence[Setting]) -> None:
        want = []
        for s in series:
            ladder = self.feasible(s)
            if ladder:
                want += [(s, b) for b in dict.fromkeys((ladder[0], ladder[-1]))]
        self._round(want)

    def probe(self, s: Setting) -> int | None:
        """The largest ladder batch within the target as far as bisection knows (no target: the
        largest that fits); None when even the smallest is outside it or failed."""
        ladder = self.feasible(s)
        known = {b: self.results.get((s, b)) for b in ladder}
        ok = [b for b in ladder if isinstance(known[b], Point)]
        if not ok:
            return None
        if self.target is None:
            return ok[-1]
        meet = [b for b in ok if known[b].ms <= self.target]
        return meet[-1] if meet else None

    def _gap(self, s: Setting) -> int | None:
        """The ladder batch bisection asks next for ``s`` (None: it knows enough)."""
        ladder = self.feasible(s)
        if self.target is None or not ladder:
            return None
        known = {i: self.results.get((s, b)) for i, b in enumerate(ladder)}
        ok = {i: p for i, p in known.items() if isinstance(p, Point)}
        meet = [i for i, p in ok.items() if p.ms <= self.target]
        lo = max(meet, default=-1)
        above = [i for i, p in ok.items() if i > lo and p.ms > self.target]
        hi = min(above, default=len(ladder))
        if hi - lo <= 1 or lo < 0 or hi >= len(ladder):
            return None  # found, or an end is outside the target or failed: nothing to bisect
        # the time per iteration is close to affine in the batch: aim where the line between
        # the two known points crosses the target, strictly between them
        a, z = ok[lo], ok[hi]
        aim = a.batch + (self.target - a.ms) * (z.batch - a.batch) / (z.ms - a.ms)
        i = min(range(lo + 1, hi), key=lambda j: (abs(ladder[j] - aim), j))
        return ladder[i] if known.get(i) is None else None

    def _bisect(self, series: Sequence[Setting]) -> None:
        while True:
            want = [(s, b) for s in series if (b := self._gap(s)) is not None]
            want = [p for p in want if p not in self.results]
            if not want:
                return
            self._round(want)

    def _probe_of(self, s: Setting) -> int | None:
        p = self.probe(s)
        if p is None:
            ladder = [b for b in self.feasible(s) if isinstance(self.results.get((s, b)), Point)]
            p = ladder[0] if ladder else None
        return p

    def _contending(self, defaults: Sequence[Setting]) -> list[Setting]:
        """The default settings whose layout is worth tuning the knobs of: per schedule, those
        whose best point scores within :data:`LAYOUT_SLACK` of the schedule's best layout."""
        score = {s: self.score(self._best_point(s)) for s in defaults}
        out = []
        for name in dict.fromkeys(s.schedule for s in defaults):
            mine = [s for s in defaults if s.schedule == name and score[s][0] >= 0]
            if not mine:
                continue
            top = max(score[s] for s in mine)
            for s in mine:
                sc = score[s]
                if sc[0] == top[0] and (
                    sc[1] >= top[1] - LAYOUT_SLACK * abs(top[1]) if top[0] == 1 else sc == top
                ):
                    out.append(s)
        return out

    def _knobs(self, families: Sequence[tuple[str, int, int]], keep: Callable[[Dim], bool]) -> None:
        """One pass over the knobs ``keep`` selects, at each family's probe batch, from its
        chosen setting (module docstring, step 3)."""
        trials: dict[tuple[str, int, int], list[tuple[Dim, Setting]]] = {}
        want = []
        for fam in families:
            cur = self.chosen[fam]
            b = self._probe_of(cur)
            if b is None:
                continue
            for dim in self._dims(cur):
                if not keep(dim):
                    continue
                for v in dim.values:
                    s = cur.with_value(dim.name, v, dim.default, dim.on_gpu)
                    if b in self.feasible(s):
                        trials.setdefault(fam, []).append((dim, s))
                        want.append((s, b))
        self._round(want)
        combos = []
        for fam, tried in trials.items():
            cur = self.chosen[fam]
            b = self._probe_of(cur)
            base_score = self.score(self.results.get((cur, b)))
            best: dict[str, tuple[tuple[int, float], Setting, Dim]] = {}
            for dim, s in tried:
                sc = self.score(self.results.get((s, b)))
                if sc > base_score and (dim.name not in best or sc > best[dim.name][0]):
                    best[dim.name] = (sc, s, dim)
            if len(best) > 1:
                combo = cur
                for _, s, dim in best.values():
                    combo = combo.with_value(dim.name, s.value(dim.name), dim.default, dim.on_gpu)
                if b in self.feasible(combo):
                    combos.append((combo, b))
        self._round(combos)
        for fam, tried in trials.items():
            cur = self.chosen[fam]
            b = self._probe_of(cur)
            cands = [cur, *(s for _, s in tried), *(c for c, bb in combos if c.schedule == fam[0]
                     and (c.ep, c.pp) == fam[1:])]  # fmt: skip
            self.chosen[fam] = max(
                cands, key=lambda s: (self.score(self.results.get((s, b))), -len(s.label()))
            )

    def _dims(self, s: Setting) -> tuple[Dim, ...]:
        return dims(self.d, self.space, s.schedule, deepep_normal(self.d, s))

    def _refresh(self, series: Sequence[Setting]) -> None:
        """The probe batch of chosen settings that are not their family's default: a walk
        along the ladder from the batch their knobs were chosen at, up while within the target,
        down while outside it (the default's bisection already placed it close)."""
        fresh = [s for s in series if s.knobs or s.gpu or s.drafts]
        while self.target is not None:
            want = []
            for s in fresh:
                ladder = self.feasible(s)
                done = {b: p for b in ladder if isinstance(p := self.results.get((s, b)), Point)}
                if not done:
                    continue
                meet = [b for b, p in done.items() if p.ms <= self.target]
                if meet:
                    i = ladder.index(max(meet)) + 1
                    nxt = ladder[i] if i < len(ladder) else None
                else:
                    i = ladder.index(min(done)) - 1
                    nxt = ladder[i] if i >= 0 else None
                if nxt is not None and (s, nxt) not in self.results:
                    want.append((s, nxt))
            if not want:
                return
            self._round(want)

    def _in_contention(self) -> list[tuple[str, int, int]]:
        """The families whose best point so far scores within :data:`CONTENTION` of the best
        family's (the same class: within the target, or all outside it)."""
        bests = {f: self.score(self._best_point(s)) for f, s in self.chosen.items()}
        top = max(bests.values(), default=(-1, 0.0))
        if top[0] < 0:
            return []
        return [
            f
            for f, sc in bests.items()
            if sc[0] == top[0] and (sc[1] >= top[1] - CONTENTION * abs(top[1]))
        ]

    def _fine(self) -> None:
        """Midpoints beside the chosen value of each numeric knob, for the families in
        contention (module docstring, step 3)."""
        want, trials = [], []
        for fam in self._in_contention():
            s = self.chosen[fam]
            b = self._probe_of(s)
            if b is None:
                continue
            for dim in self._dims(s):
                c = s.value(dim.name)
                if not dim.numeric or c is None or isinstance(c, bool):
                    continue
                grid = sorted({*dim.values, *([dim.default] if dim.default is not None else [])})
                if c not in grid:
                    continue
                i = grid.index(c)
                for other in (
                    grid[i - 1] if i else None,
                    grid[i + 1] if i + 1 < len(grid) else None,
                ):
                    if other is None:
                        continue
                    m = (c + other) / 2
                    m = round(m) if isinstance(c, int) and isinstance(other, int) else m
                    if m in grid or m == c:
                        continue
                    t = s.with_value(dim.name, m, dim.default, dim.on_gpu)
                    if b in self.feasible(t):
                        want.append((t, b))
                        trials.append((fam, t, b))
        self._round(want)
        changed = []
        for fam, t, b in trials:
            cur = self.chosen[fam]
            if self.score(self.results.get((t, b))) > self.score(self.results.get((cur, b))):
                self.chosen[fam] = t
                changed.append(t)
        self._refresh(changed)

    def _best_point(self, s: Setting) -> Point | None:
        return max(self.points(s), key=lambda p: self.score(p), default=None)

    def _every_setting(self, base: Setting) -> list[Setting]:
        """Every combination of ``base``'s knob values (exhaustive search), the GPU's DeepEP
        normal-kernel fields only where normal kernels run."""
        plain = [x for x in self._dims(base) if not x.on_gpu]
        out = []
        for values in itertools.product(*((x.default, *x.values) for x in plain)):
            s = base
            for x, v in zip(plain, values, strict=True):
                s = s.with_value(x.name, v, x.default, x.on_gpu)
            gpu_dims = [x for x in self._dims(s) if x.on_gpu]
            for gv in itertools.product(*((x.default, *x.values) for x in gpu_dims)):
                t = s
                for x, v in zip(gpu_dims, gv, strict=True):
                    t = t.with_value(x.name, v, x.default, x.on_gpu)
                out.append(t)
        return list(dict.fromkeys(out))

    # ---- the fill and its pruning -------------------------------------------------------------

    def safe(self, s: Setting) -> bool:
        """Whether ``s``'s points bear the pruning's two assumptions: time per iteration does
        not fall as the batch grows, and tokens per iteration are proportional to the batch."""
        pts = sorted(self.points(s), key=lambda p: p.batch)
        for a, b in itertools.pairwise(pts):
            if b.ms < a.ms * (1 - TOL):
                return False
        ks = [p.tps * p.ms / p.batch for p in pts]
        return all(abs(k - ks[0]) <= TOL * abs(ks[0]) for k in ks)

    def prunable(self, s: Setting, b: int) -> bool:
        """Whether no point of ``s`` at batch ``b`` can be on the frontier (module docstring)."""
        below = [p for p in self.points(s) if p.batch < b]
        if not below or not self.safe(s):
            return False
        ref = max(below, key=lambda p: p.batch)
        corner = Point(s, b, ref.ms, ref.tps * b / ref.batch * (1 + TOL), ref.iterations)
        rivals = self.points()
        if self.per_schedule:
            rivals = [q for q in rivals if q.setting.schedule == s.schedule]
        return any(dominates(q, corner) for q in rivals)

    def _fill(self, series: Sequence[Setting]) -> None:
        """Every series over its ladder, lowest batches first, skipping what is pruned. Series
        with a point on the frontier so far go first (two batches each a round), the others
        only once those have nothing left (one each): points that dominate are known sooner,
        and more is pruned."""
        while True:
            if self.per_schedule:
                front = {
                    p.setting
                    for name in {s.schedule for s in series}
                    for p in pareto(q for q in self.points() if q.setting.schedule == name)
                }
            else:
                front = {p.setting for p in pareto(self.points())}
            todo = {}
            for s in series:
                rest = [b for b in self.feasible(s) if (s, b) not in self.results]
                rest = [b for b in rest if not self.prunable(s, b)]
                if rest:
                    todo[s] = rest
            lead = [s for s in todo if s in front]
            pick = lead or list(todo)
            if not pick:
                return
            self._round((s, b) for s in pick for b in todo[s][: 2 if lead else 1])
