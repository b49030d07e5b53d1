"""The SimPy interpreter: host threads issue, streams run FIFO, kernels share SMs, HBM and links.

Per rank:
- one host process walks the rank's instructions in issue order (``shared.ir.validate.issue_order``:
  one host thread runs at a time and hands over at ``Yield``), paying the launch cost per kernel
  (one graph-launch cost per ``Graph``), host time per ``Host`` and blocking at ``Sync``; its spans
  land on the lane of the thread that issued them;
- an op replayed from a ``Graph`` starts ``gpu.graph_kernel_gap_us`` after its stream could run
  it: a replayed graph leaves that gap between consecutive kernels (measured on an H200: the
  preset's source), which its stream spends idle;
- each stream takes instructions in FIFO order from a queue: a launch runs once it holds its SMs;
  a record fires its event; a wait holds the stream until the event has fired. A stream is not a
  SimPy process: it is driven by callbacks (an instruction issued to an idle stream, its kernel's
  end, the event it waits on), which run at the same instant a process would have resumed and
  save the queue's put and get events and the kernel's done event;
- a ``sim.resources.Gpu`` (SMs and HBM) and one ``sim.resources.Link`` per link kind (its
  egress, used by symmetric flows and PCIe copies).

Across ranks, flows with an explicit destination go through one network model (default
``sim.network.Network``: each crosses its source's egress and its destination's ingress port of
its link kind, shared max-min fairly); an op's flows form one bundle, drawn as one span per link
kind on the sender's link lane. What kernels cost comes from a cost model (default
``sim.cost.RooflineCostModel``); both are ``sim.models`` protocols the engine receives, as
objects or by their registered names (``sim.models.COST_MODELS``, ``NETWORKS``).

Collectives: a send (or sendrecv) op starts its flows when it starts; a recv op makes no progress
until every flow of its key addressed to its rank has arrived, then does its own work (DeepEP's
receive hook spins on its SMs until the data is there); a sendrecv op (DeepEP's normal kernels)
works from its start but cannot finish before its data has arrived. In a symmetric program a flow
with ``dst=None`` returns to its sender, standing for the identical flow of the mirror peer.

Repeated layers are copied once the state repeats (``sim.fastforward``, switched off by
``Engine(fast_forward=False)``); the engine's hooks for it are the positions of the host plan
(``sim.host_plan``), each stream's last position taken, callbacks that say what they do
(``functools.partial`` of the engine's methods) and the renaming of instructions past the blocks
it skipped.

Nothing here is random: the same Program and GPU give the same Trace (routing noise and load
imbalance are drawn, seeded, when the Program is built: ``shared.inputs.routing``, ``shared.ir.ranks``;
``seed`` is recorded in the trace).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict, deque
from functools import partial

import numpy as np
import simpy

from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.ir.program import (
    Graph,
    Launch,
    Op,
    Program,
    RankProgram,
    Record,
    Wait,
    WaitStream,
)
from overlap_lab.shared.ir.validate import validate
from overlap_lab.shared.outputs.trace import Span, Trace, no_gc
from overlap_lab.shared.outputs.trace import new_span as _span
from overlap_lab.sim import alone, models
from overlap_lab.sim.alone import Alone
from overlap_lab.sim.budget import default_max_events, run_budgeted
from overlap_lab.sim.host_plan import ENQUEUE, HOST, LAUNCH, SYNC, host_plan
from overlap_lab.sim.models import CostModel, NetworkFactory
from overlap_lab.sim.resources import CostCache, Gpu, Kernel, Link, timers

#: Link kinds carried by the network model (per-rank egress and ingress ports); PCIe copies stay
#: on each rank's own ``Link``.
NET_KINDS = ("nvlink", "rdma")
_SINK_BITS = 24
_SINK_MASK = (1 << _SINK_BITS) - 1
#: Arrivals counted with numpy above this many flows at once (below, a dict is cheaper).
_COUNT_WITH_NUMPY = 64
#: A network link kind's index: its position in ``NET_KINDS`` (the order of ``kinds`` given to
#: the network model).
_KIND_INDEX = {k: i for i, k in enumerate(NET_KINDS)}


def _signal(gpu: Gpu, k: Kernel, _ev=None) -> None:
    """An event ``k`` polls has fired (its SimPy event's callback)."""
    gpu.signal(k)


class SimulationStalled(RuntimeError):
    """Resource contention stopped every process before the Program finished."""


class _Rank:
    def __init__(self, engine: Engine, rp: RankProgram):
        env, gpu = engine.env, engine.gpu
        self.env, self.rp = env, rp
        self.gpu = Gpu(
            env,
            gpu,
            engine.cost_model,
            on_grant=partial(engine._begin, self),
            on_done=partial(engine._kernel_done, self),
            cache=engine.costs,
        )
        self.links = {  # one rank's egress per link kind: symmetric flows and PCIe copies
            k: Link(env, *engine.cost_model.link(gpu, k)) for k in ("nvlink", "rdma", "pcie")
        }
        self.fired: set[str] = set()  # events recorded so far
        self.waited: dict[str, simpy.Event] = {}  # SimPy events of those waited on before firing
        self.queues: dict[str, deque] = {s: deque() for s in rp.streams}
        self.lanes = {s: f"stream:{s}" for s in rp.streams}
        self.prio = {s: rp.priority(s) for s in rp.streams}
        self.busy: dict[str, object] = {}  # stream -> what holds it now (for stall reports)
        self.pumping: set[str] = set()  # streams whose queue is being walked right now
        self.host_at = "not started"
        #: the host's steps in issue order (``host_plan``) and the next one's index
        self.plan, self.pc = host_plan(rp), 0
        #: per stream, the position of the item it took last (-1: none yet)
        self.popped: dict[str, int] = dict.fromkeys(rp.streams, -1)
        self.host_wait: tuple | None = None  # what the host waits on: ("t", t0), ("sync", ev, t0)
        self.launch_run: dict[str, list[float]] = {}  # lane -> [start, end] of its open launches
        #: position whose taking from its queue is a cut of the fast-forward (-1: none)
        self.anchor = -1
        self.log: list | None = None  # events fired since the fast-forward's last cut
        #: instructions from ``rename_from`` on are renamed when taken (``sim.fastforward``:
        #: blocks were skipped before them), by the layers ``renames`` gives per position
        self.rename_from: float = math.inf
        self.renames: list[tuple[int, int]] = []
        self.host_proc = None  # the SimPy process walking ``plan``
        #: its kernels each reach an idle GPU (one stream): plain ones are timed by ``sim.alone``
        self.alone = False

    def event(self, name: str) -> simpy.Event:
        """The SimPy event of ``name`` for a waiter that must block: only events someone waits
        on before they fire get one (most records are waited on later or never)."""
        ev = self.waited.get(name)
        if ev is None:
            ev = self.waited[name] = self.env.event()
        return ev

    def record(self, name: str) -> None:
        self.fired.add(name)
        if self.log is not None:  # the fast-forward reads which events fired since its last cut
            self.log.append(name)
        ev = self.waited.get(name)
        if ev is not None:
            ev.succeed()


class Engine:
    def __init__(
        self,
        program: Program,
        gpu: GPU,
        seed: int = 0,
        net_group_tol: float = 0.0,
        profile=None,
        max_events: int | None = None,
        *,
        cost_model: CostModel | str | None = None,
        network: NetworkFactory | str | None = None,
        env: simpy.Environment | None = None,
        fast_forward: bool = True,
        alone: bool = True,
    ):
        """``cost_model`` and ``network``: objects, registered names or None for the defaults,
        ``roofline`` (``sim.cost.RooflineCostModel``) and ``max-min`` (``sim.network.Network``)
        (``sim.models``). ``profile`` (a ``sim.profile.Profile``) goes to a cost model built by
        name (or by default) and is not read when ``cost_model`` is an object. ``env``: a fresh
        SimPy environment to run in (default ``simpy.Environment()``; tests pass one that
        processes simultaneous events in a shuffled order). ``fast_forward``: layers whose state
        repeats an earlier layer's are not simulated but copied (``sim.fastforward``: the same
        Trace to float round-off; ``meta["fast_forward"]`` says what was skipped, or why
        nothing was); False simulates every layer (and the meta has no such key). ``alone``:
        on a rank with one stream, a kernel with no collective and no signal is timed in closed
        form (``sim.alone``: the same floats, one event); False leaves every kernel to the
        ``sim.resources.Gpu`` (for tests)."""
        self.program, self.gpu, self.seed = program, gpu, seed
        built = cost_model is None or isinstance(cost_model, str)
        self.profile = profile if built else None
        self.cost_model, cost_name = models.cost_model(cost_model, self.profile)
        network, net_name = models.network(network)
        self._names = {"cost_model": cost_name, "network": net_name}  # recorded in the meta
        self.env = simpy.Environment() if env is None else env
        with no_gc():  # (thousands of tuples, none in a cycle: see ``run``)
            self._setup(program, gpu, max_events, network, net_group_tol, fast_forward, alone)

    def _setup(self, program, gpu, max_events, network, net_group_tol, fast_forward, alone) -> None:
        """The ranks, the flows each collective expects, the network, the fast-forward."""
        self._plans: dict[int, Alone | None] = {}  # id(op) -> ``sim.alone.plan``
        #: kernels timed by ``sim.alone`` (work the run does with no SimPy event of its own)
        self.timed_alone = 0
        self._timers = timers(self.env)
        self.max_events = max_events or default_max_events(  # sim.budget
            program, gpu.num_sms, self.cost_model.grid, self.cost_model.key
        )
        self.spans: list[Span] = []
        self.costs = CostCache()  # the cost model's answers (shared by every rank's GPU)
        self.ranks = {rp.rank: _Rank(self, rp) for rp in program.ranks}
        self._expected: dict[tuple[str, int], int] = defaultdict(int)
        self._arrived: set[tuple[str, int]] = set()  # collectives whose data is all in
        self._on_arrival: dict[tuple[str, int], list] = {}  # their waiting kernels' callbacks
        expected = self._expected
        for rank, r in self.ranks.items():  # the flows each rank will receive, per collective
            for step in r.plan:
                for _pos, ins in step[4]:
                    c = ins.op.coll if type(ins) is Launch else None
                    if c is not None and c.role != "recv":
                        parts = max(1, len(ins.op.waits))  # a kernel polling signals sends one
                        for f in c.flows:  # part per signal
                            expected[(c.key, rank if f.dst is None else f.dst)] += parts
        kinds = {k: self.cost_model.link(gpu, k) for k in NET_KINDS}
        self.net = network(self.env, max(self.ranks) + 1, kinds, self._net_done, net_group_tol)
        self._ff = None  # the fast-forward (``sim.fastforward``), when the Program repeats
        self._arrived_log: list | None = None  # collectives complete since the last cut
        self._partial: set = set()  # collectives some but not all of whose flows arrived
        self._sinks: dict[tuple[str, int], int] = {}
        self._sink_keys: list[tuple[str, int]] = []
        self._bundles: list[list] = []  # [rank, op, t0, {kind: flows left}]
        self._ff_note: str | None = None
        if fast_forward:
            from overlap_lab.sim.fastforward import FastForward  # (it reads this module)

            ff = FastForward.attach(self)
            if isinstance(ff, str):
                self._ff_note = f"not used: {ff}"
            else:
                self._ff = ff
        # (the fast-forward compares the Gpu's state and timers at its cuts: it times every kernel;
        # an environment with a ``schedule`` of its own cannot be handed an instant computed ahead)
        alone = alone and self._ff is None and self._timers.exact
        for r in self.ranks.values():
            r.alone = alone and len(r.rp.streams) == 1

    # -- processes -----------------------------------------------------------------------------

    def run(self) -> Trace:
        for r in self.ranks.values():
            r.host_proc = self.env.process(self._host(r))
        # the run makes many short-lived objects and no garbage cycles worth collecting
        # mid-run; the collector would walk the Program's objects over and over (~12 % of a run),
        # and so would the thousands of spans the Trace is built from
        with no_gc():
            run_budgeted(self.env, self.max_events)
            self._check_finished()
            spans = self.spans
            if self._ff is not None:
                spans = self._ff.spans(spans)
                self._ff_note = self._ff.note()
            meta = self.program.meta.as_dict()
            meta.update(
                gpu=self.gpu.name,
                num_sms=self.gpu.num_sms,
                world=self.program.world,
                symmetric=self.program.symmetric,
                backend="sim",
                seed=self.seed,
            )
            if self.profile is not None:  # handed to the cost model
                meta["profile"] = self.profile.name
            meta.update(self._names)  # the models that made it
            if self._ff_note is not None:  # (absent when switched off)
                meta["fast_forward"] = self._ff_note
            # Trace stores its spans in canonical order (every field of a span in its key): the
            # order events were processed in is no part of the result
            trace = Trace(tuple(spans), meta)
        for r in self.ranks.values():  # (an engine kept alive keeps none of a run's bulk)
            r.plan = []
        self.spans, self._ff = [], None
        return trace

    def _host(self, r: _Rank):
        env, rank = self.env, r.rp.rank
        while r.pc < len(r.plan):  # (the fast-forward may rewrite the steps not taken yet)
            code, ins, lane, pos, parts, where = r.plan[r.pc]
            r.pc += 1
            r.host_at = where
            if pos >= r.rename_from and not parts:  # (what it enqueues is renamed when taken)
                ins = self._ff.rename(r, pos, ins)
            if code == LAUNCH:
                t0 = env.now
                r.host_wait = ("t", t0)
                yield env.timeout(
                    self.gpu.graph_launch_us if type(ins) is Graph else self.gpu.launch_us
                )
                r.host_wait = None
                run = r.launch_run.get(lane)
                if run is not None and run[1] == t0:  # extend a run of launches
                    run[1] = env.now
                else:
                    if run is not None:
                        self._launch_span(r, lane, run)
                    r.launch_run[lane] = [t0, env.now]
                gap = self.gpu.graph_kernel_gap_us if type(ins) is Graph else 0.0
                for p, part in parts:
                    self._enqueue(r, part, p, gap)
            elif code == ENQUEUE:
                for p, part in parts:
                    self._enqueue(r, part, p)
            elif code == HOST:
                t0 = env.now
                r.host_wait = ("t", t0)
                yield env.timeout(ins.us)
                r.host_wait = None
                self.spans.append(
                    _span(rank, lane, ins.name, "host", t0, env.now, 0, ins.mb, ins.layer, ins.step)
                )
            elif code == SYNC:
                t0 = env.now
                if ins.event not in r.fired:
                    r.host_wait = ("sync", ins.event, t0)
                    yield r.event(ins.event)
                    t0 = r.host_wait[2]  # (the fast-forward moves it when it skipped time)
                    r.host_wait = None
                if env.now > t0:
                    self.spans.append(_span(rank, lane, f"sync {ins.event}", "sync", t0, env.now))
            # YIELD: ``host_plan`` already hands control to the next thread
        for lane, run in r.launch_run.items():
            self._launch_span(r, lane, run)
        r.launch_run = {}
        r.host_at = "done"

    def _launch_span(self, r: _Rank, lane: str, run: list[float]) -> None:
        self.spans.append(_span(r.rp.rank, lane, "launch", "host", run[0], run[1]))

    def _enqueue(self, r: _Rank, ins, pos: int, gap: float = 0.0) -> None:
        """Hand ``ins`` to its stream with its position in the rank's issue order (``host_plan``:
        pending CTAs of equal priority go in this order) and the gap its op waits before it
        starts (a replayed graph's: ``gpu.graph_kernel_gap_us``)."""
        if type(ins) is WaitStream:
            ev = ("wait_stream", pos, ins.stream)  # an event of its own, named by its position
            self._put(r, ins.other, (pos, Record(ev, ins.other), 0.0))
            self._put(r, ins.stream, (pos, Wait(ins.stream, ev), 0.0))
        else:  # ``_put``, inline
            stream = ins.stream
            r.queues[stream].append((pos, ins, gap))
            if stream not in r.busy:
                self._pump(r, stream)

    def _put(self, r: _Rank, stream: str, item: tuple) -> None:
        r.queues[stream].append(item)
        if stream not in r.busy:
            self._pump(r, stream)

    def _pump(self, r: _Rank, name: str) -> None:
        """Run the stream's queue until it is empty or held: by a running op or a wait on an
        event not fired yet (whose firing, or the op's end, calls this again)."""
        if name in r.pumping:
            return  # an op that ended at once, inside the walk below: the walk goes on
        q, busy = r.queues[name], r.busy
        r.pumping.add(name)
        try:
            while q and name not in busy:
                seq, ins, gap = q.popleft()
                r.popped[name] = seq
                if seq >= r.rename_from:  # past blocks the fast-forward skipped
                    ins = self._ff.rename(r, seq, ins)
                if seq == r.anchor:  # a cut of the fast-forward: compare states at its instant
                    self._ff.cut(r)
                if type(ins) is Record:
                    r.record(ins.event)
                elif type(ins) is Wait:
                    if ins.event not in r.fired:
                        busy[name] = ins
                        r.event(ins.event).callbacks.append(partial(self._released, r, name))
                else:
                    busy[name] = ins
                    if r.alone and self._time_alone(r, name, ins, gap):
                        continue
                    if gap > 0:  # the stream idles through the graph's gap, then runs it
                        self.env.timeout(gap).callbacks.append(
                            partial(self._gap_over, r, name, ins, seq)
                        )
                    else:
                        self._start(r, name, ins, seq)
        finally:
            r.pumping.discard(name)

    def _start(self, r: _Rank, name: str, ins: Launch, seq: int) -> None:
        """Start the op of ``ins`` on stream ``name``: a copy on the PCIe link, a kernel to the
        block scheduler."""
        op = ins.op
        if op.kind == "copy":
            self._copy(r, name, op, seq)
        else:
            limit = self.gpu.num_sms if op.sms is None else op.sms
            r.gpu.acquire(Kernel(op, limit, name, r.prio[name], seq))

    def _time_alone(self, r: _Rank, name: str, ins: Launch, gap: float) -> bool:
        """Time ``ins``'s kernel alone on its idle GPU (``sim.alone``), and the plain kernels
        queued right behind it on the stream, each from the end of the one before (the instant
        its gap's timer would have had): one timer at the last end. False where the GPU must
        time ``ins`` (a collective, a signal, a copy, a hook...)."""
        a = self._plan(r.gpu, ins.op)
        if a is None:
            return False
        q, t, done = r.queues[name], self.env._now, []
        while True:
            segs, t = alone.timeline(a, t + gap if gap > 0 else t)  # (SimPy's gap timer)
            done.append((ins.op, segs, t))
            if not q or type(q[0][1]) is not Launch:
                break
            a = self._plan(r.gpu, q[0][1].op)
            if a is None:
                break
            seq, ins, gap = q.popleft()
            r.popped[name] = seq
            r.busy[name] = ins
        self._timers.call_at(t, partial(self._alone_done, r, name, done))
        self.timed_alone += len(done)
        return True

    def _plan(self, gpu: Gpu, op: Op) -> Alone | None:
        """``sim.alone.plan`` of ``op``, once per op: every rank's GPU (of one model, one cost
        cache) gives the same (the Program holds op: its id stays its own)."""
        a = self._plans.get(id(op), False)
        if a is False:
            limit = self.gpu.num_sms if op.sms is None else op.sms
            a = self._plans[id(op)] = alone.plan(gpu, op, limit)
        return a

    def _alone_done(self, r: _Rank, name: str, done: list, _ev=None) -> None:
        """Kernels timed alone have ended (their last one's timer): their spans, then the
        stream goes on."""
        lane = r.lanes[name]
        for op, segs, end in done:
            self._spans_of(r, lane, op, segs, end)
        self._release(r, name)

    def _gap_over(self, r: _Rank, name: str, ins: Launch, seq: int, _ev=None) -> None:
        """A replayed graph's gap before ``ins`` is over (its timer's callback, which the
        fast-forward reads: ``sim.fastforward``)."""
        self._start(r, name, ins, seq)

    def _release(self, r: _Rank, name: str) -> None:
        """What held the stream is over: go on with its queue."""
        del r.busy[name]
        self._pump(r, name)

    def _released(self, r: _Rank, name: str, _ev=None) -> None:
        """The event a stream waits on has fired (its SimPy event's callback)."""
        self._release(r, name)

    # -- one op --------------------------------------------------------------------------------

    def _copy(self, r: _Rank, stream: str, op: Op, pos: int) -> None:
        """A copy (D2H/H2D) is a flow on the rank's PCIe link; the stream waits for it."""
        r.links["pcie"].send(op.hbm_bytes, partial(self._copied, r, stream, op, self.env.now, pos))

    def _copied(self, r: _Rank, stream: str, op: Op, t0: float, pos: int) -> None:
        """A copy's last byte has arrived (``pos``: its position, read by the fast-forward)."""
        self.spans.append(
            _span(
                r.rp.rank,
                r.lanes[stream],
                op.name,
                "copy",
                t0,
                self.env.now,
                0,
                op.mb,
                op.layer,
                op.step,
            )
        )
        self._release(r, stream)

    def _kernel_done(self, r: _Rank, k: Kernel) -> None:
        """``k`` has ended: its spans (one per change of its SMs), then its stream goes on."""
        self._spans_of(r, r.lanes[k.stream], k.op, k.segments, self.env.now)
        self._release(r, k.stream)

    def _spans_of(self, r: _Rank, lane: str, op: Op, segs: list, now: float) -> None:
        """A kernel's spans, once it has ended at ``now``: one per change of its SMs
        (``segs``)."""
        rank, spans = r.rp.rank, self.spans
        if len(segs) == 1:  # its SMs never changed: one span
            t0, sms = segs[0]
            spans.append(
                _span(rank, lane, op.name, op.kind, t0, now, sms, op.mb, op.layer, op.step)
            )
        else:
            segs.append((now, 0))
            for (t0, sms), (t1, _) in zip(segs, segs[1:]):
                if t1 > t0 or len(segs) == 2:
                    spans.append(
                        _span(rank, lane, op.name, op.kind, t0, t1, sms, op.mb, op.layer, op.step)
                    )

    def _begin(self, r: _Rank, k: Kernel) -> None:
        """The kernel holds its first SMs: its sends leave, its receive waits for arrival, its
        signals are watched, and it runs (called by the block scheduler's pass)."""
        op = k.op
        c = op.coll
        if c is None and not op.waits:  # most kernels: nothing to send, receive or watch
            r.gpu.start(k)
            return
        rank = r.rp.rank
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
                        self._start_flow(r, op, f, k.seq)

            if parts == 1:
                send()
            else:
                for ev in op.waits:
                    if ev in r.fired:
                        send()
                    else:
                        r.event(ev).callbacks.append(send)
        if c is not None and c.role != "send":
            key = (c.key, rank)
            if key not in self._arrived and self._expected.get(key, 0) != 0:
                if c.role == "recv":
                    k.waiting_data = True
                else:
                    k.gated = True
                self._on_arrival.setdefault(key, []).append(partial(r.gpu.data_arrived, k))
        for ev in op.waits:  # signals the kernel polls while it runs
            if ev in r.fired:
                k.fired += 1
            else:
                r.event(ev).callbacks.append(partial(_signal, r.gpu, k))
        r.gpu.start(k)

    def _arrive(self, key: tuple[str, int], n: int = 1) -> None:
        """``n`` flows of collective ``key`` have arrived; the last one releases its receivers."""
        left = self._expected[key] = self._expected[key] - n
        if left == 0:
            self._arrived.add(key)
            if self._arrived_log is not None:  # read by the fast-forward's next cut
                self._arrived_log.append(key)
                self._partial.discard(key)
            for fn in self._on_arrival.pop(key, ()):
                fn()
        elif self._arrived_log is not None:
            self._partial.add(key)

    def _start_flow(self, r: _Rank, op: Op, f, pos: int) -> None:
        """A symmetric flow (to the mirror peer): it only shares its rank's egress link, as every
        rank's ingress carries the same load as its egress."""
        r.links[f.link].send(
            f.nbytes, partial(self._flow_arrived, r, op, f.link, self.env.now, pos)
        )

    def _flow_arrived(self, r: _Rank, op: Op, link: str, t0: float, pos: int) -> None:
        """A symmetric flow's last byte has arrived (``pos``: its op's position)."""
        self.spans.append(
            _span(
                r.rp.rank, f"link:{link}", op.name, "link", t0, self.env.now, 0, op.mb, op.layer,
                op.step,
            )
        )  # fmt: skip
        self._arrive((op.coll.key, r.rp.rank))

    def _start_flows(self, r: _Rank, op: Op, flows) -> None:
        """Hand the op's flows to the network as one bundle (one link span per kind)."""
        src, key = r.rp.rank, op.coll.key
        sinks, sink_keys, kind_index = self._sinks, self._sink_keys, _KIND_INDEX
        b = len(self._bundles) << _SINK_BITS
        dsts = [src if f.dst is None else f.dst for f in flows]
        kinds = [kind_index[f.link] for f in flows]
        tags = []
        for dst in dsts:
            sk = (key, dst)
            sink = sinks.get(sk)
            if sink is None:
                sink = sinks[sk] = len(sink_keys)
                sink_keys.append(sk)
            tags.append(b | sink)
        left: dict[int, int] = {}
        for k in kinds:
            left[k] = left.get(k, 0) + 1
        self._bundles.append([src, op, self.env.now, left])
        self.net.send(src, dsts, kinds, [f.nbytes for f in flows], tags)

    def _net_done(self, tags: np.ndarray, kinds: np.ndarray) -> None:
        """Flows arrived: count them off their collective's arrival and their bundle's span
        (counted per collective and per bundle: an all-to-all delivers hundreds at once)."""
        nk = len(NET_KINDS)
        if len(tags) > _COUNT_WITH_NUMPY:
            sinks, n_sink = np.unique(tags & _SINK_MASK, return_counts=True)
            pairs, n_pair = np.unique((tags >> _SINK_BITS) * nk + kinds, return_counts=True)
            by_sink = zip(sinks.tolist(), n_sink.tolist())
            by_pair = zip(pairs.tolist(), n_pair.tolist())
        else:
            cs: dict[int, int] = {}
            cp: dict[int, int] = {}
            for tag, k in zip(tags.tolist(), kinds.tolist()):
                cs[tag & _SINK_MASK] = cs.get(tag & _SINK_MASK, 0) + 1
                pair = (tag >> _SINK_BITS) * nk + k
                cp[pair] = cp.get(pair, 0) + 1
            by_sink, by_pair = cs.items(), cp.items()
        for sink, n in by_sink:
            self._arrive(self._sink_keys[sink], n)
        for pair, n in by_pair:
            b, k = divmod(pair, nk)
            bundle = self._bundles[b]
            left = bundle[3]
            left[k] -= n
            if left[k] == 0:
                rank, op, t0 = bundle[0], bundle[1], bundle[2]
                lane = f"link:{NET_KINDS[k]}"
                self.spans.append(
                    _span(
                        rank, lane, op.name, "link", t0, self.env.now, 0, op.mb, op.layer, op.step
                    )
                )

    def _check_finished(self) -> None:
        problems = []
        for rank, r in self.ranks.items():
            if r.host_at != "done":
                at = r.host_at
                if isinstance(at, tuple):
                    at = f"thread {at[0]} instruction {at[1]}"
                problems.append(f"rank {rank} host blocked at {at}")
            for s, ins in r.busy.items():
                if isinstance(ins, Wait):
                    what = f"waiting for event {ins.event!r}"
                else:
                    what = f"running {ins.op.name} (layer {ins.op.layer}, mb {ins.op.mb})"
                problems.append(f"rank {rank} stream {s} stuck {what}")
            for s, q in r.queues.items():
                if q:
                    problems.append(f"rank {rank} stream {s} has {len(q)} unissued items")
        if problems:
            raise SimulationStalled("simulation stalled: " + "; ".join(problems))


def simulate(
    program: Program,
    gpu: GPU,
    *,
    seed: int = 0,
    profile=None,
    max_events: int | None = None,
    cost_model: CostModel | str | None = None,
    network: NetworkFactory | str | None = None,
    fast_forward: bool = True,
) -> Trace:
    """Validate ``program`` and simulate it on ``gpu`` (op durations from ``cost_model``, by
    default the roofline with ``profile``'s rows, a ``sim.profile.Profile``; flows with a
    destination through ``network``: ``sim.models``; repeated layers copied unless
    ``fast_forward`` is False: ``Engine``); deterministic for the same inputs."""
    validate(program, gpu.num_sms)
    return Engine(
        program,
        gpu,
        seed,
        profile=profile,
        max_events=max_events,
        cost_model=cost_model,
        network=network,
        fast_forward=fast_forward,
    ).run()
