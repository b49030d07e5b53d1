"""The executor's host work per sequence piece (experiments/gpu_validation/host_pieces.py): a
prefill attention launches its per-sequence block once per piece of its micro-batch, so a
micro-batch of one sequence holds the host for less than the calibration's two-sequence serial
run. Hand-built profiler records with known launch times; every number asserted is computed here.
"""

from __future__ import annotations

import pytest

from overlap_lab.device_time import HostLaunch, OpHost
from overlap_lab.experiments.gpu_validation.host_pieces import (
    PieceShare,
    calibration_pieces,
    piece_shares,
    pieces_per_mb,
    repeated_block,
)
from overlap_lab.experiments.gpu_validation.predict import as_executed
from overlap_lab.shared.ir.program import (
    Host,
    HostThread,
    Launch,
    Op,
    Program,
    ProgramMeta,
    RankProgram,
)
from overlap_lab.shared.outputs.trace import Span, Trace


def test_the_longest_block_repeated_once_per_piece():
    assert repeated_block(list("xabcabcz"), 2) == (1, 3)
    assert repeated_block(list("aab"), 2) == (0, 1)  # a block of one kernel counts
    assert repeated_block(list("abcabz"), 3) is None  # not three times
    assert repeated_block(list("abab"), 1) is None  # one piece: nothing to tell apart


def _records(ranges: dict[str, tuple[float, float, list[tuple[float, str]]]]) -> dict:
    """Per op range (name -> (start, end, [(launch call start, kernel name)])), each launch
    with a 1 µs device kernel of that name."""
    ev, c = [], 0
    for name, (t0, t1, calls) in ranges.items():
        ev.append({"ph": "X", "cat": "user_annotation", "name": name, "ts": t0, "dur": t1 - t0})
        for t, k in calls:
            c += 1
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t,
                       "dur": 2.0, "args": {"correlation": c}})  # fmt: skip
            ev.append({"ph": "X", "cat": "kernel", "name": k, "ts": t + 3.0, "dur": 1.0,
                       "args": {"correlation": c, "stream": 7}})  # fmt: skip
    return {"traceEvents": ev}


def test_the_per_piece_share_is_the_host_time_of_the_repeated_block_in_the_ops_range():
    """attn.core's range 0-100: per piece a gemm at 10 / 40 and the attention at 20 / 50 (the
    block, 10 -> 70, the launch after it: 60 of 100 µs), then o_proj at 70. attn.prepare
    repeats too (two ropes) but is not an op the executor runs per piece."""
    attn = [(10.0, "gemm"), (20.0, "sdpa"), (40.0, "gemm"), (50.0, "sdpa"), (70.0, "o_proj")]
    rec = _records({
        "attn.core.L1.mb0": (0.0, 100.0, attn),
        "attn.core.L2.mb0": (200.0, 300.0, [(t + 200.0, k) for t, k in attn]),
        "attn.prepare.L1.mb0": (400.0, 440.0, [(410.0, "rope"), (420.0, "rope")]),
    })  # fmt: skip
    assert piece_shares(rec, 2) == {"attn.core": PieceShare(pytest.approx(0.6), 2)}
    # in a decode (128 pieces, batched) no block repeats 128 times: the host work stays whole
    assert piece_shares(rec, 128) == {}
    # one piece, the calibration's two: the block's 60 % halves
    assert PieceShare(0.6, 2).factor(1) == pytest.approx(0.7)
    assert PieceShare(0.6, 2).factor(2) == pytest.approx(1.0)


def test_pieces_come_from_the_runs_micro_batches():
    one = [{"index": 0, "seq_lo": 0, "seq_hi": 2}]
    two = [{"index": 0, "seq_lo": 0, "seq_hi": 1}, {"index": 1, "seq_lo": 1, "seq_hi": 3}]
    assert pieces_per_mb(two) == {0: 1, 1: 2}
    assert calibration_pieces(one) == 2
    assert calibration_pieces(two) is None  # ranges of different pieces: no one count
    assert calibration_pieces(None) is None


def test_a_micro_batch_of_one_sequence_takes_its_share_of_the_per_piece_host_work():
    ops = [Op("attn.core", layer=1, mb=m, hbm_bytes=1e6) for m in (0, 1)] + [
        Op("gate", layer=1, mb=1, hbm_bytes=1e6)
    ]
    th = HostThread("main", tuple(Launch(o, "main") for o in ops))
    prog = Program((RankProgram(0, ("main",), (th,)),), meta=ProgramMeta(schedule="t"))
    mbs = [{"index": 0, "seq_lo": 0, "seq_hi": 2}, {"index": 1, "seq_lo": 2, "seq_hi": 3}]
    measured = Trace(
        tuple(Span(0, "stream:main", o.name, "compute", 0.0, 1.0, 0, o.mb, 1) for o in ops),
        {"micro_batches": mbs},
    )
    steps = (("host", 100.0), ("launch", 0.0), ("host", 40.0))
    h = HostLaunch(per_op=0.0, per_kernel=0.0,
                   measured={"attn.core": OpHost(steps), "gate": OpHost(steps)})  # fmt: skip
    pieces = {"attn.core": PieceShare(0.6, 2)}
    instrs = as_executed(measured, host_launch=h, pieces=pieces)(prog).ranks[0].threads[0].instrs
    hosts = [(i.us, i.mb) for i in instrs if isinstance(i, Host)]
    # mb 0 holds two pieces, as the calibration: whole; mb 1 one: x 0.7; gate whole
    assert hosts == [(100.0, 0), (40.0, 0), (pytest.approx(70.0), 1), (pytest.approx(28.0), 1),
                     (100.0, 1), (40.0, 1)]  # fmt: skip
    # without the shares every launch keeps the calibration's host work
    plain = as_executed(measured, host_launch=h)(prog).ranks[0].threads[0].instrs
    assert [i.us for i in plain if isinstance(i, Host)] == [100.0, 40.0] * 3


def test_a_converted_archives_profiler_share_is_the_waits_of_whole_eager_passes():
    """Two profiled eager passes of ops a and b (one kernel each): the first waits 50 µs
    between them (span 250, kernels 200), the second 70 (span 270): median span 260, kernel
    time 200. The unprofiled run's eager step 215: it waited 15 where the profiled waited 60."""
    from overlap_lab.experiments.gpu_validation.predict import pass_idle_scale

    ev, c = [], 0
    for t0, gap in ((0.0, 50.0), (1000.0, 70.0)):
        for name, start in (("a.L1.mb0", t0), ("b.L1.mb0", t0 + 100.0 + gap)):
            c += 1
            ev += [
                {"ph": "X", "cat": "user_annotation", "name": name, "ts": start, "dur": 5.0},
                {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": start + 1.0,
                 "dur": 2.0, "args": {"correlation": c}},
                {"ph": "X", "cat": "kernel", "name": "k", "ts": start, "dur": 100.0,
                 "args": {"correlation": c, "stream": 7}},
            ]  # fmt: skip
    rec = {"traceEvents": ev}
    eager = Trace((), {"step_time_source": "eager", "median_step_time_us": 215.0})
    assert pass_idle_scale(eager, rec) == pytest.approx(15.0 / 60.0)
    # a graph-replay run's eager step is its own record; without one, nothing to compare
    replayed = Trace((), {"step_time_source": "graph_replay", "median_step_time_us": 99.0,
                          "eager_step_time_us": 230.0})  # fmt: skip
    assert pass_idle_scale(replayed, rec) == pytest.approx(30.0 / 60.0)
    assert pass_idle_scale(Trace((), {"step_time_source": "graph_replay"}), rec) is None
