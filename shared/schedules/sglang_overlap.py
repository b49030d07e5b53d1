"""SGLang's CPU-GPU overlap scheduler (L1): the host schedules batch N+1 and processes N-1's
result while the GPU runs batch N (docs/schedules.md; SGLang ``Scheduler.event_loop_overlap``).

Streams: ``schedule`` (the event loop runs inside its stream context, so the GPU
ops issued while scheduling land here), ``forward`` (the model forward, FutureMap resolve/store)
and ``copy`` (the non-blocking D2H of next_token_ids / logprobs). One host thread, the scheduler.

One loop iteration, as SGLang runs it::

    ① recv_requests + process_input_requests                     host
    ③ get_next_batch_to_run (schedule N)                         host, + GPU ops on `schedule`
    ④ is_disable_overlap_for_batch(N) -> if so: process N-1 now  host (forced serial)
    ⑤ run_batch(N): forward.wait_stream(schedule)                GPU-side wait, host goes on
                    resolve_future -> forward N -> store_to_map  `forward`
                    D2H next_token_ids (+ logprobs)              `copy`, after `forward`
                    copy_done(N).record()                        `copy`
    ⑦ process_batch_result(N-1): copy_done(N-1).synchronize()   the ONLY host block
                    -> process -> send to the detokenizer        host
    ⑧ launch_batch_sample_if_needed(N)                           grammar: sample N on `forward`

The sync in ⑦ waits for batch N-1 while batch N is already queued, so the host is never more
than one step ahead. FutureMap hands batch N+1 negative placeholder ids for the
tokens batch N has not sampled yet; ``resolve_future`` replaces them on the forward stream, where
stream order guarantees that batch N's ``store_to_map`` has run.

With ``cfg.disable_overlap_schedule`` the module emits SGLang's ``event_loop_normal`` instead
(``--disable-overlap-schedule``): everything on the schedule stream, the result processed right
after its own forward (``next_token_ids.tolist()`` syncs), so the two can be compared.

Iterations follow ``cfg.iteration_modes`` (default: the workload batch's mode every time). The
requests are a cohort shaped like the workload's batch: a prefill iteration admits a new cohort
(the workload's prefill batch, or, for a decode workload, prompts of its kv_lens), a decode
iteration decodes every running request (the workload's decode batch and every cohort prefilled
so far, SGLang merging the last prefill batch into the running batch), one token (or
``tokens_per_seq``) each. A prefill batch runs whole: SGLang's chunked prefill would cut one
above ``chunked_prefill_size`` tokens, which here only sizes the FutureMap.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from statistics import median

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.inputs.knobs import knob
from overlap_lab.shared.inputs.workload import Batch, MicroBatch, Workload
from overlap_lab.shared.ir.builder import RankBuilder, ThreadBuilder, program
from overlap_lab.shared.ir.ops_sched import (
    SCHED_OP_NAMES,
    d2h_ops,
    resolve_future_op,
    schedule_ops,
    store_to_map_op,
)
from overlap_lab.shared.ir.program import Op, Program
from overlap_lab.shared.ir.program_meta import ProgramMeta
from overlap_lab.shared.outputs.trace import Trace, union
from overlap_lab.shared.schedules.common import (
    MAX_ITERATIONS,
    MAX_SEQS,
    MAX_TOKENS,
    Drawing,
    ScheduleKnobs,
)
from overlap_lab.shared.schedules.config import ScheduleConfig
from overlap_lab.shared.schedules.launch import (
    Deployment,
    ServerLaunch,
    sglang,
    sglang_env,
    sglang_flag,
)
from overlap_lab.shared.schedules.serial import forward_sequence, launch_all

UPSTREAM = "SGLang Scheduler.event_loop_overlap (python/sglang/srt/managers/scheduler.py), FutureMap (python/sglang/srt/managers/overlap_utils.py)"
SUMMARY = (
    "CPU-GPU overlap scheduler: schedule/forward/copy streams, FutureMap, one host sync "
    "(copy_done) per iteration, host one step ahead; --disable-overlap-schedule for the serial loop"
)


def _modes_fit_iterations(modes: tuple[str, ...], k: Knobs) -> str | None:
    if len(modes) > k.iterations:
        return f"lists {len(modes)} modes for --iterations {k.iterations}"
    return None


@dataclass(frozen=True)
class Knobs(ScheduleKnobs):
    """The overlap scheduler's own knobs (``ScheduleConfig.of``)."""

    iterations: int = knob(
        4, "scheduler iterations simulated", unit="iterations", lo=1, hi=MAX_ITERATIONS
    )
    disable_overlap_schedule: bool = knob(False, "--disable-overlap-schedule (event_loop_normal)")
    disable_consecutive_prefill_overlap: bool = knob(
        False, "SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP"
    )
    spec_v2: bool = knob(False, "the batches are spec-v2 (overlapped speculative decoding)")
    grammar: bool = knob(False, "requests carry a grammar (structured output)")
    return_logprob: bool = knob(False, "copy logprobs to the host with next_token_ids")
    iteration_modes: tuple[str, ...] = knob(
        (),
        '"prefill"/"decode" per iteration; last one repeats',
        choices=("prefill", "decode"),
        check=_modes_fit_iterations,
    )
    max_running_requests: int | None = knob(
        None, "FutureMap sizing (None: largest running batch)", unit="requests", lo=1, hi=MAX_SEQS
    )
    chunked_prefill_size: int | None = knob(
        8192, "FutureMap sizing; None: chunked prefill off", unit="tokens", lo=1, hi=MAX_TOKENS
    )
    context_len: int | None = knob(
        None, "FutureMap sizing (None: longest sequence simulated)", unit="tokens", lo=1, hi=1 << 24
    )


