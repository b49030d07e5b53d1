"""``overlap-lab kernels --device cpu``: the dry run of the kernel table walks the GPU's cases
(same list, same calls, same timing code), computes the same results on both sides of each
comparison, and prints the goal line last."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")


def test_the_cpu_cases_are_the_gpus_cases():
    from overlap_lab.real.kernel_table import SHAPES

    cpu = [(s["case"], s["cls"], sorted(s)) for s in SHAPES["cpu"]]
    gpu = [(s["case"], s["cls"], sorted(s)) for s in SHAPES["cuda"]]
    assert cpu == gpu
    assert {s["cls"] for s in SHAPES["cuda"]} == {"gemm", "grouped_gemm", "attention",
                                                   "elementwise"}  # fmt: skip


def test_executor_and_best_compute_the_same_thing():
    """A comparison of two kernels is only fair if they do the same work: the GEMMs and the
    prefill attention give the same numbers (the bandwidth floors copy, nothing to compare)."""
    from overlap_lab.real.kernel_table import build_cases

    cases = build_cases("cpu")
    checked = 0
    for c in cases:
        if c.unit != "TFLOP/s":
            continue
        a, b = c.executor(), c.best()
        torch.testing.assert_close(a.reshape(b.shape), b, rtol=1e-4, atol=1e-4)
        checked += 1
    assert checked == 5


def test_kernels_dry_run_writes_json_and_markdown(tmp_path, capsys):
    from overlap_lab.cli.main import main

    out = tmp_path / "k" / "kernels.json"  # --out is a folder, as every other --out folder
    rc = main(["kernels", "--device", "cpu", "--out", str(out.parent), "--repeats", "1",
               "--warmup", "0"])  # fmt: skip
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("**DRY RUN")
    assert lines[-1].startswith("GOAL ") and lines[-1].endswith("[CPU dry run: meaningless]")
    report = json.loads(out.read_text())
    assert report["timing_meaningful"] is False and report["goal"] == 0.7
    assert {r["op_class"] for r in report["rows"]} == set(report["worst_ratio_by_class"])
    for r in report["rows"]:
        assert r["executor_us"] > 0 and r["best_us"] > 0
        assert r["ratio"] == pytest.approx(r["best_us"] / r["executor_us"])
        assert r["goal_met"] == (r["ratio"] >= 0.7)
    assert report["goal_met"] == all(v >= 0.7 for v in report["worst_ratio_by_class"].values())
    assert out.with_suffix(".md").read_text().rstrip().endswith(lines[-1])


def test_kernels_cuda_without_a_gpu_is_one_error_line(capsys):
    from overlap_lab.cli.main import main

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert main(["kernels", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a CUDA GPU" in err[0]
