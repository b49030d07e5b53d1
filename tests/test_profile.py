"""Calibration profiles: parsing and its one-line errors, interpolation, SM scaling, the built-in
h800-published profile, the cost hook and the CLI's --profile with per-class provenance."""

from __future__ import annotations

import json
import math

import pytest

from overlap_lab.cli.main import main
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.ir.program import Op
from overlap_lab.sim import cost
from overlap_lab.sim.profile import BUILTIN, from_json, interpolate_loglog, load_profile
from overlap_lab.sim.profiles import h800_published

H800 = get_gpu("h800")
HEAD = {"format": "overlap-lab-profile/1", "device": "H800", "date": "2025-01-01",
        "software": {"torch": "2.6"}, "source": "test"}  # fmt: skip


def doc(*rows, **head):
    return {**HEAD, **head, "rows": list(rows)}


def row(op="experts", size=64, us=100.0, sms=132, dtype="fp8", **kw):
    return {"op": op, "dtype": dtype, "size": size, "sms": sms, "us": us, **kw}


def gemm_op(tokens=64, flops=1e9, name="attn.prepare", cls="gemm", dtype="fp8", nbytes=1e6):
    return Op(name, tokens=tokens, flops=flops, hbm_bytes=nbytes, op_class=cls, dtype=dtype)


