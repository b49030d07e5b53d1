"""Docs live in the repository: no pointer to files outside it (issue 11, item 3), and every
in-repo doc a module points to exists."""

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


def test_docs_named_in_the_code_exist():
    named = set()
    for p in tracked(".py", ".md"):
        named |= set(re.findall(r"docs/[\w\-]+\.md", p.read_text(errors="replace")))
    assert named, "the code should point readers to docs/"
    missing = sorted(n for n in named if not (ROOT / n).exists())
    assert not missing, missing
