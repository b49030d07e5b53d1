"""The Trace: what both interpreters return, and the metrics read from it.

A Trace is a flat tuple of Spans (``shared/outputs/span.py``: one kernel on a stream, one slice
of host work, one transfer on a link) plus free-form ``meta``. Metrics are computed from span
unions, so the same numbers come out whether the spans were simulated (sim/), measured with CUDA
events (real/) or imported from a torch.profiler trace.

Lane names: ``"host:<thread>"``, ``"stream:<name>"``, ``"link:<nvlink|rdma|pcie>"``.
Times are microseconds (float).

Tracks: Perfetto cannot draw overlapping slices on one track, so spans that overlap inside one
lane are moved to sub-tracks named ``"<lane> #2"``, ``"<lane> #3"``...; :meth:`Trace.tracks` is
that layout, which the Chrome/Perfetto JSON (``shared/outputs/chrome.py``, through
:meth:`Trace.to_chrome` and :meth:`Trace.from_chrome`) and the figures use. This module imports
neither matplotlib, torch nor simpy.
"""

from __future__ import annotations

import gc
import operator
from collections.abc import Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.outputs import chrome
from overlap_lab.shared.outputs.span import (
    COMM_KINDS,
    LANE_PREFIXES,
    SPAN_KINDS,
    Span,
    Track,
    new_span,
)

#: The Trace's own types (``shared.outputs.span``) are importable from here, where they are read.
__all__ = [
    "COMM_KINDS",
    "LANE_PREFIXES",
    "SPAN_KINDS",
    "Interval",
    "Span",
    "Trace",
    "Track",
    "intersect",
    "lane_order",
    "length",
    "load_json",
    "merge",
    "new_span",
    "no_gc",
    "provenance",
    "save_json",
    "union",
]

Interval = tuple[float, float]
_END = operator.attrgetter("end")


def _on_rank(spans: tuple[Span, ...], rank: int) -> tuple[Span, ...]:
    """``spans`` copied onto ``rank`` (:meth:`Span.on_rank` inlined: an EP-32 run makes ~65k
    copies; only the rank differs, so they are not validated again)."""
    new, set_dict = object.__new__, object.__setattr__
    out = []
    append = out.append
    for s in spans:
        d = s.__dict__.copy()
        d["rank"] = rank
        c = new(Span)
        set_dict(c, "__dict__", d)
        append(c)
    return tuple(out)


@contextmanager
def no_gc():
    """The cyclic garbage collector paused: building the ~100k acyclic dicts or spans of an
    explicit run's trace otherwise triggers collections that walk every live object, about
    half the time of :meth:`Trace.to_chrome` at EP 32. Reference counting still frees."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# ---------------------------------------------------------------------------------------------
# Interval arithmetic on sorted, disjoint interval lists.


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Merge intervals into sorted disjoint ones (touching intervals merge)."""
    it = iter(sorted(intervals))
    first = next(it, None)
    if first is None:
        return []
    out: list[Interval] = []
    lo, hi = first
    for a, b in it:  # (the open interval in locals: this runs per span of every lane)
        if a <= hi:
            if b > hi:
                hi = b
        else:
            out.append((lo, hi))
            lo, hi = a, b
    out.append((lo, hi))
    return out


def length(intervals: Iterable[Interval]) -> float:
    """Total length of the union of ``intervals``."""
    return sum(hi - lo for lo, hi in union(intervals))


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Intersection of two sorted disjoint interval lists (outputs of :func:`union`)."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def lane_order(lane: str) -> int:
    """Track order on a rank: host threads, then streams, then links, then anything else."""
    for i, prefix in enumerate(LANE_PREFIXES):
        if lane.startswith(prefix):
            return i
    return len(LANE_PREFIXES)


def _span_key(s: Span) -> tuple:
    return (
        s.start,
        s.end,
        s.op,
        s.kind,
        s.sms,
        _none_last(s.mb),
        _none_last(s.layer),
        _none_last(s.step),
    )


#: lane -> lane_order(lane), filled as lanes are met (a run has a few dozen lanes)
_LANE_ORDER: dict[str, int] = {}


