"""The work of SGLang's pipeline parallelism that shared/ir/ops.py does not hold: the layer split,
the PP send/recv of hidden states and of the sampled ids, and the host costs of the loop's
CPU-side messages (docs/schedules.md, pp).

- Layers: ``get_pp_indices`` (python/sglang/srt/distributed/utils.py): ``num_layers // pp`` each,
  the last ``num_layers % pp`` stages one more; contiguous, so DeepSeek's first dense layers sit
  on stage 0.
- ``send_tensor_dict`` / ``recv_tensor_dict``: the metadata (shapes, dtypes) is pickled and sent
  with ``send_object`` over the CPU (gloo) group: host work here; every GPU tensor goes with
  ``torch.distributed.send`` over the device (NCCL) group. With ``all_gather_group`` (the
  attention-TP group) each rank sends only its ``1/attn_tp`` slice and the receiver all-gathers it
  inside its TP group: PP traffic divided by attn_tp, plus an NVLink all-gather.
- Non-last stages send ``{"hidden_states", "residual"}`` ([tokens, hidden] bf16 each, DeepSeek's
  PPProxyTensors); the last stage sends ``next_token_ids`` (int64 per request), with logprobs
  ``next_token_logprobs`` (fp32 per request) too.
- ``point_to_point_pyobj`` forwards the received requests to the next stage: host work here.

A rank of a PP Program stands for one GPU of its stage (its EP / attention-TP peers behave alike);
the next stage's GPU with the same local index is its PP peer (SGLang's rank layout
``pp_rank * tp_size + tp_rank``), reached over NVLink when both lie in one node, RDMA otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.workload import MicroBatch, ModelConfig, Workload
from overlap_lab.shared.ir.program import Coll, Flow, Op

ACT = 2  # bf16 activations
ID_BYTES = 8  # next_token_ids: int64
LOGPROB_BYTES = 4  # next_token_logprobs: fp32
PROXY_TENSORS = ("hidden_states", "residual")  # DeepseekV2Model returns both between stages
NCCL_P2P_SMS = 2  # NCCL send/recv: one block per channel; NCCL_NCHANNELS_PER_NET_PEER default 2


@dataclass(frozen=True)
class PPHostCosts:
    """Host time of the loop's CPU-group messages (estimates: pickling a short list plus one gloo
    round trip over TCP is some 10-30 µs on a server CPU; no measurement yet)."""

    send_object_us: float = 15.0  # send_tensor_dict: pickle metadata + gloo send
    recv_object_us: float = 15.0  # recv_tensor_dict: gloo recv + unpickle
    pyobj_us: float = 20.0  # point_to_point_pyobj of the (usually empty) request list

    def __post_init__(self) -> None:
        for k in ("send_object_us", "recv_object_us", "pyobj_us"):
            if getattr(self, k) < 0:
                raise ConfigError(f"PP host cost {k} must be >= 0")


PP_HOST_COSTS = PPHostCosts()


def pp_layer_split(model: ModelConfig, pp: int) -> tuple[range, ...]:
    """SGLang's get_pp_indices for every stage (no SGLANG_PP_LAYER_PARTITION)."""
    n = model.num_layers
    if not 1 <= pp <= n:
        raise ConfigError(f"--pp-size {pp} must lie in 1..{n} (the layers of {model.name})")
    base, rem = divmod(n, pp)
    out = []
    for r in range(pp):
        if r >= pp - rem:  # the last `rem` partitions get one extra layer
            lo = r * (base + 1) - (pp - rem)
            out.append(range(lo, lo + base + 1))
        else:
            out.append(range(r * base, r * base + base))
    return tuple(out)


def pp_link(w: Workload, src: int, dst: int) -> str:
    """NVLink when the two stages' GPUs (local index 0) share a node, RDMA otherwise."""
    ep, gpn = w.parallel.ep, w.parallel.gpus_per_node
    return "nvlink" if (src * ep) // gpn == (dst * ep) // gpn else "rdma"


def hidden_bytes(w: Workload, mb: MicroBatch) -> float:
    """Bytes of the proxy tensors of one micro-batch (what a stage hands to the next)."""
    return len(PROXY_TENSORS) * mb.padded_tokens * w.model.hidden * ACT


def output_bytes(mb_seqs: int, return_logprob: bool) -> float:
    """next_token_ids (+ next_token_logprobs) of one micro-batch's requests."""
    return mb_seqs * (ID_BYTES + (LOGPROB_BYTES if return_logprob else 0))


def _slice(w: Workload, nbytes: float) -> float:
    """send-allgather: 1/attn_tp of each tensor crosses the PP link."""
    return nbytes / w.parallel.attn_tp


def p2p_pair(
    w: Workload,
    what: str,
    nbytes: float,
    *,
    src: int,
    dst: int,
    key: str,
    mb: int,
    step: int,
) -> tuple[Op, Op]:
    """The NCCL send on ``src`` and its matching recv on ``dst`` of one tensor dict."""
    sent = _slice(w, nbytes)
    link = pp_link(w, src, dst)
    common = dict(kind="comm", op_class="nccl", mb=mb, step=step, sms=NCCL_P2P_SMS)
    send = Op(
        f"pp_send_{what}",
        hbm_bytes=sent,
        coll=Coll(key, "send", (Flow(link, sent, dst=dst),)),
        **common,
    )
    recv = Op(f"pp_recv_{what}", hbm_bytes=sent, coll=Coll(key, "recv"), **common)
    return send, recv


def allgather_op(
    w: Workload, what: str, nbytes: float, *, key: str, mb: int, step: int
) -> Op | None:
    """The receiver's all-gather of the slices inside its attention-TP group (None for attn_tp 1):
    each rank sends its slice to the tp-1 others over NVLink."""
    tp = w.parallel.attn_tp
    if tp == 1:
        return None
    out = _slice(w, nbytes) * (tp - 1)
    return Op(
        f"pp_allgather_{what}",
        kind="comm",
        op_class="nccl",
        mb=mb,
        step=step,
        sms=NCCL_P2P_SMS,
        hbm_bytes=2 * out,
        coll=Coll(key, "sendrecv", (Flow("nvlink", out),)),
    )
