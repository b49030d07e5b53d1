"""Figures from Traces, ready for a paper: timelines with one row per host thread, stream and link.

In modules by job: :mod:`~overlap_lab.figures.style` (categories, colours, units, widths, files),
:mod:`~overlap_lab.figures.windows` (what a timeline shows), :mod:`~overlap_lab.figures.timeline`
(one trace), :mod:`~overlap_lab.figures.panels` (a comparison's stacked timelines, a
sensitivity design's ranges) and :mod:`~overlap_lab.figures.curves` (a tune's Pareto frontier, a
results file's columns); every name is importable from here.

What a reader of a paper needs, and how this package gives it:

- **Colour = what the op is.** :func:`op_category` reads the span's kind (compute, comm, copy,
  host, sync, link) and the op's exact base name (``experts.down.2`` -> ``experts.down``) in
  :data:`OP_CATEGORY`, the table of every op the schedules emit; an op it does not know falls back
  to its op class (``trace.meta["op_class"]``: ``grouped_gemm`` -> routed experts) or its kind.
  No substring matching: ``experts.gate_up`` is a routed-expert GEMM, never the router.
- **Hatches = micro-batches**; labels are written only where they fit inside their bar, on a
  white box where the bar is hatched or dark, so they never overlap or drown in the hatching;
  a comparison's panels carry none (a label fits one schedule's bar and not another's, which
  reads as a difference that is not there).
- **Titles and legends measured** (:func:`~overlap_lab.figures.style.text_width`): titles wrap
  at the width they have, a comparison's workload is one heading across the figure, and the
  legend takes as many columns as its labels fit, so a one-column figure stays mostly plot.
- **One time unit per figure** (µs, ms or s, by the run's simulated window: :func:`figure_unit`)
  on the axis and in titles, the same for ``sim``'s timeline and ``compare``'s panels of a run.
- **Lanes in one fixed order** (:func:`lane_key`: host threads, then streams in the order the
  schedules name them, then links), the same in every panel; only lanes with spans in the window
  are drawn; a stream's overflow rows (``stream:main #2``: spans that overlap in time on one
  lane) follow it in numeric order and are explained in the legend. A link's concurrent flows
  (SBO's combine, one per chunk) stay in the link's one row: each flow shows where it outlasts
  the earlier ones (:func:`flow_pieces`), so the row shows the chunks
  completing one after another instead of sixteen rows of the same bar; every other flow is a
  lighter grey (:data:`FLOW_COLOR`).
- **Windows**: :func:`parse_window` reads ``auto``, ``step`` (the whole window), ``layers:A-B``
  (MoE layers A..B of the first step) and ``T0-T1`` (ms); ``rank`` picks the rank. A window the
  trace does not reach (layers it lacks, times past its end) is refused, not drawn empty.
- **Widths** of one and two paper columns (:data:`WIDTHS`: 3.3 and 7 inches); PDF and SVG are
  vector, with no dates inside (same trace, same bytes).
- **Series that coincide stay visible**: :data:`SERIES_STYLES` gives markers and line styles
  that differ even where lines lie on top of each other.

matplotlib is imported inside the functions and only through ``matplotlib.figure.Figure``: no
pyplot, no global backend state, no ``plt.show()``; figures render off-screen (Agg for PNG).
"""

from overlap_lab.figures.curves import SERIES_COLORS, frontier_figure, results_figure
from overlap_lab.figures.panels import compare_timelines, sensitivity_ranges
from overlap_lab.figures.style import (
    CATEGORY_COLORS,
    CLASS_CATEGORY,
    FAMILY_COLORS,
    FLOW_COLOR,
    KIND_CATEGORY,
    MB_HATCHES,
    OP_CATEGORY,
    PAPER_RC,
    SERIES_STYLES,
    SUFFIXES,
    WIDTHS,
    _legend_ncol,
    _style,
    base_name,
    figure_unit,
    fmt_time,
    mb_hatch,
    op_category,
    op_family,
    paper_style,
    save_figure,
    series_style,
    time_unit,
)
from overlap_lab.figures.timeline import (
    LINK_ORDER,
    STREAM_ORDER,
    add_legend,
    default_title,
    flow_pieces,
    lane_key,
    legend_handles,
    save_timeline,
    timeline,
    track_key,
    visible_tracks,
)
from overlap_lab.figures.windows import (
    Window,
    check_time_window,
    clip,
    layer_clip,
    layer_window,
    moe_layers_of,
    moe_window,
    parse_window,
    resolve_window,
    whole_window,
)

__all__ = [
    "CATEGORY_COLORS",
    "CLASS_CATEGORY",
    "FAMILY_COLORS",
    "FLOW_COLOR",
    "KIND_CATEGORY",
    "LINK_ORDER",
    "MB_HATCHES",
    "OP_CATEGORY",
    "PAPER_RC",
    "SERIES_COLORS",
    "SERIES_STYLES",
    "STREAM_ORDER",
    "SUFFIXES",
    "WIDTHS",
    "Window",
    "_legend_ncol",
    "_style",
    "add_legend",
    "base_name",
    "check_time_window",
    "clip",
    "compare_timelines",
    "default_title",
    "flow_pieces",
    "figure_unit",
    "fmt_time",
    "frontier_figure",
    "lane_key",
    "layer_clip",
    "layer_window",
    "legend_handles",
    "mb_hatch",
    "moe_layers_of",
    "moe_window",
    "op_category",
    "op_family",
    "paper_style",
    "parse_window",
    "resolve_window",
    "results_figure",
    "save_figure",
    "save_timeline",
    "sensitivity_ranges",
    "series_style",
    "time_unit",
    "timeline",
    "track_key",
    "visible_tracks",
    "whole_window",
]
