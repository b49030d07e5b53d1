"""Figures write non-empty files of each format and read the same layout as the Perfetto export."""

from __future__ import annotations

import pytest

from overlap_lab.figures import (
    WIDTHS,
    compare_timelines,
    fmt_time,
    lane_key,
    moe_window,
    op_category,
    parse_window,
    resolve_window,
    save_timeline,
    series_style,
    time_unit,
    timeline,
)
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.outputs.trace import Span, Trace

MOE_OPS = [
    ("comm_prepare_attn", "compute", 2),
    ("attn.prepare", "compute", 3),
    ("attn.core", "compute", 6),
    ("comm_prepare_mlp", "compute", 1),
    ("gate", "compute", 1),
    ("select_experts", "compute", 1),
    ("dispatch_a", "comm", 2),
    ("dispatch_b", "comm", 4),
    ("experts", "compute", 8),
    ("combine_a", "comm", 2),
    ("combine_b", "comm", 4),
    ("shared_experts", "compute", 3),
    ("output", "compute", 1),
    ("comm_postprocess_layer", "compute", 1),
]


def make_trace(layers: int = 4, mbs: int = 2) -> Trace:
    """A toy two-micro-batch trace: mb 1 trails mb 0 by half a layer, comm on its own stream,
    layer 0 dense, a host lane and an overlapping kernel on stream:main to force a sub-row."""
    spans = []
    for mb in range(mbs):
        t = 10.0 * mb
        for layer in range(layers):
            ops = MOE_OPS if layer > 0 else [("attn.core", "compute", 6), ("mlp", "compute", 8)]
            for op, kind, dur in ops:
                lane = "stream:comm" if kind == "comm" else "stream:main"
                spans.append(
                    Span(0, lane, op, kind, t, t + dur, sms=100, mb=mb, layer=layer, step=0)
                )
                spans.append(
                    Span(0, f"host:mb{mb}", f"launch {op}", "host", t, t + 0.5, mb=mb, layer=layer)
                )
                if op == "dispatch_b":
                    spans.append(
                        Span(0, "link:rdma", "xfer", "link", t, t + dur, mb=mb, layer=layer)
                    )
                t += dur + 1.0 * mbs
    return Trace(spans, {"schedule": "toy", "gpu": "h800", "num_sms": 132})


@pytest.mark.parametrize("suffix", [".png", ".pdf", ".svg"])
def test_save_timeline_formats(tmp_path, suffix):
    p = save_timeline(make_trace(), tmp_path / f"t{suffix}")
    assert p.exists() and p.stat().st_size > 1000
    head = p.read_bytes()[:8]
    assert {".png": b"\x89PNG", ".pdf": b"%PDF", ".svg": b"<?xml"}[suffix] in head


def test_save_timeline_window_and_bad_suffix(tmp_path):
    tr = make_trace()
    w = moe_window(tr, layers=2)
    assert save_timeline(tr, tmp_path / "zoom.png", window=w, title="zoom").stat().st_size > 1000
    with pytest.raises(ConfigError):
        save_timeline(tr, tmp_path / "t.jpg")


def test_timeline_rows_are_perfetto_tracks():
    tr = make_trace()
    ax = timeline(tr, window="step")
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert sorted(labels) == sorted(t.name for t in tr.tracks(0))
    assert labels[-1].startswith("host:")
    assert any(lbl.endswith("#2") for lbl in labels)  # mb 1 overlaps mb 0 on stream:main
    (legend,) = ax.figure.legends
    texts = {t.get_text() for t in legend.get_texts()}
    assert {"attention", "dispatch", "combine", "routed experts"} <= texts
    assert {"micro-batch 0", "micro-batch 1"} <= texts
    assert any("overlapping on one lane" in t for t in texts)  # the #2 row is explained


def test_moe_window_picks_first_moe_layers():
    tr = make_trace()
    t0, t1 = moe_window(tr, layers=2, pad=0.0)
    sel = [s for s in tr.spans if s.layer in (1, 2) and s.step == 0]
    assert (t0, t1) == (min(s.start for s in sel), max(s.end for s in sel))
    assert moe_window(Trace()) == (0.0, 1.0)
    plain = Trace([Span(0, "stream:7", "k", "compute", 3, 9)])
    assert moe_window(plain, pad=0.0) == (3, 9)


def test_compare_timelines(tmp_path):
    a, b = make_trace(mbs=1), make_trace(mbs=2)
    fig = compare_timelines({"serial": a, "tbo": b}, tmp_path / "cmp.svg")
    assert (tmp_path / "cmp.svg").stat().st_size > 1000
    axes = fig.get_axes()
    assert len(axes) == 2 and axes[0].get_xlim() == axes[1].get_xlim()
    assert axes[0].get_xlim()[0] == 0.0  # every panel starts its window at 0
    compare_timelines({"serial": a, "tbo": b}, tmp_path / "cmp.pdf", window="step")
    assert (tmp_path / "cmp.pdf").stat().st_size > 1000
    with pytest.raises(ConfigError):
        compare_timelines({}, tmp_path / "x.png")


