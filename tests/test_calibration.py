"""Measured traces in: analyze (kernel classes, stream roles, overlap), profiles built from traces
(the round trip), validate (predicted vs measured, op by op), the calibrate microbenchmark plan."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from overlap_lab import validate as V
from overlap_lab.cli.main import main
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model, with_layers
from overlap_lab.shared.ir.program import first_rank_ops, ops_of
from overlap_lab.shared.outputs.analyze import (
    KernelClass,
    Mapping,
    analyze,
    label_ops,
    load_mapping,
)
from overlap_lab.shared.outputs.trace import Trace
from overlap_lab.shared.schedules import ScheduleConfig, build
from overlap_lab.sim import simulate
from overlap_lab.sim.calibrate import bench_plan, measured_ops, profile_from_trace, program_ops

DATA = Path(os.environ.get("OVERLAP_LAB_SHARED", Path(__file__).resolve().parents[2] / "shared"))
DEEPSEEK_TRAIN = DATA / "data" / "deepseek_profile_train.json"
H800 = get_gpu("h800")
SMALL = ["--model", "deepseek-v3", "--layers", "3", "--ep", "16", "--batch", "32"]


def workload(mode="decode", tokens=32):
    b = (
        Batch.decode(tokens, kv_len=2048)
        if mode == "decode"
        else Batch.prefill(1, extend_len=tokens)
    )
    return Workload(with_layers(get_model("deepseek-v3"), 3), b, Parallel(ep=16))


def kineto(events, sms=132):
    """A minimal torch.profiler trace: GPU kernels as (name, stream, ts, dur)."""
    ev = [
        {
            "ph": "X",
            "cat": "kernel",
            "name": n,
            "pid": 0,
            "tid": s,
            "ts": t,
            "dur": d,
            "args": {"stream": s, "device": 0, "grid": [sms, 1, 1]},
        }
        for n, s, t, d in events
    ]
    return {"traceEvents": ev, "deviceProperties": [{"id": 0, "numSms": sms}]}  # fmt: skip


# ---- analyze ------------------------------------------------------------------------------------


def test_analyze_closed_form_overlap_and_classes():
    tr = Trace.from_chrome(kineto([
        ("void deep_ep::internode::dispatch<8>(...)", 30, 0, 100),
        ("void deep_ep::internode::combine<8>(...)", 30, 150, 50),
        ("void cuda::per_token_cast_to_fp8(...)", 30, 100, 10),  # small compute on the comm stream
        ("void deep_gemm::fp8_gemm_kernel<128>(...)", 7, 50, 100),  # overlaps [50, 150)
        ("flash_fwd_splitkv_mla_kernel", 7, 160, 20),
        ("ncclDevKernel_AllGather_RING_LL", 31, 300, 10),
        ("triton_poi_fused_add_0", 7, 400, 5),
        ("Memcpy DtoD (Device -> Device)", 7, 410, 3),
    ]))  # fmt: skip
    a = analyze(tr)
    roles = {s.lane: s.role for s in a.streams}
    assert roles == {"stream:7": "compute", "stream:30": "comm", "stream:31": "comm"}
    assert a.comm_us == 100 + 10 + 50 + 10  # stream 30 busy [0,110) and [150,200), stream 31
    assert a.compute_us == 100 + 20 + 5 + 3
    assert a.overlap_us == 60 + 20  # [50,110) and [160,180)
    assert a.exposed_comm_us == a.comm_us - 80
    classes = {c.name: (c.kind, c.kernels) for c in a.classes}
    assert classes == {
        "deepep_normal": ("comm", 2), "elementwise": ("compute", 1), "deepgemm": ("compute", 1),
        "flashmla": ("compute", 1), "nccl": ("comm", 1), "triton": ("compute", 1),
        "memcpy": ("copy", 1),
    }  # fmt: skip


def test_a_mapping_file_comes_before_the_builtins(tmp_path):
    m = tmp_path / "map.json"
    m.write_text(json.dumps([{"pattern": "my_a2a", "class": "custom_a2a", "kind": "comm"}]))
    mapping = load_mapping(m)
    assert mapping.classify("void my_a2a_gemm_kernel()").name == "custom_a2a"
    assert mapping.classify("void deep_gemm::x()").name == "deepgemm"
    m.write_text(json.dumps([{"pattern": "x", "class": "y", "kind": "magic"}]))
    with pytest.raises(ConfigError, match="kind must be one of"):
        load_mapping(m)
    m.write_text(json.dumps({"pattern": "x"}))
    with pytest.raises(ConfigError, match="expected a list"):
        load_mapping(m)


@pytest.mark.skipif(
    not DEEPSEEK_TRAIN.exists(),
    reason="needs DeepSeek's public V3 training trace (deepseek-ai/profile-data; OVERLAP_LAB_SHARED)",
)
def test_analyze_deepseek_train_trace():
    """DeepSeek-V3 training, EP64, DualPipe forward+backward chunks (deepseek-ai/profile-data)."""
    a = analyze(Trace.from_chrome(DEEPSEEK_TRAIN))
    busy = {s.lane: s for s in a.streams}
    assert busy["stream:27"].role == "comm"
    assert busy["stream:7"].role == busy["stream:23"].role == "compute"
    assert a.comm_us / 1e3 == pytest.approx(114.5, rel=0.005)
    assert a.compute_us / 1e3 == pytest.approx(124.3, rel=0.005)
    assert a.overlap_us / 1e3 == pytest.approx(110.3, rel=0.005)
    assert a.hidden_fraction == pytest.approx(0.963, rel=0.005)
    top = {c.name for c in a.classes[:4]}
    assert top == {"deepep_normal", "deepgemm", "elementwise", "flashattention"}


def test_analyze_command_writes_table_json_and_figure(tmp_path, capsys):
    path = tmp_path / "k.json"
    path.write_text(
        json.dumps(kineto([("deep_ep::dispatch", 3, 0, 10), ("deep_gemm::g", 1, 5, 10)]))
    )
    assert main(["analyze", str(path), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "communication hidden" in out and "deepep_normal" in out
    assert (tmp_path / "o" / "analyze_timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["analyze", str(path), "--json", "--out", ""]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["overlap_us"] == 5 and res["exposed_comm_us"] == 5
    assert main(["analyze", str(tmp_path / "missing.json")]) == 2


# ---- profiles from traces: the round trip -------------------------------------------------------


@pytest.mark.parametrize(
    "schedule, mode", [("serial", "decode"), ("tbo", "decode"), ("serial", "prefill")]
)
def test_round_trip_a_profile_from_its_own_trace_reproduces_the_ops(schedule, mode):
    w = workload(mode, 32 if mode == "decode" else 1024)
    prog = build(schedule, w, H800, ScheduleConfig())
    first = simulate(prog, H800)  # the roofline's trace stands for a measurement
    prof = profile_from_trace(first, prog, num_sms=H800.num_sms)
    again = simulate(prog, H800, profile=prof)
    a, b = measured_ops(first), measured_ops(again)
    ops = program_ops(prog)
    compute = [k for k, op in ops.items() if op.kind == "compute" and k in a]
    assert len(compute) > 10
    for k in compute:
        assert b[k].us == pytest.approx(a[k].us, rel=1e-3), k
    assert again.step_time_us == pytest.approx(first.step_time_us, rel=1e-3)


def test_profile_from_trace_needs_labelled_spans():
    prog = build("serial", workload(), H800, ScheduleConfig())
    foreign = Trace.from_chrome(kineto([("deep_gemm::g", 1, 0, 10)]))
    with pytest.raises(ConfigError, match="no compute op"):
        profile_from_trace(foreign, prog, num_sms=132)


def test_label_ops_turns_a_foreign_trace_into_the_programs_ops():
    w = workload()
    prog = build("serial", w, H800, ScheduleConfig())
    n = sum(1 for _, op in ops_of(prog) if op.name == "experts")
    events, t = [], 0
    for _ in range(n):  # each occurrence: two grouped GEMM kernels back to back, then a cast
        events += [("deep_gemm::m_grouped_gate_up", 7, t, 30), ("deep_gemm::m_grouped_down", 7, t + 30, 20),
                   ("cast_kernel", 7, t + 50, 5)]  # fmt: skip
        t += 100
    mapping = Mapping().with_user((KernelClass("m_grouped", "deepgemm", "compute", "experts"),))
    labelled = label_ops(Trace.from_chrome(kineto(events)), mapping, first_rank_ops(prog))
    prof = profile_from_trace(labelled, prog, num_sms=132)
    assert [(r.op, r.us) for r in prof.rows] == [("experts", 50.0)]
    with pytest.raises(ConfigError, match="occurrences of 'experts'"):
        label_ops(Trace.from_chrome(kineto(events[:3])), mapping, first_rank_ops(prog))


# ---- validate -----------------------------------------------------------------------------------


def test_a_trace_against_itself_has_zero_error():
    prog = build("tbo", workload(), H800, ScheduleConfig())
    tr = simulate(prog, H800)
    v = V.compare(tr, tr)
    assert v.step_error == 0 and v.exposed_error_us == 0 and v.max_op_error == 0
    assert len(v.ops) == len(measured_ops(tr)) and v.only_measured == v.only_predicted == 0


def test_validate_predicts_the_measured_trace_from_its_own_profile():
    prog = build("serial", workload(), H800, ScheduleConfig())
    measured = simulate(prog, H800)
    v, predicted, prof = V.validate(measured, prog, H800)
    assert abs(v.step_error) < 1e-9 and v.max_op_error < 1e-9
    assert prof.name == "from-measured-trace"


def test_validate_sees_a_slower_measurement():
    prog = build("serial", workload(), H800, ScheduleConfig())
    tr = simulate(prog, H800)
    slow = Trace(tuple(s.__class__(**{**s.__dict__, "start": s.start * 1.1, "end": s.end * 1.1})
                       for s in tr.spans), tr.meta)  # fmt: skip
    v = V.compare(slow, tr)
    assert v.step_error == pytest.approx(1 / 1.1 - 1)
    assert max(abs(o.error) for o in v.ops) == pytest.approx(1 - 1 / 1.1)


def test_validate_and_calibrate_commands(tmp_path, capsys):
    assert main(["sim", *SMALL, "--out", str(tmp_path / "run")]) == 0
    trace = str(tmp_path / "run" / "trace.json")
    capsys.readouterr()
    assert (
        main(["calibrate", "--from-trace", trace, *SMALL, "--out", str(tmp_path / "p.json")]) == 0
    )
    prof = json.loads((tmp_path / "p.json").read_text())
    assert prof["format"] == "overlap-lab-profile/1" and prof["rows"]
    assert main(["sim", *SMALL, "--profile", str(tmp_path / "p.json"), "--out", ""]) == 0
    capsys.readouterr()
    assert main(["validate", trace, *SMALL, "--predict", "tbo", "--json",
                 "--out", str(tmp_path / "v")]) == 0  # fmt: skip
    res = json.loads(capsys.readouterr().out)
    assert abs(res["step_time_us"]["error"]) < 1e-6 and res["what_if"]["schedule"] == "tbo"
    assert (tmp_path / "v" / "validate.png").exists()
    assert main(["calibrate", *SMALL]) == 2  # neither --from-trace nor --device
    assert "exactly one of" in capsys.readouterr().err


# ---- calibrate --device cuda: the CPU half ------------------------------------------------------


def test_bench_plan_covers_sizes_and_sm_budgets():
    from overlap_lab.calibrate import plan_for

    cases, workload_of = plan_for(workload(), H800, (64, 16), (132, 66))
    assert [(c.tokens, c.sms) for c in cases] == [(16, 66), (16, 132), (64, 66), (64, 132)]
    for c in cases:
        for _, op in ops_of(c.program):
            if op.kind == "compute" and c.sms < 132:
                assert op.sms == c.sms
        assert workload_of(c.tokens).batch.num_tokens == c.tokens
    with pytest.raises(ConfigError, match="SM budgets"):
        bench_plan(lambda t: None, (16,), (200,), 132)
    with pytest.raises(ConfigError, match="sizes"):
        bench_plan(lambda t: None, (0,), (132,), 132)


def test_bench_plan_measurements_pool_into_a_profile_over_sizes_and_sms():
    """Simulated runs stand in for the GPU's: the rows cover every size and SM budget."""
    from overlap_lab.calibrate import plan_for

    cases, _ = plan_for(workload(), H800, (16, 64), (66, 132))
    pairs = [(simulate(c.program, H800), c.program) for c in cases]
    prof = profile_from_trace(pairs, num_sms=132)
    keys = {(r.op, r.size, r.sms) for r in prof.rows}
    assert {("attn.core", 16.0, 66), ("attn.core", 64.0, 132)} <= keys


