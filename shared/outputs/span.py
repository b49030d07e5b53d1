"""A Span: one busy interval of one lane, the element of every Trace (``shared/outputs/trace.py``),
and a Track, the spans of one Perfetto track. Their own module so that the Trace and its Chrome
reader and writer (``shared/outputs/chrome.py``) both build on them without importing each
other.

Lane names: ``"host:<thread>"``, ``"stream:<name>"``, ``"link:<nvlink|rdma|pcie>"``.
Times are microseconds (float).
"""

from __future__ import annotations

from dataclasses import dataclass

from overlap_lab.shared.errors import ConfigError

SPAN_KINDS: tuple[str, ...] = ("compute", "comm", "copy", "host", "link", "sync")
COMM_KINDS = frozenset({"comm", "link"})
LANE_PREFIXES: tuple[str, ...] = ("host:", "stream:", "link:")


@dataclass(frozen=True)
class Span:
    """One busy interval of one lane: a kernel, a copy, host work, a host sync or a transfer.

    ``sms`` is the number of SMs the kernel held (0 for host work, copies, links and kernels whose
    SM count is unknown); ``mb``, ``layer`` and ``step`` say which micro-batch, layer and decode
    step the work belongs to (None where it belongs to none).
    """

    rank: int
    lane: str
    op: str
    kind: str
    start: float
    end: float
    sms: int = 0
    mb: int | None = None
    layer: int | None = None
    step: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in SPAN_KINDS:
            raise ConfigError(
                f"span {self.op!r}: kind must be one of {SPAN_KINDS}, got {self.kind!r}"
            )
        if not self.end >= self.start:
            raise ConfigError(
                f"span {self.op!r} on {self.lane}: end {self.end} < start {self.start}"
            )

    @property
    def duration(self) -> float:
        return self.end - self.start

    def on_rank(self, rank: int) -> Span:
        """This span on ``rank`` (a copy; not validated again: only the rank differs)."""
        new = object.__new__(Span)
        new.__dict__.update(self.__dict__)
        new.__dict__["rank"] = rank
        return new


def new_span(rank, lane, op, kind, start, end, sms=0, mb=None, layer=None, step=None) -> Span:
    """``Span(...)`` with its fields written as one ``__dict__`` and checked by ``Span``'s own
    ``__post_init__``: the frozen dataclass's ``__init__`` stores each field through
    ``object.__setattr__`` (~3.4 µs a span, ~10 % of a decode step's simulation; this ~1 µs).
    The simulator makes its spans with it; keep the dict's keys in ``Span``'s field order."""
    s = object.__new__(Span)
    object.__setattr__(
        s,
        "__dict__",
        {
            "rank": rank,
            "lane": lane,
            "op": op,
            "kind": kind,
            "start": start,
            "end": end,
            "sms": sms,
            "mb": mb,
            "layer": layer,
            "step": step,
        },
    )
    s.__post_init__()
    return s


@dataclass(frozen=True)
class Track:
    """One Perfetto track (and one row of a timeline figure): a lane or one of its sub-tracks."""

    name: str  # "stream:main" or "stream:main #2"
    lane: str
    spans: tuple[Span, ...]
