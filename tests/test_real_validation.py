"""The predicted-vs-measured loop (experiments/gpu_validation/) on the CPU,
and the executor's run bookkeeping it relies on: counters reset per run, every SM limit of a
Program enforced or reported, per-op spans kept apart from graph-replay step times, the same
experts kernels in every schedule."""

from __future__ import annotations

import json
import tarfile

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("simpy")

from overlap_lab.real import kernels as K  # noqa: E402
from overlap_lab.real import model as M  # noqa: E402
from overlap_lab.shared import schedules as S  # noqa: E402
from overlap_lab.shared.inputs.hardware import get_gpu  # noqa: E402
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload  # noqa: E402
from overlap_lab.shared.ir.program import ops_of  # noqa: E402
from overlap_lab.shared.outputs.trace import Span, Trace  # noqa: E402


def _w(mode="decode"):
    mc = M.get_model_config("tiny-mla")
    b = Batch.decode(kv_lens=[40] * 6) if mode == "decode" else Batch.prefill(extend_lens=[20, 9])
    return Workload(mc, b, Parallel(ep=2))


def test_dry_run_writes_one_archive_with_the_table_and_says_it_is_a_dry_run(tmp_path):
    from overlap_lab.experiments import gpu_validation as GV

    rc = GV.main(
        ["--device", "cpu", "--out", str(tmp_path), "--name", "dry", "--batches", "4",
         "--prefill", "16", "--schedules", "serial,tbo,pp", "--repeats", "1",
         "--warmup", "0"]
    )  # fmt: skip
    assert rc == 0
    files = list(tmp_path.iterdir())
    assert [f.name for f in files] == ["dry.tar.gz"]  # ONE archive
    with tarfile.open(files[0]) as tar:
        names = tar.getnames()
        report = json.load(tar.extractfile("dry/results.json"))
        md = tar.extractfile("dry/table.md").read().decode()
    assert "dry/step_times.png" in names
    assert any(n.endswith("tbo.measured.trace.json.gz") for n in names)
    assert any(n.endswith("tbo.predicted.trace.json.gz") for n in names)
    assert report["timing_meaningful"] is False and md.startswith("**DRY RUN")
    assert set(report["cases"]) == {"decode_4", "prefill_16"}
    for case in report["cases"].values():
        assert set(case["runs"]) == {"serial", "tbo", "pp"}
        for name, r in case["runs"].items():
            assert "comparison" in r, (name, r)
            assert r["comparison"]["ops_aligned"] > 0
            assert r["comparable"] == (name != "pp")
            assert r["cost_sources"]["comm"] == {"link": r["cost_sources"]["comm"]["link"]}
            assert "profile" in r["cost_sources"]["gemm"]  # per op class: where from
    assert "pp" not in report["summary"]["decode_4"]["ranking_measured"]


def test_the_loop_calibrates_and_predicts_through_the_simulators_path():
    """The GPU loop's profile is sim.calibrate's, its prediction overlap_lab.simulate's: a
    profile from a (simulated) serial trace predicts serial back, and every prediction says per
    op class where its durations came from (LightLLM's split expert kernels are not in
    sim.profile.PROFILED_OPS: the roofline times them, and the loop says so)."""
    from types import SimpleNamespace

    from overlap_lab.experiments import gpu_validation as GV
    from overlap_lab.sim import simulate as sim_run

    g = get_gpu("h100")
    ctx = SimpleNamespace(gpu=g, device_sms=g.num_sms, env={"device": "sim", "versions": {}})
    w = _w()
    p = S.build("serial", w, g)
    tr = sim_run(p, g)
    prof = GV.calibrate_profile(ctx, [(p, tr)], "decode")
    pred, sources = GV.predict(ctx, "serial", w, prof)
    assert sources["grouped_gemm"] == {"profile": 2}  # the experts of the two MoE layers
    assert "roofline" not in sources["gemm"] and sources["comm"].keys() == {"link"}
    cmp = GV.comparison(tr, pred, tr.step_time_us)
    assert abs(cmp["step_time_us"]["rel_error"]) < 0.02
    assert cmp["ops_aligned"] > 0 and cmp["per_op_median_abs_rel_error"] < 0.02
    _, ll = GV.predict(ctx, "lightllm", w, prof)
    assert ll["grouped_gemm"].get("roofline", 0) > 0  # experts.gate_up / down: no profile row
    assert "roofline" in GV.sources_text(ll)


