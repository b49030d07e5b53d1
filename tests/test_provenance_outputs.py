"""Every results file says where it came from: the JSON of ``sim``/``compare``/``analyze``/
``validate``/``run --check`` on stdout, the traces ``run`` and ``validate`` write, the profile
``calibrate`` writes (its ``.provenance.json`` beside it), the ``kernels`` table and the
experiments' results carry ``shared.outputs.trace.provenance``'s record: the tool's version, the command
line as typed and the inputs. The record holds no date and no host, so the same command records
the same bytes; each test runs its command twice to check that."""

from __future__ import annotations

import hashlib
import json
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import pytest

from overlap_lab.cli.main import main
from overlap_lab.shared.outputs.trace import Trace

SMALL = ["--layers", "3", "--ep", "8", "--batch", "16"]
VERSION = version("overlap-lab")


def _stdout_json(capsys, argv: list[str]) -> tuple[dict, str]:
    capsys.readouterr()
    assert main(argv) == 0
    out = capsys.readouterr().out
    return json.loads(out), out


def _check(p: dict, argv: list[str]) -> dict:
    """The record names the tool, its installed version and the command line as typed; its
    inputs are returned for the caller's own checks."""
    assert p["tool"] == "overlap-lab" and p["version"] == VERSION
    assert p["command"] == ["overlap-lab", *argv]
    return p["inputs"]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> Path:
    """A trace to analyse, calibrate from and validate: the simulator's own serial run."""
    out = tmp_path_factory.mktemp("measured")
    assert main(["sim", *SMALL, "--out", str(out), "--figure-format", "svg"]) == 0
    return out / "trace.json"


def test_sim_json_records_its_inputs_outside_the_result(capsys):
    argv = ["sim", "--schedule", "tbo", *SMALL, "--hbm-gbps", "2000", "--out", "", "--json"]
    res, first = _stdout_json(capsys, argv)
    inp = _check(res["provenance"], argv)
    assert inp["schedule"] == "tbo" and inp["gpu"]["name"] == "h800+hbm-gbps=2000"
    assert inp["model"]["num_layers"] == 3 and inp["batch"]["mode"] == "decode"
    assert inp["knobs"]["tbo_threshold"] is not None and inp["parallel"]["ep"] == 8
    assert inp["profile"] == res["profile"] and inp["ranks"]["mode"] == "symmetric"
    assert _stdout_json(capsys, argv)[1] == first  # the same command prints the same bytes


def test_compare_json_records_the_schedules_and_the_shared_workload(capsys):
    argv = ["compare", "--schedules", "serial,tbo", *SMALL, "--tbo-threshold", "0.3"]
    argv += ["--out", "", "--json"]
    res, first = _stdout_json(capsys, argv)
    inp = _check(res["provenance"], argv)
    assert inp["schedules"] == ["serial", "tbo"] and inp["knobs"]["tbo_threshold"] == 0.3
    assert inp["model"]["num_layers"] == 3 and inp["gpu"]["name"] == "h800"
    assert inp["profile"] == res["results"][0]["profile"] and inp["pp_stages"] is None
    assert [r["schedule"] for r in res["results"]] == ["serial", "tbo"]
    assert _stdout_json(capsys, argv)[1] == first


def test_analyze_json_names_the_trace_by_its_bytes(capsys, measured):
    argv = ["analyze", str(measured), "--out", "", "--json"]
    res, first = _stdout_json(capsys, argv)
    inp = _check(res["provenance"], argv)
    assert inp["trace"] == {"path": str(measured), "sha256": _sha(measured)}
    assert inp["map"] is None and inp["rank"] == 0
    assert _stdout_json(capsys, argv)[1] == first


def test_calibrate_writes_the_provenance_beside_the_profile(tmp_path, capsys, measured):
    from overlap_lab.sim.profile import load_profile

    out = tmp_path / "p.json"
    argv = ["calibrate", "--from-trace", str(measured), *SMALL, "--out", str(out)]
    assert main(argv) == 0
    side = tmp_path / "p.json.provenance.json"
    assert str(side) in capsys.readouterr().out
    inp = _check(json.loads(side.read_text()), argv)
    assert inp["from_trace"]["sha256"] == _sha(measured) and inp["schedule"] == "serial"
    assert inp["model"]["num_layers"] == 3 and inp["gpu"]["name"] == "h800"
    assert load_profile(out).rows  # the profile itself keeps its format and loads
    first = side.read_bytes()
    assert main(argv) == 0
    assert side.read_bytes() == first


def test_validate_json_and_predicted_trace_record_their_inputs(tmp_path, capsys, measured):
    folder = tmp_path / "v"
    argv = ["validate", str(measured), *SMALL, "--predict", "tbo", "--profile", "roofline"]
    argv += ["--json", "--out", str(folder), "--figure-format", "svg"]
    res, first = _stdout_json(capsys, argv)
    inp = _check(res["provenance"], argv)
    assert inp["trace"]["sha256"] == _sha(measured) and inp["predict"] == "tbo"
    assert inp["profile_given"] == "roofline" and inp["profile_file"] is None
    assert inp["profile"] == res["profile"] and inp["model"]["num_layers"] == 3
    written = folder / "predicted_trace.json"
    doc = json.loads(written.read_text())
    assert doc["otherData"]["provenance"] == res["provenance"]
    assert Trace.from_chrome(doc).spans
    trace_bytes = written.read_bytes()
    assert _stdout_json(capsys, argv)[1] == first
    assert written.read_bytes() == trace_bytes