# ---- parsing and errors -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, message",
    [
        (doc(row()) | {"device": None}, "header 'device' must be a non-empty string"),
        ({k: v for k, v in doc(row()).items() if k != "date"}, "header lacks 'date'"),
        (doc(row(), format="csv"), "format must be"),
        (doc(row(op="flux_capacitor")), "unknown op 'flux_capacitor'"),
        (doc(row(op="dispatch_a")), "unknown op 'dispatch_a'"),  # the link model's
        (doc(row(us=-3.0)), "us must be positive"),
        (doc(row(size=0)), "size must be positive"),
        (doc(row(sms=1.5)), "sms must be a positive integer"),
        (doc(row(dtype="fp4")), "dtype must be one of"),
        (doc(row(colour="red")), "unknown field 'colour'"),
        (doc(row(), row()), "two rows for experts fp8 size 64"),
        (doc(), "'rows' must be a non-empty list"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_bad_profiles_fail_in_one_line(bad, message):
    with pytest.raises(ConfigError) as e:
        from_json(bad, "p.json")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_cli_reports_a_bad_profile_in_one_line_and_exits_2(tmp_path, capsys):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc(row(us=-1.0))))
    code = main(["sim", "--layers", "2", "--out", "", "--profile", str(p)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "us must be positive" in err
    assert main(["sim", "--layers", "2", "--out", "", "--profile", "nope"]) == 2


# ---- interpolation and lookup -------------------------------------------------------------------

XS, YS = (16.0, 64.0, 256.0, 1024.0), (20.0, 31.0, 75.0, 260.0)


def test_interpolation_is_exact_on_table_points_and_monotone_between():
    for x, y in zip(XS, YS):
        assert interpolate_loglog(XS, YS, x) == y
    grid = [16 * (1024 / 16) ** (i / 500) for i in range(501)]
    vals = [interpolate_loglog(XS, YS, x) for x in grid]
    assert all(b >= a for a, b in zip(vals, vals[1:]))
    # log-log: the geometric midpoint of two sizes gets the geometric mean of their times
    assert interpolate_loglog(XS, YS, 32.0) == pytest.approx(math.sqrt(20.0 * 31.0))


def test_profile_durations_interpolate_and_extrapolate_down_but_not_up():
    p = from_json(doc(*(row(op="attn.prepare", size=x, us=y) for x, y in zip(XS, YS))))
    for x, y in zip(XS, YS):
        assert cost.profiled_us(gemm_op(int(x), nbytes=0), H800, 132, p) == y
    # below the smallest row (16 tokens, inside one 64-row M tile): the whole tile's time
    assert cost.profiled_us(gemm_op(8, nbytes=0), H800, 132, p) == YS[0]
    assert cost.profiled_us(gemm_op(4096), H800, 132, p) is None  # above, plain durations
    assert cost.duration_source(gemm_op(8), H800, p) == "profile"
    assert cost.duration_source(gemm_op(4096), H800, p) == "roofline"


def test_profiled_durations_follow_the_wave_model_across_sm_counts():
    p = from_json(doc(row(op="attn.prepare", size=64, us=50.0, sms=66)))
    op = gemm_op(64, nbytes=0)
    assert cost.profiled_us(op, H800, 66, p) == 50.0
    # carried to 132 SMs by the wave model: the roofline's own ratio between the two SM counts
    ratio = cost.solo_duration_us(op, H800, 132) / cost.solo_duration_us(op, H800, 66)
    assert cost.profiled_us(op, H800, 132, p) == pytest.approx(50.0 * ratio)
    assert 0.4 < ratio <= 1.0  # more SMs: never slower, at most by the SM ratio (fewer waves)


def test_name_rows_win_over_class_rows_and_dtype_must_match():
    p = from_json(doc(row(op="gemm", us=10.0), row(op="attn.prepare", us=30.0)))
    assert p.lookup(gemm_op(64), 132).us == 30.0
    assert p.lookup(gemm_op(64, name="shared_experts"), 132).us == 10.0
    assert p.lookup(gemm_op(64, dtype="bf16"), 132) is None
    assert p.lookup(Op("dispatch_a", kind="comm", tokens=64, flops=1.0), 132) is None


def test_rows_with_flops_are_throughputs_that_scale_with_the_ops_work():
    p = from_json(doc(row(size=64, us=100.0, flops=1e10), row(size=256, us=200.0, flops=4e10)))
    op = gemm_op(64, flops=1e10, name="experts", cls="grouped_gemm", nbytes=0)
    assert cost.profiled_us(op, H800, 132, p) == 100.0
    hot = gemm_op(64, flops=1.5e10, name="experts", cls="grouped_gemm", nbytes=0)
    assert cost.profiled_us(hot, H800, 132, p) == pytest.approx(150.0)  # an overloaded rank
    big = gemm_op(1024, flops=16e10, name="experts", cls="grouped_gemm", nbytes=0)
    assert cost.profiled_us(big, H800, 132, p) == pytest.approx(800.0)  # saturated throughput


def test_a_profiled_duration_never_beats_reading_the_ops_bytes():
    p = from_json(doc(row(size=64, us=1.0, flops=1e10)))
    op = gemm_op(64, flops=1e10, name="experts", cls="grouped_gemm", nbytes=3e9)
    floor = 3e9 / (H800.hbm_bytes_per_us * cost.HBM_USABLE)
    assert cost.profiled_us(op, H800, 132, p) == pytest.approx(floor)


def test_the_cost_hook_gives_the_profiled_solo_duration_and_keeps_hbm_sharing():
    p = from_json(doc(row(op="attn.prepare", size=64, us=77.0)))
    op = gemm_op(64, flops=2e9, nbytes=5e7)
    assert cost.solo_duration_us(op, H800, profile=p) == pytest.approx(77.0)
    d = cost.demand(op, H800, 132, p)
    shared = cost.duration_us(d, H800.hbm_bytes_per_us * 0.01)  # starved of HBM
    assert shared > 77.0


# ---- the built-in profile -----------------------------------------------------------------------


def test_h800_published_ships_every_cell_with_its_source():
    p = load_profile("h800-published")
    assert p.name in BUILTIN and p.device.startswith("NVIDIA H800")
    assert all(r.source.startswith("DeepGEMM README") and "TFLOP/s" in r.source for r in p.rows)
    cells = sum(len(v) for v in h800_published.NORMAL.values())
    cells += sum(len(s) for g in h800_published.GROUPED.values() for s in g.values())
    assert len(p.rows) == cells
    # the shipped file is what the generator writes from the tables
    assert p.to_json() == from_json(h800_published.build(), "x").to_json()


def test_h800_published_reproduces_a_published_cell():
    p = load_profile("h800-published")
    # M = 4096, all six shapes: pooled throughput = total FLOPs / total time
    shapes = h800_published.NORMAL
    flops = sum(2.0 * 4096 * n * k for n, k in shapes)
    us = sum(2.0 * 4096 * n * k / (t[4096] * 1e6) for (n, k), t in shapes.items())
    op = gemm_op(4096, flops=flops, name="shared_experts", nbytes=0)
    assert cost.profiled_us(op, H800, 132, p) == pytest.approx(us)


def test_sim_json_says_where_each_classs_durations_came_from(capsys):
    small = ["--layers", "3", "--ep", "16", "--batch", "64", "--out", "", "--json"]
    assert main(["sim", *small]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["profile"] == "h800-published"  # the default for --gpu h800
    src = res["cost_sources"]
    assert sum(sum(v.values()) for v in src.values()) == res["num_ops"]
    assert src["gemm"]["profile"] > 0 and src["comm"] == {"link": src["comm"]["link"]}
    assert main(["sim", *small, "--profile", "roofline"]) == 0
    roof = json.loads(capsys.readouterr().out)
    assert roof["profile"] == "roofline" and "profile" not in roof["cost_sources"]["gemm"]
    assert roof["step_time_us"] != res["step_time_us"]
    assert main(["sim", *small, "--gpu", "h100"]) == 0
    assert json.loads(capsys.readouterr().out)["profile"] == "roofline"


def test_show_with_a_profile_annotates_durations_the_parser_skips(capsys):
    from overlap_lab.shared.ir.program import parse

    assert main(["show", "--layers", "2", "--profile", "h800-published"]) == 0
    out = capsys.readouterr().out
    assert "# attn.prepare layer=0 mb=0" in out and " profile" in out
    parse(out)  # still a Program
