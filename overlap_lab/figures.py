"""Figures from Traces, ready for a paper: timelines with one row per host thread, stream and link.

What a reader of a paper needs, and how this module gives it:

- **Colour = what the op is.** :func:`op_category` reads the span's kind (compute, comm, copy,
  host, sync, link) and the op's exact base name (``experts.down.2`` -> ``experts.down``) in
  :data:`OP_CATEGORY`, the table of every op the schedules emit; an op it does not know falls back
  to its op class (``trace.meta["op_class"]``: ``grouped_gemm`` -> routed experts) or its kind.
  No substring matching: ``experts.gate_up`` is a routed-expert GEMM, never the router.
- **Hatches = micro-batches**; labels are written only where they fit inside their bar, on a
  white box where the bar is hatched or dark, so they never overlap or drown in the hatching.
- **Time units by scale** (µs, ms, s) on the axis and in titles.
- **Lanes in one fixed order** (:func:`lane_key`: host threads, then streams in the order the
  schedules name them, then links), the same in every panel; only lanes with spans in the window
  are drawn; a stream's overflow rows (``stream:main #2``: spans that overlap in time on one
  lane) follow it in numeric order and are explained in the legend. A link's concurrent flows
  (SBO's combine, one per chunk) stay in the link's one row: each flow shows where it outlasts
  the earlier ones, every other one hatched (:func:`flow_pieces`), so the row shows the chunks
  completing one after another instead of sixteen rows of the same bar.
- **Windows**: :func:`parse_window` reads ``auto``, ``step`` (the whole window), ``layers:A-B``
  (MoE layers A..B of the first step) and ``T0-T1`` (ms); ``rank`` picks the rank. A window the
  trace does not reach (layers it lacks, times past its end) is refused, not drawn empty.
- **One time unit per figure**: the panels of a compare figure and their titles share the unit.
- **Widths** of one and two paper columns (:data:`WIDTHS`: 3.3 and 7 inches); PDF and SVG are
  vector, with no dates inside (same trace, same bytes).
- **Series that coincide stay visible**: :data:`SERIES_STYLES` gives markers and line styles
  that differ even where lines lie on top of each other.

matplotlib is imported inside the functions and only through ``matplotlib.figure.Figure``: no
pyplot, no global backend state, no ``plt.show()``; figures render off-screen (Agg for PNG).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.outputs.trace import Span, Trace, Track, union

# ---------------------------------------------------------------------------------------------
# Categories and colours

#: Category -> (face colour, text colour on it). Okabe-Ito and Tol colours, readable in print.
CATEGORY_COLORS: dict[str, tuple[str, str]] = {
    "attention": ("#0072B2", "white"),
    "router": ("#56B4E9", "black"),
    "routed experts": ("#009E73", "white"),
    "shared experts": ("#8FD694", "black"),
    "dense MLP": ("#117733", "white"),
    "norm / residual": ("#CC79A7", "black"),
    "LM head": ("#882255", "white"),
    "FP8 quantisation": ("#DDCC77", "black"),
    "MTP": ("#44AA99", "black"),
    "scheduler ops": ("#AA4499", "white"),
    "dispatch": ("#D55E00", "white"),
    "combine": ("#E69F00", "black"),
    "PP send/recv": ("#994F00", "white"),
    "other comm": ("#661100", "white"),
    "copy": ("#F0E442", "black"),
    "link transfer": ("#444444", "white"),
    "host": ("#999999", "black"),
    "host wait": ("#DDDDDD", "black"),
    "other": ("#BBBBBB", "black"),
}
#: Backwards-compatible name: category -> face colour.
FAMILY_COLORS: dict[str, str] = {k: v[0] for k, v in CATEGORY_COLORS.items()}

#: Every op the schedules emit (shared/ir/ops.py, ops_sched.py, ops_pp.py), by exact base name.
OP_CATEGORY: dict[str, str] = {
    "attn.prepare": "attention",
    "attn.core": "attention",
    "attn.o_proj": "attention",
    "attn.absorb_k": "attention",
    "attn.absorb_v": "attention",
    "attn.quant": "FP8 quantisation",
    "attn.uk_quant": "FP8 quantisation",
    "attn.uv_quant": "FP8 quantisation",
    "attn.o_quant": "FP8 quantisation",
    "shared_experts.quant": "FP8 quantisation",
    "mlp.quant": "FP8 quantisation",
    "experts.act_quant": "FP8 quantisation",
    "mtp.embed": "MTP",
    "mtp.norm": "MTP",
    "mtp.eh_proj": "MTP",
    "mtp.logits": "MTP",
    "mtp.sample": "MTP",
    "gate": "router",
    "select_experts": "router",
    "experts": "routed experts",
    "experts.gate_up": "routed experts",
    "experts.down": "routed experts",
    "shared_experts": "shared experts",
    "mlp": "dense MLP",
    "comm_prepare_attn": "norm / residual",
    "comm_prepare_mlp": "norm / residual",
    "comm_postprocess_layer": "norm / residual",
    "output": "norm / residual",
    "embed": "LM head",
    "logits": "LM head",
    "sample": "LM head",
    "dispatch_a": "dispatch",
    "dispatch_b": "dispatch",
    "combine_a": "combine",
    "combine_b": "combine",
    "pp_send_hidden": "PP send/recv",
    "pp_recv_hidden": "PP send/recv",
    "pp_send_out": "PP send/recv",
    "pp_recv_out": "PP send/recv",
    "pp_allgather_hidden": "PP send/recv",
    "pp_allgather_out": "PP send/recv",
    "req_to_token_gather": "scheduler ops",
    "req_to_token_scatter": "scheduler ops",
    "write_req_to_token_pool_triton": "scheduler ops",
    "seq_lens_add": "scheduler ops",
    "seq_lens_clone": "scheduler ops",
    "seq_lens_next": "scheduler ops",
    "out_cache_loc_cast": "scheduler ops",
    "resolve_future": "scheduler ops",
    "store_to_map": "scheduler ops",
}
#: Op class (shared.ir.program.Op.op_class) -> category, for ops outside :data:`OP_CATEGORY`.
CLASS_CATEGORY: dict[str, str] = {
    "grouped_gemm": "routed experts",
    "attention": "attention",
    "sampling": "LM head",
    "comm": "other comm",
    "copy": "copy",
}
KIND_CATEGORY: dict[str, str] = {
    "host": "host",
    "sync": "host wait",
    "copy": "copy",
    "link": "link transfer",
    "comm": "other comm",
}
MB_HATCHES: tuple[str, ...] = ("", "////", "\\\\\\\\", "xxx", "...", "ooo")
#: Hatch of every other concurrent flow of a link row (:func:`flow_pieces`), apart from the
#: micro-batch hatches.
FLOW_HATCH = "---"
SUFFIXES = (".png", ".pdf", ".svg")
#: Figure widths in inches: one column and two columns of a two-column paper.
WIDTHS: dict[str, float] = {"single": 3.3, "double": 7.0}
#: (marker, linestyle) per series, so that series lying on top of each other stay distinct.
SERIES_STYLES: tuple[tuple[str, str], ...] = (
    ("o", "-"),
    ("s", "--"),
    ("^", ":"),
    ("D", "-."),
    ("v", (0, (5, 1, 1, 1))),
    ("x", (0, (1, 1))),
)
_CHUNK = re.compile(r"(\.\d+)+$")  # "experts.down.2" -> "experts.down"


def base_name(op: str) -> str:
    """The op's name without its chunk suffix (SBO's streamed pieces ``combine_a.3``)."""
    return _CHUNK.sub("", op)


def op_category(span: Span, op_class: Mapping[str, str] | None = None) -> str:
    """The category (legend entry and colour) of a span; see the module docstring."""
    if span.kind in ("host", "sync", "link"):
        return KIND_CATEGORY[span.kind]
    name = base_name(span.op)
    if name in OP_CATEGORY:
        return OP_CATEGORY[name]
    cls = (op_class or {}).get(span.op) or (op_class or {}).get(name)
    if cls in CLASS_CATEGORY:
        return CLASS_CATEGORY[cls]
    return KIND_CATEGORY.get(span.kind, "other")


#: Backwards-compatible name.
op_family = op_category


def mb_hatch(mb: int | None) -> str:
    """Hatch of a micro-batch: none for mb 0 (or no micro-batch), then one pattern each."""
    return "" if mb is None else MB_HATCHES[mb % len(MB_HATCHES)]


def series_style(i: int) -> dict[str, Any]:
    """Keyword arguments for ``ax.plot`` of the i-th series (marker, line style, fill)."""
    marker, ls = SERIES_STYLES[i % len(SERIES_STYLES)]
    return {
        "marker": marker,
        "linestyle": ls,
        "markersize": 4 + (i % 3),
        "markerfacecolor": "none" if i % 2 else None,
    }


# ---------------------------------------------------------------------------------------------
# Time units and windows


def time_unit(span_us: float) -> tuple[str, float]:
    """(unit, µs per unit) that keeps numbers short for a range of ``span_us`` µs."""
    if span_us >= 2e6:
        return "s", 1e6
    if span_us >= 2e3:
        return "ms", 1e3
    return "µs", 1.0


def fmt_time(us: float, unit: tuple[str, float] | None = None) -> str:
    """A duration with a unit chosen by its size: ``850 µs``, ``55.3 ms``, ``2.68 s``; or in
    ``unit`` (from :func:`time_unit`), so that the numbers of one figure compare at a glance."""
    unit, scale = unit or time_unit(us)
    v = us / scale
    return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"


@dataclass(frozen=True)
class Window:
    """What a timeline shows: ``kind`` is auto, step, layers (``lo``..``hi`` MoE layers, counted
    from 0 among MoE layers) or time (``lo``..``hi`` in µs)."""

    kind: str = "auto"
    lo: float = 0.0
    hi: float = 0.0


def parse_window(text: str | Window | tuple[float, float] | None) -> Window:
    """``auto``, ``step`` (or ``whole``), ``layers:A-B`` / ``layers:N`` (the first N MoE
    layers), or ``T0-T1`` in ms."""
    if isinstance(text, Window):
        return text
    if text is None:
        return Window()
    if isinstance(text, tuple):
        return Window("time", float(text[0]), float(text[1]))
    s = str(text).strip().lower()
    if s in ("auto", ""):
        return Window()
    if s in ("step", "whole", "whole step", "all"):
        return Window("step")
    try:
        if s.startswith("layers:"):
            spec = s.split(":", 1)[1]
            if "-" in spec:
                a, b = spec.split("-", 1)
                lo, hi = int(a), int(b)
            else:
                lo, hi = 0, int(spec) - 1
            if lo < 0 or hi < lo:
                raise ValueError
            return Window("layers", lo, hi)
        a, b = s.split("-", 1)
        lo, hi = float(a) * 1e3, float(b) * 1e3
        if not 0 <= lo < hi:
            raise ValueError
        return Window("time", lo, hi)
    except ValueError:
        raise ConfigError(
            f"--window takes auto, step, layers:A-B, layers:N or T0-T1 (ms), got {text!r}"
        ) from None


_MOE_CATEGORIES = frozenset({"dispatch", "combine", "routed experts", "shared experts"})


def moe_layers_of(trace: Trace, rank: int = 0) -> list[int]:
    """MoE layers with spans on ``rank`` (those with a dispatch, combine or expert op)."""
    moe = {"dispatch", "combine", "routed experts", "shared experts"}
    return sorted(
        {
            s.layer
            for s in trace.spans
            if s.rank == rank and s.layer is not None and op_category(s) in moe
        }
    )


def moe_window(
    trace: Trace,
    layers: int = 2,
    rank: int = 0,
    step: int | None = None,
    pad: float = 0.02,
    first: int = 0,
) -> tuple[float, float]:
    """From the first to the last span of MoE layers ``first .. first+layers-1`` of one step.

    MoE layers are those with a dispatch, combine or expert span; without any (dense model,
    imported profile) the layers with spans; without layer numbers, the whole trace. ``step``
    defaults to the first step present. Padded by ``pad`` of its width on each side."""
    spans = [s for s in trace.spans if s.rank == rank and s.layer is not None]
    steps = sorted({s.step for s in spans if s.step is not None})
    if step is None and steps:
        step = steps[0]
    if step is not None:
        spans = [s for s in spans if s.step == step]
    moe = sorted(
        {
            s.layer
            for s in spans
            if op_category(s) in ("dispatch", "combine", "routed experts", "shared experts")
        }
    )
    chosen = (moe or sorted({s.layer for s in spans}))[first : first + layers]
    picked = [s for s in spans if s.layer in chosen]
    if not picked:
        picked = [s for s in trace.spans if s.rank == rank] or list(trace.spans)
        if not picked:
            return (0.0, 1.0)
    t0, t1 = min(s.start for s in picked), max(s.end for s in picked)
    margin = pad * max(t1 - t0, 1e-9)
    return (t0 - margin, t1 + margin)


def whole_window(trace: Trace) -> bool:
    """Whether ``auto`` shows the whole window: schedules whose point lies across iterations
    (sglang-overlap: the host one iteration ahead) or ranks (pp: bubbles)."""
    return trace.meta.get("schedule") in ("sglang-overlap", "pp")


def resolve_window(trace: Trace, window: Any, rank: int = 0) -> tuple[float, float]:
    """The (t0, t1) in µs that ``window`` (see :func:`parse_window`) selects on ``trace``;
    ConfigError for layers the trace lacks or times it does not reach (a figure of nothing, or
    of the whole step titled with layers it does not have, would mislead)."""
    w = parse_window(window)
    if w.kind == "time":
        check_time_window(w, [trace])
        return (w.lo, w.hi)
    if w.kind == "step" or (w.kind == "auto" and whole_window(trace)):
        return _extent(trace)
    if w.kind == "layers":
        n = len(_window_layers(trace, rank))
        if w.hi >= n and trace.spans:
            has = f"MoE layers 0-{n - 1}" if n > 1 else "MoE layer 0" if n else "no layer numbers"
            lo, hi = int(w.lo), int(w.hi)
            raise ConfigError(
                f"--window layers:{lo}-{hi}: the trace (rank {rank}) has {has}"
                + ("; use step or T0-T1 (ms)" if not n else "")
            )
        return moe_window(trace, layers=int(w.hi - w.lo) + 1, rank=rank, first=int(w.lo))
    return moe_window(trace, layers=2, rank=rank)


def check_time_window(w: Window, traces: Iterable[Trace]) -> None:
    """A T0-T1 window must reach into at least one of ``traces`` (a panel set)."""
    extents = [_extent(t) for t in traces if t.spans]
    if extents and not any(w.lo < b and w.hi > a for a, b in extents):
        a, b = min(e[0] for e in extents), max(e[1] for e in extents)
        raise ConfigError(
            f"--window {w.lo / 1e3:g}-{w.hi / 1e3:g}: outside the trace, which runs from "
            f"{a / 1e3:.4g} to {b / 1e3:.4g} ms"
        )


def _window_layers(trace: Trace, rank: int) -> list[int]:
    """The layers ``layers:A-B`` counts on ``rank`` (as :func:`moe_window` picks them): the MoE
    layers of the first step, else its layers with spans."""
    spans = [s for s in trace.spans if s.rank == rank and s.layer is not None]
    steps = sorted({s.step for s in spans if s.step is not None})
    if steps:
        spans = [s for s in spans if s.step == steps[0]]
    moe = {s.layer for s in spans if op_category(s) in _MOE_CATEGORIES}
    return sorted(moe or {s.layer for s in spans})


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


@dataclass(frozen=True)
class _Style:
    width: float
    font: float

    @property
    def ncol(self) -> int:
        """Legend columns that fit the width."""
        return max(1, int(self.width / (1.05 if self.width < 5 else 1.45)))

    def wrap(self, title: str) -> str:
        """``title`` broken into lines that fit the width at the title's font size."""
        import textwrap

        # titles start at the axes' left edge, right of the lane names (about an inch)
        chars = max(20, int((self.width - 1.05) * 72 / ((self.font + 1) * 0.58)))
        return "\n".join(
            ln for part in title.split("\n") for ln in textwrap.wrap(part, chars) or [""]
        )


