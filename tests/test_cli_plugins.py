"""Subcommands from the ``overlap_lab.commands`` entry point group: ``overlap-lab experiments``
(the experiments sit above the command line, which may not import them), and a broken plugin
costs one line on stderr, not the command line."""

from __future__ import annotations

import importlib.metadata

from overlap_lab.cli import main as cli
from overlap_lab.experiments import runner


def test_experiments_subcommand_lists_and_refuses_like_the_runner(capsys, tmp_path):
    assert cli.main(["experiments", "--list"]) == 0
    listed = capsys.readouterr().out
    assert runner.main(["--list"]) == 0
    assert listed == capsys.readouterr().out and "tbo_decode" in listed
    assert cli.main(["experiments", "tbo_decode", "--draw", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("overlap-lab experiments: error: --draw")


def test_a_broken_command_plugin_is_one_line(capsys, monkeypatch):
    real = importlib.metadata.entry_points
    broken = importlib.metadata.EntryPoint(
        name="broken", value="overlap_lab.no_such_module:register", group=cli.PLUGINS
    )

    def entry_points(**kw):
        found = real(**kw)
        return (*found, broken) if kw.get("group") == cli.PLUGINS else found

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    assert cli.main(["schedules"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "command 'broken'" in err and "Traceback" not in err
