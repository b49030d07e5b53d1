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

Everything here keys on what an op is (its kind, op class, dtype, work and collective role),
never on its name, so a new op of a known class is costed with no edit: DeepEP's kernels (class
``comm``, ``shared.ir.program.DEEPEP_CLASS``) carry DeepEP's rules (the low-latency receive's
fixed cost, the normal kernels' channels), NCCL's (class ``nccl``) only their bytes on the
links. Only a calibration profile's row measured for one op is found by its name (``sim.profile``).

The efficiencies are assumptions of this model, not measurements: they are the typical fraction of
peak reached by well-tuned kernels of each class on Hopper (DeepGEMM reports ~1350-1550 of 1979
dense FP8 TFLOP/s on H800 for large GEMMs, i.e. ~0.7; FlashMLA ~660 TFLOP/s BF16 of 989 on H800,
~0.65, and ~3000 GB/s of 3350 when memory-bound, ~0.9). A calibration table measured on a GPU
replaces them: ``--profile`` (``sim.profile``; docs/architecture.md, "Ops and their costs"). Where a profile row applies,
:func:`demand` scales the roofline demand so that the kernel alone on its SMs takes exactly the
profiled duration, and sharing HBM with concurrent kernels still slows it as above; on other SM
counts a profiled duration follows the wave model below (:func:`profile_factor`).

How kernels share the SMs (``sim.resources.Gpu``; docs/sm-sharing.md has the full account)
-----------------------------------------------------------------------------------------
A kernel is a grid of thread blocks (CTAs); ``grid`` below gives each op its CTA count, CTAs per
SM and kind:

- *persistent* (DeepGEMM, FlashAttention-3 / FlashMLA, which size the grid to the SMs they may use
  and loop over tiles inside each CTA): ``ctas = SMs allowed x ctas_per_sm``; each CTA does an
  equal share of the work and keeps its SM until it is done.
- *dynamic* (a persistent grid whose CTAs take tiles from a shared counter, FlashAttention-3's
  DynamicPersistentTileScheduler): CTAs that start late share what work is left, so the kernel
  ends when its resident CTAs run out of tiles together, and it holds its SMs to its end.
- *waved* (cuBLAS/Triton-style GEMMs, elementwise and reduction kernels): many CTAs, each a tile
  of the output; a CTA releases its SM when it finishes, so the kernel runs in waves of
  ``SMs x ctas_per_sm`` CTAs and its duration on ``s`` SMs is ``ceil(ctas / (s x ctas_per_sm))``
  waves, not a smooth ``1/s``.
