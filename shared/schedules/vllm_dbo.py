"""vLLM's Dual Batch Overlap (DBO): two ubatch host threads ping-pong at ``dbo_yield``.

Upstream (vllm/v1/worker/gpu_ubatch_wrapper.py, ubatching.py, ubatch_utils.py, dp_utils.py,
fused_moe/modular_kernel.py, prepare_finalize/deepep_ll.py and deepep_ht.py):

- ``GPUModelRunner`` decides per step whether to micro-batch: ``check_ubatch_thresholds`` (a
  uniform-decode batch needs ``num_tokens >= dbo_decode_token_threshold``, any other batch
  ``>= dbo_prefill_token_threshold``; the comparison is ``>=``), then ``coordinate_batch_across_dp``
  all-reduces the wish of every DP rank: all must agree, every rank is padded to the largest token
  count, and ubatching is aborted on every rank when ``is_last_ubatch_empty`` (the padded maximum
  halved reaches the smallest real count). The split point is ``padded // 2``; the second
  micro-batch takes the rest, padded out to the padded total.
- ``UBatchWrapper`` starts one thread per micro-batch; both run the whole model on their half.
  Both threads issue to the SAME two CUDA streams: the runner's compute stream and one comm
  stream (``make_ubatch_contexts(compute_stream=..., comm_stream=...)``, the "two CUDA streams" of
  vLLM's design notes). Thread 0 runs first; ``dbo_yield`` wakes the other thread and sleeps, so exactly one
  thread issues at a time (the IR's ``Yield``).
- Every yield lives in ``FusedMoEModularKernel``. DeepEP low-latency (decode):
  ``_prepare``: run the hook the other thread registered, dispatch send, register this dispatch's
  recv hook with the OTHER thread, yield; ``_finalize``: run the other's hook, combine send,
  shared experts, register the combine's recv hook with the other thread, yield. Everything is on
  the compute stream (LL kernels hold no SMs for communication: ``max_sms_used() == 0``).
  DeepEP high-throughput (prefill): no hooks; ``dbo_yield_and_switch_from_compute_to_comm``
  before dispatch and before combine, ``dbo_switch_to_compute_sync`` after dispatch, and
  ``dbo_yield_and_switch_from_comm_to_compute`` after the combine's output copy; the comm
  kernels hold ``min(VLLM_DBO_COMM_SMS, 20)`` SMs and DeepGEMM the rest.
- With full CUDA graphs (decode) the two threads run once, under capture; every later step
  replays the graph from one host thread: one launch, the captured body keeping the issue order.
- Stream priorities: vLLM sets none. The compute stream is the runner's current stream and the
  comm stream ``torch.cuda.Stream(device=device)`` (``UBatchWrapper.__init__``), both priority 0;
  ``make_ubatch_contexts`` creates no stream. But DeepEP's high-throughput ``Buffer.dispatch`` /
  ``combine`` launch their kernels on the Buffer's own ``comm_stream``, taken from PyTorch's
  high-priority pool (DeepEP ``csrc/deep_ep.cpp``: ``at::cuda::getStreamFromPool(true)``),
  after making it wait for the caller's stream (vLLM's comm stream here) and before making the
  caller wait for it (``async_finish=False``). The Program's ``comm`` stream holds only those
  kernels, in that order, so it is priority -1. The low-latency kernels with a receive hook
  launch on the caller's stream (``launch_stream = return_recv_hook ? compute_stream :
  comm_stream``): the default-priority ``main``.

The published order (vLLM's DBO design notes; docs/schedules.md) is the steady state of this
ping-pong. Its subscripts name the micro-batch whose attention comes first in the window as 0;
in the code's terms that is ubatch 1 (ubatch 0 starts the step and is half a layer ahead):
published X₀ is ubatch 1, X₁ ubatch 0.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field, replace

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.inputs.knobs import knob
from overlap_lab.shared.inputs.workload import MicroBatch, Workload
from overlap_lab.shared.ir.builder import RankBuilder, ThreadBuilder, program
from overlap_lab.shared.ir.ops import head_ops, layer_ops, mtp_ops, parts
from overlap_lab.shared.ir.program import (
    HIGH_PRIORITY,
    Graph,
    Launch,
    Op,
    Program,
    Record,
    Wait,
    WaitStream,
)
from overlap_lab.shared.ir.validate import issue_order
from overlap_lab.shared.schedules.common import (
    MAX_TOKENS,
    ScheduleKnobs,
    comm_sms_knob,
    resolve_comm_sms,
)
from overlap_lab.shared.schedules.config import ScheduleConfig
from overlap_lab.shared.schedules.launch import (
    VLLM_ARGS,
    Deployment,
    Flag,
    ServerLaunch,
    vllm,
    vllm_env,
)
from overlap_lab.shared.schedules.serial import forward_sequence, launch_all

UPSTREAM = "vLLM vllm/v1/worker/ubatching.py, gpu_ubatch_wrapper.py, dp_utils.py, model_executor/layers/fused_moe/modular_kernel.py"
SUMMARY = "vLLM DBO: two ubatch threads ping-pong at dbo_yield; each runs the other's recv hooks"
VLLM_DBO_COMM_SMS = 20  # vllm/envs.py: VLLM_DBO_COMM_SMS default "20"


@dataclass(frozen=True)
class Knobs(ScheduleKnobs):
    """vLLM DBO's own knobs (``ScheduleConfig.of``)."""

    comm_sms: int | None = comm_sms_knob(
        "prefill: VLLM_DBO_COMM_SMS, the SMs DeepEP's kernels keep while DeepGEMM takes the "
        f"rest, capped at DeepEP's 20 (None: {VLLM_DBO_COMM_SMS}; 0: SM control off)",
        least=0,
        tune=(0, 10),
    )
    dbo_decode_token_threshold: int = knob(
        32,
        "vLLM --dbo-decode-token-threshold",
        unit="tokens",
        lo=0,
        hi=MAX_TOKENS,
        tune=(64, 256),
    )
    dbo_prefill_token_threshold: int = knob(
        512,
        "vLLM --dbo-prefill-token-threshold",
        unit="tokens",
        lo=0,
        hi=MAX_TOKENS,
        tune=(2048, 8192),
    )
    dp_peer_tokens: tuple[int, ...] = knob(
        (), "other DP ranks' tokens (empty: as this)", unit="tokens", lo=0, hi=MAX_TOKENS
    )