def _canonical_key(s: Span) -> tuple:
    """(start, rank, lane order, lane, then :func:`_span_key`'s fields): written out, as sorting
    a run's spans calls it once per span."""
    lane = s.lane
    order = _LANE_ORDER.get(lane)
    if order is None:
        order = lane_order(lane)
        if len(_LANE_ORDER) < 4096:
            _LANE_ORDER[lane] = order
    mb, layer, step = s.mb, s.layer, s.step
    return (
        s.start,
        s.rank,
        order,
        lane,
        s.end,
        s.op,
        s.kind,
        s.sms,
        (1, 0) if mb is None else (0, mb),
        (1, 0) if layer is None else (0, layer),
        (1, 0) if step is None else (0, step),
    )


_START = operator.attrgetter("start")


def _canonical_order(spans: Iterable[Span]) -> tuple[Span, ...]:
    """``spans`` sorted by :func:`_canonical_key`: by start time alone (a C-level key), then each
    run of equal starts by the whole key (a run's spans are few; building the whole key for
    every span was most of a Trace's construction)."""
    out = sorted(spans, key=_START)
    starts = list(map(_START, out))
    ties = [i for i, (a, b) in enumerate(zip(starts, starts[1:])) if a == b]
    k = 0
    while k < len(ties):
        lo = hi = ties[k]
        while k + 1 < len(ties) and ties[k + 1] == hi + 1:
            k += 1
            hi += 1
        out[lo : hi + 2] = sorted(out[lo : hi + 2], key=_canonical_key)
        k += 1
    return tuple(out)


def _none_last(x: int | None) -> tuple[int, int]:
    return (1, 0) if x is None else (0, x)


# ---------------------------------------------------------------------------------------------


class _Spans:
    """:attr:`Trace.spans` (a dataclass field with this descriptor as its default, ``()``): the
    tuple as stored, or, for a Trace whose ranks are alike (:meth:`Trace.replicated`), built on
    first read. Every per-rank query of such a Trace reads the model rank's spans alone, so a
    run whose ranks were simulated once (``shared.ir.symmetry``) copies its spans to every rank
    only where something reads them all."""

    def __get__(self, obj: Trace | None, owner: type | None = None) -> tuple[Span, ...]:
        if obj is None:
            return ()
        spans = obj.__dict__.get("_spans")
        if spans is None:
            spans = obj.__dict__["_spans"] = obj._interleave()
        return spans

    def __set__(self, obj: Trace, value: tuple[Span, ...]) -> None:
        obj.__dict__["_spans"] = value


