"""Figures write non-empty files of each format and read the same layout as the Perfetto export."""

from __future__ import annotations

import pytest

from overlap_lab.experiments.figures import (
    compare_timelines,
    moe_window,
    op_family,
    save_timeline,
    timeline,
)
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.trace import Span, Trace

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
    ax = timeline(tr)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert list(reversed(labels)) == [t.name for t in tr.tracks(0)]
    assert labels[-1].startswith("host:")
    assert any(lbl.endswith("#2") for lbl in labels)  # mb 1 overlaps mb 0 on stream:main
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"attention", "dispatch", "combine", "experts", "mb 0", "mb 1"} <= set(legend)


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
    compare_timelines({"serial": a, "tbo": b}, tmp_path / "cmp.pdf", window=moe_window(b))
    assert (tmp_path / "cmp.pdf").stat().st_size > 1000
    with pytest.raises(ConfigError):
        compare_timelines({}, tmp_path / "x.png")


def test_op_families():
    fam = {op: op_family(Span(0, "stream:main", op, k, 0, 1)) for op, k, _ in MOE_OPS}
    assert fam["attn.core"] == "attention" and fam["select_experts"] == "gate/select"
    assert fam["dispatch_b"] == "dispatch" and fam["combine_a"] == "combine"
    assert fam["experts"] == "experts" and fam["shared_experts"] == "shared"
    assert fam["comm_prepare_attn"] == "norms"
    assert op_family(Span(0, "stream:main", "mlp", "compute", 0, 1)) == "dense mlp"
    assert op_family(Span(0, "link:nvlink", "s0.L3.mb0.dispatch", "link", 0, 1)) == "link"
    assert op_family(Span(0, "host:t", "schedule", "host", 0, 1)) == "host"


def test_empty_trace_renders(tmp_path):
    assert save_timeline(Trace(), tmp_path / "empty.png").stat().st_size > 0