def _style(width: str | float | None) -> _Style:
    if width is None:
        width = "double"
    if isinstance(width, str):
        if width in WIDTHS:
            w = WIDTHS[width]
        else:
            try:
                w = float(width)
            except ValueError:
                raise ConfigError(
                    f"--width takes single, double or inches, got {width!r}"
                ) from None
    else:
        w = float(width)
    if not 2.0 <= w <= 20.0:
        raise ConfigError(f"figure width must lie in 2..20 inches, got {w}")
    return _Style(w, 5.5 if w < 5 else 7.0)


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
) -> Any:
    """Draw the timeline of ``rank`` on ``ax`` (a new figure's axis when None); return the axis.

    One row per visible track, bars coloured by :func:`op_category`, micro-batches hatched.
    ``window`` is anything :func:`parse_window` reads or (t0, t1) in µs; ``shift`` puts t0 at 0
    (panels of different schedules side by side). ``seen`` collects (category, mb) drawn, for a
    shared legend."""
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
    unit, scale = time_unit(span_us)
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
            groups.setdefault((cat, s.mb, flow % 2), []).append(
                ((a - x0) / scale, max(b - a, 0.5 * us_per_pt) / scale)
            )
            if flow:
                drawn.add(("#flows", None))
            text = _label(s.op)
            if labels and len(text) * st.font * 0.55 * us_per_pt < 0.92 * (b - a):
                hatched = bool(mb_hatch(s.mb)) or flow % 2 == 1
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
                facecolors=CATEGORY_COLORS[cat][0],
                edgecolors="white",  # the hatch colour; no outline (it would whiten thin bars)
                linewidth=0,
                hatch=(mb_hatch(mb) + (FLOW_HATCH if odd else "")) or None,
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
        face = CATEGORY_COLORS["link transfer"][0]
        handles.append(
            Patch(
                facecolor=face, edgecolor="white", hatch=FLOW_HATCH, label="alternate link chunks"
            )
        )
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
        handlelength=1.2 if st.width < 5 else 1.4,
        columnspacing=0.8 if st.width < 5 else 1.0,
    )


