"""Sweeps that share a file, lose their parent, are interrupted or get odd numbers: a second
sweep on one output is refused, children die quietly with their parent, Ctrl-C is one line and
exit 130 with the rows kept, a torn quoted row is dropped on resume, workers are capped, and
non-positive limits are refused."""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from overlap_lab.cli.main import main
from overlap_lab.cli.sweep import run_sweep
from overlap_lab.shared.errors import ConfigError
from overlap_lab.sweep_csv import read_rows

SMALL = {"model": "deepseek-v3", "layers": 3, "ep": 8, "mode": "decode"}
SPEC = {"base": SMALL, "grid": {"schedule": ["serial", "sbo"], "batch": [16, 32]}}
#: many distinct cases, so that a sweep is still running when a test signals it
LONG = {"base": {**SMALL, "layers": 6}, "grid": {"schedule": ["tbo"], "batch": list(range(8, 200))}}


def test_a_second_sweep_on_the_same_output_is_refused(tmp_path, capsys):
    out = tmp_path / "s.csv"
    with open(out, "a") as held:  # a sweep writing it now: the lock is the file's own
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ConfigError, match="another sweep is writing"):
            run_sweep(SPEC, out, processes=1, progress=False)
        spec = tmp_path / "spec.json"
        spec.write_text(json.dumps(SPEC))
        assert main(["sweep", str(spec), "--out", str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "another sweep is writing" in err
    assert out.read_text() == ""  # nothing written by the refused sweep
    run_sweep(SPEC, out, processes=1, progress=False)  # released: runs
    assert len(read_rows(out)) == 4


def test_a_torn_quoted_row_is_dropped_on_resume(tmp_path):
    out = tmp_path / "s.csv"
    run_sweep(SPEC, out, processes=1, progress=False, limit=2)
    with open(out, "a") as f:  # killed while writing a quoted field with a newline in it
        f.write('2,deepseek-v3,3,8,decode,sbo,16,"h800\nmore')
    assert len(read_rows(out)) == 2
    run_sweep(SPEC, out, processes=1, progress=False)
    full = tmp_path / "full.csv"
    run_sweep(SPEC, full, processes=1, progress=False)
    assert out.read_bytes() == full.read_bytes()


def test_workers_are_capped_at_the_cases_and_cpus(tmp_path, monkeypatch):
    started = []
    real = multiprocessing.context.BaseContext.Pool

    def pool(self, processes=None, *a, **kw):
        started.append(processes)
        return real(self, processes, *a, **kw)

    monkeypatch.setattr(multiprocessing.context.BaseContext, "Pool", pool)
    run_sweep(SPEC, tmp_path / "s.csv", processes=200, progress=False)
    assert started and started[0] <= min(4, os.cpu_count() or 1)


@pytest.mark.parametrize("option", [["--limit", "-1"], ["--limit", "0"], ["--processes", "0"]])
def test_non_positive_limits_are_refused(tmp_path, capsys, option):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    out = tmp_path / "s.csv"
    assert main(["sweep", str(spec), "--out", str(out), "--no-progress", *option]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and option[0] in err
    assert not read_rows(out)


def _start(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path, Path]:
    spec = tmp_path / "long.json"
    spec.write_text(json.dumps(LONG))
    out, err = tmp_path / "long.csv", tmp_path / "err.txt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "overlap_lab.cli", "sweep", str(spec), "--out", str(out), *extra],
        stdout=subprocess.DEVNULL,
        stderr=open(err, "w"),
        start_new_session=True,  # its own process group, as a shell's job
    )
    deadline = time.monotonic() + 120
    while len(read_rows(out)) < 1:  # running: a row written
        assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
        time.sleep(0.1)
    return proc, out, err


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_is_one_line_exit_130_and_keeps_the_rows(tmp_path):
    proc, out, err = _start(tmp_path, "--processes", "2", "--no-progress")
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
    assert proc.wait(60) == 130
    text = err.read_text()
    assert text.count("\n") == 1 and "interrupted" in text and "Traceback" not in text, text
    assert len(read_rows(out)) >= 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG, /proc")
def test_children_die_quietly_with_a_killed_parent(tmp_path):
    proc, out, err = _start(tmp_path, "--processes", "2", "--no-progress")
    children = _children(proc.pid)
    assert len(children) >= 2  # the manager and the workers
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 20
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(c) for c in children)
    text = err.read_text()
    assert "Traceback" not in text and "BrokenPipe" not in text, text


def test_the_bar_is_closed_before_the_summary(tmp_path, capfd):
    """stdout and stderr to one file: the bar's last line ends before the summary starts."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    out = tmp_path / "s.csv"
    both = tmp_path / "both.txt"
    with open(both, "w") as f:
        code = subprocess.call(
            [sys.executable, "-m", "overlap_lab.cli", "sweep", str(spec), "--out", str(out),
             "--processes", "1"],
            stdout=f,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    assert code == 0
    last = both.read_bytes().decode().split("\n")[-2]
    assert last.startswith(f"{out}: 4 cases"), last
    assert read_rows(out)


def test_compare_finishes_its_bar_before_the_table(tmp_path):
    both = tmp_path / "both.txt"
    argv = ["compare", "--schedules", "serial,tbo", "--layers", "3", "--ep", "8", "--batch", "16"]
    with open(both, "w") as f:
        code = subprocess.call(
            [sys.executable, "-m", "overlap_lab.cli", *argv, "--out", str(tmp_path / "c")],
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    assert code == 0
    lines = both.read_bytes().decode().split("\n")  # read_text would turn \r into \n
    head = next(i for i, ln in enumerate(lines) if "decode on h800" in ln)
    assert lines[head].startswith("deepseek-v3[3 of 61 layers] decode on h800"), lines[head]


def test_spec_shapes_that_crashed_are_one_line_errors(tmp_path):
    """`cases: [5]` raised AttributeError and a truncated JSON spec JSONDecodeError."""
    from overlap_lab.cli.sweep import load_spec
    from overlap_lab.shared.errors import ConfigError

    with pytest.raises(ConfigError, match=r"cases\[0\] must be a mapping"):
        load_spec({"cases": [5]})
    with pytest.raises(ConfigError, match="grid must be a mapping"):
        load_spec({"grid": [1, 2]})
    bad = tmp_path / "spec.json"
    bad.write_text('{"grid": {"batch": [16, 3')
    with pytest.raises(ConfigError, match="not valid JSON") as e:
        load_spec(bad)
    assert "\n" not in str(e.value)


def test_a_huge_grid_is_refused_before_it_is_expanded():
    """A grid multiplying out to 1e8 cases filled 6 GB in 21 s; it is counted first."""
    from overlap_lab.cli.sweep import MAX_CASES, load_spec
    from overlap_lab.shared.errors import ConfigError

    grid = {"batch": list(range(1, 101)), "kv-len": list(range(1, 101)),
            "ep": [8] * 100, "seed": list(range(100))}  # fmt: skip
    with pytest.raises(ConfigError, match="100,000,000 cases"):
        load_spec({"grid": grid})
    assert len(load_spec({"grid": {"batch": [16, 32]}}).cases) == 2 <= MAX_CASES
