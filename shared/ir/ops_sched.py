"""The scheduler's own GPU work in SGLang's event loop, computed from the batch (bytes per request).

These are the small kernels and copies SGLang's scheduler issues around the model forward
(docs/schedules.md, sglang-overlap), not the model's ops (those come from ``shared.ir.ops``):

- schedule stream, decode (``prepare_for_decode`` -> ``alloc_for_decode``, in this order):
  ``req_to_token_gather`` (``last_loc = req_to_token[req_pool_indices, seq_lens - 1]``),
  ``seq_lens_next`` (``seq_lens + token_per_req``), ``seq_lens_clone`` (``locs = seq_lens.clone()``),
  ``out_cache_loc_cast`` (``out_cache_loc.to(int32)``), ``req_to_token_scatter``
  (``req_to_token[req_pool_indices, locs] = out_cache_loc``) and ``seq_lens_add``
  (``seq_lens = seq_lens + 1``, a new tensor: never in place under overlap);
- schedule stream, prefill (``prepare_for_extend``): ``h2d_input_ids`` (the new requests' token
  ids, CPU -> GPU) and ``write_req_to_token_pool_triton`` (SGLang's Triton kernel that fills the
  req_to_token rows, prefix and extend slots; it is the scatter of the prefill path);
- forward stream: ``resolve_future`` (FutureMap's ``torch.where(input_ids < 0,
  buf[-input_ids], input_ids)``, one compiled kernel over the batch's input ids) before the
  forward, ``store_to_map`` (``token_ids_buf[interval] = next_token_ids``) after it;
- copy stream: ``d2h_next_token_ids`` and, with logprobs, ``d2h_next_token_logprobs`` (and, for
  prefill, ``d2h_input_token_logprobs``): one non-blocking ``.to("cpu")`` each.

Dtypes are SGLang's: token ids, seq_lens, req_pool_indices and out_cache_loc are int64,
req_to_token is int32, logprobs are float32. Each kernel reads and writes its tensors once (HBM
bytes); the GPU-side floor ``kernel_min_us`` of the cost model dominates them all, as it does on a
real GPU. ``seq_lens_cpu + 1`` and the free-slot list pops are host work (``HostCosts``).
"""

from __future__ import annotations

from overlap_lab.shared.inputs.workload import Batch
from overlap_lab.shared.ir.program import Op

I64 = 8  # token ids, seq_lens, req_pool_indices, out_cache_loc, FutureMap slots
I32 = 4  # req_to_token entries
F32 = 4  # logprobs

SCHEDULE_DECODE_OPS: tuple[str, ...] = (
    "req_to_token_gather",
    "seq_lens_next",
    "seq_lens_clone",
    "out_cache_loc_cast",
    "req_to_token_scatter",
    "seq_lens_add",
)
SCHEDULE_PREFILL_OPS: tuple[str, ...] = ("h2d_input_ids", "write_req_to_token_pool_triton")
FORWARD_PRE_OPS: tuple[str, ...] = ("resolve_future",)
FORWARD_POST_OPS: tuple[str, ...] = ("store_to_map",)
D2H_OPS: tuple[str, ...] = (
    "d2h_next_token_ids",
    "d2h_next_token_logprobs",
    "d2h_input_token_logprobs",
)
#: Every op name this module emits: the scheduler's work, as opposed to the model forward's.
SCHED_OP_NAMES: frozenset[str] = frozenset(
    SCHEDULE_DECODE_OPS + SCHEDULE_PREFILL_OPS + FORWARD_PRE_OPS + FORWARD_POST_OPS + D2H_OPS
)


def _kernel(name: str, nbytes: float, batch: Batch, step: int | None) -> Op:
    """A memory-bound elementwise / index kernel moving ``nbytes`` through HBM."""
    return Op(
        name,
        step=step,
        mb=0,
        hbm_bytes=float(nbytes),
        op_class="elementwise",
        tokens=batch.num_tokens,
    )


def _copy(name: str, nbytes: float, batch: Batch, step: int | None) -> Op:
    """A host<->device copy of ``nbytes`` over PCIe (a copy engine, no SMs)."""
    return Op(
        name,
        kind="copy",
        step=step,
        mb=0,
        hbm_bytes=float(nbytes),
        op_class="copy",
        tokens=batch.num_tokens,
    )


def schedule_ops(batch: Batch, step: int | None = None) -> list[Op]:
    """The GPU ops ``get_next_batch_to_run`` issues on the schedule stream, in issue order."""
    bs, n = batch.num_seqs, batch.num_tokens
    if batch.mode == "decode":
        return [
            # last_loc = req_to_token[req_pool_indices, seq_lens - 1]: read indices and
            # seq_lens, gather one int32 per request, write int64 locations.
            _kernel("req_to_token_gather", bs * (I64 + I64 + I32 + I64), batch, step),
            # seq_lens_next = seq_lens + token_per_req
            _kernel("seq_lens_next", bs * 2 * I64, batch, step),
            # locs = seq_lens.clone()
            _kernel("seq_lens_clone", bs * 2 * I64, batch, step),
            # out_cache_loc.to(torch.int32): one slot per new token
            _kernel("out_cache_loc_cast", n * (I64 + I32), batch, step),
            # req_to_token[req_pool_indices, locs] = out_cache_loc (int32)
            _kernel("req_to_token_scatter", bs * 2 * I64 + n * 2 * I32, batch, step),
            # seq_lens = seq_lens + 1 (a new tensor: the last batch's forward still reads the old)
            _kernel("seq_lens_add", bs * 2 * I64, batch, step),
        ]
    prefix = sum(batch.prefix_lens)
    return [
        # input_ids = torch.tensor(tokens, device="cuda"): the new tokens, int64
        _copy("h2d_input_ids", n * I64, batch, step),
        # write_req_to_token_pool_triton: read prefix slots (int64) and the new out_cache_loc
        # (int64), write every row's int32 entries.
        _kernel(
            "write_req_to_token_pool_triton",
            (prefix + n) * I64 + (prefix + n) * I32 + bs * 4 * I64,
            batch,
            step,
        ),
    ]


def resolve_future_op(batch: Batch, step: int | None = None) -> Op:
    """FutureMap.resolve_future: where(ids < 0, buf[-ids], ids) over every input id."""
    n = batch.num_tokens
    return _kernel("resolve_future", n * 3 * I64, batch, step)


def store_to_map_op(batch: Batch, step: int | None = None) -> Op:
    """FutureMap.store_to_map: token_ids_buf[interval] = next_token_ids (one per request)."""
    return _kernel("store_to_map", batch.num_seqs * 2 * I64, batch, step)


def d2h_ops(batch: Batch, step: int | None = None, *, return_logprob: bool = False) -> list[Op]:
    """GenerationBatchResult.copy_to_cpu: one non-blocking D2H per tensor the host reads."""
    bs = batch.num_seqs
    ops = [_copy("d2h_next_token_ids", bs * I64, batch, step)]
    if return_logprob:
        ops.append(_copy("d2h_next_token_logprobs", bs * F32, batch, step))
        if batch.mode == "prefill":
            ops.append(_copy("d2h_input_token_logprobs", batch.num_tokens * F32, batch, step))
    return ops


def request_bytes(batch: Batch) -> dict[str, float]:
    """Bytes per request of the scheduler's GPU work, by op (a readable summary for reports)."""
    ops = schedule_ops(batch) + [resolve_future_op(batch), store_to_map_op(batch)] + d2h_ops(batch)
    return {op.name: op.hbm_bytes / batch.num_seqs for op in ops}
