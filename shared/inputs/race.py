"""The race sampler: exact, sparse sampling of top-k expert routing with random gating scores
(the dense Gumbel top-k, group-limited as DeepSeek-V3 gates), drawn from a counter-based stream
of random numbers that numpy and the compiled loop compute alike (``Race``'s docstring says how
and why). ``shared/inputs/routing.py`` draws each layer's routing with it and holds the switch
between the compiled loop (numba, ``routing.compiled_race_loop``) and numpy.
"""

from __future__ import annotations

import numpy as np

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.jit import as_bits, as_float

# ----------------------------------------------------------------------------------------------
# Random numbers: counter-based, computed where they are used
# ----------------------------------------------------------------------------------------------

#: splitmix64 (Steele, Lea & Flood, 2014): number c of the stream with key s is
#: random_bits(s, c)
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


def random_bits(key, ctr):
    """64 random bits, number ``ctr`` of stream ``key`` (uint64: numpy arrays, or scalars in the
    compiled loop): splitmix64's output, a bijective mix of key + ctr * golden gamma. Counter
    based, so each (token, slot) has its own number however the tokens are split into blocks."""
    z = key + ctr * _GAMMA
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


def uniform(z):
    """A uniform in [0, 1) from the top 53 of the bits z (exact: a multiple of 2^-53)."""
    return np.float64(z >> _S11) * 1.1102230246251565e-16


def exponential(z):
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


class Race:
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
    per layer (:func:`random_bits`): slots 0..G-1 the groups' first arrival exponentials, G..2G-1
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
        self, key: int, lo: int, hi: int, into: np.ndarray | None = None, load=None, loop=None
    ) -> np.ndarray:
        """The top-k ids of tokens lo..hi-1 of the stream ``key``, (k, hi - lo), each token's in
        key order (smallest first): by ``loop``, :func:`race_loop` compiled (numba:
        ``routing.compiled_race_loop()``), or, None, by the numpy code (:meth:`_merge`): the
        same ids.

        ``into`` (hi - lo, k) and ``load`` (per expert), when given, are where the compiled loop
        writes the ids (row per token: the caller's table, no transposed copy) and counts the
        experts taken; the return value is then ``into.T`` and, with numpy, neither is
        touched."""
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
        u1 = uniform(random_bits(key, base + np.uint64(self.firsts_at) + slot))
        first = self._pick(u1, np.arange(G)[:, None])
        t1 = exponential(random_bits(key, base + slot)) / self.mass[:, None]
        rest = self.mass[:, None] - self.p[first]  # > 0: every p_e > 0
        if size > 1:
            t2 = t1 + exponential(random_bits(key, base + np.uint64(G) + slot)) / rest
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
            return uniform(random_bits(key, base[tok] + picks + c))

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
                e2 = exponential(random_bits(key, base[late] + np.uint64(self.times_at) + q[late]))
                with np.errstate(divide="ignore"):
                    nxt[late] = t[flat[late]] + e2 / mass[flat[late]]
                q[late] += _ONE
            if taken is not None:  # groups smaller than k can run out of experts
                taken[flat] += 1
                nxt[taken[flat] >= size] = np.inf
            t[flat], tn[flat], hid[flat] = nxt, np.nan, -1
        self.seen[(out[:-1] * n + cols).ravel()] = False
        return out


