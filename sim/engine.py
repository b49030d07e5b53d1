"""The SimPy interpreter: host threads issue, streams run FIFO, kernels share SMs, HBM and links.

Per rank:
- one host process walks the rank's instructions in issue order (``shared.validate.issue_order``:
  one host thread runs at a time and hands over at ``Yield``), paying the launch cost per kernel
  (one graph-launch cost per ``Graph``), host time per ``Host`` and blocking at ``Sync``; its spans
  land on the lane of the thread that issued them;
- one process per stream takes instructions in FIFO order: a launch runs once it holds its SMs;
  a record fires its event; a wait holds the stream until the event has fired;
- a ``sim.resources.Gpu`` (SMs and HBM) and one ``sim.resources.Link`` per link kind (its
  egress, used by symmetric flows and PCIe copies).

Across ranks, flows with an explicit destination go through one ``sim.network.Network``: each
crosses its source's egress and its destination's ingress port of its link kind, shared max-min
fairly; an op's flows form one bundle, drawn as one span per link kind on the sender's link lane.

Collectives: a send (or sendrecv) op starts its flows when it starts; a recv op makes no progress
until every flow of its key addressed to its rank has arrived, then does its own work (DeepEP's
receive hook spins on its SMs until the data is there); a sendrecv op (DeepEP's normal kernels)
works from its start but cannot finish before its data has arrived. In a symmetric program a flow
with ``dst=None`` returns to its sender, standing for the identical flow of the mirror peer.

Nothing here is random: the same Program and GPU give the same Trace (routing noise and load
imbalance are drawn, seeded, when the Program is built: ``shared.routing``, ``shared.ranks``;
``seed`` is recorded in the trace).
"""

from __future__ import annotations

import dataclasses
import heapq
import random
from collections import defaultdict

import simpy

from overlap_lab.shared.hardware import GPU
from overlap_lab.shared.program import (
    Graph,
    Host,
    Launch,
    Op,
    Program,
    RankProgram,
    Record,
    Sync,
    Wait,
    WaitStream,
    Yield,
)
from overlap_lab.shared.trace import Span, Trace
from overlap_lab.shared.validate import issue_order, validate
from overlap_lab.sim import cost
from overlap_lab.sim.budget import default_max_events, run_budgeted
from overlap_lab.sim.network import Network
from overlap_lab.sim.resources import Gpu, Kernel, Link

#: Link kinds carried by the network model (per-rank egress and ingress ports); PCIe copies stay
#: on each rank's own ``Link``.
NET_KINDS = ("nvlink", "rdma")
_SINK_BITS = 24


def _span_key(s: Span) -> tuple:
    return (
        s.rank,
        s.lane,
        s.start,
        s.end,
        s.op,
        s.sms,
        -1 if s.mb is None else s.mb,
        -1 if s.layer is None else s.layer,
        -1 if s.step is None else s.step,
    )


class TieShuffledEnvironment(simpy.Environment):
    """A SimPy environment that processes events of the same time and SimPy priority in a seeded
    random order (and runs each event's callbacks in a seeded random order). The simulator's
    result must not depend on that order; tests run Programs under it to prove so."""

    def __init__(self, seed: int):
        super().__init__()
        self._rng = random.Random(seed)

    def schedule(self, event, priority=simpy.core.NORMAL, delay=0) -> None:
        key = (self._rng.random(), next(self._eid))
        heapq.heappush(self._queue, (self._now + delay, priority, key, event))

    def step(self) -> None:
        if self._queue:
            event = self._queue[0][3]
            if event.callbacks and len(event.callbacks) > 1:
                self._rng.shuffle(event.callbacks)
        super().step()


class SimulationStalled(RuntimeError):
    """Resource contention stopped every process before the Program finished."""