def _legend_ncol(handles: list[Any], st: _Style) -> int:
    """Legend columns that fit the width with the longest label (a fixed count clips a long
    label off a one-column figure)."""
    longest = max((len(h.get_label()) for h in handles), default=1)
    handle = (1.2 if st.width < 5 else 1.4) + (0.8 if st.width < 5 else 1.0) + 0.8  # em
    col_in = (handle + longest * 0.56) * st.font / 72
    return max(1, min(len(handles), int((st.width - 0.15) / col_in)))


def save_timeline(
    trace: Trace,
    path: str | Path,
    *,
    window: Any = None,
    rank: int | None = None,
    width: str | float | None = None,
    title: str | None = None,
    labels: bool = True,
) -> Path:
    """Write the timeline of ``trace`` to ``path`` (png, pdf or svg from the suffix).

    ``rank`` None draws rank 0, or one panel per rank for a pp trace (bubbles are across
    ranks)."""
    path = _check_suffix(path)
    st = _style(width)
    ranks = trace.ranks or (0,)
    if rank is not None:
        if rank not in ranks and trace.spans:
            raise ConfigError(f"--rank {rank}: the trace has ranks {', '.join(map(str, ranks))}")
        ranks = (rank,)
    elif trace.meta.get("schedule") != "pp":
        ranks = ranks[:1]
    spans = [resolve_window(trace, window, r) for r in ranks]
    t0, t1 = min(a for a, _ in spans), max(b for _, b in spans)
    rows = [len(visible_tracks(trace, r, t0, t1)) for r in ranks]
    win = parse_window(window)
    shown = ""
    if win.kind == "layers" or (win.kind == "auto" and not whole_window(trace)):
        lo, hi = (int(win.lo), int(win.hi)) if win.kind == "layers" else (0, 1)
        n = len(moe_layers_of(trace, ranks[0]))
        shown = f"MoE layers {lo}-{hi} of {n}" if hi > lo else f"MoE layer {lo} of {n}"
    heads = []
    for i, r in enumerate(ranks):
        head = title if title is not None else default_title(trace, r)
        if shown and i == 0:
            head = f"{head}\n{shown}"
        if len(ranks) > 1:
            head = (head + "\n" if i == 0 else "") + f"rank {r}"
        heads.append(st.wrap(head) if head else "")
    items = set().union(*(_seen_in(trace, r, t0, t1) for r in ranks))
    fig = _figure(
        sum(rows),
        st,
        titles=sum(h.count("\n") + 1 for h in heads if h),
        legend=legend_handles(items),
        panels=len(ranks),
    )
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


