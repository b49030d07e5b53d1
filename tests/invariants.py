"""Invariants every simulated Trace must satisfy; shared by the simulator and schedule tests."""

from __future__ import annotations

from collections import defaultdict

from overlap_lab.shared.ir.program import Graph, Launch, Program, Record, Wait, WaitStream
from overlap_lab.shared.ir.validate import issue_order
from overlap_lab.shared.outputs.trace import Trace
from overlap_lab.sim.cost import solo_duration_us

EPS = 1e-6


def kernels_on(trace: Trace, rank: int, lane: str) -> list[tuple[str, float, float]]:
    """(op, start, end) per kernel on a lane, joining the SM-grant segments of one kernel."""
    out: list[tuple] = []
    spans = sorted(
        (s for s in trace.spans if s.rank == rank and s.lane == lane),
        key=lambda s: (s.start, s.end),
    )
    for s in spans:
        # a kernel whose SM grant changed appears as contiguous segments with different sms
        key = (s.op, s.mb, s.layer, s.step)
        if (
            out
            and out[-1][0] == key
            and abs(out[-1][2] - s.start) < EPS
            and out[-1][3] != s.sms
            and s.end > s.start > out[-1][1]
        ):
            out[-1] = (key, out[-1][1], s.end, s.sms)
        else:
            out.append((key, s.start, s.end, s.sms))
    return [(k[0], a, b) for k, a, b, _ in out]


def no_stream_overlap(trace: Trace) -> None:
    """A stream runs one op at a time."""
    for rank in trace.ranks:
        for lane in trace.lanes(rank):
            if lane.startswith("stream:"):
                ks = kernels_on(trace, rank, lane)
                for (a, _, e), (b, s, _) in zip(ks, ks[1:]):
                    assert s >= e - EPS, f"rank {rank} {lane}: {b} starts before {a} ends"


def sm_never_above(trace: Trace, num_sms: int) -> None:
    """At every instant the SMs held on a rank sum to at most the GPU's."""
    for rank in trace.ranks:
        points = []
        for s in trace.spans:
            if s.rank == rank and s.lane.startswith("stream:") and s.end > s.start:
                points += [(s.start, s.sms), (s.end, -s.sms)]
        points.sort(key=lambda p: (p[0], p[1]))  # releases before grants at equal times
        used = 0
        for t, d in points:
            used += d
            assert used <= num_sms, f"rank {rank}: {used} SMs in use at t={t}"


def waits_respected(program: Program, trace: Trace) -> None:
    """An op issued to a stream after ``wait(stream, E)`` starts no earlier than E fired, where
    E fires when the last op issued to the recording stream before the record has finished."""
    for rp in program.ranks:
        issued = defaultdict(list)
        for it in issue_order(rp):
            for ins in it.instr.body if isinstance(it.instr, Graph) else (it.instr,):
                if isinstance(ins, (Launch, Record, Wait)):
                    issued[ins.stream].append(ins)
        timed = {}  # stream -> list of (instr, start, end) for launches
        fired: dict[str, float] = {}
        for stream, items in issued.items():
            ks = iter(kernels_on(trace, rp.rank, f"stream:{stream}"))
            last = 0.0
            rows = []
            for ins in items:
                if isinstance(ins, Launch):
                    name, start, end = next(ks)
                    assert name == ins.op.name, f"{stream}: expected {ins.op.name}, ran {name}"
                    rows.append((ins, start, end))
                    last = end
                elif isinstance(ins, Record):
                    fired[ins.event] = last
                else:
                    rows.append((ins, None, None))
            timed[stream] = rows
        for stream, rows in timed.items():
            floor = 0.0
            for ins, start, _ in rows:
                if isinstance(ins, Wait):
                    floor = max(floor, fired[ins.event])
                else:
                    assert start >= floor - EPS, f"{ins.op.name} on {stream} ran before its wait"


def check_all(program: Program, trace: Trace, num_sms: int) -> None:
    no_stream_overlap(trace)
    sm_never_above(trace, num_sms)
    waits_respected(program, trace)


def _solo(op, gpu) -> float:
    """What a kernel takes alone on its SMs (0 for what no SM runs: copies, hooks)."""
    if op.kind == "copy" or op.sms == 0 or not (op.flops or op.hbm_bytes):
        return 0.0
    return solo_duration_us(op, gpu)


def never_faster_than_alone(program: Program, trace: Trace, gpu) -> None:
    """Every kernel runs, from its first SMs to its end, at least as long as it takes alone."""
    for rp in program.ranks:
        by_stream = defaultdict(list)
        for it in issue_order(rp):
            for ins in it.instr.body if isinstance(it.instr, Graph) else (it.instr,):
                if isinstance(ins, Launch):
                    by_stream[ins.stream].append(ins.op)
        for stream, ops in by_stream.items():
            ran = kernels_on(trace, rp.rank, f"stream:{stream}")
            for op, (name, start, end) in zip(ops, ran):
                assert name == op.name, (stream, name, op.name)
                solo = _solo(op, gpu)
                assert end - start >= solo * (1 - 1e-9) - EPS, (
                    f"rank {rp.rank} {stream}: {op.name} took {end - start} µs, alone {solo} µs"
                )


def critical_path_us(program: Program, gpu) -> float:
    """A lower bound of the step time: the longest chain of kernels alone (``_solo``) through
    stream order, event waits, signals and received data, ignoring host, launch and network
    latency and sharing (they can only add). A receiving op ends no earlier than the last flow
    of its key to its rank could arrive, each flow alone on its link from its op's start; a
    flow nobody receives ends no op (its bytes land in the peer's memory, as an NVLink store or
    an RDMA write does, without a kernel there waiting). Waits whose record is issued later by
    another thread, and data sent later by another rank, are resolved by repeating the pass
    until the times settle (the Program is acyclic)."""
    fired: dict[tuple[int, str], float] = {}
    arrival: dict[tuple[str, int], float] = {}
    for _ in range(1000):
        before, arrived = dict(fired), dict(arrival)
        longest = 0.0
        for rp in program.ranks:
            ready: dict[str, float] = defaultdict(float)
            for it in issue_order(rp):
                for ins in it.instr.body if isinstance(it.instr, Graph) else (it.instr,):
                    if isinstance(ins, Launch):
                        op = ins.op
                        start = ready[ins.stream]
                        end = start + _solo(op, gpu)
                        for ev in op.waits:
                            end = max(end, fired.get((rp.rank, ev), 0.0))
                        c = op.coll
                        if c is not None and c.role != "send":
                            end = max(end, arrived.get((c.key, rp.rank), 0.0))
                        if c is not None and c.role != "recv":
                            parts = max(1, len(op.waits))  # each part leaves on its signal
                            for f in c.flows:
                                at = (c.key, rp.rank if f.dst is None else f.dst)
                                alone = f.nbytes / parts / gpu.link_bytes_per_us(f.link, True)
                                arrival[at] = max(arrival.get(at, 0.0), start + alone)
                        ready[ins.stream] = end
                        longest = max(longest, end)
                    elif isinstance(ins, Record):
                        fired[(rp.rank, ins.event)] = ready[ins.stream]
                    elif isinstance(ins, Wait):
                        t = fired.get((rp.rank, ins.event), 0.0)
                        ready[ins.stream] = max(ready[ins.stream], t)
                    elif isinstance(ins, WaitStream):
                        ready[ins.stream] = max(ready[ins.stream], ready[ins.other])
        if fired == before and arrival == arrived:
            return longest
    return longest
