"""Like for like: split and sliced ops are timed from the same profile rows as the whole op, by
one rule checked here against closed forms (sim.profile, "Lookup"); per-shape rows stay per
shape; and a comparison says where two schedules rest on different sources."""

from __future__ import annotations

import json

import pytest

import overlap_lab as ol
from overlap_lab.cli.main import main
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.ir.program import Op
from overlap_lab.sim import cost
from overlap_lab.sim.profile import M_TILE, from_json, load_profile, match_shapes
from overlap_lab.sim.profiles import h800_published

H800 = get_gpu("h800")
HEAD = {"format": "overlap-lab-profile/1", "device": "H800", "date": "2025-01-01",
        "software": {"x": "1"}, "source": "test"}  # fmt: skip
USABLE = H800.hbm_bytes_per_us * cost.HBM_USABLE


def profile(*rows):
    return from_json({**HEAD, "rows": list(rows)}, "t")


def gemm(m, n, k, name="attn.o_proj", nbytes=0.0, cls="gemm"):
    return Op(name, tokens=m, flops=2.0 * m * n * k, hbm_bytes=nbytes, op_class=cls, dtype="fp8")


def row(m, n, k, us, shape=True, **kw):
    r = {"op": "gemm", "dtype": "fp8", "size": m, "sms": 132, "us": us, "flops": 2.0 * m * n * k}
    return r | ({"shape": [[n, k]]} if shape else {}) | kw


# ---- the rule below the smallest measured size, in closed form ----------------------------------


def test_below_one_m_tile_an_op_costs_the_whole_tile():
    """DeepGEMM computes a 64-row tile however few rows it holds: at the smallest published
    M = 64, a GEMM of M = 8 or 32 costs exactly the M = 64 row."""
    p = profile(row(64, 2112, 7168, 9.4), row(128, 2112, 7168, 11.0))
    for m in (1, 8, 32, 63, 64):
        assert cost.profiled_us(gemm(m, 2112, 7168), H800, 132, p) == pytest.approx(9.4)


def test_below_the_smallest_row_the_padded_work_runs_at_its_throughput():
    """Smallest row at M0 = 256 (above one tile): an op of M rows is charged
    us0 × max(M, 64) / M0 (its own FLOPs padded to a whole tile, at M0's time per FLOP)."""
    p = profile(row(256, 4096, 7168, 40.0), row(1024, 4096, 7168, 100.0))
    for m, want in ((128, 40.0 * 128 / 256), (100, 40.0 * 100 / 256), (16, 40.0 * M_TILE / 256)):
        assert cost.profiled_us(gemm(m, 4096, 7168), H800, 132, p) == pytest.approx(want)


def test_on_the_flops_axis_below_the_smallest_row_the_throughput_holds():
    """A grouped GEMM half (TBO) or slice (SBO) of the smallest measured FLOPs: its FLOPs at that
    row's time per FLOP, no tile (rows per expert follow routing)."""
    r = {"op": "grouped_gemm", "dtype": "fp8", "size": 9e10, "size_unit": "flops", "sms": 132,
         "us": 90.0, "flops": 9e10}  # fmt: skip
    p = profile(r)
    for f in (4.5e10, 1.9e9):
        op = Op("experts", tokens=64, flops=f, op_class="grouped_gemm", dtype="fp8")
        assert cost.profiled_us(op, H800, 132, p) == pytest.approx(90.0 * f / 9e10)
        assert cost.duration_source(op, H800, p) == "profile"


