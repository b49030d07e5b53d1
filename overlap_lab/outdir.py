"""The folders the tool writes its outputs into (``--out``), and how it knows them again.

Every folder the tool makes or writes into holds a small marker file; an ``--out`` that is
another non-empty folder is refused unless ``--force``, and a filesystem root always is, so that
a slip such as ``--out /`` or ``--out ~`` does not scatter trace.json and figures among a user's
files. A folder of outputs written before the marker existed is recognised by its file names.
"""

from __future__ import annotations

import re
from pathlib import Path

#: the marker file in every folder the tool wrote into
MARKER = ".overlap-lab-out"

#: the names of what the tool writes into an output folder (sim, compare, analyze, validate, run,
#: calibrate's default profile)
OUTPUT_NAME = re.compile(
    r"(trace|predicted_trace|trace_[\w.-]+|[\w.+-]+\.trace)\.json(\.gz)?"
    r"|(timeline|compare|analyze_timeline|validate|[\w.+-]+)\.(png|pdf|svg)"
    r"|profile\.json"
)


def is_root(p: Path) -> bool:
    """Whether ``p`` is a filesystem root (``/``, a drive), its own parent once resolved."""
    r = p.resolve()
    return r.parent == r


def foreign_files(p: Path) -> list[str]:
    """The entries of folder ``p`` the tool did not write: none when it holds the marker."""
    names = sorted(e.name for e in p.iterdir())
    if MARKER in names:
        return []
    return [n for n in names if not OUTPUT_NAME.fullmatch(n)]


def mark(p: Path) -> None:
    """Mark folder ``p`` as the tool's output folder (it already exists and is writable)."""
    m = p / MARKER
    if not m.exists():
        m.write_text("overlap-lab writes its outputs here; --out reuses this folder\n")
