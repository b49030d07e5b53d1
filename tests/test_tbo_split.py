"""SGLang's TBO split rules (two_batch_overlap.py) pinned on examples, ties and refusals."""

from __future__ import annotations

import pytest

from overlap_lab.shared.inputs.workload import Batch, MicroBatch, Parallel, Workload, get_model
from overlap_lab.shared.schedules import ScheduleConfig
from overlap_lab.shared.schedules.tbo_split import (
    balanced_sum_split,
    children,
    cum_less_than_half_split,
    padded_len,
    tbo_split,
    two_chunk_enabled,
)

DSV3 = get_model("deepseek-v3")


def _w(batch: Batch, attn_tp: int = 1) -> Workload:
    return Workload(DSV3, batch, Parallel(ep=32, attn_tp=attn_tp))


# -- _split_array_by_balanced_sum ------------------------------------------------------------


def test_balanced_sum_upstream_example():
    # left sums 100, 150, 180 (diff 0), then 260: the scan stops at the increase
    assert balanced_sum_split([100, 50, 30, 80, 40, 60]) == 3


def test_balanced_sum_keeps_the_later_index_on_a_tie():
    # cut 1: 1 | 3 (diff 2); cut 2: 3 | 1 (diff 2): `diff <= min_diff` keeps 2
    assert balanced_sum_split([1, 2, 1]) == 2
    assert balanced_sum_split([3, 3]) == 1


def test_balanced_sum_stops_at_first_increase():
    # diffs 4, 0, 2: the scan stops at cut 3 and keeps cut 2
    assert balanced_sum_split([2, 2, 1, 3]) == 2


def test_balanced_sum_walks_a_plateau_to_its_end():
    # diffs 4, 0, 0, 0 (zero-length entries): every tie moves the cut later
    assert balanced_sum_split([2, 2, 0, 0, 4]) == 4


def test_balanced_sum_single_sequence_is_zero():
    assert balanced_sum_split([4096]) == 0


def test_cum_less_than_half():
    assert cum_less_than_half_split([1, 3]) == 1  # half 2: 1, then 4 > 2
    assert cum_less_than_half_split([2, 1, 5]) == 2  # half 4: 2, 3, 8
    assert cum_less_than_half_split([8000, 100, 100]) == 0


# -- two-chunk -----------------------------------------------------------------------------


def test_two_chunk_threshold():
    assert not two_chunk_enabled([4096, 4096, 1], 0.48)  # 4096 / 8193 = 0.49995
    assert two_chunk_enabled([45, 55], 0.48)  # lighter side 0.45 < 0.48
    assert not two_chunk_enabled([45, 55], 0.40)
    assert two_chunk_enabled([4096], 0.48)  # one sequence: left side empty


def test_two_chunk_guard_declines_degenerate_batches():
    # upstream: child A would hold 1 sequence and 0 tokens -> balanced split instead
    assert not two_chunk_enabled([1], 0.48)


def test_two_chunk_children_share_the_cut_sequence():
    split = children(Batch.prefill(extend_lens=[8000, 100, 100]), 0.48, 1)
    a, b = split.micro_batches
    assert split.two_chunk and split.split_seq_index == 0 and split.split_token_index == 4100
    assert a == MicroBatch(0, 0, 1, 0, 4100, 4100, True)
    assert b == MicroBatch(1, 0, 3, 4100, 8200, 4100, True)


def test_single_long_prefill_is_cut_in_half():
    a, b = children(Batch.prefill(extend_lens=[4097]), 0.48, 1).micro_batches
    assert (a.tokens, b.tokens) == (2048, 2049)
    assert (a.seq_lo, a.seq_hi, b.seq_lo, b.seq_hi) == (0, 1, 0, 1)


def test_balanced_prefill_split_on_sequence_boundary():
    split = children(Batch.prefill(extend_lens=[100, 50, 30, 80, 40, 60]), 0.48, 1)
    a, b = split.micro_batches
    assert not split.two_chunk
    assert (a.seq_lo, a.seq_hi, a.tokens) == (0, 3, 180)
    assert (b.seq_lo, b.seq_hi, b.tokens) == (3, 6, 180)


# -- decode, target verify, padding ----------------------------------------------------------


def test_decode_halves_the_sequences():
    a, b = children(Batch.decode(7), 0.48, 1).micro_batches
    assert (a.seq_hi, a.tokens, b.seq_lo, b.tokens) == (3, 3, 3, 4)


def test_target_verify_halves_sequences_not_tokens():
    split = children(Batch.decode(6, tokens_per_seq=3), 0.48, 1)
    assert (split.split_seq_index, split.split_token_index) == (3, 9)


@pytest.mark.parametrize("n,tp,expected", [(0, 4, 0), (1, 4, 4), (4, 4, 4), (5, 4, 8), (3, 1, 3)])
def test_padded_len(n, tp, expected):
    assert padded_len(n, tp) == expected


def test_children_padded_to_attention_tp():
    a, b = children(Batch.decode(5), 0.48, 4).micro_batches
    assert (a.tokens, a.padded_tokens, b.tokens, b.padded_tokens) == (2, 4, 3, 4)


# -- refusals --------------------------------------------------------------------------------


def test_refuses_extend_with_low_latency_deepep():
    s = tbo_split(_w(Batch.prefill(2, extend_len=512)), ScheduleConfig(), "low_latency")
    assert s.micro_batches is None and "low-latency" in s.fallback_reason


def test_target_verify_with_low_latency_is_not_refused():
    s = tbo_split(_w(Batch.decode(4, tokens_per_seq=2)), ScheduleConfig(), "low_latency")
    assert s.micro_batches is not None


def test_refuses_when_dp_ranks_disagree():
    cfg = ScheduleConfig(dp_ranks_disagree=True)
    s = tbo_split(_w(Batch.decode(64)), cfg, "low_latency")
    assert s.micro_batches is None and "DP ranks disagree" in s.fallback_reason


@pytest.mark.parametrize("batch", [Batch.decode(1), Batch.prefill(extend_lens=[1])])
def test_refuses_an_empty_micro_batch(batch):
    mode = "low_latency" if batch.mode == "decode" else "normal"
    s = tbo_split(_w(batch), ScheduleConfig(), mode)
    assert s.micro_batches is None and s.fallback_reason.startswith("empty micro-batch")


def test_threshold_knob_changes_the_split():
    lens = [45, 55]
    on = tbo_split(_w(Batch.prefill(extend_lens=lens)), ScheduleConfig(), "normal")
    off = tbo_split(
        _w(Batch.prefill(extend_lens=lens)), ScheduleConfig(tbo_threshold=0.4), "normal"
    )
    assert on.two_chunk and [m.tokens for m in on.micro_batches] == [50, 50]
    assert not off.two_chunk and [m.tokens for m in off.micro_batches] == [45, 55]
