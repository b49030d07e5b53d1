"""SGLang pipeline parallelism: ``Scheduler.event_loop_pp`` on every PP rank (SGLang v0.4.9;
docs/schedules.md).

Each PP rank holds a contiguous slice of the layers (``get_pp_indices``, shared/ir/ops_pp.py) and runs
its own scheduler loop over ``pp_size`` micro-batches (``mbs``, ``last_mbs``, ``bids``), walked
round robin. Per micro-batch iteration ``mb_id`` (``next_mb_id = (mb_id + 1) % pp_size``):

1. ``recv_requests`` + ``process_input_requests`` + ``get_next_batch_to_run``: rank 0 reads the
   tokenizer's socket; every other rank receives the requests its predecessor forwards
   (``point_to_point_pyobj``).
2. ``run_batch``: a non-first rank first receives the hidden states (``recv_tensor_dict``: metadata
   over the CPU group, tensors over the device group, send-allgather inside attention TP); then the
   forward of its layers; the last rank samples.
3. last rank: ``send_tensor_dict(next_token_ids [+ logprobs])`` to rank 0 (``dst = (rank+1) % N``).
4. if ``mbs[next_mb_id]`` exists: ``recv_tensor_dict`` of that micro-batch's outputs from the
   previous rank (rank 0: from the last), then ``process_batch_result``, whose ``.tolist()`` blocks
   the host until the current stream (this iteration's forward included) has finished: the
   CPU-GPU overlap scheduler is off under PP.
5. non-last rank: forward the outputs received in the previous iteration (``pp_outputs``, the ring
   relay: one micro-batch iteration later), forward the requests, send the hidden states on.

Every rank thus receives every micro-batch's next_token_ids once, one hop per micro-batch
iteration around the ring last -> 0 -> 1 -> ... -> last. The simulated window is
``cfg.iterations`` rounds of the ``while True`` loop; the receive that would pair with a send
after the window (non-first ranks, last iteration) is left out.

Streams: ``main`` (forward), ``pp_recv`` and ``pp_send`` (PyTorch gives each point-to-point pair
its own NCCL communicator and stream; a send waits for the current stream first, the current
stream waits for a receive).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.inputs.knobs import knob
from overlap_lab.shared.inputs.workload import MicroBatch, Workload
from overlap_lab.shared.ir.builder import RankBuilder, ThreadBuilder, program
from overlap_lab.shared.ir.ops import head_ops, layer_ops, parts, whole_batch
from overlap_lab.shared.ir.ops_pp import (
    PP_HOST_COSTS,
    allgather_op,
    hidden_bytes,
    output_bytes,
    p2p_pair,
    pp_layer_split,
)
from overlap_lab.shared.ir.program import Op, Program
from overlap_lab.shared.schedules.common import MAX_ITERATIONS, Drawing, ScheduleKnobs
from overlap_lab.shared.schedules.config import ScheduleConfig
from overlap_lab.shared.schedules.launch import Deployment, ServerLaunch, sglang, sglang_flag
from overlap_lab.shared.schedules.serial import launch_all

UPSTREAM = "SGLang Scheduler.event_loop_pp, distributed/parallel_state.py (send/recv_tensor_dict), distributed/utils.py (get_pp_indices)"
SUMMARY = "SGLang event_loop_pp: layer slices per rank, pp_size micro-batches, token-id ring"


@dataclass(frozen=True)
class Knobs(ScheduleKnobs):
    """pp's own knobs (``ScheduleConfig.of``)."""

    iterations: int = knob(
        4,
        "rounds of event_loop_pp simulated (each: every micro-batch once)",
        unit="iterations",
        lo=1,
        hi=MAX_ITERATIONS,
    )
    micro_batches: int | None = knob(
        None,
        "micro-batches in flight (None = pp_size)",
        unit="micro-batches",
        lo=1,
        hi=64,
        tune=(4, 8),
    )
    return_logprob: bool = knob(False, "copy logprobs to the host with next_token_ids")