def test_device_calibration_needs_a_gpu():
    from overlap_lab.calibrate import measure_on_gpu

    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is present")
    except ImportError:
        pass
    with pytest.raises(ConfigError, match="needs"):
        measure_on_gpu([], lambda t: None, H800)


# ---- the README's section runs as written -------------------------------------------------------


def readme_calibration_commands() -> list[list[str]]:
    import re
    import shlex

    text = (Path(__file__).parents[1] / "README.md").read_text()
    section = text.split("## Calibrate against your GPU", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    return [
        [
            shlex.split(ln.split("  #")[0])[1:]
            for ln in b.splitlines()
            if ln.startswith("overlap-lab ")
        ]
        for b in blocks
    ]


def test_readme_calibration_section_runs_in_order(tmp_path, capsys, monkeypatch):
    """The CPU block runs line after line in one directory; the GPU block parses."""
    monkeypatch.chdir(tmp_path)
    cpu, gpu = readme_calibration_commands()
    assert [a[0] for a in cpu] == ["sim", "analyze", "calibrate", "sim", "validate"]
    for argv in cpu:
        argv = [a.replace("DIR", str(tmp_path / "out")) for a in argv]
        assert main(argv) == 0, (argv, capsys.readouterr().err)
    assert (tmp_path / "out" / "validate.png").exists()
    from overlap_lab.cli.main import parser

    for argv in gpu:
        parser().parse_args([a.replace("DIR", str(tmp_path)) for a in argv])


# ---- DeepEP's published tables ------------------------------------------------------------------


# every row of every table: tests/test_deepep_tables.py


def test_deepep_tables_is_declared_on_the_runner():
    from overlap_lab.experiments.runner import declared

    exp = declared()["deepep_tables"]
    cases = list(exp.cases())
    assert len(cases) == 20 and exp.simulate is not None and exp.summary is not None
