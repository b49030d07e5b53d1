"""A trace says where it came from: ``trace.json`` and every results file carry the tool's
version, the command line and the full inputs; ``analyze`` knows the simulator's own op names."""

from __future__ import annotations

import json
from importlib.metadata import version

import pytest

import overlap_lab as ol
from overlap_lab.cli.main import main
from overlap_lab.cli.sweep import run_sweep
from overlap_lab.shared.outputs.analyze import Mapping, analyze
from overlap_lab.shared.outputs.trace import Trace
from overlap_lab.shared.schedules import SCHEDULES

SMALL = ["--layers", "3", "--ep", "8", "--batch", "16"]


def test_sim_trace_records_version_command_and_full_inputs(tmp_path, capsys):
    argv = ["sim", "--schedule", "tbo", *SMALL, "--hbm-gbps", "2000", "--tbo-threshold", "0.25"]
    argv += ["--profile", "roofline", "--out", str(tmp_path / "a")]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "a" / "trace.json").read_text())
    p = doc["otherData"]["provenance"]
    assert p["tool"] == "overlap-lab" and p["version"] == version("overlap-lab")
    assert p["command"] == ["overlap-lab", *argv]
    inp = p["inputs"]
    assert inp["schedule"] == "tbo" and inp["profile"] == "roofline"
    assert inp["gpu"]["name"] == "h800+hbm-gbps=2000" and inp["gpu"]["hbm_gbps"] == 2000.0
    assert inp["model"]["name"] == "deepseek-v3" and inp["model"]["num_layers"] == 3
    assert inp["knobs"]["tbo_threshold"] == 0.25 and inp["parallel"]["ep"] == 8
    assert inp["ranks"]["mode"] == "symmetric"
    # the trace still reads back, and the same command writes the same bytes
    assert Trace.from_chrome(doc).spans
    first = (tmp_path / "a" / "trace.json").read_bytes()
    assert main(argv) == 0
    assert (tmp_path / "a" / "trace.json").read_bytes() == first
    capsys.readouterr()


def test_compare_traces_and_sweep_and_experiments_record_provenance(tmp_path, capsys):
    argv = ["compare", "--schedules", "serial,sbo", *SMALL, "--out", str(tmp_path / "c")]
    assert main(argv) == 0
    for name in ("serial", "sbo"):
        p = json.loads((tmp_path / "c" / f"trace_{name}.json").read_text())["otherData"]
        assert p["provenance"]["inputs"]["schedule"] == name
        assert p["provenance"]["command"] == ["overlap-lab", *argv]
    spec = {"base": {"layers": 3, "ep": 8, "batch": 16}, "grid": {"schedule": ["serial"]}}
    run_sweep(spec, tmp_path / "s.csv", processes=1, progress=False, command=["x", "y"])
    p = json.loads((tmp_path / "s.csv.provenance.json").read_text())
    assert p["version"] == version("overlap-lab") and p["command"] == ["x", "y"]
    assert p["inputs"]["cases"] == [{"schedule": "serial", "layers": 3, "ep": 8, "batch": 16}]
    assert p["inputs"]["defaults"]["gpu"] == "h800"
    capsys.readouterr()


def _op_names() -> set[tuple[str, str]]:
    names = set()
    for mode, batch in (("decode", 16), ("prefill", 2)):
        w = ol.workload("deepseek-v3", mode=mode, batch=batch, ep=8, layers=3)
        for s in SCHEDULES:
            try:
                tr = ol.simulate(s, w, "h800").trace
            except ol.ConfigError:  # a schedule that refuses the mode
                continue
            names |= {(sp.op, sp.kind) for sp in tr.spans if sp.lane.startswith("stream:")}
    return names


def test_analyze_knows_the_simulators_own_op_names():
    mapping = Mapping()
    unknown = sorted(
        (op, kind)
        for op, kind in _op_names()
        if mapping.classify(op, kind).name in ("other", "other_comm", "other_copy")
    )
    assert not unknown
    a = analyze(ol.simulate("tbo", ol.workload(batch=16, ep=8, layers=3), "h800").trace)
    names = {c.name for c in a.classes}
    assert {"attention", "router", "dispatch", "combine", "routed_experts"} <= names
    assert not names & {"other", "other_comm", "other_copy"}


@pytest.mark.parametrize("kernel", ["void deep_gemm::fp8_gemm_kernel<>", "ncclDevKernel_AllGather"])
def test_foreign_kernels_keep_their_library_classes(kernel):
    assert Mapping().classify(kernel).name in ("deepgemm", "nccl")