def _tr(spans, **meta):
    return Trace([Span(0, "stream:main", n, "compute", a, b) for n, a, b in spans], meta)


def test_graph_timed_runs_keep_eager_op_spans_and_graph_step_times_apart():
    from overlap_lab.real.executor import timing_meta

    graphs = [_tr([("graph:decode", 0, t)]) for t in (50.0, 40.0, 45.0)]
    eager = [_tr([("attn.core", 0, 30), ("experts", 30, t)]) for t in (70.0, 90.0, 80.0)]
    tr, meta = timing_meta(graphs, eager)
    assert [s.op for s in tr.spans] == ["attn.core", "experts"]  # per-op spans, eager
    assert tr.step_time_us == 80.0  # the eager run of median step time
    assert meta["graph_replay_step_time_us"] == 45.0 and meta["eager_step_time_us"] == 80.0
    assert meta["step_time_source"] == "graph_replay" and "eager" in meta["spans_source"]


def test_graph_timed_runs_record_each_replay_s_launch_and_graph_span():
    """What decides the wait before a graph's first kernel next run (overlap_lab.graph_launch):
    each timed run's host time of every graph.replay() and each graph's CUDA-event span."""
    from overlap_lab.real.fp8 import Precision
    from overlap_lab.real.runlog import RunLog
    from overlap_lab.real.timing import Run, replay_launch_meta, run_meta

    bf16 = Precision("bf16", "bf16", "gemm_dtype=bf16")
    log = RunLog()
    for us in (310.0, 290.0):
        log.graph_launched("forward", us)
    meta = run_meta([], None, log, bf16)
    assert meta["graph_launch_host_us"] == {"forward": [310.0, 290.0]}
    assert "graph_launch_host_us" not in run_meta([], None, RunLog(), bf16)
    runs = [
        Run(_tr([("schedule", 0, 1), ("graph:forward", 5, 405), ("d2h", 406, 410)]), meta),
        Run(_tr([("graph:forward", 3, 383), ("graph:forward", 390, 770)]), {}),
    ]
    got = replay_launch_meta(runs)
    assert got["graph_launch_host_us"] == [{"forward": [310.0, 290.0]}, {}]
    assert got["graph_replay_spans_us"] == [[400.0], [380.0, 380.0]]


def test_kernel_counters_are_per_run_and_sm_limits_are_all_reported():
    from overlap_lab.real.executor import execute

    w = _w("prefill")
    prog = S.build("deepseek", w, get_gpu("h100"))  # limits 108 SMs on 11+ compute op types
    dw = _w()  # decode: attention counts which kernel ran, per run
    dprog = S.build("serial", dw, get_gpu("h100"))
    once = execute(dprog, dw).trace.meta["attention_kernels"]
    assert sum(once.values()) == dw.model.num_layers
    assert execute(dprog, dw, warmup=2, repeats=3).trace.meta["attention_kernels"] == once
    tr = execute(prog, w).trace
    limited = {K.split_piece(o.name)[0] for _, o in ops_of(prog) if o.kind == "compute" and o.sms}
    compute = tr.meta["sm_limits"]["compute"]
    assert limited and limited <= set(compute)  # every limit has a status
    assert compute["experts"]["status"].startswith("budget scoped")
    assert compute["gate"]["status"].startswith("budget scoped")
    assert compute["attn.core"]["status"].startswith("not enforced")
    comm = tr.meta["sm_limits"]["comm"]
    assert comm["normal_dispatch"]["status"].startswith("not enforced")  # the local backend


def test_emulated_sbo_combine_launches_the_programs_sms():
    from overlap_lab.real.comm import make_backend
    from overlap_lab.real.executor import execute

    w = _w()
    prog = S.build("sbo", w, get_gpu("h100"))
    be = make_backend("emulated", rank=0, world=2, num_experts=8, hidden=64, device_sms=132)
    tr = execute(prog, w, backend=be).trace
    assert tr.meta["sm_limits"]["comm"]["ll_combine"]["requested"] == 3
    assert {r["ctas"] for r in be.launches if r["kind"] == "ll_combine"} == {3}
    assert {r["ctas"] for r in be.launches if r["kind"] == "ll_dispatch"} == {8}


