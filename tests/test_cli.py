"""The command line: JSON keys, files written, one-line errors with exit code 2, README commands."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from overlap_lab.cli.main import main

SMALL = ["--model", "deepseek-v2-lite", "--layers", "3", "--ep", "8", "--batch", "16"]


def run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_sim_json_has_the_documented_keys(capsys, tmp_path):
    code, out, _ = run(capsys, "sim", *SMALL, "--json", "--out", str(tmp_path))
    assert code == 0
    res = json.loads(out)
    for key in (
        "schedule",
        "model",
        "gpu",
        "mode",
        "step_time_us",
        "busy_us",
        "exposed_comm_us",
        "micro_batches",
        "num_ops",
    ):
        assert key in res
    assert (
        res["micro_batches"][0]["tokens"] == 16 and res["micro_batches"][0]["padded_tokens"] == 16
    )
    assert res["step_time_us"] > 0 and res["busy_us"]["stream:main"] > 0
    assert (tmp_path / "trace.json").stat().st_size > 0
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_sim_defaults_run(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, "sim", "--layers", "4")
    assert code == 0 and "step time" in out
    assert (tmp_path / "overlap-lab-out" / "trace.json").exists()


def test_batch_counts_sequences_per_rank(capsys):
    _, out, _ = run(
        capsys, "sim", *SMALL[:-2], "--batch", "8", "--tokens-per-seq", "2", "--json", "--out", ""
    )
    res = json.loads(out)
    assert res["batch"] == 8 and res["tokens"] == 16


def test_explicit_lengths(capsys):
    _, out, _ = run(
        capsys,
        "sim",
        *SMALL[:-2],
        "--mode",
        "prefill",
        "--extend-lens",
        "64,32,1",
        "--json",
        "--out",
        "",
    )
    assert json.loads(out)["tokens"] == 97


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--model", "gpt-5"], "unknown model"),
        (["--gpu", "a100"], "unknown gpu"),
        (["--schedule", "nope"], "unknown schedule"),
        (["--batch", "0"], "1..65536"),
        (["--batch", "-3"], "1..65536"),
        (["--ep", "7"], "divide"),
        (["--num-sms", "0"], "--num-sms"),
        (["--mode", "train"], "--mode"),
        (["--layers", "1000"], "--layers"),
        (["--kv-lens", "4096,x"], "expected an integer"),
        (["--tbo-threshold", "0.9"], "--tbo-threshold"),
        (["--sbo-mode", "7"], "--sbo-mode"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, fragment):
    code, out, err = run(capsys, "sim", "--out", "", *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], err
    assert "Traceback" not in err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["sim", "--batch", "zero"])
    assert e.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_show_prints_a_parseable_program(capsys):
    from overlap_lab.shared.ir.program import parse

    code, out, _ = run(capsys, "show", *SMALL)
    assert code == 0
    p = parse(out)
    assert str(p) == out


def test_schedules_lists_each_with_its_upstream_code(capsys):
    """Issue 11, item 3: the listing pointed at documents outside the repository."""
    _, out, _ = run(capsys, "schedules")
    rows = out.strip().splitlines()
    assert rows[0].startswith("serial")
    from overlap_lab.shared.schedules import SCHEDULES

    assert sum(r.lstrip().startswith("upstream: ") for r in rows) == len(SCHEDULES)
    assert "docs/schedules.md" in out
    for word in ("SCHEDULES.md", "DESIGN.md", "seed", "../shared"):
        assert word not in out


def test_compare_table_and_figure(capsys, tmp_path):
    code, out, _ = run(
        capsys, "compare", *SMALL, "--schedules", "serial,tbo", "--json", "--out", str(tmp_path)
    )
    assert code == 0
    rows = {r["schedule"]: r for r in json.loads(out)["results"]}
    assert rows["serial"]["speedup_vs_serial"] == pytest.approx(1.0)
    assert rows["tbo"]["step_time_us"] > 0
    assert (tmp_path / "compare.png").exists()


def readme_commands() -> list[str]:
    text = (Path(__file__).parents[1] / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [
        ln.split("#")[0].strip()
        for b in blocks
        for ln in b.splitlines()
        if ln.strip().startswith("overlap-lab ") and "run " not in ln
    ]


@pytest.mark.parametrize("command", readme_commands())
def test_readme_examples_run(capsys, tmp_path, monkeypatch, command):
    """Every `overlap-lab` line of the README runs (on 4 layers, to stay fast)."""
    monkeypatch.chdir(tmp_path)
    argv = shlex.split(command.replace("DIR", str(tmp_path / "out")))[1:]
    if argv[0] in ("sim", "show", "compare") and "--layers" not in argv:
        argv += ["--layers", "4"]
    code, _, err = run(capsys, *argv)
    assert code == 0, err


def test_sim_json_without_figure_does_not_import_matplotlib():
    """`sim --json --out ''` writes no figure and pays no matplotlib import (0.4-0.55 s)."""
    import subprocess
    import sys

    code = (
        "import sys; from overlap_lab.cli.main import main; "
        "main(['sim', '--layers', '2', '--ep', '8', '--out', '', '--json']); "
        "print('matplotlib' in sys.modules, file=sys.stderr)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr.strip().splitlines()[-1] == "False"