def compare_timelines(
    traces: Any,
    path: str | Path | None,
    window: Any = None,
    rank: int | None = None,
    *,
    width: str | float | None = None,
    title: str | None = None,
) -> Any:
    """Stacked timelines, one panel per schedule, on one x scale, with one legend.

    ``traces`` is a mapping name -> Trace or an :class:`overlap_lab.api.Comparison` (panel titles
    then carry ms per iteration and throughput). Each panel shows the same window of its own
    trace (``auto``: the first two MoE layers) moved to start at 0, so the panels line up layer
    against layer. Written to ``path`` (png/pdf/svg) when given; the Figure is returned."""
    st = _style(width)
    heads: dict[str, str] = {}
    if hasattr(traces, "rows") and hasattr(traces, "traces"):
        done = [row for row in traces.rows if row.result is not None]
        unit = time_unit(max((row.result.metrics.iteration_us for row in done), default=0.0))
        for row in done:
            m = row.result.metrics
            heads[row.schedule] = (
                f"{row.schedule}: {fmt_time(m.iteration_us, unit)}/iter, "
                f"{m.tokens_per_s_gpu:,.0f} tok/s/GPU ({row.speedup:.2f}x serial)"
            )
        traces = traces.traces()
    if not traces:
        raise ConfigError("compare_timelines needs at least one trace")
    step_unit = time_unit(max(t.step_time_us for t in traces.values()))
    if path is not None:
        path = _check_suffix(path)
    r = 0 if rank is None else rank
    win = parse_window(window)
    if win.kind == "auto":  # the first two MoE layers of each, as many as all panels have
        n = min(len(_window_layers(t, r)) for t in traces.values())
        win = Window("layers", 0, min(1, n - 1)) if n else Window("step")
    if win.kind == "layers":
        what = (
            f"MoE layers {int(win.lo)}-{int(win.hi)}"
            if win.hi > win.lo
            else f"MoE layer {int(win.lo)}"
        )
        what += " of each schedule, each drawn from 0"
        title = f"{title}\n{what}" if title else what
    if win.kind == "time":  # one window for all: refused only where no panel reaches it
        check_time_window(win, traces.values())
        cuts = {n: (win.lo, win.hi) for n in traces}
    else:
        cuts = {n: resolve_window(t, win, r) for n, t in traces.items()}
    span = max(b - a for a, b in cuts.values())
    rows = {n: max(len(visible_tracks(t, r, *cuts[n])), 1) for n, t in traces.items()}
    titles = {}
    for i, (name, tr) in enumerate(traces.items()):
        head = heads.get(name, f"{name}: {fmt_time(tr.step_time_us, step_unit)}")
        titles[name] = st.wrap(f"{title}\n{head}" if i == 0 and title else head)
    items = set().union(*(_seen_in(t, r, cuts[n][0], cuts[n][0] + span) for n, t in traces.items()))
    fig = _figure(
        sum(rows.values()),
        st,
        titles=sum(h.count("\n") + 1 for h in titles.values()),
        legend=legend_handles(items),
        panels=len(rows),
        compact=True,
    )
    axes = fig.subplots(
        len(rows), 1, sharex=True, squeeze=False, height_ratios=list(rows.values())
    )[:, 0]
    seen: set = set()
    for ax, (name, tr) in zip(axes, traces.items(), strict=True):
        a = cuts[name][0]
        head = titles[name]
        timeline(
            tr,
            ax,
            rank=r,
            title=head,
            window=(a, a + span),
            legend=False,
            width=st.width,
            shift=True,
            seen=seen,
        )
        if ax is not axes[-1]:
            ax.set_xlabel("")
            ax.tick_params(labelbottom=False)
    add_legend(fig, seen, st)
    if path is not None:
        _save(fig, path)
    return fig