def test_validate_names_a_profile_file_by_its_bytes(tmp_path, capsys, measured):
    prof = tmp_path / "p.json"
    assert main(["calibrate", "--from-trace", str(measured), *SMALL, "--out", str(prof)]) == 0
    argv = ["validate", str(measured), *SMALL, "--profile", str(prof), "--json", "--out", ""]
    res, _ = _stdout_json(capsys, argv)
    assert _check(res["provenance"], argv)["profile_file"] == {
        "path": str(prof),
        "sha256": _sha(prof),
    }


def test_run_gpu_traces_record_the_run(tmp_path, capsys, monkeypatch):
    """The measured trace files of ``run`` on a GPU: the executor is replaced by the simulator
    (no GPU here); what is checked is what run_on_gpu writes around it."""
    torch = pytest.importorskip("torch")
    import overlap_lab.measure as measure
    import overlap_lab.real.check  # noqa: F401 - imported before execute is replaced: it binds it
    import overlap_lab.real.deps as deps
    import overlap_lab.real.executor as executor
    from overlap_lab import api

    def fake_execute(prog, w, **kw):
        tr = api.simulate("serial", w, "h100").trace
        return SimpleNamespace(trace=Trace(tr.spans, {**tr.meta, **kw["meta"]}))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda i: SimpleNamespace(name="NVIDIA H100 80GB HBM3", multi_processor_count=132),
    )
    monkeypatch.setattr(executor, "execute", fake_execute)
    monkeypatch.setattr(measure, "comm_backend", lambda *a: None)
    monkeypatch.setattr(measure, "_driver", lambda: None)
    monkeypatch.setattr(deps, "probe", lambda: {})
    folder = tmp_path / "run"
    argv = ["run", "--schedule", "serial", "--gpu", "h100", "--layers", "2", "--ep", "8"]
    argv += ["--batch", "8", "--backend", "emulated", "--repeats", "1", "--seed", "3"]
    argv += ["--out", str(folder)]
    assert main(argv) == 0
    written = folder / "serial.trace.json"
    doc = json.loads(written.read_text())
    inp = _check(doc["otherData"]["provenance"], argv)
    assert inp["schedule"] == "serial" and inp["gpu"]["name"] == "h100"
    assert inp["model"]["num_layers"] == 2 and inp["parallel"]["ep"] == 8
    assert inp["backend"] == "emulated" and inp["seed"] == 3 and inp["repeats"] == 1
    assert inp["knobs"]["iterations"] >= 1
    first = written.read_bytes()
    assert main(argv) == 0
    assert written.read_bytes() == first
    capsys.readouterr()


def test_run_cpu_check_json_records_the_check(capsys):
    pytest.importorskip("torch")
    argv = ["run", "--device", "cpu", "--check", "--schedule", "serial", "--json"]
    res, _ = _stdout_json(capsys, argv)
    inp = _check(res["provenance"], argv)
    assert inp["schedules"] == ["serial"] and inp["model"] == res["model"]
    assert inp["tolerance"] == res["tolerance"] and inp["ranks"] == 1 and inp["seed"] == 0
    assert inp["gpu"]["name"] == "h800"  # the preset the check's costs assume: the default
    again, _ = _stdout_json(capsys, argv)
    assert json.dumps(again["provenance"]) == json.dumps(res["provenance"])


def test_kernels_json_records_its_options(tmp_path, capsys):
    pytest.importorskip("torch")
    out = tmp_path / "k" / "kernels.json"  # --out is a folder
    argv = ["kernels", "--device", "cpu", "--out", str(out.parent), "--repeats", "1",
            "--warmup", "0"]  # fmt: skip
    assert main(argv) == 0
    first = json.loads(out.read_text())["provenance"]
    assert _check(first, argv) == {"device": "cpu", "repeats": 1, "warmup": 0}
    assert main(argv) == 0
    assert json.loads(out.read_text())["provenance"] == first
    capsys.readouterr()


def test_experiment_results_record_every_cases_inputs(tmp_path):
    from overlap_lab.experiments.runner import Case, Experiment, run
    from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model
    from overlap_lab.shared.schedules import ScheduleConfig

    def cases():
        for layers in (2, 3):  # one model name, two cuts: two models in the record
            w = Workload(
                get_model("deepseek-v2-lite", num_layers=layers), Batch.decode(8), Parallel(ep=8)
            )
            yield Case({"layers": layers}, "tbo", w, "h100", ScheduleConfig(tbo_threshold=0.2))

    exp = Experiment(name="prov", title="two cuts", cases=cases)
    command = ["overlap-lab", "experiments", "prov", "--out", "x"]
    docs = [json.loads(run(exp, 1, out=tmp_path / d, command=command).read_text()) for d in "ab"]
    p = docs[0]["provenance"]
    assert p["tool"] == docs[0]["tool"] == "overlap-lab" and p["version"] == VERSION
    assert p["command"] == command and docs[0]["command"] == " ".join(command)
    inp = p["inputs"]
    assert inp["experiment"] == "prov" and inp["profile"] == "auto"
    assert inp["profiles"] == {"h100": docs[0]["profiles"]["h100"]}
    assert [c["params"] for c in inp["cases"]] == [{"layers": 2}, {"layers": 3}]
    models = [inp["models"][c["model"]]["num_layers"] for c in inp["cases"]]
    assert models == [2, 3] and len(inp["models"]) == 2
    assert all(c["knobs"]["tbo_threshold"] == 0.2 for c in inp["cases"])
    assert all(c["batch"]["mode"] == "decode" and c["gpu"] == "h100" for c in inp["cases"])
    assert inp["gpus"]["h100"]["num_sms"] > 0
    # no date, no commit in the record: the same command records the same
    assert json.dumps(docs[1]["provenance"]) == json.dumps(p)
    assert "date" not in json.dumps(p) and docs[0]["date"]