def test_the_weight_read_floor_binds_a_split_decode_expert_gemm():
    """At small M a GEMM reads all its weights: each TBO half of a decode expert GEMM pays the
    whole read, so two halves take twice the whole op, as both the rows and HBM say."""
    r = {"op": "grouped_gemm", "dtype": "fp8", "size": 9e10, "size_unit": "flops", "sms": 132,
         "us": 90.0, "flops": 9e10}  # fmt: skip
    p = profile(r)
    weights = 3.5e8
    whole = Op("experts", tokens=128, flops=9e10, hbm_bytes=weights, op_class="grouped_gemm",
               dtype="fp8")  # fmt: skip
    half = Op("experts", tokens=64, flops=4.5e10, hbm_bytes=weights, op_class="grouped_gemm",
              dtype="fp8")  # fmt: skip
    assert cost.profiled_us(whole, H800, 132, p) == pytest.approx(weights / USABLE)
    assert cost.profiled_us(half, H800, 132, p) == pytest.approx(weights / USABLE)


def test_between_rows_the_measured_tflops_curve_is_interpolated_log_log():
    p = profile(row(64, 7168, 2048, 6.0), row(4096, 7168, 2048, 100.0))
    q64, q4096 = 6.0 / (2 * 64 * 7168 * 2048), 100.0 / (2 * 4096 * 7168 * 2048)
    q512 = q64 * (q4096 / q64) ** 0.5  # log 512 is halfway between log 64 and log 4096
    op = gemm(512, 7168, 2048)
    assert cost.profiled_us(op, H800, 132, p) == pytest.approx(op.flops * q512)


# ---- per-shape rows ------------------------------------------------------------------------------


def test_an_op_of_measured_shapes_is_timed_from_their_own_rows():
    """attn.prepare = fused q_a/kv_a (2112×7168) then q_b (24576×1536): the sum of the two
    published cells at its M, not the pool of all six shapes."""
    p = load_profile("h800-published")
    cells = h800_published.NORMAL
    for m in (64, 128):
        want = sum(
            2.0 * m * n * k / (cells[(n, k)][m] * 1e6) for n, k in ((2112, 7168), (24576, 1536))
        )
        flops = 2.0 * m * (2112 * 7168 + 24576 * 1536) + 60_000 * m  # norms and RoPE fused in
        op = Op("attn.prepare", tokens=m, flops=flops, op_class="gemm", dtype="fp8")
        assert cost.profiled_us(op, H800, 132, p) == pytest.approx(want)
    o = gemm(128, 7168, 16384)
    assert cost.profiled_us(o, H800, 132, p) == pytest.approx(o.flops / (645 * 1e6))


def test_an_op_of_no_measured_shape_takes_the_pool():
    p = load_profile("h800-published")
    op = gemm(128, 36864, 7168, name="mlp")  # DeepSeek-V3's dense gate_up: not in the table
    shapes = h800_published.NORMAL
    pooled_q = sum(2.0 * 128 * n * k / (t[128] * 1e6) for (n, k), t in shapes.items()) / sum(
        2.0 * 128 * n * k for n, k in shapes
    )
    assert cost.profiled_us(op, H800, 132, p) == pytest.approx(op.flops * pooled_q)


def test_shape_matching_picks_the_set_whose_flops_per_token_match():
    shapes = (((2112, 7168),), ((7168, 2048),), ((24576, 1536),))
    assert match_shapes(shapes, 2.0 * 7168 * 2048) == (((7168, 2048),),)
    two = match_shapes(shapes, 2.0 * (2112 * 7168 + 24576 * 1536))
    assert set(two) == {((2112, 7168),), ((24576, 1536),)}
    assert match_shapes(shapes, 2.0 * 1000 * 1000) is None


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"shape": [[7168, 2048]]}, "flops"),  # the row's flops are another shape's
        ({"shape": [[7168]]}, "list of [N, K] pairs"),
        ({"shape": [[2112, 7168]], "size_unit": "flops"}, "tokens-axis row"),
    ],
)
def test_a_bad_shape_fails_in_one_line(extra, message):
    r = row(64, 2112, 7168, 9.4, shape=False) | extra
    with pytest.raises(ConfigError) as e:
        profile(r)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_both_builtin_profiles_carry_their_shapes():
    for name in ("h800-published", "h200-measured"):
        gemms = [r for r in load_profile(name).rows if r.op == "gemm"]
        assert gemms and all(r.shape is not None and len(r.shape) == 1 for r in gemms)


