"""One rank's interpreter: its host instructions in issue order, its step states, its streams.

Host side (both devices): the rank's instructions run in the order ``shared.ir.issue`` gives
(host threads one at a time, handing over round robin at ``Yield``), exactly as the simulator
walks them. Ranks of a non-symmetric Program run in one process as coroutines that meet at
point-to-point ops (``Mailbox``); a receive whose data has not been sent yet pauses its rank.

CPU: streams become ordered execution in issue order, every read checked by ``real.hazards``;
a ``Graph`` runs instruction by instruction, like the simulator's graph launch. GPU: torch CUDA
streams and events, each op bracketed by CUDA events and a profiler range, compute SM budgets
scoped (``KernelCtx.sm_budget``), comm SM budgets given to the backend; a ``Graph`` is captured
once with torch.cuda.graph per its plan (``real.graphs``) and replayed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from overlap_lab.real import fp8
from overlap_lab.real import kernels as K
from overlap_lab.real.clocks import Anchor, ClockMap, anchor
from overlap_lab.real.graphs import GraphPlan, plan_graphs
from overlap_lab.real.hazards import HazardTracker
from overlap_lab.real.runlog import RunLog
from overlap_lab.shared.ir.issue import issue_order
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
    iter_gpu_instrs,
)
from overlap_lab.shared.outputs.trace import Span


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


def _steps_of(rp) -> list[int]:
    steps = set()
    for th in rp.threads:
        for ins in iter_gpu_instrs(th.instrs):
            if isinstance(ins, Launch):
                steps.add(ins.op.step if ins.op.step is not None else 0)
    return sorted(steps) or [0]


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
        kernels: K.Bindings | None = None,
    ):
        self.precision, self.fp8_weights = precision, fp8_weights
        self.kernels = kernels if kernels is not None else K.bindings()
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
            for ins in iter_gpu_instrs(th.instrs):
                if isinstance(ins, Launch):
                    ops.add((ins.op.name, ins.op.step, ins.op.layer, ins.op.mb))
                    if ins.op.waits:  # SBO mode 1: a combine that polls the down GEMM's signal
                        polling.add((ins.op.step, ins.op.layer, ins.op.mb))
                    base, k = self.kernels.split_piece(ins.op.name)
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
        self.order = issue_order(rp)
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
        fn = self.kernels.bind(op.name)
        fn = self._limit_checked(op, fn)
        base, k = self.kernels.split_piece(op.name)
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
        t0 = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with (
            torch.cuda.stream(s),
            torch.profiler.record_function(f"{op.name}.L{op.layer}.mb{op.mb}"),
        ):
            start.record(s)
            fn(ctx)
            end.record(s)
        self.gpu.timed.append((op, stream, start, end))
        self.log.launched(op.name, (time.perf_counter() - t0) * 1e6)  # its host time

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
            name = self.kernels.split_piece(op.name)[0]
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
            t0 = time.perf_counter()
            st["graph"].replay()
            self.log.graph_launched(g.name, (time.perf_counter() - t0) * 1e6)
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
        """A coroutine running this rank's host instructions in issue order
        (``shared.ir.issue.issue_order``, the simulator's); yields (instructions run since the
        last yield) when a receive must wait for another rank, and goes on with the same
        instruction when resumed. On a GPU a Graph is one instruction (captured and replayed);
        on the CPU its body runs instruction by instruction, as the simulator's graph launch."""
        done = 0
        for it in self.order:
            if isinstance(it.instr, Yield):
                continue
            unit = self.gpu is not None or not isinstance(it.instr, Graph)
            for ins in (it.instr,) if unit else it.instr.body:
                while True:
                    try:
                        self.run_instr(ins, it.thread)
                        done += 1
                        break
                    except K.WouldBlock:
                        yield done  # instructions run since the last block: progress if > 0
                        done = 0

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


def run_once(runners: list[RankRunner], log: RunLog) -> None:
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
            raise RuntimeError(
                f"deadlock: ranks {sorted(procs)} wait on receives nobody sends (the validator "
                "admits no such Program: a bug of the executor)"
            )
    for r in runners:
        if r.gpu is not None:
            r.collect_gpu_spans()


@dataclass(frozen=True)
class Setup:
    """What a call of ``real.executor.execute`` runs with, fixed before its first run."""

    device: torch.device
    dtype: torch.dtype
    check_hazards: bool
    backend: Any
    precision: fp8.Precision
    runners: tuple[RankRunner, ...]
    has_graphs: bool  # the Program holds Graphs
    graph_timed: bool  # captured graphs on a GPU: an eager pass, then timed replays
    kernels: K.Bindings  # op name -> kernel for this call (real.kernels.registry)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"
