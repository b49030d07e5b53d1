"""The cost model, in one place: a roofline with per-op-class efficiency.

A kernel granted ``s`` of the GPU's ``N`` SMs and ``B`` bytes/µs of HBM bandwidth runs for

    duration = max(flops / (peak(dtype) · eff_c(class) · s/N),     # compute roof, scaled by SMs
                   hbm_bytes / B,                                   # memory roof, at its share
                   gpu.kernel_min_us)                               # launch-to-finish floor

where ``B`` comes from sharing HBM among the kernels running at the same time (``hbm_shares``):
each kernel asks for the bandwidth that would make it exactly compute-bound, capped by what its
SMs can pull (a kernel on few SMs cannot saturate HBM: ``SATURATING_SM_FRACTION``), and the usable
bandwidth is split max-min fairly (water-filling). A kernel alone on the GPU thus gets the plain
roofline; two memory-bound kernels side by side each take about half the bandwidth.

Links (NVLink, RDMA, PCIe) are shared the same way among the flows crossing them; a flow arrives
``latency`` after its last byte leaves. Copies (D2H/H2D) are flows on the rank's PCIe link.

The efficiencies are assumptions of this model, not measurements: they are the typical fraction of
peak reached by well-tuned kernels of each class on Hopper (DeepGEMM reports ~1350-1550 of 1979
dense FP8 TFLOP/s on H800 for large GEMMs, i.e. ~0.7; FlashMLA ~660 TFLOP/s BF16 of 989 on H800,
~0.65, and ~3000 GB/s of 3350 when memory-bound, ~0.9). A calibration table measured on a GPU
replaces them: ``--profile`` (``sim.profile``; docs/architecture.md, "Costs"). Where a profile row applies,
:func:`demand` scales the roofline demand so that the kernel alone on its SMs takes exactly the
profiled duration, and sharing HBM with concurrent kernels still slows it as above; the SM scaling
of a profiled duration is :func:`scale_sms` (one function, to be replaced by a wave model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from overlap_lab.shared.hardware import GPU
from overlap_lab.shared.program import Op

if TYPE_CHECKING:
    from overlap_lab.sim.profile import Profile

# op_class -> (compute efficiency, memory efficiency)
EFFICIENCY: dict[str, tuple[float, float]] = {
    "gemm": (0.70, 0.85),  # DeepGEMM normal GEMMs (see module docstring)
    "grouped_gemm": (0.65, 0.80),  # DeepGEMM grouped contiguous / masked
    "attention": (0.60, 0.85),  # FlashMLA / FlashAttention-3
    "elementwise": (0.50, 0.80),  # norms, activations, residual adds (memory-bound)
    "sampling": (0.30, 0.50),  # top-k / sampling kernels: small, latency-dominated
    "comm": (0.50, 0.80),  # packing / unpacking inside DeepEP kernels
    "copy": (1.0, 1.0),
}
#: A kernel on this fraction of the SMs (or more) can pull the full HBM bandwidth.
SATURATING_SM_FRACTION = 1 / 3
#: Fraction of the peak HBM bandwidth that all kernels together can use.
HBM_USABLE = 0.90


def efficiency(op: Op) -> tuple[float, float]:
    return EFFICIENCY.get(op.op_class, EFFICIENCY["elementwise"])


def peak_flops_per_us(gpu: GPU, dtype: str) -> float:
    tflops = gpu.fp8_tflops if dtype == "fp8" else gpu.bf16_tflops
    return tflops * 1e6  # 1 TFLOP/s = 1e12 FLOP/s = 1e6 FLOP/µs


def hbm_bytes_per_us(gpu: GPU) -> float:
    return gpu.hbm_gbps * 1e3  # 1 GB/s = 1e9 B/s = 1e3 B/µs


def link_bytes_per_us(gpu: GPU, link: str) -> float:
    """What DeepEP-class kernels achieve on the link (the preset's effective figure if given)."""
    eff = getattr(gpu, f"{link}_eff_gbps", 0.0)
    return (eff or getattr(gpu, f"{link}_gbps")) * 1e3


def link_latency_us(gpu: GPU, link: str) -> float:
    return getattr(gpu, f"{link}_lat_us")


def compute_time_us(op: Op, gpu: GPU, sms: int) -> float:
    """Time at the compute roof on ``sms`` SMs (0 when the op does no arithmetic)."""
    if op.flops <= 0:
        return 0.0
    eff_c, _ = efficiency(op)
    return op.flops / (peak_flops_per_us(gpu, op.dtype) * eff_c * max(sms, 1) / gpu.num_sms)


def bandwidth_cap(op: Op, gpu: GPU, sms: int) -> float:
    """The most HBM bandwidth (B/µs) a kernel on ``sms`` SMs can pull."""
    _, eff_m = efficiency(op)
    frac = min(1.0, max(sms, 1) / (SATURATING_SM_FRACTION * gpu.num_sms))
    return hbm_bytes_per_us(gpu) * eff_m * frac


@dataclass(frozen=True)
class KernelDemand:
    """What one running kernel asks of HBM, given its SMs."""

    t_compute: float
    nbytes: float
    cap: float  # B/µs: the lesser of what its SMs can pull and what keeps it compute-bound
    fixed_us: float = 0.0  # time on top of the roofline, not shared (DeepEP LL receive)


def demand(op: Op, gpu: GPU, sms: int, profile: Profile | None = None) -> KernelDemand:
    """What ``op`` on ``sms`` SMs asks of the GPU: the roofline's, or (where ``profile`` has a
    row for it) the roofline's scaled to the profiled solo duration."""
    base = roofline_demand(op, gpu, sms)
    if profile is None:
        return base
    us = profiled_us(op, gpu, sms, profile)
    if us is None:
        return base
    solo = duration_us(base, hbm_shares([base], gpu)[0])
    if solo <= 0:
        return base
    f = us / solo
    return KernelDemand(base.t_compute * f, base.nbytes * f, base.cap, base.fixed_us * f)


def scale_sms(us: float, from_sms: int, to_sms: int, gpu: GPU) -> float:
    """A duration measured on ``from_sms`` SMs, carried to ``to_sms`` SMs: linear in 1/SMs
    (s/N), the assumption until the wave-quantisation model of SM sharing replaces it here."""
    return us * from_sms / max(to_sms, 1)


def profiled_us(op: Op, gpu: GPU, sms: int, profile: Profile) -> float | None:
    """Duration of ``op`` alone on ``sms`` SMs from the profile (None: no row applies).

    It never beats moving the op's HBM bytes at the usable peak (``HBM_USABLE`` × datasheet), a
    physical bound that matters where a class row's shape is not the op's: DeepGEMM's grouped
    rows (1-8 groups, compute-bound) read as a throughput for a decode expert GEMM over many
    groups with few rows each, which is bound by reading every group's weights."""
    m = profile.lookup(op, sms)
    if m is None:
        return None
    us = m.us if m.sms == sms else scale_sms(m.us, m.sms, sms, gpu)
    return max(us, op.hbm_bytes / (hbm_bytes_per_us(gpu) * HBM_USABLE))


def duration_source(op: Op, gpu: GPU, profile: Profile | None) -> str:
    """Where the duration of ``op`` comes from: ``profile``, ``roofline``, or ``link`` (comm
    kernels and copies, timed by the link model with the roofline for their local work)."""
    if op.kind != "compute":
        return "link"
    if profile is None:
        return "roofline"
    sms = op.sms if op.sms else gpu.num_sms
    return "profile" if profile.lookup(op, sms) is not None else "roofline"


def is_deepep_ll_recv(op: Op) -> bool:
    """DeepEP's low-latency receive hook: a recv half that holds SMs (the normal kernels'
    completion marker holds none; PP receives are NCCL's)."""
    return (
        op.kind == "comm"
        and op.coll is not None
        and op.coll.role == "recv"
        and bool(op.sms)
        and op.name in ("dispatch_b", "combine_b")
    )


def roofline_demand(op: Op, gpu: GPU, sms: int) -> KernelDemand:
    t_c = compute_time_us(op, gpu, sms)
    if op.flops > 0 or op.hbm_bytes > 0:
        t_c = max(t_c, gpu.kernel_min_us)
    cap = 0.0
    if op.hbm_bytes > 0:
        cap = bandwidth_cap(op, gpu, sms)
        if t_c > 0:
            cap = min(cap, op.hbm_bytes / t_c)
    fixed = gpu.deepep_ll_recv_us if is_deepep_ll_recv(op) else 0.0
    return KernelDemand(t_c, op.hbm_bytes, cap, fixed)


def water_fill(caps: list[float], total: float) -> list[float]:
    """Max-min fair split of ``total`` among demands capped at ``caps``."""
    alloc = [0.0] * len(caps)
    order = sorted(range(len(caps)), key=lambda i: caps[i])
    left, n = total, len(caps)
    for k, i in enumerate(order):
        share = left / (n - k)
        alloc[i] = min(caps[i], share)
        left -= alloc[i]
    return alloc


def hbm_shares(demands: list[KernelDemand], gpu: GPU) -> list[float]:
    return water_fill([d.cap for d in demands], hbm_bytes_per_us(gpu) * HBM_USABLE)


def duration_us(d: KernelDemand, share: float) -> float:
    """Duration of a kernel at a fixed HBM share (its rate is 1/duration of the whole kernel)."""
    if d.nbytes <= 0:
        return d.fixed_us + d.t_compute  # 0 for a pure wait (a hook or event marker, no work)
    return d.fixed_us + max(d.t_compute, d.nbytes / max(share, 1e-9))


def solo_duration_us(
    op: Op, gpu: GPU, sms: int | None = None, profile: Profile | None = None
) -> float:
    """Duration of ``op`` alone on the GPU with ``sms`` SMs (default: its limit or all)."""
    s = sms if sms is not None else (op.sms if op.sms else gpu.num_sms)
    d = demand(op, gpu, s, profile)
    return duration_us(d, hbm_shares([d], gpu)[0])