#: matplotlib settings for figures printed at :data:`WIDTHS` (7 pt text in a 7-inch figure
#: reads like a paper's caption text); applied by :func:`paper_style`.
PAPER_RC: dict[str, Any] = {
    "font.size": 7,
    "axes.titlesize": 7.5,
    "axes.labelsize": 7,
    "xtick.labelsize": 6.5,
    "ytick.labelsize": 6.5,
    "legend.fontsize": 6,
    "lines.linewidth": 1.2,
    "lines.markersize": 4,
    "axes.linewidth": 0.6,
    "grid.linewidth": 0.4,
    "svg.fonttype": "none",  # text stays text in SVG
    "pdf.fonttype": 42,  # TrueType in PDF, as publishers ask
}


def paper_style() -> Any:
    """A context in which figures are built and saved with :data:`PAPER_RC`."""
    import matplotlib

    return matplotlib.rc_context(PAPER_RC)


def save_figure(
    fig: Any, path: str | Path, suffixes: Iterable[str] = (".png", ".svg"), dpi: int = 200
) -> None:
    """Write ``fig`` to ``path`` with each of ``suffixes`` (png, pdf, svg; no dates inside)."""
    for suffix in suffixes:
        _save(fig, _check_suffix(Path(path).with_suffix(suffix)), dpi)


