"""Figures from Traces: timelines with one row per host thread, stream and link.

The rows are the Perfetto tracks of :meth:`shared.trace.Trace.tracks` (overlapping spans of one
lane go to sub-rows), so a figure and the exported JSON show the same layout. Colours are op
families (attention, gate/select, dispatch, combine, experts...), hatches are micro-batches.

matplotlib is imported inside the functions and only through ``matplotlib.figure.Figure``: no
pyplot, no global backend state, no ``plt.show()``; figures render off-screen (Agg for PNG).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.trace import Span, Trace

# Family -> colour (Okabe-Ito / tab palettes, readable in print).
FAMILY_COLORS: dict[str, str] = {
    "attention": "#0072B2",
    "gate/select": "#56B4E9",
    "dispatch": "#D55E00",
    "combine": "#E69F00",
    "experts": "#009E73",
    "shared": "#8FD694",
    "dense mlp": "#117733",
    "norms": "#CC79A7",
    "head": "#882255",
    "host": "#999999",
    "sync": "#DDDDDD",
    "copy": "#F0E442",
    "link": "#444444",
    "other": "#BBBBBB",
}
MB_HATCHES: tuple[str, ...] = ("", "////", "\\\\\\\\", "xxx", "...", "ooo")
SUFFIXES = (".png", ".pdf", ".svg")


def op_family(span: Span) -> str:
    """The colour family of a span, from its kind and op name (shared.ops naming)."""
    if span.kind in ("host", "sync", "copy", "link"):
        return span.kind
    name = span.op.lower()
    if name.startswith(("comm_prepare", "comm_postprocess", "output")) or "norm" in name:
        return "norms"
    if "dispatch" in name:
        return "dispatch"
    if "combine" in name:
        return "combine"
    if "attn" in name or "attention" in name:
        return "attention"
    if "gate" in name or "select" in name or "router" in name or "topk" in name:
        return "gate/select"
    if "shared" in name:
        return "shared"
    if "expert" in name:
        return "experts"
    if "mlp" in name:
        return "dense mlp"
    if name in ("embed", "logits", "sample") or "lm_head" in name:
        return "head"
    if span.kind == "comm":
        return "dispatch"
    return "other"


def mb_hatch(mb: int | None) -> str:
    """Hatch of a micro-batch: none for mb 0 (or no micro-batch), then one pattern each."""
    return "" if mb is None else MB_HATCHES[mb % len(MB_HATCHES)]


def moe_window(
    trace: Trace, layers: int = 2, rank: int = 0, step: int | None = None, pad: float = 0.02
) -> tuple[float, float]:
    """A readable zoom: from the first to the last span of the first ``layers`` MoE layers.

    MoE layers are those with a dispatch, combine or experts span; without any (dense model,
    imported profile) the first ``layers`` layers with spans; without layer numbers, the whole
    step. ``step`` defaults to the first step present. The window is padded by ``pad`` of its
    width on each side.
    """
    spans = [s for s in trace.spans if s.rank == rank and s.layer is not None]
    steps = sorted({s.step for s in spans if s.step is not None})
    if step is None and steps:
        step = steps[0]
    if step is not None:
        spans = [s for s in spans if s.step == step]
    moe = sorted(
        {s.layer for s in spans if op_family(s) in ("dispatch", "combine", "experts", "shared")}
    )
    chosen = (moe or sorted({s.layer for s in spans}))[:layers]
    picked = [s for s in spans if s.layer in chosen]
    if not picked:
        all_spans = [s for s in trace.spans if s.rank == rank] or list(trace.spans)
        if not all_spans:
            return (0.0, 1.0)
        picked = all_spans
    t0, t1 = min(s.start for s in picked), max(s.end for s in picked)
    margin = pad * max(t1 - t0, 1e-9)
    return (t0 - margin, t1 + margin)


def timeline(
    trace: Trace,
    ax: Any = None,
    rank: int = 0,
    title: str | None = None,
    window: tuple[float, float] | None = None,
    legend: bool = True,
    labels: bool = True,
) -> Any:
    """Draw the timeline of ``rank`` on ``ax`` (a new figure's axis when None); return the axis.

    One row per track (host threads, streams, links; sub-rows for overlapping spans), bars
    coloured by :func:`op_family`, micro-batches hatched (:func:`mb_hatch`), x in µs. ``window``
    (t0, t1) zooms in (see :func:`moe_window`); ``labels`` writes op names on bars wide enough.
    """
    if ax is None:
        fig = _figure(len(trace.tracks(rank)))
        ax = fig.add_subplot(1, 1, 1)
    tracks = trace.tracks(rank)
    t0, t1 = window if window is not None else _extent(trace)
    if t1 <= t0:
        raise ConfigError(f"timeline window must have t0 < t1, got ({t0}, {t1})")
    width = t1 - t0
    seen: set[tuple[str, int | None]] = set()
    for row, track in enumerate(tracks):
        y = len(tracks) - 1 - row
        groups: dict[tuple[str, int | None], list[tuple[float, float]]] = {}
        for s in track.spans:
            if s.end < t0 or s.start > t1:
                continue
            fam = op_family(s)
            groups.setdefault((fam, s.mb), []).append((s.start, max(s.duration, width * 1e-4)))
            if labels and s.duration >= 0.06 * width:
                ax.text(
                    max(s.start, t0) + 0.5 * (min(s.end, t1) - max(s.start, t0)),
                    y,
                    s.op,
                    ha="center",
                    va="center",
                    fontsize=6,
                    clip_on=True,
                )
        for (fam, mb), bars in sorted(groups.items(), key=lambda kv: (kv[0][0], _mb_key(kv[0][1]))):
            ax.broken_barh(
                bars,
                (y - 0.4, 0.8),
                facecolors=FAMILY_COLORS[fam],
                edgecolors="white",
                linewidth=0.3,
                hatch=mb_hatch(mb) or None,
                alpha=0.55 if fam == "sync" else 1.0,
            )
            seen.add((fam, mb))
    ax.set_yticks(range(len(tracks)))
    ax.set_yticklabels([t.name for t in reversed(tracks)], fontsize=7)
    ax.set_ylim(-0.6, len(tracks) - 0.4)
    ax.set_xlim(t0, t1)
    ax.set_xlabel("time (µs)")
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    if title is None:
        title = _default_title(trace, rank)
    if title:
        ax.set_title(title, fontsize=9, loc="left")
    if legend:
        handles = legend_handles(seen)
        if handles:
            ax.legend(
                handles=handles,
                loc="upper left",
                bbox_to_anchor=(1.005, 1.0),
                fontsize=7,
                frameon=False,
            )
    return ax


def legend_handles(seen: set[tuple[str, int | None]]) -> list[Any]:
    """Legend patches: one per family drawn, then one hatch per micro-batch drawn."""
    from matplotlib.patches import Patch

    fams = [f for f in FAMILY_COLORS if any(f == s[0] for s in seen)]
    mbs = sorted({mb for _, mb in seen if mb is not None})
    handles = [Patch(facecolor=FAMILY_COLORS[f], label=f) for f in fams]
    if len(mbs) > 1:
        handles += [
            Patch(facecolor="white", edgecolor="black", hatch=mb_hatch(mb), label=f"mb {mb}")
            for mb in mbs
        ]
    return handles


def save_timeline(trace: Trace, path: str | Path, **kw: Any) -> Path:
    """Write :func:`timeline` of ``trace`` to ``path``; format from the suffix (png, pdf, svg)."""
    path = _check_suffix(path)
    fig = _figure(len(trace.tracks(kw.get("rank", 0))))
    timeline(trace, fig.add_subplot(1, 1, 1), **kw)
    _save(fig, path)
    return path


def compare_timelines(
    traces: Mapping[str, Trace],
    path: str | Path | None,
    window: tuple[float, float] | None = None,
    rank: int = 0,
) -> Any:
    """Stacked timelines, one subplot per schedule, on one shared x axis; one legend.

    Written to ``path`` (png/pdf/svg) when given; the Figure is returned either way. ``window``
    defaults to the longest trace's extent so step times compare at a glance.
    """
    if not traces:
        raise ConfigError("compare_timelines needs at least one trace")
    if path is not None:
        path = _check_suffix(path)
    rows = [max(len(t.tracks(rank)), 1) for t in traces.values()]
    fig = _figure(sum(rows) + 1.2 * len(rows))
    axes = fig.subplots(len(rows), 1, sharex=True, squeeze=False, height_ratios=rows)[:, 0]
    if window is None:
        extents = [_extent(t) for t in traces.values()]
        window = (min(e[0] for e in extents), max(e[1] for e in extents))
    seen: set[tuple[str, int | None]] = set()
    for ax, (name, tr) in zip(axes, traces.items(), strict=True):
        title = f"{name}  (step {tr.step_time_us:.1f} µs)"
        timeline(tr, ax, rank=rank, title=title, window=window, legend=False)
        seen |= {(op_family(s), s.mb) for s in tr.spans if s.rank == rank}
        if ax is not axes[-1]:
            ax.set_xlabel("")
    handles = legend_handles(seen)
    if handles:
        axes[0].legend(
            handles=handles,
            loc="upper left",
            bbox_to_anchor=(1.005, 1.0),
            fontsize=7,
            frameon=False,
        )
    if path is not None:
        _save(fig, path)
    return fig


def save_figure(
    fig: Any, path: str | Path, suffixes: Iterable[str] = (".png", ".svg"), dpi: int = 150
) -> None:
    """Write ``fig`` to ``path`` with each of ``suffixes`` (png, pdf, svg; no dates in the
    files)."""
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


def _figure(rows: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(12, 1.2 + 0.32 * max(rows, 1)), layout="constrained")


def _save(fig: Any, path: Path, dpi: int = 150) -> None:
    import matplotlib

    path.parent.mkdir(parents=True, exist_ok=True)
    # a fixed salt: SVG element ids are hashes, random per run without one
    with matplotlib.rc_context({"svg.hashsalt": "overlap-lab"}):
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


def _default_title(trace: Trace, rank: int) -> str:
    parts = [str(trace.meta[k]) for k in ("schedule", "model", "gpu", "mode") if k in trace.meta]
    if len(trace.ranks) > 1:
        parts.append(f"rank {rank}")
    parts.append(f"step {trace.step_time_us:.1f} µs")
    return " · ".join(parts)
