"""Every fallback or refusal a schedule took, in words: the one place they are read from.

A schedule that does not run as its name says records why in its Program's meta, under one of
the keys below; :func:`fallback_notes` turns each into one note, which ``overlap_lab.api`` puts
in ``Result.notes`` (``sim``'s summary, ``compare``'s note column, the JSON's ``notes``). A new
schedule that records its fallbacks under these keys gets its notes without touching the API.

- ``fallback_reason``: the batch ran unsplit (TBO, vLLM DBO, DeepSeek refusing a split), or, for
  ``sbo``, the plain forward ran without SBO (DeepEP's normal kernels have no low-latency combine).
- ``sbo_inactive_reason``: ``tbo+sbo`` ran without its SBO part (a prefill on normal kernels runs
  as ``tbo``).
- ``micro_batches``: a micro-batch with no tokens, padded with fake ones (LightLLM pads an empty
  second micro-batch to one token rather than refusing the split).
- ``loop`` rows' ``forced_serial``: iterations ``sglang-overlap`` ran without CPU-GPU overlap.
- ``shared_experts_stream``: the shared experts run on their own stream (``sbo-off``) to overlap
  the routed path; when, in the trace, no other kernel or transfer ran beside them, the step ran
  as ``serial`` does, which is worth saying (docs/schedules.md, "sbo-off").
"""

from __future__ import annotations

from overlap_lab.shared.ir.program_meta import ProgramMeta
from overlap_lab.shared.outputs.trace import Trace, intersect, union

#: Why a side stream of shared experts can overlap nothing (docs/schedules.md, "sbo-off").
SHARED_ALONE = (
    "ran as serial: the shared experts on the {stream} stream overlapped no other kernel or "
    "transfer (forked before top-k, they start first and DeepGEMM's persistent grid takes every "
    "SM, so the routed path waits for them)"
)


def fallback_notes(meta: ProgramMeta, trace: Trace | None = None) -> list[str]:
    """One note per fallback the Program's ``meta`` records (and, given its ``trace``, per
    overlap that did not happen), in the order of the module docstring."""
    notes: list[str] = []
    mbs = meta.micro_batches or []
    if meta.fallback_reason:
        ran = "ran as serial, without SBO" if meta.schedule == "sbo" else "ran unsplit"
        notes.append(f"{ran}: {meta.fallback_reason}")
    if meta.sbo_inactive_reason:
        ran = "ran as tbo, without SBO" if len(mbs) > 1 else "without SBO too"
        notes.append(f"{ran}: {meta.sbo_inactive_reason}")
    for mb in mbs:
        if mb.get("tokens") == 0:
            notes.append(
                f"micro-batch {mb['index']} empty: 0 tokens padded to {mb['padded_tokens']}"
            )
    forced: dict[str, list[int]] = {}
    for row in meta.extra.get("loop", []):
        if row.get("forced_serial"):
            forced.setdefault(str(row["forced_serial"]), []).append(row["step"])
    for reason, steps in forced.items():
        which = ", ".join(map(str, steps))
        notes.append(f"iteration{'s' if len(steps) > 1 else ''} {which} without overlap: {reason}")
    stream = meta.extra.get("shared_experts_stream")
    if stream and trace is not None and _ran_alone(trace, "shared_experts"):
        notes.append(SHARED_ALONE.format(stream=stream))
    return notes


def _ran_alone(trace: Trace, op: str) -> bool:
    """Whether every ``op`` span of the first rank ran with no other GPU work (kernel, copy or
    transfer) in flight; False when there is no such span."""
    ranks = trace.ranks
    if not ranks:
        return False
    spans = [s for s in trace.spans_of(ranks[0]) if s.kind not in ("host", "sync")]
    mine = union((s.start, s.end) for s in spans if s.op == op)
    others = union((s.start, s.end) for s in spans if s.op != op)
    return bool(mine) and not any(hi > lo for lo, hi in intersect(mine, others))