- *coresident* (DeepEP's kernels: sender and receiver CTAs spin on each other): it starts only
  when all its CTAs fit; until then the SMs freed are kept for the first such kernel in
  precedence order (head-of-line), not handed to kernels behind it.

The block scheduler hands free SMs to pending CTAs of higher-priority streams first, then in
launch (issue) order (CUDA programming guide, "Stream Priorities": pending work in a
higher-priority stream is scheduled before pending work in lower-priority streams; it does not
preempt running blocks). A CTA runs to completion, so a waved kernel gives SMs to a kernel that
precedes it only at its wave boundaries; a persistent kernel holds its SMs to its end. What
dispatch order the hardware uses within one priority level is not documented: this model serves
kernels first come, first served (by the time each reached the GPU, then launch order), as the
measured GEMM-beside-GEMM pairs show (docs/sm-sharing.md): a concurrent kernel fills in behind the
last wave of the kernel that reached the GPU before it, and the two alternate.

Which kernels are persistent, their CTAs per SM and the work of one waved CTA are assumptions
named below (``PERSISTENT_CLASSES``, ``CTAS_PER_SM``, ``WAVED_CTA_FLOPS``, ``WAVED_CTA_BYTES``);
an op may state its own (``Op.grid``, ``Op.ctas``, ``Op.ctas_per_sm``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.ir.program import DEEPEP_CLASS, Op

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
    "nccl": (0.50, 0.80),  # NCCL's copies in and out of its buffers: assumed as DeepEP's
    "copy": (1.0, 1.0),
}
#: A kernel on this fraction of the SMs (or more) can pull the full HBM bandwidth.
SATURATING_SM_FRACTION = 1 / 3
#: Fraction of the peak HBM bandwidth that all kernels together can use.
HBM_USABLE = 0.90


def cost_key(op: Op) -> tuple:
    """Every field of ``op`` that :func:`grid` and :func:`demand` read (a profile's lookup
    included: name, for a row measured for the op itself, class, dtype, tokens, FLOPs; the
    roofline reads no name): two ops with the same key cost the same, so
    ``sim.resources.Gpu`` caches both under it (explicit ranks launch the same kernel once per
    rank; layers repeat). Leaves out what only places the op (layer, micro-batch, step, flows)."""
    c = op.coll
    return (
        op.name,
        op.kind,
        op.flops,
        op.hbm_bytes,
        op.dtype,
        op.op_class,
        op.sms,
        op.tokens,
        op.grid,
        op.ctas,
        op.ctas_per_sm,
        None if c is None else c.role,
    )


def efficiency(op: Op) -> tuple[float, float]:
    return EFFICIENCY.get(op.op_class, EFFICIENCY["elementwise"])


def compute_time_us(op: Op, gpu: GPU, sms: int) -> float:
    """Time at the compute roof on ``sms`` SMs (0 when the op does no arithmetic)."""
    if op.flops <= 0:
        return 0.0
    eff_c, _ = efficiency(op)
    return op.flops / (gpu.peak_flops_per_us(op.dtype) * eff_c * max(sms, 1) / gpu.num_sms)


def bandwidth_cap(op: Op, gpu: GPU, sms: int) -> float:
    """The most HBM bandwidth (B/µs) a kernel on ``sms`` SMs can pull."""
    _, eff_m = efficiency(op)
    frac = min(1.0, max(sms, 1) / (SATURATING_SM_FRACTION * gpu.num_sms))
    return gpu.hbm_bytes_per_us * eff_m * frac


@dataclass(frozen=True)
class KernelDemand:
    """What one running kernel asks of HBM, given its SMs.

    ``link_us`` and ``headroom`` describe a kernel whose SMs move its bytes with fine-grained,
    latency-bound copies (DeepEP's normal kernels: :func:`channel_time_us`): ``link_us`` is its
    traffic at the link's rate, ``headroom`` how many times the link's rate its SMs can copy
    when nothing else loads the memory system. Beside other kernels its copies slow by
    :func:`loaded_latency` of their HBM load, and where that exceeds the headroom the kernel
    runs slower than its link (:func:`loaded_t_compute`). 0: the kernel is not such a one."""

    t_compute: float
    nbytes: float
    cap: float  # B/µs: the lesser of what its SMs can pull and what keeps it compute-bound
    fixed_us: float = 0.0  # time on top of the roofline, not shared (DeepEP LL receive)
    link_us: float = 0.0
    headroom: float = 0.0


def demand(op: Op, gpu: GPU, sms: int, profile: Profile | None = None) -> KernelDemand:
    """What ``op`` on ``sms`` SMs asks of the GPU: the roofline's, or (where ``profile`` has a
    row for it) the roofline's scaled by :func:`profile_factor`."""
    base = roofline_demand(op, gpu, sms)
    f = profile_factor(op, gpu, sms, profile) if profile is not None else None
    if f is None:
        return base
    return KernelDemand(
        base.t_compute * f, base.nbytes * f, base.cap, base.fixed_us * f, base.link_us * f,
        base.headroom,
    )  # fmt: skip


def profile_factor(op: Op, gpu: GPU, sms: int, profile: Profile) -> float | None:
    """Measured over modelled: the profile row's duration (on the SMs it was measured on) over
    the roofline's duration of the op alone on those SMs, waves included (:func:`solo_duration_us`).

    Scaling the roofline's demand by this factor makes the op alone on the measured SMs take
    exactly the measured time, and carries it to other SM counts by the wave model (whole waves
    of the kernel's CTAs, ``sim.resources.Gpu``), not by a smooth s/N. The measured time never
    beats moving the op's HBM bytes at the usable peak (``HBM_USABLE`` × datasheet), a physical
    bound that matters where a class row's shape is not the op's: DeepGEMM's grouped rows (1-8
    groups, compute-bound) read as a throughput for a decode expert GEMM over many groups with
    few rows each, which is bound by reading every group's weights. None: no row applies."""
    m = profile.lookup(op, sms, gpu)
    if m is None:
        return None
    ref = solo_duration_us(op, gpu, m.sms)
    if ref <= 0:
        return None
    return max(m.us, op.hbm_bytes / (gpu.hbm_bytes_per_us * HBM_USABLE)) / ref


def profiled_us(op: Op, gpu: GPU, sms: int, profile: Profile) -> float | None:
    """Duration of ``op`` alone on ``sms`` SMs from the profile (None: no row applies): the
    measured time on the measured SMs, carried to others by the wave model."""
    m = profile.lookup(op, sms, gpu)
    if m is None:
        return None
    floor = op.hbm_bytes / (gpu.hbm_bytes_per_us * HBM_USABLE)
    if m.sms == sms:
        return max(m.us, floor)
    return profile_factor(op, gpu, sms, profile) * solo_duration_us(op, gpu, sms)


def duration_source(op: Op, gpu: GPU, profile: Profile | None) -> str:
    """Where the duration of ``op`` comes from: ``profile``, ``roofline``, or ``link`` (comm
    kernels and copies, timed by the link model with the roofline for their local work)."""
    if op.kind != "compute":
        return "link"
    if profile is None:
        return "roofline"
    sms = op.sms if op.sms else gpu.num_sms
    return "profile" if profile.lookup(op, sms, gpu) is not None else "roofline"


def is_deepep_ll_recv(op: Op) -> bool:
    """DeepEP's low-latency receive hook: a recv half of a DeepEP kernel that holds SMs (the
    normal kernels' completion marker holds none; NCCL's receives are of class ``nccl``)."""
    return (
        op.kind == "comm"
        and op.op_class == DEEPEP_CLASS
        and op.coll is not None
        and op.coll.role == "recv"
        and bool(op.sms)
    )


def channel_time_us(op: Op, gpu: GPU) -> float:
    """How long a DeepEP normal kernel's channels need to move its flows on the SMs it holds
    (``shared.ir.links.channel_us`` at ``channel_rates`` of the GPU's ``deepep_release``: the
    rule the emulated backend holds its send kernel by): the links' rate where
    it holds enough SMs, proportionally less below. A sendrecv kernel cannot finish before
    this (nor before its data arrives: ``sim.resources``), so with too few SMs its span outlasts
    the link time; with enough, the kernel's HBM traffic is paced at the link's rate over this
    time rather than asked for at once (docs/sm-sharing.md, "Communication beside
    computation"). 0 for every other op (NCCL's kernels included)."""
    return _channels(op, gpu)[0]


def _channels(op: Op, gpu: GPU) -> tuple[float, float, float]:
    """(channel time, link time, headroom) of a DeepEP normal kernel (:func:`channel_time_us`),
    set by its slowest link kind; (0, 0, 0) for every other op. The headroom is the SMs' copy
    rate over the link's (``sms / saturating SMs``, the release's proportional rule)."""
    c = op.coll
    deepep = op.kind == "comm" and op.op_class == DEEPEP_CLASS
    if not deepep or c is None or c.role != "sendrecv" or not op.sms:
        return 0.0, 0.0, 0.0
    from overlap_lab.shared.ir.deepep import deepep_normal_fraction
    from overlap_lab.shared.ir.links import channel_rates, channel_us, gpu_links

    per_link: dict[str, float] = {}
    for f in c.flows:
        per_link[str(f.link)] = per_link.get(str(f.link), 0.0) + f.nbytes
    rates = gpu_links(gpu)[0]
    channels = channel_rates(rates, gpu.deepep_release, op.sms)
    best = (0.0, 0.0, 0.0)
    for link, nbytes in per_link.items():
        t_link = nbytes / rates[link]
        t = max(t_link, channel_us({link: nbytes}, channels))
        # the fraction one SM reaches, times the SMs: uncapped (proportional below saturation)
        headroom = op.sms * deepep_normal_fraction(gpu.deepep_release, 1, link)
        if t > best[0]:
            best = (t, t_link, headroom)
    return best


#: How much slower a latency-bound copy runs as the GPU's HBM load rises: (load, slowdown)
#: pairs, the load as a fraction of the bandwidth all kernels can use. Measured on an H200
#: (2026-11-26, the project's interference probe: a Triton copy kernel, one 32-warp CTA per
#: SM, on 1 to 264 CTAs): one CTA copies 77.4 GB/s; as more CTAs load HBM, each copies less,
#: 71.9 GB/s at 575 GB/s in all, 62.2 at 1.49 TB/s, 47.6 at 3.04 TB/s, 29.2 at 3.85 TB/s of
#: the 3.91 TB/s the GPU reached. A CTA keeps a fixed number of loads in flight, so its rate
#: is the inverse of the memory latency, which rises with the load (docs/sm-sharing.md).
LOADED_LATENCY: tuple[tuple[float, float], ...] = (
    (0.0, 1.0),
    (0.147, 1.077),
    (0.273, 1.159),
    (0.382, 1.244),
    (0.480, 1.319),
    (0.650, 1.460),
    (0.778, 1.626),
    (0.894, 2.121),
    (0.984, 2.651),
)


def loaded_latency(load: float) -> float:
    """The copy slowdown at an HBM ``load`` (a fraction of the usable bandwidth), interpolated
    linearly in :data:`LOADED_LATENCY`; the last point beyond it."""
    pts = LOADED_LATENCY
    if load <= 0.0:
        return 1.0
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if load <= x1:
            return y0 + (y1 - y0) * (load - x0) / (x1 - x0)
    return pts[-1][1]


def loaded_t_compute(d: KernelDemand, slowdown: float) -> float:
    """``d``'s time beside other kernels whose HBM load slows its copies ``slowdown`` times: its
    channels copy at ``headroom / slowdown`` of the link's rate, so the kernel takes longer than
    its link only where that falls below 1 (a kernel with SMs to spare absorbs the first of
    it). ``d.t_compute`` for every other kernel."""
    if d.headroom <= 0.0 or slowdown <= 1.0:
        return d.t_compute
    return max(d.t_compute, d.link_us * slowdown / d.headroom)


def loaded_demands(
    demands: list[KernelDemand], shares: list[float], owners: list, usable: float
) -> list[KernelDemand]:
    """``demands`` (of running cohorts; ``owners[i]`` the kernel of cohort ``i``, ``shares`` their
    HBM shares) with each latency-bound copy kernel's time raised by what the other kernels' HBM
    load does to its copies (:func:`loaded_t_compute`): the load is the bandwidth they draw now,
    a fraction of ``usable``. The kernel's own draw is left out, so alone it runs as alone."""
    out = list(demands)
    for i, d in enumerate(demands):
        if not d.headroom:
            continue
        # (fsum: exactly rounded, so the cohorts' order cannot change the float)
        others = math.fsum(s for k, s in zip(owners, shares) if k is not owners[i])
        t = loaded_t_compute(d, loaded_latency(others / usable))
        if t > d.t_compute:
            out[i] = dataclasses.replace(d, t_compute=t)
    return out


def roofline_demand(op: Op, gpu: GPU, sms: int) -> KernelDemand:
    t_channel, t_link, headroom = _channels(op, gpu)
    t_c = max(compute_time_us(op, gpu, sms), t_channel)
    if op.flops > 0 or op.hbm_bytes > 0:
        t_c = max(t_c, gpu.kernel_min_us)
    cap = 0.0
    if op.hbm_bytes > 0:
        cap = bandwidth_cap(op, gpu, sms)
        if t_c > 0:
            cap = min(cap, op.hbm_bytes / t_c)
    fixed = gpu.deepep_ll_recv_us if is_deepep_ll_recv(op) else 0.0
    return KernelDemand(t_c, op.hbm_bytes, cap, fixed, t_link, headroom)


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
    return water_fill([d.cap for d in demands], gpu.hbm_bytes_per_us * HBM_USABLE)


def duration_us(d: KernelDemand, share: float) -> float:
    """Duration of a kernel at a fixed HBM share (its rate is 1/duration of the whole kernel)."""
    if d.nbytes <= 0:
        return d.fixed_us + d.t_compute  # 0 for a pure wait (a hook or event marker, no work)
    return d.fixed_us + max(d.t_compute, d.nbytes / max(share, 1e-9))


def solo_duration_us(
    op: Op, gpu: GPU, sms: int | None = None, profile: Profile | None = None
) -> float:
    """Duration of ``op`` alone on the GPU with ``sms`` SMs (default: its limit or all): whole
    waves of ``sms x ctas_per_sm`` CTAs, then a last partial wave on the SMs its CTAs need
    (what ``sim.resources.Gpu`` does for a kernel alone)."""
    s = sms if sms is not None else (op.sms if op.sms else gpu.num_sms)
    g = grid(op, s)

    def whole(n: int) -> float:
        d = demand(op, gpu, n, profile)
        return duration_us(d, hbm_shares([d], gpu)[0])

    if g.ctas == 0:
        return whole(s)
    slots = s * g.per_sm
    waves, rest = divmod(g.ctas, slots)
    t = waves * slots / g.ctas * whole(s) if waves else 0.0
    if rest:
        t += rest / g.ctas * whole(math.ceil(rest / g.per_sm))
    return t


# ----------------------------------------------------------------------------------------------
# Kernels as grids of thread blocks
# ----------------------------------------------------------------------------------------------

#: (op_class, dtype) pairs whose kernels are persistent; dtype None matches any. DeepGEMM's FP8
#: GEMMs (normal and grouped) launch ``num_sms`` persistent CTAs with a tile scheduler
#: (deep_gemm ``set_num_sms``); FlashAttention-3 and FlashMLA on Hopper size their grid to the SMs
#: the same way. BF16 GEMMs (the router GEMM through torch/cuBLAS) are waved.
PERSISTENT_CLASSES: frozenset[tuple[str, str | None]] = frozenset(
    {("gemm", "fp8"), ("grouped_gemm", "fp8"), ("attention", None)}
)
#: CTAs resident per SM by op class (assumption: tensor-core GEMM and attention tiles use most of
#: an SM's shared memory, one CTA each; elementwise kernels run 256-thread blocks, 8 per SM for
#: 2048 threads per SM on Hopper/Blackwell).
CTAS_PER_SM: dict[str, int] = {"elementwise": 8, "sampling": 8}
#: Work of one CTA of a waved matrix kernel: a 128 x 128 output tile over K = 7168 (DeepSeek-V3's
#: hidden size), 2 * 128 * 128 * 7168 FLOPs. An assumption standing in for the op's real shape.
WAVED_CTA_FLOPS: float = 2.0 * 128 * 128 * 7168
#: Least work per CTA a waved matrix kernel is cut to when its output tiles alone would not fill
#: the SMs it may use: cuBLAS and Triton pick smaller tiles or split K for skinny GEMMs (the
#: router GEMM: 2 output tiles of 128 x 128 at 128 tokens). A 64 x 64 tile over K = 512, or,
#: for a memory-bound GEMM, a 64 x 512 BF16 slice of the weights per CTA; assumptions.
WAVED_MIN_CTA_FLOPS: float = 2.0 * 64 * 64 * 512
WAVED_MIN_CTA_BYTES: float = 64.0 * 512 * 2
#: HBM bytes one CTA of a waved memory-bound kernel moves (assumption: 256 threads x 16 B).
WAVED_CTA_BYTES: float = 4096.0
_MATRIX_CLASSES = ("gemm", "grouped_gemm", "attention")


class Grid(NamedTuple):
    """A kernel's grid: ``kind`` (persistent, waved or coresident), CTAs and CTAs per SM (a
    NamedTuple: one is made per launched kernel, and it must be cheap)."""

    kind: str
    ctas: int
    per_sm: int

    @property
    def sms_needed(self) -> int:
        """SMs that hold every CTA at once."""
        return math.ceil(self.ctas / self.per_sm) if self.ctas else 0


def grid_kind(op: Op) -> str:
    """The op's own ``grid``, else: DeepEP communication kernels coresident, the persistent
    classes persistent, everything else waved."""
    if op.grid is not None:
        return op.grid
    if op.kind == "comm":
        return "coresident"
    if (op.op_class, op.dtype) in PERSISTENT_CLASSES or (op.op_class, None) in PERSISTENT_CLASSES:
        return "persistent"
    return "waved"


def grid(op: Op, limit: int) -> Grid:
    """The grid of ``op`` when it may use at most ``limit`` SMs (its ``Op.sms`` or the GPU)."""
    kind = grid_kind(op)
    per_sm = op.ctas_per_sm or (1 if kind == "coresident" else CTAS_PER_SM.get(op.op_class, 1))
    if limit <= 0:
        return Grid(kind, 0, per_sm)  # a hook: polls on the host side of the stream, no SMs
    if op.ctas is not None:
        ctas = op.ctas
    elif kind != "waved":  # persistent, dynamic, coresident: one CTA set sized to the SMs
        ctas = limit * per_sm
    elif op.op_class in _MATRIX_CLASSES:
        tiles = math.ceil(op.flops / WAVED_CTA_FLOPS)
        fill = max(op.flops / WAVED_MIN_CTA_FLOPS, op.hbm_bytes / WAVED_MIN_CTA_BYTES)
        ctas = max(tiles, min(limit, math.ceil(fill)))
    else:
        ctas = math.ceil(op.hbm_bytes / WAVED_CTA_BYTES)
    return Grid(kind, max(1, ctas), per_sm)


class RooflineCostModel:
    """The default ``sim.models.CostModel``: this module's roofline with per-class
    efficiencies, ``profile``'s measured rows where they apply (``demand``), and the grids
    above. Stateless but for the profile, so one instance may serve any number of runs."""

    __slots__ = ("profile",)

    def __init__(self, profile: Profile | None = None):
        self.profile = profile

    # the module's functions themselves (no method frame around them: ``key`` runs per launch)
    key = staticmethod(cost_key)
    grid = staticmethod(grid)

    def demand(self, op: Op, gpu: GPU, sms: int) -> KernelDemand:
        return demand(op, gpu, sms, self.profile)

    def hbm_bytes_per_us(self, gpu: GPU) -> float:
        return gpu.hbm_bytes_per_us * HBM_USABLE

    def link(self, gpu: GPU, kind: str) -> tuple[float, float]:
        return gpu.link_bytes_per_us(kind, effective=True), gpu.link_latency_us(kind)