# ---------------------------------------------------------------------------------------------
# Cutting a trace for a timeline inset


def layer_window(
    trace: Trace, layer: int, *, op: str | None = None, mb: int = 0
) -> tuple[float, float]:
    """One layer period: the first span of micro-batch ``mb`` in ``layer`` (of op ``op``, when
    given) to the same in ``layer + 1``."""

    def start(L: int) -> float:
        return min(
            s.start
            for s in trace.spans
            if s.layer == L and s.mb == mb and (op is None or s.op == op)
        )

    return start(layer), start(layer + 1)


def clip(trace: Trace, t0: float, t1: float, *, shift: bool = True, host: bool = False) -> Trace:
    """The spans overlapping [t0, t1), cut to it; moved to start at 0 with ``shift``; host
    lanes dropped unless ``host``."""
    dt = t0 if shift else 0.0
    spans = [
        replace(s, start=max(s.start, t0) - dt, end=min(s.end, t1) - dt)
        for s in trace.spans
        if s.end > t0 and s.start < t1 and (host or not s.lane.startswith("host"))
    ]
    return Trace(tuple(spans), dict(trace.meta))


def layer_clip(trace: Trace, layer: int, *, op: str | None = None) -> Trace:
    """One layer period of ``trace`` (:func:`layer_window`), moved to 0, without host lanes."""
    return clip(trace, *layer_window(trace, layer, op=op))


