"""Sweeps: which cases share a simulation. Every case is built; cases whose lowered Programs run
alike on the simulator's view of the GPU share a key and are simulated once."""

from __future__ import annotations

import dataclasses

from overlap_lab import runner
from overlap_lab.cli.sweep import case_inputs
from overlap_lab.simcase import build
from overlap_lab.sweep import SweepJob, sim_key

BASE = {"model": "deepseek-v3", "gpu": "h800", "mode": "decode", "layers": 3, "ep": 8}


def _key(knobs) -> str:
    case = case_inputs(knobs)
    w, p, tol = build(case)
    return sim_key(p, case.gpu, tol, case.profile, workload=w, ranks=case.ranks)


def _run(cases, dedupe=True):
    """The cases through the runner in this process: their outcomes and how many simulated."""
    finished = []

    class Counting(SweepJob):
        def finish(self, prepared):
            if prepared.state is not None:  # built: simulated here
                finished.append(prepared.key)
            return super().finish(prepared)

    job = Counting(case_inputs)
    outs = {o.index: o for o in runner.run(job, enumerate(cases), backend=runner.Local(1),
                                           dedupe=dedupe)}  # fmt: skip
    return outs, finished


def test_a_gpu_field_the_build_does_not_read_merges():
    cases = [
        {**BASE, "schedule": s, "batch": 16, "sbo_comm_sms": c}
        for s in ("serial", "sbo")
        for c in (8, 12)
    ]
    outs, finished = _run(cases)
    assert all(not o.result["error"] for o in outs.values())
    # serial never reads sbo_comm_sms: its second case shares the first's simulation; SBO reads it
    assert len(finished) == 3
    assert outs[1].same_as == 0 and outs[1].key == outs[0].key == _key(cases[1])
    assert outs[1].shared["step_time_us"] == outs[0].result["step_time_us"]
    assert outs[2].same_as is None and outs[3].same_as is None
    assert outs[2].key == _key(cases[2]) != outs[3].key == _key(cases[3])


def test_a_schedule_knob_of_other_schedules_merges():
    """serial does not read --comm-sms (in checks.partial_knob_readers() for the four that do): the
    parse gives both serial cases its default, and they merge."""
    cases = [
        {**BASE, "schedule": s, "batch": 16, "comm_sms": c}
        for s in ("serial", "sbo")
        for c in (8, 12)
    ]
    outs, finished = _run(cases)
    assert len(finished) == 3 and outs[1].same_as == 0
    assert outs[2].key != outs[3].key


def test_without_deduplication_every_case_is_simulated():
    cases = [{**BASE, "schedule": "serial", "batch": 16, "sbo_comm_sms": c} for c in (8, 12)]
    outs, finished = _run(cases, dedupe=False)
    assert len(finished) == 2 and all("step_time_us" in o.result for o in outs.values())
    assert outs[0].key == outs[1].key  # the same key all the same


def test_other_inputs_give_other_keys():
    cases = [
        {**BASE, "schedule": "serial", "batch": 16},
        {**BASE, "schedule": "serial", "batch": 17},
        {**BASE, "schedule": "serial", "batch": 16, "hbm_gbps": 3350.0000000001},
        {**BASE, "schedule": "serial", "batch": 16, "launch_us": 6.5},
        {**BASE, "schedule": "serial", "batch": 16, "profile": "roofline"},
        {**BASE, "schedule": "serial", "batch": 16, "max_events": 10**7},
    ]
    outs, finished = _run(cases)
    assert len(finished) == len(cases) and len({o.key for o in outs.values()}) == len(cases)


def test_explicit_ranks_key_how_they_are_run():
    """Balanced explicit ranks reduced to one or every rank run: two runs (the network's grouping
    tolerance applies to the second only), two keys; the seed of balanced routing: one."""
    explicit = {**BASE, "schedule": "tbo", "batch": 16, "ranks": "explicit"}
    assert _key({**explicit, "seed": 1}) == _key({**explicit, "seed": 2})
    assert _key(explicit) != _key({**explicit, "reduce_ranks": False})


def test_a_failing_case_is_an_error_row_with_no_key():
    cases = [{**BASE, "schedule": "sbo", "batch": 16, "comm_sms": 500}]  # above the GPU's SMs
    outs, finished = _run(cases)
    assert outs[0].key is None and "comm-sms" in outs[0].result["error"] and not finished


def test_the_key_reads_the_program_not_its_report():
    case = case_inputs({**BASE, "schedule": "sbo", "batch": 16})
    w, p, tol = build(case)
    relabeled = dataclasses.replace(p, meta=p.meta.merged(note="reporting only"))
    assert sim_key(relabeled, case.gpu, tol) == sim_key(p, case.gpu, tol)
    assert p.content_key() == relabeled.content_key()
