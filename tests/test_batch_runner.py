"""The one runner of batches of simulations (overlap_lab.runner): plain and keyed jobs on local
processes and on Ray (a stand-in, tests/fake_ray.py, where Ray is not installed), and the sweep,
the experiments and a sensitivity design each run through it, with the same results either way."""

from __future__ import annotations

import json
import sys

import pytest

import overlap_lab as ol
from overlap_lab import runner
from overlap_lab.runner import Local, Prepared, Ray, in_order, run
from overlap_lab.sensitivity import Design, sensitivity
from overlap_lab.shared.errors import ConfigError
from tests.fake_ray import FakeRay


@pytest.fixture
def fake_ray(monkeypatch):
    fake = FakeRay(seed=3)
    monkeypatch.setitem(sys.modules, "ray", fake)
    return fake


@pytest.fixture
def steps(monkeypatch):
    """The cases ``runner.step`` ran in this process (in-process backends: Local(1), Ray's
    stand-in), by index."""
    seen: list[int] = []
    real = runner.step

    def counting(job, claim, index, case):
        seen.append(index)
        return real(job, claim, index, case)

    monkeypatch.setattr(runner, "step", counting)
    return seen


def _backend(name: str):
    return {"local1": Local(1), "local2": Local(2), "ray": Ray()}[name]


BACKENDS = ("local1", "local2", "ray")


def _square(x: int) -> int:
    return x * x


class Halves:
    """A keyed job: cases ``2k`` and ``2k + 1`` share the key ``k``."""

    def prepare(self, case: int) -> Prepared:
        return Prepared(str(case // 2), case, {"own": case})

    def finish(self, prepared: Prepared) -> dict:
        return {"value": (prepared.state // 2) ** 2, "by": prepared.state}


@pytest.mark.parametrize("name", BACKENDS)
def test_a_plain_job_gives_its_results_in_case_order(name, fake_ray):
    assert in_order(_square, list(range(7)), backend=_backend(name)) == [x * x for x in range(7)]


@pytest.mark.parametrize("name", BACKENDS)
def test_a_keyed_job_runs_each_key_once_and_duplicates_share_it(name, fake_ray):
    outs = list(run(Halves(), enumerate(range(6)), backend=_backend(name)))
    by = {o.index: o for o in outs}
    assert sorted(by) == list(range(6))
    owners = [o for o in outs if o.same_as is None]
    assert sorted(int(o.key) for o in owners) == [0, 1, 2]  # one simulation per key
    for o in outs:
        if o.same_as is not None:
            assert o.key == by[o.same_as].key and o.result == {"own": o.index}
            assert o.shared == by[o.same_as].result
            assert outs.index(o) > outs.index(by[o.same_as])  # after the result it shares
    assert [by[i].shared or by[i].result for i in range(6)] == [
        {"value": (i // 2) ** 2, "by": by[i].same_as if by[i].same_as is not None else i}
        for i in range(6)
    ]


def test_duplicates_wait_for_an_owner_that_finishes_later(fake_ray):
    """Ray hands results back in any order: a duplicate that comes back first is held until its
    owner's result is there (the stand-in shuffles them; several seeds)."""
    for seed in range(6):
        fake_ray._rng.seed(seed)
        outs = list(run(Halves(), enumerate(range(8)), backend=Ray()))
        pos = {o.index: k for k, o in enumerate(outs)}
        assert all(pos[o.same_as] < pos[o.index] for o in outs if o.same_as is not None)


def test_known_keys_are_shared_not_run_again(steps):
    outs = list(run(Halves(), [(2, 2), (3, 3), (4, 4)], backend=Local(1), known={"1": (9, "x")}))
    by = {o.index: o for o in outs}
    assert by[2].same_as == by[3].same_as == 9 and by[2].shared == "x"
    assert by[4].same_as is None and by[4].result["value"] == 4
    plain = list(run(Halves(), [(2, 2), (3, 3)], backend=Local(1), dedupe=False))
    assert all(o.same_as is None for o in plain)


def test_workers_are_capped_and_checked(monkeypatch):
    monkeypatch.setattr(runner, "cpus", lambda: 3)
    assert Local(8).workers(100) == 3 and Local(8).workers(2) == 2 and Local(1).workers(9) == 1
    assert Local().workers(100) == 3
    with pytest.raises(ConfigError, match="at least 1"):
        Local(0)


def test_ray_not_installed_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(ConfigError, match=r"needs Ray: pip install 'overlap-lab\[ray\]'"):
        list(run(_square, [(0, 1)], backend=Ray()))


# ---- the three batches of the project, through the runner ---------------------------------


SPEC = {
    "base": {"model": "deepseek-v3", "gpu": "h800", "mode": "decode", "layers": 3, "ep": 8},
    "grid": {"schedule": ["serial", "sbo"], "batch": [16, 32], "sbo-comm-sms": [8, 16]},
    "cases": [{"schedule": "tbo", "ranks": "explicit", "batch": 16, "seed": s} for s in (1, 2)],
}


def test_the_sweep_runs_through_the_runner(tmp_path, fake_ray, steps):
    from overlap_lab.cli.sweep import run_sweep
    from overlap_lab.sweep_csv import read_rows

    def rows(path):
        return sorted(read_rows(path), key=lambda r: int(r["case"]))

    local = run_sweep(SPEC, tmp_path / "local.csv", processes=1, progress=False)
    assert sorted(steps) == list(range(10))
    run_sweep(SPEC, tmp_path / "two.csv", processes=2, progress=False)
    steps.clear()
    remote = run_sweep(SPEC, tmp_path / "ray.csv", backend="ray", progress=False)
    assert sorted(steps) == list(range(10)) and "remote _ray_step" in fake_ray.calls
    assert local == remote and local["simulated"] == 2 + 4 + 1 and local["duplicates"] == 3
    assert rows(tmp_path / "local.csv") == rows(tmp_path / "two.csv") == rows(tmp_path / "ray.csv")


def test_the_experiments_run_through_the_runner(tmp_path, fake_ray, steps):
    from overlap_lab.experiments.runner import run as run_experiment
    from tests.test_runner import TINY

    def rows(path):
        return json.loads(path.read_text())["rows"]

    a = rows(run_experiment(TINY, processes=1, out=tmp_path / "a"))
    assert steps == [0, 1]
    b = rows(run_experiment(TINY, processes=2, out=tmp_path / "b"))
    c = rows(run_experiment(TINY, out=tmp_path / "c", backend=Ray()))
    assert a == b == c and "remote _ray_step" in fake_ray.calls


@pytest.fixture(scope="module")
def small():
    w = ol.workload("deepseek-v3", mode="decode", batch=64, ep=32, layers=4)
    return ol.compare(["serial", "tbo"], w, "h800")


def test_a_sensitivity_design_runs_through_the_runner(small, fake_ray, steps):
    d = Design(oat=False, lhs=3, seed=2)
    one = sensitivity(small, d, workers=1)
    assert sorted(steps) == [0, 1, 2]
    two = sensitivity(small, d, workers=2)
    on_ray = sensitivity(small, d, backend=Ray())
    assert one == two == on_ray and "remote _ray_step" in fake_ray.calls