DEEPEP_HT_NUM_SMS = 20  # vLLM DeepEPHTAll2AllManager.num_sms ("This is the DeepEP default")
THREADS = ("ubatch0", "ubatch1")
DEEPGEMM_CLASSES = ("gemm", "grouped_gemm")  # what deep_gemm.set_num_sms limits


# ----------------------------------------------------------------------------------------------
# The per-step decision: thresholds, DP agreement, padding, abort (dp_utils / ubatch_utils)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    """What ``coordinate_batch_across_dp`` settles for this step."""

    ubatch: bool
    padded_tokens: int  # this rank's tokens after DP padding
    reason: str | None = None  # why the batch runs unsplit


def check_ubatch_thresholds(cfg: ScheduleConfig, num_tokens: int, uniform_decode: bool) -> bool:
    """ubatch_utils.check_ubatch_thresholds: ``>=`` the decode or the prefill threshold."""
    k = cfg.of(Knobs)
    if uniform_decode:
        return num_tokens >= k.dbo_decode_token_threshold
    return num_tokens >= k.dbo_prefill_token_threshold


def is_last_ubatch_empty(
    orig_num_tokens: int, padded_num_tokens: int, num_ubatches: int = 2
) -> bool:
    """ubatch_utils.is_last_ubatch_empty."""
    return (padded_num_tokens // num_ubatches) * (num_ubatches - 1) >= orig_num_tokens


def dp_tokens(w: Workload, cfg: ScheduleConfig) -> tuple[int, ...]:
    """Tokens of every DP rank, this rank first (peers as this one unless given)."""
    dp = w.parallel.ep // w.parallel.attn_tp
    own, peers = w.batch.num_tokens, cfg.of(Knobs).dp_peer_tokens
    if not peers:
        return (own,) * dp
    if len(peers) != dp - 1:
        raise ConfigError(
            f"--dp-peer-tokens gives {len(peers)} ranks; DP size {dp} has {dp - 1} peers"
        )
    return (own, *peers)


def decide(w: Workload, cfg: ScheduleConfig) -> Decision:
    """``coordinate_batch_across_dp`` for every DP rank at once (peers run the same kind of
    batch as this one: a uniform decode when this batch is a decode)."""
    tokens = dp_tokens(w, cfg)
    uniform_decode = w.batch.mode == "decode"
    wants = [check_ubatch_thresholds(cfg, n, uniform_decode) for n in tokens]
    graph = _graph_mode(w, cfg)
    ubatch = all(wants)
    reason = None
    if not ubatch:
        thr = "dbo_decode_token_threshold" if uniform_decode else "dbo_prefill_token_threshold"
        limit = getattr(cfg.of(Knobs), thr)
        r = wants.index(False)
        who = "this rank" if r == 0 else f"DP rank {r}"
        reason = f"{who} has {tokens[r]} tokens < {thr} {limit}: no DP rank micro-batches"
    elif is_last_ubatch_empty(min(tokens), max(tokens)):
        ubatch = False
        reason = (
            f"second micro-batch would be empty: max padded tokens {max(tokens)} // 2 >= "
            f"min tokens {min(tokens)} across DP ranks"
        )
    # DP padding (should_dp_pad): when micro-batching or when every rank runs a CUDA graph.
    padded = max(tokens) if (ubatch or graph) else tokens[0]
    return Decision(ubatch, padded, reason)


def split(w: Workload, padded: int) -> tuple[MicroBatch, MicroBatch]:
    """maybe_create_ubatch_slices: split at ``padded // 2``; the second takes the remaining real
    tokens and is padded out to the padded total. Request slices as upstream (searchsorted)."""
    cu = list(w.batch.token_offsets())
    total = cu[-1]
    point = padded // 2
    out = []
    for i, (lo, hi) in enumerate(((0, point), (point, total))):
        req_lo = bisect.bisect_right(cu, lo) - 1
        req_hi = bisect.bisect_left(cu, hi)
        cut = (i == 0 and hi not in cu) or (i == 1 and lo not in cu)
        pad = point if i == 0 else padded - point
        out.append(MicroBatch(i, req_lo, req_hi, lo, hi, pad, split_seq=cut))
    return out[0], out[1]


# ----------------------------------------------------------------------------------------------
# Two ubatch threads (UBatchContext) and what each issues
# ----------------------------------------------------------------------------------------------


@dataclass
class _Ctx:
    """One UBatchContext: its thread, the recv hook another thread registered with it, and
    counters for its (re-recorded upstream, single-assignment here) GPU events."""

    index: int
    t: ThreadBuilder
    recv_hook: Op | None = None
    events: int = 0
    log: list[str] = field(default_factory=list)

    def event(self, what: str) -> str:
        self.events += 1
        return f"ub{self.index}.{what}.{self.events}"


class _Dbo:
    """Emits both threads. Thread bodies are Python generators that yield at ``dbo_yield``; the
    driver resumes them round robin, so a hook registered by one thread is launched by the other
    exactly where upstream's ``dbo_maybe_run_recv_hook`` runs it."""

    def __init__(self, w: Workload, gpu: GPU, cfg: ScheduleConfig, mbs, mode: str, step: int):
        self.w, self.gpu, self.cfg, self.mbs, self.mode, self.step = w, gpu, cfg, mbs, mode, step
        if mode == "low_latency":
            self.rank = RankBuilder(0, ("main",))
        else:  # DeepEP's high-priority Buffer comm_stream runs the HT kernels (module docstring)
            self.rank = RankBuilder(0, ("main", "comm"), priorities=(("comm", HIGH_PRIORITY),))
        self.ctxs = [_Ctx(i, self.rank.thread(THREADS[i])) for i in range(2)]
        self.comm_sms = 0
        if mode == "normal":
            own = cfg.of(Knobs).comm_sms
            want = resolve_comm_sms(own, gpu, default=VLLM_DBO_COMM_SMS, least=0)
            self.comm_sms = min(want, DEEPEP_HT_NUM_SMS)  # min(comm_sms, max_sms_used())

    # -- SM control (SMControlContextManager): comm kernels hold comm_sms, DeepGEMM the rest ----
    def _sm(self, op: Op) -> Op:
        if self.comm_sms <= 0:
            return op
        if op.kind == "comm" and op.sms:  # (a notify kernel's own grid stays within them)
            return dataclasses.replace(op, sms=max(self.comm_sms, op.ctas or 0))
        if op.kind == "compute" and op.op_class in DEEPGEMM_CLASSES:
            return dataclasses.replace(op, sms=self.gpu.num_sms - self.comm_sms)
        return op

    def _launch(self, c: _Ctx, op: Op, stream: str = "main") -> None:
        c.t.launch(self._sm(op), stream)
        c.log.append(f"{op.name}@{stream}")

    # -- ubatching.py primitives --------------------------------------------------------------
    def _maybe_run_recv_hook(self, c: _Ctx) -> None:
        if c.recv_hook is not None:
            self._launch(c, c.recv_hook)
            c.recv_hook = None

    def _register_recv_hook(self, c: _Ctx, hook: Op) -> None:
        other = self.ctxs[(c.index + 1) % 2]
        other.recv_hook = hook

    # -- one thread: the model forward on its micro-batch ---------------------------------------
    def thread_body(self, c: _Ctx):
        w, mb = self.w, self.mbs[c.index]
        self._launch(c, head_ops(w, self.gpu, mb, step=self.step)["embed"])
        for layer in range(w.model.num_layers):
            ops = layer_ops(w, self.gpu, layer, mb, deepep_mode=self.mode, step=self.step)
            if not w.model.is_moe_layer(layer):  # dense layers: no yield, nothing to overlap
                for op in ops.values():
                    self._launch(c, op)
                continue
            for k in ("comm_prepare_attn", "attn.prepare", "attn.core"):  # A0, A1 (attention)
                for op in parts(ops, k):
                    self._launch(c, op)
            for k in ("comm_prepare_mlp", "gate", "select_experts"):  # A1 (MoE gate)
                for op in parts(ops, k):
                    self._launch(c, op)
            if self.mode == "low_latency":
                yield from self._moe_ll(c, ops)
            else:
                yield from self._moe_ht(c, ops)
            for k in ("output", "comm_postprocess_layer"):
                self._launch(c, ops[k])
        # the model's last norm, the end of each ubatch's forward (DeepseekV2Model.forward)
        self._launch(c, head_ops(w, self.gpu, mb, step=self.step)["final_norm"])
        # UBatchContext.__exit__: run a hook still registered with this thread, wake the other.
        self._maybe_run_recv_hook(c)

    def _moe_ll(self, c: _Ctx, ops: dict[str, Op]):
        # FusedMoEModularKernel._prepare
        self._maybe_run_recv_hook(c)  # the other thread's pending recv (C of its last layer)
        self._launch(c, ops["dispatch_a"])  # D send (low_latency_dispatch, return_recv_hook)
        self._register_recv_hook(c, ops["dispatch_b"])
        c.log.append("yield")
        yield  # dbo_yield
        for op in parts(ops, "experts"):  # MLP (receiver() unpacks; batched experts)
            self._launch(c, op)
        # FusedMoEModularKernel._finalize -> DeepEPLLPrepareAndFinalize._finalize
        self._maybe_run_recv_hook(c)  # the other thread's D recv
        self._launch(c, ops["combine_a"])  # C send
        for op in parts(ops, "shared_experts"):  # S, overlapped with the combine in flight
            self._launch(c, op)
        self._register_recv_hook(c, ops["combine_b"])
        c.log.append("yield")
        yield  # dbo_yield

    def _yield_compute_to_comm(self, c: _Ctx):
        ev = c.event("compute_done")
        c.t.record(ev, "main")
        c.log.append("yield")
        yield
        c.t.wait("comm", ev)

    def _moe_ht(self, c: _Ctx, ops: dict[str, Op]):
        self._maybe_run_recv_hook(c)  # _prepare; HT registers no hooks, so nothing runs
        yield from self._yield_compute_to_comm(c)  # before the dispatch kernel (CPU-blocking)
        for op in parts(ops, "dispatch_a"):  # layout and notify, then the dispatch kernel
            self._launch(c, op, "comm")
        self._launch(c, ops["dispatch_b"], "comm")
        ev = c.event("comm_done")  # dbo_switch_to_compute_sync
        c.t.record(ev, "comm")
        c.t.wait("main", ev)
        for op in parts(ops, "experts"):
            self._launch(c, op)
        yield from self._yield_compute_to_comm(c)  # HT _finalize, before buffer.combine
        for op in parts(ops, "combine_a"):  # cached_notify, then the combine kernel
            self._launch(c, op, "comm")
        for op in parts(ops, "shared_experts"):  # dbo_switch_to_compute; shared experts
            self._launch(c, op)
        self._launch(c, ops["combine_b"], "comm")  # receiver: switch_to_comm, output.copy_
        ev = c.event("comm_done")  # dbo_yield_and_switch_from_comm_to_compute
        c.t.record(ev, "comm")
        c.log.append("yield")
        yield
        c.t.wait("main", ev)

    def run(self) -> None:
        """UBatchWrapper._run_ubatches: thread 0 first; each dbo_yield wakes the other thread;
        a finished thread wakes the other (``__exit__`` sets its cpu_signal_event)."""
        gens = [self.thread_body(c) for c in self.ctxs]
        live, cur = [0, 1], 0
        while live:
            i = live[cur % len(live)]
            try:
                next(gens[i])
                self.ctxs[i].t.yield_()
                cur = (live.index(i) + 1) % len(live)
            except StopIteration:
                live.remove(i)
                cur = 0


# ----------------------------------------------------------------------------------------------
# The step
# ----------------------------------------------------------------------------------------------


def _graph_mode(w: Workload, cfg: ScheduleConfig) -> bool:
    """Full CUDA graphs for decode; DeepEP high-throughput kernels cannot be captured."""
    graph = cfg.use_cuda_graph(w.batch.mode)
    if graph and cfg.resolved_deepep_mode(w.batch.mode) == "normal":
        if cfg.cuda_graph:
            raise ConfigError("vllm-dbo: DeepEP high-throughput kernels cannot be CUDA-graphed")
        return False
    return graph


def _check(w: Workload) -> None:
    p = w.parallel
    if p.ep // p.attn_tp < 2 or p.ep < 2:
        raise ConfigError(
            "vllm-dbo needs --data-parallel-size > 1 with expert parallelism (--ep >= 2 and "
            "ep / attn_tp >= 2)"
        )


def _head_whole(w: Workload, gpu: GPU, padded: int, step: int) -> dict[str, Op]:
    """compute_logits / sampler on the concatenated outputs (main thread, after the join)."""
    n = w.batch.num_tokens
    whole = MicroBatch(0, 0, w.batch.num_seqs, 0, n, padded)
    return {
        k: dataclasses.replace(v, mb=None) for k, v in head_ops(w, gpu, whole, step=step).items()
    }


def _finish(t: ThreadBuilder, w: Workload, gpu: GPU, cfg: ScheduleConfig, padded: int, step: int):
    head = _head_whole(w, gpu, padded, step)
    for k in ("logits", "sample"):  # (the final norm ran in each ubatch's forward)
        t.launch(head[k], "main")
    n, mode = w.batch.num_tokens, cfg.resolved_deepep_mode(w.batch.mode)
    whole = MicroBatch(0, 0, w.batch.num_seqs, 0, n, padded)
    for op in mtp_ops(w, gpu, whole, deepep_mode=mode, step=step):  # the MTP drafter, after
        t.launch(op, "main")  # sampling (vLLM's propose_draft_token_ids)
    t.launch(head["d2h"], "main")
    t.record("step_done", "main")
    t.sync("step_done")
    t.host("process_result", cfg.host.process_result_us(w.batch.num_seqs), step=step)


def build(w: Workload, gpu: GPU, cfg: ScheduleConfig) -> Program:
    _check(w)
    mode = cfg.resolved_deepep_mode(w.batch.mode)
    graph = _graph_mode(w, cfg)
    d = decide(w, cfg)
    step = 0
    knobs = dict(
        schedule="vllm-dbo",
        deepep_mode=mode,
        cuda_graph=graph,
        dbo_decode_token_threshold=cfg.of(Knobs).dbo_decode_token_threshold,
        dbo_prefill_token_threshold=cfg.of(Knobs).dbo_prefill_token_threshold,
        dp_tokens=list(dp_tokens(w, cfg)),
    )
    if not d.ubatch:  # the runner's normal path: one thread, one stream
        n = w.batch.num_tokens
        mb = MicroBatch(0, 0, w.batch.num_seqs, 0, n, d.padded_tokens)
        rank = RankBuilder(0, ("main",))
        t = rank.thread("main")
        t.host("schedule", cfg.host.schedule_us(w.batch.num_seqs), step=step)
        body = forward_sequence(w, gpu, mb, deepep_mode=mode, step=step)[:-2]  # model only
        launch_all(t, body, "main", graph="forward" if graph else None)
        _finish(t, w, gpu, cfg, d.padded_tokens, step)
        return program(
            [rank],
            world=w.parallel.ep,
            micro_batches=[mb.as_meta()],
            fallback_reason=d.reason,
            **knobs,
        )
    mbs = split(w, d.padded_tokens)
    dbo = _Dbo(w, gpu, cfg, mbs, mode, step)
    c0, c1 = dbo.ctxs
    c0.t.host("schedule", cfg.host.schedule_us(w.batch.num_seqs), step=step)
    dbo.run()
    # The main thread joins both and runs compute_logits / sampling: issued after ubatch1, the
    # thread that finishes last (ubatch0 exits first and wakes it).
    _finish(c1.t, w, gpu, cfg, d.padded_tokens, step)
    rank = dbo.rank
    if graph:
        rank = _as_graph_replay(rank, w, gpu, cfg, d.padded_tokens, step)
    meta = dict(knobs, micro_batches=[m.as_meta() for m in mbs])
    if dbo.comm_sms:
        meta["comm_sms"] = dbo.comm_sms
    return program([rank], world=w.parallel.ep, **meta)


def _as_graph_replay(rank: RankBuilder, w, gpu, cfg, padded: int, step: int) -> RankBuilder:
    """A captured DBO graph replays without threads: one host thread, one graph launch whose body
    keeps the GPU instructions in the order the ping-ponging threads issued them."""
    rp = rank.build()
    body = []
    for it in issue_order(rp):
        ins = it.instr
        if isinstance(ins, (Launch, Record, Wait, WaitStream)):
            if isinstance(ins, Launch) and ins.op.mb is None:
                break  # compute_logits onwards is the main thread's, outside the graph
            body.append(ins)
    out = RankBuilder(0, rp.streams, priorities=rp.priorities)
    t = out.thread("main")
    t.host("schedule", cfg.host.schedule_us(w.batch.num_seqs), step=step)
    t.instrs.append(Graph("dbo_forward", tuple(body)))
    _finish(t, w, gpu, cfg, padded, step)
    return out


def cpu_check_config(cfg: ScheduleConfig) -> ScheduleConfig:
    """``cfg`` with the split thresholds lowered to 1 where they are at their defaults, for the
    CPU check (``real.check``): its workloads have 4 to 32 tokens, all under the defaults (32
    decode, 512 prefill tokens), so vllm-dbo would take its unsplit path on every one of them
    and its check would compare serial with itself. Thresholds the caller set are kept (its
    unsplit runs are then reported)."""
    given = cfg.own
    lowered = {
        f: 1
        for f in ("dbo_decode_token_threshold", "dbo_prefill_token_threshold")
        if f not in given or given[f] == getattr(Knobs(), f)
    }
    return replace(cfg, **lowered)


def launch_flags(d: Deployment) -> ServerLaunch:
    """vLLM with Dual Batch Overlap: ``--enable-dbo`` and its two split thresholds
    (``vllm/engine/arg_utils.py`` over ``vllm/config/parallel.py``), the SMs DeepEP keeps as
    ``VLLM_DBO_COMM_SMS`` (``vllm/envs.py``) where given (docs/tune.md)."""
    k = d.cfg.of(Knobs)
    extra = [
        Flag("--enable-dbo", None, VLLM_ARGS, "dbo"),
        Flag("--dbo-decode-token-threshold", k.dbo_decode_token_threshold, VLLM_ARGS,
             "dbo_decode_token_threshold"),
        Flag("--dbo-prefill-token-threshold", k.dbo_prefill_token_threshold, VLLM_ARGS,
             "dbo_prefill_token_threshold"),
    ]  # fmt: skip
    if k.comm_sms is not None:
        extra.append(vllm_env("VLLM_DBO_COMM_SMS", k.comm_sms, "comm_sms"))
    return vllm(d, tuple(extra))
