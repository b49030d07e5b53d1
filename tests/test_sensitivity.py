"""Sensitivity of a comparison (overlap_lab.sensitivity): seeded designs, a cost-only
perturbation that leaves the nominal run unchanged, ranges and wins that follow the runs, and
the command line's option and figure."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import overlap_lab as ol
from overlap_lab import runner
from overlap_lab.sensitivity import (
    INPUTS,
    Design,
    PerturbedCostModel,
    Point,
    design_from,
    perturbed_gpu,
    sensitivity,
)
from overlap_lab.shared.errors import ConfigError
from overlap_lab.sim.cost import RooflineCostModel
from overlap_lab.sim.engine import Engine

ROOT = Path(__file__).parents[1]


def input_table(inputs=INPUTS) -> str:
    """The inputs as a markdown table: docs/uncertainty.md's, written from the records."""
    lines = [
        "| input | what | range (x nominal) | basis | varied |",
        "| --- | --- | --- | --- | --- |",
    ]
    for i in inputs:
        lines.append(
            f"| `{i.name}` | {i.what} | {i.lo:g}-{i.hi:g} | {i.basis} | "
            f"{'yes' if i.varied else 'no'} |"
        )
    return "\n".join(lines)


@pytest.fixture(scope="module")
def small():
    w = ol.workload("deepseek-v3", mode="decode", batch=64, ep=32, layers=4)
    return ol.compare(["serial", "tbo", "tbo+sbo"], w, "h800")


def test_design_is_seeded_and_latin():
    d = Design(oat=True, lhs=5, seed=7)
    assert d.points() == Design(oat=True, lhs=5, seed=7).points()
    assert d.points() != Design(oat=True, lhs=5, seed=8).points()
    varied = d.varied()
    assert len(d.points()) == 2 * len(varied) + 5
    lhs = [p for p in d.points() if p.label.startswith("lhs")]
    for i in varied:  # one point per stratum of every input's range
        xs = sorted(p.factor(i.name) for p in lhs)
        strata = [int((x - i.lo) / (i.hi - i.lo) * 5) for x in xs]
        assert strata == list(range(5)), i.name
    oat = [p for p in d.points() if not p.label.startswith("lhs")]
    assert all(len(p.factors) == 1 for p in oat)


def test_design_from_strings_and_refusals():
    assert design_from(True) == Design()
    assert design_from(None) is None
    assert design_from("lhs=8,seed=3,oat=0,inputs=hbm+rdma") == Design(
        oat=False, lhs=8, seed=3, inputs=("hbm", "rdma")
    )
    for bad in ("lhs=x", "colour=1", "inputs=nope", "oat=0,lhs=0", "inputs=comm_sms"):
        with pytest.raises(ConfigError):
            design_from(bad)


def test_nominal_point_reproduces_the_run(small):
    """The wrapper at factors 1 is the wrapped model: same window to the last bit."""
    g = small.baseline.gpu
    inner = RooflineCostModel(ol.api.resolve_profile("auto", g))
    for row in small.rows:
        cm = PerturbedCostModel(inner, g, Point("nominal", ()))
        t = Engine(row.result.program, g, 0, cost_model=cm).run()
        assert t.step_time_us == row.result.trace.step_time_us


def test_perturbed_gpu_scales_the_named_fields():
    g = ol.gpu("h800")
    p = perturbed_gpu(g, Point("x", (("hbm", 0.5), ("rdma", 2.0), ("deepep_fixed", 0.5))))
    assert p.hbm_gbps == g.hbm_gbps * 0.5
    assert p.rdma_eff_gbps == g.rdma_eff_gbps * 2.0
    assert p.deepep_ll_recv_us == g.deepep_ll_recv_us * 0.5
    assert p.bf16_tflops == g.bf16_tflops and p.num_sms == g.num_sms


def test_slower_costs_slow_every_schedule(small):
    s = sensitivity(small, Design(oat=True, lhs=0, inputs=("hbm", "rdma")))
    labels = [p.label for p in s.points]
    assert labels == ["hbm x0.85", "hbm x1.05", "rdma x0.85", "rdma x1.1"]
    for sched, its in s.iteration_us.items():
        nominal, hbm_lo, hbm_hi, rdma_lo, rdma_hi = its
        assert hbm_lo > nominal > hbm_hi, sched  # less bandwidth, more time
        assert rdma_lo >= nominal >= rdma_hi, sched
        r = s[sched]
        assert r.lo_us == min(its) and r.hi_us == max(its) and r.nominal_us == nominal


def test_ranges_wins_and_separation(small):
    s = sensitivity(small, Design(lhs=3, seed=1))
    assert s == sensitivity(small, Design(lhs=3, seed=1))  # same seed, same result
    n = len(s.points) + 1
    assert abs(sum(r.wins for r in s.ranges) - 1.0) < 1e-9
    for r in s.ranges:
        best = sum(1 for k in range(n) if s.tps[r.schedule][k] == max(s.tps[o][k] for o in s.tps))
        assert r.wins * n == pytest.approx(best)  # no ties among these three
        for o in s.tps:
            if o != r.schedule:
                overlap = min(s.tps[o]) <= max(s.tps[r.schedule]) and min(s.tps[r.schedule]) <= max(
                    s.tps[o]
                )
                assert (o in r.not_separated) == overlap
                assert s.separated(r.schedule, o) == (not overlap)
        assert 0.0 <= s.paired_share(r.schedule, "serial") <= 1.0


