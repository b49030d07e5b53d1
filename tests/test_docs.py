"""Docs live in the repository: no pointer to files outside it, no citation of the project's
internal tracker in what users read, and every in-repo doc a module points to exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[1]
OUTSIDE = re.compile(r"\.\./shared|SCHEDULES\.md|DESIGN\.md|\bseeds? \d{3}\b|§0x|seeds/")


def tracked(*suffixes: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout
    return [ROOT / p for p in out.split() if p.endswith(suffixes) and "tests/golden" not in p]


def test_no_pointer_outside_the_repository():
    hits = []
    for p in tracked(".py", ".md", ".toml", ".txt"):
        if p.name == Path(__file__).name:
            continue
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line) and "OUTSIDE" not in line and "for word in" not in line:
                hits.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


TRACKER = re.compile(r"\b(?:issue|ticket) #?\d+\b", re.IGNORECASE)


def test_user_docs_cite_no_tracker():
    """A reader of the docs has no access to the project's tracker: its numbers mean nothing."""
    hits = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in tracked(".md")
        if p.parts[len(ROOT.parts)] in ("docs", "README.md")
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if TRACKER.search(line)
    ]
    assert not hits, "\n".join(hits)


def test_docs_named_in_the_code_exist():
    named = set()
    for p in tracked(".py", ".md"):
        for line in p.read_text(errors="replace").splitlines():
            if "DeepEP" not in line:  # DeepEP's own docs/ (upstream references)
                named |= set(re.findall(r"(?<![\w/.-])docs/[\w\-]+\.md", line))
    assert named, "the code should point readers to docs/"
    missing = sorted(n for n in named if not (ROOT / n).exists())
    assert not missing, missing


def test_readme_python_example_runs(tmp_path, monkeypatch):
    """The README's notebook-sized example runs as written (in a scratch directory)."""
    text = (ROOT / "README.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, re.S)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    assert (tmp_path / "tbo.pdf").stat().st_size > 1000
    assert (tmp_path / "compare.pdf").stat().st_size > 1000


def test_readme_states_python_and_the_cpu_torch_pin():
    text = (ROOT / "README.md").read_text()
    assert "Python 3.11" in text
    for m in re.finditer(r'pip install[^\n`]*"?\.\[(real|test)\]', text):
        assert "torch==2.13.0" in m.group(0), m.group(0)
