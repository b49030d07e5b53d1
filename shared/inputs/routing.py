"""Which experts each token goes to, and what that means per EP rank: seeded and reproducible.

Expert load (``--imbalance``):

- ``balanced``: the *expected* routing of uniformly random gating, with no sampling noise: every
  rank sends every other rank the same (fractional) number of token copies, so an explicit
  simulation of all ranks gives exactly the symmetric one (its straggler cost is 0).
- ``zipf:S``: expert popularity p_e proportional to 1/i^S over a seeded permutation of the experts
  (a different permutation per layer); each token draws its top-k distinct experts with
  probability proportional to p (Gumbel top-k, i.e. sampling without replacement; drawn by the
  exact race sampler of ``shared/inputs/race.py``, a few random numbers per expert taken, not
  one per expert, from a counter-based generator seeded per layer). ``zipf:0`` is uniformly
  random routing *with*
  sampling noise. Cost (compiled, DeepSeek-V3 at EP32, one core of the 2-core bench machine):
  ~0.26 us per token drawn: ~75 ns the 31 numbers it draws in bulk (23 exponentials: logs),
  ~50 ns the groups' first arrivals and the kept groups, ~120 ns the k-way merge's chains of
  dependent steps, and ~20 ns counting it per rank; the numpy code ~4 us.
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
import io
import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.files import read_text
from overlap_lab.shared.inputs.race import Race, exponential, race_loop, random_bits, uniform
from overlap_lab.shared.inputs.topology import Topology
from overlap_lab.shared.jit import inline, njit


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


#: Routing files larger than this are refused unread: a routing sample is a few MB (a million
#: tokens' top-8 expert ids are ~25 MB of CSV), and parsed it takes several times its size.
MAX_ROUTING_FILE_BYTES = 32 << 20
_NOT_FINITE = re.compile(r"(?i)(?<![a-z_])(nan|inf|infinity)(?![a-z_])")


def read_sample(path: str, num_experts: int, top_k: int) -> Sample:
    """Parse a routing file (format in the module docstring), checking it against the model;
    read through ``shared.files`` (a regular UTF-8 file of at most
    :data:`MAX_ROUTING_FILE_BYTES`)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".json", ".csv"):
        if not p.exists():
            raise _bad(path, "no such file")
        raise _bad(path, "expected a .json or .csv file")
    text = read_text(p, "routing file", MAX_ROUTING_FILE_BYTES)
    if "\x00" in text:
        raise _bad(path, "not a text file (NUL bytes)")
    if _NOT_FINITE.search(text):
        raise _bad(path, "numbers must be finite (found NaN or Infinity)")
    if suffix == ".json":
        try:
            data = json.loads(text)
        except RecursionError:
            raise _bad(path, "invalid JSON (nested too deeply)") from None
        except json.JSONDecodeError as e:
            raise _bad(path, f"invalid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(data, dict) or not ({"expert_counts", "topk_ids"} & set(data)):
            raise _bad(path, "expected an object with 'expert_counts' or 'topk_ids'")
        if "expert_counts" in data:
            return Sample(counts=_check_counts(path, data["expert_counts"], num_experts))
        return Sample(topk_ids=_check_ids(path, data["topk_ids"], num_experts, top_k))
    # row by row: the file's text, and no list of every row's cells, is all it holds at once
    rows = (r for r in csv.reader(io.StringIO(text, newline="")) if any(c.strip() for c in r))
    try:
        first = next(rows, None)
        if first is None:
            raise _bad(path, "empty file")
        if [c.strip().lower() for c in first] == ["expert", "count"]:
            counts = [0.0] * num_experts
            for i, (e, c) in enumerate(_pairs(path, rows), 2):
                if not 0 <= e < num_experts:
                    raise _bad(path, f"line {i}: expert {e} outside 0..{num_experts - 1}")
                counts[e] += c
            return Sample(counts=_check_counts(path, counts, num_experts))
        try:
            ids = [tuple(int(c) for c in r) for r in itertools.chain((first,), rows)]
        except ValueError:
            raise _bad(path, "expected integer expert ids (or an 'expert,count' header)") from None
    except csv.Error as e:  # a field over the csv module's limit (128 KiB), say
        raise _bad(path, f"not a CSV of numbers ({e})") from None
    return Sample(topk_ids=_check_ids(path, ids, num_experts, top_k))


def _pairs(path: str, rows):
    for i, r in enumerate(rows, 2):
        try:
            e, c = r
            yield int(e), float(c)
        except ValueError:
            text = ",".join(r)[:80]
            raise _bad(path, f"line {i}: expected 'expert,count', got {text!r}") from None


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
        if not isinstance(row, (list, tuple)) or len(row) != top_k:
            raise _bad(path, f"token {i}: expected {top_k} expert ids, got {row!r}")
        if any(isinstance(e, bool) or not isinstance(e, int) for e in row):
            raise _bad(path, f"token {i}: expert ids must be integers")
        if any(not 0 <= e < num_experts for e in row):
            raise _bad(path, f"token {i}: expert id outside 0..{num_experts - 1}")
        if len(set(row)) != top_k:
            raise _bad(path, f"token {i}: repeated expert id in {row}")
        out.append(row if isinstance(row, tuple) else tuple(row))
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
        (``shared.inputs.race.Race``: in one compiled loop, or in numpy block by block of
        :data:`BLOCK` tokens, the same ids from one stream of numbers per layer); and the expert
        load where the compiled sampler counted it (None: count the ids)."""
        cfg = self.cfg
        n, k, e = sum(self.dp_tokens), cfg.top_k, cfg.num_experts
        ids = np.uint8 if e <= 256 else np.int16 if e <= 32768 else np.int32
        if cfg.imbalance.kind == "file" and self.sample is not None and self.sample.topk_ids:
            table = np.asarray(self.sample.topk_ids, dtype=ids)
            return table[np.arange(n) % len(table)], None
        rng = self._rng()
        grouped = cfg.group_limited and cfg.n_group > 1
        race = Race(
            self._popularity(rng),
            cfg.n_group if grouped else 1,
            cfg.topk_group if grouped else 1,
            k,
        )
        key = int(rng.bit_generator.random_raw())  # the layer's stream of race numbers
        topk = np.empty((n, k), dtype=ids)
        loop = compiled_race_loop()
        if loop is not None:  # the loop writes the rows, counts the load
            load = np.zeros(e, dtype=np.int64)
            race.draw(key, 0, n, into=topk, load=load, loop=loop)
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


def _count_loop(topk, a, b, rank_of, node_of, copies, tokens, node_tokens, load):
    """:meth:`LayerRouting._counted`'s counts of rows a..b (one source rank) as one loop over
    tokens (compiled by numba): a rank (node) counts a token once, at its first expert there,
    found by the last token stamped on it (no loop over the token's earlier experts); rank_of /
    node_of map expert ids (no integer division in the loop)."""  # pragma: no cover
    k = topk.shape[1]
    rank_at, node_at = np.full(len(copies), -1, np.int64), np.full(len(node_tokens), -1, np.int64)
    for i in range(a, b):
        for j in range(k):
            e = topk[i, j]
            load[e] += 1
            d, nd = rank_of[e], node_of[e]
            copies[d] += 1
            tokens[d] += rank_at[d] != i
            node_tokens[nd] += node_at[nd] != i
            rank_at[d], node_at[nd] = i, i


_compiled = None  # None: not tried yet; False: numba missing (or switched off); else the loops


def _compiled_loops() -> dict | None:
    """``shared.inputs.race.race_loop`` and :func:`_count_loop` compiled with numba (cached next
    to their modules when they can be), None when numba is not installed (or ``_compiled`` is
    set to False: the numpy code)."""
    global _compiled
    if _compiled is None:
        opts = dict(nogil=True, error_model="numpy")
        inline(random_bits, uniform, exponential)
        race, count = njit(race_loop, **opts), njit(_count_loop, **opts)
        _compiled = {"race": race, "count": count} if race and count else False
    return _compiled or None


def compiled_race_loop():
    """The compiled ``shared.inputs.race.race_loop``, None without numba (a benchmark loads it
    before its clock starts)."""
    loops = _compiled_loops()
    return loops["race"] if loops else None


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