#: SGLang turns the overlap scheduler off under pipeline parallelism (event_loop_pp runs).
SUPPORTS_PP = False
STREAMS_OVERLAP = ("schedule", "forward", "copy")
STREAMS_NORMAL = ("schedule",)
HOST_THREAD = "scheduler"


# ----------------------------------------------------------------------------------------------
# The iterations: which batch the scheduler runs at each step
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Iteration:
    """One turn of the event loop: the batch ``get_next_batch_to_run`` returns at ``step``.

    ``reqs`` are the request ids in the batch (a cohort's ids are consecutive), so the FutureMap
    can follow each request's placeholder from the batch that sampled it to the batch that reads
    it; ``running`` counts every request admitted and not finished (none finish here).
    """

    step: int
    batch: Batch
    reqs: tuple[int, ...]
    running: int  # requests running once this batch is scheduled (held against max_running)

    @property
    def mode(self) -> str:
        return self.batch.mode

    @property
    def is_extend(self) -> bool:
        return self.batch.mode == "prefill"


def iteration_modes(w: Workload, cfg: ScheduleConfig) -> tuple[str, ...]:
    """--iteration-modes padded to --iterations by repeating its last mode."""
    k = cfg.of(Knobs)
    modes = tuple(k.iteration_modes) or (w.batch.mode,)
    return modes + (modes[-1],) * (k.iterations - len(modes))


def plan_iterations(w: Workload, cfg: ScheduleConfig) -> tuple[Iteration, ...]:
    """The batch of every iteration (see the module docstring for the request model)."""
    b = w.batch
    if b.mode == "prefill":
        extend, prefix, tps = b.extend_lens, b.prefix_lens, 1
        running: dict[int, int] = {}
    else:
        extend, prefix, tps = b.kv_lens, (0,) * b.num_seqs, b.tokens_per_seq
        running = dict(enumerate(b.kv_lens))  # request id -> tokens in its KV cache
    next_id = len(running)
    out = []
    for step, mode in enumerate(iteration_modes(w, cfg)):
        if mode == "prefill":
            reqs = tuple(range(next_id, next_id + len(extend)))
            next_id += len(extend)
            batch = Batch.prefill(extend_lens=extend, prefix_lens=prefix)
            running.update({r: p + e for r, p, e in zip(reqs, prefix, extend, strict=True)})
        else:
            if not running:
                raise ConfigError(
                    f"iteration {step} is a decode but no request is running yet: "
                    "start --iteration-modes with prefill"
                )
            reqs = tuple(sorted(running))
            batch = Batch.decode(kv_lens=[running[r] for r in reqs], tokens_per_seq=tps)
            running = {r: kv + tps for r, kv in running.items()}
        out.append(Iteration(step, batch, reqs, len(running)))
    return tuple(out)