#: The one schedule that runs --pp-size > 1 (every other one is refused by ``schedules.build``).
SUPPORTS_PP = True
#: Pipeline stages pp runs where the workload asks for one (``prepare_workload``).
DEFAULT_STAGES = 2
#: A pipeline's bubbles lie across its stages and iterations: every rank, the whole window.
DRAWING = Drawing(whole_window=True, every_rank=True)
#: One iteration of its window is one micro-batch on every stage (``iterations_and_tokens``):
#: what a table's iteration count says beside the number ("8 mb")
ITERATION = "mb"
STREAMS = ("main", "pp_recv", "pp_send")


def micro_batch(w: Workload, k: int) -> MicroBatch:
    """Micro-batch k: one whole ScheduleBatch of the workload's batch (every mb alike): the
    workload's batch is the sequences of one micro-batch, and a stage holds ``micro_batches``
    of them (:func:`batches_in_flight`)."""
    whole = whole_batch(w)
    return MicroBatch(
        k, whole.seq_lo, whole.seq_hi, whole.tok_lo, whole.tok_hi, whole.padded_tokens
    )


def stage_ops(
    w: Workload,
    gpu: GPU,
    mb: MicroBatch,
    layers: range,
    *,
    first: bool,
    last: bool,
    mode: str,
    step: int,
) -> list[Op]:
    """The forward of one stage: embed on the first, its layers, logits + sample on the last."""
    head = head_ops(w, gpu, mb, step=step)
    ops: list[Op] = [head["embed"]] if first else []
    for layer in layers:
        ops += layer_ops(w, gpu, layer, mb, deepep_mode=mode, step=step).values()
    if last:
        ops += [*parts(head, "logits"), head["sample"]]
    return ops


def out_key(g: int, src: int, dst: int) -> str:
    return f"pp.out.g{g}.r{src}to{dst}"


def hidden_key(g: int, src: int) -> str:
    return f"pp.hidden.g{g}.r{src}to{src + 1}"


