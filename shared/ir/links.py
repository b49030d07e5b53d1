"""The link model of one collective, as one pure function both sides can call.

Why here: the simulator times a dispatch/combine by the flows its Program carries (bytes per
link kind, from ``shared.ir.ops.expected_bytes``), each flow taking ``bytes / bandwidth`` on the
rank's link plus the link's latency, links of different kinds in parallel (``sim.network`` with
``GPU.link_bytes_per_us`` / ``link_latency_us``: the preset's DeepEP-achievable bandwidth
where given). The single-GPU emulation of DeepEP (``real.comm.emulated``) must hold its SMs
until the same arrival time for the same bytes, or a validation compares two link models. This
module is that function (:func:`arrival_us`) and the byte counts a Program gives each of its
collectives (:func:`program_sends`), so the emulated backend is fed the simulator's numbers.

An uncontended flow in the simulator arrives exactly ``latency + bytes / bandwidth`` after it
leaves (one flow per link kind of a symmetric rank: nothing to share the link with); with
contention (several collectives in flight on one link) the simulator's max-min sharing is slower
and the emulation, one collective at a time, does not model it.

DeepEP's normal kernels move their bytes through channels, a pair of SMs each: on fewer SMs
than saturate a link their rate is the SMs' share of it (``shared.ir.deepep.deepep_normal_rate``),
so such a kernel lasts at least ``bytes / channel rate`` (:func:`channel_rates`,
:func:`channel_us`). The simulator holds a normal kernel that long (``sim.cost``); the emulated
backend holds its send kernel until the same time (``arrival_us`` given the channel rates):
at the 20 SMs of DeepEP's default ``Buffer`` a V1 kernel moves 20/24 of the link's rate.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from overlap_lab.shared.ir.issue import issue_order
from overlap_lab.shared.ir.program import Graph, Launch, Op, Program, Role

LINK_KINDS: tuple[str, ...] = ("nvlink", "rdma")


def arrival_us(
    nbytes: Mapping[str, float],
    bytes_per_us: Mapping[str, float],
    latency_us: Mapping[str, float],
    channel_bytes_per_us: Mapping[str, float] | None = None,
) -> float:
    """Time from send to the last byte's arrival: per link kind with bytes, ``latency +
    bytes / bandwidth``, and no less than ``bytes / channel rate`` where the sending kernel's
    channels bound it (``channel_bytes_per_us``, :func:`channel_rates`); kinds run in parallel
    (the max); 0 for no remote bytes (local copies stay in HBM)."""
    t = 0.0
    for kind in LINK_KINDS:
        b = float(nbytes.get(kind, 0.0))
        if b > 0:
            t = max(t, latency_us[kind] + b / bytes_per_us[kind])
    return max(t, channel_us(nbytes, channel_bytes_per_us or {}))


def channel_rates(bytes_per_us: Mapping[str, float], release: str, sms: int) -> dict[str, float]:
    """Per link kind, the rate (bytes per µs) DeepEP ``release``'s normal kernels on ``sms`` SMs
    move where their channels, not the link, bound it (``shared.ir.deepep``: the link's rate
    times ``sms`` over the release's saturating SMs); kinds the SMs saturate are left out, and
    so is everything for a kernel that holds no SMs (a completion marker)."""
    from overlap_lab.shared.ir.deepep import deepep_normal_fraction

    out: dict[str, float] = {}
    if sms <= 0:
        return out
    for kind in LINK_KINDS:
        f = deepep_normal_fraction(release, sms, kind)
        if f < 1.0:
            out[kind] = bytes_per_us[kind] * f
    return out


def channel_us(nbytes: Mapping[str, float], channel_bytes_per_us: Mapping[str, float]) -> float:
    """How long channels at ``channel_bytes_per_us`` (:func:`channel_rates`) need to move
    ``nbytes`` per link kind, kinds in parallel; 0 where no kind is channel-bound."""
    t = 0.0
    for kind, rate in channel_bytes_per_us.items():
        b = float(nbytes.get(kind, 0.0))
        if b > 0:
            t = max(t, b / rate)
    return t


def gpu_links(gpu) -> tuple[dict[str, float], dict[str, float]]:
    """(bytes per µs, latency µs) per link kind of a ``shared.inputs.hardware.GPU`` preset: the
    DeepEP-achievable bandwidth where the preset gives one, as the simulator uses."""
    return (
        {k: gpu.link_bytes_per_us(k, effective=True) for k in LINK_KINDS},
        {k: gpu.link_latency_us(k) for k in LINK_KINDS},
    )


@dataclass(frozen=True)
class Send:
    """One collective's send side as the Program states it: which, and its bytes per link."""

    key: str
    what: str  # "dispatch" or "combine"
    op: Op  # the op that issues it (the last piece of a split send)
    nbytes: dict[str, float]


def _parts(instrs: Iterable) -> Iterable[Op]:
    for ins in instrs:
        for part in ins.body if isinstance(ins, Graph) else (ins,):
            if isinstance(part, Launch):
                yield part.op


def program_sends(program: Program, rank: int | None = None) -> list[Send]:
    """The dispatch/combine sends of ``rank`` (the first rank by default) in issue order, each
    with the bytes its flows carry per link kind. Ops of one collective (SBO's combine pieces)
    are one send, placed where its last piece is issued: that is when the executor's backend
    is called."""
    rp = program.ranks[0] if rank is None else program.rank(rank)
    order: dict[str, int] = {}
    sends: dict[str, Send] = {}
    for i, op in enumerate(_parts(it.instr for it in issue_order(rp))):
        c = op.coll
        if c is None or c.role == Role.RECV or not op.name.startswith(("dispatch", "combine")):
            continue
        prev = sends.get(c.key)
        nb = dict(prev.nbytes) if prev else {k: 0.0 for k in LINK_KINDS}
        for f in c.flows:
            nb[str(f.link)] = nb.get(str(f.link), 0.0) + f.nbytes
        what = "dispatch" if op.name.startswith("dispatch") else "combine"
        sends[c.key] = Send(c.key, what, op, nb)
        order[c.key] = i
    return [sends[k] for k in sorted(sends, key=order.__getitem__)]
