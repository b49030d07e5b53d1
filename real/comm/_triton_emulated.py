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
def send_kernel(
    src, dst, stats, t_arrive, nv_lat_ns, nv_ns_per_byte, rd_lat_ns, rd_ns_per_byte,
    SPIN: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Move this rank's remote bytes through HBM and stamp the modelled arrival time; with SPIN,
    hold the SMs until then. ``stats`` = [local, nvlink, rdma, messages] bytes on the device
    (no host sync); delay = max over links of α + bytes/β (LinkParams.arrival_us)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    t0 = _now()
    nv = tl.load(stats + 1)
    rd = tl.load(stats + 2)
    d_nv = tl.where(nv > 0, nv_lat_ns + nv.to(tl.float32) * nv_ns_per_byte, 0.0)
    d_rd = tl.where(rd > 0, rd_lat_ns + rd.to(tl.float32) * rd_ns_per_byte, 0.0)
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
