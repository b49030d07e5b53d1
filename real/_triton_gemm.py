"""Triton kernels of real/gemm.py (imported on first use: this module imports triton).

Kept at module level because Triton's CPU interpreter resolves ``tl`` and helper kernels through
the kernel's module globals, not a closure.
"""

import triton
import triton.language as tl


@triton.jit
def _tile(
    a, b, rm, rn, m_hi, N, K, sam, sak, sbn, sbk,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        at = tl.load(
            a + rm[:, None] * sam + kk[None, :] * sak,
            mask=(rm[:, None] < m_hi) & (kk[None, :] < K),
            other=0.0,
        )
        bt = tl.load(
            b + rn[None, :] * sbn + kk[:, None] * sbk,
            mask=(rn[None, :] < N) & (kk[:, None] < K),
            other=0.0,
        )
        acc = tl.dot(at, bt, acc)
    return acc


@triton.jit
def persistent_mm(
    a, b, c, M, N, K, sam, sak, sbn, sbk, scm, scn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)  # == the SM budget
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    for tile in range(pid, num_m * num_n, nprog):
        group = GM * num_n  # grouped order: neighbouring programs share A rows (L2)
        first = (tile // group) * GM
        gsz = tl.minimum(num_m - first, GM)
        pm = first + (tile % group) % gsz
        pn = (tile % group) // gsz
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        acc = _tile(a, b, rm, rn, M, N, K, sam, sak, sbn, sbk, BM, BN, BK)
        tl.store(
            c + rm[:, None] * scm + rn[None, :] * scn,
            acc.to(c.dtype.element_ty),
            mask=(rm[:, None] < M) & (rn[None, :] < N),
        )


@triton.jit
def grouped_masked_mm(
    a, b, c, counts, signal, E, M, N, K, sae, sam, sak, sbe, sbn, sbk, sce, scm, scn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SIGNAL: tl.constexpr,
):  # fmt: skip
    """With SIGNAL, SBO's down GEMM: after a program stored its tile of (expert e, row block
    pm) it adds 1 to ``signal[e * cdiv(M, BM) + pm]`` with release semantics (the tile's stores
    are visible to whoever acquires the count), so row block pm of expert e is complete when its
    count reaches cdiv(N, BN). Tiles past the expert's rows are skipped and never signalled."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    per_e = num_m * num_n
    for tile in range(pid, E * per_e, nprog):
        e = tile // per_e
        pm = (tile % per_e) // num_n
        pn = tile % num_n
        cnt = tl.load(counts + e).to(tl.int32)
        if pm * BM < cnt:  # tiles past this expert's rows are skipped (left unwritten)
            rm = pm * BM + tl.arange(0, BM)
            rn = pn * BN + tl.arange(0, BN)
            acc = _tile(a + e * sae, b + e * sbe, rm, rn, cnt, N, K, sam, sak, sbn, sbk, BM, BN, BK)
            tl.store(
                c + e * sce + rm[:, None] * scm + rn[None, :] * scn,
                acc.to(c.dtype.element_ty),
                mask=(rm[:, None] < cnt) & (rn[None, :] < N),
            )
            if SIGNAL:
                tl.atomic_add(signal + e * num_m + pm, 1, sem="release")


@triton.jit
def grouped_contig_mm(
    a, b, c, tile_e, tile_lo, tile_hi, MT, N, K, sam, sak, sbe, sbn, sbk, scm, scn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_n = tl.cdiv(N, BN)
    for tile in range(pid, MT * num_n, nprog):
        t = tile // num_n
        pn = tile % num_n
        e = tl.load(tile_e + t)
        lo = tl.load(tile_lo + t)
        hi = tl.load(tile_hi + t)
        rm = lo + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        acc = _tile(a, b + e * sbe, rm, rn, hi, N, K, sam, sak, sbn, sbk, BM, BN, BK)
        tl.store(
            c + rm[:, None] * scm + rn[None, :] * scn,
            acc.to(c.dtype.element_ty),
            mask=(rm[:, None] < hi) & (rn[None, :] < N),
        )
