"""The IR fuzz script (``tests/fuzz_ir.py``) at a small N: it runs, counts, writes its results."""

from __future__ import annotations

import time

from tests import fuzz_ir
from tests.fuzz_ir import FAILURES, classify, main


def test_a_small_fuzz_finds_nothing_and_writes_its_counts(tmp_path):
    out = tmp_path / "results.md"
    assert main(["--programs", "60", "--out", str(out)]) == 0
    text = out.read_text()
    assert "Command: `python -m tests.fuzz_ir --programs 60 --seed 0" in text
    assert "Programs: 60" in text
    for k in FAILURES:
        assert f"| **{k}** | 0 |" in text


def test_each_failure_is_counted(monkeypatch):
    """The classes the script counts can be told apart (so zero counts mean something)."""
    ok = "program world=1\nrank 0 streams=main\n  thread t\n    launch main x flops=1e9\n"
    assert classify(ok, 1000, 30) == "simulated"
    assert classify("rank x\n", 1000, 30) == "parsed out"
    assert classify(ok.replace("world=1", "world=0"), 1000, 30) == "refused"
    assert classify(ok + "    launch main y flops=1e9\n", 1, 30) == "hang"  # one event of budget
    assert classify("program world=1\nrank 0 streams=main,main\n", 1000, 30) == "refused"

    monkeypatch.setattr(fuzz_ir, "critical_path_us", lambda *_: 1e12)
    assert classify(ok, 1000, 30) == "below critical path"

    def broken(*_a, **_k):
        raise KeyError("pcie")

    monkeypatch.setattr(fuzz_ir, "Engine", broken)
    assert classify(ok, 1000, 30) == "crash"

    def stuck(_text):
        time.sleep(10)

    monkeypatch.setattr(fuzz_ir, "parse", stuck)
    assert classify(ok, 1000, 0.05) == "hang"  # over its time: stopped, counted
