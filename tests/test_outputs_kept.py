"""Nothing written where it should not be (issue 32): ``calibrate --out`` replaces only a profile
the tool wrote (else ``--force``), ``kernels --out`` is a folder, a sweep refuses a device, a
FIFO, another spec's file and a file another sweep holds by any name, and leaves no lock file;
a symlink loop as ``--out`` is one line; killed runs leave no worker behind."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from overlap_lab.cli.main import main
from overlap_lab.cli.sweep import run_sweep
from overlap_lab.shared.errors import ConfigError
from overlap_lab.sweep_csv import read_rows

SPEC = {
    "base": {"layers": 2, "ep": 8},
    "grid": {"schedule": ["serial", "sbo"], "batch": [16, 32]},
}


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tr")
    assert main(["sim", "--layers", "2", "--out", str(out / "tr")]) == 0
    return out / "tr" / "trace.json"


def _calibrate(trace: Path, out: Path, *extra: str) -> int:
    return main(["calibrate", "--layers", "2", "--from-trace", str(trace), "--out", str(out),
                 *extra])  # fmt: skip


def test_calibrate_replaces_only_its_own_profile(trace, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    assert _calibrate(trace, notes) == 2
    assert "notes.txt: exists and overlap-lab did not write it" in _one_line(capsys)
    assert notes.read_text() == "my notes\n"
    assert not (tmp_path / "notes.txt.provenance.json").exists()
    assert _calibrate(trace, notes, "--force") == 0  # asked for: replaced
    assert json.loads(notes.read_text())["format"].startswith("overlap-lab-profile/")
    assert _calibrate(trace, notes) == 0  # now the tool's own: written again without --force
    mine = tmp_path / "p.json"
    (tmp_path / "p.json.provenance.json").write_text("not the tool's\n")
    assert _calibrate(trace, mine) == 2  # the record beside it is checked too
    assert "p.json.provenance.json exists" in _one_line(capsys)


@pytest.mark.parametrize("target", ["/dev/null", "fifo", "folder"])
def test_calibrate_out_must_be_a_file(trace, tmp_path, capsys, target):
    out = {"/dev/null": Path("/dev/null"), "fifo": tmp_path / "f", "folder": tmp_path}[target]
    if target == "fifo":
        os.mkfifo(out)
    assert _calibrate(trace, out, "--force") == 2
    assert "not a file" in _one_line(capsys)


def test_kernels_out_is_a_folder_checked_before_the_timing(tmp_path, capsys, monkeypatch):
    import overlap_lab.real.kernel_table as kt

    monkeypatch.setattr(kt, "kernel_table", lambda *a, **k: pytest.fail("timed before checks"))
    md = tmp_path / "x.md"
    md.write_text("my table\n")
    assert main(["kernels", "--device", "cpu", "--out", str(md)]) == 2
    assert "exists and is not a folder" in _one_line(capsys)
    assert main(["kernels", "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert "holds files overlap-lab did not write (x.md" in _one_line(capsys)
    assert md.read_text() == "my table\n"


@pytest.mark.parametrize("device", ["/dev/null", "/dev/zero"])
def test_a_sweep_into_a_device_is_refused(tmp_path, capsys, device):
    link = tmp_path / "n.csv"
    link.symlink_to(device)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    assert main(["sweep", str(spec), "--out", str(link), "--no-progress"]) == 2
    assert "a device, not a file" in _one_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["n.csv", "spec.json"]


def test_a_sweep_leaves_no_lock_file(tmp_path):
    out = tmp_path / "s.csv"
    run_sweep(SPEC, out, processes=1, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.csv", "s.csv.provenance.json"]


@pytest.mark.parametrize("how", ["symlink", "hard link"])
def test_a_sweep_holding_a_file_refuses_another_by_any_name(tmp_path, how):
    out = tmp_path / "s.csv"
    run_sweep(SPEC, out, processes=1, progress=False, limit=1)
    other = tmp_path / "other.csv"
    other.symlink_to(out) if how == "symlink" else os.link(out, other)
    before = out.read_bytes()
    with open(out, "a") as held:  # a sweep writing it now
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ConfigError, match="another sweep is writing"):
            run_sweep(SPEC, other, processes=1, progress=False)
    assert out.read_bytes() == before
    run_sweep(SPEC, other, processes=1, progress=False)  # released: resumes the same rows
    assert sorted(int(r["case"]) for r in read_rows(out)) == [0, 1, 2, 3]


def test_resuming_with_another_spec_is_refused(tmp_path):
    out = tmp_path / "s.csv"
    run_sweep(SPEC, out, processes=1, progress=False, limit=2)
    side = tmp_path / "s.csv.provenance.json"
    rows, record = out.read_bytes(), side.read_bytes()
    changed = {**SPEC, "grid": {**SPEC["grid"], "batch": [64, 32]}}  # same columns
    with pytest.raises(ConfigError, match=r"another spec's results \(case 0: batch '16' there"):
        run_sweep(changed, out, processes=1, progress=False)
    assert out.read_bytes() == rows and side.read_bytes() == record
    shorter = {**SPEC, "grid": {"schedule": ["serial"], "batch": [16]}}
    with pytest.raises(ConfigError, match="case 1"):
        run_sweep(shorter, out, processes=1, progress=False)


def test_a_file_holding_a_case_twice_is_refused(tmp_path):
    out = tmp_path / "s.csv"
    run_sweep(SPEC, out, processes=1, progress=False, limit=1)
    head, row = out.read_text().splitlines()
    out.write_text(f"{head}\n{row}\n{row}\n")  # what two sweeps on one file used to write
    with pytest.raises(ConfigError, match="holds case 0 twice"):
        run_sweep(SPEC, out, processes=1, progress=False)


def test_a_first_line_beyond_the_csv_field_limit_is_one_line(tmp_path, capsys):
    big = tmp_path / "big.csv"
    with open(big, "wb") as f:
        f.truncate(17 << 20)  # 17 MiB of NULs
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    assert main(["sweep", str(spec), "--out", str(big), "--no-progress"]) == 2
    assert "is not this sweep's results file" in _one_line(capsys)
    assert big.stat().st_size == 17 << 20


def test_a_symlink_loop_as_out_is_one_line(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    a.symlink_to(b)
    b.symlink_to(a)
    for extra in ([], ["--force"]):
        assert main(["sim", "--layers", "2", "--out", str(a), *extra]) == 2
        assert "a loop of symbolic links" in _one_line(capsys)
    assert main(["experiments", "pp_bubbles", "--draw", "--out", str(a)]) == 2
    assert "a loop of symbolic links" in _one_line(capsys)


# ---- killed runs ------------------------------------------------------------------------------

#: a batch of slow cases through the one runner, as compare --sensitivity, a sweep or the
#: experiments run theirs; prints its workers' pids once they run
RUNNER = textwrap.dedent(
    """
    import os, sys, time
    from overlap_lab import runner

    def job(case):
        os.write(1, f"{os.getpid()}\\n".encode())  # one write: the workers share the pipe
        time.sleep(120)

    for _ in runner.run(job, enumerate(range(4)), backend=runner.Local(2)):
        pass
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG, /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["TERM", "KILL"])
def test_a_killed_run_leaves_no_worker(sig):
    proc = subprocess.Popen(
        [sys.executable, "-c", RUNNER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    workers = {int(proc.stdout.readline()) for _ in range(2)}
    assert len(workers) == 2 and proc.pid not in workers
    os.kill(proc.pid, sig)  # the parent alone, as `kill PID` does
    proc.wait(30)
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in workers if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
