"""The folders the tool writes its outputs into (``--out``), and how it knows them again.

Every folder the tool makes or writes into holds a small marker file; an ``--out`` that is
another non-empty folder is refused unless ``--force``, and a filesystem root always is, so that
a slip such as ``--out /`` or ``--out ~`` does not scatter trace.json and figures among a user's
files. A folder of outputs written before the marker existed is recognised by its file names.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from overlap_lab.shared.errors import ConfigError

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


def check_out_dir(out: str | os.PathLike, *, mine_only: bool = False) -> None:
    """An output folder that exists as a writable folder or can be made under one, never a
    filesystem root. With ``mine_only`` (sim, compare, analyze, validate without --force) it must
    also be new, empty or hold only what the tool wrote (this module's marker), and it is
    marked as the tool's now, before anything runs. Without it (the experiments' results folder,
    which keeps other runs' files that ``--draw`` reads; a folder written into with --force) the
    folder is written into as it is and left unmarked."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a folder")
    if is_root(p):
        raise ConfigError(f"--out {out}: a filesystem root; give a folder for the outputs")
    if mine_only and p.is_dir():
        try:
            foreign = foreign_files(p)
        except OSError as e:
            raise ConfigError(f"--out {out}: cannot list it ({e.strerror})") from None
        if foreign:
            raise ConfigError(
                f"--out {out}: holds files overlap-lab did not write ({foreign[0]}, ...); "
                "give a new or empty folder, or --force to write there anyway"
            )
    probe = p
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise ConfigError(f"--out {out}: {probe} is a file, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out}: folder {probe} is not writable")
    try:  # make it and write into it now: what os.access cannot tell (/proc, read-only mounts)
        p.mkdir(parents=True, exist_ok=True)
        if mine_only:
            mark(p)
        else:
            with tempfile.TemporaryFile(dir=p):
                pass
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write there ({e.strerror})") from None