class _Rank:
    def __init__(self, engine: Engine, rp: RankProgram):
        env, gpu = engine.env, engine.gpu
        self.rp = rp
        self.gpu = Gpu(env, gpu, engine.profile)
        self.links = {  # one rank's egress per link kind: symmetric flows and PCIe copies
            k: Link(env, cost.link_bytes_per_us(gpu, k), cost.link_latency_us(gpu, k))
            for k in ("nvlink", "rdma", "pcie")
        }
        self.events: dict[str, simpy.Event] = defaultdict(env.event)
        self.queues = {s: simpy.Store(env) for s in rp.streams}
        self.busy: dict[str, str] = {}  # stream -> what it is doing now (for stall reports)
        self.host_at = "not started"
        self.issued = 0  # launch sequence numbers: pending CTAs of equal priority go in this order


class Engine:
    def __init__(
        self,
        program: Program,
        gpu: GPU,
        seed: int = 0,
        net_group_tol: float = 0.0,
        profile=None,
        max_events: int | None = None,
        tie_seed: int | None = None,
    ):
        self.program, self.gpu, self.seed = program, gpu, seed
        self.profile = profile  # sim.profile.Profile or None (the roofline alone)
        self.max_events = max_events or default_max_events(program)  # sim.budget
        self.env = simpy.Environment() if tie_seed is None else TieShuffledEnvironment(tie_seed)
        self.spans: list[Span] = []
        self.ranks = {rp.rank: _Rank(self, rp) for rp in program.ranks}
        self._expected: dict[tuple[str, int], int] = defaultdict(int)
        self._arrived: dict[tuple[str, int], simpy.Event] = defaultdict(self.env.event)
        for rp in program.ranks:
            for it in issue_order(rp):
                for ins in it.instr.body if isinstance(it.instr, Graph) else (it.instr,):
                    if isinstance(ins, Launch) and ins.op.coll and ins.op.coll.role != "recv":
                        for f in ins.op.coll.flows:
                            dst = rp.rank if f.dst is None else f.dst
                            # a kernel polling signals sends one part per signal
                            self._expected[(ins.op.coll.key, dst)] += max(1, len(ins.op.waits))
        self._implicit = 0
        kinds = {
            k: (cost.link_bytes_per_us(gpu, k), cost.link_latency_us(gpu, k)) for k in NET_KINDS
        }
        self.net = Network(self.env, max(self.ranks) + 1, kinds, self._net_done, net_group_tol)
        self._sinks: dict[tuple[str, int], int] = {}
        self._sink_keys: list[tuple[str, int]] = []
        self._bundles: list[list] = []  # [rank, op, t0, {kind: flows left}]

    # -- processes -----------------------------------------------------------------------------

    def run(self) -> Trace:
        for r in self.ranks.values():
            self.env.process(self._host(r))
            for s, q in r.queues.items():
                self.env.process(self._stream(r, s, q))
        run_budgeted(self.env, self.max_events)
        self._check_finished()
        meta = dict(self.program.meta)
        meta.update(
            gpu=self.gpu.name,
            num_sms=self.gpu.num_sms,
            world=self.program.world,
            symmetric=self.program.symmetric,
            backend="sim",
            seed=self.seed,
        )
        if self.profile is not None:
            meta["profile"] = self.profile.name
        # spans in a canonical order: the order events were processed in is no part of the
        # result. Within a stream or host lane spans are appended in program order already; the
        # key breaks the remaining ties (links, spans of one instant) without comparing None.
        spans = sorted(self.spans, key=_span_key)
        return Trace(tuple(spans), meta)

    def _host(self, r: _Rank):
        env, rank = self.env, r.rp.rank
        launch_open: dict[str, int] = {}  # lane -> index of its last launch span
        for it in issue_order(r.rp):
            ins, lane = it.instr, f"host:{it.thread}"
            r.host_at = f"thread {it.thread} instruction {it.index}"
            if isinstance(ins, (Launch, Graph)):
                t0 = env.now
                yield env.timeout(
                    self.gpu.graph_launch_us if isinstance(ins, Graph) else self.gpu.launch_us
                )
                i = launch_open.get(lane)
                if i is not None and self.spans[i].end == t0:  # extend a run of launches
                    self.spans[i] = Span(rank, lane, "launch", "host", self.spans[i].start, env.now)
                else:
                    launch_open[lane] = len(self.spans)
                    self.spans.append(Span(rank, lane, "launch", "host", t0, env.now))
                for part in ins.body if isinstance(ins, Graph) else (ins,):
                    self._enqueue(r, part)
            elif isinstance(ins, (Record, Wait, WaitStream)):
                self._enqueue(r, ins)
            elif isinstance(ins, Host):
                t0 = env.now
                yield env.timeout(ins.us)
                self.spans.append(
                    Span(rank, lane, ins.name, "host", t0, env.now, 0, ins.mb, ins.layer, ins.step)
                )
            elif isinstance(ins, Sync):
                t0, ev = env.now, r.events[ins.event]
                if not ev.processed:
                    yield ev
                if env.now > t0:
                    self.spans.append(Span(rank, lane, f"sync {ins.event}", "sync", t0, env.now))
            elif isinstance(ins, Yield):
                pass  # issue_order already hands control to the next thread
        r.host_at = "done"

    def _enqueue(self, r: _Rank, ins) -> None:
        """Hand ``ins`` to its stream with its launch (issue) sequence number on the rank."""
        r.issued += 1
        if isinstance(ins, WaitStream):
            self._implicit += 1
            ev = f"__wait_stream_{self._implicit}"
            r.queues[ins.other].put((r.issued, Record(ev, ins.other)))
            r.queues[ins.stream].put((r.issued, Wait(ins.stream, ev)))
        else:
            r.queues[ins.stream].put((r.issued, ins))

    def _stream(self, r: _Rank, name: str, q: simpy.Store):
        while True:
            seq, ins = yield q.get()
            if isinstance(ins, Record):
                r.events[ins.event].succeed()
            elif isinstance(ins, Wait):
                ev = r.events[ins.event]
                if not ev.processed:
                    r.busy[name] = f"waiting for event {ins.event!r}"
                    yield ev
            else:
                r.busy[name] = f"running {ins.op.name} (layer {ins.op.layer}, mb {ins.op.mb})"
                yield from self._run_op(r, name, ins.op, seq)
            r.busy.pop(name, None)

    # -- one op --------------------------------------------------------------------------------

    def _run_op(self, r: _Rank, stream: str, op: Op, seq: int):
        env, rank, lane = self.env, r.rp.rank, f"stream:{stream}"
        if op.kind == "copy":
            t0 = env.now
            yield r.links["pcie"].send(op.hbm_bytes)
            self.spans.append(
                Span(rank, lane, op.name, "copy", t0, env.now, 0, op.mb, op.layer, op.step)
            )
            return
        limit = self.gpu.num_sms if op.sms is None else op.sms
        k = Kernel(op, limit, env.event(), r.rp.priority(stream), seq)
        k.on_grant = lambda: self._begin(r, k)
        r.gpu.acquire(k)
        yield k.done
        segs = k.segments + [(env.now, 0)]
        for (t0, sms), (t1, _) in zip(segs, segs[1:]):
            if t1 > t0 or len(segs) == 2:
                self.spans.append(
                    Span(rank, lane, op.name, op.kind, t0, t1, sms, op.mb, op.layer, op.step)
                )

    def _begin(self, r: _Rank, k: Kernel) -> None:
        """The kernel holds its first SMs: its sends leave, its receive waits for arrival, its
        signals are watched, and it runs (called by the block scheduler's pass)."""
        op, rank = k.op, r.rp.rank
        c = op.coll
        parts = max(1, len(op.waits))
        if c is not None and c.role != "recv" and c.flows:
            flows = c.flows
            if parts > 1:  # part i of the traffic leaves once signal i has fired
                flows = tuple(dataclasses.replace(f, nbytes=f.nbytes / parts) for f in flows)

            def send(_e=None, r=r, op=op, flows=flows):
                if any(f.dst is not None for f in flows):
                    self._start_flows(r, op, flows)
                else:
                    for f in flows:
                        self._start_flow(r, op, f)

            if parts == 1:
                send()
            else:
                for ev in op.waits:
                    e = r.events[ev]
                    if e.processed:
                        send()
                    else:
                        e.callbacks.append(send)
        if c is not None and c.role != "send":
            arrived = self._arrival(c.key, rank)
            if not arrived.processed:
                if c.role == "recv":
                    k.waiting_data = True
                else:
                    k.gated = True
                arrived.callbacks.append(lambda _e: r.gpu.data_arrived(k))
        for ev in op.waits:  # signals the kernel polls while it runs
            e = r.events[ev]
            if e.processed:
                k.fired += 1
            else:
                e.callbacks.append(lambda _e: r.gpu.signal(k))
        r.gpu.start(k)

    def _arrival(self, key: str, rank: int) -> simpy.Event:
        ev = self._arrived[(key, rank)]
        if self._expected.get((key, rank), 0) == 0 and not ev.triggered:
            ev.succeed()
        return ev

    def _start_flow(self, r: _Rank, op: Op, f) -> None:
        """A symmetric flow (to the mirror peer): it only shares its rank's egress link, as every
        rank's ingress carries the same load as its egress."""
        env, t0 = self.env, self.env.now
        key = (op.coll.key, r.rp.rank)
        done = r.links[f.link].send(f.nbytes)

        def arrived(_e, rank=r.rp.rank):
            self.spans.append(
                Span(
                    rank,
                    f"link:{f.link}",
                    op.name,
                    "link",
                    t0,
                    env.now,
                    0,
                    op.mb,
                    op.layer,
                    op.step,
                )
            )
            self._expected[key] -= 1
            if self._expected[key] == 0:
                self._arrived[key].succeed()

        done.callbacks.append(arrived)

    def _start_flows(self, r: _Rank, op: Op, flows) -> None:
        """Hand the op's flows to the network as one bundle (one link span per kind)."""
        src, key = r.rp.rank, op.coll.key
        dsts, kinds, nbytes, tags, left = [], [], [], [], {}
        b = len(self._bundles)
        for f in flows:
            dst = src if f.dst is None else f.dst
            sk = (key, dst)
            sink = self._sinks.get(sk)
            if sink is None:
                sink = self._sinks[sk] = len(self._sink_keys)
                self._sink_keys.append(sk)
            k = self.net.kind_index[f.link]
            dsts.append(dst)
            kinds.append(k)
            nbytes.append(f.nbytes)
            tags.append((b << _SINK_BITS) | sink)
            left[k] = left.get(k, 0) + 1
        self._bundles.append([src, op, self.env.now, left])
        self.net.send(src, dsts, kinds, nbytes, tags)

    def _net_done(self, tags, kinds) -> None:
        """Flows arrived: count them off their collective's arrival and their bundle's span."""
        mask = (1 << _SINK_BITS) - 1
        for tag, k in zip(tags.tolist(), kinds.tolist()):
            sk = self._sink_keys[tag & mask]
            self._expected[sk] -= 1
            if self._expected[sk] == 0:
                self._arrived[sk].succeed()
            bundle = self._bundles[tag >> _SINK_BITS]
            left = bundle[3]
            left[k] -= 1
            if left[k] == 0:
                rank, op, t0 = bundle[0], bundle[1], bundle[2]
                lane = f"link:{NET_KINDS[k]}"
                self.spans.append(
                    Span(rank, lane, op.name, "link", t0, self.env.now, 0, op.mb, op.layer, op.step)
                )

    def _check_finished(self) -> None:
        problems = []
        for rank, r in self.ranks.items():
            if r.host_at != "done":
                problems.append(f"rank {rank} host blocked at {r.host_at}")
            for s, what in r.busy.items():
                problems.append(f"rank {rank} stream {s} stuck {what}")
            for s, q in r.queues.items():
                if q.items:
                    problems.append(f"rank {rank} stream {s} has {len(q.items)} unissued items")
        if problems:
            raise SimulationStalled("simulation stalled: " + "; ".join(problems))


def simulate(
    program: Program, gpu: GPU, *, seed: int = 0, profile=None, max_events: int | None = None
) -> Trace:
    """Validate ``program`` and simulate it on ``gpu`` (op durations from ``profile``, a
    ``sim.profile.Profile``, where it has rows); deterministic for the same inputs."""
    validate(program, gpu.num_sms)
    return Engine(program, gpu, seed, profile=profile, max_events=max_events).run()