def race_loop(key, lo, hi, p, mass, heavy, prob, alias, kg, k, size, depth, tries, stride, out,
               load):  # fmt: skip
    """:meth:`Race._merge` compiled (numba): the same random numbers (computed here, only those
    used) and float operations, so the same ids, written as out[token - lo, s] (the ids table's
    own layout) and counted in ``load`` (per expert). Like the numpy code it goes step by step
    over a chunk of tokens, not token by token: the random numbers and the groups' first
    arrivals and scores in loops along the chunk's tokens, which vectorise; then the merge,
    a chain of dependent latencies per token (draw an expert, its rate, the next time, the
    next head), where the chunk's tokens, independent, fill each other's waits."""  # pragma: no cover - compiled
    G, C = len(mass), 64
    nexp, picks_at = 2 * G + k - 1, np.uint64(3 * G + k - 1)  # exponentials, then uniforms
    # (number or group, token) of a chunk: the loops before the merge run along the tokens
    xs, us = np.empty((nexp, C)), np.empty((G, C))
    first, t1, t2 = np.empty((G, C), np.int64), np.empty((G, C)), np.empty((G, C))
    rest, score = np.empty((G, C)), np.empty((G, C))
    kept = np.empty((C, G), np.int64)  # kept[c, kg:]: scratch
    m, rank = np.empty(C, np.int64), np.empty(C, np.int64)
    t, tn, ms = np.empty((C, kg)), np.empty((C, kg)), np.empty((C, kg))
    hid, cnt = np.empty((C, kg), np.int64), np.empty((C, kg), np.int64)
    ptr, q = np.empty(C, np.uint64), np.empty(C, np.int64)
    w, cum = np.empty(size), np.empty(size)
    jbs, hs, todo = np.empty(C, np.int64), np.empty(C, np.int64), np.empty(C, np.int64)
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
        base0 = np.uint64(c0) * np.uint64(stride)
        for x in range(nexp):  # the exponentials and first uniforms, in loops that vectorise
            for c in range(n):
                xs[x, c] = exponential(
                    random_bits(key, base0 + np.uint64(c) * np.uint64(stride) + np.uint64(x))
                )
        for x in range(G):
            for c in range(n):
                us[x, c] = uniform(
                    random_bits(key, base0 + np.uint64(c) * np.uint64(stride) + np.uint64(nexp + x))
                )
        for g in range(G):  # every group's first two arrivals, a group of every token at once
            for c in range(n):
                f = pick(us[g, c], g, 0)
                first[g, c] = f
                a = xs[g, c] / mass[g]
                rest[g, c] = mass[g] - p[f]
                b = a + xs[G + g, c] / rest[g, c] if size > 1 else np.inf
                t1[g, c], t2[g, c], score[g, c] = a, b, a * b
        # the kept in group order: rank < kg, ranks of the (score, group) pairs as
        # _smallest_rows, without branches
        m[:n] = 0
        for g in range(G):
            rank[:n] = 0
            for h in range(G):
                for c in range(n):
                    rank[c] += (score[h, c] < score[g, c]) | (
                        (score[h, c] == score[g, c]) & (h < g)
                    )
            for c in range(n):
                kept[c, m[c]] = g
                m[c] += rank[c] < kg
        for c in range(n):
            for j in range(kg):
                g = kept[c, j]
                t[c, j], hid[c, j], tn[c, j], ms[c, j] = t1[g, c], first[g, c], t2[g, c], rest[g, c]
                cnt[c, j] = 0
            ptr[c], q[c] = picks_at, 2 * G
        for s in range(k):  # the merge, a step of every token in turn
            nl = 0
            for c in range(n):  # each token's earliest head, and which need their expert drawn
                jb, tb = 0, t[c, 0]  # the first of the earliest heads, without branches
                for j in range(1, kg):
                    b = t[c, j] < tb
                    jb, tb = (j if b else jb), min(t[c, j], tb)
                h = hid[c, jb]
                jbs[c], hs[c], todo[nl] = jb, h, c
                nl += h < 0
            for i in range(nl):  # the heads whose expert is not drawn yet
                c = todo[i]
                jb = jbs[c]
                h = -1
                base = np.uint64(c0 + c) * np.uint64(stride)
                g = kept[c, jb]
                r = 0
                while r < depth - 1 and taken[c, heavy[g * size + r]]:
                    r += 1
                for _ in range(tries):
                    ex = pick(uniform(random_bits(key, base + ptr[c])), g, r)
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
                    lim = uniform(random_bits(key, base + ptr[c])) * cum[size - 1]
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
                hs[c] = h
            for c in range(n):  # the heads taken
                h = hs[c]
                out[c0 + c - lo, s] = h
                taken[c, h] = True
                load[h] += 1
            if s == k - 1:
                break
            for c in range(n):  # the time after each head taken: drawn if not yet
                jb = jbs[c]
                nxt = tn[c, jb]
                late = np.isnan(nxt)
                # computed for every token and selected, no branch (xs[q] exists: at most s of
                # the k - 1 later times are drawn before step s)
                later = t[c, jb] + xs[q[c], c] / ms[c, jb]
                nxt = later if late else nxt
                q[c] += late
                if size <= k:
                    cnt[c, jb] += 1
                    if cnt[c, jb] >= size:
                        nxt = np.inf
                t[c, jb], tn[c, jb], hid[c, jb] = nxt, np.nan, -1
        for c in range(n):
            for s in range(k):
                taken[c, out[c0 + c - lo, s]] = False


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
