"""overlap-lab tune: the frontier's definition, the search's pruning against brute force, the space
learnt from the knob records, resuming, and the API end to end on a cut model."""

from __future__ import annotations

import hashlib
import json

import pytest

import overlap_lab as ol
from overlap_lab import runner
from overlap_lab.shared import schedules as registry
from overlap_lab.shared.errors import ConfigError
from overlap_lab.tune import RESULTS, _Evaluator, tune
from overlap_lab.tune_search import Point, Search, best_under, dominates, pareto
from overlap_lab.tune_space import (
    Deployment,
    Setting,
    Space,
    batches,
    dims,
    layouts,
    tunable_knobs,
)

# ---- the frontier ---------------------------------------------------------------------------


def _p(ms, tps, name="serial", b=8):
    return Point(Setting(name, 8), b, ms, tps)


def test_pareto_keeps_exactly_the_points_nothing_dominates():
    pts = [_p(10, 100), _p(12, 150), _p(11, 90), _p(12, 150, "tbo"), _p(20, 150), _p(9, 50)]
    front = pareto(pts)
    assert [(p.ms, p.tps) for p in front] == [(9, 50), (10, 100), (12, 150), (12, 150)]
    for p in pts:
        assert (p in front) == (not any(dominates(q, p) for q in pts))


def test_best_under_a_target_is_the_most_throughput_within_it():
    pts = [_p(10, 100), _p(12, 150), _p(30, 400)]
    assert best_under(pts, 12).tps == 150
    assert best_under(pts, None).tps == 400
    assert best_under(pts, 5) is None


def test_of_tied_points_one_that_ran_as_its_name_comes_before_a_fallback():
    """sbo on DeepEP's normal kernels runs as serial: the same numbers as serial's. Ties go to
    fewer knobs, then by label (sbo before serial), unless a point fell back: then the other."""
    sbo, serial = _p(10, 100, "sbo"), _p(10, 100, "serial")
    assert best_under([serial, sbo], None) == sbo  # by label, nothing said of fallbacks

    def fell_back(p):
        return p.setting.schedule == "sbo"

    assert best_under([sbo, serial], None, fell_back) == serial
    assert best_under([sbo, serial, _p(9, 100, "sbo")], None, fell_back).ms == 9  # faster first
    assert pareto([sbo, serial], fell_back) == [serial, sbo]
    fewer = _p(10, 100, "sbo")  # no knobs; a fallback all the same
    knobbed = Point(Setting("serial", 8, knobs=(("comm_sms", 6),)), 8, 10, 100)
    assert best_under([fewer, knobbed], None, fell_back) == knobbed


# ---- the search against brute force, on a synthetic evaluator -------------------------------


def _deployment(**kw):
    return Deployment(ol.model("deepseek-v3"), ol.gpu("h800"), 8, layers=2, **kw)


def _synthetic(dip: Setting | None = None):
    """ms affine in the batch with a per-setting slope and intercept (seeded by the setting's
    label): monotone, as the pruning assumes, except a dip on ``dip``."""
    calls: list = []

    def evaluate(pairs):
        calls.extend(pairs)
        out = {}
        for s, b in pairs:
            h = hashlib.sha256(s.label().encode()).digest()
            a, c = 5 + h[0] / 16, 0.05 + h[1] / 600
            ms = a + c * b
            if s == dip and b == 32:
                ms = a  # iteration time falls as the batch grows: the series is never pruned
            out[(s, b)] = Point(s, b, ms, 1000 * b / ms)
        return out

    return evaluate, calls


def _search(evaluate, *, exhaustive, per_schedule=False, names=("serial", "sbo", "tbo")):
    d = _deployment()
    space = Space(batches=(8, 16, 32, 48, 64, 96, 128), ep=(8,), drafts=())
    s = Search(
        d,
        space,
        names,
        60.0,
        evaluate,
        exhaustive=exhaustive,
        per_schedule=per_schedule,
        layouts=lambda n: layouts(d, space, n),
        ladder=batches(d, space),
    )
    s.run()
    return s


def _brute(evaluate, search):
    """Every setting the exhaustive search considers, at every batch."""
    series = {s for (s, _) in search.results}
    pairs = [(s, b) for s in series for b in search.feasible(s)]
    return evaluate(pairs)


