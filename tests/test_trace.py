"""Trace metrics on hand-made traces with known answers, Chrome export/import, round trips."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.outputs.trace import (
    Span,
    Trace,
    intersect,
    length,
    load_json,
    save_json,
    union,
)


def S(lane, op, kind, start, end, **kw):
    return Span(rank=kw.pop("rank", 0), lane=lane, op=op, kind=kind, start=start, end=end, **kw)


@pytest.fixture
def two_streams() -> Trace:
    """main: attn 0-10, experts 10-30; comm: dispatch 5-15 (5 exposed), combine 28-40 (10 exposed);
    link: 6-14 (covered); copy 32-36 on stream:copy; host thread 0-4, sync 4-40."""
    spans = [
        S("host:sched", "schedule", "host", 0, 4),
        S("host:sched", "wait", "sync", 4, 40),
        S("stream:main", "attn.core", "compute", 0, 10, sms=132, mb=0, layer=3),
        S("stream:main", "experts", "compute", 10, 30, sms=108, mb=0, layer=3),
        S("stream:comm", "dispatch_a", "comm", 5, 15, sms=24, mb=0, layer=3),
        S("stream:comm", "combine_a", "comm", 28, 40, sms=24, mb=0, layer=3),
        S("link:rdma", "s0.L3.mb0.dispatch", "link", 6, 14),
        S("stream:copy", "d2h", "copy", 32, 36),
    ]
    return Trace(spans, {"num_sms": 132, "schedule": "test"})


def test_interval_helpers():
    assert union([(3, 4), (0, 2), (1, 3), (6, 7)]) == [(0, 4), (6, 7)]
    assert length([(0, 2), (1, 3), (5, 6)]) == 4
    assert intersect([(0, 4), (6, 10)], [(2, 7), (9, 12)]) == [(2, 4), (6, 7), (9, 10)]


def test_step_time_and_per_rank(two_streams):
    assert two_streams.step_time_us == 40
    assert Trace().step_time_us == 0
    t = Trace(
        [
            S("stream:main", "a", "compute", 2, 5, rank=0),
            S("stream:main", "a", "compute", 1, 9, rank=1),
        ]
    )
    assert t.step_time_us == 8
    assert t.per_rank_step_us() == {0: 3, 1: 8}


def test_busy_counts_overlaps_once_and_skips_sync():
    t = Trace(
        [
            S("stream:main", "a", "compute", 0, 10),
            S("stream:main", "b", "compute", 5, 15),  # overlaps a: union 0-15
            S("stream:main", "c", "compute", 20, 25),
            S("host:t", "h", "host", 0, 2),
            S("host:t", "s", "sync", 2, 30),
        ]
    )
    assert t.busy_us() == {"host:t": 2, "stream:main": 20}


def test_busy_keys_with_several_ranks():
    t = Trace([S("stream:main", "a", "compute", 0, 3, rank=r) for r in (0, 1)])
    assert t.busy_us() == {"r0/stream:main": 3, "r1/stream:main": 3}
    assert t.busy_us(rank=1) == {"stream:main": 3}


def test_exposed_comm_partial_cover(two_streams):
    # comm ∪ link = [5,15] ∪ [28,40] = 22 µs; compute runs 0-30 (one stream),
    # covering [5,15] and [28,30]: exposed = 22 - 12 = 10.
    assert two_streams.exposed_comm_us() == pytest.approx(10)
    # the copy 32-36 hides 4 µs of the exposed combine: comm-only = 6.
    assert two_streams.comm_only_us() == pytest.approx(6)


def test_exposed_comm_link_only_and_other_rank():
    t = Trace(
        [
            S("stream:main", "x", "compute", 0, 4),
            S("link:nvlink", "l", "link", 2, 10),
            S("stream:main", "x", "compute", 0, 100, rank=1),
        ]
    )
    assert t.exposed_comm_us(0) == 6
    assert t.comm_only_us(0) == 6
    assert t.exposed_comm_us(1) == 0


def test_sm_utilisation(two_streams):
    held = 132 * 10 + 108 * 20 + 24 * 10 + 24 * 12
    assert two_streams.sm_utilisation() == pytest.approx(held / (132 * 40))
    assert two_streams.sm_utilisation(num_sms=264) == pytest.approx(held / (264 * 40))
    with pytest.raises(ConfigError):
        Trace([S("stream:main", "a", "compute", 0, 1)]).sm_utilisation()


def test_summary(two_streams):
    s = two_streams.summary()
    assert s["step_time_us"] == 40
    assert s["exposed_comm_us"] == pytest.approx(10)
    assert s["comm_only_us"] == pytest.approx(6)
    assert s["num_spans"] == 8
    assert "sm_utilisation" in s and s["busy_us"]["stream:main"] == 30
    assert "sm_utilisation" not in Trace([S("stream:main", "a", "compute", 0, 1)]).summary()


def test_span_validation():
    with pytest.raises(ConfigError):
        S("stream:main", "a", "bogus", 0, 1)
    with pytest.raises(ConfigError):
        S("stream:main", "a", "compute", 2, 1)


def test_canonical_order_and_equality():
    a = S("stream:main", "a", "compute", 0, 1)
    b = S("stream:alt", "b", "compute", 0.5, 2)
    assert Trace([b, a]) == Trace([a, b])
    assert hash(a) == hash(S("stream:main", "a", "compute", 0, 1))


def _tracks_by_name(doc):
    ev = doc["traceEvents"]
    procs = {
        e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"
    }
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in ev
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    return procs, threads


def test_chrome_structure_and_subtracks(two_streams):
    spans = list(two_streams.spans) + [
        S("stream:main", "shared_experts", "compute", 12, 20, sms=24, mb=1, layer=3, step=0)
    ]
    doc = Trace(spans, two_streams.meta).to_chrome()
    assert doc["otherData"] == {"num_sms": 132, "schedule": "test"}
    procs, threads = _tracks_by_name(doc)
    assert procs == {0: "rank 0"}
    names = [threads[k] for k in sorted(threads)]
    # host first, then streams (by first start), then links; the overlap goes to a sub-track.
    assert names == [
        "host:sched",
        "stream:main",
        "stream:main #2",
        "stream:comm",
        "stream:copy",
        "link:rdma",
    ]
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(spans)
    by_name = {e["name"]: e for e in xs}
    se = by_name["shared_experts"]
    assert threads[(se["pid"], se["tid"])] == "stream:main #2"
    assert se["ts"] == 12 and se["dur"] == 8
    assert se["args"] == {
        "lane": "stream:main",
        "kind": "compute",
        "sms": 24,
        "mb": 1,
        "layer": 3,
        "step": 0,
    }
    # no two slices overlap on one track (Perfetto's rule)
    per_track: dict = {}
    for e in xs:
        per_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for iv in per_track.values():
        iv.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(iv))


def test_chrome_deterministic_and_file_round_trip(tmp_path, two_streams):
    p1, p2 = tmp_path / "a.json", tmp_path / "b.json"
    save_json(two_streams, p1)
    save_json(Trace(reversed(two_streams.spans), two_streams.meta), p2)
    assert p1.read_bytes() == p2.read_bytes()
    back = load_json(p1)
    assert back == two_streams
    gz = tmp_path / "c.json.gz"
    save_json(two_streams, gz)
    assert load_json(gz) == two_streams


def test_round_trip_multi_rank_subtracks_and_awkward_floats():
    spans = [
        S("stream:main", "a", "compute", 0.1, 0.3, rank=r, sms=7, mb=1, layer=2, step=5)
        for r in (0, 3)
    ] + [
        S("stream:main", "b", "compute", 0.2, 0.7, rank=3),
        S("stream:main", "c", "compute", 0.25, 0.5, rank=3),
        S("host:ubatch0", "h", "host", 1 / 3, 2 / 3, rank=3),
    ]
    t = Trace(spans, {"world": 2, "micro_batches": ({"index": 0},)})
    doc = json.loads(json.dumps(t.to_chrome()))
    back = Trace.from_chrome(doc)
    assert back.spans == t.spans
    assert back.meta == {"world": 2, "micro_batches": [{"index": 0}]}
    _, threads = _tracks_by_name(doc)
    assert sorted(v for (pid, _), v in threads.items() if pid == 3) == [
        "host:ubatch0",
        "stream:main",
        "stream:main #2",
        "stream:main #3",
    ]


def test_from_chrome_maps_subtrack_names_without_lane_arg():
    doc = {
        "traceEvents": [
            {
                "ph": "M",
                "name": "thread_name",
                "pid": 0,
                "tid": 2,
                "args": {"name": "stream:main #2"},
            },
            {
                "ph": "X",
                "name": "k",
                "pid": 0,
                "tid": 2,
                "ts": 1.0,
                "dur": 2.0,
                "args": {"kind": "compute"},
            },
        ]
    }
    (s,) = Trace.from_chrome(doc).spans
    assert s.lane == "stream:main" and s.end == 3.0


TORCH_PROFILE = {
    "schemaVersion": 1,
    "distributedInfo": {"backend": "nccl", "rank": 1, "world_size": 2},
    "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "numSms": 132}],
    "traceEvents": [
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "aten::mm",
            "pid": 123,
            "tid": 123,
            "ts": 1000.0,
            "dur": 5.0,
        },
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "pid": 123,
            "tid": 123,
            "ts": 1001.0,
            "dur": 2.0,
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "sm90_xmma_gemm_bf16bf16_bf16f32",
            "pid": 0,
            "tid": 7,
            "ts": 1010.0,
            "dur": 20.0,
            "args": {"device": 0, "stream": 7, "grid": [66, 1, 1], "block": [384, 1, 1]},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "void deep_ep::internode_ll::dispatch<3, 10>()",
            "pid": 0,
            "tid": 20,
            "ts": 1015.0,
            "dur": 30.0,
            "args": {"device": 0, "stream": 20, "grid": [24, 1, 1]},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "ncclDevKernel_AllGather_RING_LL",
            "pid": 0,
            "tid": 20,
            "ts": 1050.0,
            "dur": 10.0,
            "args": {"device": 0, "stream": 20, "grid": [1000, 1, 1]},
        },
        {
            "ph": "X",
            "cat": "gpu_memcpy",
            "name": "Memcpy DtoH (Device -> Pinned)",
            "pid": 0,
            "tid": 9,
            "ts": 1060.0,
            "dur": 4.0,
            "args": {"device": 0, "stream": 9},
        },
        {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 1, "pid": 0, "tid": 7, "ts": 1010.0},
    ],
}


def test_torch_profiler_import():
    t = Trace.from_chrome(TORCH_PROFILE)
    assert [(s.lane, s.kind, s.start, s.end, s.sms) for s in t.spans] == [
        ("stream:7", "compute", 0.0, 20.0, 66),
        ("stream:20", "comm", 5.0, 35.0, 24),
        ("stream:20", "comm", 40.0, 50.0, 132),
        ("stream:9", "copy", 50.0, 54.0, 0),
    ]
    assert {s.rank for s in t.spans} == {1}
    assert t.meta["num_sms"] == 132 and t.meta["time_origin_us"] == 1010.0
    assert t.meta["backend"] == "torch.profiler"
    assert t.exposed_comm_us(rank=1) == pytest.approx(15 + 10)  # 20-35 and 40-50
    assert Trace.from_chrome(TORCH_PROFILE, rank=0).ranks == (0,)
    # imported traces export like ours and read back the same
    assert Trace.from_chrome(t.to_chrome()).spans == t.spans


def test_from_chrome_bad_input(tmp_path):
    with pytest.raises(ConfigError):
        Trace.from_chrome(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError):
        Trace.from_chrome(bad)
    with pytest.raises(ConfigError):
        Trace.from_chrome({"foo": 1})


def test_import_does_not_pull_heavy_modules():
    code = (
        "import sys, shared.outputs.trace; "
        "bad = [m for m in ('matplotlib', 'torch', 'simpy') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
