"""Which experts each token goes to, and what that means per EP rank: seeded and reproducible.

Expert load (``--imbalance``):

- ``balanced``: the *expected* routing of uniformly random gating, with no sampling noise: every
  rank sends every other rank the same (fractional) number of token copies, so an explicit
  simulation of all ranks gives exactly the symmetric one (its straggler cost is 0).
- ``zipf:S``: expert popularity p_e proportional to 1/i^S over a seeded permutation of the experts
  (a different permutation per layer); each token draws its top-k distinct experts with
  probability proportional to p (Gumbel top-k, i.e. sampling without replacement; drawn by the
  exact race sampler ``_Race``, a few random numbers per expert taken, not one per expert, from
  a counter-based generator seeded per layer). ``zipf:0`` is uniformly random routing *with*
  sampling noise. Cost (compiled, DeepSeek-V3 at EP32): ~0.5-0.6 us per token drawn, about a
  third computing its ~40 random numbers (the exponentials' logs), two thirds the group pick
  and the k-way merge's chains of dependent steps; the numpy code ~4 us.
- ``file:PATH``: a routing sample, in one of these forms (``.json`` or ``.csv``):

  * JSON ``{"expert_counts": [c_0, ..., c_{E-1}]}``: tokens routed to each expert in some
    measured batch; popularity p_e = c_e / sum(c), tokens drawn as for zipf;
  * JSON ``{"topk_ids": [[e, ...], ...]}``: the top-k expert ids of measured tokens, used as
    they are (token i of the EP group is token i of the file, cycling when the file is shorter);
  * CSV with a header ``expert,count``: per-expert counts as above;
  * CSV without a header: one token per line, its top-k expert ids.

  Expert ids must lie in 0..E-1 and each token needs exactly top_k distinct ids.

DeepSeek-V3's group-limited routing (``group_limited``, default on for models with n_group > 1):
experts form n_group groups of consecutive ids; a token's group score is the sum of its two best
expert scores in the group, it keeps the best topk_group groups and picks its top-k experts
inside them. Expert e lives on EP rank e // (E / ep) (DeepEP's contiguous layout).

DP attention: each rank's batch may hold fewer real tokens than the padded size all ranks run
(``dp_tokens``); only real tokens are routed and dispatched.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.topology import Topology
from overlap_lab.shared.jit import as_bits, as_float, inline, njit


@dataclass(frozen=True)
class Imbalance:
    """Expert-load model: ``balanced``, ``zipf`` (skew ``s``) or ``file`` (routing sample)."""

    kind: str = "balanced"
    s: float = 0.0
    path: str = ""

    def __str__(self) -> str:
        return {"balanced": "balanced", "zipf": f"zipf:{self.s:g}", "file": f"file:{self.path}"}[
            self.kind
        ]


def parse_imbalance(spec: str) -> Imbalance:
    """``balanced`` | ``zipf:S`` (S >= 0) | ``file:PATH``; ConfigError in one line otherwise."""
    spec = (spec or "").strip()
    if spec == "balanced":
        return Imbalance()
    if spec.startswith("zipf:"):
        try:
            s = float(spec[5:])
        except ValueError:
            s = -1.0
        if not (s >= 0 and math.isfinite(s)):
            raise ConfigError(
                f"imbalance zipf:S needs a number S >= 0, got {spec!r}", names=("imbalance",)
            )
        return Imbalance("zipf", s)
    if spec.startswith("file:") and spec[5:]:
        return Imbalance("file", path=spec[5:])
    raise ConfigError(
        f"imbalance must be balanced, zipf:S or file:PATH, got {spec!r}", names=("imbalance",)
    )


# ----------------------------------------------------------------------------------------------
# Routing samples read from files
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """What a routing file holds: per-expert counts or per-token top-k ids."""

    counts: tuple[float, ...] | None = None
    topk_ids: tuple[tuple[int, ...], ...] | None = None


def _bad(path: str, why: str) -> ConfigError:
    return ConfigError(f"routing file {path}: {why}")


def read_sample(path: str, num_experts: int, top_k: int) -> Sample:
    """Parse a routing file (format in the module docstring), checking it against the model."""
    p = Path(path)
    if not p.is_file():
        raise _bad(path, "no such file")
    text = p.read_text()
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise _bad(path, f"invalid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(data, dict) or not ({"expert_counts", "topk_ids"} & set(data)):
            raise _bad(path, "expected an object with 'expert_counts' or 'topk_ids'")
        if "expert_counts" in data:
            return Sample(counts=_check_counts(path, data["expert_counts"], num_experts))
        return Sample(topk_ids=_check_ids(path, data["topk_ids"], num_experts, top_k))
    if p.suffix.lower() == ".csv":
        rows = [r for r in csv.reader(text.splitlines()) if r and any(c.strip() for c in r)]
        if not rows:
            raise _bad(path, "empty file")
        if [c.strip().lower() for c in rows[0]] == ["expert", "count"]:
            counts = [0.0] * num_experts
            for i, (e, c) in enumerate(_pairs(path, rows[1:]), 2):
                if not 0 <= e < num_experts:
                    raise _bad(path, f"line {i}: expert {e} outside 0..{num_experts - 1}")
                counts[e] += c
            return Sample(counts=_check_counts(path, counts, num_experts))
        try:
            ids = [[int(c) for c in r] for r in rows]
        except ValueError:
            raise _bad(path, "expected integer expert ids (or an 'expert,count' header)") from None
        return Sample(topk_ids=_check_ids(path, ids, num_experts, top_k))
    raise _bad(path, "expected a .json or .csv file")


def _pairs(path: str, rows):
    for i, r in enumerate(rows, 2):
        try:
            e, c = r
            yield int(e), float(c)
        except ValueError:
            raise _bad(path, f"line {i}: expected 'expert,count', got {','.join(r)!r}") from None


def _check_counts(path: str, counts, num_experts: int) -> tuple[float, ...]:
    if not isinstance(counts, list) or len(counts) != num_experts:
        n = len(counts) if isinstance(counts, list) else "no list of"
        raise _bad(path, f"expert_counts needs {num_experts} numbers, got {n}")
    if any(isinstance(c, bool) or not isinstance(c, (int, float)) or c < 0 for c in counts):
        raise _bad(path, "expert counts must be numbers >= 0")
    if sum(counts) <= 0:
        raise _bad(path, "expert counts are all zero")
    return tuple(float(c) for c in counts)


def _check_ids(path: str, ids, num_experts: int, top_k: int) -> tuple[tuple[int, ...], ...]:
    if not isinstance(ids, list) or not ids:
        raise _bad(path, "topk_ids must be a non-empty list of lists")
    out = []
    for i, row in enumerate(ids):
        if not isinstance(row, list) or len(row) != top_k:
            raise _bad(path, f"token {i}: expected {top_k} expert ids, got {row!r}")
        if any(isinstance(e, bool) or not isinstance(e, int) for e in row):
            raise _bad(path, f"token {i}: expert ids must be integers")
        if any(not 0 <= e < num_experts for e in row):
            raise _bad(path, f"token {i}: expert id outside 0..{num_experts - 1}")
        if len(set(row)) != top_k:
            raise _bad(path, f"token {i}: repeated expert id in {row}")
        out.append(tuple(row))
    return tuple(out)


# ----------------------------------------------------------------------------------------------
# Routing of one layer and what it means per rank
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Matrices:
    """Per-rank consequences of routing a set of tokens (float arrays, counts of tokens).

    copies[s, d]: (token, expert) pairs from source rank s to an expert on rank d;
    tokens[s, d]: distinct tokens s sends to rank d (dedup of a token's experts on one rank);
    node_tokens[s, n]: distinct tokens s sends to node n (dedup per node, DeepEP's RDMA copies);
    active[d]: local experts of rank d that receive at least one token.
    """

    copies: np.ndarray
    tokens: np.ndarray
    node_tokens: np.ndarray
    active: np.ndarray

    @property
    def recv_copies(self) -> np.ndarray:
        return self.copies.sum(axis=0)


@dataclass(frozen=True)
class RoutingConfig:
    """Everything routing depends on; ``dp_tokens`` are real tokens per rank (None: all)."""

    num_experts: int
    top_k: int
    ep: int
    gpus_per_node: int = 8
    imbalance: Imbalance = Imbalance()
    seed: int = 0
    group_limited: bool = False
    n_group: int = 1
    topk_group: int = 1

    def __post_init__(self) -> None:
        if self.num_experts % self.ep:
            raise ConfigError(f"routing: ep={self.ep} must divide {self.num_experts} experts")

    @property
    def topology(self) -> Topology:
        return Topology(self.ep, min(self.gpus_per_node, self.ep))

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep


#: Tokens counted per chunk (``LayerRouting._counted``): the unit of the per-rank counts' memory.
CHUNK = 8192
#: Tokens drawn per block by the race sampler's numpy code: its unit of vectorisation (its state is
#: a few arrays of groups x BLOCK). The draws do not depend on it (nor on CHUNK).
BLOCK = 8192


class LayerRouting:
    """The routing of one layer's tokens: per-token top-k ids (sampled) or expectations.

    Sampled routing draws its top-k ids lazily, all the layer's tokens at once, and keeps
    them (``uint8``/``int16`` ids) only while they may still be needed: the per-range matrices
    and the expert load are what stays. A :class:`Routing` keeps the ids of its two most recently
    used layers (``keep`` below); drawing again gives the same ids (seeded per layer).
    """

    def __init__(
        self, cfg: RoutingConfig, dp_tokens: tuple[int, ...], layer: int = 0, sample=None, keep=None
    ):
        self.cfg, self.dp_tokens, self.layer = cfg, tuple(dp_tokens), layer
        if len(self.dp_tokens) != cfg.ep:
            raise ConfigError(
                f"routing: {len(self.dp_tokens)} per-rank token counts for ep {cfg.ep}"
            )
        self._cache: dict[tuple[int, int], Matrices] = {}
        self.sample = sample
        self._keep = keep  # callback(self) when the ids are drawn: the owner may release others
        self._topk: np.ndarray | None = None
        self._load: np.ndarray | None = None

    @property
    def sampled(self) -> bool:
        return self.cfg.imbalance.kind != "balanced"

    # -- drawing ------------------------------------------------------------------------------

    def _rng(self) -> np.random.Generator:
        return np.random.default_rng([self.cfg.seed, self.layer, 0x5EED])

    @property
    def src(self) -> np.ndarray | None:
        """Source rank of every token (EP-rank-major order), None for expected routing."""
        if not self.sampled:
            return None
        return np.repeat(np.arange(self.cfg.ep), self.dp_tokens)

    @property
    def tix(self) -> np.ndarray | None:
        """Per-rank index of every token, None for expected routing."""
        if not self.sampled:
            return None
        n = sum(self.dp_tokens)
        return np.concatenate([np.arange(t) for t in self.dp_tokens]) if n else np.zeros(0, int)

    @property
    def topk(self) -> np.ndarray | None:
        """The top-k expert ids of every token (drawn now if released), None for expected."""
        if not self.sampled:
            return None
        if self._topk is None:
            self._topk, load = self._draw()
            if self._load is None and load is not None:
                self._load = load.astype(float)
            if self._load is None:  # by chunks: bincount widens the ids to intp (8x)
                e = self.cfg.num_experts
                load = np.zeros(e, dtype=np.int64)
                for lo in range(0, len(self._topk), CHUNK):
                    load += np.bincount(self._topk[lo : lo + CHUNK].ravel(), minlength=e)
                self._load = load.astype(float)
            if self._keep is not None:
                self._keep(self)
        return self._topk

    def release(self) -> None:
        """Drop the per-token ids (the matrices already computed stay; ids are redrawn if a new
        range is asked for)."""
        self._topk = None

    def _draw(self) -> tuple[np.ndarray, np.ndarray | None]:
        """Top-k ids of every token: a table row per token (``file`` ids) or the race sampler
        (:class:`_Race`: in one compiled loop, or in numpy block by block of :data:`BLOCK`
        tokens, the same ids from one stream of numbers per layer); and the expert load where the compiled sampler counted it (None: count the ids)."""
        cfg = self.cfg
        n, k, e = sum(self.dp_tokens), cfg.top_k, cfg.num_experts
        ids = np.uint8 if e <= 256 else np.int16 if e <= 32768 else np.int32
        if cfg.imbalance.kind == "file" and self.sample is not None and self.sample.topk_ids:
            table = np.asarray(self.sample.topk_ids, dtype=ids)
            return table[np.arange(n) % len(table)], None
        rng = self._rng()
        grouped = cfg.group_limited and cfg.n_group > 1
        race = _Race(
            self._popularity(rng),
            cfg.n_group if grouped else 1,
            cfg.topk_group if grouped else 1,
            k,
        )
        key = int(rng.bit_generator.random_raw())  # the layer's stream of race numbers
        topk = np.empty((n, k), dtype=ids)
        if compiled_race_loop() is not None:  # the loop writes the rows, counts the load
            load = np.zeros(e, dtype=np.int64)
            race.draw(key, 0, n, into=topk, load=load)
            return topk, load
        for lo in range(0, n, BLOCK):
            topk[lo : lo + BLOCK] = race.draw(key, lo, min(n, lo + BLOCK)).T
        return topk, None

    def _popularity(self, rng: np.random.Generator) -> np.ndarray:
        cfg, e = self.cfg, self.cfg.num_experts
        if cfg.imbalance.kind == "file":
            p = np.asarray(self.sample.counts, dtype=np.float64)
            p = np.maximum(p, 1e-12 * p.max())  # an expert never seen keeps a tiny chance
        else:
            p = np.empty(e)
            p[rng.permutation(e)] = 1.0 / np.arange(1, e + 1) ** cfg.imbalance.s
        return p / p.sum()

    # -- per-rank matrices --------------------------------------------------------------------

    def matrices(self, lo: int = 0, hi: int | None = None) -> Matrices:
        """Matrices for the tokens with per-rank index in [lo, hi) (a micro-batch's range)."""
        hi = max(self.dp_tokens) if hi is None else hi
        key = (lo, hi)
        if key not in self._cache:
            self._cache[key] = self._counted(lo, hi) if self.sampled else self._expected(lo, hi)
        return self._cache[key]

    def _expected(self, lo: int, hi: int) -> Matrices:
        cfg, topo = self.cfg, self.cfg.topology
        r, k, nn = cfg.ep, cfg.top_k, topo.num_nodes
        t = np.array([max(0, min(hi, n) - lo) for n in self.dp_tokens], dtype=np.float64)
        copies = np.outer(t, np.full(r, k / r))
        tokens = np.outer(t, np.full(r, rank_hit_prob(r, k)))
        node_tokens = np.outer(t, np.full(nn, rank_hit_prob(nn, k)))
        total = t.sum()
        p_active = 1.0 - (1.0 - k / cfg.num_experts) ** total
        active = np.full(r, cfg.local_experts * p_active)
        return Matrices(copies, tokens, node_tokens, active)

    def _counted(self, lo: int, hi: int) -> Matrices:
        """Counts over the tokens of [lo, hi) on every rank, a chunk of tokens at a time: a
        token's distinct ranks (nodes) are the changes along its sorted row of ranks (nodes)."""
        cfg, topo = self.cfg, self.cfg.topology
        r, nn, g = cfg.ep, topo.num_nodes, topo.gpus_per_node
        topk_all = self.topk
        copies = np.zeros(r * r, dtype=np.int64)
        tokens = np.zeros(r * r, dtype=np.int64)
        node_tokens = np.zeros(r * nn, dtype=np.int64)
        load = np.zeros(cfg.num_experts, dtype=np.int64)
        loops = _compiled_loops()
        rank_of = np.arange(cfg.num_experts) // cfg.local_experts
        start = 0
        for s, n_s in enumerate(self.dp_tokens):  # rank s's tokens are rows start..start+n_s
            a, b = start + min(lo, n_s), start + min(max(hi, lo), n_s)
            start += n_s
            if loops:  # the same counts, token by token
                loops["count"](topk_all, a, b, rank_of, rank_of // g, copies[s * r : (s + 1) * r],
                               tokens[s * r : (s + 1) * r], node_tokens[s * nn : (s + 1) * nn], load)  # fmt: skip
                continue
            for c0 in range(a, b, CHUNK):
                topk = topk_all[c0 : min(b, c0 + CHUNK)].astype(np.int64)
                load += np.bincount(topk.ravel(), minlength=cfg.num_experts)
                dst = np.sort(topk // cfg.local_experts, axis=1)
                copies[s * r : (s + 1) * r] += np.bincount(dst.ravel(), minlength=r)
                first = np.ones(dst.shape, dtype=bool)
                first[:, 1:] = dst[:, 1:] != dst[:, :-1]
                tokens[s * r : (s + 1) * r] += np.bincount(dst[first], minlength=r)
                node = dst // g  # sorted ranks give sorted nodes
                first[:, 1:] = node[:, 1:] != node[:, :-1]
                node_tokens[s * nn : (s + 1) * nn] += np.bincount(node[first], minlength=nn)
        active = (load.reshape(r, cfg.local_experts) > 0).sum(axis=1)
        f = np.float64
        return Matrices(
            copies.reshape(r, r).astype(f),
            tokens.reshape(r, r).astype(f),
            node_tokens.reshape(r, nn).astype(f),
            active.astype(f),
        )

    @property
    def expert_load(self) -> np.ndarray:
        """Token copies per expert over the whole batch."""
        if not self.sampled:
            total = sum(self.dp_tokens) * self.cfg.top_k / self.cfg.num_experts
            return np.full(self.cfg.num_experts, total)
        if self._load is None:
            self.topk  # noqa: B018 - drawing sets the load
        return self._load


# ----------------------------------------------------------------------------------------------
# The race sampler's random numbers: counter-based, computed where they are used
# ----------------------------------------------------------------------------------------------

#: splitmix64 (Steele, Lea & Flood, 2014): number c of the stream with key s is _bits(s, c)
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S11, _S12, _S27, _S30, _S31 = (np.uint64(s) for s in (11, 12, 27, 30, 31))
_ONE = np.uint64(1)
#: fdlibm's log (e_log.c): ln 2 in two parts and the minimax coefficients Lg1..Lg7
_LN2_HI, _LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10
_LG = (6.666666666666735130e-01, 3.999999999940941908e-01, 2.857142874366239149e-01,
       2.222219843214978396e-01, 1.818357216161805012e-01, 1.531383769920937332e-01,
       1.479819860511658591e-01)  # fmt: skip
_LG1, _LG2, _LG3, _LG4, _LG5, _LG6, _LG7 = _LG
_S52, _MANTISSA, _EXP_ONE = np.uint64(52), np.uint64(2**52 - 1), np.uint64(1023 << 52)
_SQRT2_BITS = np.uint64(0x3FF6A09E667F3BCD)  # sqrt(2) rounded to nearest (below it)
_MAGIC = np.uint64(0x4330000000000000)  # 2^52: its low bits, an integer, read as a float


def _bits(key, ctr):
    """64 random bits, number ``ctr`` of stream ``key`` (uint64: numpy arrays, or scalars in the
    compiled loop): splitmix64's output, a bijective mix of key + ctr * golden gamma. Counter
    based, so each (token, slot) has its own number however the tokens are split into blocks."""
    z = key + ctr * _GAMMA
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


def _uniform(z):
    """A uniform in [0, 1) from the top 53 of the bits z (exact: a multiple of 2^-53)."""
    return np.float64(z >> _S11) * 1.1102230246251565e-16


def _exponential(z):
    """An Exp(1) from the bits z: -ln U, U = 2 - V in (0, 1] with V in [1, 2) made of the top
    52 bits, by fdlibm's log written in IEEE basic operations and bit casts (no library log, no
    int-float conversion, no FMA: numba contracts nothing without fastmath), so numpy and the
    compiled loop give the same bits and the loop vectorises. Its largest value is 52 ln 2 =
    36.04 (probability 2^-52 beyond), its error below 1 ulp."""
    b = as_bits(2.0 - as_float((z >> _S12) | _EXP_ONE))  # U, exact (a multiple of 2^-52)
    m = (b & _MANTISSA) | _EXP_ONE  # U's significand f in [1, 2) ...
    high = np.uint64(m > _SQRT2_BITS)  # ... halved above sqrt(2) (to [sqrt(1/2), sqrt(2)))
    f = as_float(m - (high << _S52))
    k = as_float(_MAGIC | ((b >> _S52) + high)) - 4503599627371519.0  # U = f 2^k: 2^52 + 1023
    x = f - 1.0
    s = x / (2.0 + x)
    z2 = s * s
    w = z2 * z2
    r = z2 * (_LG1 + w * (_LG3 + w * (_LG5 + w * _LG7))) + w * (_LG2 + w * (_LG4 + w * _LG6))
    hfsq = 0.5 * x * x
    return ((hfsq - (s * (hfsq + r) + k * _LN2_LO)) - x) - k * _LN2_HI


class _Race:
    """Exact, sparse sampling of DeepSeek-V3 gating with random scores: the race sampler.

    What it samples. Dense Gumbel top-k gives expert e the key K_e = E_e / p_e (E_e ~ Exp(1)
    i.i.d.; exp(-Gumbel) is Exp(1), so the top-k of log p_e + Gumbel_e are the k smallest keys);
    a group's score is the product of its two smallest keys (the sum of its two best scores),
    the topk_group groups of smallest score are kept and the token takes the k smallest keys
    inside them, in key order: k experts drawn without replacement with probability
    proportional to p within the kept groups (Plackett-Luce).

    Why this draws the same thing. K_e ~ Exp(p_e), independent: an exponential race. Inside a
    group g, the smallest key is Exp(P_g) (P_g the group's mass), its expert is e with
    probability p_e / P_g, and the two are independent; by memorylessness the race of the others
    goes on from there: the next key is that plus Exp(P_g - p_first), its expert categorical over
    the rest, and so on. Drawing the first two arrival times (and the first expert, whose weight
    sets the second rate) of every group gives the groups' scores with the dense law; the keys
    after them are independent of the choice of groups, so the kept groups' races continue
    lazily: a k-way merge of their next arrivals, each arrival's expert drawn only when it is
    taken (a categorical over the group's experts not taken yet, independent of the time). The
    sorted keys of each group, and so everything computed from them, have the dense joint law;
    only ties differ (dense float32 keys tie with probability ~1e-7 a pair, these float64 ones
    far less).

    Random numbers. Token t's numbers are numbers t * stride + slot of a splitmix64 stream keyed
    per layer (:func:`_bits`): slots 0..G-1 the groups' first arrival exponentials, G..2G-1
    their second, then k - 1 exponentials for later arrival times, G uniforms for the groups'
    first experts and (k - 1)(TRIES + 1) uniforms for later experts, computed only when used
    (the exponentials and first uniforms in bulk, a few tokens at a time, in loops that
    vectorise). Per token that is 2 exponentials and a uniform per group and, for the merge,
    about one exponential and a uniform or two per later expert: ~40 numbers for DeepSeek-V3
    where the dense sampler drew one exponential per expert (256). Both the compiled loop and
    numpy compute the same number for a (token, slot), so the ids are the same bits with or
    without numba and do not depend on how the tokens are split into blocks.

    A categorical draw is one uniform through an alias table. Without replacement it draws from
    the table of the group without its r heaviest experts, r the number of them already taken in
    a row (the heavy ones go first), and rejects other taken experts: :data:`TRIES` rounds, then
    an exact inverse CDF over the experts left, so a group whose mass sits on a few experts
    cannot stall it. The state is a few (groups x tokens) arrays per block (numpy) or chunk of
    64 tokens (the compiled loop) and a taken-flag per (expert, token) of the block or chunk.
    """

    #: rejection rounds of a categorical draw without replacement before the exact fallback
    TRIES = 2

    def __init__(self, p: np.ndarray, n_group: int, topk_group: int, top_k: int):
        self.p = np.asarray(p, dtype=np.float64)
        self.n_group, self.topk_group, self.k = n_group, topk_group, top_k
        self.size = size = len(p) // n_group
        if topk_group * size < top_k:
            raise ConfigError(
                f"routing: top-{top_k} needs {top_k} experts in the {topk_group} kept groups "
                f"of {size}"
            )
        # a token's slots (class docstring): 2 exponentials per group, k - 1 later times, a
        # uniform per group, (k - 1)(TRIES + 1) for later experts
        self.times_at = 2 * n_group
        self.firsts_at = self.times_at + top_k - 1
        self.picks_at = self.firsts_at + n_group
        self.stride = self.picks_at + (top_k - 1) * (self.TRIES + 1)
        groups = self.p.reshape(n_group, size)
        self.mass = groups.sum(axis=1)
        # heavy[g, r]: the id of group g's r-th heaviest expert; tables[r]: alias tables of every
        # group without its r heaviest experts (r < depth), flattened (group, r, slot)
        self.depth = min(top_k, size)
        heavy = np.argsort(-groups, axis=1, kind="stable")
        self.heavy = (heavy + np.arange(n_group)[:, None] * size).ravel()
        prob, alias = np.ones((n_group, self.depth, size)), np.zeros((n_group, self.depth, size))
        for g in range(n_group):
            for r in range(self.depth):
                ids = heavy[g, r:]
                pr, al = _alias_table(groups[g, ids])
                prob[g, r, : len(ids)], alias[g, r, : len(ids)] = pr, g * size + ids[al]
        self.prob, self.alias = prob.ravel(), alias.ravel().astype(np.intp)
        self.seen = np.zeros(0, dtype=bool)  # taken[e * n + token] of the block being drawn

    def _pick(self, u: np.ndarray, g: np.ndarray, r: np.ndarray | int = 0) -> np.ndarray:
        """Expert ids drawn ∝ p inside groups g without their r heaviest experts (alias method:
        the integer part of u * slots picks a slot, the fraction one of its two outcomes)."""
        slots = self.size - r
        x = u * slots
        j = np.minimum(x.astype(np.intp), slots - 1)  # u * slots may round up to slots
        slot = (g * self.depth + r) * self.size + j
        own = self.heavy[g * self.size + r + j]
        return np.where(x - j < self.prob[slot], own, self.alias[slot])

    def _pick_new(self, u, ptr, g: np.ndarray, tok: np.ndarray, n: int) -> np.ndarray:
        """For every i, an expert of group g[i] ∝ p among those token tok[i] has not taken
        (``self.seen`` over n tokens): rejection, then the exact inverse CDF. ``u(i, c)`` is
        the uniform of token i's later-expert slot c; ``ptr`` (per token) the next unused."""
        seen, size = self.seen, self.size
        r = np.zeros(len(g), dtype=np.intp)  # the heaviest experts taken in a row
        on = np.arange(len(g))
        for level in range(self.depth - 1):
            on = on[seen[self.heavy[g[on] * size + level] * n + tok[on]]]
            if not len(on):
                break
            r[on] += 1
        out = np.full(len(g), -1, dtype=np.intp)
        todo = np.arange(len(g))
        for _ in range(self.TRIES):
            tt = tok[todo]
            e = self._pick(u(tt, ptr[tt]), g[todo], r[todo])
            ptr[tt] += 1
            ok = ~seen[e * n + tt]
            out[todo[ok]] = e[ok]
            todo = np.flatnonzero(out < 0)
            if not len(todo):
                break
        if len(todo):
            tt = tok[todo]
            first = g[todo, None] * size + np.arange(size)  # the stragglers' groups' experts
            w = np.where(seen[first * n + tt[:, None]], 0.0, self.p[first])
            cum = np.cumsum(w, axis=1)
            j = (cum <= (u(tt, ptr[tt]) * cum[:, -1])[:, None]).sum(axis=1)
            ptr[tt] += 1
            last = size - 1 - (w[:, ::-1] > 0).argmax(axis=1)  # u * total may round to total
            out[todo] = first[:, 0] + np.minimum(j, last)
        return out

    def draw(
        self, key: int, lo: int, hi: int, into: np.ndarray | None = None, load=None
    ) -> np.ndarray:
        """The top-k ids of tokens lo..hi-1 of the stream ``key``, (k, hi - lo), each token's in
        key order (smallest first): by the compiled loop (:func:`_race_loop`, numba, when
        installed) or the numpy code (:meth:`_merge`), the same ids.

        ``into`` (hi - lo, k) and ``load`` (per expert), when given, are where the compiled loop
        writes the ids (row per token: the caller's table, no transposed copy) and counts the
        experts taken; the return value is then ``into.T`` and, without numba, neither is
        touched."""
        loop = compiled_race_loop()
        if loop is None:
            return self._merge(np.uint64(key), lo, hi)
        out = np.empty((hi - lo, self.k), dtype=np.intp) if into is None else into
        load = np.zeros(len(self.p), dtype=np.int64) if load is None else load
        loop(np.uint64(key), lo, hi, self.p, self.mass, self.heavy, self.prob, self.alias,
             self.topk_group, self.k, self.size, self.depth, self.TRIES, self.stride, out, load)  # fmt: skip
        return out.T

    def _merge(self, key: np.uint64, lo: int, hi: int) -> np.ndarray:
        """:meth:`draw` in numpy, vectorised over the tokens."""
        G, kg, k, size = self.n_group, self.topk_group, self.k, self.size
        n = hi - lo
        cols = np.arange(n)
        base = np.arange(lo, hi, dtype=np.uint64) * np.uint64(self.stride)  # token's slot 0
        if len(self.seen) < len(self.p) * n:
            self.seen = np.zeros(len(self.p) * n, dtype=bool)
        slot = np.arange(G, dtype=np.uint64)[:, None]
        # every group's first two arrivals: t1 ~ Exp(P_g), its expert, t2 = t1 + Exp(rest)
        u1 = _uniform(_bits(key, base + np.uint64(self.firsts_at) + slot))
        first = self._pick(u1, np.arange(G)[:, None])
        t1 = _exponential(_bits(key, base + slot)) / self.mass[:, None]
        rest = self.mass[:, None] - self.p[first]  # > 0: every p_e > 0
        if size > 1:
            t2 = t1 + _exponential(_bits(key, base + np.uint64(G) + slot)) / rest
        else:
            t2 = np.full((G, n), np.inf)
        if kg < G:  # the kg groups of smallest score t1 * t2, in group order
            kept = _smallest_rows(t1 * t2, kg)
            gk = np.flatnonzero(kept.T.ravel()).reshape(n, kg).T % G
        else:
            gk = np.repeat(np.arange(G)[:, None], n, axis=1)
        # the kept groups' races, merged: head time, head id (-1: not drawn), the time after the
        # head (nan: not drawn), mass of the experts not taken (nor the head, when drawn)
        at = (gk * n + cols).ravel()  # (kg * n,), kept group-major
        t, hid, tn, mass = t1.ravel()[at], first.ravel()[at], t2.ravel()[at], rest.ravel()[at]
        gk = gk.ravel()
        taken = np.zeros(kg * n, dtype=np.int64) if size <= k else None
        ptr, q = np.zeros(n, dtype=np.uint64), np.zeros(n, dtype=np.uint64)  # next slots used
        picks = np.uint64(self.picks_at)

        def u(tok, c):
            return _uniform(_bits(key, base[tok] + picks + c))

        out = np.empty((k, n), dtype=np.intp)
        for s in range(k):
            flat = _argmin_rows(t.reshape(kg, n)) * n + cols
            h = hid[flat]
            new = np.flatnonzero(h < 0)
            if len(new):
                h[new] = self._pick_new(u, ptr, gk[flat[new]], new, n)
                mass[flat[new]] -= self.p[h[new]]
            out[s] = h
            if s == k - 1:
                break
            self.seen[h * n + cols] = True
            nxt = tn[flat]
            late = np.flatnonzero(np.isnan(nxt))
            if len(late):
                e2 = _exponential(_bits(key, base[late] + np.uint64(self.times_at) + q[late]))
                with np.errstate(divide="ignore"):
                    nxt[late] = t[flat[late]] + e2 / mass[flat[late]]
                q[late] += _ONE
            if taken is not None:  # groups smaller than k can run out of experts
                taken[flat] += 1
                nxt[taken[flat] >= size] = np.inf
            t[flat], tn[flat], hid[flat] = nxt, np.nan, -1
        self.seen[(out[:-1] * n + cols).ravel()] = False
        return out


def _race_loop(key, lo, hi, p, mass, heavy, prob, alias, kg, k, size, depth, tries, stride, out,
               load):  # fmt: skip
    """:meth:`_Race._merge` compiled (numba): the same random numbers (computed here, only those
    used) and float operations, so the same ids, written as out[token - lo, s] (the ids table's
    own layout) and counted in ``load`` (per expert). Like the numpy code it goes step by step
    over a chunk of tokens, not token by token: a token's merge is a chain of dependent
    latencies (draw an expert, its rate, the next time, the next head), and the tokens of a
    chunk, independent, fill each other's waits."""  # pragma: no cover - compiled
    G, C = len(mass), 64
    nexp, picks_at = 2 * G + k - 1, np.uint64(3 * G + k - 1)  # exponentials, then uniforms
    xs, us = np.empty((C, nexp)), np.empty((C, G))
    first, t1, t2, rest = np.empty(G, np.int64), np.empty(G), np.empty(G), np.empty(G)
    score, kept = np.empty(G), np.empty((C, G), np.int64)  # kept[c, kg:]: scratch
    t, tn, ms = np.empty((C, kg)), np.empty((C, kg)), np.empty((C, kg))
    hid, cnt = np.empty((C, kg), np.int64), np.empty((C, kg), np.int64)
    ptr, q = np.empty(C, np.uint64), np.empty(C, np.int64)
    w, cum = np.empty(size), np.empty(size)
    taken = np.zeros((C, len(p)), np.bool_)  # each token's experts so far

    def pick(u, g, r):
        slots = size - r
        x = u * slots
        j = min(np.int64(x), slots - 1)
        slot = (g * depth + r) * size + j
        a = alias[slot]  # own if x - j < prob[slot] else alias, without a branch
        return a + np.int64(x - j < prob[slot]) * (heavy[g * size + r + j] - a)

    for c0 in range(lo, hi, C):
        n = min(C, hi - c0)
        for c in range(n):  # the exponentials and first uniforms, in loops that vectorise
            at = np.uint64(c0 + c) * np.uint64(stride)
            for x in range(nexp):
                xs[c, x] = _exponential(_bits(key, at + np.uint64(x)))
            for x in range(G):
                us[c, x] = _uniform(_bits(key, at + np.uint64(nexp + x)))
        for c in range(n):  # every group's first two arrivals, the kept groups
            for g in range(G):
                first[g] = pick(us[c, g], g, 0)
                t1[g] = xs[c, g] / mass[g]
                rest[g] = mass[g] - p[first[g]]
                t2[g] = t1[g] + xs[c, G + g] / rest[g] if size > 1 else np.inf
                score[g] = t1[g] * t2[g]
            # the kept in group order: rank < kg, ranks of the (score, group) pairs as
            # _smallest_rows, without branches
            m = 0
            for g in range(G):
                rank = 0
                for h in range(G):
                    rank += (score[h] < score[g]) | ((score[h] == score[g]) & (h < g))
                kept[c, m] = g
                m += rank < kg
            for j in range(kg):
                g = kept[c, j]
                t[c, j], hid[c, j], tn[c, j], ms[c, j] = t1[g], first[g], t2[g], rest[g]
                cnt[c, j] = 0
            ptr[c], q[c] = picks_at, 2 * G
        for s in range(k):  # the merge, a step of every token in turn
            for c in range(n):
                jb, tb = 0, t[c, 0]  # the first of the earliest heads, without branches
                for j in range(1, kg):
                    b = t[c, j] < tb
                    jb, tb = (j if b else jb), min(t[c, j], tb)
                h = hid[c, jb]
                if h < 0:
                    base = np.uint64(c0 + c) * np.uint64(stride)
                    g = kept[c, jb]
                    r = 0
                    while r < depth - 1 and taken[c, heavy[g * size + r]]:
                        r += 1
                    for _ in range(tries):
                        ex = pick(_uniform(_bits(key, base + ptr[c])), g, r)
                        ptr[c] += np.uint64(1)
                        if not taken[c, ex]:
                            h = ex
                            break
                    if h < 0:
                        acc = 0.0
                        for x in range(size):
                            w[x] = 0.0 if taken[c, g * size + x] else p[g * size + x]
                            acc += w[x]
                            cum[x] = acc
                        lim = _uniform(_bits(key, base + ptr[c])) * cum[size - 1]
                        ptr[c] += np.uint64(1)
                        j = 0
                        for x in range(size):
                            j += cum[x] <= lim
                        last = size - 1
                        for x in range(size - 1, -1, -1):
                            if w[x] > 0:
                                last = x
                                break
                        h = g * size + min(j, last)
                    ms[c, jb] -= p[h]
                out[c0 + c - lo, s] = h
                taken[c, h] = True
                load[h] += 1
                if s == k - 1:
                    continue
                nxt = tn[c, jb]
                if np.isnan(nxt):
                    nxt = t[c, jb] + xs[c, q[c]] / ms[c, jb]
                    q[c] += 1
                if size <= k:
                    cnt[c, jb] += 1
                    if cnt[c, jb] >= size:
                        nxt = np.inf
                t[c, jb], tn[c, jb], hid[c, jb] = nxt, np.nan, -1
        for c in range(n):
            for s in range(k):
                taken[c, out[c0 + c - lo, s]] = False


def _count_loop(topk, a, b, rank_of, node_of, copies, tokens, node_tokens, load):
    """:meth:`LayerRouting._counted`'s counts of rows a..b (one source rank) as one loop over
    tokens (compiled by numba): a rank (node) counts a token once, at its first expert there;
    rank_of / node_of map expert ids (no integer division in the loop)."""  # pragma: no cover
    k = topk.shape[1]
    ranks, nodes = np.empty(k, np.int64), np.empty(k, np.int64)
    for i in range(a, b):
        for j in range(k):
            e = topk[i, j]
            load[e] += 1
            d, nd = rank_of[e], node_of[e]
            copies[d] += 1
            new_rank, new_node = True, True
            for jj in range(j):
                new_rank &= ranks[jj] != d
                new_node &= nodes[jj] != nd
            ranks[j], nodes[j] = d, nd
            tokens[d] += new_rank
            node_tokens[nd] += new_node


_compiled = None  # None: not tried yet; False: numba missing (or switched off); else the loops


def _compiled_loops() -> dict | None:
    """:func:`_race_loop` and :func:`_count_loop` compiled with numba (cached next to this
    module when it can be), None when numba is not installed (or ``_compiled`` is set to False:
    the numpy code)."""
    global _compiled
    if _compiled is None:
        opts = dict(nogil=True, error_model="numpy")
        inline(_bits, _uniform, _exponential)
        race, count = njit(_race_loop, **opts), njit(_count_loop, **opts)
        _compiled = {"race": race, "count": count} if race and count else False
    return _compiled or None


def compiled_race_loop():
    """The compiled :func:`_race_loop`, None without numba (a benchmark loads it before its
    clock starts)."""
    loops = _compiled_loops()
    return loops["race"] if loops else None


def _smallest_rows(a: np.ndarray, m: int) -> np.ndarray:
    """Which rows of each column of ``a`` are its m smallest (the lower row on ties), as a bool
    array: pairwise ranks, cheaper than a sort along a short axis."""
    rank = np.zeros(a.shape, dtype=np.int8)
    for i in range(len(a)):
        for j in range(i + 1, len(a)):
            below = a[j] < a[i]
            rank[i] += below
            rank[j] += ~below
    return rank < m


def _argmin_rows(a: np.ndarray) -> np.ndarray:
    """``a.argmin(axis=0)`` for a few long rows (the lower row on ties), as a knockout
    tournament of row pairs: numpy's own reduction over a short axis is several times slower."""
    best: list[np.ndarray] = list(a)
    idx: list = list(range(len(a)))  # row ids: ints in the first round, then arrays
    while len(best) > 1:
        nb, ni = [], []
        for i in range(0, len(best) - 1, 2):
            right = best[i + 1] < best[i]
            nb.append(np.where(right, best[i + 1], best[i]))
            if isinstance(idx[i], int):
                ni.append(right + np.intp(idx[i]))
            else:
                ni.append(np.where(right, idx[i + 1], idx[i]))
        if len(best) % 2:
            nb.append(best[-1])
            ni.append(idx[-1])
        best, idx = nb, ni
    return np.full(a.shape[1], idx[0], dtype=np.intp) if isinstance(idx[0], int) else idx[0]


def _alias_table(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Walker's alias table of weights w (Vose's construction): slot i gives outcome i with
    probability prob[i], else outcome alias[i]."""
    n = len(w)
    q = (w * n / w.sum()).tolist()
    prob, alias = np.ones(n), np.arange(n)
    small = [i for i in range(n) if q[i] < 1.0]
    large = [i for i in range(n) if q[i] >= 1.0]
    while small and large:
        s, big = small.pop(), large.pop()
        prob[s], alias[s] = q[s], big
        q[big] -= 1.0 - q[s]
        (small if q[big] < 1.0 else large).append(big)
    return prob, alias  # what is left keeps its slot: prob 1, up to rounding


def rank_hit_prob(ranks: int, top_k: int) -> float:
    """Chance a given one of ``ranks`` holds at least one of a token's top-k experts (uniform,
    choices with replacement; the balanced expectation ``shared.ir.ops`` uses too)."""
    return 1.0 - (1.0 - 1.0 / ranks) ** top_k


class Routing:
    """Per-layer routings of a workload, drawn lazily and cached (the same seed, the same draw)."""

    def __init__(self, cfg: RoutingConfig, dp_tokens: tuple[int, ...]):
        self.cfg, self.dp_tokens = cfg, tuple(dp_tokens)
        self.sample = None
        if cfg.imbalance.kind == "file":
            self.sample = read_sample(cfg.imbalance.path, cfg.num_experts, cfg.top_k)
        self._layers: dict[int, LayerRouting] = {}
        self._drawn: list[LayerRouting] = []  # layers holding per-token ids, oldest first

    #: layers whose per-token ids stay drawn (a lowering visits a layer's micro-batches in turn)
    KEEP = 2

    def _kept(self, lr: LayerRouting) -> None:
        if lr in self._drawn:
            self._drawn.remove(lr)
        self._drawn.append(lr)
        while len(self._drawn) > self.KEEP:
            self._drawn.pop(0).release()

    def layer(self, layer: int) -> LayerRouting:
        if layer not in self._layers:
            # balanced routing is the same expectation on every layer: share one
            key = 0 if self.cfg.imbalance.kind == "balanced" else layer
            if key not in self._layers:
                self._layers[key] = LayerRouting(
                    self.cfg, self.dp_tokens, key, self.sample, keep=self._kept
                )
            self._layers[layer] = self._layers[key]
        return self._layers[layer]


def dp_token_counts(padded: int, ep: int, spread: float, seed: int) -> tuple[int, ...]:
    """Real tokens per DP rank: rank 0 holds the padded count, the others a seeded uniform draw
    in [(1 - spread) * padded, padded] (``--dp-imbalance``; 0 gives every rank ``padded``)."""
    if not 0.0 <= spread < 1.0:
        raise ConfigError(f"dp_imbalance must lie in [0, 1), got {spread}", names=("dp_imbalance",))
    if spread == 0:
        return (padded,) * ep
    u = np.random.default_rng([seed, 0xD9]).random(ep)
    counts = [max(1, round(padded * (1.0 - spread * x))) for x in u]
    counts[0] = padded
    return tuple(int(c) for c in counts)


def routing_for(
    w,
    imbalance: Imbalance | str = "balanced",
    *,
    seed: int = 0,
    dp_tokens: tuple[int, ...] | None = None,
    group_limited: bool | None = None,
) -> Routing:
    """The routing of a Workload's batch on every EP rank (``w.batch`` is the padded per-rank
    batch; ``dp_tokens`` the real tokens per rank, default all). ``group_limited`` defaults to the
    model's own gating (DeepSeek-V3: on)."""
    if isinstance(imbalance, str):
        imbalance = parse_imbalance(imbalance)
    m, p = w.model, w.parallel
    n = w.batch.num_tokens
    dp = tuple(dp_tokens) if dp_tokens is not None else (n,) * p.ep
    if len(dp) != p.ep or any(not 0 <= t <= n for t in dp):
        raise ConfigError(f"dp tokens must be {p.ep} counts in 0..{n}, got {dp}")
    cfg = RoutingConfig(
        m.num_experts,
        m.top_k,
        p.ep,
        p.gpus_per_node,
        imbalance,
        seed,
        m.group_limited if group_limited is None else group_limited,
        m.n_group,
        m.topk_group,
    )
    return Routing(cfg, dp)