def test_op_categories():
    cat = {op: op_category(Span(0, "stream:main", op, k, 0, 1)) for op, k, _ in MOE_OPS}
    assert cat["attn.core"] == "attention" and cat["select_experts"] == "router"
    assert cat["gate"] == "router"
    assert cat["dispatch_b"] == "dispatch" and cat["combine_a"] == "combine"
    assert cat["experts"] == "routed experts" and cat["shared_experts"] == "shared experts"
    assert cat["comm_prepare_attn"] == "norm / residual"
    assert op_category(Span(0, "stream:main", "mlp", "compute", 0, 1)) == "dense MLP"
    assert (
        op_category(Span(0, "link:nvlink", "s0.L3.mb0.dispatch", "link", 0, 1)) == "link transfer"
    )
    assert op_category(Span(0, "host:t", "schedule", "host", 0, 1)) == "host"


def test_expert_gemms_are_never_drawn_as_the_router():
    """Issue 11, item 4: 'gate_up' GEMMs were coloured as the router by a name regex."""
    for op in ("experts.gate_up", "experts.down.0", "experts.down.3"):
        assert op_category(Span(0, "stream:main", op, "compute", 0, 1)) == "routed experts"
    assert op_category(Span(0, "stream:main", "combine_a.2", "comm", 0, 1)) == "combine"
    # an op the table does not know takes its op class, then its kind: never a substring guess
    unknown = Span(0, "stream:main", "gate_up_proj_fused", "compute", 0, 1)
    assert op_category(unknown, {"gate_up_proj_fused": "grouped_gemm"}) == "routed experts"
    assert op_category(unknown) == "other"


def test_time_units_by_scale():
    assert time_unit(500) == ("µs", 1.0) and time_unit(140000)[0] == "ms"
    assert time_unit(2_033_345.6)[0] == "s"
    assert fmt_time(2_033_345.6) == "2.03 s" and fmt_time(55_274) == "55.3 ms"
    tr = Trace([Span(0, "stream:main", "attn.core", "compute", 0, 140000)])
    ax = timeline(tr, window="step")
    assert ax.get_xlabel() == "time (ms)" and ax.get_xlim() == (0.0, 140.0)


def test_windows_and_ranks():
    tr = make_trace()
    assert parse_window("step").kind == "step" and parse_window("layers:1-2").hi == 2
    assert parse_window("10-25").lo == 10_000.0
    for bad in ("layers:3-1", "x", "5-2"):
        with pytest.raises(ConfigError):
            parse_window(bad)
    whole = resolve_window(tr, "step")
    assert whole == (min(s.start for s in tr.spans), max(s.end for s in tr.spans))
    assert resolve_window(tr, "auto") == moe_window(tr, layers=2)
    two = Trace(
        [*tr.spans, Span(1, "stream:main", "attn.core", "compute", 0, 5)], {"schedule": "pp"}
    )
    with pytest.raises(ConfigError):
        save_timeline(two, "/tmp/never.png", rank=7)


def test_lane_order_is_fixed_and_unused_lanes_are_left_out():
    lanes = ["link:rdma", "stream:copy", "host:scheduler", "stream:forward", "stream:schedule"]
    assert sorted(lanes, key=lane_key) == [
        "host:scheduler",
        "stream:schedule",
        "stream:forward",
        "stream:copy",
        "link:rdma",
    ]
    tr = Trace(
        [
            Span(0, "stream:main", "attn.core", "compute", 0, 10, layer=1),
            Span(0, "stream:copy", "d2h", "copy", 100, 101),
        ]
    )
    ax = timeline(tr, window=(0, 20))
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stream:main"]


def test_widths_and_distinct_series(tmp_path):
    assert WIDTHS == {"single": 3.3, "double": 7.0}
    p = save_timeline(make_trace(), tmp_path / "one.pdf", width="single")
    assert p.read_bytes()[:4] == b"%PDF"
    styles = {(series_style(i)["marker"], str(series_style(i)["linestyle"])) for i in range(4)}
    assert len(styles) == 4


def test_empty_trace_renders(tmp_path):
    assert save_timeline(Trace(), tmp_path / "empty.png").stat().st_size > 0


def test_cli_figure_options(tmp_path):
    """--window, --rank, --width and vector formats reach the figure; bad values are one line."""
    from overlap_lab.cli.main import main

    base = ["--model", "deepseek-v2-lite", "--layers", "4", "--ep", "8", "--batch", "8"]
    out = tmp_path / "pp"
    assert (
        main(
            [
                "sim",
                "--schedule",
                "pp",
                *base,
                "--out",
                str(out),
                "--window",
                "step",
                "--rank",
                "1",
                "--width",
                "single",
                "--figure-format",
                "svg",
            ]
        )
        == 0
    )
    assert (out / "timeline.svg").read_text().lstrip().startswith("<?xml")
    assert main(["sim", *base, "--out", str(tmp_path / "s"), "--window", "layers:1-2"]) == 0
    assert main(["sim", *base, "--out", str(tmp_path / "b"), "--window", "sideways"]) == 2
    assert main(["sim", *base, "--out", str(tmp_path / "w"), "--width", "wide"]) == 2