class _Loop:
    """Emits the rank's scheduler thread, iteration by iteration."""

    def __init__(self, w: Workload, gpu: GPU, cfg: ScheduleConfig, rank: int):
        self.w, self.gpu, self.cfg, self.r = w, gpu, cfg, rank
        self.pp = w.parallel.pp
        self.first, self.last = rank == 0, rank == self.pp - 1
        self.k = cfg.of(Knobs)
        self.M = self.k.micro_batches or self.pp
        self.G = self.k.iterations * self.M
        self.layers = pp_layer_split(w.model, self.pp)[rank]
        self.mode = cfg.resolved_deepep_mode(w.batch.mode)
        self.graph = cfg.use_cuda_graph(w.batch.mode)
        self.nseq = w.batch.num_seqs
        self.out_nbytes = output_bytes(self.nseq, self.k.return_logprob)
        self.rb = RankBuilder(rank, STREAMS)
        self.t: ThreadBuilder = self.rb.thread("scheduler")
        self.host = PP_HOST_COSTS

    # -- receiving and sending tensor dicts ---------------------------------------------------
    def _recv(self, what: str, nbytes: float, key: str, src: int, mb: int, step: int) -> None:
        t = self.t
        t.host("recv_object", self.host.recv_object_us, mb=mb, step=step)  # metadata, CPU group
        _, recv = p2p_pair(self.w, what, nbytes, src=src, dst=self.r, key=key, mb=mb, step=step)
        t.launch(recv, "pp_recv")
        ag = allgather_op(self.w, what, nbytes, key=f"{key}.ag.r{self.r}", mb=mb, step=step)
        if ag is not None:
            t.launch(ag, "pp_recv")
        t.wait_stream("main", "pp_recv")

    def _send(self, what: str, nbytes: float, key: str, dst: int, mb: int, step: int) -> None:
        t = self.t
        t.host("send_object", self.host.send_object_us, mb=mb, step=step)
        send, _ = p2p_pair(self.w, what, nbytes, src=self.r, dst=dst, key=key, mb=mb, step=step)
        t.wait_stream("pp_send", "main")  # NCCL send is ordered after the current stream
        t.launch(send, "pp_send")

    def _recv_outputs_key(self, g: int) -> str | None:
        """Which send the receive at the end of iteration g pairs with (None: outside window)."""
        if g < self.M - 1:
            return None  # mbs[next_mb_id] is still None in the first round
        if self.first:
            return out_key(g - (self.M - 1), self.pp - 1, 0)  # the last rank's g-(M-1) send
        if g + 1 >= self.G:
            return None  # the predecessor forwards it in iteration g+1, after the window
        return out_key(g + 1, self.r - 1, self.r)  # relayed by the predecessor next iteration

    # -- one micro-batch iteration ------------------------------------------------------------
    def iteration(self, g: int, relayed: bool) -> bool:
        """Emit iteration g; return whether outputs were received (pp_outputs for g+1)."""
        w, t, k = self.w, self.t, g % self.M
        mb = micro_batch(w, k)
        # 1. requests and scheduling
        if self.first:
            t.host("recv_requests", self.cfg.host.recv_requests_us, mb=k, step=g)
        else:
            t.host("recv_reqs_pyobj", self.host.pyobj_us, mb=k, step=g)
        t.host("schedule", self.cfg.host.schedule_us(self.nseq), mb=k, step=g)
        # 2. run_batch (forward_batch_generation)
        if not self.first:
            self._recv("hidden", hidden_bytes(w, mb), hidden_key(g, self.r - 1), self.r - 1, k, g)
        ops = stage_ops(
            w, self.gpu, mb, self.layers, first=self.first, last=self.last, mode=self.mode, step=g
        )
        launch_all(t, ops, "main", graph=f"forward.g{g}" if self.graph else None)
        # 3. last rank: next_token_ids (+ logprobs) to rank 0
        if self.last:
            self._send("out", self.out_nbytes, out_key(g, self.r, 0), 0, k, g)
        # 4. outputs of the next micro-batch, then process_batch_result
        key = self._recv_outputs_key(g)
        received = key is not None
        if received:
            nxt = (g + 1) % self.M
            src = self.pp - 1 if self.first else self.r - 1
            self._recv("out", self.out_nbytes, key, src, nxt, g)
            t.record(f"outputs.g{g}", "main")
            t.sync(f"outputs.g{g}")  # .tolist(): waits for this iteration's forward too
            t.host("process_result", self.cfg.host.process_result_us(self.nseq), mb=nxt, step=g)
            if self.first:  # stream_output: only pp rank 0 (attn-TP rank 0) owns the socket
                t.host("detokenizer_send", self.cfg.host.detokenizer_send_us, mb=nxt, step=g)
        # 5. non-last rank: relay outputs, forward requests, send hidden states on
        if not self.last:
            if relayed:
                self._send("out", self.out_nbytes, out_key(g, self.r, self.r + 1), self.r + 1, k, g)
            t.host("send_reqs_pyobj", self.host.pyobj_us, mb=k, step=g)
            self._send("hidden", hidden_bytes(w, mb), hidden_key(g, self.r), self.r + 1, k, g)
        return received

    def run(self) -> RankBuilder:
        pp_outputs = False
        for g in range(self.G):
            pp_outputs = self.iteration(g, pp_outputs)
        return self.rb


def _check(w: Workload, cfg: ScheduleConfig) -> None:
    if w.parallel.pp < 2:
        raise ConfigError("pp needs --pp-size >= 2 (event_loop_pp runs only when pp_size > 1)")
    mbs = cfg.of(Knobs).micro_batches
    if mbs is not None and mbs < w.parallel.pp:
        raise ConfigError(
            f"pp needs --micro-batches >= --pp-size {w.parallel.pp}: with fewer, event_loop_pp "
            "deadlocks (a rank waits for outputs relayed by its predecessor one iteration later, "
            "which waits for hidden states this rank sends only after that wait)"
        )
    if w.batch.mode == "decode" and w.batch.tokens_per_seq > 1:
        raise ConfigError(
            "pp refuses a decode step that verifies draft tokens (--tokens-per-seq "
            f"{w.batch.tokens_per_seq}): SGLang's server_args asserts that pipeline parallelism "
            "is not compatible with speculative decoding (MTP included); use --tokens-per-seq 1"
        )
    split = pp_layer_split(w.model, w.parallel.pp)
    if sum(len(s) for s in split) != w.model.num_layers:  # pragma: no cover - by construction
        raise ConfigError("PP layer slices do not cover the model")