def whole(batch: Batch) -> MicroBatch:
    return MicroBatch(0, 0, batch.num_seqs, 0, batch.num_tokens, batch.num_tokens)


# ----------------------------------------------------------------------------------------------
# FutureMap: the ring buffer of future token ids (overlap_utils.py)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FutureMapSize:
    """FutureMap's sizing, as upstream computes it.

    ``future_limit = max_running_requests * (3 + max_num_chunks)`` is where the allocation pointer
    wraps; the buffer holds ``future_limit + 2 * max_running_requests`` slots (an allocation that
    starts just below the limit runs past it). Slot 0 is never handed out: placeholders are
    ``-index`` and must be negative.
    """

    max_running_requests: int
    max_num_chunks: int

    @classmethod
    def of(cls, mrr: int, chunked_prefill_size: int | None, context_len: int) -> FutureMapSize:
        chunks = (
            (context_len + chunked_prefill_size - 1) // chunked_prefill_size
            if chunked_prefill_size
            else 0
        )
        return cls(mrr, chunks)

    @property
    def future_limit(self) -> int:
        return self.max_running_requests * (3 + self.max_num_chunks)

    @property
    def future_buffer_len(self) -> int:
        return self.future_limit + 2 * self.max_running_requests


class FutureRingOverwrite(AssertionError):
    """A FutureMap allocation would overwrite a slot whose token no batch has read yet."""


class FutureRing:
    """alloc_future_indices / resolve_future as bookkeeping on slot numbers.

    A slot is *pending* from the allocation of the batch that will store its token until the
    batch that reads it (the request's next decode) has resolved it; allocating a pending slot
    again would overwrite a token before it is read. Allocation order is forward-stream order
    (the host allocates just before launching, and resolve/store run on the forward stream), so
    checking in allocation order is checking on the GPU's order.
    """

    def __init__(self, size: FutureMapSize, limit: int | None = None):
        self.size = size
        self.limit = limit if limit is not None else size.future_limit
        self.ct = 0
        self.pending: dict[int, tuple[int, int]] = {}  # slot -> (step that stores it, request)

    def alloc(self, step: int, reqs: tuple[int, ...]) -> tuple[int, int]:
        """Upstream: start = ct + 1; ct = (ct + bs) % future_limit; slots [start, start + bs)."""
        bs = len(reqs)
        if bs > self.size.max_running_requests:
            raise FutureRingOverwrite(
                f"step {step}: batch of {bs} exceeds max_running_requests="
                f"{self.size.max_running_requests}"
            )
        start = self.ct + 1
        self.ct = (self.ct + bs) % self.limit
        end = start + bs
        if end > self.size.future_buffer_len:
            raise FutureRingOverwrite(f"step {step}: slots [{start}, {end}) run past the buffer")
        for slot, req in zip(range(start, end), reqs, strict=True):
            if slot in self.pending:
                owner, r = self.pending[slot]
                raise FutureRingOverwrite(
                    f"step {step}: slot {slot} still holds request {r}'s token from step "
                    f"{owner}, not yet resolved"
                )
            self.pending[slot] = (step, req)
        return start, end

    def resolve(self, reqs: tuple[int, ...]) -> list[int]:
        """The batch reading ``reqs``' placeholders resolves them; returns the steps it read from."""
        want = set(reqs)
        done = [s for s, (_, r) in self.pending.items() if r in want]
        steps = sorted({self.pending[s][0] for s in done})
        for s in done:
            del self.pending[s]
        return steps


def future_map_size(plan: tuple[Iteration, ...], cfg: ScheduleConfig) -> FutureMapSize:
    k = cfg.of(Knobs)
    largest = max(plan, key=lambda it: it.running)
    mrr = k.max_running_requests or largest.running
    if mrr < largest.running:
        raise ConfigError(
            f"--max-running-requests {mrr} is below the {largest.running} requests "
            f"running at iteration {largest.step}"
        )
    longest = max(
        it.batch.seq_cached(i) + it.batch.seq_tokens(i)
        for it in plan
        for i in range(it.batch.num_seqs)
    )
    if k.context_len is not None and k.context_len < longest:
        raise ConfigError(
            f"--context-len {k.context_len} is below the longest sequence simulated "
            f"({longest} tokens); give at least {longest}"
        )
    return FutureMapSize.of(mrr, k.chunked_prefill_size, k.context_len or longest)


