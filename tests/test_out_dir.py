"""--out refuses a filesystem root and a folder of other files (unless --force), and reuses the
folders the tool wrote."""

from __future__ import annotations

from pathlib import Path

import pytest

from overlap_lab.cli.main import main
from overlap_lab.outdir import MARKER

SIM = ["sim", "--schedule", "serial", "--layers", "2"]
COMPARE = ["compare", "--schedules", "serial,tbo", "--layers", "2"]


@pytest.mark.parametrize("cmd", [SIM, COMPARE], ids=["sim", "compare"])
def test_a_filesystem_root_is_refused(capsys, cmd: list[str]) -> None:
    assert main([*cmd, "--out", "/"]) == 2
    err = capsys.readouterr().err
    assert err == "overlap-lab: error: --out /: a filesystem root; give a folder for the outputs\n"
    assert main([*cmd, "--out", "/", "--force"]) == 2


@pytest.mark.parametrize("cmd", [SIM, COMPARE], ids=["sim", "compare"])
def test_a_folder_of_other_files_needs_force(tmp_path: Path, capsys, cmd: list[str]) -> None:
    (tmp_path / "thesis.tex").write_text("mine")
    assert main([*cmd, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "holds files overlap-lab did not write (thesis.tex, ...)" in err
    assert err.count("\n") == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["thesis.tex"]
    assert main([*cmd, "--out", str(tmp_path), "--force"]) == 0
    assert not (tmp_path / MARKER).exists()  # still not the tool's: the next run asks again
    assert main([*cmd, "--out", str(tmp_path)]) == 2


def test_the_tools_own_folder_is_reused(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert main([*SIM, "--out", str(out)]) == 0 and (out / MARKER).is_file()
    (out / "notes.txt").write_text("a folder the tool made stays the tool's")
    assert main([*SIM, "--out", str(out)]) == 0
    assert main([*COMPARE, "--out", str(out)]) == 0
    assert main(["validate", str(out / "trace.json"), "--layers", "2", "--out", str(out)]) == 0
    assert main(["analyze", str(out / "trace.json"), "--out", str(out)]) == 0


def test_outputs_written_before_the_marker_are_recognised(tmp_path: Path) -> None:
    for name in (
        "trace.json",
        "timeline.png",
        "compare.png",
        "trace_tbo.json",
        "serial.trace.json",
    ):
        (tmp_path / name).write_text("")
    assert main([*SIM, "--out", str(tmp_path)]) == 0


def test_analyze_and_validate_check_their_out(tmp_path: Path, capsys) -> None:
    src = tmp_path / "src"
    assert main([*SIM, "--out", str(src)]) == 0
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "data.csv").write_text("1")
    capsys.readouterr()
    assert main(["analyze", str(src / "trace.json"), "--out", str(mine)]) == 2
    assert "--out" in capsys.readouterr().err
    argv = ["validate", str(src / "trace.json"), "--layers", "2", "--out", str(mine)]
    assert main(argv) == 2
    assert main([*argv, "--force"]) == 0 and (mine / "validate.png").is_file()
