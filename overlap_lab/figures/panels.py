"""Figures of several runs: stacked timelines of a comparison on one time scale, and each
schedule's throughput range over a sensitivity design."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from overlap_lab.figures.style import (
    _check_suffix,
    _figure,
    _save,
    _style,
    figure_unit,
    fmt_time,
    text_width,
)
from overlap_lab.figures.timeline import (
    _seen_in,
    add_legend,
    legend_handles,
    timeline,
    visible_tracks,
)
from overlap_lab.figures.windows import (
    Window,
    _window_layers,
    check_time_window,
    parse_window,
    resolve_window,
)
from overlap_lab.shared.errors import ConfigError


def compare_timelines(
    traces: Any,
    path: str | Path | None,
    window: Any = None,
    rank: int | None = None,
    *,
    width: str | float | None = None,
    title: str | None = None,
    say_window: bool = True,
) -> Any:
    """Stacked timelines, one panel per schedule, on one x scale, with one legend.

    ``traces`` is a mapping name -> Trace or an :class:`overlap_lab.api.Comparison` (panel titles
    then carry ms per iteration and throughput). Each panel shows the same window of its own
    trace (``auto``: the first two MoE layers) moved to start at 0, so the panels line up layer
    against layer. ``title`` (the workload) and, with ``say_window``, the layers drawn are one
    heading across the figure ('': none). One time unit for axis and titles (:func:`figure_unit`); no in-bar labels
    (a label that fits one schedule's bar and not another's reads as a difference). Written to
    ``path`` (png/pdf/svg) when given; the Figure is returned."""
    st = _style(width)
    rows_of = getattr(traces, "rows", None)
    if rows_of is not None and hasattr(traces, "traces"):
        done = [row for row in rows_of if row.result is not None]
        traces = traces.traces()
    else:
        done = []
    if not traces:
        raise ConfigError("compare_timelines needs at least one trace")
    if path is not None:
        path = _check_suffix(path)
    r = 0 if rank is None else rank
    win = parse_window(window)
    if win.kind == "auto":  # the first two MoE layers of each, as many as all panels have
        n = min(len(_window_layers(t, r)) for t in traces.values())
        win = Window("layers", 0, min(1, n - 1)) if n else Window("step")
    heading = title
    if win.kind == "layers" and title != "" and say_window:
        what = (
            f"MoE layers {int(win.lo)}-{int(win.hi)}"
            if win.hi > win.lo
            else f"MoE layer {int(win.lo)}"
        )
        what += " of each schedule, each drawn from 0"
        heading = f"{title}\n{what}" if title else what
    if win.kind == "time":  # one window for all: refused only where no panel reaches it
        check_time_window(win, traces.values())
        cuts = {n: (win.lo, win.hi) for n in traces}
    else:
        cuts = {n: resolve_window(t, win, r) for n, t in traces.items()}
    span = max(b - a for a, b in cuts.values())
    unit = figure_unit(span)  # the axis's and the titles'
    heads = {
        row.schedule: f"{row.schedule}: {fmt_time(row.result.metrics.iteration_us, unit)}/iter, "
        f"{row.result.metrics.tokens_per_s_gpu:,.0f} tok/s/GPU, {row.speedup:.2f}x serial"
        for row in done
    }
    tracks = {n: visible_tracks(t, r, *cuts[n]) for n, t in traces.items()}
    rows = {n: max(len(v), 1) for n, v in tracks.items()}
    names = [t.name for v in tracks.values() for t in v]
    lanes = max((text_width(x, st.font) for x in names), default=0.5) + 0.25  # y labels, ticks
    titles = {
        name: st.wrap(
            heads.get(name, f"{name}: {fmt_time(tr.step_time_us, unit)}"), st.width - lanes, st.font
        )  # fmt: skip
        for name, tr in traces.items()
    }
    heading = st.wrap(heading, st.width - 0.1) if heading else ""
    items = set().union(*(_seen_in(t, r, cuts[n][0], cuts[n][0] + span) for n, t in traces.items()))
    fig = _figure(
        sum(rows.values()),
        st,
        titles=sum(h.count("\n") + 1 for h in (*titles.values(), heading) if h),
        legend=legend_handles(items),
        panels=len(rows),
        compact=True,
    )
    if heading:
        fig.suptitle(heading, x=0.01, ha="left", fontsize=st.font + 1)
    axes = fig.subplots(
        len(rows), 1, sharex=True, squeeze=False, height_ratios=list(rows.values())
    )[:, 0]
    seen: set = set()
    for ax, (name, tr) in zip(axes, traces.items(), strict=True):
        a = cuts[name][0]
        timeline(
            tr,
            ax,
            rank=r,
            title="",
            window=(a, a + span),
            legend=False,
            labels=False,
            width=st.width,
            shift=True,
            seen=seen,
            unit=unit,
        )
        ax.set_title(titles[name], fontsize=st.font, loc="left")
        if ax is not axes[-1]:
            ax.set_xlabel("")
            ax.tick_params(labelbottom=False)
    add_legend(fig, seen, st)
    if path is not None:
        _save(fig, path)
    return fig


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
