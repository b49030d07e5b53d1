"""SGLang's TBO split rules (``batch_overlap/two_batch_overlap.py``) and its refusals.

- decode / target-verify: ``split_seq = (num_tokens // tokens_per_seq) // 2`` sequences go to A;
- extend: ``_split_array_by_balanced_sum`` over the extend lengths, unless the lighter side would
  hold less than ``tbo_token_distribution_threshold`` (default 0.48) of the tokens, in which case
  the two-chunk split cuts one sequence at ``total // 2`` tokens (A ends with its head, B starts
  with its tail);
- each child is padded up to a multiple of attention TP (``tbo_padded_len``);
- refusals (the batch then runs unsplit): extend with low-latency DeepEP, DP ranks that do not
  all agree, and a split that leaves a micro-batch empty (``compute_split_seq_index`` returned None
  for a split at 0 or at the end in SGLang's first TBO versions; vLLM's DBO aborts the same way).

Pure functions of lists of ints, so the tests can pin upstream's exact index choices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from overlap_lab.shared.inputs.knobs import knob
from overlap_lab.shared.inputs.workload import Batch, MicroBatch, Workload
from overlap_lab.shared.schedules.common import ScheduleKnobs
from overlap_lab.shared.schedules.config import ScheduleConfig


@dataclass(frozen=True)
class SplitKnobs(ScheduleKnobs):
    """The knobs of TBO's split (tbo's and tbo+sbo's ``Knobs`` hold them)."""

    tbo_threshold: float = knob(
        0.48,
        "SGLang tbo_token_distribution_threshold",
        unit="fraction",
        lo=0.01,
        hi=0.5,
        tune=(0.25, 0.35),
    )
    dp_ranks_disagree: bool = knob(False, "some DP rank cannot split (or runs another mode)")


def balanced_sum_split(arr: Sequence[int]) -> int:
    """``_split_array_by_balanced_sum``: scan cut points 1..n-1 left to right, keep the later index
    on a tie (``diff <= min_diff``) and stop at the first increase of the difference."""
    overall = sum(arr)
    left, min_diff, best = 0, float("inf"), 0
    for i in range(1, len(arr)):
        left += arr[i - 1]
        diff = abs(left - (overall - left))
        if diff <= min_diff:
            min_diff, best = diff, i
        else:
            break
    return best


def cum_less_than_half_split(arr: Sequence[int]) -> int:
    """``_split_array_by_cum_less_than_half``: the first sequence whose running sum passes
    ``total // 2``: the one the two-chunk split cuts."""
    half, left = sum(arr) // 2, 0
    for i, n in enumerate(arr):
        left += n
        if left > half:
            return i
    return 0


def two_chunk_enabled(extend_lens: Sequence[int], threshold: float) -> bool:
    """``_is_two_chunk_split_enabled``: the balanced split leaves a side below ``threshold``.

    Upstream's guard is kept: when child A would hold more sequences than tokens (one sequence of
    one token, say) the two-chunk split is declined and the balanced split is used.
    """
    vanilla = balanced_sum_split(extend_lens)
    left, overall = sum(extend_lens[:vanilla]), sum(extend_lens)
    want = left < overall * threshold or left > overall * (1 - threshold)
    if not want:
        return False
    child_a_seqs = cum_less_than_half_split(extend_lens) + 1
    return child_a_seqs <= overall // 2


def padded_len(tokens: int, attn_tp: int) -> int:
    """``tbo_padded_len``: ``((n - 1) // attn_tp + 1) * attn_tp`` (0 stays 0)."""
    return ((tokens - 1) // attn_tp + 1) * attn_tp


@dataclass(frozen=True)
class TboSplit:
    """The two children, or None with the reason SGLang would run the batch unsplit."""

    micro_batches: tuple[MicroBatch, MicroBatch] | None
    fallback_reason: str | None = None
    two_chunk: bool = False
    split_seq_index: int | None = None
    split_token_index: int | None = None

    def as_meta(self) -> dict:
        return {
            "two_chunk": self.two_chunk,
            "split_seq_index": self.split_seq_index,
            "split_token_index": self.split_token_index,
        }


def split_indices(batch: Batch, threshold: float) -> tuple[int, int, bool]:
    """(split_seq_index, split_token_index, two_chunk) as ``compute_split_*_index`` give them."""
    if batch.mode == "decode":
        seq = (batch.num_tokens // batch.tokens_per_seq) // 2
        return seq, seq * batch.tokens_per_seq, False
    lens = batch.extend_lens
    if two_chunk_enabled(lens, threshold):
        return cum_less_than_half_split(lens), sum(lens) // 2, True
    seq = balanced_sum_split(lens)
    return seq, sum(lens[:seq]), False


def children(batch: Batch, threshold: float, attn_tp: int) -> TboSplit:
    """``TboForwardBatchPreparer.prepare_raw``: A = tokens [0, t), B = [t, end); with two-chunk A
    holds sequences [0, s + 1) and B [s, n), sharing sequence s."""
    seq, tok, two_chunk = split_indices(batch, threshold)
    n, total = batch.num_seqs, batch.num_tokens
    a = MicroBatch(0, 0, seq + 1 if two_chunk else seq, 0, tok, padded_len(tok, attn_tp), two_chunk)
    b = MicroBatch(1, seq, n, tok, total, padded_len(total - tok, attn_tp), two_chunk)
    return TboSplit((a, b), None, two_chunk, seq, tok)


def tbo_split(w: Workload, cfg: ScheduleConfig, deepep_mode: str) -> TboSplit:
    """The split SGLang runs for this rank's batch, or the reason it runs the batch unsplit.

    Checked in SGLang's order (``TboDPAttentionPreparer``): the local split and the local veto
    (extend with low-latency DeepEP), then the all-reduced agreement of the DP ranks.
    """
    b = w.batch
    if b.mode == "prefill" and deepep_mode == "low_latency":
        return TboSplit(None, "extend with low-latency DeepEP: TBO is not supported (SGLang)")
    k = cfg.of(SplitKnobs)
    split = children(b, k.tbo_threshold, w.parallel.attn_tp)
    a, c = split.micro_batches
    if a.tokens == 0 or c.tokens == 0:
        which = "first" if a.tokens == 0 else "second"
        reason = f"empty micro-batch: the {which} child of {b.num_seqs} sequence(s) has no tokens"
        return TboSplit(
            None, reason, split.two_chunk, split.split_seq_index, split.split_token_index
        )
    if k.dp_ranks_disagree:
        return TboSplit(
            None,
            "DP ranks disagree (a rank cannot split or runs another forward mode): nobody splits",
            split.two_chunk,
            split.split_seq_index,
            split.split_token_index,
        )
    return split
