"""The figures' look: what colour and hatch an op gets, time units, widths, fonts, and how a
figure is sized and written (reproducibly: no dates inside)."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.outputs.trace import Span

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
#: Face of every other concurrent flow of a link row (:func:`flow_pieces`): a lighter shade of
#: the link's colour, so chunks read as pieces one after another (white dashes across a dark
#: bar read as a rendering fault), and the micro-batch hatches stay free for micro-batches.
FLOW_COLOR = "#767676"
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
# Time units


def time_unit(span_us: float) -> tuple[str, float]:
    """(unit, µs per unit) that keeps numbers short for a range of ``span_us`` µs."""
    if span_us >= 2e6:
        return "s", 1e6
    if span_us >= 2e3:
        return "ms", 1e3
    return "µs", 1.0


def figure_unit(span_us: float) -> tuple[str, float]:
    """The one time unit of a timeline figure (axis and titles) drawing ``span_us`` µs: ms from
    0.1 ms to 10 s, where every step and layer window of these models falls, so that ``sim``'s
    timeline and ``compare``'s panels of one workload read in the same unit whatever their
    windows' lengths; µs for a zoom below 0.1 ms, s beyond 10 s."""
    if span_us >= 1e7:
        return "s", 1e6
    return ("ms", 1e3) if span_us >= 100 else ("µs", 1.0)


def fmt_time(us: float, unit: tuple[str, float] | None = None) -> str:
    """A duration with a unit chosen by its size: ``850 µs``, ``55.3 ms``, ``2.68 s``; or in
    ``unit`` (from :func:`time_unit`), so that the numbers of one figure compare at a glance."""
    unit, scale = unit or time_unit(us)
    v = us / scale
    return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"


# ---------------------------------------------------------------------------------------------
# Sizes, fonts and files


@functools.lru_cache(maxsize=4096)
def text_width(text: str, size: float) -> float:
    """The width in inches of one line of ``text`` at ``size`` points, as matplotlib lays it
    out in its default font: what wraps titles and sizes legend columns, not a guess per
    character."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextToPath

    w, _, _ = TextToPath().get_text_width_height_descent(
        text, FontProperties(size=size), ismath=False
    )
    return w / 72


@dataclass(frozen=True)
class _Style:
    width: float
    font: float

    def wrap(self, title: str, avail: float | None = None, size: float | None = None) -> str:
        """``title`` broken into lines no wider than ``avail`` inches (default: an axes title,
        right of the lane names) at ``size`` points (default: the title's), measured."""
        avail = self.width - 1.05 if avail is None else avail
        size = self.font + 1 if size is None else size
        out = []
        for part in title.split("\n"):
            line = ""
            for word in part.split(" "):
                cand = f"{line} {word}" if line else word
                if line and text_width(cand, size) > avail:
                    out.append(line)
                    cand = word
                line = cand
            out.append(line)
        return "\n".join(out)


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


#: Legend spacing in ems of its font: handle, handle to text, between columns
LEGEND_EM = {"handlelength": 1.2, "handletextpad": 0.5, "columnspacing": 0.8}


def _legend_ncol(handles: list[Any], st: _Style) -> int:
    """The most legend columns that fit the width, each as wide as its longest label (filled
    column by column, as matplotlib does), measured; so a one-column figure's legend takes
    three columns where its labels allow, not one long list."""
    import math

    labels = [h.get_label() for h in handles]
    em = st.font / 72
    handle = (LEGEND_EM["handlelength"] + LEGEND_EM["handletextpad"]) * em
    for ncol in range(len(labels), 1, -1):
        rows = math.ceil(len(labels) / ncol)
        cols = [labels[i : i + rows] for i in range(0, len(labels), rows)]
        need = sum(handle + max(text_width(t, st.font) for t in c) for c in cols)
        if need + (len(cols) - 1) * LEGEND_EM["columnspacing"] * em <= st.width - 0.15:
            return len(cols)
    return 1


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


def _mb_key(mb: int | None) -> int:
    return -1 if mb is None else mb
