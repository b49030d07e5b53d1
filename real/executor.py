"""The executor: interprets a Program with real kernels (real/kernels.py), on the CPU or a GPU.

Host side (both devices): each rank's host threads run one at a time; at ``Yield`` control passes
round-robin to the next live thread, exactly as in the simulator. A ``Graph`` runs instruction by
instruction on the CPU; on a GPU it is captured once with torch.cuda.graph (``plan_graph``: which
stream captures, which streams fork and join, which waits the capture skips) and replayed. Ranks
of a non-symmetric Program run in one process as coroutines that meet at point-to-point ops.

CPU: streams become ordered execution in host issue order; a hook runs in place. Because host
order hides races the GPU would have, every op's reads are checked against the Program's own
ordering (``HazardTracker``): a value must have been written by an op that happens-before the
reader by stream order, events, stream waits or host syncs, as CUDA would order them.

GPU: torch CUDA streams and events, each op bracketed by CUDA events and a profiler range,
compute SM budgets scoped (real.kernels.sm_budget), comm SM budgets given to the backend; warm-up,
repeats, and the repeat with the median step time becomes the Trace.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from overlap_lab.real import fp8
from overlap_lab.real import kernels as K
from overlap_lab.real import model as M
from overlap_lab.real.clocks import Anchor, ClockMap, anchor
from overlap_lab.real.runlog import RunLog
from overlap_lab.shared.ir.program import (
    Graph,
    Host,
    Launch,
    Op,
    Program,
    Record,
    Sync,
    Wait,
    WaitStream,
    Yield,
)
from overlap_lab.shared.outputs.trace import Span, Trace


class HazardError(RuntimeError):
    """An op reads a value whose writer is not ordered before it on the GPU."""


# ----------------------------------------------------------------------------------------------
# Happens-before on the CPU: vector clocks per stream, events and host threads
# ----------------------------------------------------------------------------------------------


@dataclass
class _Stamp:
    stream: str
    seq: int
    clock: dict[str, int]
    desc: str
    coll: str | None = None  # collective key of the op
    recv: bool = False  # a receive half: completes only when the collective's data arrived


def _ordered(cur: _Stamp, w: _Stamp) -> bool:
    """w happens-before cur: by streams and events, or because cur is the receive half of w's
    collective (DeepEP's recv kernel polls arrival flags on the device, whatever its stream)."""
    if w is cur or cur.clock.get(w.stream, 0) >= w.seq:
        return True
    return cur.recv and cur.coll is not None and cur.coll == w.coll


class HazardTracker:
    """Vector clocks over one rank's streams. An op X happens-before op Y iff Y's clock has seen
    X's position on X's stream. Host-side reads (after a Sync) are not checked."""

    def __init__(self):
        self.streams: dict[str, dict[str, int]] = {}
        self.events: dict[str, dict[str, int]] = {}
        self.writers: dict[tuple, list[_Stamp]] = {}
        self.current: _Stamp | None = None
        self.violations: list[str] = []

    def _vc(self, stream: str) -> dict[str, int]:
        return self.streams.setdefault(stream, {})

    @staticmethod
    def _merge(a: dict[str, int], b: dict[str, int]) -> None:
        for k, v in b.items():
            if a.get(k, 0) < v:
                a[k] = v

    def launch(self, op: Op, stream: str) -> None:
        vc = self._vc(stream)
        vc[stream] = vc.get(stream, 0) + 1
        desc = f"{op.name} (layer {op.layer}, mb {op.mb}, step {op.step}) on {stream}"
        coll = op.coll.key if op.coll is not None else None
        recv = op.coll is not None and op.coll.role in ("recv", "sendrecv")
        self.current = _Stamp(stream, vc[stream], dict(vc), desc, coll, recv)

    def record(self, event: str, stream: str) -> None:
        self.events[event] = dict(self._vc(stream))

    def wait(self, stream: str, event: str) -> None:
        if event not in self.events:
            raise HazardError(f"wait on event {event!r} before it was recorded")
        self._merge(self._vc(stream), self.events[event])

    def wait_stream(self, stream: str, other: str) -> None:
        self._merge(self._vc(stream), self._vc(other))

    def write(self, key: tuple, op: Op) -> None:
        if self.current is not None:
            if key[0] == "kv":
                self.writers.setdefault(key, []).append(self.current)
            else:
                self.writers[key] = [self.current]

    def check(self, w: _Stamp, what: str) -> None:
        cur = self.current
        if cur is not None and not _ordered(cur, w):
            self.violations.append(
                f"{cur.desc} reads {what} written by {w.desc}, which is not ordered before it "
                "(missing event wait?)"
            )

    def read(self, key: tuple, op: Op) -> None:
        cur = self.current
        if cur is None:
            return
        for w in self.writers.get(key, ()):
            if not _ordered(cur, w):
                self.violations.append(
                    f"{cur.desc} reads {key[-1] if key[0] == 'mb' else 'kv cache'} "
                    f"written by {w.desc}, which is not ordered before it (missing event wait?)"
                )


# ----------------------------------------------------------------------------------------------
# Point-to-point between in-process ranks
# ----------------------------------------------------------------------------------------------


class Mailbox:
    def __init__(self):
        self.box: dict[str, list[tuple[int, dict]]] = {}

    def send(self, key: str, src: int, payload: dict) -> None:
        self.box.setdefault(key, []).append((src, payload))

    def recv(self, key: str, dst: int) -> dict | None:
        q = self.box.get(key)
        if not q:
            return None
        return q.pop(0)[1]


# ----------------------------------------------------------------------------------------------
# Execution
# ----------------------------------------------------------------------------------------------


@dataclass
class ExecResult:
    """Outputs per rank and step, plus the Trace (timings only on a GPU)."""

    outputs: dict[int, dict[int, K.StepState]]
    trace: Trace
    violations: list[str] = field(default_factory=list)


def _flatten(instrs) -> Iterator:
    for ins in instrs:
        if isinstance(ins, Graph):
            yield from ins.body
        else:
            yield ins


def _steps_of(rp) -> list[int]:
    steps = set()
    for th in rp.threads:
        for ins in _flatten(th.instrs):
            if isinstance(ins, Launch):
                steps.add(ins.op.step if ins.op.step is not None else 0)
    return sorted(steps) or [0]


# ----------------------------------------------------------------------------------------------
# CUDA graphs: the capture plan (pure, tested on the CPU) and its use on a GPU
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GraphPlan:
    """How one ``Graph`` instruction is captured with torch.cuda.graph.

    ``capture_stream`` (the body's first stream) is the stream captured and replayed on; every
    other stream of the body forks from it (``wait_stream``) at the start of the capture and
    joins it at the end, so all of the body's work is one graph. Before capture and replay the
    capture stream waits for every body stream (work issued before the graph on any of them is
    ordered before it: conservative). Waits in the body on events not recorded earlier in the
    body (``skip_waits``, body indices) are satisfied by that join-in and skipped under capture
    (an event from outside a capture cannot be waited on inside it). After each replay the
    events recorded in the body (``exported_events``) are re-recorded on the capture stream, for
    waits after the graph. ``eager_reason``: why the body must run op by op instead (then None
    of the above is used)."""

    name: str
    capture_stream: str
    streams: tuple[str, ...]
    skip_waits: tuple[int, ...]
    exported_events: tuple[str, ...]
    eager_reason: str | None = None
    step: int = 0


def _streams_of(ins) -> tuple[str, ...]:
    if isinstance(ins, WaitStream):
        return (ins.stream, ins.other)
    return (ins.stream,)


def plan_graph(graph: Graph, before: list[Op] = (), others: list[Op] = ()) -> GraphPlan:
    """The capture plan of ``graph``. ``before``: ops launched before it by its own host thread
    in its step; ``others``: ops of its step launched by other threads. The graph is captured
    once and replayed, so the tensors it reads must be the same objects every run: kernels with
    no tensors (real.kernels.NOOP_OPS) may precede it, anything else makes it run eagerly."""
    streams: list[str] = []
    recorded: set[str] = set()
    skip: list[int] = []
    for i, ins in enumerate(graph.body):
        for s in _streams_of(ins):
            if s not in streams:
                streams.append(s)
        if isinstance(ins, Record):
            recorded.add(ins.event)
        elif isinstance(ins, Wait) and ins.event not in recorded:
            skip.append(i)
    reason = None
    if not graph.body or not any(isinstance(i, Launch) for i in graph.body):
        reason = "empty body"
    feeders = sorted({op.name for op in (*before, *others) if op.name not in K.NOOP_OPS})
    if feeders:
        reason = (
            f"ops outside the graph in its step ({', '.join(feeders[:4])}) may feed it: "
            "inputs are not static"
        )
    ops = [i.op for i in graph.body if isinstance(i, Launch)]
    return GraphPlan(
        graph.name,
        streams[0] if streams else "main",
        tuple(streams),
        tuple(skip),
        tuple(sorted(recorded)),
        reason,
        (ops[0].step or 0) if ops else 0,
    )


def plan_graphs(rp) -> dict[int, GraphPlan]:
    """Plans of every Graph of a rank, keyed by ``id`` of the Graph instruction."""
    step_of = lambda op: op.step if op.step is not None else 0  # noqa: E731
    out: dict[int, GraphPlan] = {}
    for th in rp.threads:
        seen: list[Op] = []
        for ins in th.instrs:
            if isinstance(ins, Graph):
                ops = [i.op for i in ins.body if isinstance(i, Launch)]
                step = step_of(ops[0]) if ops else 0
                before = [op for op in seen if step_of(op) == step]
                others = [
                    i.op
                    for t2 in rp.threads
                    if t2 is not th
                    for i in _flatten(t2.instrs)
                    if isinstance(i, Launch) and step_of(i.op) == step
                ]
                out[id(ins)] = plan_graph(ins, before, others)
                seen.extend(ops)
            elif isinstance(ins, Launch):
                seen.append(ins.op)
    return out


class _Gpu:
    """CUDA streams, events and timing of one rank (created only on a GPU run)."""

    def __init__(self, streams: tuple[str, ...], priorities: tuple[tuple[str, int], ...] = ()):
        prio = dict(priorities)  # the Program's CUDA stream priorities (lower is higher)
        self.streams = {s: torch.cuda.Stream(priority=prio.get(s, 0)) for s in streams}
        self.events: dict[str, torch.cuda.Event] = {}
        self.timed: list[tuple[Op, str, Any, Any]] = []
        self.start: Anchor | None = None  # the run's start anchor (real/clocks.py)
        self.clock: ClockMap | None = None
        self.graphs: dict[int, dict] = {}  # id(Graph) -> {"runs", "graph", "snapshot", "mode"}
        self.capturing: GraphPlan | None = None
        self.timed_graphs: list[tuple[Graph, GraphPlan, Any, Any]] = []

    def stream(self, name: str):
        if name not in self.streams:
            self.streams[name] = torch.cuda.Stream()
        return self.streams[name]


class RankRunner:
    """One rank: its host threads, its step states, its streams."""

    def __init__(
        self,
        rp,
        program: Program,
        *,
        weights,
        backend,
        workload,
        device,
        seed,
        check_hazards,
        world: Mailbox,
        host_spin: bool,
        cuda_graphs: bool = True,
        precision: fp8.Precision = fp8.BF16,
        fp8_weights: fp8.WeightCache | None = None,
    ):
        self.precision, self.fp8_weights = precision, fp8_weights
        self.log = RunLog()  # the current run's (each run is handed a new one: start_run)
        self.rp, self.program, self.weights, self.backend = rp, program, weights, backend
        self.device, self.world, self.host_spin = torch.device(device), world, host_spin
        self.layout = K.BatchLayout.of(workload.batch)
        self.mbs = {m["index"]: m for m in program.meta.micro_batches or ()}
        if not self.mbs:
            n = self.layout.num_tokens
            self.mbs = {
                0: dict(
                    index=0,
                    seq_lo=0,
                    seq_hi=len(self.layout.new),
                    tok_lo=0,
                    tok_hi=n,
                    padded_tokens=n,
                    split_seq=False,
                )
            }
        n = self.layout.num_tokens
        self.whole = dict(
            index=-1,
            seq_lo=0,
            seq_hi=len(self.layout.new),
            tok_lo=0,
            tok_hi=n,
            padded_tokens=n,
            split_seq=False,
        )
        self.max_dispatch = max(m["padded_tokens"] for m in self.mbs.values())
        mode = program.meta.deepep_mode or (
            "low_latency" if workload.batch.mode == "decode" else "normal"
        )
        self.deepep_mode = mode
        self.seed = seed
        self.piece_counts: dict[tuple, int] = {}
        ops, polling = set(), set()
        for th in rp.threads:
            for ins in _flatten(th.instrs):
                if isinstance(ins, Launch):
                    ops.add((ins.op.name, ins.op.step, ins.op.layer, ins.op.mb))
                    if ins.op.waits:  # SBO mode 1: a combine that polls the down GEMM's signal
                        polling.add((ins.op.step, ins.op.layer, ins.op.mb))
                    base, k = K.split_piece(ins.op.name)
                    if k is not None:
                        key = (base, ins.op.step, ins.op.layer, ins.op.mb)
                        self.piece_counts[key] = max(self.piece_counts.get(key, 0), k + 1)
        self.program_ops = frozenset(ops)
        # (step, layer, mb) whose down GEMM writes SBO's signal for a polling combine: only where
        # the backend polls it inside its combine and a signalling kernel can run here (Triton
        # on the GPU, or its CPU interpreter); else the combine waits for every signal's event
        self.signalled = frozenset(polling) if self._can_poll_signals() else frozenset()
        self.states = {s: K.new_step_state(self.layout, weights, seed=seed) for s in _steps_of(rp)}
        self.tracker = HazardTracker() if check_hazards else None
        self.gpu = _Gpu(rp.streams, rp.priorities) if self.device.type == "cuda" else None
        self.graph_plans = plan_graphs(rp)
        self.cuda_graphs = cuda_graphs and self.gpu is not None
        self.spans: list[Span] = []
        self.sm_limits: dict[str, dict] = {}  # compute op name -> {"requested", "status"}
        self.force_eager = False  # the eager pass of a graph-timed run: per-op spans
        self.host_t0 = time.perf_counter()

    def reset(self) -> None:
        self.sm_limits = {}
        for st in self.states.values():
            st.keep.clear()  # the previous run ended with a device synchronize
            st.mbs.clear()
            st.rowlog.clear()
            st.logits.clear()
            st.covered.clear()
        if self.tracker is not None:
            self.tracker = HazardTracker()
        if self.gpu is not None:
            self.gpu.events.clear()
            self.gpu.timed.clear()
            self.gpu.timed_graphs.clear()
        self.spans = []

    def resolve_mb(self, op: Op) -> dict:
        """The micro-batch an op works on. Listed micro-batches match by index and token count;
        an op over the whole batch (TBO's dense layers and head, index 0 like its first half)
        is recognised by its token count and gets the synthetic index -1."""
        m = self.mbs.get(op.mb if op.mb is not None else 0)
        if m is not None and op.tokens in (0, m["padded_tokens"]):
            return m
        if op.tokens == self.whole["padded_tokens"] or m is None:
            return self.whole
        return m

    def _now_us(self) -> float:
        return (time.perf_counter() - self.host_t0) * 1e6

    # -- instructions ----------------------------------------------------------------------------

    def launch(self, op: Op, stream: str) -> None:
        mb = self.resolve_mb(op)
        step = self.states[op.step if op.step is not None else 0]
        ctx = K.KernelCtx(
            op=op,
            mb=mb,
            step=step,
            weights=self.weights,
            backend=self.backend,
            deepep_mode=self.deepep_mode,
            max_dispatch_tokens=self.max_dispatch,
            tracker=self.tracker,
            world=self.world,
            rank=self.rp.rank,
            steps=self.states,
            keep_alive=self.gpu is not None,
            program_ops=self.program_ops,
            piece_counts=self.piece_counts,
            sbo_signal=(op.step, op.layer, op.mb) in self.signalled,
            log=self.log,
            precision=self.precision,
            fp8_weights=self.fp8_weights,
        )
        fn = K.bind(op.name)
        fn = self._limit_checked(op, fn)
        base, k = K.split_piece(op.name)
        if k is not None:
            ctx.piece = (k, self.piece_counts[(base, op.step, op.layer, op.mb)])
        if self.tracker is not None:
            self.tracker.launch(op, stream)
        if self.gpu is None:
            t = self._now_us()
            fn(ctx)
            self.spans.append(self._span(op, stream, t, self._now_us()))
            return
        s = self.gpu.stream(stream)
        if self.gpu.capturing is not None:  # inside a CUDA graph: timed as one replay
            with torch.cuda.stream(s):
                fn(ctx)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with (
            torch.cuda.stream(s),
            torch.profiler.record_function(f"{op.name}.L{op.layer}.mb{op.mb}"),
        ):
            start.record(s)
            fn(ctx)
            end.record(s)
        self.gpu.timed.append((op, stream, start, end))

    def _can_poll_signals(self) -> bool:
        from overlap_lab.real.deps import available, interpreting

        if "sbo_signal" not in getattr(self.backend, "capabilities", ()):
            return False
        return self.deepep_mode == "low_latency" and (
            (self.device.type == "cuda" and available("triton")) or interpreting()
        )

    def _polls(self, op: Op) -> bool:
        """Does this combine poll its signals in-kernel? Only once the down GEMM pieces of its
        layer wrote the signal (kernels.experts_down puts ``sbo_down``); decided on the host
        before its launch, so the executor either skips the waits or keeps them, never both."""
        if not op.waits or (op.step, op.layer, op.mb) not in self.signalled:
            return False
        st = self.states[op.step if op.step is not None else 0].mbs.get(
            self.resolve_mb(op)["index"]
        )
        down = (st or {}).get("sbo_down")
        return down is not None and down["layer"] == op.layer

    def _limit_checked(self, op: Op, fn):
        """``fn`` wrapped so this run records how a compute op's SM limit was honoured."""
        if op.kind != "compute" or not op.sms:
            return fn
        from overlap_lab.real import gemm as G

        def run(ctx):
            before = G.ENTERED
            fn(ctx)
            dsms = G.device_sms(self.device) if self.gpu is not None else None
            name = K.split_piece(op.name)[0]
            status = limit_status(op.sms, G.ENTERED > before, device_sms=dsms)
            self.sm_limits.setdefault(name, {"requested": op.sms, "status": status})

        return run

    def _span(self, op: Op, stream: str, t0: float, t1: float) -> Span:
        kind = op.kind if op.kind in ("compute", "comm", "copy") else "compute"
        sms = op.sms if op.sms is not None else 0
        return Span(
            self.rp.rank, f"stream:{stream}", op.name, kind, t0, t1, sms, op.mb, op.layer, op.step
        )

    def run_instr(self, ins, thread: str) -> None:
        if isinstance(ins, Launch):
            # a kernel that polls signals while it runs (Op.waits, SBO's combine): launched
            # right away when its backend polls the down GEMM's signal tensor in-kernel (the
            # hazard tracker still orders it after each signal: the kernel waits on every one),
            # else after its last signal's event (no overlap; kernels.combine_a says which)
            polls = self._polls(ins.op)
            for ev in ins.op.waits:
                if polls:
                    if self.tracker is not None:
                        self.tracker.wait(ins.stream, ev)
                else:
                    self.run_instr(Wait(ins.stream, ev), thread)
            self.launch(ins.op, ins.stream)
        elif isinstance(ins, Record):
            if self.tracker is not None:
                self.tracker.record(ins.event, ins.stream)
            if self.gpu is not None:
                ev = torch.cuda.Event()
                ev.record(self.gpu.stream(ins.stream))
                self.gpu.events[ins.event] = ev
        elif isinstance(ins, Wait):
            if self.tracker is not None:
                self.tracker.wait(ins.stream, ins.event)
            if self.gpu is not None:
                self.gpu.stream(ins.stream).wait_event(self.gpu.events[ins.event])
        elif isinstance(ins, WaitStream):
            if self.tracker is not None:
                self.tracker.wait_stream(ins.stream, ins.other)
            if self.gpu is not None:
                self.gpu.stream(ins.stream).wait_stream(self.gpu.stream(ins.other))
        elif isinstance(ins, Host):
            t = self._now_us()
            if self.host_spin and ins.us > 0:  # stand in for the host work the Program models
                end = time.perf_counter() + ins.us * 1e-6
                while time.perf_counter() < end:
                    pass
            self.spans.append(
                Span(
                    self.rp.rank,
                    f"host:{thread}",
                    ins.name,
                    "host",
                    t,
                    self._now_us(),
                    0,
                    ins.mb,
                    ins.layer,
                    ins.step,
                )
            )
        elif isinstance(ins, Sync):
            t = self._now_us()
            if self.gpu is not None:
                self.gpu.events[ins.event].synchronize()
            self.spans.append(
                Span(self.rp.rank, f"host:{thread}", f"sync:{ins.event}", "sync", t, self._now_us())
            )
        elif isinstance(ins, Graph):
            self.run_graph(ins, thread)
        else:
            raise TypeError(f"unexpected instruction {ins!r}")

    # -- CUDA graphs (GPU) -----------------------------------------------------------------------

    def _snapshot(self, step: int):
        st = self.states[step]
        return (
            {i: dict(d) for i, d in st.mbs.items()},
            {k: list(v) for k, v in st.rowlog.items()},
            dict(st.logits),
            set(st.covered),
            st.version,
        )

    def _restore(self, step: int, snap) -> None:
        st = self.states[step]
        mbs, rowlog, logits, covered, version = snap
        st.mbs = {i: dict(d) for i, d in mbs.items()}
        st.rowlog = {k: list(v) for k, v in rowlog.items()}
        st.logits, st.covered, st.version = dict(logits), set(covered), version

    def run_graph(self, g: Graph, thread: str) -> None:
        """A Graph on a GPU: the first run op by op (warm-up: compiles kernels, sizes buffers),
        the second captures the body with torch.cuda.graph on the plan's streams and replays
        it, later runs replay it (the Python-side state the body produced is restored from
        the capture). Falls back to op by op, with the reason in the trace, when the plan says
        so or the capture fails (a host sync in the body, for instance)."""
        plan = self.graph_plans[id(g)]
        st = self.gpu.graphs.setdefault(id(g), {"runs": 0, "name": g.name, "mode": "eager"})
        st["runs"] += 1
        if self.force_eager:
            for ins in g.body:
                self.run_instr(ins, thread)
            return
        if not self.cuda_graphs or plan.eager_reason or st.get("failed") or st["runs"] == 1:
            if plan.eager_reason:
                st["reason"] = plan.eager_reason
            elif not self.cuda_graphs:
                st["reason"] = "cuda_graphs=False"
            for ins in g.body:
                self.run_instr(ins, thread)
            return
        cap = self.gpu.stream(plan.capture_stream)
        others = [self.gpu.stream(s) for s in plan.streams[1:]]
        for o in others:  # join in: earlier work on every body stream precedes the graph
            cap.wait_stream(o)
        if "graph" not in st:
            before = self._snapshot(plan.step)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, stream=cap):
                    self.gpu.capturing = plan
                    try:
                        for o in others:  # fork from the capture stream
                            o.wait_stream(cap)
                        for i, ins in enumerate(g.body):
                            if i not in plan.skip_waits:
                                self.run_instr(ins, thread)
                        for o in others:  # join back
                            cap.wait_stream(o)
                    finally:
                        self.gpu.capturing = None
            except Exception as e:  # noqa: BLE001 - any capture error falls back, recorded
                st.update(failed=True, reason=f"capture failed: {type(e).__name__}: {e}"[:300])
                torch.cuda.synchronize()
                self._restore(plan.step, before)
                for ins in g.body:
                    self.run_instr(ins, thread)
                return
            st.update(graph=graph, snapshot=self._snapshot(plan.step), mode="captured")
            st.pop("reason", None)
        else:
            self._restore(plan.step, st["snapshot"])
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(cap):
            a.record(cap)
            st["graph"].replay()
            b.record(cap)
        self.gpu.timed_graphs.append((g, plan, a, b))
        for name in plan.exported_events:  # real events for waits after the graph
            ev = torch.cuda.Event()
            ev.record(cap)
            self.gpu.events[name] = ev
        for o in others:  # later work on any body stream sees the graph's results
            o.wait_stream(cap)

    # -- host threads ----------------------------------------------------------------------------

    def process(self):
        """A coroutine running this rank's host threads; yields (instructions run since the
        last yield) when a receive must wait for another rank."""
        # On a GPU a Graph is one instruction (captured and replayed); on the CPU its body runs
        # instruction by instruction, exactly like the simulator's graph launch.
        unit = self.gpu is not None
        threads = [
            (th.name, iter(th.instrs) if unit else _flatten(th.instrs)) for th in self.rp.threads
        ]
        pending: dict[int, Any] = {}
        live = list(range(len(threads)))
        cur = done = 0
        while live:
            i = live[cur % len(live)]
            name, it = threads[i]
            switched = False
            while True:
                ins = pending.pop(i, None) or next(it, None)
                if ins is None:
                    live.remove(i)
                    switched = True
                    break
                if isinstance(ins, Yield):
                    cur = (live.index(i) + 1) % len(live)
                    break
                try:
                    self.run_instr(ins, name)
                    done += 1
                except K.WouldBlock:
                    pending[i] = ins
                    yield done  # instructions run since the last block: progress if > 0
                    done = 0
            if switched and live:
                cur = cur % len(live)
        return

    def start_clock(self) -> None:
        """The run's start anchor; host spans count from its timestamp."""
        self.gpu.start = _gpu_anchor()
        self.host_t0 = self.gpu.start.host_s

    def collect_gpu_spans(self) -> None:
        """CUDA-event spans mapped onto the host axis through the run's two anchors."""
        end = _gpu_anchor()
        torch.cuda.synchronize()
        cm = self.gpu.clock = ClockMap.between(self.gpu.start, end)
        for op, stream, a, b in self.gpu.timed:
            self.spans.append(self._span(op, stream, cm.host_us(a), cm.host_us(b)))
        for g, plan, a, b in self.gpu.timed_graphs:
            t0, t1 = cm.host_us(a), cm.host_us(b)
            self.spans.append(
                Span(
                    self.rp.rank,
                    f"stream:{plan.capture_stream}",
                    f"graph:{g.name}",
                    "compute",
                    t0,
                    t1,
                    0,
                    None,
                    None,
                    plan.step,
                )
            )