def walk_future_map(plan: tuple[Iteration, ...], ring: FutureRing) -> list[dict]:
    """Per step: the slots it allocates and the steps whose placeholders it resolves.

    resolve_future runs before the forward, store_to_map after it, so a decode first resolves
    its requests' pending slots and then allocates new ones. Prefill input ids are real tokens
    (nothing to resolve). A cohort's pending slots from a prefill stay pending across later
    prefills until a decode reads them.
    """
    out = []
    for it in plan:
        reads = ring.resolve(it.reqs) if it.mode == "decode" else []
        start, end = ring.alloc(it.step, it.reqs)
        out.append({"step": it.step, "alloc": [start, end], "resolves": reads})
    return out


# ----------------------------------------------------------------------------------------------
# Forced serial cases (is_disable_overlap_for_batch)
# ----------------------------------------------------------------------------------------------


def disable_overlap_reason(
    cfg: ScheduleConfig, it: Iteration, last: Iteration | None, result_queue_len: int
) -> str | None:
    """Why SGLang processes the last batch before launching this one, or None (overlap)."""
    k = cfg.of(Knobs)
    if k.disable_consecutive_prefill_overlap and last is not None:
        if it.is_extend and last.is_extend:
            return "consecutive prefill (SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP)"
    if k.spec_v2 and k.grammar and it.mode == "decode" and result_queue_len > 0:
        return "spec v2 + grammar + decode with a pending result"
    return None


def delays_sample(cfg: ScheduleConfig) -> bool:
    """Grammar without speculative decoding: the sample waits for the last batch's grammar state
    (tp_worker: enable_overlap and not enable_spec and grammars is not None)."""
    k = cfg.of(Knobs)
    return k.grammar and not k.spec_v2


# ----------------------------------------------------------------------------------------------
# Emission
# ----------------------------------------------------------------------------------------------


def _scheduling(t: ThreadBuilder, cfg: ScheduleConfig, it: Iteration) -> None:
    """① recv + process_input, ③ get_next_batch_to_run with its GPU ops on the schedule stream."""
    h, i = cfg.host, it.step
    t.host("recv_requests", h.recv_requests_us, step=i)  # + process_input_requests
    t.host("get_next_batch_to_run", h.schedule_us(it.batch.num_seqs), step=i)
    for op in schedule_ops(it.batch, step=i):
        t.launch(op, "schedule")


def _forward_ops(w: Workload, gpu: GPU, cfg: ScheduleConfig, it: Iteration) -> list[Op]:
    wi = dataclasses.replace(w, batch=it.batch)
    mode = cfg.resolved_deepep_mode(it.mode)
    return forward_sequence(wi, gpu, whole(it.batch), deepep_mode=mode, step=it.step)


def _process(t: ThreadBuilder, cfg: ScheduleConfig, done: tuple[int, int, str]) -> None:
    """⑦ process_batch_result: the one host block, then the CPU work, then the detokenizer."""
    step, num_reqs, event = done
    h = cfg.host
    t.sync(event)
    t.host("process_batch_result", h.process_result_us(num_reqs), step=step)
    t.host("send_to_detokenizer", h.detokenizer_send_us, step=step)


def _copy_to_cpu(t: ThreadBuilder, cfg: ScheduleConfig, it: Iteration) -> str:
    """store_to_map on `forward`, then the D2H on `copy` once `forward` is done, then copy_done."""
    k = cfg.of(Knobs)
    i = it.step
    t.launch(store_to_map_op(it.batch, step=i), "forward")
    t.record(f"forward_done.{i}", "forward")
    t.wait("copy", f"forward_done.{i}")
    for op in d2h_ops(it.batch, step=i, return_logprob=k.return_logprob):
        t.launch(op, "copy")
    t.record(f"copy_done.{i}", "copy")
    return f"copy_done.{i}"