def test_h200_measured_follows_the_same_rule():
    """The H200 rows: a shape measured at M = 64 times an M = 32 op exactly; an op of two
    measured shapes is their sum; at 108 SMs the measured row, not the 132-SM one."""
    p = load_profile("h200-measured")
    g = get_gpu("h200")
    assert cost.profiled_us(gemm(32, 2112, 7168), g, 132, p) == pytest.approx(22.52)
    pair = Op("attn.prepare", tokens=128, flops=2.0 * 128 * (2112 * 7168 + 24576 * 1536),
              op_class="gemm", dtype="fp8")  # fmt: skip
    assert cost.profiled_us(pair, g, 132, p) == pytest.approx(25.94 + 19.02)
    assert p.lookup(gemm(128, 2112, 7168), 108, g).us == pytest.approx(23.54)


# ---- a comparison: every schedule's GEMMs from the same source -----------------------------------

SCHEDULES = "serial,sbo,tbo,lightllm,deepseek"


@pytest.fixture(scope="module")
def decode_json():
    from contextlib import redirect_stdout
    from io import StringIO

    buf = StringIO()
    with redirect_stdout(buf):
        code = main(["compare", "--schedules", SCHEDULES, "--gpu", "h800", "--json", "--out", ""])
    assert code == 0
    return json.loads(buf.getvalue())


def test_every_schedule_times_its_routed_expert_gemms_from_the_profile(decode_json):
    for r in decode_json["results"]:
        assert r["cost_sources"]["grouped_gemm"] == {"profile": sum(
            r["cost_sources"]["grouped_gemm"].values())}, r["schedule"]  # fmt: skip


def test_every_schedules_share_of_profile_timed_gemms_is_serials():
    """Per kind of GEMM (class and dtype): the share of ops timed from the profile is serial's
    in every schedule (the DeepSeek-V3 decode default: 128 sequences, EP 32)."""
    from overlap_lab.sources import kernel_sources, profiled_share

    c = ol.compare(SCHEDULES.split(","), ol.workload("deepseek-v3", batch=128, ep=32), "h800")
    shares = {
        r.schedule: {
            k: profiled_share(v)
            for k, v in kernel_sources(r.result).items()
            if k[0] in ("gemm", "grouped_gemm")
        }
        for r in c.rows
    }
    assert shares["serial"][("grouped_gemm", "fp8")] == 1.0
    for name, by in shares.items():
        assert by == shares["serial"], name
    assert not any("Not like for like" in line for line in c.caveats())
    for r in c.rows:  # the API's per-row share of kernel time by source
        assert sum(r.cost_share.values()) == pytest.approx(1.0) and r.cost_share["profile"] > 0


def test_cost_share_is_in_the_json_and_sums_to_one(decode_json):
    for r in decode_json["results"]:
        assert set(r["cost_share"]) <= {"profile", "roofline", "link"}
        assert sum(r["cost_share"].values()) == pytest.approx(1.0)


def test_unlike_sources_are_named_once_under_the_table():
    """A profile whose only rows are plain durations of the expert GEMM at TBO's half size
    (64 tokens): they time TBO's halves, but not serial's whole op above them (plain durations
    do not extrapolate up), so the comparison says the two rest on different sources."""
    w = ol.workload("deepseek-v3", batch=128, ep=32, layers=4)
    p = profile({"op": "experts", "dtype": "fp8", "size": 64, "sms": 132, "us": 150.0})
    c = ol.compare(["serial", "tbo"], w, "h800", profile=p)
    unlike = [line for line in c.caveats() if "Not like for like" in line]
    assert len(unlike) == 1 and "(tbo)" in unlike[0] and "grouped_gemm fp8" in unlike[0]
    assert "0 % profile-timed in serial, 100 % in tbo" in unlike[0]
    assert c.text().count("Not like for like") == 1
