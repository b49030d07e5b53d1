"""A schedule in a separate package: installed for real (pip, no network), found through the
``overlap_lab.schedules`` entry point group, listed and run by the command line; a schedule that
cannot load is one ConfigError naming its package."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from overlap_lab.shared import schedules as S
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.plugins import Entry

PYPROJECT = """\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "overlap-lab-echo"
version = "0.1.0"

[project.entry-points."overlap_lab.schedules"]
echo = "overlap_lab_echo"

[tool.setuptools]
py-modules = ["overlap_lab_echo"]
"""

MODULE = '''\
"""A plugin schedule: the serial schedule under another name."""

from overlap_lab.shared.schedules import serial

UPSTREAM = "none (a test plugin)"
SUMMARY = "echo: the serial schedule, registered by another package"
KNOBS = serial.KNOBS


def build(workload, gpu, cfg):
    return serial.build(workload, gpu, cfg)
'''


def _cli(*args: str, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("overlap-lab")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "overlap_lab.cli"]
    return subprocess.run(
        [*cmd, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_a_schedule_in_its_own_package_is_listed_and_runs(tmp_path):
    src, site = tmp_path / "echo", tmp_path / "site"
    src.mkdir()
    (src / "pyproject.toml").write_text(PYPROJECT)
    (src / "overlap_lab_echo.py").write_text(MODULE)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*pip, "--target", str(site), str(src)], check=True, capture_output=True)
    env = {**os.environ, "PYTHONPATH": str(site), "COLUMNS": "200"}

    listed = _cli("schedules", env=env, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    table = listed.stdout.split("\n\n")[0].splitlines()  # the rules follow a blank line
    names = [line.split()[0] for line in table if line[0] != " "]
    assert names[:10] == list(S.BUILTINS) and names[10:] == ["echo"], names

    run = _cli(
        "compare",
        "--schedules",
        "serial,echo",
        *("--model", "deepseek-v2-lite", "--layers", "3", "--ep", "8", "--batch", "16"),
        *("--out", str(tmp_path / "out")),
        env=env,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    rows = {line.split()[0]: line.split() for line in run.stdout.splitlines() if line.strip()}
    assert rows["echo"][1:4] == rows["serial"][1:4]  # GPUs, iters, ms/iter: serial's Program


def _register(monkeypatch, name: str, target: str, package: str) -> None:
    """A schedule registered as another package's entry point would be (``shared.plugins``)."""
    monkeypatch.setitem(S.REGISTRY.entries, name, Entry(name, target, package))
    monkeypatch.setitem(S.SCHEDULES, name, target)


def test_a_schedule_that_cannot_load_is_one_error_naming_its_package(monkeypatch):
    _register(monkeypatch, "broken", "overlap_lab_no_such_module", "overlap-lab-broken")
    with pytest.raises(ConfigError) as e:
        S.module("broken")
    msg = str(e.value)
    assert "\n" not in msg and "overlap-lab-broken" in msg and "cannot be loaded" in msg


def test_a_schedule_missing_a_part_is_refused(monkeypatch, tmp_path):
    (tmp_path / "overlap_lab_half.py").write_text(
        textwrap.dedent('UPSTREAM = "x"\nSUMMARY = "y"\n\ndef build(w, g, c):\n    return None\n')
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    _register(monkeypatch, "half", "overlap_lab_half", "overlap-lab-half")
    with pytest.raises(ConfigError, match=r"schedule 'half' .*overlap-lab-half\) lacks KNOBS"):
        S.module("half")