# ---------------------------------------------------------------------------------------------


def default_title(trace: Trace, rank: int = 0) -> str:
    """The workload from the trace's meta: schedule, model, mode, batch, layout, GPU."""
    m = trace.meta
    parts = [str(m["schedule"])] if "schedule" in m else []
    if "model" in m:
        what = f"{m['model']} {m.get('mode', '')}".strip()
        if "batch" in m:
            what += f", {m['batch']} seqs/GPU"
        parts.append(what)
    lay = []
    if m.get("ep"):
        lay.append(f"EP{m['ep']}")
    if (m.get("pp") or 1) > 1:
        lay.append(f"PP{m['pp']}")
    if lay:
        parts.append(" ".join(lay))
    if "gpu" in m:
        parts.append(str(m["gpu"]))
    if len(trace.ranks) > 1:
        parts.append(f"rank {rank}")
    return " · ".join(parts)


def _figure(
    rows: float,
    st: _Style,
    *,
    titles: int = 1,
    legend: list[Any] = (),
    panels: int = 1,
    compact: bool = False,
) -> Any:
    """A figure sized for ``rows`` lane rows, ``titles`` title lines, ``panels`` x axes (one
    with tick labels) and the ``legend`` handles below. ``compact`` (a compare figure: ten
    schedules on one page width) packs rows and titles tighter: a row still holds a 6-pt label."""
    import math

    from matplotlib.figure import Figure

    pt = 1 / 72
    row_in = (0.11 if st.width < 5 else 0.125) if compact else (0.15 if st.width < 5 else 0.2)
    height = (
        titles * (st.font + 1) * (1.3 if compact else 1.5) * pt
        + row_in * max(rows, 1)
        + (0.06 if compact else 0.12) * panels
        + 3.2 * st.font * pt  # the x axis's tick labels and label
        + (math.ceil(len(legend) / _legend_ncol(legend, st)) if legend else 0) * st.font * 1.6 * pt
        + 0.1
    )
    return Figure(figsize=(st.width, height), layout="constrained")


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