@dataclass(frozen=True)
class Trace:
    """Spans of one run (every rank) plus ``meta`` (schedule, model, gpu, mode, num_sms, world,
    backend, ...).

    ``spans`` may be given as any iterable in any order; it is stored as a tuple in canonical
    order (start, rank, lane, then the rest), so two traces of the same spans compare equal and
    export to the same bytes whatever order an interpreter emitted them in.
    """

    spans: tuple[Span, ...] = _Spans()  # type: ignore[assignment]
    meta: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "spans", _canonical_order(self.spans))

    @classmethod
    def replicated(
        cls, model: tuple[Span, ...], ranks: tuple[int, ...], meta: dict[str, Any]
    ) -> Trace:
        """The Trace in which every rank of ``ranks`` runs ``model`` (rank ``ranks[0]``'s spans,
        in canonical order): each other rank's spans are ``model``'s, index for index, with only
        ``rank`` changed (:meth:`Span.on_rank`). Equal to ``Trace`` of all those spans; per-rank
        layouts and sums (:meth:`lanes`, :meth:`tracks`, :meth:`busy_us`,
        :meth:`per_rank_step_us`, :meth:`to_chrome`) are worked out once, on the model, and
        reused (the same floats, summed in the same order), and the copies are made only when
        ``spans`` or another rank's spans are read (``shared.ir.symmetry.expand_trace``)."""
        if not model or any(s.rank != ranks[0] for s in model):
            raise ValueError("a replicated trace needs the model rank's spans")
        t = object.__new__(cls)
        object.__setattr__(t, "meta", meta)
        t.__dict__["_alike"] = (ranks[0], tuple(ranks), model)
        return t

    def _model(self, rank: int) -> int:
        """The rank whose spans ``rank``'s copy (itself unless the Trace is replicated)."""
        alike = self.__dict__.get("_alike")
        return alike[0] if alike is not None and rank in alike[1] else rank

    def _interleave(self) -> tuple[Span, ...]:
        """A replicated Trace's spans in canonical order, (start, rank, rest): the model's spans
        of one start, then the next rank's copies of them, ..."""
        _, ranks, model = self.__dict__["_alike"]
        by, n = self._by_rank, len(model)
        flat = [s for r in ranks for s in by[r]]  # the i-th rank's k-th span at i * n + k
        cuts = [k for k in range(1, n) if model[k].start != model[k - 1].start]
        order = [
            i * n + k
            for lo, hi in zip([0, *cuts], [*cuts, n])
            for i in range(len(ranks))
            for k in range(lo, hi)
        ]
        return tuple([flat[i] for i in order])

    # -- selection --------------------------------------------------------------------------

    @cached_property
    def _by_rank(self) -> dict[int, tuple[Span, ...]]:
        """Spans grouped by rank, each group in canonical order (built once)."""
        alike = self.__dict__.get("_alike")
        if alike is not None:
            first, ranks, model = alike
            with no_gc():
                return {r: model if r == first else _on_rank(model, r) for r in ranks}
        by: dict[int, list[Span]] = {}
        for s in self.spans:
            by.setdefault(s.rank, []).append(s)
        return {r: tuple(v) for r, v in by.items()}

    def _lanes_of(self, rank: int) -> dict[str, list[Span]]:
        """The spans of ``rank`` grouped by lane, each group in canonical order (built once per
        rank: every per-rank and per-lane query reads it instead of rescanning all spans)."""
        cache = self.__dict__.setdefault("_lane_cache", {})
        lanes = cache.get(rank)
        if lanes is None:
            lanes = cache[rank] = {}
            for s in self.spans_of(rank):
                lanes.setdefault(s.lane, []).append(s)
        return lanes

    def spans_of(self, rank: int) -> tuple[Span, ...]:
        """The spans of ``rank``, in canonical order (a float sum over them is the same as over
        ``spans`` filtered by rank)."""
        alike = self.__dict__.get("_alike")
        if alike is not None and rank == alike[0]:
            return alike[2]
        return self._by_rank.get(rank, ())

    def _rank_spans(self, rank: int) -> list[Span]:
        """The spans of ``rank`` (in canonical order within each lane)."""
        return [s for spans in self._lanes_of(rank).values() for s in spans]

    @property
    def ranks(self) -> tuple[int, ...]:
        alike = self.__dict__.get("_alike")
        return tuple(sorted(alike[1] if alike is not None else self._by_rank))

    def lanes(self, rank: int = 0) -> tuple[str, ...]:
        """Lanes of ``rank`` in track order (host, streams, links), then by first start, name."""
        by_lane = self._lanes_of(self._model(rank))
        # canonical order starts with the start time: a lane's first span has its earliest start
        first = {ln: spans[0].start for ln, spans in by_lane.items()}
        return tuple(sorted(first, key=lambda ln: (lane_order(ln), first[ln], ln)))

    def select(
        self, *, rank: int | None = None, lane: str | None = None, kind: str | None = None
    ) -> Trace:
        """The spans matching every given filter, same meta."""
        spans = (
            s
            for s in self.spans
            if (rank is None or s.rank == rank)
            and (lane is None or s.lane == lane)
            and (kind is None or s.kind == kind)
        )
        return Trace(spans, self.meta)

    def tracks(self, rank: int = 0) -> tuple[Track, ...]:
        """The Perfetto layout of ``rank``: per lane, overlapping spans go to sub-tracks.

        Greedy interval partitioning in start order: each span takes the first sub-track whose
        last span has ended, so a lane with no overlap keeps a single track named as the lane.
        """
        model = self._model(rank)
        cache = self.__dict__.setdefault("_layout_cache", {})
        layout = cache.get(model)
        if layout is None:
            layout = cache[model] = self._layout(model)
        by_lane = self._lanes_of(model) if model == rank else self._lanes_of_alike(rank)
        return tuple(
            Track(name, ln, tuple(by_lane[ln][i] for i in row)) for name, ln, row in layout
        )

    def _layout(self, rank: int) -> list[tuple[str, str, list[int]]]:
        """(track name, lane, positions in the lane's spans) of ``rank``'s tracks (see
        :meth:`tracks`): positions, so that alike ranks reuse them."""
        by_lane = self._lanes_of(rank)
        out: list[tuple[str, str, list[int]]] = []
        for ln in self.lanes(rank):
            rows: list[list[int]] = []
            ends: list[float] = []  # each row's last end
            # within one (rank, lane), canonical order is _span_key order
            for i, s in enumerate(by_lane[ln]):
                for k, end in enumerate(ends):
                    if end <= s.start:
                        rows[k].append(i)
                        ends[k] = s.end
                        break
                else:
                    rows.append([i])
                    ends.append(s.end)
            for k, row in enumerate(rows):
                out.append((ln if k == 0 else f"{ln} #{k + 1}", ln, row))
        return out

    def _lanes_of_alike(self, rank: int) -> dict[str, list[Span]]:
        """``rank``'s spans per lane, cut from its canonical tuple at the model rank's lane
        positions (no per-span grouping: the ranks are alike)."""
        cache = self.__dict__.setdefault("_lane_cache", {})
        lanes = cache.get(rank)
        if lanes is None:
            where = self.__dict__.get("_lane_pos")
            if where is None:
                where = {}
                for i, s in enumerate(self.spans_of(self._model(rank))):
                    where.setdefault(s.lane, []).append(i)
                self.__dict__["_lane_pos"] = where
            mine = self._by_rank[rank]
            lanes = cache[rank] = {ln: [mine[i] for i in idx] for ln, idx in where.items()}
        return lanes

    # -- metrics -----------------------------------------------------------------------------

    @property
    def step_time_us(self) -> float:
        """Latest end minus earliest start over all spans of all ranks (0 for an empty trace)."""
        alike = self.__dict__.get("_alike")
        spans = alike[2] if alike is not None else self.spans  # every rank: the same times
        if not spans:
            return 0.0
        return self._last_end - spans[0].start  # canonical order starts with the start

    @cached_property
    def _last_end(self) -> float:
        alike = self.__dict__.get("_alike")
        return max(map(_END, alike[2] if alike is not None else self.spans))

    def per_rank_step_us(self) -> dict[int, float]:
        """Latest end minus earliest start of each rank's spans."""
        memo: dict[int, float] = {}
        out = {}
        for r in self.ranks:
            m = self._model(r)
            if m not in memo:
                spans = self.spans_of(m)
                memo[m] = max(map(_END, spans)) - spans[0].start
            out[r] = memo[m]
        return out

    def busy_us(self, rank: int | None = None) -> dict[str, float]:
        """Busy time per lane: the length of the union of its spans (overlaps count once).

        Host ``sync`` spans (a thread blocked on an event) are waiting, not work, and are left
        out. Keys: with ``rank`` given, or when the trace has a single rank, the lane name
        (``"stream:main"``); otherwise ``"r{rank}/{lane}"`` for every rank. Ordered by rank,
        then track order.
        """
        ranks = self.ranks if rank is None else (rank,)
        prefixed = rank is None and len(ranks) > 1
        out: dict[str, float] = {}
        memo: dict[int, list[tuple[str, float]]] = {}  # model rank -> its lanes' busy times
        for r in ranks:
            m = self._model(r)
            busy = memo.get(m)
            if busy is None:
                by_lane = self._lanes_of(m)
                busy = memo[m] = []
                for ln in self.lanes(m):
                    iv = [(s.start, s.end) for s in by_lane[ln] if s.kind != "sync"]
                    if iv:
                        busy.append((ln, length(iv)))
            for ln, v in busy:
                out[f"r{r}/{ln}" if prefixed else ln] = v
        return out

    def _union_of(self, rank: int, kinds: Iterable[str]) -> list[Interval]:
        ks = frozenset(kinds)
        return union((s.start, s.end) for s in self._rank_spans(rank) if s.kind in ks)

    def exposed_comm_us(self, rank: int = 0) -> float:
        """Communication not covered by computation on ``rank``.

        |C| - |C ∩ K| where C is the union of ``comm`` kernels and ``link`` transfers and K the
        union of ``compute`` kernels of that rank, all streams together.
        """
        comm = self._union_of(rank, COMM_KINDS)
        comp = self._union_of(rank, ("compute",))
        return length(comm) - length(intersect(comm, comp))

    def comm_only_us(self, rank: int = 0) -> float:
        """GPU time of ``rank`` during which only communication runs: |C \\ (K ∪ Y)|.

        C: union of ``comm``/``link`` spans, K: ``compute`` spans, Y: ``copy`` spans. Equal to
        :meth:`exposed_comm_us` when no copy overlaps exposed communication; smaller otherwise
        (a PCIe copy hiding a transfer keeps the GPU busy, though not computing).
        """
        comm = self._union_of(rank, COMM_KINDS)
        busy = self._union_of(rank, ("compute", "copy"))
        return length(comm) - length(intersect(comm, busy))

    def sm_utilisation(self, num_sms: int | None = None, rank: int = 0) -> float:
        """Fraction of the SM-time of the step that kernels held: Σ sms·duration over the
        ``stream:`` spans of ``rank``, divided by ``num_sms`` · :attr:`step_time_us`.

        ``num_sms`` defaults to ``meta["num_sms"]``. Kernels with unknown SM count (sms=0) add
        nothing. 0 for an empty trace.
        """
        n = num_sms if num_sms is not None else self.meta.get("num_sms")
        if not n or n <= 0:
            raise ConfigError("sm_utilisation needs num_sms > 0 (argument or meta['num_sms'])")
        step = self.step_time_us
        if step <= 0:
            return 0.0
        held = sum(  # in canonical order: the float sum is the same whatever the indexing
            s.sms * s.duration for s in self.spans_of(rank) if s.lane.startswith("stream:")
        )
        return held / (n * step)

    def summary(self, rank: int = 0) -> dict[str, Any]:
        """The headline numbers: step time, per-lane busy time (all ranks, keys as
        :meth:`busy_us`), exposed and comm-only communication and SM utilisation of ``rank``
        (the latter when ``meta`` has num_sms), number of spans."""
        out: dict[str, Any] = {
            "step_time_us": self.step_time_us,
            "busy_us": self.busy_us(),
            "exposed_comm_us": self.exposed_comm_us(rank),
            "comm_only_us": self.comm_only_us(rank),
        }
        if self.meta.get("num_sms"):
            out["sm_utilisation"] = self.sm_utilisation(rank=rank)
        alike = self.__dict__.get("_alike")
        out["num_spans"] = len(alike[2]) * len(alike[1]) if alike is not None else len(self.spans)
        return out

    # -- Chrome trace JSON -------------------------------------------------------------------

    def to_chrome(
        self, path: str | Path | None = None, *, provenance: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """The Chrome Trace Event JSON of this trace (``shared.outputs.chrome``); written to
        ``path`` too when given (``.gz`` suffix: gzip). ``provenance`` (:func:`provenance`: the
        tool's version, the command line, the full inputs) goes into ``otherData`` with the
        meta, so that a trace file says what produced it. Deterministic: same trace, same bytes.
        Events with equal ``args`` share one dict (every rank's copy of an op, all the events of
        ranks alike, :meth:`replicated`): the document is for writing out, not for editing in
        place."""
        meta = self.meta if provenance is None else {**self.meta, "provenance": provenance}
        with no_gc():
            doc = chrome.document(self.ranks, self._model, self.tracks, meta)
        if path is not None:
            chrome.write(doc, path)
        return doc

    @classmethod
    def from_chrome(
        cls, src: str | Path | dict | list, *, rank: int | None = None, num_sms: int | None = None
    ) -> Trace:
        """Read a Chrome trace: our own export (the exact spans written), or a torch.profiler
        (Kineto) trace, whose GPU events become spans (``shared.outputs.chrome.read`` says
        which, on what lanes and ranks, with how many SMs)."""
        spans, meta = chrome.read(src, rank=rank, num_sms=num_sms)
        return cls(spans, meta)


def provenance(
    command: Sequence[str] | None, inputs: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """What produced a results file: the tool and its installed version, the command line as
    typed (None: called from Python) and the full ``inputs`` (model, GPU with its overrides,
    schedule knobs, profile name, ...), as JSON values. No date, host or path of its own: the
    same command on the same inputs writes the same bytes (a byte-identity check of two runs
    compares their files whole)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("overlap-lab")
    except PackageNotFoundError:  # run from a source tree that was never installed
        v = "unknown"
    return {
        "tool": "overlap-lab",
        "version": v,
        "command": None if command is None else [str(c) for c in command],
        "inputs": chrome.jsonable(dict(inputs or {})),
    }


def save_json(trace: Trace, path: str | Path) -> Path:
    """Write ``trace`` as Chrome trace JSON (the one writer: :meth:`Trace.to_chrome`)."""
    trace.to_chrome(path)
    return Path(path)


def load_json(path: str | Path, **kw: Any) -> Trace:
    """Read a Chrome trace JSON (ours or torch.profiler's): :meth:`Trace.from_chrome`."""
    return Trace.from_chrome(path, **kw)


def merge(traces: Iterable[Trace], meta: dict[str, Any] | None = None) -> Trace:
    """One trace from several (e.g. one file per rank under torchrun); meta of the first unless
    given."""
    traces = list(traces)
    spans = tuple(s for t in traces for s in t.spans)
    return Trace(spans, dict(meta if meta is not None else (traces[0].meta if traces else {})))
