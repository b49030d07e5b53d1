"""The interference probe's dry run on CPU: the command a GPU session runs writes what
``tests/test_interference.py`` reads, and its kernel records keep what the profiler says."""

from __future__ import annotations

import gzip
import json

from overlap_lab.experiments import gpu_interference
from overlap_lab.real.interference import calls_beside, kernel_events
from tests.test_interference import PAIRS, measured


def test_dry_run_writes_the_test_data_format(tmp_path):
    assert gpu_interference.main(["--device", "cpu", "--out", str(tmp_path)]) == 0
    alone, pairs, grids = measured(tmp_path / "interference_cpu.txt")
    assert set(alone) == {"gemm8192", "gemm128", "copy", "attn"}
    assert set(pairs) == set(PAIRS)  # every ordered pair the H200 data has
    assert all(a > 0 and b > 0 for a, b in pairs.values()) and grids == {}
    with gzip.open(tmp_path / "interference_cpu_kernels.json.gz", "rt") as f:
        doc = json.load(f)
    rec = doc["pairs"]["gemm8192|gemm128"]
    us = doc["alone_us"]  # unrounded (the text file keeps one decimal)
    assert rec["calls_b"] == calls_beside(us["gemm8192"], us["gemm128"])
    assert alone == {k: round(v, 1) for k, v in us.items()}
    assert isinstance(rec["kernels"], list)  # no device kernels on CPU
    assert doc["device_name"] == "cpu (dry run)" and doc["command"].endswith(
        "--device cpu --out " + str(tmp_path)
    )


def test_kernel_events_keep_the_launch_shape():
    """A device kernel as torch.profiler's Chrome trace writes it (the H200 traces' fields)."""
    events = [
        {"cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": 5.0},
        {"cat": "kernel", "name": "nvjet_sm90_tst_256x128_64x4_2x1_v_bz_coopA_TNT", "ts": 10.0,
         "dur": 597.0, "args": {"stream": 7, "grid": [2, 66, 1], "block": [384, 1, 1],
                                "shared memory": 213188, "registers per thread": 168}},
    ]  # fmt: skip
    (k,) = kernel_events(events)
    assert k == {
        "name": "nvjet_sm90_tst_256x128_64x4_2x1_v_bz_coopA_TNT", "stream": 7, "ts": 10.0,
        "dur": 597.0, "grid": [2, 66, 1], "block": [384, 1, 1], "smem": 213188, "regs": 168,
    }  # fmt: skip


def test_calls_beside_is_the_probes_rule():
    assert calls_beside(596.8, 22.7) == 1056  # the H200 data's gemm8192 beside gemm128
    assert calls_beside(22.7, 596.8) == 8
