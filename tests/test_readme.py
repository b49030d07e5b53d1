"""The README's `compare` table is what its command prints today: the test runs the exact command
the README shows (``$ overlap-lab compare ...``, with DIR a scratch folder) and checks the table
line by line, so a change of the model or the table's format cannot leave the README stale."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from overlap_lab.cli.main import main

README = Path(__file__).resolve().parent.parent / "README.md"


def _example() -> tuple[list[str], list[str]]:
    """(the command's arguments, the table lines below it) of the README's ``$ overlap-lab``
    block."""
    text = README.read_text()
    m = re.search(r"^```\n\$ (overlap-lab compare[^\n]*)\n(.*?)^```", text, re.M | re.S)
    assert m, "README: no ```$ overlap-lab compare ...``` block"
    argv = shlex.split(m.group(1))[1:]
    return argv, m.group(2).splitlines()


def test_readme_compare_table_is_the_commands_output(tmp_path, capsys):
    argv, table = _example()
    assert main([str(tmp_path) if a == "DIR" else a for a in argv]) == 0
    out = [line.rstrip() for line in capsys.readouterr().out.splitlines()]
    printed = out[: out.index("")]  # the table ends at the blank line before its footnotes
    assert printed == [line.rstrip() for line in table]
