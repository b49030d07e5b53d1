"""One trace's timeline: one row per host thread, stream and link of a rank, bars coloured by
what the op is, micro-batches hatched, one legend; a file of one rank, or of every rank where the
schedule's drawing rule asks for it (``shared.schedules.drawing``: a pipeline's stages)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from overlap_lab.figures.style import (
    CATEGORY_COLORS,
    FLOW_COLOR,
    LEGEND_EM,
    _check_suffix,
    _figure,
    _legend_ncol,
    _mb_key,
    _save,
    _Style,
    _style,
    figure_unit,
    mb_hatch,
    op_category,
    text_width,
)
from overlap_lab.figures.windows import moe_layers_of, parse_window, resolve_window, whole_window
from overlap_lab.shared import schedules
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.outputs.trace import Span, Trace, Track, union

# ---------------------------------------------------------------------------------------------
# Lanes

#: Streams in the order schedules name them; others follow alphabetically.
STREAM_ORDER = (
    "schedule",
    "main",
    "forward",
    "ubatch0",
    "ubatch1",
    "alt",
    "comm",
    "comm0",
    "comm1",
    "pp_recv",
    "pp_send",
    "copy",
)
LINK_ORDER = ("nvlink", "rdma", "pcie")


def lane_key(lane: str) -> tuple:
    """The one fixed order of lanes in every panel: host threads, streams, links, the rest;
    inside each, known names first in :data:`STREAM_ORDER`/:data:`LINK_ORDER`, then by name."""
    prefix, _, name = lane.partition(":")
    group = {"host": 0, "stream": 1, "link": 2}.get(prefix, 3)
    order = STREAM_ORDER if prefix == "stream" else LINK_ORDER if prefix == "link" else ()
    known = order.index(name) if name in order else len(order)
    return (group, known, name)


_SUB_ROW = re.compile(r" #(\d+)$")


def track_key(t: Track) -> tuple:
    """:func:`lane_key`, then the overflow row by number (``#2`` before ``#10``)."""
    m = _SUB_ROW.search(t.name)
    return (lane_key(t.lane), int(m.group(1)) if m else 1)


def visible_tracks(trace: Trace, rank: int, t0: float, t1: float) -> list[Track]:
    """The rows of ``rank`` with a span inside [t0, t1], in :func:`track_key` order; overflow
    rows are computed on the window, so a stream gets a second row only if spans overlap there.
    A link's overflow rows are its concurrent flows: they are merged into the link's one row
    (drawn by :func:`flow_pieces`)."""
    inside = Trace(
        [s for s in trace.spans if s.rank == rank and s.end > t0 and s.start < t1], trace.meta
    )
    rows: list[Track] = []
    links: dict[str, list[Span]] = {}
    for t in inside.tracks(rank):
        if t.lane.startswith("link:"):
            links.setdefault(t.lane, []).extend(t.spans)
        else:
            rows.append(t)
    rows += [Track(lane, lane, tuple(sp)) for lane, sp in links.items()]
    return sorted(rows, key=track_key)


def flow_pieces(spans: Iterable[Span]) -> list[tuple[Span, int, float, float]]:
    """(span, flow, start, end) of what shows of each span of one link row.

    Overlapping spans are concurrent flows: flow k is the k-th that runs at once (each span takes
    the lowest flow free at its start, as :meth:`Trace.tracks` assigns sub-tracks). Flow k shows
    where no lower flow runs, so staggered chunks read as pieces in the order they complete."""
    ends: list[float] = []
    flows: list[list[Span]] = []
    for s in sorted(spans, key=lambda s: (s.start, s.end)):
        k = next((i for i, e in enumerate(ends) if e <= s.start), len(ends))
        if k == len(ends):
            ends.append(s.end)
            flows.append([])
        ends[k] = s.end
        flows[k].append(s)
    out: list[tuple[Span, int, float, float]] = []
    cover: list[tuple[float, float]] = []  # union of the lower flows, sorted and disjoint
    for k, flow in enumerate(flows):
        for s in flow:
            for a, b in _minus((s.start, s.end), cover):
                out.append((s, k, a, b))
            if s.start == s.end:
                out.append((s, k, s.start, s.end))
        cover = union([*cover, *((s.start, s.end) for s in flow)])
    return out


def _minus(iv: tuple[float, float], cover: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``iv`` less the sorted, disjoint intervals ``cover``."""
    import bisect

    a, b = iv
    out = []
    i = max(0, bisect.bisect_right(cover, (a, float("inf"))) - 1)
    for c, d in cover[i:]:
        if c >= b:
            break
        if d <= a:
            continue
        if c > a:
            out.append((a, c))
        a = max(a, d)
        if a >= b:
            break
    if a < b:
        out.append((a, b))
    return out


# ---------------------------------------------------------------------------------------------
# Drawing


def _label(op: str) -> str:
    return op.removeprefix("sync ")


def timeline(
    trace: Trace,
    ax: Any = None,
    rank: int = 0,
    title: str | None = None,
    window: Any = None,
    legend: bool = True,
    labels: bool = True,
    *,
    width: str | float | None = None,
    shift: bool = False,
    seen: set[tuple[str, int | None]] | None = None,
    unit: tuple[str, float] | None = None,
) -> Any:
    """Draw the timeline of ``rank`` on ``ax`` (a new figure's axis when None); return the axis.

    One row per visible track, bars coloured by :func:`op_category`, micro-batches hatched.
    ``window`` is anything :func:`parse_window` reads or (t0, t1) in µs; ``shift`` puts t0 at 0
    (panels of different schedules side by side). ``seen`` collects (category, mb) drawn, for a
    shared legend. ``unit`` (:func:`time_unit`): the figure's one time unit (default: the
    window's, :func:`figure_unit`)."""
    st = _style(width)
    # (t0, t1): the caller's cut (a panel of a set, checked against the set), drawn as given
    t0, t1 = (
        map(float, window) if isinstance(window, tuple) else resolve_window(trace, window, rank)
    )
    if t1 <= t0:
        raise ConfigError(f"timeline window must have t0 < t1, got ({t0}, {t1})")
    tracks = visible_tracks(trace, rank, t0, t1)
    if ax is None:
        fig = _figure(len(tracks), st, legend=legend_handles(_seen_in(trace, rank, t0, t1)))
        ax = fig.add_subplot(1, 1, 1)
    span_us = t1 - t0
    unit, scale = unit or figure_unit(span_us)
    x0 = t0 if shift else 0.0
    op_class = trace.meta.get("op_class") if isinstance(trace.meta.get("op_class"), dict) else None
    drawn = seen if seen is not None else set()
    # data units per point, to decide where a label fits: the axis spans about 80 % of the width
    us_per_pt = span_us / (0.8 * st.width * 72)
    for row, track in enumerate(tracks):
        y = len(tracks) - 1 - row
        groups: dict[tuple[str, int | None, int], list[tuple[float, float]]] = {}
        if track.lane.startswith("link:"):
            pieces = flow_pieces(track.spans)
        else:
            pieces = [(s, 0, s.start, s.end) for s in track.spans]
        for s, flow, start, end in pieces:
            a, b = max(start, t0), min(end, t1)
            if b <= a and not (start == end and t0 <= start <= t1):
                continue
            cat = op_category(s, op_class)
            # at least half a point wide, so that short kernels of a long window stay visible
            groups.setdefault((cat, s.mb, flow % 2), []).append(  # odd flows: a lighter face
                ((a - x0) / scale, max(b - a, 0.5 * us_per_pt) / scale)
            )
            if flow:
                drawn.add(("#flows", None))
            text = _label(s.op)
            if labels and len(text) * st.font * 0.55 * us_per_pt < 0.92 * (b - a):
                hatched = bool(mb_hatch(s.mb))
                face, ink = CATEGORY_COLORS[cat]
                ax.text(
                    ((a + b) / 2 - x0) / scale,
                    y,
                    text,
                    ha="center",
                    va="center",
                    fontsize=st.font - 1,
                    color="black" if hatched else ink,
                    clip_on=True,
                    bbox=dict(boxstyle="square,pad=0.1", fc="white", ec="none", alpha=0.85)
                    if hatched
                    else None,
                )
        for (cat, mb, odd), bars in sorted(
            groups.items(),
            key=lambda kv: (list(CATEGORY_COLORS).index(kv[0][0]), _mb_key(kv[0][1]), kv[0][2]),
        ):
            ax.broken_barh(
                bars,
                (y - 0.42, 0.84),
                facecolors=FLOW_COLOR if odd else CATEGORY_COLORS[cat][0],
                edgecolors="white",  # the hatch colour; no outline (it would whiten thin bars)
                linewidth=0,
                hatch=mb_hatch(mb) or None,
            )
            drawn.add((cat, mb))
    ax.set_yticks(range(len(tracks)))
    ax.set_yticklabels([t.name for t in reversed(tracks)], fontsize=st.font)
    ax.set_ylim(-0.6, len(tracks) - 0.4)
    ax.set_xlim((t0 - x0) / scale, (t1 - x0) / scale)
    ax.set_xlabel(f"time ({unit})", fontsize=st.font)
    ax.tick_params(axis="x", labelsize=st.font)
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    if any(t.name != t.lane for t in tracks):
        drawn.add(("#overflow", None))
    if title is None:
        title = default_title(trace, rank)
    if title:
        ax.set_title(title, fontsize=st.font + 1, loc="left")
    if legend:
        add_legend(ax.figure, drawn, st)
    return ax


def legend_handles(seen: Iterable[tuple[str, int | None]]) -> list[Any]:
    """Legend patches: one per category drawn (in :data:`CATEGORY_COLORS` order), one hatch per
    micro-batch when there are several, and a note on overflow rows when any was drawn."""
    from matplotlib.patches import Patch

    seen = set(seen)
    cats = [c for c in CATEGORY_COLORS if any(c == s[0] for s in seen)]
    mbs = sorted({mb for cat, mb in seen if mb is not None and not cat.startswith("#")})
    handles = [Patch(facecolor=CATEGORY_COLORS[c][0], label=c) for c in cats]
    if len(mbs) > 1:
        handles += [
            Patch(
                facecolor="white", edgecolor="black", hatch=mb_hatch(mb), label=f"micro-batch {mb}"
            )
            for mb in mbs
        ]
    if any(c == "#flows" for c, _ in seen):
        handles.append(Patch(facecolor=FLOW_COLOR, label="alternate link chunks"))
    if any(c == "#overflow" for c, _ in seen):
        handles.append(
            Patch(facecolor="none", edgecolor="none", label="#2: overlapping on one lane")
        )
    return handles


def add_legend(fig: Any, seen: Iterable[tuple[str, int | None]], st: _Style | None = None) -> None:
    """One legend for the figure, below the plots, in as many columns as the width allows."""
    st = st or _style(None)
    handles = legend_handles(seen)
    if not handles:
        return
    ncol = _legend_ncol(handles, st)
    fig.legend(
        handles=handles,
        loc="outside lower center",
        ncol=ncol,
        fontsize=st.font,
        frameon=False,
        **LEGEND_EM,  # what _legend_ncol measured with
    )


def save_timeline(
    trace: Trace,
    path: str | Path,
    *,
    window: Any = None,
    rank: int | None = None,
    width: str | float | None = None,
    title: str | None = None,
    labels: bool = True,
    say_window: bool = True,
) -> Path:
    """Write the timeline of ``trace`` to ``path`` (png, pdf or svg from the suffix).

    ``rank`` None draws rank 0, or one panel per rank where the trace's schedule asks for it
    (``shared.schedules.drawing``: a pipeline's bubbles are across its stages). The heading:
    ``title`` (None: the workload; '': none) and, with ``say_window``, the layers drawn."""
    path = _check_suffix(path)
    st = _style(width)
    ranks = trace.ranks or (0,)
    if rank is not None:
        if rank not in ranks and trace.spans:
            raise ConfigError(f"--rank {rank}: the trace has ranks {', '.join(map(str, ranks))}")
        ranks = (rank,)
    elif not schedules.drawing(trace.meta.get("schedule")).every_rank:
        ranks = ranks[:1]
    spans = [resolve_window(trace, window, r) for r in ranks]
    t0, t1 = min(a for a, _ in spans), max(b for _, b in spans)
    rows = [len(visible_tracks(trace, r, t0, t1)) for r in ranks]
    win = parse_window(window)
    shown = ""
    if say_window and (win.kind == "layers" or (win.kind == "auto" and not whole_window(trace))):
        lo, hi = (int(win.lo), int(win.hi)) if win.kind == "layers" else (0, 1)
        n = len(moe_layers_of(trace, ranks[0]))
        shown = f"MoE layers {lo}-{hi} of {n}" if hi > lo else f"MoE layer {lo} of {n}"
    # one heading across the figure (the full width: no lane names beside it): the workload
    # and the window drawn, on one line where they fit; a panel per rank says its rank
    head = (
        title if title is not None else default_title(trace, None if len(ranks) > 1 else ranks[0])
    )
    lines = [x for x in (head, shown) if x]
    one = "; ".join(lines)
    heading = one if text_width(one, st.font + 1) <= st.width - 0.1 else "\n".join(lines)
    heading = st.wrap(heading, st.width - 0.1) if head or (shown and title != "") else ""
    heads = [f"rank {r}" if len(ranks) > 1 else "" for r in ranks]
    items = set().union(*(_seen_in(trace, r, t0, t1) for r in ranks))
    fig = _figure(
        sum(rows),
        st,
        titles=sum(h.count("\n") + 1 for h in (*heads, heading) if h),
        legend=legend_handles(items),
        panels=len(ranks),
    )
    if heading:
        fig.suptitle(heading, x=0.01, ha="left", fontsize=st.font + 1)
    axes = fig.subplots(
        len(ranks), 1, sharex=True, squeeze=False, height_ratios=[max(r, 1) for r in rows]
    )[:, 0]
    seen: set = set()
    for ax, r, head in zip(axes, ranks, heads, strict=True):
        timeline(
            trace,
            ax,
            rank=r,
            title=head,
            window=(t0, t1),
            legend=False,
            labels=labels,
            width=st.width,
            seen=seen,
        )
        if ax is not axes[-1]:
            ax.set_xlabel("")
            ax.tick_params(labelbottom=False)
    add_legend(fig, seen, st)
    _save(fig, path)
    return path


def default_title(trace: Trace, rank: int | None = 0) -> str:
    """The workload from the trace's meta: schedule, model, mode, batch, layout, GPU, and the
    rank where the trace has several (``rank`` None: not said)."""
    m = trace.meta
    parts = [str(m["schedule"])] if "schedule" in m else []
    if "model" in m:
        what = f"{m['model']} {m.get('mode', '')}".strip()
        if "batch" in m:
            what += f", {m['batch']} seqs/GPU"
        parts.append(what)
    lay = []
    for label, least in (("EP", 1), ("PP", 2)):  # the layout as titles name it, from its keys
        n = m.get(label.lower())
        if n and n >= least:
            lay.append(f"{label}{n}")
    if lay:
        parts.append(" ".join(lay))
    if "gpu" in m:
        parts.append(str(m["gpu"]))
    if len(trace.ranks) > 1 and rank is not None:
        parts.append(f"rank {rank}")
    return " · ".join(parts)


def _seen_in(trace: Trace, rank: int, t0: float, t1: float) -> set[tuple[str, int | None]]:
    """The (category, micro-batch) pairs a timeline of that window draws, and its notes (overflow
    rows, link flows), for sizing its legend."""
    op_class = trace.meta.get("op_class") if isinstance(trace.meta.get("op_class"), dict) else None
    out = {
        (op_category(s, op_class), s.mb)
        for s in trace.spans
        if s.rank == rank and s.end >= t0 and s.start <= t1
    }
    for t in visible_tracks(trace, rank, t0, t1):
        if t.name != t.lane:
            out.add(("#overflow", None))
        elif t.lane.startswith("link:") and any(k for _, k, _, _ in flow_pieces(t.spans)):
            out.add(("#flows", None))
    return out