def _gpu_anchor() -> Anchor:
    return anchor(
        time.perf_counter, lambda: torch.cuda.Event(enable_timing=True), torch.cuda.synchronize
    )


def limit_status(sms: int, budgeted: bool, *, device_sms: int | None) -> str:
    """How a compute op's SM limit ``sms`` was honoured in a run: its GEMMs ran inside an SM
    budget (``budgeted``) or not, on a GPU with ``device_sms`` SMs or on the CPU (None)."""
    if device_sms is not None and sms >= device_sms:
        return "no limit: at or above the device's SMs"
    if not budgeted:
        return (
            "not enforced: this op's kernels (attention, norms, elementwise) run on every SM; "
            "only GEMMs take an SM budget"
        )
    if device_sms is None:
        return "budget scoped (CPU: no SMs to limit)"
    return "enforced: GEMMs within the budget (see sm_budget_mechanisms)"


def timing_meta(graph_traces: list[Trace], eager_traces: list[Trace]) -> tuple[Trace, dict]:
    """A graph-timed run's two measurements, kept apart: ``graph_traces`` (CUDA graphs
    replayed: the step time a serving engine sees; a replayed graph is one span) and
    ``eager_traces`` (the same Program op by op: one CUDA-event span per op, for per-op times
    and exposed communication). Returns the eager trace of median step time (the spans) and
    the meta that says which number is which."""
    g = [t.step_time_us for t in graph_traces]
    e = [t.step_time_us for t in eager_traces]
    med = sorted(range(len(e)), key=lambda i: e[i])[len(e) // 2]
    meta = {
        "step_time_source": "graph_replay",
        "graph_replay_step_times_us": g,
        "graph_replay_step_time_us": statistics.median(g) if g else None,
        "eager_step_times_us": e,
        "eager_step_time_us": statistics.median(e),
        "spans_source": "eager pass: op by op, one CUDA-event span per op (graphs not replayed)",
    }
    return eager_traces[med], meta


def _run_once(runners: list[RankRunner], log: RunLog) -> None:
    """One run of every rank's Program, its kernels logged into ``log`` (this run's only)."""
    for r in runners:
        if hasattr(r.backend, "reset_run"):
            r.backend.reset_run()
        r.reset()
        r.log = log
        r.host_t0 = time.perf_counter()
        if r.gpu is not None:
            r.start_clock()
    procs = {r.rp.rank: r.process() for r in runners}
    while procs:
        progressed = False
        for rank in list(procs):
            try:
                progressed |= next(procs[rank]) > 0
            except StopIteration:
                del procs[rank]
                progressed = True
        if procs and not progressed:
            raise RuntimeError(f"deadlock: ranks {sorted(procs)} wait on receives nobody sends")
    for r in runners:
        if r.gpu is not None:
            r.collect_gpu_spans()


def _run_meta(runners: list[RankRunner], backend, log: RunLog, precision: fp8.Precision) -> dict:
    """What one timed run used: the GEMM kernels by label (counted for this run only), how each
    SM limit of the Program was honoured (compute ops here, all-to-alls by the backend)."""
    from overlap_lab.real.gemm import DEEP_GEMM_ERRORS

    limits: dict[str, dict] = {}
    for r in runners:
        for name, v in r.sm_limits.items():
            limits.setdefault(name, v)
    comm = {k: dict(v) for k, v in getattr(backend, "sm_limits", {}).items()}
    meta = {
        "sm_budget_mechanisms": dict(log.gemms),
        "sm_limits": {"compute": limits, "comm": comm},
    }
    meta["gemm_precision"] = precision_meta(log.gemms, precision)
    if log.notes:
        meta["kernel_notes"] = dict(log.notes)
    if "attention" in log.kernels:
        meta["attention_kernels"] = dict(log.kernels["attention"])
    if DEEP_GEMM_ERRORS:
        meta["deep_gemm_errors"] = dict(DEEP_GEMM_ERRORS)
    return meta


def precision_meta(applied: dict[str, int], p: fp8.Precision) -> dict:
    """The run's GEMM precision: what the workload asked for (``p``), what ran (``fp8``, ``bf16``,
    or ``mixed`` when FP8 GEMMs fell back to BF16 after a DeepGEMM failure), why, and the counts."""
    n_fp8 = sum(n for k, n in applied.items() if k.startswith("deep_gemm.") and "fp8" in k)
    n_back = sum(n for k, n in applied.items() if k.startswith("bf16 fallback"))
    used = p.used
    if p.fp8 and n_back:
        used = "mixed" if n_fp8 else "bf16"
    return {"requested": p.requested, "used": used, "reason": p.reason,
            "fp8_gemms": n_fp8, "bf16_fallbacks": n_back}  # fmt: skip


@dataclass(frozen=True)
class Setup:
    """What a call of :func:`execute` runs with, fixed before its first run."""

    device: torch.device
    dtype: torch.dtype
    check_hazards: bool
    backend: Any
    precision: fp8.Precision
    runners: tuple[RankRunner, ...]
    has_graphs: bool  # the Program holds Graphs
    graph_timed: bool  # captured graphs on a GPU: an eager pass, then timed replays

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def setup(
    program: Program,
    workload,
    *,
    weights: M.ModelWeights | None,
    backend,
    device: str,
    dtype: torch.dtype | None,
    seed: int,
    check_hazards: bool | None,
    ranks: list[int] | None,
    host_spin: bool,
    cuda_graphs: bool,
) -> Setup:
    """Defaults resolved, weights made (this rank's experts) and, for an FP8 run, quantised
    once here (never inside a step or a captured graph), the run's precision resolved, one
    RankRunner per rank this process runs."""
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if dtype is None:
        dtype = torch.bfloat16 if cuda else torch.float32
    if check_hazards is None:
        check_hazards = not cuda
    cfg = M.from_model_config(workload.model)
    if backend is None:
        from overlap_lab.real.comm.loopback import LoopbackBackend

        backend = LoopbackBackend(rank=0, world=1, num_experts=cfg.num_experts, hidden=cfg.hidden)
    if weights is None:  # this rank's experts: all of them with the local backend
        weights = M.init_weights(
            cfg, seed=seed, dtype=dtype, device=dev, ep_rank=backend.rank, ep_size=backend.world
        )
    from overlap_lab.real.gemm import deep_gemm_module

    precision = fp8.resolve(
        workload.model.gemm_dtype, cuda=cuda, module=deep_gemm_module() if cuda else None
    )
    fp8_weights = fp8.load_weights(weights) if precision.fp8 else None
    mailbox = Mailbox()
    chosen = [rp for rp in program.ranks if ranks is None or rp.rank in ranks]
    runners = tuple(
        RankRunner(
            rp,
            program,
            weights=weights,
            backend=backend,
            workload=workload,
            device=dev,
            seed=seed,
            check_hazards=check_hazards,
            world=mailbox,
            host_spin=host_spin,
            cuda_graphs=cuda_graphs,
            precision=precision,
            fp8_weights=fp8_weights,
        )
        for rp in chosen
    )
    has_graphs = any(isinstance(i, Graph) for rp in chosen for th in rp.threads for i in th.instrs)
    return Setup(
        dev, dtype, check_hazards, backend, precision, runners, has_graphs,
        graph_timed=cuda and has_graphs and cuda_graphs,
    )  # fmt: skip


@dataclass(frozen=True)
class Run:
    """One recorded run: its trace and what its kernels used (:func:`_run_meta`)."""

    trace: Trace
    meta: dict


@dataclass(frozen=True)
class Runs:
    """The recorded runs of a call: the timed ones and, for a graph-timed call, the eager pass."""

    timed: tuple[Run, ...]
    eager: tuple[Run, ...]


def run(su: Setup, *, warmup: int, repeats: int) -> Runs:
    """``warmup`` unrecorded runs, then (graph-timed) an eager pass of ``max(1, repeats)`` runs
    (op by op: per-op spans, and the kernels' bookkeeping, which a replay skips), then
    ``repeats`` timed runs, last, so the outputs left in the runners are theirs."""
    phases = ["warmup"] * warmup + ["eager"] * (max(1, repeats) if su.graph_timed else 0)
    phases += ["timed"] * repeats
    timed: list[Run] = []
    eager: list[Run] = []
    try:
        for phase in phases:
            for r in su.runners:
                r.force_eager = phase == "eager"
            log = RunLog()
            _run_once(list(su.runners), log)
            if phase == "warmup":
                continue
            tr = Trace([s for r in su.runners for s in r.spans], {})
            rec = Run(tr, _run_meta(list(su.runners), su.backend, log, su.precision))
            (eager if phase == "eager" else timed).append(rec)
    finally:
        for r in su.runners:
            r.force_eager = False
    return Runs(tuple(timed), tuple(eager))


@dataclass(frozen=True)
class ExecMeta:
    """The trace meta of a call, as one record: :meth:`as_dict` lays it out key by key in the
    order consumers have always read it (the Program's meta, the backend's, the run's setup,
    the caller's ``meta``, then how it was timed, what its kernels used, its step times)."""

    program: dict
    backend: dict
    device: str
    dtype: str
    world: int
    setup_notes: dict  # the CPU's graph and timing notes, pp in one process
    caller: dict
    timing: dict  # step_time_source, spans_source (+ the graph-timed pair of measurements)
    run: dict  # _run_meta of the run whose spans the trace holds
    step_times_us: tuple[float, ...]
    warmup: int
    repeats: int
    gpu: dict  # clocks, cuda_graphs (a GPU run)

    def as_dict(self) -> dict:
        d = dict(self.program)
        d.update(self.backend)
        d.update(device=self.device, dtype=self.dtype, world=self.world)
        d.update(self.setup_notes)
        d.update(self.caller)
        d.update(self.timing)
        d.update(self.run)
        d.update(
            step_times_us=list(self.step_times_us),
            median_step_time_us=statistics.median(self.step_times_us),
            warmup=self.warmup,
            repeats=self.repeats,
        )
        d.update(self.gpu)
        return d


def _setup_notes(program: Program, su: Setup) -> dict:
    notes: dict[str, str] = {}
    if su.has_graphs and not su.cuda:
        notes["cuda_graphs"] = "CPU: graph bodies run op by op"
    if not su.cuda:
        notes["timing"] = "none: CPU spans are host wall-clock of ordered execution"
    if (program.meta.pp_size or 1) > 1:
        notes["pp_in_one_process"] = (
            "every pipeline stage runs in this one process (one device): not the timing of one "
            "stage per GPU"
        )
    return notes


def timing(su: Setup, runs: Runs) -> tuple[Trace, dict, dict]:
    """The run the trace shows (median step time; of a graph-timed call, the eager pass's, see
    :func:`timing_meta`), how it was timed, and what its kernels used."""
    times = [r.trace.step_time_us for r in runs.timed]
    med = sorted(range(len(times)), key=lambda i: times[i])[len(times) // 2]
    if su.graph_timed:
        trace, tmeta = timing_meta([r.trace for r in runs.timed], [r.trace for r in runs.eager])
        # the eager pass's bookkeeping: replays run no Python kernels
        run_meta = next(r.meta for r in runs.eager if r.trace is trace)
        captured = any(
            g.get("mode") == "captured" for r in su.runners for g in r.gpu.graphs.values()
        )
        if not captured:  # every graph fell back to op by op: both passes were eager
            tmeta["step_time_source"] = "eager (no graph captured: see cuda_graphs)"
        return trace, tmeta, run_meta
    tmeta = {
        "step_time_source": "eager" if su.cuda else "cpu",
        "spans_source": "op by op, one CUDA-event span per op"
        if su.cuda
        else "host wall-clock of ordered execution",
    }
    return runs.timed[med].trace, tmeta, runs.timed[med].meta


def _gpu_meta(su: Setup) -> dict:
    if not su.cuda:
        return {}
    cm = next((r.gpu.clock for r in su.runners if r.gpu.clock is not None), None)
    out: dict[str, Any] = {"clocks": cm.describe() if cm is not None else None}
    if su.has_graphs:
        out["cuda_graphs"] = {
            g["name"]: g["mode"] + (f" ({g['reason']})" if g.get("reason") else "")
            for r in su.runners
            for g in r.gpu.graphs.values()
        }
    return out


def execute(
    program: Program,
    workload,
    *,
    weights: M.ModelWeights | None = None,
    backend=None,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
    check_hazards: bool | None = None,
    ranks: list[int] | None = None,
    warmup: int = 0,
    repeats: int = 1,
    host_spin: bool = False,
    meta: dict | None = None,
    cuda_graphs: bool = True,
) -> ExecResult:
    """Run ``program`` for ``workload``. ``ranks``: which of the Program's ranks this process
    runs (default: all it holds). On the CPU hazards are checked by default; a violation raises
    HazardError listing them. On a GPU, ``warmup`` unrecorded runs, then ``repeats`` timed runs;
    the Trace is the repeat with the median step time (all step times in its meta). On a GPU
    with ``cuda_graphs``, each Graph runs op by op on its first run, is captured on its second
    and replayed from then on (``warmup >= 2`` times only replays); the trace meta
    ``cuda_graphs`` says, per graph, "captured" or why it ran op by op."""
    su = setup(
        program, workload, weights=weights, backend=backend, device=device, dtype=dtype,
        seed=seed, check_hazards=check_hazards, ranks=ranks, host_spin=host_spin,
        cuda_graphs=cuda_graphs,
    )  # fmt: skip
    runs = run(su, warmup=warmup, repeats=repeats)
    violations = [v for r in su.runners if r.tracker for v in r.tracker.violations]
    if violations and su.check_hazards:
        raise HazardError(
            f"{len(violations)} unordered read(s) in schedule {program.meta.schedule!r}:\n  "
            + "\n  ".join(violations[:10])
        )
    trace, tmeta, run_meta = timing(su, runs)
    em = ExecMeta(
        program=program.meta.as_dict(),
        backend=dict(su.backend.describe()),
        device=str(su.device),
        dtype=str(su.dtype).replace("torch.", ""),
        world=program.world,
        setup_notes=_setup_notes(program, su),
        caller=dict(meta or {}),
        timing=tmeta,
        run=run_meta,
        step_times_us=tuple(r.trace.step_time_us for r in runs.timed),
        warmup=warmup,
        repeats=repeats,
        gpu=_gpu_meta(su),
    )
    trace.meta.update(em.as_dict())
    outputs = {r.rp.rank: r.states for r in su.runners}
    return ExecResult(outputs, trace, violations)