@pytest.mark.parametrize("dip", [False, True])
def test_pruning_never_drops_a_frontier_point_brute_force_finds(dip):
    evaluate, calls = _synthetic()
    search = _search(evaluate, exhaustive=True)
    if dip:  # a series whose time falls as the batch grows: searched without pruning
        odd = next(iter({s for (s, _) in search.results}))
        evaluate, calls = _synthetic(odd)
        search = _search(evaluate, exhaustive=True)
    found = {(p.setting, p.batch) for p in pareto(search.points())}
    everything = [p for p in _brute(evaluate, search).values() if isinstance(p, Point)]
    assert found == {(p.setting, p.batch) for p in pareto(everything)}
    assert len(search.results) < len(everything)  # pruning skipped some
    assert best_under(search.points(), 60.0) == best_under(everything, 60.0)


def test_per_schedule_pruning_keeps_each_schedules_frontier():
    evaluate, _ = _synthetic()
    search = _search(evaluate, exhaustive=True, per_schedule=True)
    everything = [p for p in _brute(evaluate, search).values() if isinstance(p, Point)]
    for name in ("serial", "sbo", "tbo"):
        mine = [p for p in search.points() if p.setting.schedule == name]
        theirs = [p for p in everything if p.setting.schedule == name]
        assert {(p.setting, p.batch) for p in pareto(mine)} == {
            (p.setting, p.batch) for p in pareto(theirs)
        }


def test_coarse_to_fine_search_asks_far_less_than_brute_force():
    evaluate, calls = _synthetic()
    search = _search(evaluate, exhaustive=False)
    brute = _search(_synthetic()[0], exhaustive=True)
    everything = _brute(evaluate, brute)
    assert len(search.results) < len(everything) / 3
    assert best_under(search.points(), 60.0) is not None
    assert sum(search.asked.values()) == len(search.results)


# ---- the space, learnt from the knob records ------------------------------------------------


def test_space_is_learnt_from_the_knob_records():
    d = _deployment()
    for name in registry.available():
        got = {x.name: x for x in dims(d, Space(), name, deepep_normal=False)}
        for rec in registry.own_knobs(name):
            tried = set(rec.tune) - {rec.default}
            assert (rec.name in got) == bool(tried), (name, rec.name)
            if tried:
                assert set(got[rec.name].values) == tried
    assert "delta_stages" in tunable_knobs() and "iterations" not in tunable_knobs()
    tbo = {x.name: x for x in dims(d, Space(values={"delta_stages": (5,)}), "tbo", False)}
    assert tbo["delta_stages"].values == (5,)
    assert "delta_stages" not in {
        x.name for x in dims(d, Space(values={"delta_stages": ()}), "tbo", False)
    }
    # DeepEP's normal-kernel fields only where normal kernels run
    assert not any(x.on_gpu for x in dims(d, Space(), "serial", deepep_normal=False))
    assert {x.name for x in dims(d, Space(), "serial", deepep_normal=True) if x.on_gpu} == {
        "deepep_normal_sms",
        "deepep_release",
    }


def test_layouts_follow_the_experts_the_gpus_and_the_pipeline_rule():
    d = Deployment(ol.model("deepseek-v3"), ol.gpu("h800"), 32)
    assert layouts(d, Space(), "tbo") == tuple((e, 1) for e in (1, 2, 4, 8, 16, 32))
    assert all(pp > 1 for _, pp in layouts(d, Space(), "pp"))
    with pytest.raises(ConfigError, match="no knob the search varies"):
        Space(values={"iterations": (2,)})


# ---- the API end to end, on a cut model -----------------------------------------------------


def _small(tmp_path, **kw):
    args = dict(
        model="deepseek-v3",
        gpu="h800",
        gpus=8,
        mode="decode",
        max_ms=3.0,
        layers=2,
        space=Space(schedules=("serial", "tbo"), batches=(8, 16, 32, 64), ep=(8,), drafts=()),
        sensitivity="oat=1,lhs=0,inputs=hbm",
        rivals=1,
        out=tmp_path / "t",
        processes=1,
    )
    args.update(kw)
    return tune(**args)


