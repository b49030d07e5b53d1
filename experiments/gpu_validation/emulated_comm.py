"""The emulated backend's communication ops as the executor runs them, for the prediction.

DeepEP's kernels do their index math, gathers and unpacking inside the send and receive kernels
while the data is on the links. The executor's ``emulated`` backend (``real/comm/emulated.py``)
does that work as torch ops (the mirror data path) around its link kernels, which hold until
the modelled arrival counted from the op's start (``overlap_lab.device_time.LINK_KERNELS``).
Where the data path takes longer than the modelled flight, the run is longer than the link
model says: on the H200 (2026-11-27, decode 32, graph replay) a ``dispatch_a`` ran 46 kernels,
about 129 µs of device time with the gaps between them, where the simulator's low-latency send
takes 2 µs and the flight about 44 µs.

The loop predicts that run: each communication op's local work is its data path as the
calibration runs measured it (``device_time.local_work_us``, by op name and token count), and
:class:`EmulatedCommCost` charges it on top of the link model: a kernel takes
``max(link model's local work, data path + its own copy)``, without DeepEP's fixed receive
cost (the emulated receive kernel only spins until the arrival); its flows still leave at its start
and a receive still waits for them (``sim.engine``), so a data path shorter than the flight
stays hidden, as in the executor. The run's record says so (``predicted_comm``). The
simulator's own runs (``overlap-lab sim``) keep DeepEP's kernels, which have no such path.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Mapping

#: (op name, tokens) -> µs of local work
LocalWork = Mapping[tuple[str, int], float]


def is_deepep(op) -> bool:
    from overlap_lab.shared.ir.program import DEEPEP_CLASS

    return op.kind == "comm" and op.op_class == DEEPEP_CLASS


def local_work(runs: Iterable, gap_us: float = 0.0) -> dict[tuple[str, int], float]:
    """Per (DeepEP op name, tokens) the median local work of ``runs`` (``CalibrationRun``: a
    Program and its kernel records; runs without kernel records add nothing), each op timed
    by ``device_time.local_work_us`` (graph replays with ``gap_us``, else eager device time)."""
    from overlap_lab.device_time import local_work_us
    from overlap_lab.shared.ir.program import ops_of

    found: dict[tuple[str, int], list[float]] = {}
    for r in runs:
        if not r.kernels:
            continue
        ops = {(op.name, op.layer, op.mb): op for rank, op in ops_of(r.program)
               if rank == r.program.ranks[0].rank and is_deepep(op)}  # fmt: skip
        for oid, us in local_work_us(r.kernels, ops, gap_us).items():
            found.setdefault((oid[0], ops[oid].tokens), []).append(us)
    return {k: statistics.median(v) for k, v in sorted(found.items())}


def lookup(work: LocalWork, name: str, tokens: int) -> float | None:
    """The local work of op ``name`` at ``tokens``: measured at that token count, else at the
    nearest one measured (log scale; the calibration measures the case's size and its half,
    the sizes its schedules' micro-batches run). None: never measured."""
    sizes = [t for n, t in work if n == name]
    if not sizes:
        return None
    near = min(sizes, key=lambda t: (abs(math.log(max(t, 1) / max(tokens, 1))), -t))
    return work[(name, near)]


def rows(work: LocalWork) -> list[dict]:
    """``work`` as JSON rows for the case's record."""
    return [{"op": n, "tokens": t, "us": round(us, 3)} for (n, t), us in work.items()]


def from_rows(rs: Iterable[Mapping]) -> dict[tuple[str, int], float]:
    return {(str(r["op"]), int(r["tokens"])): float(r["us"]) for r in rs}


class EmulatedCommCost:
    """A ``sim.models.CostModel``: ``base`` for every op, and a DeepEP op with measured local
    work (:func:`local_work`) kept busy for at least that work plus its own copy (the module
    docstring). Keys on what ``base`` keys on (``sim.cost.cost_key``: the op's name and tokens
    among them), so the engine's cache stays right."""

    def __init__(self, base, work: LocalWork):
        self.base = base
        self.work = dict(work)

    def key(self, op):
        return self.base.key(op)

    def grid(self, op, limit: int):
        return self.base.grid(op, limit)

    def bandwidth_cap(self, *a, **kw):
        return self.base.bandwidth_cap(*a, **kw)

    def hbm_bytes_per_us(self, gpu) -> float:
        return self.base.hbm_bytes_per_us(gpu)

    def link(self, gpu, kind: str):
        return self.base.link(gpu, kind)

    def demand(self, op, gpu, sms: int):
        from overlap_lab.sim.cost import compute_time_us

        d = self.base.demand(op, gpu, sms)
        us = lookup(self.work, op.name, op.tokens) if is_deepep(op) else None
        if not us:
            return d
        # the data path replaces DeepEP's fixed receive cost: the emulated receive kernel only
        # spins until the arrival, its unpacking is the data path
        return dataclasses.replace(
            d, t_compute=max(d.t_compute, us + compute_time_us(op, gpu, max(sms, 1))), fixed_us=0.0
        )


def as_executed(op, work: LocalWork, num_sms: int):
    """``op`` as the emulated backend runs it: a DeepEP receive that holds no SMs in the
    Program (the normal kernels' completion marker) but whose data path ran kernels in the
    calibration (the combine's unpacking: 1.9 ms per prefill-4096 layer on the H200) runs
    them on the device's SMs, as a waved grid; other ops are returned as they are."""
    if not is_deepep(op) or op.sms or not lookup(work, op.name, op.tokens):
        return op
    return dataclasses.replace(op, sms=None, grid="waved", ctas=num_sms)
