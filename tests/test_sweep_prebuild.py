"""Sweeps: cases known to share a sim_key before their build (the watched GPU fields)."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from overlap_lab.experiments import sweep
from overlap_lab.experiments.sweep import lower_case, sim_key

BASE = {"model": "deepseek-v3", "gpu": "h800", "mode": "decode", "layers": 3, "ep": 8}


@pytest.fixture
def builds(monkeypatch):
    """A fresh table of known input keys, and the cases each build ran for."""
    monkeypatch.setattr(sweep, "_known", sweep._KnownKeys())
    seen: list[str] = []
    real = sweep._lower

    def counting(c):
        seen.append(c.args.schedule)
        return real(c)

    monkeypatch.setattr(sweep, "_lower", counting)
    return seen


def _key(knobs) -> str:
    _, p, g, t, prof, _ = lower_case(knobs)
    return sim_key(p, g, t, prof)


def test_a_knob_the_build_does_not_read_skips_the_build(builds):
    claims = sweep._LocalClaims({})
    cases = [
        {**BASE, "schedule": s, "batch": 16, "sbo_comm_sms": c}
        for s in ("serial", "sbo")
        for c in (8, 12)
    ]
    res = [sweep.run_case(i, k, claims) for i, k in enumerate(cases)]
    assert all(not r["error"] for r in res)
    # serial never reads sbo_comm_sms: its second case is known without a build; SBO reads it
    assert builds == ["serial", "sbo", "sbo"]
    assert res[1]["same_as"] == 0 and res[1]["sim_key"] == res[0]["sim_key"] == _key(cases[1])
    assert res[2]["same_as"] == res[3]["same_as"] == ""
    assert res[2]["sim_key"] == _key(cases[2]) != res[3]["sim_key"] == _key(cases[3])


def test_without_deduplication_every_case_is_built(builds):
    cases = [{**BASE, "schedule": "serial", "batch": 16, "sbo_comm_sms": c} for c in (8, 12)]
    res = [sweep.run_case(i, k, lambda key, i: i) for i, k in enumerate(cases)]
    assert builds == ["serial", "serial"] and all("step_time_us" in r for r in res)


def test_other_inputs_are_in_the_input_key(builds):
    claims = sweep._LocalClaims({})
    cases = [
        {**BASE, "schedule": "serial", "batch": 16},
        {**BASE, "schedule": "serial", "batch": 17},
        {**BASE, "schedule": "serial", "batch": 16, "hbm_gbps": 3350.0000000001},
        {**BASE, "schedule": "serial", "batch": 16, "launch_us": 6.5},
    ]
    res = [sweep.run_case(i, k, claims) for i, k in enumerate(cases)]
    assert len(builds) == 4 and len({r["sim_key"] for r in res}) == 4
    assert all(r["same_as"] == "" for r in res)


@pytest.mark.parametrize(
    "whole",
    [
        lambda g: dataclasses.replace(g, launch_us=1.0),
        lambda g: dataclasses.asdict(g),
        lambda g: vars(g),
        lambda g: copy.copy(g),
        lambda g: pickle.dumps(g),
    ],
)
def test_reading_the_whole_gpu_counts_as_reading_every_left_out_field(whole, monkeypatch):
    case = sweep._inputs({**BASE, "schedule": "serial", "batch": 16})
    watched, reads = sweep._watching(case)
    monkeypatch.setattr(sweep, "_reads", reads)
    assert watched.gpu.num_sms == case.gpu.num_sms and not reads  # a keyed field: not noted
    whole(watched.gpu)
    assert reads == set(sweep._UNKEYED_GPU_FIELDS)
    assert pickle.loads(pickle.dumps(watched.gpu)) == case.gpu  # comes back plain


def test_a_watched_gpu_equals_only_itself(monkeypatch):
    """So a cache keyed on the GPU cannot hand a build a value computed in another build."""
    case = sweep._inputs({**BASE, "schedule": "sbo", "batch": 16})
    a, _ = sweep._watching(case)
    b, reads = sweep._watching(case)
    monkeypatch.setattr(sweep, "_reads", reads)
    assert a.gpu != b.gpu and a.gpu == a.gpu and hash(a.gpu) != hash(b.gpu)
    assert not reads
    b.gpu.sbo_comm_sms  # noqa: B018 - a read of a left-out field
    assert reads == {"sbo_comm_sms"}


def test_a_watched_build_gives_the_same_program():
    for s in ("serial", "sbo", "tbo", "deepseek"):
        knobs = {**BASE, "schedule": s, "batch": 16, "sbo_comm_sms": 8}
        (_, p, g, t, _, _), _ = sweep._lower_watched(sweep._inputs(knobs))
        _, q, h, u, _, _ = lower_case(knobs)
        assert p.ranks == q.ranks and g == h and t == u
