"""``overlap-lab sim --program FILE``: the text ``show`` prints, edited or not, simulated as
written (``overlap_lab.simulate_program``); a bad Program, a bad file and the options that
build a schedule's Program are each one line and exit 2 (issue 32)."""

from __future__ import annotations

import json
import os

import pytest

import overlap_lab as ol
from overlap_lab.cli.main import main

SMALL = ["--model", "deepseek-v2-lite", "--layers", "2", "--ep", "8", "--batch", "4"]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def shown(tmp_path, capsys):
    """tbo's Program as ``show`` prints it, in a file."""
    code, text, _ = _run(capsys, "show", "--schedule", "tbo", *SMALL)
    assert code == 0
    path = tmp_path / "tbo.txt"
    path.write_text(text)
    return path


def _window(capsys, path, *extra: str) -> float:
    code, out, err = _run(capsys, "sim", "--program", str(path), "--out", "", "--json", *extra)
    assert code == 0, err
    return json.loads(out)["window_us"]


def test_show_then_sim_program_is_sim(shown, capsys):
    """Unedited, the Program ``show`` prints simulates to ``sim``'s own window (``show`` prints
    the lowered Program ``sim`` runs); edited, the edit is what runs."""
    code, out, _ = _run(capsys, "sim", "--schedule", "tbo", *SMALL, "--out", "", "--json")
    assert code == 0
    assert _window(capsys, shown) == json.loads(out)["window_us"]
    text = shown.read_text()
    marker = "  thread main\n"
    assert marker in text
    edited = shown.with_name("edited.txt")
    edited.write_text(text.replace(marker, marker + "    host think 1000.0\n", 1))
    assert _window(capsys, edited) > _window(capsys, shown) + 999


def test_sim_program_writes_sims_outputs(shown, tmp_path, capsys):
    """The summary says what a bare Program cannot report; --out holds the trace (its
    provenance names the Program file by SHA-256) and the timeline."""
    out_dir = tmp_path / "out"
    code, out, err = _run(capsys, "sim", "--program", str(shown), "--out", str(out_dir))
    assert code == 0, err
    assert "a Program of tbo" in out and "not available without a workload" in out
    assert (out_dir / "timeline.png").exists()
    prov = json.loads((out_dir / "trace.json").read_text())["otherData"]["provenance"]
    assert prov["inputs"]["program"]["path"] == str(shown)
    assert len(prov["inputs"]["program"]["sha256"]) == 64


def test_simulate_program_api_takes_a_program_record():
    w = ol.workload("deepseek-v2-lite", layers=2, ep=8, batch=4)
    r = ol.simulate("tbo", w, "h800")
    p = ol.simulate_program(r.program, "h800")
    assert p.trace.step_time_us == r.trace.step_time_us
    assert p.source is None and "tokens_per_s_gpu" in p.as_dict()["not_available"]


def test_a_bad_program_is_the_validators_line_naming_the_instruction(shown, capsys):
    bad = shown.with_name("bad.txt")
    bad.write_text(shown.read_text().replace("launch main ", "launch nostream ", 1))
    code, out, err = _run(capsys, "sim", "--program", str(bad), "--out", "")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "rank 0, thread main, instruction" in err and "unknown stream 'nostream'" in err


@pytest.mark.parametrize(
    "text, said",
    [("program world=x\n", "line 1: world must be an integer"), ("bogus\n", "line 1:")],
)
def test_a_malformed_text_names_the_file_and_line(tmp_path, capsys, text, said):
    path = tmp_path / "p.txt"
    path.write_text(text)
    code, _, err = _run(capsys, "sim", "--program", str(path))
    assert code == 2 and err.count("\n") == 1
    assert f"Program {path}: {said}" in err


def test_the_file_is_read_bounded(tmp_path, capsys):
    """A FIFO would block the read forever; a device reads forever; a missing file is named."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, said in [(fifo, "FIFO"), ("/dev/zero", "device"), (tmp_path / "no", "no such")]:
        code, _, err = _run(capsys, "sim", "--program", str(path))
        assert code == 2 and err.count("\n") == 1 and said in err, err


def test_options_that_build_a_schedules_program_are_refused(shown, capsys):
    code, out, err = _run(
        capsys, "sim", "--program", str(shown), "--schedule", "tbo", "--batch", "8",
        "--comm-sms", "4", "--ranks", "explicit",
    )  # fmt: skip
    assert code == 2 and out == "" and err.count("\n") == 1
    for flag in ("--schedule", "--batch", "--comm-sms", "--ranks"):
        assert flag in err
    # what it still reads: the GPU and its overrides, the cost model, the budget
    assert _window(capsys, shown, "--gpu", "h200") != _window(capsys, shown)
    assert _window(capsys, shown, "--hbm-gbps", "1000") > _window(capsys, shown)
