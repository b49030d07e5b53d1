"""The executor's host work per sequence piece: an op it runs once per sequence of its
micro-batch holds the host in proportion to those sequences, not to its tokens.

In a prefill, ``attn_core`` (``real/kernels/attention.py``) runs the expanded MLA (or GQA)
attention of each sequence piece of the micro-batch in turn, then one ``o_proj`` for them all:
its launches are a block repeated once per piece. A micro-batch of one sequence (DeepSeek's,
TBO's, ... two micro-batches of a two-sequence prefill) launches that block once where the
calibration's serial run launched it twice. Every other op launches the same kernels whatever
its tokens, so its host work hardly moves with them (the H200 recording of 2026-11-26, serial
under the profiler: decode 128 sequences against prefill 4096 tokens, ``select_experts`` 238 /
343 µs before / after its launch point in both, ``shared_experts`` 97 / 135 against 105 / 146).

Which part of the op's host work is per piece is read off the calibration's profiler records:
the longest block of launches (by the kernels they ran) that repeats back to back once per
piece of the op's micro-batch, and the host time from its first launch to the launch after its
last repeat. Where no such block is found (decode's batched form, a calibration of one piece
per micro-batch) the op's host work stays whole.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: the ops the executor runs once per sequence piece of their micro-batch, where their
#: launches show it (``real/kernels/attention.py``: ``attn_core``'s prefill loop)
PER_PIECE = ("attn.core",)


@dataclass(frozen=True)
class PieceShare:
    """``share``: the part of an op's host work (its range in the calibration's eager runs,
    median over its ranges) spent launching its per-piece block, repeated for the ``pieces``
    sequence pieces of the calibration's micro-batch."""

    share: float
    pieces: int

    def factor(self, pieces: int) -> float:
        """The op's host work with ``pieces`` pieces over the calibration's."""
        return 1.0 - self.share + self.share * pieces / self.pieces


def repeated_block(names: Sequence[Any], n: int) -> tuple[int, int] | None:
    """(start, length) of the longest block of ``names`` that repeats ``n`` times back to back
    (the first such block at that length); None where ``n`` < 2 or there is none."""
    if n < 2:
        return None
    for size in range(len(names) // n, 0, -1):
        for i in range(len(names) - size * n + 1):
            block = names[i : i + size]
            if all(names[i + k * size : i + (k + 1) * size] == block for k in range(1, n)):
                return i, size
    return None


def piece_shares(trace: Mapping[str, Any] | list, pieces: int,
                 ops: Sequence[str] = PER_PIECE) -> dict[str, PieceShare]:  # fmt: skip
    """Per op of ``ops`` whose launches in ``trace`` (a profiler trace of the executor's eager
    runs, as ``overlap_lab.device_time.host_calls`` reads it) repeat a block once per piece of
    its micro-batch (``pieces`` of them in every range), its :class:`PieceShare`."""
    from overlap_lab.device_time import host_calls

    ranges, calls = host_calls(trace)
    starts = [c[0] for c in calls]
    got: dict[str, list[float]] = defaultdict(list)
    for a, b, op in ranges:
        inside = calls[bisect.bisect_left(starts, a) : bisect.bisect_right(starts, b)]
        if op[0] not in ops or not inside or b <= a:
            continue
        names = [tuple(str(r.get("name")) for r in recs) for _, _, recs in inside]
        found = repeated_block(names, pieces)
        if found is None:
            got[op[0]].append(0.0)
            continue
        i, size = found
        j = i + size * pieces
        end = inside[j][0] if j < len(inside) else max(c[1] for c in inside)
        got[op[0]].append(min((end - inside[i][0]) / (b - a), 1.0))
    return {n: PieceShare(statistics.median(v), pieces)
            for n, v in sorted(got.items()) if statistics.median(v) > 0}  # fmt: skip


def pieces_per_mb(micro_batches: Sequence[Mapping] | None) -> dict[int, int]:
    """Per micro-batch index its sequence pieces (the executor's trace meta ``micro_batches``:
    sequences [seq_lo, seq_hi), a split sequence counted in both halves)."""
    return {int(m["index"]): int(m["seq_hi"]) - int(m["seq_lo"]) for m in micro_batches or ()}


def calibration_pieces(micro_batches: Sequence[Mapping] | None) -> int | None:
    """The pieces of every micro-batch of a calibration run, where they are all the same (its
    op ranges then all hold that many); None otherwise."""
    got = set(pieces_per_mb(micro_batches).values())
    return got.pop() if len(got) == 1 else None