def _build_overlap(
    w: Workload, gpu: GPU, cfg: ScheduleConfig, plan: tuple[Iteration, ...]
) -> tuple[RankBuilder, list[dict]]:
    """event_loop_overlap over the planned iterations; returns the rank and the loop's record."""
    rank = RankBuilder(0, STREAMS_OVERLAP)
    t = rank.thread(HOST_THREAD)
    result_queue: deque[tuple[int, int, str]] = deque()  # (step, requests, copy_done event)
    delayed = delays_sample(cfg)
    info: list[dict] = []
    last: Iteration | None = None
    for it in plan:
        i, graph = it.step, cfg.use_cuda_graph(it.mode)
        row = {"step": i, "processes": [], "forced_serial": None, "delayed_sample": delayed}
        # ① ③ receive, schedule batch N (GPU ops on the schedule stream)
        _scheduling(t, cfg, it)
        # ④ is_disable_overlap_for_batch: process N-1 before launching N
        reason = disable_overlap_reason(cfg, it, last, len(result_queue))
        if reason and result_queue:
            row["forced_serial"] = reason
            done = result_queue.popleft()
            _process(t, cfg, done)
            row["processes"].append({"step": done[0], "before_launch": True})
        # ⑤ run_batch(N): alloc_future_indices on the host; then, on the forward stream,
        # a GPU-side wait for the schedule stream's ops, resolve_future and the forward.
        t.wait_stream("forward", "schedule")
        t.launch(resolve_future_op(it.batch, step=i), "forward")
        ops = _forward_ops(w, gpu, cfg, it)
        (sample,) = [op for op in ops if op.name == "sample"]
        if delayed:  # grammar: sampling waits for the last batch's grammar state (⑧)
            ops = [op for op in ops if op is not sample]
        launch_all(t, ops, "forward", graph=f"forward.{i}" if graph else None)
        if not delayed:
            result_queue.append((i, it.batch.num_seqs, _copy_to_cpu(t, cfg, it)))
        # ⑦ process batch N-1 while the GPU runs batch N
        if last is not None and not reason and result_queue and result_queue[0][0] != i:
            done = result_queue.popleft()
            _process(t, cfg, done)
            row["processes"].append({"step": done[0], "before_launch": False})
        # ⑧ launch_batch_sample_if_needed(N): sample, store_to_map, D2H on the forward stream
        if delayed:
            t.wait_stream("forward", "schedule")
            t.launch(sample, "forward")
            result_queue.append((i, it.batch.num_seqs, _copy_to_cpu(t, cfg, it)))
        info.append(row)
        last = it
    # The loop's next turn would process the last batch; do it so every result is delivered.
    while result_queue:
        done = result_queue.popleft()
        _process(t, cfg, done)
        info.append({"step": None, "processes": [{"step": done[0], "before_launch": False}]})
    return rank, info


def _build_normal(
    w: Workload, gpu: GPU, cfg: ScheduleConfig, plan: tuple[Iteration, ...]
) -> tuple[RankBuilder, list[dict]]:
    """event_loop_normal: recv, schedule, forward and the blocking result copy on one stream."""
    k = cfg.of(Knobs)
    rank = RankBuilder(0, STREAMS_NORMAL)
    t = rank.thread(HOST_THREAD)
    info = []
    for it in plan:
        i, graph = it.step, cfg.use_cuda_graph(it.mode)
        _scheduling(t, cfg, it)
        launch_all(
            t, _forward_ops(w, gpu, cfg, it), "schedule", graph=f"forward.{i}" if graph else None
        )
        # process_batch_result: next_token_ids.tolist() copies on the current stream and blocks
        for op in d2h_ops(it.batch, step=i, return_logprob=k.return_logprob):
            t.launch(op, "schedule")
        t.record(f"result_ready.{i}", "schedule")
        _process(t, cfg, (i, it.batch.num_seqs, f"result_ready.{i}"))
        info.append(
            {
                "step": i,
                "processes": [{"step": i, "before_launch": False}],
                "forced_serial": "--disable-overlap-schedule",
                "delayed_sample": False,
            }
        )
    return rank, info


