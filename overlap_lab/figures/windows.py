"""What a timeline shows: the window (``auto``, ``step``, ``layers:A-B``, ``T0-T1``) resolved on a
trace, and cuts of a trace for insets. ``auto`` follows the schedule's own drawing rule
(``shared.schedules.drawing``: the whole window where its point lies across iterations)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from overlap_lab.figures.style import op_category
from overlap_lab.shared import schedules
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.outputs.trace import Trace


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
    """Whether ``auto`` shows the whole window: the trace's schedule's drawing rule
    (``shared.schedules.drawing``), for schedules whose point lies across iterations or ranks."""
    return schedules.drawing(trace.meta.get("schedule")).whole_window


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


def _extent(trace: Trace) -> tuple[float, float]:
    if not trace.spans:
        return (0.0, 1.0)
    t0 = min(s.start for s in trace.spans)
    t1 = max(s.end for s in trace.spans)
    return (t0, t1 if t1 > t0 else t0 + 1.0)


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


def drawn_by(rule: str) -> list[str]:
    """The registered schedules whose figures follow ``rule`` (a ``shared.schedules.Drawing``
    field: ``whole_window``, ``every_rank``); a broken plug-in is left out (reported where it
    is used)."""
    names = []
    for name in schedules.REGISTRY.usable():
        try:
            if getattr(schedules.drawing(name), rule):
                names.append(name)
        except ConfigError:
            continue
    return names
