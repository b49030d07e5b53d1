"""The help texts of `overlap-lab` and every subcommand, pinned: a restructuring of the command
line must leave what a user reads unchanged. Regenerate after a deliberate change with
`OVERLAP_LAB_REGEN_HELP=1 python -m pytest tests/test_cli_help_golden.py`."""

from __future__ import annotations

import os
from importlib.metadata import entry_points
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "golden" / "cli_help"
COMMANDS = [
    "",
    "sim",
    "show",
    "schedules",
    "compare",
    "run",
    "analyze",
    "calibrate",
    "validate",
    "sweep",
    "experiments",
    "kernels",
]


def _main():
    """The installed console script, wherever the package keeps it."""
    (ep,) = entry_points(group="console_scripts", name="overlap-lab")
    return ep.load()


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c or "top")
def test_help_text_unchanged(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    argv = [command, "-h"] if command else ["-h"]
    with pytest.raises(SystemExit) as exc:
        _main()(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    path = GOLDEN / f"{command or 'top'}.txt"
    if os.environ.get("OVERLAP_LAB_REGEN_HELP"):
        path.write_text(out)
    assert out == path.read_text(), f"`overlap-lab {command} -h` changed"