def build(w: Workload, gpu: GPU, cfg: ScheduleConfig) -> Program:
    k = cfg.of(Knobs)
    plan = plan_iterations(w, cfg)
    size = future_map_size(plan, cfg)
    overlap = not k.disable_overlap_schedule
    rank, info = (_build_overlap if overlap else _build_normal)(w, gpu, cfg, plan)
    future = {
        "max_running_requests": size.max_running_requests,
        "max_num_chunks": size.max_num_chunks,
        "future_limit": size.future_limit,
        "future_buffer_len": size.future_buffer_len,
        "slots": walk_future_map(plan, FutureRing(size)) if overlap else [],
    }
    iterations = []
    for it in plan:
        iterations.append(
            {
                "step": it.step,
                "mode": it.mode,
                "num_seqs": it.batch.num_seqs,
                "num_tokens": it.batch.num_tokens,
                "cuda_graph": cfg.use_cuda_graph(it.mode),
                "deepep_mode": cfg.resolved_deepep_mode(it.mode),
                "exceeds_chunked_prefill": bool(
                    it.is_extend
                    and k.chunked_prefill_size
                    and it.batch.num_tokens > k.chunked_prefill_size
                ),
            }
        )
    micro_batches = [dict(whole(it.batch).as_meta(), step=it.step) for it in plan]
    return program(
        [rank],
        world=w.parallel.ep,
        schedule="sglang-overlap",
        overlap=overlap,
        streams=list(STREAMS_OVERLAP if overlap else STREAMS_NORMAL),
        micro_batches=micro_batches,
        iterations=iterations,
        loop=info,
        future_map=future,
        disable_consecutive_prefill_overlap=k.disable_consecutive_prefill_overlap,
        spec_v2=k.spec_v2,
        grammar=k.grammar,
        return_logprob=k.return_logprob,
        deepep_mode=cfg.deepep_mode,
        host_costs=dataclasses.asdict(cfg.host),
    )


# ----------------------------------------------------------------------------------------------
# Reports: throughput per iteration, GPU idle time, TTFT of prefills (on a Trace of this module)
# ----------------------------------------------------------------------------------------------


def _model_spans(trace: Trace, step: int, rank: int = 0):
    return [
        s
        for s in trace.spans
        if s.rank == rank
        and s.step == step
        and s.lane.startswith("stream:")
        and s.kind != "copy"
        and s.op not in SCHED_OP_NAMES
    ]


def _host_span(trace: Trace, name: str, step: int, rank: int = 0):
    for s in trace.spans:
        if s.rank == rank and s.lane.startswith("host:") and s.op == name and s.step == step:
            return s
    return None


