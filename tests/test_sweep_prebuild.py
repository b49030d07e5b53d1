"""Sweeps: cases known to share a sim_key before their build (the watched GPU fields)."""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle

import pytest

# internals tested directly: the sweep's input keys, read watching, byte keys and row order
from overlap_lab.cli import sweep
from overlap_lab.cli.sweep import lower_case, sim_key

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


def test_a_schedule_knob_the_build_does_not_read_skips_the_build(builds):
    """serial does not read --comm-sms (it is in inputs.KNOB_SCHEDULES for the four that do):
    its cases merge."""
    claims = sweep._LocalClaims({})
    cases = [
        {**BASE, "schedule": s, "batch": 16, "comm_sms": c}
        for s in ("serial", "sbo")
        for c in (8, 12)
    ]
    res = [sweep.run_case(i, k, claims) for i, k in enumerate(cases)]
    assert all(not r["error"] for r in res)
    assert builds == ["serial", "sbo", "sbo"]
    assert res[1]["same_as"] == 0 and res[1]["sim_key"] == _key(cases[1])
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
    assert reads == {("gpu", f) for f in sweep._UNKEYED_GPU_FIELDS}
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
    assert reads == {("gpu", "sbo_comm_sms")}
    a.cfg.sbo_mode  # noqa: B018 - a schedule's own knob: read through the config's ``own``
    assert reads == {("gpu", "sbo_comm_sms"), ("cfg", "own")}


def test_a_watched_build_gives_the_same_program():
    for s in ("serial", "sbo", "tbo", "deepseek"):
        knobs = {**BASE, "schedule": s, "batch": 16, "sbo_comm_sms": 8}
        (_, p, g, t, _, _), _ = sweep._lower_watched(sweep._inputs(knobs))
        _, q, h, u, _, _ = lower_case(knobs)
        assert p.ranks == q.ranks and g == h and t == u


def _first_graph_op(p):
    from overlap_lab.shared.ir.program import Graph, Launch

    for th in p.ranks[0].threads:
        for k, ins in enumerate(th.instrs):
            if isinstance(ins, Graph):
                j = next(j for j, b in enumerate(ins.body) if isinstance(b, Launch))
                return th, k, ins, j
    raise AssertionError("no graph")


def _with_op(p, op):
    """``p`` with the first launch of its first graph running ``op``."""
    th, k, graph, j = _first_graph_op(p)
    body = (*graph.body[:j], dataclasses.replace(graph.body[j], op=op), *graph.body[j + 1 :])
    g2 = dataclasses.replace(graph, body=body)
    th2 = dataclasses.replace(th, instrs=(*th.instrs[:k], g2, *th.instrs[k + 1 :]))
    rp = p.ranks[0]
    threads = tuple(th2 if t is th else t for t in rp.threads)
    return dataclasses.replace(p, ranks=(dataclasses.replace(rp, threads=threads),))


def test_the_ranks_encoding_is_by_value_and_exact():
    from overlap_lab.shared.ir.program import Op

    _, p, g, t, _, _ = lower_case({**BASE, "schedule": "sbo", "batch": 16})
    th, k, graph, j = _first_graph_op(p)
    op = graph.body[j].op
    assert sweep._ranks_bytes(p.ranks) == sweep._ranks_bytes(_with_op(p, copy.deepcopy(op)).ranks)
    changed = [
        dataclasses.replace(op, flops=math.nextafter(op.flops, math.inf)),  # one ulp
        dataclasses.replace(op, hbm_bytes=float(op.hbm_bytes) + 0.5),
        dataclasses.replace(op, tokens=float(op.tokens)),  # 16 == 16.0, but not the same Program
        dataclasses.replace(op, sms=True if op.sms == 1 else 1),
        dataclasses.replace(op, layer=None if op.layer is not None else 0),
        dataclasses.replace(op, waits=(*op.waits, "x")),
    ]
    keys = {sim_key(p, g, t)} | {sim_key(_with_op(p, o), g, t) for o in changed}
    assert len(keys) == 1 + len(changed)

    class Sub(Op):  # an op type the encoding does not know: hashed by repr, still exact
        pass

    sub = Sub(**{f.name: getattr(op, f.name) for f in dataclasses.fields(Op)})
    with pytest.raises(TypeError):
        sweep._ranks_bytes(_with_op(p, sub).ranks)
    assert sim_key(_with_op(p, sub), g, t) != sim_key(p, g, t)


def test_workers_share_what_builds_taught_them():
    """A key learnt in one process is found through the pool's shared table in another; an entry
    already there is not added twice."""
    from multiprocessing import Manager

    case = sweep._inputs({**BASE, "schedule": "serial", "batch": 16})
    ikey = sweep._input_key(case)
    with Manager() as manager:
        table = manager.dict()
        sweep._KnownKeys(table).add(ikey, {("gpu", "sbo_comm_sms")}, case, "k1")
        sweep._KnownKeys(table).add(ikey, {("gpu", "sbo_comm_sms")}, case, "k1")
        other = sweep._KnownKeys(table)
        assert other.lookup(ikey, case) == "k1" and len(table[ikey]) == 1
        changed = dataclasses.replace(
            case, gpu=dataclasses.replace(case.gpu, sbo_comm_sms=case.gpu.sbo_comm_sms + 1)
        )
        assert other.lookup(ikey, changed) is None  # a read field with another value: no key


def test_cases_are_dispatched_last_knob_slowest():
    todo = [
        (i, {"schedule": s, "batch": b, "sbo_comm_sms": c})
        for i, (s, b, c) in enumerate(
            (s, b, c) for s in ("serial", "sbo") for b in (16, 32) for c in (8, 4)
        )
    ]
    done = set(range(len(todo)))
    del todo[3]  # a case done before: the rest keep their order
    order = [i for i, _ in sweep._spread(todo)]
    assert sorted(order) == sorted(done - {3})
    # comm SMs 8 (first seen) before 4, then batch, then schedule; cases stay whole
    assert order == [0, 4, 2, 6, 1, 5, 7]
    assert all(dict(todo)[i] == knobs for i, knobs in sweep._spread(todo))