def build(w: Workload, gpu: GPU, cfg: ScheduleConfig) -> Program:
    _check(w, cfg)
    pp = w.parallel.pp
    loops = [_Loop(w, gpu, cfg, r) for r in range(pp)]
    ranks = [lp.run() for lp in loops]
    lp = loops[0]
    return program(
        ranks,
        world=pp,
        symmetric=False,
        schedule="pp",
        pp_size=pp,
        micro_batches=[micro_batch(w, k).as_meta() for k in range(lp.M)],
        iterations=lp.k.iterations,
        layer_split=[[s.start, s.stop] for s in pp_layer_split(w.model, pp)],
        return_logprob=lp.k.return_logprob,
        deepep_mode=lp.mode,
        cuda_graph=lp.graph,
        overlap_schedule=False,
    )


# ----------------------------------------------------------------------------------------------
# Its workload default, and how its runs are counted and compared (shared.schedules' hooks)
# ----------------------------------------------------------------------------------------------


def prepare_workload(w: Workload) -> tuple[Workload, tuple[str, ...]]:
    """One pipeline stage asked for (the default layout) means :data:`DEFAULT_STAGES` stages of
    the workload's EP size: ``sim --schedule pp`` runs without ``--pp-size``."""
    if w.parallel.pp != 1:
        return w, ()
    staged = replace(w, parallel=replace(w.parallel, pp=DEFAULT_STAGES))
    return staged, (f"{DEFAULT_STAGES} pipeline stages (default)",)


def iterations_and_tokens(program: Program, w: Workload) -> tuple[int, int]:
    """Its window: ``iterations`` rounds of ``micro_batches`` micro-batch iterations on every
    stage; the tokens the pipeline completes, divided by its stages (each GPU holds a slice of
    the layers, so a GPU pushes 1/pp of each token through the whole model)."""
    meta = program.meta
    g = int(meta.extra.get("iterations", 1)) * len(meta.micro_batches or [None])
    pp = int(meta.pp_size or w.parallel.pp)
    return g, g * w.batch.num_tokens // pp


def batches_in_flight(w: Workload, cfg: ScheduleConfig) -> int:
    """Batches a GPU holds at once: ``micro_batches`` (default ``pp_size``) micro-batches, each a
    whole batch of the workload's sequences (:func:`micro_batch`), so a stage keeps the KV cache
    of all of them for its layers, and a launch runs that many batches' requests."""
    return cfg.of(Knobs).micro_batches or w.parallel.pp


def latency_iterations(w: Workload, cfg: ScheduleConfig) -> int:
    """Iterations of its window a sequence waits, which a latency target is compared with: in
    decode, a round of every micro-batch in flight on every stage between two of a sequence's
    tokens (:func:`batches_in_flight`); in prefill, a prompt's micro-batch through each stage."""
    return batches_in_flight(w, cfg) if w.batch.mode == "decode" else w.parallel.pp


def window_note(cfg: ScheduleConfig) -> str:
    return (
        "pp: iters are micro-batch iterations (mb): iterations x micro-batches on each stage, "
        "each micro-batch a whole batch of the given sequences."
    )


def launch_flags(d: Deployment) -> ServerLaunch:
    """SGLang with pipeline stages: ``--pp-size`` (in the layout) and
    ``--pp-max-micro-batch-size``, the sequences of one micro-batch (the workload's batch) per DP
    rank; ``--max-running-requests`` counts every batch in flight (:func:`batches_in_flight`, as
    the memory check does). SGLang keeps ``pp_size`` micro-batches in flight, so
    ``micro_batches`` has no flag (docs/tune.md)."""
    k = d.cfg.of(Knobs)
    b = d.workload.batch.num_seqs
    flags = (sglang_flag("pp_max_micro_batch_size", b, "batch"),)
    unmapped = ()
    if k.micro_batches is not None and k.micro_batches != d.workload.parallel.pp:
        unmapped = (
            (
                "micro_batches",
                "SGLang's event_loop_pp keeps pp_size micro-batches in flight "
                "(python/sglang/srt/managers/scheduler_pp_mixin.py); no flag",
            ),
        )
    return sglang(d, flags, unmapped, running=b * batches_in_flight(d.workload, d.cfg))
