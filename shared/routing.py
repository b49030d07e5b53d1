"""Which experts each token goes to, and what that means per EP rank: seeded and reproducible.

Expert load (``--imbalance``):

- ``balanced``: the *expected* routing of uniformly random gating, with no sampling noise: every
  rank sends every other rank the same (fractional) number of token copies, so an explicit
  simulation of all ranks gives exactly the symmetric one (its straggler cost is 0).
- ``zipf:S``: expert popularity p_e proportional to 1/i^S over a seeded permutation of the experts
  (a different permutation per layer); each token draws its top-k distinct experts with
  probability proportional to p (Gumbel top-k, i.e. sampling without replacement).
  ``zipf:0`` is uniformly random routing *with* sampling noise.
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
from functools import cached_property
from pathlib import Path

import numpy as np

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.topology import Topology


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
            raise ConfigError(f"--imbalance zipf:S needs a number S >= 0, got {spec!r}")
        return Imbalance("zipf", s)
    if spec.startswith("file:") and spec[5:]:
        return Imbalance("file", path=spec[5:])
    raise ConfigError(f"--imbalance must be balanced, zipf:S or file:PATH, got {spec!r}")


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


class LayerRouting:
    """The routing of one layer's tokens: per-token top-k ids (sampled) or expectations."""

    def __init__(self, cfg: RoutingConfig, dp_tokens: tuple[int, ...], layer: int = 0, sample=None):
        self.cfg, self.dp_tokens, self.layer = cfg, tuple(dp_tokens), layer
        if len(self.dp_tokens) != cfg.ep:
            raise ConfigError(
                f"routing: {len(self.dp_tokens)} per-rank token counts for ep {cfg.ep}"
            )
        self._cache: dict[tuple[int, int], Matrices] = {}
        self.sample = sample
        self.src = self.tix = self.topk = None
        if cfg.imbalance.kind != "balanced":
            self._draw()

    # -- drawing ------------------------------------------------------------------------------

    def _rng(self) -> np.random.Generator:
        return np.random.default_rng([self.cfg.seed, self.layer, 0x5EED])

    def _draw(self) -> None:
        cfg, rng = self.cfg, self._rng()
        src = np.repeat(np.arange(cfg.ep), self.dp_tokens)
        tix = np.concatenate([np.arange(n) for n in self.dp_tokens]) if len(src) else src
        n = len(src)
        if cfg.imbalance.kind == "file" and self.sample is not None and self.sample.topk_ids:
            ids = np.asarray(self.sample.topk_ids, dtype=np.int64)
            topk = ids[np.arange(n) % len(ids)]
        else:
            logp = np.log(self._popularity(rng))
            g = rng.gumbel(size=(n, cfg.num_experts)).astype(np.float32)
            scores = logp[None, :].astype(np.float32) + g
            if cfg.group_limited and cfg.n_group > 1:
                scores = _mask_groups(scores, cfg.n_group, cfg.topk_group)
            topk = np.argpartition(-scores, cfg.top_k - 1, axis=1)[:, : cfg.top_k]
        self.src, self.tix, self.topk = src, tix, topk

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
            self._cache[key] = (
                self._expected(lo, hi) if self.topk is None else self._counted(lo, hi)
            )
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
        cfg, topo = self.cfg, self.cfg.topology
        r, nn, g = cfg.ep, topo.num_nodes, topo.gpus_per_node
        sel = (self.tix >= lo) & (self.tix < hi)
        src, topk = self.src[sel], self.topk[sel]
        n = len(src)
        dst = topk // cfg.local_experts
        srck = np.repeat(src, cfg.top_k)
        copies = np.bincount(srck * r + dst.ravel(), minlength=r * r).reshape(r, r)
        tok = np.repeat(np.arange(n), cfg.top_k)
        pairs = np.unique(tok * r + dst.ravel())
        tokens = np.bincount(src[pairs // r] * r + pairs % r, minlength=r * r).reshape(r, r)
        npairs = np.unique(tok * nn + (dst // g).ravel())
        node_tokens = np.bincount(src[npairs // nn] * nn + npairs % nn, minlength=r * nn).reshape(
            r, nn
        )
        load = np.bincount(topk.ravel(), minlength=cfg.num_experts)
        active = (load.reshape(r, cfg.local_experts) > 0).sum(axis=1)
        f = np.float64
        return Matrices(copies.astype(f), tokens.astype(f), node_tokens.astype(f), active.astype(f))

    @cached_property
    def expert_load(self) -> np.ndarray:
        """Token copies per expert over the whole batch."""
        if self.topk is None:
            total = sum(self.dp_tokens) * self.cfg.top_k / self.cfg.num_experts
            return np.full(self.cfg.num_experts, total)
        return np.bincount(self.topk.ravel(), minlength=self.cfg.num_experts).astype(float)


def _mask_groups(scores: np.ndarray, n_group: int, topk_group: int) -> np.ndarray:
    """DeepSeek-V3 group-limited gating: keep the topk_group groups with the best top-2 sums."""
    n, e = scores.shape
    grouped = scores.reshape(n, n_group, e // n_group)
    top2 = np.partition(grouped, -2, axis=2)[:, :, -2:].sum(axis=2)
    keep = np.argpartition(-top2, topk_group - 1, axis=1)[:, :topk_group]
    mask = np.zeros((n, n_group), dtype=bool)
    mask[np.arange(n)[:, None], keep] = True
    return np.where(np.repeat(mask, e // n_group, axis=1), scores, -np.inf).astype(np.float32)


def rank_hit_prob(ranks: int, top_k: int) -> float:
    """Chance a given one of ``ranks`` holds at least one of a token's top-k experts (uniform,
    choices with replacement; the balanced expectation ``shared.ops`` uses too)."""
    return 1.0 - (1.0 - 1.0 / ranks) ** top_k


class Routing:
    """Per-layer routings of a workload, drawn lazily and cached (the same seed, the same draw)."""

    def __init__(self, cfg: RoutingConfig, dp_tokens: tuple[int, ...]):
        self.cfg, self.dp_tokens = cfg, tuple(dp_tokens)
        self.sample = None
        if cfg.imbalance.kind == "file":
            self.sample = read_sample(cfg.imbalance.path, cfg.num_experts, cfg.top_k)
        self._layers: dict[int, LayerRouting] = {}

    def layer(self, layer: int) -> LayerRouting:
        if layer not in self._layers:
            # balanced routing is the same expectation on every layer: share one
            key = 0 if self.cfg.imbalance.kind == "balanced" else layer
            if key not in self._layers:
                self._layers[key] = LayerRouting(self.cfg, self.dp_tokens, key, self.sample)
            self._layers[layer] = self._layers[key]
        return self._layers[layer]


def dp_token_counts(padded: int, ep: int, spread: float, seed: int) -> tuple[int, ...]:
    """Real tokens per DP rank: rank 0 holds the padded count, the others a seeded uniform draw
    in [(1 - spread) * padded, padded] (``--dp-imbalance``; 0 gives every rank ``padded``)."""
    if not 0.0 <= spread < 1.0:
        raise ConfigError(f"--dp-imbalance must lie in [0, 1), got {spread}")
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