class _RecordingBudget:
    """Stands in for real.gemm.ComputeBudget with the GPU's decision (every GEMM through the
    budget kernels); records which kernel each GEMM took and its grid."""

    calls: list = []

    def __init__(self, sms, device=None):
        self.sms = sms or 132

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    limited = True

    @property
    def mm(self):
        return self.linear

    def linear(self, x, w):
        self.calls.append(("linear", self.sms))
        return x @ w.t()

    def grouped_masked(self, x, w, counts, expected_m=None):
        self.calls.append(("grouped_masked", self.sms, expected_m))
        y = torch.bmm(x, w.transpose(1, 2))
        valid = torch.arange(x.shape[1])[None, :] < counts[:, None]
        return torch.where(valid[..., None], y, torch.zeros((), dtype=y.dtype))

    def grouped_contiguous(self, x, w, counts):
        self.calls.append(("grouped_contiguous", self.sms))
        out, lo = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype), 0
        for e, n in enumerate(counts):
            out[lo : lo + n] = x[lo : lo + n] @ w[e].t()
            lo += n
        return out


def test_every_decode_schedule_runs_the_same_masked_experts_kernel(monkeypatch):
    """Experts cost must not depend on the code path: every schedule's routed experts go
    through the masked grouped GEMM (only the grid, the SM budget, differs), with DeepGEMM's
    expected_m from the routing (not the padded rows)."""
    from overlap_lab.real import kernels as K
    from overlap_lab.real.check import workload_variants
    from overlap_lab.real.comm import make_backend
    from overlap_lab.real.executor import execute

    monkeypatch.setattr(
        K.KernelCtx, "sm_budget", lambda ctx, device=None: _RecordingBudget(ctx.op.sms, device)
    )
    w = _w()
    for name in S.available():
        wv = workload_variants(name, w)[0]
        _RecordingBudget.calls = []
        be = make_backend("emulated", rank=0, world=2, num_experts=8, hidden=64, device_sms=132)
        execute(S.build(name, wv, get_gpu("h100")), wv, backend=be)
        kinds = {c[0] for c in _RecordingBudget.calls}
        assert "grouped_masked" in kinds and "grouped_contiguous" not in kinds, name
        masked = [c for c in _RecordingBudget.calls if c[0] == "grouped_masked"]
        # 6 tokens, top-2 of 8 experts, 2 ranks: 3 rows per expert on average; padded rows 12
        assert all(c[2] is not None and c[2] < 12 for c in masked), (name, masked[:2])


def test_readme_gpu_setup_lines_map_the_package_for_the_loop(tmp_path):
    """real/README.md's setup lines for the GPU machine (no install: a folder mapping the
    namespace onto the checkout), run as written with /tmp/ol moved to a temporary folder, then
    the loop's CPU dry run through that map with ``python -P`` (the simulator's API included)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = (root / "real" / "README.md").read_text()
    m = re.search(r"(mkdir -p /tmp/ol/overlap_lab.*?)export PYTHONPATH", text, re.S)
    assert m, "README lost its GPU setup lines"
    setup = m.group(1).replace("/tmp/ol", str(tmp_path / "ol")).rstrip().rstrip("&\\ \n")
    subprocess.run(["bash", "-c", setup.replace("\\\n", " ")], cwd=root, check=True)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "ol")}
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-P", "-m", "overlap_lab.experiments.gpu_validation", "--device",
         "cpu", "--modes", "decode", "--batches", "4", "--schedules", "serial", "--repeats",
         "1", "--warmup", "0", "--no-figures", "--out", str(out), "--name", "mapped"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (out / "mapped.tar.gz").is_file()
    # every module the loop imports comes from the map (this venv's editable install would
    # otherwise hide a module the map lacks)
    mods = ["overlap_lab", "overlap_lab.api", "overlap_lab.metrics", "overlap_lab.sim.calibrate",
            "overlap_lab.validate", "overlap_lab.experiments.gpu_validation",
            "overlap_lab.real.executor", "overlap_lab.real.fp8", "overlap_lab.figures",
            "overlap_lab.cli.main"]  # fmt: skip
    code = f"import importlib; print(*[importlib.import_module(m).__file__ for m in {mods!r}])"
    r = subprocess.run([sys.executable, "-P", "-c", code], cwd=root, env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    files = r.stdout.split()
    assert len(files) == len(mods) and all(f.startswith(str(tmp_path / "ol")) for f in files), files
