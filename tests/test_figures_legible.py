"""Timelines draw what they say: windows the trace lacks are refused, overflow rows sort by
number, a link's concurrent flows share its row, one time unit per figure, legends fit the width
and the default compare figure fits a page."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from overlap_lab.figures import (
    _legend_ncol,
    _style,
    compare_timelines,
    flow_pieces,
    legend_handles,
    resolve_window,
    save_timeline,
    timeline,
    visible_tracks,
)
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.outputs.trace import Span, Trace, union
from tests.test_figures import make_trace


def png_size(p: Path) -> tuple[int, int]:
    w, h = struct.unpack(">II", p.read_bytes()[16:24])
    return w, h


def test_layers_the_trace_lacks_are_refused(tmp_path: Path) -> None:
    tr = make_trace(layers=4)  # MoE layers 1..3: three of them
    with pytest.raises(ConfigError, match=r"layers:70-80: the trace \(rank 0\) has MoE layers 0-2"):
        resolve_window(tr, "layers:70-80")
    with pytest.raises(ConfigError, match="layers:2-3"):
        save_timeline(tr, tmp_path / "t.png", window="layers:2-3")
    assert resolve_window(tr, "layers:1-2")[1] > 0


def test_a_time_window_past_the_trace_is_refused(tmp_path: Path) -> None:
    tr = make_trace()
    with pytest.raises(ConfigError, match="outside the trace"):
        save_timeline(tr, tmp_path / "t.png", window="100-200")
    assert not (tmp_path / "t.png").exists()
    with pytest.raises(ConfigError, match="outside the trace"):
        compare_timelines({"a": tr, "b": tr}, None, window="100-200")
    short = Trace([s for s in tr.spans if s.end < 50], tr.meta)  # panels of other lengths
    assert compare_timelines({"a": tr, "short": short}, None, window="0.06-0.1") is not None


def test_cli_refuses_bad_windows_in_one_line(tmp_path: Path, capsys) -> None:
    from overlap_lab.cli.main import main

    base = ["sim", "--schedule", "sbo", "--layers", "4", "--out", str(tmp_path / "o")]
    for window, what in (("layers:70-80", "MoE layers 0-2"), ("100-200", "outside the trace")):
        assert main([*base, "--window", window]) == 2
        err = capsys.readouterr().err
        assert err.startswith("overlap-lab: error: --window") and err.count("\n") == 1
        assert what in err
    assert not (tmp_path / "o" / "timeline.png").exists()


def test_overflow_rows_sort_by_number() -> None:
    spans = [Span(0, "stream:main", f"k{i}", "compute", i * 0.1, 10) for i in range(12)]
    names = [t.name for t in visible_tracks(Trace(spans), 0, 0, 10)]
    assert names == ["stream:main"] + [f"stream:main #{i}" for i in range(2, 13)]


def chunked_link(n: int = 16) -> Trace:
    """SBO's combine: ``n`` flows on one link, each starting 3 µs after the last and ending
    later, beside a stream."""
    spans = [Span(0, "stream:main", "combine_b", "comm", 0, 200, layer=1)]
    spans += [
        Span(0, "link:rdma", "combine_a", "link", 3 * k, 120 + 5 * k, layer=1) for k in range(n)
    ]
    return Trace(spans, {"schedule": "sbo"})


def test_concurrent_link_flows_share_one_row() -> None:
    tr = chunked_link()
    rows = visible_tracks(tr, 0, 0, 300)
    assert [t.name for t in rows] == ["stream:main", "link:rdma"] and len(rows[1].spans) == 16
    pieces = flow_pieces(rows[1].spans)
    assert sorted({k for _, k, _, _ in pieces}) == list(range(16))
    cuts = sorted((a, b) for _, _, a, b in pieces)
    assert all(b1 <= a2 for (_, b1), (a2, _) in zip(cuts, cuts[1:]))  # disjoint
    assert union(cuts) == [(0.0, 195.0)]  # and they cover every flow
    ax = timeline(tr, window="step")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["link:rdma", "stream:main"]
    texts = {t.get_text() for t in ax.figure.legends[0].get_texts()}
    assert "alternate link chunks" in texts and not any("#2" in t for t in texts)


def test_one_time_unit_per_compare_figure() -> None:
    fast = Trace([Span(0, "stream:main", "attn.core", "compute", 0, 850, layer=1)])
    slow = Trace([Span(0, "stream:main", "attn.core", "compute", 0, 2500, layer=1)])
    fig = compare_timelines({"fast": fast, "slow": slow}, None, window="step")
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert titles[0].endswith("fast: 0.85 ms") and titles[1].endswith("slow: 2.5 ms")


@pytest.mark.parametrize("width", ["single", "double"])
def test_the_legend_fits_the_width(width: str) -> None:
    tr = make_trace()
    fig = timeline(chunked_link(), window="step", width=width).figure
    fig = compare_timelines({"a": tr, "sbo": chunked_link()}, None, window="step", width=width)
    fig.draw_without_rendering()
    box, legend = fig.bbox, fig.legends[0].get_window_extent()
    assert box.x0 <= legend.x0 and legend.x1 <= box.x1, (legend, box)
    st = _style(width)
    handles = legend_handles({("attention", 0), ("#overflow", None), ("#flows", None)})
    assert _legend_ncol(handles, st) >= 2


def test_default_compare_figure_fits_a_page(tmp_path: Path) -> None:
    from overlap_lab.cli.main import main

    assert main(["compare", "--out", str(tmp_path)]) == 0
    w, h = png_size(tmp_path / "compare.png")
    assert w == 2100 and h <= 2800, (w, h)


def test_compare_auto_window_takes_the_layers_every_panel_has() -> None:
    one = make_trace(layers=2)  # one MoE layer
    fig = compare_timelines({"a": one, "b": make_trace()}, None)
    assert "MoE layer 0 of each schedule" in fig.get_suptitle()  # the heading across the figure
    plain = Trace([Span(0, "stream:main", "k", "compute", 0, 5)])
    assert compare_timelines({"plain": plain}, None) is not None  # no layers: the whole step


# ---- a newcomer's paper figures (issue 32) ---------------------------------------------------


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """sim and compare of one small workload (a 1.5 ms step: sim drew it in µs, compare in ms)."""
    from overlap_lab.cli.main import main

    out = tmp_path_factory.mktemp("figs")
    base = ["--layers", "2", "--batch", "16", "--figure-format", "svg", "--width", "single"]
    assert main(["sim", *base, "--out", str(out / "sim")]) == 0
    assert main(["compare", *base, "--out", str(out / "cmp")]) == 0
    return out


def _svg_texts(path: Path) -> list[str]:
    import re

    return re.findall(r"<text[^>]*>([^<]*)</text>", path.read_text())


def test_sim_and_compare_of_one_workload_share_the_time_unit(small_run):
    sim = _svg_texts(small_run / "sim" / "timeline.svg")
    cmp = _svg_texts(small_run / "cmp" / "compare.svg")
    assert "time (ms)" in sim and "time (ms)" in cmp and "time (µs)" not in sim + cmp


def test_a_single_column_compare_figure_has_short_titles_and_a_wide_legend():
    """Titles wrapped to 5 lines and the legend took two columns (half the figure's height)."""
    import overlap_lab as ol
    from overlap_lab.report import workload_title

    table = ol.compare(None, ol.workload("deepseek-v3", layers=2, batch=16))
    head = workload_title(table.baseline).split(": ", 1)[1]
    fig = compare_timelines(table, None, width="single", title=head)
    assert fig.get_suptitle().count("\n") + 1 <= 3  # the workload and the window, full width
    for ax in fig.axes:
        assert ax.get_title(loc="left").count("\n") == 0, ax.get_title(loc="left")
        assert not ax.texts  # no in-bar labels on some schedules and not on others
    legend = fig.legends[0]
    assert legend._ncols >= 3
    fig.draw_without_rendering()
    assert legend.get_window_extent().height < 0.2 * fig.bbox.height
    assert compare_timelines(table, None, width="single", title="").get_suptitle() == ""


def test_alternate_link_chunks_are_a_shade_not_white_dashes():
    from matplotlib.colors import to_hex

    from overlap_lab.figures import FLOW_COLOR

    ax = timeline(chunked_link(), window="step")
    link = [c for c in ax.collections if any(to_hex(f) == FLOW_COLOR for f in c.get_facecolors())]
    assert link and not any(c.get_hatch() for c in link)


def test_the_title_option(tmp_path):
    from overlap_lab.cli.main import main

    base = ["sim", "--layers", "2", "--batch", "16", "--figure-format", "svg"]
    assert main([*base, "--title", "Figure 3: serial", "--out", str(tmp_path / "a")]) == 0
    assert "Figure 3: serial" in _svg_texts(tmp_path / "a" / "timeline.svg")
    assert main([*base, "--title", "", "--out", str(tmp_path / "b")]) == 0
    texts = _svg_texts(tmp_path / "b" / "timeline.svg")
    assert not any("serial" in t or "MoE layer" in t for t in texts)
