"""A schedule in a separate package: installed for real (pip, no network), found through the
``overlap_lab.schedules`` entry point group, listed and run by the command line; a schedule that
cannot load is one ConfigError naming its package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from overlap_lab.shared import schedules as S
from overlap_lab.shared.errors import ConfigError
from tests.plugin_dist import installed

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


def test_a_schedule_that_cannot_load_is_one_error_naming_its_package(tmp_path):
    with installed(
        tmp_path,
        "overlap-lab-broken",
        {},
        {"overlap_lab.schedules": {"broken": "overlap_lab_no_such_module"}},
    ):
        with pytest.raises(ConfigError) as e:
            S.module("broken")
        assert "broken" not in S.pipeline_schedules()  # listing others is not stopped by it
    msg = str(e.value)
    assert "\n" not in msg and "overlap-lab-broken" in msg and "cannot be loaded" in msg


@pytest.mark.parametrize(
    "source, why",
    [
        ('UPSTREAM = "x"\n\ndef build(w, g, c):\n    return None\n', "lacks SUMMARY"),
        (
            'UPSTREAM = "x"\nSUMMARY = "y"\nKnobs = dict\n\ndef build(w, g, c):\n    return None\n',
            "has a Knobs that is not a frozen dataclass deriving from ScheduleKnobs",
        ),
        (
            'UPSTREAM = "x"\nSUMMARY = "y"\nwindow_note = 3\n\ndef build(w, g, c):\n    return None\n',
            "has window_note that is not a function",
        ),
    ],
    ids=["no summary", "knobs not a record", "hook not a function"],
)
def test_a_schedule_missing_or_malformed_part_is_refused(tmp_path, source, why):
    with installed(
        tmp_path,
        "overlap-lab-half",
        {"overlap_lab_half": source},
        {"overlap_lab.schedules": {"half": "overlap_lab_half"}},
    ):
        with pytest.raises(ConfigError) as e:
            S.module("half")
    assert "schedule 'half' (overlap_lab_half, package overlap-lab-half)" in str(e.value)
    assert why in str(e.value)


def test_a_plugin_may_not_redeclare_a_knob_every_schedule_reads(tmp_path):
    source = """\
        from dataclasses import dataclass
        from overlap_lab.shared.inputs.knobs import knob
        from overlap_lab.shared.schedules import serial
        from overlap_lab.shared.schedules.common import ScheduleKnobs

        UPSTREAM = SUMMARY = "x"
        build = serial.build


        @dataclass(frozen=True)
        class Knobs(ScheduleKnobs):
            cuda_graph: bool = knob(True, "mine")
        """
    with installed(
        tmp_path,
        "overlap-lab-clash",
        {"overlap_lab_clash": source},
        {"overlap_lab.schedules": {"clash": "overlap_lab_clash"}},
    ):
        with pytest.raises(ConfigError, match="declares cuda_graph, which every schedule reads"):
            S.module("clash")
