"""Sweeps: spec expansion, resume after an interruption, duplicate detection, backends, CLI."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from overlap_lab import runner
from overlap_lab import sweep as api_sweep
from overlap_lab.cli.main import main
from overlap_lab.cli.sweep import case_inputs, load_spec, run_sweep
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.ir.program import Graph
from overlap_lab.simcase import build
from overlap_lab.sweep import METRICS, SCHEDULE_ONLY_GPU_FIELDS, sim_key
from overlap_lab.sweep_csv import cell, read_rows

SPEC = {
    "base": {"model": "deepseek-v3", "gpu": "h800", "mode": "decode", "layers": 3, "ep": 8},
    "grid": {"schedule": ["serial", "sbo"], "batch": [16, 32], "sbo-comm-sms": [8, 16]},
    "cases": [
        {"schedule": "tbo", "ranks": "explicit", "imbalance": "zipf:1.2", "batch": 16},
        {"schedule": "tbo", "ranks": "explicit", "batch": 16, "seed": 1},
        {"schedule": "tbo", "ranks": "explicit", "batch": 16, "seed": 2},
    ],
}


def _by_case(path: Path) -> dict[int, dict[str, str]]:
    return {int(r["case"]): r for r in read_rows(path)}


def lower_case(knobs):
    """One case parsed and built as the sweep does: (its inputs, workload, Program, tolerance)."""
    case = case_inputs(knobs)
    return (case, *build(case))


def _key(case, w, p, tol) -> str:
    return sim_key(
        p, case.gpu, tol, case.profile, workload=w, ranks=case.ranks, max_events=case.max_events
    )


def test_spec_expansion_and_checks():
    spec = load_spec(SPEC)
    assert len(spec.cases) == 2 * 2 * 2 + 3
    assert spec.knobs[:5] == ("model", "gpu", "mode", "layers", "ep")
    assert spec.cases[0]["schedule"] == "serial" and spec.cases[-1]["seed"] == 2
    for bad, match in [
        ({"grid": {"bogus": [1]}}, "unknown knob"),
        ({"grid": {"batch": []}}, "non-empty list"),
        ({"base": {"batch": "x"}}, "batch"),
        ({"base": {"ranks": "some"}}, "ranks must be one of"),
        ({"grids": {}}, "unknown spec keys"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_spec(bad)


def test_sweep_rows_and_duplicates(tmp_path):
    out = tmp_path / "s.csv"
    stats = run_sweep(SPEC, out, processes=1, progress=False)
    rows = _by_case(out)
    assert sorted(rows) == list(range(11)) and stats["errors"] == 0
    # serial does not read the SBO comm-SM knob, and balanced routing ignores the seed
    assert stats["simulated"] == 2 + 4 + 2 and stats["duplicates"] == 3
    assert (
        rows[0]["sim_key"] == rows[1]["sim_key"]
        and rows[0]["step_time_us"] == rows[1]["step_time_us"]
    )
    assert rows[4]["sim_key"] != rows[5]["sim_key"]  # SBO reads it
    assert rows[9]["sim_key"] == rows[10]["sim_key"] != rows[8]["sim_key"]
    assert all(float(r["step_time_us"]) > 0 for r in rows.values())
    # the same rows as simulating every case on its own
    for i in (1, 5, 8):
        case, w, program, tol = lower_case(load_spec(SPEC).cases[i])
        from overlap_lab.sim.engine import Engine

        trace = Engine(program, case.gpu, 0, net_group_tol=tol, profile=case.profile).run()
        m = api_sweep.metrics(trace, program, case.gpu, w, case.profile)
        assert {k: rows[i][k] for k in METRICS} == {k: cell(v) for k, v in m.items()}


def test_sweep_resumes_without_redoing_finished_cases(tmp_path, monkeypatch):
    out = tmp_path / "s.csv"
    first = run_sweep(SPEC, out, processes=1, progress=False, limit=5)
    assert first["simulated"] + first["duplicates"] == 5 and len(read_rows(out)) == 5
    with open(out, "a") as f:  # an interruption in the middle of writing a row
        f.write("7,deepseek-v3,h800,dec")
    seen = []
    real = runner.step
    monkeypatch.setattr(runner, "step", lambda j, c, i, k: seen.append(i) or real(j, c, i, k))
    second = run_sweep(SPEC, out, processes=1, progress=False)
    assert second["done_before"] == 5
    assert sorted(seen) == list(range(5, 11))  # the finished cases are not run again
    full = tmp_path / "full.csv"
    run_sweep(SPEC, full, processes=1, progress=False)
    assert _strip(_by_case(out)) == _strip(_by_case(full))
    assert run_sweep(SPEC, out, processes=1, progress=False)["simulated"] == 0


def _strip(rows):
    return {i: {k: v for k, v in r.items()} for i, r in rows.items()}


def test_parallel_workers_give_the_same_rows(tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    run_sweep(SPEC, a, processes=1, progress=False)
    stats = run_sweep(SPEC, b, processes=2, progress=False)
    assert stats["simulated"] == 8 and stats["duplicates"] == 3
    assert _by_case(a) == _by_case(b)


def test_another_sweeps_file_is_refused(tmp_path):
    out = tmp_path / "s.csv"
    out.write_text("case,x\n")
    with pytest.raises(ConfigError, match="not this sweep.s results file"):
        run_sweep(SPEC, out, processes=1, progress=False)


def test_duplicate_detection_never_merges_different_programs():
    """Cases whose keys match have equal Programs and simulator-visible GPUs; any change to one
    op changes the key."""
    knobs = [
        {"schedule": s, "layers": 3, "ep": 8, "batch": b, "sbo_comm_sms": c, "hbm_gbps": h}
        for s in ("serial", "sbo", "tbo")
        for b in (16, 17)
        for c in (8, 9)
        for h in (3350.0, 3350.0000000001)
    ]
    lowered = [lower_case(k) for k in knobs]
    keys = [_key(*c) for c in lowered]
    for i in range(len(knobs)):
        for j in range(i):
            (ci, _, pi, _), (cj, _, pj, _) = lowered[i], lowered[j]
            same = pi.ranks == pj.ranks and _sim_fields(ci.gpu) == _sim_fields(cj.gpu)
            assert (keys[i] == keys[j]) == same, (knobs[i], knobs[j])
    assert len(set(keys)) < len(keys)  # some did merge (serial and tbo ignore sbo_comm_sms)
    case, _, p, t = lowered[0]
    g = case.gpu
    rp = p.ranks[0]
    th = rp.threads[0]
    k = next(n for n, ins in enumerate(th.instrs) if isinstance(ins, Graph))
    graph = th.instrs[k]
    op = graph.body[0].op
    first = dataclasses.replace(
        graph.body[0], op=dataclasses.replace(op, hbm_bytes=op.hbm_bytes * (1 + 2**-52))
    )
    nudged = dataclasses.replace(graph, body=(first, *graph.body[1:]))
    th2 = dataclasses.replace(th, instrs=th.instrs[:k] + (nudged,) + th.instrs[k + 1 :])
    p2 = dataclasses.replace(p, ranks=(dataclasses.replace(rp, threads=(th2, *rp.threads[1:])),))
    assert op.hbm_bytes > 0 and p2.ranks != p.ranks and sim_key(p2, g, t) != sim_key(p, g, t)


def _sim_fields(gpu):
    d = dataclasses.asdict(gpu)
    for f in (*SCHEDULE_ONLY_GPU_FIELDS, "name"):  # the name labels the trace only
        d.pop(f)
    return d


def test_simulator_never_reads_schedule_only_gpu_fields():
    import overlap_lab.sim

    sim_dir = Path(overlap_lab.sim.__file__).parent
    text = "\n".join(p.read_text() for p in sim_dir.glob("*.py"))
    assert "class Engine" in text  # the simulator's source, not an empty folder
    for f in SCHEDULE_ONLY_GPU_FIELDS:
        assert not re.search(rf"\b{f}\b", text), f"sim/ reads {f}: take it out of the exclusion"


def test_ray_backend_gives_the_same_rows(tmp_path):
    ray = pytest.importorskip("ray")
    local, remote = tmp_path / "local.csv", tmp_path / "ray.csv"
    run_sweep(SPEC, local, processes=1, progress=False)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        stats = run_sweep(SPEC, remote, backend="ray", progress=False)
    finally:
        ray.shutdown()
    assert stats["simulated"] == 8
    assert _by_case(local) == _by_case(remote)


def test_parquet_output(tmp_path):
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    out = tmp_path / "s.parquet"
    run_sweep(SPEC, out, processes=1, progress=False, limit=4)
    assert not out.exists() and (tmp_path / "s.parquet.partial.csv").exists()
    run_sweep(SPEC, out, processes=1, progress=False)
    table = pq.read_table(out)
    assert table.num_rows == 11 and table.column("case").to_pylist() == list(range(11))
    assert not (tmp_path / "s.parquet.partial.csv").exists()


def test_cli_sweep(tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "base: {layers: 2, ep: 8, batch: 16}\ngrid:\n  schedule: [serial, tbo]\n  sbo-comm-sms: [4, 8]\n"
    )
    out = tmp_path / "r.csv"
    assert main(["sweep", str(spec), "--out", str(out), "--processes", "1", "--no-progress"]) == 0
    assert "4 cases" in capsys.readouterr().err and len(read_rows(out)) == 4
    spec.write_text("grid: {nope: [1]}\n")
    assert main(["sweep", str(spec), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown knob" in err[0]


def test_readme_spec_is_valid():
    import yaml

    text = (Path(__file__).parents[1] / "README.md").read_text()
    block = re.search(r"## Sweeps.*?```yaml\n(.*?)```", text, re.S).group(1)
    spec = load_spec(yaml.safe_load(block))
    assert len(spec.cases) == 5 * 3 * 2 * 3 + 1
    assert spec.cases[-1]["imbalance"] == "zipf:1.2"
