"""Triton kernels of the emulated backend (imported on first use: this module imports triton).

Module level, not a closure, so helper kernels and ``tl`` resolve the same way for the compiler
and for Triton's CPU interpreter (which cannot run ``%globaltimer`` anyway: GPU only).
"""

import triton
import triton.language as tl


@triton.jit
def _now():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def stamp_kernel(t_start):
    """The op's start time (before its data path), for the send kernel to count from."""
    tl.store(t_start, _now())


@triton.jit
def send_kernel(
    src, dst, stats, t_arrive, nv_lat_ns, nv_ns_per_byte, rd_lat_ns, rd_ns_per_byte,
    nv_chan_ns_per_byte, rd_chan_ns_per_byte, t_start,
    SPIN: tl.constexpr, BLOCK: tl.constexpr, HAS_START: tl.constexpr,
):  # fmt: skip
    """Move this rank's remote bytes through HBM and stamp the modelled arrival time; with SPIN,
    hold the SMs until then. ``stats`` = [local, nvlink, rdma, messages] bytes on the device
    (no host sync); delay = max over links of α + bytes/β and of bytes / channel rate (0 ns per
    byte: no channel bound) (LinkParams.arrival_us), counted from ``t_start`` (the op's start,
    stamped before its data path) with HAS_START, else from now."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if HAS_START:
        t0 = tl.load(t_start)
    else:
        t0 = _now()
    nv = tl.load(stats + 1)
    rd = tl.load(stats + 2)
    d_nv = tl.where(nv > 0, nv_lat_ns + nv.to(tl.float32) * nv_ns_per_byte, 0.0)
    d_rd = tl.where(rd > 0, rd_lat_ns + rd.to(tl.float32) * rd_ns_per_byte, 0.0)
    d_nv = tl.maximum(d_nv, nv.to(tl.float32) * nv_chan_ns_per_byte)
    d_rd = tl.maximum(d_rd, rd.to(tl.float32) * rd_chan_ns_per_byte)
    delay = tl.maximum(d_nv, d_rd).to(tl.int64)
    n_words = (nv + rd) // 4
    if pid == 0:
        tl.store(t_arrive, t0 + delay)
    for off in range(pid * BLOCK, n_words, nprog * BLOCK):
        idx = off + tl.arange(0, BLOCK)
        m = idx < n_words
        tl.store(dst + idx, tl.load(src + idx, mask=m), mask=m)
    if SPIN:
        while _now() < t0 + delay:
            pass


@triton.jit
def recv_kernel(t_arrive, unset, limit_ns):
    # the send kernel may run on another stream: wait for its stamp, then for the arrival.
    # Never longer than limit_ns for the stamp: a send that cannot run (its SMs all held by
    # spinning receivers) must not hang the device; a step that long shows in the timings.
    t0 = _now()
    t = tl.load(t_arrive, volatile=True)
    while (t == unset) & (_now() - t0 < limit_ns):
        t = tl.load(t_arrive, volatile=True)
    end = tl.where(t == unset, t0, t)
    while _now() < end:
        pass


@triton.jit
def sbo_combine_kernel(
    src, dst, counts, signal, stale, E, M, H, threshold, max_spins, sse, ssm, dse, dsm,
    BM: tl.constexpr, BH: tl.constexpr,
):  # fmt: skip
    """SBO mode 1's combine send, resident on ``num_sms`` CTAs (the grid) beside the down GEMM:
    each CTA takes the (expert e, row block b) items pid, pid + grid, ... in order; for a block
    with rows it spins on ``signal[e, b] >= threshold`` (acquire loads: the GEMM's release adds
    make its tile stores visible) and then sends the block (copies rows [b*BM, min(count,
    (b+1)*BM)) of ``src[e]`` to ``dst[e]``). Blocks past an expert's count are never signalled
    and are skipped, as DeepEP walks ``packed_recv_count``. A block whose signal has not arrived
    after ``max_spins`` polls is sent anyway and counted in ``stale`` (no hang; never silent)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_m = tl.cdiv(M, BM)
    for item in range(pid, E * num_m, nprog):
        e = item // num_m
        b = item % num_m
        cnt = tl.load(counts + e).to(tl.int32)
        if b * BM < cnt:
            s = tl.atomic_add(signal + item, 0, sem="acquire")
            spins = 0
            while (s < threshold) & (spins < max_spins):
                s = tl.atomic_add(signal + item, 0, sem="acquire")
                spins += 1
            if s < threshold:
                tl.atomic_add(stale, 1)
            rows = b * BM + tl.arange(0, BM)
            for h0 in range(0, H, BH):
                cols = h0 + tl.arange(0, BH)
                m = (rows[:, None] < cnt) & (cols[None, :] < H)
                v = tl.load(src + e * sse + rows[:, None] * ssm + cols[None, :], mask=m)
                tl.store(dst + e * dse + rows[:, None] * dsm + cols[None, :], v, mask=m)
