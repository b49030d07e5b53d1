"""The race sampler (shared/inputs/race.py ``Race``) against the dense Gumbel top-k it replaces.

Both are seeded, so every statistic here is a fixed number; the thresholds are the 1e-5 upper
quantiles of the statistics' laws under "same distribution", and
``test_the_comparison_catches_wrong_samplers`` shows that plausible mistakes land far above them.
"""

from __future__ import annotations

import json
import math
import tracemalloc

import numpy as np
import pytest

# internals tested directly: the race, its counter-based draws and the numba switch
# (routing's _compiled), against the dense sampler and numpy
from overlap_lab.shared.inputs import race as race_mod
from overlap_lab.shared.inputs import routing as routing_mod
from overlap_lab.shared.inputs.race import Race
from overlap_lab.shared.inputs.routing import Imbalance, LayerRouting, RoutingConfig

#: z of the one-sided 1e-5 tail of a normal
Z = 4.265


def dense_topk(rng, p, n_group, topk_group, k, n, score="two"):
    """The dense sampler the race replaced: one Exp(1) / p_e key per (token, expert), groups
    scored by the product of their two smallest keys (``score="one"``: the smallest only, a
    wrong variant), the k smallest keys of the kept groups in key order."""
    e = len(p)
    keys = rng.standard_exponential((n, e)) / p
    grouped = keys.reshape(n, n_group, e // n_group)
    two = np.sort(grouped, axis=2)[:, :, :2]
    s = two[:, :, 0] * two[:, :, 1] if score == "two" else two[:, :, 0]
    drop = np.argsort(s, axis=1, kind="stable")[:, topk_group:]
    np.put_along_axis(grouped, drop[:, :, None], np.inf, axis=1)
    return np.argsort(keys, axis=1)[:, :k]


def race_topk(rng, p, n_group, topk_group, k, n):
    race = Race(p, n_group, topk_group, k)
    return race.draw(int(rng.integers(2**63)), 0, n, loop=routing_mod.compiled_race_loop()).T


def _zipf(e, s, seed):
    p = np.empty(e)
    p[np.random.default_rng(seed).permutation(e)] = 1.0 / np.arange(1, e + 1) ** s
    return p / p.sum()


def _chi2_limit(df: int) -> float:
    """Wilson-Hilferty: the chi-square(df) quantile at 1 - 1e-5."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + Z * math.sqrt(a)) ** 3


def _homogeneity(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Two-sample chi-square of two equal-size histograms (cells with fewer than 20 pooled
    counts merged into one) and its 1e-5 limit."""
    big = (a + b) >= 20
    a = np.append(a[big], a[~big].sum())
    b = np.append(b[big], b[~big].sum())
    keep = (a + b) > 0
    stat = float(((a - b)[keep] ** 2 / (a + b)[keep]).sum())
    return stat, _chi2_limit(int(keep.sum()) - 1)


def _codes(x: np.ndarray, e: int) -> dict[str, np.ndarray]:
    """Each token of a (tokens x k) id sample as a cell of four histograms: its unordered set,
    its first two ids in order, the set of groups (of 4 experts) it uses, and (one row per
    position) its id at each position."""
    s = np.sort(x, axis=1).astype(np.int64)
    sets, groups = np.zeros(len(x), dtype=np.int64), np.zeros(len(x), dtype=np.int64)
    for j in range(x.shape[1]):
        sets = sets * e + s[:, j]
        groups |= 1 << (x[:, j] // 4)
    pos = (np.arange(x.shape[1]) * e + x).ravel()
    return {"sets": sets, "first_two": x[:, 0] * e + x[:, 1], "groups": groups, "position": pos}


def _compare(a: np.ndarray, b: np.ndarray, e: int) -> dict[str, tuple[float, float]]:
    """Homogeneity statistic and limit of each histogram of two equal-size samples."""
    out = {}
    ca, cb = _codes(a.astype(np.int64), e), _codes(b.astype(np.int64), e)
    for name in ca:
        cells = np.unique(np.concatenate([ca[name], cb[name]]), return_inverse=True)[1]
        m = cells.max() + 1
        ha = np.bincount(cells[: len(ca[name])], minlength=m).astype(float)
        hb = np.bincount(cells[len(ca[name]) :], minlength=m).astype(float)
        out[name] = _homogeneity(ha, hb)
    return out


# 16 experts in 4 groups of 4, keep 2, top-3; skewed so that groups and orders matter
P16 = _zipf(16, 1.2, seed=5)
N = 120_000


@pytest.mark.parametrize(
    ("n_group", "topk_group", "k"), [(4, 2, 3), (4, 1, 3), (1, 1, 4), (4, 3, 4)]
)
def test_race_has_the_law_of_dense_gumbel_top_k(n_group, topk_group, k):
    dense = dense_topk(np.random.default_rng(1), P16, n_group, topk_group, k, N)
    race = race_topk(np.random.default_rng(2), P16, n_group, topk_group, k, N)
    assert (np.sort(race, axis=1)[:, 1:] != np.sort(race, axis=1)[:, :-1]).all()  # distinct
    for name, (stat, limit) in _compare(dense, race, 16).items():
        assert stat < limit, (name, stat, limit)


def test_the_comparison_catches_wrong_samplers():
    """What the test above would say of samplers with plausible mistakes: groups scored by their
    best key only, group limiting forgotten, experts drawn with probability p but independent of
    the groups' race (top-k of a shuffled copy)."""
    dense = dense_topk(np.random.default_rng(1), P16, 4, 2, 3, N)
    wrong = {
        "one-key score": dense_topk(np.random.default_rng(3), P16, 4, 2, 3, N, score="one"),
        "no group limit": race_topk(np.random.default_rng(3), P16, 1, 1, 3, N),
    }
    for what, x in wrong.items():
        worst = max(stat / limit for stat, limit in _compare(dense, x, 16).values())
        assert worst > 3, what


def test_draws_without_replacement_follow_the_rest_of_the_group():
    """``_pick_new``: a group whose second heaviest expert, taken, holds nearly half the mass
    (rejection gives up on a fifth of the tokens, the exact inverse CDF draws them), one whose
    heaviest expert is taken (drawn from the table without it) and one with a light expert
    taken (rejection): all proportional to the rest."""
    p = np.array([0.5, 0.45, 0.03, 0.02, 0.4, 0.3, 0.2, 0.1])
    race = Race(p / p.sum(), 2, 2, 2)
    n = 60_000
    for g, taken in ((0, 1), (1, 0), (1, 2)):
        race.seen = np.zeros(8 * n, dtype=bool)
        race.seen[(4 * g + taken) * n : (4 * g + taken + 1) * n] = True
        u2 = np.random.default_rng(g).random((race.TRIES + 1, n))
        ptr = np.zeros(n, dtype=np.intp)
        ids = race._pick_new(lambda tok, c, u2=u2: u2[c, tok], ptr, np.full(n, g), np.arange(n), n)
        assert ptr.min() >= 1 and ptr.max() <= race.TRIES + 1
        counts = np.bincount(ids - 4 * g, minlength=4)
        rest = p[4 * g : 4 * g + 4].copy()
        rest[taken] = 0.0
        expect = n * rest / rest.sum()
        assert counts[taken] == 0 and counts.sum() == n
        pos = expect > 0
        stat = float(((counts[pos] - expect[pos]) ** 2 / expect[pos]).sum())
        assert stat < _chi2_limit(int(pos.sum()) - 1), (g, taken, counts, expect)


def _v3_cfg(**kw) -> RoutingConfig:
    base = dict(
        num_experts=256,
        top_k=8,
        ep=32,
        imbalance=Imbalance("zipf", 1.2),
        group_limited=True,
        n_group=8,
        topk_group=4,
    )
    return RoutingConfig(**{**base, **kw})


def test_v3_routing_is_seeded_and_stays_in_four_groups():
    dp = (300,) * 32
    a = LayerRouting(_v3_cfg(seed=3), dp, layer=5).topk
    b = LayerRouting(_v3_cfg(seed=3), dp, layer=5).topk
    c = LayerRouting(_v3_cfg(seed=3), dp, layer=6).topk
    assert a.dtype == np.uint8 and (a == b).all() and not (a == c).all()
    s = np.sort(a.astype(int), axis=1)
    assert (s[:, 1:] != s[:, :-1]).all()
    assert max(len({e // 32 for e in row}) for row in a.tolist()) <= 4


@pytest.mark.parametrize("compiled", [False, None])
def test_draw_memory_is_bounded_by_the_block(compiled, monkeypatch):
    """Drawing (and counting the load of) 256K tokens of DeepSeek-V3 routing takes the ids
    (2 MiB) and a block's state, nothing proportional to the tokens: a dense tokens x 256
    float32 key matrix would be 256 MiB, a bincount of all ids at once 16 MiB. (numpy: ~10 MiB,
    the compiled loop: ~3 MiB.)"""
    if compiled is None:
        pytest.importorskip("numba")
    monkeypatch.setattr(routing_mod, "_compiled", compiled)
    LayerRouting(_v3_cfg(), (1,) * 32).topk  # noqa: B018 - loads the compiled loop first
    n = 32 * routing_mod.BLOCK
    lr = LayerRouting(_v3_cfg(), (n // 32,) * 32)
    tracemalloc.start()
    ids = lr.topk
    peak = tracemalloc.get_traced_memory()[1] - ids.nbytes
    tracemalloc.stop()
    assert lr.expert_load.sum() == n * 8
    assert peak < 16 * 2**20


def test_an_expert_never_seen_can_still_be_drawn(tmp_path):
    """Counts with zeros: each group's mass sits on one expert (the other experts keep a chance of
    1e-12 of the top one); the draw terminates, stays distinct and group-limited."""
    counts = [0] * 16
    counts[0], counts[5], counts[10], counts[15] = 50, 30, 15, 5
    path = tmp_path / "counts.json"
    path.write_text(json.dumps({"expert_counts": counts}))
    sample = routing_mod.read_sample(str(path), 16, 3)
    cfg = RoutingConfig(16, 3, 4, 2, Imbalance("file", path=str(path)), 0, True, 4, 2)
    ids = LayerRouting(cfg, (2000,) * 4, sample=sample).topk.astype(int)
    s = np.sort(ids, axis=1)
    assert (s[:, 1:] != s[:, :-1]).all()
    assert max(len({e // 4 for e in row}) for row in ids.tolist()) <= 2
    # two of the four popular experts in the two kept groups, then one of their unseen mates
    assert np.isin(ids[:, :2], [0, 5, 10, 15]).all()
    assert not np.isin(ids[:, 2], [0, 5, 10, 15]).any()


def _configs():
    deg = np.full(16, 1e-12)  # each group's mass on one expert: the exact fallback draws
    deg[[0, 5, 10, 15]] = [50, 30, 15, 5]
    pair = np.array([0.5, 0.45, 0.03, 0.02] * 4)  # a heavy second expert: rejection fails often
    return [
        (_zipf(256, 1.2, 0), 8, 4, 8),  # DeepSeek-V3
        (P16, 4, 2, 3),
        (_zipf(8, 0.0, 1), 1, 1, 3),  # no group limit
        (_zipf(16, 1.5, 2), 8, 4, 6),  # groups of 2: they run out of experts
        (deg / deg.sum(), 4, 2, 3),
        (pair / pair.sum(), 4, 2, 4),
        (_zipf(256, 0.0, 3), 1, 1, 8),
    ]


@pytest.mark.parametrize("cfg", range(7))
def test_compiled_loop_draws_the_numpy_ids(cfg, monkeypatch):
    """With numba the tokens are drawn by ``race_loop``; it must give the numpy code's ids, bit
    for bit (the same random numbers, the same float operations), or a seed would mean
    different routings on machines with and without the ``fast`` extra. Several keys (the top
    bit set in one), token ranges not starting at 0."""
    pytest.importorskip("numba")
    p, n_group, topk_group, k = _configs()[cfg]
    race = Race(p, n_group, topk_group, k)
    for key in (11, 2**64 - 3, 0x5EED_0000_0001):
        numpy_ids = race.draw(key, 500, 3500)
        monkeypatch.setattr(routing_mod, "_compiled", None)
        loop = routing_mod.compiled_race_loop()
        assert loop is not None
        assert (race.draw(key, 500, 3500, loop=loop) == numpy_ids).all(), key


def test_draws_do_not_depend_on_the_split_into_blocks(monkeypatch):
    """A token's numbers are counters of the layer's stream: drawing tokens 0..3000 at once or
    as 0..1000 and 1000..3000 gives the same ids (numpy), and a layer's table is the same
    whatever BLOCK is."""
    monkeypatch.setattr(routing_mod, "_compiled", False)
    race = Race(P16, 4, 2, 3)
    whole = race.draw(7, 0, 3000)
    assert (
        np.concatenate([race.draw(7, 0, 1000), race.draw(7, 1000, 3000)], axis=1) == whole
    ).all()
    cfg, dp = _v3_cfg(seed=4, ep=4), (900, 700, 1, 1000)
    a = LayerRouting(cfg, dp).topk
    monkeypatch.setattr(routing_mod, "BLOCK", 333)
    assert (LayerRouting(cfg, dp).topk == a).all()


def test_the_generator_s_uniforms_and_exponentials():
    """The counter-based numbers: uniforms equidistributed (chi-square over 1024 cells),
    exponentials -ln U within an ulp of numpy's log (mean and variance 1), at the ends of
    their range too (U = 1 gives 0, the smallest U = 2^-52 gives 52 ln 2)."""
    key = np.uint64(0x1234_5678_9ABC_DEF0)
    z = race_mod.random_bits(key, np.arange(1 << 20, dtype=np.uint64))
    u = race_mod.uniform(z)
    assert 0.0 <= u.min() and u.max() < 1.0
    hist = np.bincount((u * 1024).astype(int), minlength=1024)
    expect = len(u) / 1024
    assert float(((hist - expect) ** 2 / expect).sum()) < _chi2_limit(1023)
    ends = np.array([0, 2**64 - 1, 2**12 - 1, 2**12], dtype=np.uint64)
    z = np.concatenate([z, ends])
    x = race_mod.exponential(z)
    ref = -np.log(1.0 - (z >> np.uint64(12)).astype(np.float64) * 2.0**-52)  # exact U
    assert np.all(np.abs(x - ref) <= 2.3e-16 * np.maximum(ref, 1e-300))
    assert x[-4] == 0.0 and x[-3] == 52 * math.log(2) and x[-2] == 0.0 and 0 < x[-1] < 1e-15
    assert abs(x.mean() - 1) < 5 * Z * 1e-3 and abs(x.var() - 1) < 5 * Z * 2e-3


def test_compiled_numbers_are_the_numpy_numbers():
    """The generator compiled (scalars, bit casts by LLVM) against numpy (arrays, views): the
    same bits, uniforms and exponentials, ends of the range included."""
    numba = pytest.importorskip("numba")
    from overlap_lab.shared.jit import inline

    inline(race_mod.random_bits, race_mod.uniform, race_mod.exponential)
    bits, uni, exp_ = race_mod.random_bits, race_mod.uniform, race_mod.exponential

    @numba.njit
    def numbers(key, ctr):
        out = np.empty((3, len(ctr)))
        for i in range(len(ctr)):
            z = bits(key, ctr[i])
            out[0, i], out[1, i], out[2, i] = np.float64(z >> np.uint64(11)), uni(z), exp_(z)
        return out

    key = np.uint64(99)
    ctr = np.append(np.arange(100_000, dtype=np.uint64), np.uint64(2**64 - 1))
    z = race_mod.random_bits(key, ctr)
    got = numbers(key, ctr)
    assert (got[0] == (z >> np.uint64(11)).astype(np.float64)).all()
    assert (got[1] == race_mod.uniform(z)).all()
    assert (got[2] == race_mod.exponential(z)).all()


def test_compiled_counts_are_the_numpy_counts(monkeypatch):
    """``_count_loop`` (per token) against the numpy counting (sorted rows), on ranges of ranks
    with different real token counts, ranks on several nodes and uneven ranges."""
    pytest.importorskip("numba")
    cfg = _v3_cfg(seed=2, ep=16, gpus_per_node=4)
    dp = tuple(int(x) for x in np.random.default_rng(0).integers(50, 400, 16))
    got = {}
    for compiled in (False, None):
        monkeypatch.setattr(routing_mod, "_compiled", compiled)
        lr = LayerRouting(cfg, dp)
        got[compiled] = [lr.matrices(lo, hi) for lo, hi in ((0, None), (0, 120), (120, 333))]
    assert routing_mod._compiled  # the second pass counted with the compiled loop
    for a, b in zip(got[False], got[None]):
        for field in ("copies", "tokens", "node_tokens", "active"):
            assert (getattr(a, field) == getattr(b, field)).all(), field


def test_compiled_draw_into_the_table_gives_the_numpy_ids_and_load(monkeypatch):
    """With numba a layer's ids are written by the loop straight into its table and its expert
    load counted there (``Race.draw(into=, load=)``); without, the numpy ids are copied in and
    counted by bincount: the same table and load, over several blocks (the last one short)."""
    pytest.importorskip("numba")
    monkeypatch.setattr(routing_mod, "BLOCK", 1000)
    cfg = _v3_cfg(seed=5, ep=8, gpus_per_node=8)
    dp = (700, 650, 512, 700, 333, 700, 1, 700)
    got = {}
    for compiled in (False, None):
        monkeypatch.setattr(routing_mod, "_compiled", compiled)
        lr = LayerRouting(cfg, dp, layer=4)
        got[compiled] = (lr.topk.copy(), lr.expert_load.copy())
    assert routing_mod._compiled
    assert got[None][0].dtype == np.uint8 and (got[None][0] == got[False][0]).all()
    assert (got[None][1] == got[False][1]).all()
    assert got[None][1].sum() == sum(dp) * cfg.top_k