def overlap_report(
    trace: Trace,
    program: Program | None = None,
    *,
    baseline: Trace | None = None,
    rank: int = 0,
) -> dict:
    """What the overlap scheduler bought, from a simulated (or measured) trace of this module.

    - per iteration: its period (from the previous forward's last model op to this one's; the
      first from the start of the trace), tokens and tokens per second over that period; in the
      steady state this is the loop's iteration time;
    - GPU idle: time inside [first, last] GPU activity with no stream busy, and per iteration the
      gap between the previous forward's last model op and this forward's first;
    - per prefill: ``wait_us`` from the forward's last op (sample) to the end of its result
      processing (send to the detokenizer), ``ttft_us`` from its recv_requests to that end,
      whether its processing came only after the next batch's launch (``deferred``), and
      ``iterations_late``: how many loop iterations after its own the token was sent (1 under
      overlap, forced-serial or not; 0 for the normal loop; the drain counts as an iteration).

    The loop's bookkeeping comes from ``program.meta`` (or the trace's meta, which the simulator
    copies from the program). With ``baseline`` (a trace of the same iterations under
    ``--disable-overlap-schedule``) the report adds the speed-up and each prefill's TTFT cost.
    """
    meta = program.meta if program is not None else ProgramMeta.from_dict(trace.meta)
    if meta.schedule != "sglang-overlap":
        raise ConfigError("overlap_report needs a trace of the sglang-overlap schedule")
    iters = meta.extra["iterations"]
    deferred, drained = {}, set()
    for row in meta.extra.get("loop", []):
        for p in row["processes"]:
            if row["step"] is None:
                drained.add(p["step"])
            deferred[p["step"]] = row["step"] is not None and (
                row["step"] != p["step"] and not p["before_launch"]
            )
    recv = {it["step"]: _host_span(trace, "recv_requests", it["step"], rank) for it in iters}
    start = min(s.start for s in trace.spans)
    end = max(s.end for s in trace.spans)
    rows, prev_end = [], start
    for k, it in enumerate(iters):
        i = it["step"]
        model = _model_spans(trace, i, rank)
        f0, f1 = min(s.start for s in model), max(s.end for s in model)
        period = f1 - prev_end
        row = {
            "step": i,
            "mode": it["mode"],
            "tokens": it["num_tokens"],
            "period_us": period,
            "tokens_per_s": it["num_tokens"] / period * 1e6 if period > 0 else 0.0,
            "forward_us": f1 - f0,
            "forward_gap_us": max(f0 - prev_end, 0.0) if k else 0.0,
        }
        if it["mode"] == "prefill":
            fwd_end = max(s.end for s in model if s.op == "sample")
            sent = _host_span(trace, "send_to_detokenizer", i, rank)
            # loop iterations begun by the time it is sent (the drain stands for the next one)
            loop = sum(1 for r in recv.values() if r.start <= sent.start) + (i in drained)
            row.update(
                wait_us=sent.end - fwd_end,
                ttft_us=sent.end - recv[i].start,
                deferred=deferred.get(i, False),
                drained=i in drained,
                iterations_late=loop - 1 - k,
            )
        rows.append(row)
        prev_end = f1
    gpu = union(
        (s.start, s.end)
        for s in trace.spans
        if s.rank == rank and s.lane.startswith("stream:") and s.end > s.start
    )
    busy = sum(b - a for a, b in gpu)
    report = {
        "overlap": meta.extra.get("overlap", True),
        "total_us": end - start,
        "iterations": rows,
        "steady_period_us": median(r["period_us"] for r in rows[1:] or rows),
        "gpu_idle_us": (gpu[-1][1] - gpu[0][0] - busy) if gpu else 0.0,
        "forward_gap_us": sum(r["forward_gap_us"] for r in rows),
        "host_blocked_us": sum(
            s.duration for s in trace.spans if s.rank == rank and s.kind == "sync"
        ),
    }
    if baseline is not None:
        base = overlap_report(baseline, rank=rank)
        report["baseline"] = base
        report["speedup"] = base["total_us"] / report["total_us"]
        by_step = {r["step"]: r for r in base["iterations"]}
        for r in rows:
            if r["mode"] == "prefill":
                b = by_step[r["step"]]
                r["ttft_cost_us"] = r["ttft_us"] - b["ttft_us"]
                r["wait_cost_us"] = r["wait_us"] - b["wait_us"]
    return report


def report(trace: Trace, program: Program) -> dict:
    """What `overlap-lab sim --json` adds under "report" for this schedule."""
    return overlap_report(trace, program)


# ----------------------------------------------------------------------------------------------
# How its runs are counted, compared and drawn (shared.schedules' hooks)
# ----------------------------------------------------------------------------------------------

#: The host one iteration ahead shows across iterations: figures show the whole window.
DRAWING = Drawing(whole_window=True)


def iterations_and_tokens(program: Program, w: Workload) -> tuple[int, int]:
    """Its window: the planned iterations, each a forward of that iteration's batch."""
    its = program.meta.extra.get("iterations")
    if isinstance(its, list) and its:
        return len(its), sum(int(it["num_tokens"]) for it in its)
    return 1, w.batch.num_tokens


def window_note(cfg: ScheduleConfig) -> str:
    return f"sglang-overlap runs {cfg.of(Knobs).iterations} loop iterations (--iterations)."


def launch_flags(d: Deployment) -> ServerLaunch:
    """SGLang as it runs by default (the overlap scheduler on); this module's switches as
    SGLang spells them (docs/tune.md)."""
    k = d.cfg.of(Knobs)
    extra = []
    if k.disable_overlap_schedule:
        extra.append(sglang_flag("disable_overlap_schedule", carries="disable_overlap_schedule"))
    if k.disable_consecutive_prefill_overlap:
        name = "SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP"
        extra.append(sglang_env(name, "true", "disable_consecutive_prefill_overlap"))
    return sglang(d, tuple(extra))
