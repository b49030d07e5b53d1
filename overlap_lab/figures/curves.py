"""Curves of many runs: a tune's Pareto frontier (tokens/s per GPU against ms per iteration,
one line per schedule) and any two columns of a results file (a sweep's or a tune's CSV), one
line per value of a third.

Series take a colour each from :data:`SERIES_COLORS` (Okabe-Ito, readable in print) and a
marker and line style from :func:`~overlap_lab.figures.style.series_style`, so series that lie on
top of each other stay distinct; sizes, fonts and files follow the package's style
(:mod:`overlap_lab.figures.style`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from overlap_lab.figures.style import _check_suffix, _figure, _save, _style, series_style
from overlap_lab.shared.errors import ConfigError

#: One colour per series (Okabe-Ito, then Tol's muted colours), cycled.
SERIES_COLORS = (
    "#0072B2",
    "#D55E00",
    "#009E73",
    "#CC79A7",
    "#E69F00",
    "#56B4E9",
    "#882255",
    "#117733",
    "#999933",
    "#332288",
    "#000000",
)


def _series(i: int) -> dict[str, Any]:
    return {**series_style(i), "color": SERIES_COLORS[i % len(SERIES_COLORS)]}


def _counted(c: Any) -> str:
    """The configurations of a tune as its text counts them (``Tuning.text``)."""
    parts = [f"{c.get('simulated', 0)} configurations simulated"]
    if c.get("duplicates"):
        parts.append(f"{c['duplicates']} more shared an identical simulation")
    if c.get("resumed"):
        parts.append(f"{c['resumed']} read back")
    return ", ".join(parts)


def frontier_figure(tuning: Any, path: str | Path, *, width: str | float | None = "double") -> Path:
    """A tune's points (``overlap_lab.tune.Tuning``): every configuration simulated as a grey
    dot, each schedule's Pareto frontier as a line, the target as a dashed vertical line and the
    best configuration within it as a star. Written to ``path`` (png, pdf or svg)."""
    st = _style(width)
    out = _check_suffix(path)
    fig = _figure(18, st, titles=2)
    ax = fig.add_subplot(1, 1, 1)
    pts = tuning.points
    ax.scatter([p.ms for p in pts], [p.tps for p in pts], s=4, color="#BBBBBB", lw=0,
               label="simulated", zorder=1)  # fmt: skip
    drawn = [(n, f) for n, f in tuning.by_schedule.items() if f]
    for i, (name, front) in enumerate(drawn):
        ax.plot([p.ms for p in front], [p.tps for p in front], label=name, zorder=2, **_series(i))
    d = tuning.deployment
    if tuning.target_ms is not None:
        ax.axvline(tuning.target_ms, color="#444444", ls="--", lw=0.8, zorder=0,
                   label=f"target {tuning.target_ms:g} ms")  # fmt: skip
    if tuning.best is not None:
        b = tuning.best
        ax.scatter([b.ms], [b.tps], marker="*", s=90, color="#000000", zorder=3,
                   label=f"best: {b.setting.schedule}, batch {b.batch}")  # fmt: skip
    ax.set_xlabel(tuning.unit)
    ax.set_ylabel("tokens/s per GPU")
    ax.grid(alpha=0.3)
    ax.set_title(
        st.wrap(
            f"{d.model.label} {d.mode} on {d.gpus} x {d.gpu.name}: Pareto frontier per schedule "
            f"({_counted(tuning.counts)})"
        ),
        loc="left",
        fontsize=st.font,
    )
    ax.legend(fontsize=st.font - 1, ncol=2 if st.width > 5 else 1, loc="lower right")
    _save(fig, out)
    return out


# ---------------------------------------------------------------------------------------------
# A results file's columns


def _number(v: str) -> float | None:
    try:
        return float(v)
    except ValueError:
        return None


def results_figure(
    table: tuple[Sequence[str], Sequence[dict[str, str]]],
    x: str,
    y: str,
    hue: Sequence[str] = (),
    out: str | Path = "plot.png",
    *,
    width: str | float | None = "single",
    title: str | None = None,
    source: str = "the results",
) -> tuple[Path, list[str]]:
    """Column ``y`` against column ``x`` of a results file's ``table`` (its columns and rows of
    strings: ``overlap_lab.sweep_csv.read_table``), one line per value of the ``hue`` columns
    (none: one line), written to ``out`` (png, pdf or svg). Rows with an error or without a
    ``y`` are left out. Where several rows of one line share an ``x`` (a knob not in ``hue``
    varies), each is a marker and the line joins their mean. Returns the figure's path and notes
    on what was left out or merged; ``source`` names the file in errors."""
    cols, rows = table
    path = source
    for c in (x, y, *hue):
        if c not in cols:
            raise ConfigError(f"plot: {path} has no column {c!r}; its columns: {', '.join(cols)}")
    notes = []
    if "error" in cols:
        failed = sum(1 for r in rows if r.get("error"))
        rows = [r for r in rows if not r.get("error")]
        if failed:
            notes.append(f"{failed} rows with an error left out")
    kept = [r for r in rows if r.get(y, "") != ""]
    if not kept:
        raise ConfigError(f"plot: {path} has no row with a value of {y!r}")
    bad = next((r[y] for r in kept if _number(r[y]) is None), None)
    if bad is not None:
        raise ConfigError(f"plot: column {y!r} holds a value that is no number: {bad!r}")
    numeric_x = all(_number(r[x]) is not None for r in kept)
    cats = list(dict.fromkeys(r[x] for r in kept))
    groups: dict[str, dict[Any, list[float]]] = {}
    for r in kept:
        key = (
            ", ".join(f"{h}={r[h] or '-'}" for h in hue)
            if len(hue) > 1
            else (r[hue[0]] if hue else y)
        )
        xv = _number(r[x]) if numeric_x else cats.index(r[x])
        groups.setdefault(key or "-", {}).setdefault(xv, []).append(float(r[y]))
    merged = sum(1 for g in groups.values() for v in g.values() if len(v) > 1)
    if merged:
        notes.append(
            f"{merged} points hold several rows (a column not in --hue varies): markers for "
            "each, the line through their mean; add columns to --hue to split them"
        )
    st = _style(width)
    target = (
        Path(out) if out is not None else Path(path).with_name(f"{Path(path).stem}.{x}-{y}.png")
    )
    target = _check_suffix(target)
    fig = _figure(14, st, titles=1 if title else 0)
    ax = fig.add_subplot(1, 1, 1)
    for i, (name, g) in enumerate(groups.items()):
        xs = sorted(g)
        style = _series(i)
        ax.plot(xs, [sum(g[v]) / len(g[v]) for v in xs], label=name, **style)
        many = [(v, yy) for v in xs for yy in g[v] if len(g[v]) > 1]
        if many:
            ax.scatter([v for v, _ in many], [yy for _, yy in many], s=8,
                       color=style["color"], alpha=0.5, lw=0)  # fmt: skip
    if not numeric_x:
        ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right")
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(st.wrap(title), loc="left", fontsize=st.font)
    if len(groups) > 1 or hue:
        ax.legend(fontsize=st.font - 1, title=", ".join(hue) if len(hue) == 1 else None,
                  title_fontsize=st.font - 1)  # fmt: skip
    _save(fig, target)
    return target, notes
