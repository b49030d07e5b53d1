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
    """A comparison of two kernels is only fair if they do the same work: every reference that
    computes (GEMMs, the prefill attention) gives the executor's numbers; the floors (copies,
    the roofline's GEMM) are not outputs to compare."""
    from overlap_lab.real.kernel_table import build_cases

    checked = 0
    for c in build_cases("cpu"):
        if c.skipped:
            continue
        for r in c.refs:
            if r.same_work:
                a, b = c.executor(), r.fn()
                torch.testing.assert_close(a.reshape(b.shape), b, rtol=1e-4, atol=1e-4)
                checked += 1
    assert checked == 5


def test_every_row_has_its_executor_call_or_says_why_not():
    """Each GEMM shape has the three paths the executor can take (BF16 on every SM, the
    SM-limited path, FP8), decode attention FlashMLA and its SDPA fallback; on the CPU the rows
    that need a GPU are skipped with the reason, and the fallback row counts only where FlashMLA
    cannot run."""
    from overlap_lab.real.kernel_table import build_cases

    cases = {c.name: c for c in build_cases("cpu")}
    for g in ("gemm decode", "gemm prefill", "grouped_gemm decode", "grouped_gemm prefill"):
        assert cases[f"{g} bf16"].skipped is None and cases[f"{g} bf16"].counted
        assert "SM-budget" in cases[f"{g} bf16, SM-limited path"].skipped
        assert "CPU has no FP8" in cases[f"{g} fp8"].skipped
    assert cases["attention decode flash_mla"].skipped == "flash_mla is not installed"
    sdpa = cases["attention decode sdpa (fallback)"]
    assert sdpa.counted and sdpa.combine == "max"
    assert [r.same_work for r in sdpa.refs] == [False, False]


def test_the_decode_roofline_is_the_larger_floor_and_says_which(monkeypatch):
    """Decode MLA at 128 heads is compute-bound on Hopper: the best is the larger of its bytes
    at copy bandwidth and its FLOPs at the dense GEMM's rate, each from a measured call."""
    import overlap_lab.real.kernel_table as kt

    c = next(c for c in kt.build_cases("cpu") if c.name.startswith("attention decode sdpa"))
    times = iter([10.0, 4.0])  # the copy, then the dense GEMM
    monkeypatch.setattr(kt, "time_us", lambda *a, **k: (next(times), "host clock"))
    best, label, refs = kt._best(c, torch.device("cpu"), 0, 1)
    mem, comp = (r.scale for r in c.refs)
    assert mem == 0.5 and best == max(10.0 * mem, 4.0 * comp)
    assert label.startswith("roofline, the larger floor: ")
    assert refs == {c.refs[0].label: 5.0, c.refs[1].label: 4.0 * comp}


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
    counted = [r for r in report["rows"] if r["counted"]]
    assert {r["op_class"] for r in counted} == set(report["worst_ratio_by_class"])
    assert all(r.get("skipped") for r in report["rows"] if not r["counted"])  # the CPU's
    for r in counted:
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


def test_the_flash_mla_row_where_flash_mla_runs(monkeypatch):
    """Where FlashMLA runs (a fake asserting its preconditions, tests/test_real_flash_mla.py,
    at FlashMLA's head sizes in bf16), the decode row is the executor's FlashMLA call, counted,
    against the best installed kernels for its work (FlashMLA alone on prepared queries + the
    absorptions as cuBLAS bmm, summed), its roofline reported beside it; the SDPA path is the
    uncounted fallback row and computes the same output."""
    import overlap_lab.real.kernel_table as kt
    import overlap_lab.real.kernels.attention as A
    from overlap_lab.real import model as M
    from tests.test_real_flash_mla import FakeFlashMLA1

    fm = FakeFlashMLA1(use_legacy=True)
    monkeypatch.setattr(A, "flash_mla_module", lambda: fm)
    monkeypatch.setattr(M, "flash_mla_unusable", lambda cfg, cache, module: None)  # a CPU cache
    monkeypatch.setattr(kt, "_dtype", lambda dev: torch.bfloat16)
    shapes = [s for s in kt.SHAPES["cpu"] if s["case"] == "attention decode"]
    shapes = [{**shapes[0], "C": 512, "R": 64, "S": 2, "L": 64}]
    monkeypatch.setitem(kt.SHAPES, "cpu", shapes)
    flash, sdpa = kt.build_cases("cpu")
    assert flash.counted and flash.skipped is None and flash.combine == "sum"
    assert not sdpa.counted and sdpa.refs is flash.refs
    a, b = flash.executor(), sdpa.executor()
    assert float((a.float() - b.float()).norm() / b.float().norm()) < 2e-2
    report = kt.kernel_table("cpu", warmup=0, repeats=1)
    row = report["rows"][0]
    assert row["best_us"] == pytest.approx(sum(row["references_us"][r.label] for r in flash.refs))
    assert row["roofline_ratio"] > 0 and set(report["worst_ratio_by_class"]) == {"attention"}
    assert report["rows"][1]["counted"] is False


def test_a_failing_call_is_a_row_and_every_row_is_reported_as_it_ends(monkeypatch):
    """An executor call that raises is a row with its error and the goal not met (the table
    still ends); ``on_row`` sees the report after each row, incomplete until the last."""
    import overlap_lab.real.kernel_table as kt

    def boom():
        raise RuntimeError("JIT\nfailed")

    ok = kt.Case("ok", "gemm", {}, lambda: torch.ones(2), [kt.Ref("r", lambda: torch.ones(2))],
                 "k", 1.0, "TFLOP/s")  # fmt: skip
    bad = kt.Case("bad", "gemm", {}, boom, [kt.Ref("r", lambda: torch.ones(2))], "k", 1.0,
                  "TFLOP/s")  # fmt: skip
    monkeypatch.setattr(kt, "build_cases", lambda dev: [ok, bad])
    seen = []
    report = kt.kernel_table("cpu", warmup=0, repeats=1, on_row=seen.append)
    assert [len(r["rows"]) for r in seen] == [1, 2] and not any(r["complete"] for r in seen)
    assert report["complete"] and not report["goal_met"]
    assert report["rows"][1]["error"] == "RuntimeError: JIT failed"
    assert report["worst_ratio_by_class"] == {"gemm": 0.0}
    text = kt.table_text(seen[0])
    assert "failed" not in text and text.rstrip().endswith(
        "[INCOMPLETE: stopped before every case ran]"
    )
    assert "| bad |  | failed: RuntimeError: JIT failed |" in kt.table_text(report)