def test_workers_share_the_points_and_change_nothing(small):
    """Forked workers give what one process gives (each point is simulated alone)."""
    d = Design(oat=False, lhs=3, seed=2)
    assert sensitivity(small, d, workers=2) == sensitivity(small, d, workers=1)
    with pytest.raises(ConfigError, match="workers"):
        sensitivity(small, d, workers=0)


def test_compare_carries_it_and_prints_it(small):
    w = small.baseline.workload
    c = ol.compare(["serial", "tbo"], w, "h800", sensitivity="oat=0,lhs=2")
    assert c.sensitivity is not None and set(c.sensitivity.iteration_us) == {"serial", "tbo"}
    text = c.text()
    assert "Sensitivity: 3 points" in text and "wins  group" in text
    flat = " ".join(text.split())
    assert "Not varied: interference, comm_sms, kernel_floor" in flat  # and says what it means
    assert "up to 1.21x slower than simulated" in flat
    plain = ol.compare(["serial"], w, "h800")
    assert plain.sensitivity is None
    assert "kernels lost up to 21 % more" in " ".join(plain.text().split())  # said without it too
    json.dumps(c.sensitivity.as_dict())


def test_explicit_ranks_are_rerun_explicitly(monkeypatch):
    """A comparison of every rank is re-run the same way (reduced or with the network's grouping
    tolerance), not as one symmetric Program."""
    calls = []
    real = ol.api.simulate_explicit

    def counted(lowered, w, g, r, prof, max_events, models=None):
        calls.append((lowered, (models or {}).get("cost_model")))
        return real(lowered, w, g, r, prof, max_events, models)

    monkeypatch.setattr(ol.api, "simulate_explicit", counted)
    monkeypatch.setattr(runner, "cpus", lambda: 1)  # counted here, not in a worker
    w = ol.workload("deepseek-v3", mode="decode", batch=32, ep=16, layers=3)
    design = Design(oat=False, lhs=2, inputs=("hbm",))
    c = ol.compare(
        ["serial", "tbo"], w, "h800", ranks="explicit", imbalance="zipf:1.2", sensitivity=design
    )
    s = c.sensitivity
    for sched, its in s.iteration_us.items():
        assert its[0] == c[sched].result.metrics.iteration_us
        assert len(its) == 3 and its[1] != its[0]  # perturbed
    reruns = [p for p, cm in calls if isinstance(cm, PerturbedCostModel)]
    assert len(reruns) == 2 * 2  # 2 points x 2 schedules
    programs = {id(row.result.program) for row in c.rows}
    assert all(id(p) in programs for p in reruns)  # each the comparison's explicit Program


def test_docs_table_is_the_inputs():
    doc = (ROOT / "docs" / "uncertainty.md").read_text()
    assert input_table(INPUTS) in doc
    for i in INPUTS:  # each range has its why
        assert re.search(rf"\*\*`{i.name}`\*\*", doc), i.name


def test_cli_sensitivity_option_and_figure(tmp_path, capsys):
    from overlap_lab.cli.main import main

    rc = main(
        [
            "compare",
            "--schedules",
            "serial,tbo",
            "--model",
            "deepseek-v3",
            "--layers",
            "3",
            "--batch",
            "32",
            "--sensitivity",
            "oat=0,lhs=2",
            "--out",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "Sensitivity: 3 points" in out
    assert (tmp_path / "sensitivity.png").stat().st_size > 1000
    rc = main(["compare", "--schedules", "serial", "--layers", "3", "--sensitivity", "lhs=x"])
    assert rc == 2
    assert "--sensitivity: lhs needs an integer" in capsys.readouterr().err


def _stub(tps: dict[str, tuple[float, ...]]):
    """A Sensitivity of made-up throughputs per point (nominal first)."""
    from overlap_lab.sensitivity import Sensitivity, _ranges

    its = {k: tuple(1e6 / t for t in v) for k, v in tps.items()}
    return Sensitivity(Design(), (), its, tps, _ranges(its, tps))


def test_schedules_not_separated_are_shown_as_groups_once():
    """Nothing separated: every row listed every other schedule, and the pairs were cut."""
    names = [f"s{i}" for i in range(10)]
    s = _stub({n: (100.0 + i, 90.0 + i, 120.0 - i) for i, n in enumerate(names)})
    assert s.groups() == [names[::-1]]  # one group, nominally fastest first
    text = s.text()
    rows = [ln for ln in text.splitlines() if ln[:1] == "s" and ln[1:2].isdigit()]
    assert len(rows) == 10 and all(ln.endswith("%  1") for ln in rows)
    assert "more pairs" not in text and text.count("s9 [") == 1
    chain = " ".join(text.split("\n  1: ", 1)[1].split("\n\n")[0].split())
    assert chain.startswith("s9 [67 %] s8 [67 %] s7") and chain.endswith("s0")  # 2 of 3 points


def test_separated_schedules_are_in_no_group():
    s = _stub({"a": (100.0, 99.0), "b": (98.0, 100.5), "c": (50.0, 51.0), "d": (10.0, 11.0)})
    assert s.groups() == [["a", "b"]]
    rows = {
        ln.split()[0]: ln.split()[-1]
        for ln in s.text().splitlines()
        if ln[:2] in ("a ", "b ", "c ", "d ")
    }
    assert rows == {"a": "1", "b": "1", "c": "-", "d": "-"}
