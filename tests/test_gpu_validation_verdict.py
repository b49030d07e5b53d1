"""The GPU validation loop's verdict (its last line) on synthetic numbers, and the CPU dry run's
verdict line, results files and measured rows for every op (no roofline rows in a validation)."""

from __future__ import annotations

import json

import pytest

from overlap_lab.experiments import gpu_validation as GV


def _run(pred: float, meas: float, ex_pred: float = 0.0, ex_meas: float = 0.0, ok=True) -> dict:
    return {
        "comparable": ok,
        "comparison": {
            "step_time_us": {"predicted": pred, "measured": meas,
                             "rel_error": (pred - meas) / meas},
            "exposed_comm_us": {"predicted": ex_pred, "measured": ex_meas,
                                "abs_error_us": ex_pred - ex_meas},
        },
    }  # fmt: skip


def _cases(**runs) -> dict:
    return {"decode_32": {"runs": runs}}


def test_pass_when_every_target_is_met():
    v = GV.verdict(_cases(a=_run(103, 100, 500, 520), b=_run(196, 200, 40, 80),
                          c=_run(300, 300, 1000, 1090)))  # fmt: skip
    assert v["pass"], v
    assert v["median_abs_step_error"] == pytest.approx(0.02)
    assert v["max_abs_step_error"] == pytest.approx(0.03) and v["worst_run"] == "decode_32/a"
    line = GV.verdict_line(v)
    assert line.startswith("VERDICT PASS: median |step error| 2.0% (<= 5% ok); max 3.0% ")
    assert "ranking the same in 1/1 cases" in line and "in 3/3 runs" in line


def test_each_target_fails_on_its_own():
    # median over 5 %
    v = GV.verdict(_cases(a=_run(106, 100), b=_run(94, 100), c=_run(200, 200)))
    assert not v["pass"] and v["checks"] == {"median_step": False, "max_step": True,
                                             "ranking": True, "exposed_comm": True}  # fmt: skip
    # one outlier beyond 10 % with a good median
    v = GV.verdict(_cases(a=_run(100, 100), b=_run(200, 200), c=_run(340, 300), d=_run(4, 4)))
    assert v["checks"]["max_step"] is False and v["checks"]["median_step"] is True
    assert "MISSED" in GV.verdict_line(v) and GV.verdict_line(v).startswith("VERDICT FAIL")
    # exposed communication: 60 us off and 12 % off misses; 60 us off at 1000 us (6 %) does not
    v = GV.verdict(_cases(a=_run(100, 100, 560, 500)))
    assert v["checks"]["exposed_comm"] is False and v["exposed_worst"]["abs_us"] == 60
    assert GV.verdict(_cases(a=_run(100, 100, 1060, 1000)))["checks"]["exposed_comm"]
    assert GV.verdict(_cases(a=_run(100, 100, 45, 0)))["checks"]["exposed_comm"]  # under 50 us


def test_ranking_counts_ties_within_two_percent():
    # measured a < b by 1.5 %: tied, so predicting b < a is no disagreement
    v = GV.verdict(_cases(a=_run(101, 100), b=_run(99.5, 101.5)))
    assert v["checks"]["ranking"] and v["ranking_discordant"] == {}
    # measured a < b by 10 %, predicted b < a by 4 %: discordant
    v = GV.verdict(_cases(a=_run(104, 100), b=_run(100, 110)))
    assert not v["checks"]["ranking"] and v["ranking_discordant"] == {"decode_32": [("a", "b")]}
    assert "discordant decode_32: a/b" in GV.verdict_line(v)


def test_the_communication_only_case_has_its_own_five_percent_target():
    runs = dict(a=_run(100, 100), b=_run(200, 200))
    ok = GV.verdict(_cases(**runs, **{GV.COMM_ONLY: _run(104, 100, ok=False)}))
    assert ok["pass"] and ok["checks"]["comm_only"] and ok["runs"] == 2
    assert "comm-only |step error| decode_32 4.0% (<= 5% ok)" in GV.verdict_line(ok)
    bad = GV.verdict(_cases(**runs, **{GV.COMM_ONLY: _run(94, 100, ok=False)}))
    assert not bad["pass"] and bad["checks"]["comm_only"] is False
    assert "comm_only" not in GV.verdict(_cases(**runs))["checks"]  # not run: not judged


def test_excluded_runs_do_not_count_and_no_run_fails():
    v = GV.verdict(_cases(a=_run(100, 100), pp=_run(900, 100, ok=False)))
    assert v["pass"] and v["runs"] == 1
    v = GV.verdict({"decode_32": {"runs": {"a": {"error": "boom"}}}})
    assert not v["pass"] and GV.verdict_line(v) == "VERDICT FAIL: no comparable run"
    assert GV.verdict_line(v, dry_run=True).startswith("VERDICT: nothing judged (CPU dry run")