def test_tune_finds_a_best_with_its_win_share_and_launch_flags_and_resumes(tmp_path):
    t = _small(tmp_path)
    assert t.best is not None and t.best.ms <= 3.0
    assert t.best == best_under(t.points, 3.0)
    assert set(pareto(t.points)) == set(t.frontier)
    assert t.sensitivity is not None and 0.0 <= t.sensitivity[_label(t)].wins <= 1.0
    assert t.launch.system == "SGLang" and "--max-running-requests" in t.launch.shell()
    text = t.text()
    assert "Best:" in text and "win share" in text and "python -m sglang.launch_server" in text
    names = {p.name for p in (tmp_path / "t").iterdir()}
    assert {RESULTS, "frontier.png", "tune.json", "launch.sh"} <= names
    assert json.loads((tmp_path / "t" / "tune.json").read_text())["best"]["batch"] == t.best.batch
    again = _small(tmp_path)  # the same out: every configuration read back
    assert again.counts["simulated"] == again.counts["errors"] == 0
    assert again.counts["resumed"] == sum(again.counts["asked"].values())
    assert again.best == t.best and again.frontier == t.frontier
    other = _small(tmp_path, max_ms=2.5)  # another target reads the rows it shares
    assert other.counts["resumed"] > 0


def _label(t):
    from overlap_lab.tune import label

    return label(t.best)


def test_a_results_file_of_another_deployment_is_refused(tmp_path):
    _small(tmp_path, sensitivity=False)
    with pytest.raises(ConfigError, match="another deployment"):
        _small(tmp_path, sensitivity=False, kv_len=1024)


def test_pruned_search_on_real_simulations_matches_brute_force(tmp_path):
    """The exhaustive search's pruning on the simulator itself (a cut model, two schedules)."""
    d = _deployment()
    space = Space(
        schedules=("serial", "tbo"),
        batches=(8, 16, 32, 64, 128),
        ep=(8,),
        drafts=(),
        values={"deepep_mode": (), "delta_stages": (0,), "tbo_threshold": ()},
    )
    ev = _Evaluator(d, tmp_path / RESULTS, runner.Local(1), False, None, _inputs(d, space))
    search = Search(
        d,
        space,
        ["serial", "tbo"],
        None,
        ev,
        exhaustive=True,
        layouts=lambda n: layouts(d, space, n),
        ladder=batches(d, space),
    )
    search.run()
    series = {s for (s, _) in search.results}
    everything = ev([(s, b) for s in series for b in search.feasible(s)])
    pts = [p for p in everything.values() if isinstance(p, Point)]
    assert {(p.setting, p.batch) for p in pareto(search.points())} == {
        (p.setting, p.batch) for p in pareto(pts)
    }
    assert len(search.results) < len(pts)


def _inputs(d, space):
    from overlap_lab.tune import _inputs as inputs

    return inputs(d, None, space, True, False)


# ---- --try KNOB=V1,V2 -------------------------------------------------------------------------


def test_try_values_are_parsed_and_checked_by_the_knob_record():
    """``tune --try``: each value typed as its record types it and in its range; ``KNOB=`` holds
    the knob at its default; a knob the search does not vary, a value of the wrong type or out
    of range and a draft count that is no integer are each one ConfigError, never a traceback
    (a non-integer draft count was an argparse error escaping the handler)."""
    from overlap_lab.tune_space import parse_tries

    got = parse_tries(["comm-sms=2, 12", "tbo_threshold=0.25", "deepep_release=v2", "sbo_mode="])
    assert got == {"comm_sms": (2, 12), "tbo_threshold": (0.25,), "deepep_release": ("v2",),
                   "sbo_mode": ()}  # fmt: skip
    assert parse_tries(["mtp_drafts=1,2"]) == {"drafts": (1, 2)}
    for bad, said in [
        ("comm_sms", "KNOB=V1,V2"),
        ("batch=8", "no knob the search varies"),
        ("comm_sms=two", "comm_sms"),
        ("comm_sms=0", "comm_sms"),
        ("mtp_drafts=x", "integers"),
    ]:
        with pytest.raises(ConfigError, match=said):
            parse_tries([bad])