def _save(fig: Any, path: Path, dpi: int = 300) -> None:
    import matplotlib

    path.parent.mkdir(parents=True, exist_ok=True)
    # a fixed salt: SVG element ids are hashes, random per run without one
    with paper_style(), matplotlib.rc_context({"svg.hashsalt": "overlap-lab"}):
        fig.savefig(path, dpi=dpi, metadata=_metadata(path))


def _metadata(path: Path) -> dict[str, Any]:
    # Reproducible files: no creation dates in PDF/SVG.
    if path.suffix == ".pdf":
        return {"CreationDate": None}
    if path.suffix == ".svg":
        return {"Date": None}
    return {}


def _check_suffix(path: str | Path) -> Path:
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise ConfigError(f"figure path must end in .png, .pdf or .svg, got {path.name!r}")
    return path


def _extent(trace: Trace) -> tuple[float, float]:
    if not trace.spans:
        return (0.0, 1.0)
    t0 = min(s.start for s in trace.spans)
    t1 = max(s.end for s in trace.spans)
    return (t0, t1 if t1 > t0 else t0 + 1.0)


def _mb_key(mb: int | None) -> int:
    return -1 if mb is None else mb


# ---------------------------------------------------------------------------------------------
# Sensitivity: each schedule's range over perturbed costs


def sensitivity_ranges(
    sens: Any, path: str | Path, *, title: str = "", width: str | float | None = "single"
) -> Path:
    """Each schedule's throughput per GPU over a sensitivity design (``overlap_lab.sensitivity
    .Sensitivity``) as a bar from its lowest to its highest point, the nominal run marked and
    the share of points it wins written beside it. Throughput, not time per iteration, so that
    pp (more GPUs, micro-batch iterations) sits on the same axis; bars that overlap are the
    schedules the design does not separate."""
    st = _style(width)
    ranges = sorted(sens.ranges, key=lambda r: r.nominal_tps)
    fig = _figure(len(ranges) * 1.4, st, titles=1 if title else 0)
    ax = fig.add_subplot(1, 1, 1)
    ys = range(len(ranges))
    for y, r in zip(ys, ranges, strict=True):
        ax.plot([r.lo_tps, r.hi_tps], [y, y], lw=4, color="#9ecae1", solid_capstyle="butt")
        ax.plot([r.nominal_tps], [y], "|", color="#08519c", ms=10, mew=1.5)
        ax.annotate(
            f" {100 * r.wins:.0f} %",
            (r.hi_tps, y),
            va="center",
            fontsize=st.font - 1,
        )
    ax.set_yticks(list(ys), [r.schedule for r in ranges], fontsize=st.font)
    ax.set_xlabel(
        f"tokens/s per GPU over {len(sens.points) + 1} points (| nominal; % wins)", fontsize=st.font
    )
    ax.tick_params(labelsize=st.font)
    ax.grid(axis="x", alpha=0.3)
    ax.margins(x=0.12)
    if title:
        ax.set_title(st.wrap(title), fontsize=st.font, loc="left")
    out = _check_suffix(path)
    _save(fig, out)
    return out