def test_dry_run_prints_the_verdict_last_and_times_every_op_from_a_measurement(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("simpy")
    rc = GV.main(
        ["--device", "cpu", "--out", str(tmp_path / "out"), "--results", str(tmp_path / "res"),
         "--name", "dry", "--modes", "decode", "--batches", "4", "--schedules",
         "serial,sbo,lightllm", "--repeats", "1", "--warmup", "0", "--no-figures", "--kernels"]
    )  # fmt: skip
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    # the dry run judges nothing: its last line says so, never PASS or FAIL
    assert lines[-1] == GV.DRY_RUN_LINE.format(runs=3)
    assert "PASS" not in lines[-1] and "FAIL" not in lines[-1]
    report = json.loads((tmp_path / "res" / "gpu_cpu.json").read_text())
    assert (tmp_path / "res" / "gpu_cpu.md").read_text().rstrip().endswith(lines[-1])
    runs = report["cases"]["decode_4"]["runs"]
    for name, r in runs.items():
        assert r["roofline_ops"] == [], (name, r["roofline_ops"])  # no roofline rows
        for cls, n in r["cost_sources"].items():
            assert "roofline" not in n, (name, cls, n)
    assert runs["serial"]["rows_from_own_run"] == {}
    assert "experts.down.0" in runs["sbo"]["rows_from_own_run"]["grouped_gemm"]
    assert "experts.gate_up" in runs["lightllm"]["rows_from_own_run"]["grouped_gemm"]
    assert report["verdict"]["runs"] == 3
    assert (tmp_path / "res" / "kernels_cpu.json").is_file()
    assert lines[-2].startswith("kernels: GOAL ")


def test_results_of_two_commands_merge_and_the_verdict_covers_both(tmp_path):
    base = {
        "preset": "h200",
        "model": "deepseek-v3",
        "layers": 4,
        "ep": 32,
        "timing_meaningful": True,
        "precision": {"gemm": {"executor_and_simulator": "bf16"}},
    }
    path = tmp_path / "gpu_h200.json"
    first = dict(base, cases=_cases(a=_run(100, 100), b=_run(200, 200)), commands=["decode"])
    path.write_text(json.dumps(first))
    second = dict(base, cases={"prefill_4096": {"runs": {"a": _run(150, 100)}}},
                  commands=["prefill"])  # fmt: skip
    out = GV.merged(second, path)
    assert set(out["cases"]) == {"decode_32", "prefill_4096"}
    assert out["verdict"]["runs"] == 3 and out["merged_commands"] == [["decode"], ["prefill"]]
    other = dict(second, precision={"gemm": {"executor_and_simulator": "fp8"}})
    assert GV.merged(other, path) is other  # another precision: not merged


def test_own_run_rows_name_known_ops_and_class_the_split_ones():
    """Rows for ops serial does not run: a known name (SGLang's overlap-scheduler ops) under
    its own name, a split expert kernel under its class; both then time the op in the
    simulator (no roofline left), and ops without work get no row."""
    pytest.importorskip("simpy")
    from overlap_lab.calibrate import unprofiled_rows, with_rows
    from overlap_lab.real import model as M
    from overlap_lab.shared import schedules as S
    from overlap_lab.shared.inputs.hardware import get_gpu
    from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload
    from overlap_lab.shared.ir.program import ops_of
    from overlap_lab.sim import simulate as sim_run
    from overlap_lab.sim.calibrate import profile_from_trace
    from overlap_lab.sim.cost import duration_source

    g = get_gpu("h100")
    w = Workload(M.get_model_config("tiny-mla"), Batch.decode(kv_lens=[40] * 6), Parallel(ep=2))
    serial = S.build("serial", w, g)
    prof = profile_from_trace(sim_run(serial, g), serial, num_sms=g.num_sms)
    for name, want in (("sglang-overlap", "req_to_token_gather"), ("sbo", "grouped_gemm")):
        prog = S.build(name, w, g)
        before = {op.name for _, op in ops_of(prog)
                  if op.kind == "compute" and (op.flops > 0 or op.hbm_bytes > 0)
                  and duration_source(op, g, prof) == "roofline"}  # fmt: skip
        assert before, name
        rows = unprofiled_rows([(sim_run(prog, g), prog)], num_sms=g.num_sms, source="t",
                               names=before)  # fmt: skip
        assert want in {r["op"] for r in rows}
        p2 = with_rows(prof, rows)
        left = {op.name for _, op in ops_of(prog) if op.name in before
                and duration_source(op, g, p2) == "roofline"}  # fmt: skip
        assert left == set(), (name, left)
