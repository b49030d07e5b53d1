"""What LightLLM's and DeepSeek's two-micro-batch schedules share: a small emitter with DeepEP hooks.

Both systems run one host thread that walks the layers and interleaves two micro-batches by hand
(no stage machinery as SGLang's TBO has). Communication is asynchronous through DeepEP:

- low-latency kernels (``return_recv_hook=True``): the send kernel (``*_a``) is launched on the
  compute stream and returns once its RDMA writes are issued; the data then flies with no kernel
  holding SMs; the receive kernel (``*_b``) is launched later, where the schedule calls the hook.
- normal kernels (``async_finish=True, allocate_on_comm_stream=True``): the kernel (``*_a``, it
  sends and receives holding DeepEP's SMs) runs on a communication stream after waiting for an
  event captured on the compute stream (``Buffer.capture()`` / ``previous_event``); the hook is
  ``event.current_stream_wait()``: the compute stream waits for the comm stream's completion event.

A :class:`Hook` is what a pending hook will emit when called: an optional GPU-side wait, then ops
on the compute stream (the receive kernel, and for a deferred ``_1_hook_post`` the tail of the
layer). :class:`Emitter` collects GPU instructions (and the host syncs DeepEP's normal dispatch
makes) into a forward body; :func:`step_program` frames the body as serial frames a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.inputs.workload import MicroBatch, Workload
from overlap_lab.shared.ir.builder import program
from overlap_lab.shared.ir.ops import head_ops, layer_ops, parts
from overlap_lab.shared.ir.program import Instr, Launch, Op, Program, Record, Sync, Wait
from overlap_lab.shared.schedules.config import ScheduleConfig
from overlap_lab.shared.schedules.frame import step_frame

MAIN = "main"

# The ops of a layer as LightLLM and DeepSeek group them (shared.ir.ops names):
ATTENTION = ("comm_prepare_attn", "attn.prepare", "attn.core", "comm_prepare_mlp")
FINISH = ("output", "comm_postprocess_layer")  # scale + shared add, then the residual add


def cdiv(a: int, b: int) -> int:
    """triton.cdiv: ceiling division."""
    return -(-a // b)


def system_deepep_mode(cfg: ScheduleConfig, mode: str, system: str) -> str:
    """Both systems hard-code their kernels: low-latency in decode, normal in prefill.

    ``--deepep-mode auto`` (or the matching explicit mode) is accepted; anything else is refused,
    since the system has no such code path.
    """
    own = "low_latency" if mode == "decode" else "normal"
    if cfg.deepep_mode not in ("auto", own):
        raise ConfigError(
            f"{system} runs DeepEP {own} kernels in {mode}; --deepep-mode {cfg.deepep_mode} "
            "has no code path there (use auto)"
        )
    return own


@dataclass
class Hook:
    """A pending DeepEP hook: wait (GPU-side) for ``event`` if any, then run ``ops`` on main."""

    event: str | None = None
    ops: tuple[Op, ...] = ()


@dataclass
class Emitter:
    """Collects the forward body of one step for a pair (or a single) micro-batch.

    ``compute_sms`` caps every compute kernel (DeepSeek's 108-SM partition); ``comm_sms`` replaces
    the SMs DeepEP's normal kernels hold. None keeps what ``shared.ir.ops`` gives.
    """

    w: Workload
    gpu: GPU
    mbs: tuple[MicroBatch, ...]
    deepep_mode: str
    step: int = 0
    compute_sms: int | None = None
    comm_sms: int | None = None
    body: list[Instr] = field(default_factory=list)
    hooks: dict[int, Hook] = field(default_factory=dict)
    _ops: dict[tuple[int, int], dict[str, Op]] = field(default_factory=dict)
    _head: dict[int, dict[str, Op]] = field(default_factory=dict)

    # -- ops ----------------------------------------------------------------------------------
    def _narrow(self, op: Op) -> Op:
        """The partition's SMs: every compute kernel capped at ``compute_sms``, and DeepEP's
        kernels given the Buffer's ``comm_sms`` (a notify kernel's own grid, its ``ctas``, stays
        within them)."""
        if op.kind == "compute" and self.compute_sms is not None:
            return replace(op, sms=self.compute_sms)
        if op.kind == "comm" and self.comm_sms is not None and op.sms:
            return replace(op, sms=max(self.comm_sms, op.ctas or 0))
        return op

    def ops(self, i: int, layer: int) -> dict[str, Op]:
        key = (i, layer)
        if key not in self._ops:
            raw = layer_ops(
                self.w, self.gpu, layer, self.mbs[i], deepep_mode=self.deepep_mode, step=self.step
            )
            self._ops[key] = {k: self._narrow(v) for k, v in raw.items()}
        return self._ops[key]

    def head(self, i: int) -> dict[str, Op]:
        if i not in self._head:
            raw = head_ops(self.w, self.gpu, self.mbs[i], step=self.step)
            self._head[i] = {k: self._narrow(v) for k, v in raw.items()}
        return self._head[i]

    def has(self, i: int) -> bool:
        return 0 <= i < len(self.mbs)

    # -- instructions -------------------------------------------------------------------------
    def run(self, i: int, layer: int, names: tuple[str, ...] | list[str], stream: str = MAIN):
        """Launch the named ops of micro-batch ``i``'s layer, in the order given (skipped when the
        micro-batch does not exist, i.e. the batch ran unsplit)."""
        if not self.has(i):
            return
        ops = self.ops(i, layer)
        done: set[str] = set()  # ``names`` may list a key's parts besides the key (every op)
        for name in names:  # a key with parts launches each (``shared.ir.ops.PARTS``)
            for op in parts(ops, name):
                if op.name not in done:
                    done.add(op.name)
                    self.body.append(Launch(op, stream))

    def launch(self, op: Op, stream: str = MAIN) -> None:
        self.body.append(Launch(op, stream))

    def launch_head(self, i: int, key: str, stream: str = MAIN) -> None:
        """Launch micro-batch ``i``'s head op ``key`` with its parts (the final norm before
        the logits)."""
        for op in parts(self.head(i), key):
            self.launch(op, stream)

    def record(self, event: str, stream: str = MAIN) -> None:
        self.body.append(Record(event, stream))

    def wait(self, stream: str, event: str) -> None:
        self.body.append(Wait(stream, event))

    def host_sync(self, event: str) -> None:
        self.body.append(Sync(event))

    # -- hooks --------------------------------------------------------------------------------
    def set_hook(self, i: int, hook: Hook) -> None:
        """``infer_state.hook = ...``: a hook still pending would be lost, so that is a bug."""
        if not self.has(i):
            return
        assert i not in self.hooks, f"micro-batch {i}: a pending hook would be overwritten"
        self.hooks[i] = hook

    def call_hook(self, i: int) -> bool:
        """``if infer_state.hook is not None: infer_state.hook(); infer_state.hook = None``."""
        hook = self.hooks.pop(i, None)
        if hook is None:
            return False
        if hook.event is not None:
            self.wait(MAIN, hook.event)
        for op in hook.ops:
            self.launch(op, MAIN)
        return True

    def normal_comm(
        self, i: int, layer: int, what: str, ready: str, stream: str, *, host_sync: bool
    ) -> str:
        """DeepEP normal ``dispatch``/``combine`` with ``previous_event=ready`` on ``stream``.

        The comm stream waits for the captured event, runs DeepEP's kernels (the parts of
        ``*_a``: ``get_dispatch_layout`` and ``notify_dispatch`` or ``cached_notify``, then the
        kernel that holds DeepEP's SMs until its data has arrived; ``*_b`` is the empty
        completion marker) and records the event the hook will wait on, which is returned.
        ``host_sync``: a dispatch without a cached handle makes the CPU busy-wait for the
        receive counts its notify kernel writes (DeepEP's ``moe_recv_counter``) before it
        launches the dispatch kernel, i.e. until the comm stream has run the notify.
        """
        done = f"L{layer}.mb{i}.{what}_done"
        if not self.has(i):
            return done
        self.wait(stream, ready)
        *before, kernel = parts(self.ops(i, layer), f"{what}_a")
        for op in before:
            self.launch(op, stream)
        if host_sync:
            counts = f"{kernel.coll.key}.counts"
            self.record(counts, stream)
            self.host_sync(counts)
        self.launch(kernel, stream)
        self.run(i, layer, (f"{what}_b",), stream)
        self.record(done, stream)
        return done


def step_program(
    w: Workload,
    gpu: GPU,
    cfg: ScheduleConfig,
    body: list[Instr],
    *,
    streams: tuple[str, ...],
    step: int = 0,
    priorities: tuple[tuple[str, int], ...] = (),
    **meta,
) -> Program:
    """One scheduler step around a forward body, framed as serial frames it: host scheduling, the
    launches (one CUDA graph for a graph-captured decode, both micro-batches inside), the D2H of
    the sampled ids, the one host sync and result processing."""
    rank = step_frame(
        w, gpu, cfg, body, streams=streams, step=step, stream=MAIN, priorities=priorities
    )
    graph = cfg.use_cuda_graph(w.batch.mode)
    return program([rank], world=w.parallel.ep, cuda_graph=graph, **meta)
