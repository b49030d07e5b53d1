"""The folders and files the tool writes its outputs into (``--out``), and how it knows them
again.

Every folder the tool makes or writes into holds a small marker file; an ``--out`` that is
another non-empty folder is refused unless ``--force``, and a filesystem root always is, so that
a slip such as ``--out /`` or ``--out ~`` does not scatter trace.json and figures among a user's
files. A folder of outputs written before the marker existed is recognised by its file names.
An ``--out FILE`` (a profile) replaces only a file the tool wrote, known by how it begins, unless
``--force`` (:func:`check_out_file`).
"""

from __future__ import annotations

import os
import re
import stat
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
    r"|profile\.json|kernels\.(json|md)"
)


def resolved(p: Path, option: str = "--out") -> Path:
    """``p`` with its symbolic links followed (a link loop is one ConfigError, naming ``option``)."""
    try:
        return p.resolve()
    except (RuntimeError, OSError):  # RuntimeError: Python < 3.13's "Symlink loop"
        raise ConfigError(f"{option} {p}: a loop of symbolic links") from None


def is_root(p: Path) -> bool:
    """Whether ``p`` is a filesystem root (``/``, a drive), its own parent once resolved."""
    r = resolved(p)
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


def check_out_dir(out: str | os.PathLike, *, mine_only: bool = False) -> Path:
    """An output folder that exists as a writable folder or can be made under one, never a
    filesystem root. With ``mine_only`` (sim, compare, analyze, validate without --force) it must
    also be new, empty or hold only what the tool wrote (this module's marker), and it is
    marked as the tool's now, before anything runs. Without it (the experiments' results folder,
    which keeps other runs' files that ``--draw`` reads; a folder written into with --force) the
    folder is written into as it is and left unmarked. Returns the folder."""
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
    _check_writable_under(p, f"--out {out}")
    try:  # make it and write into it now: what os.access cannot tell (/proc, read-only mounts)
        p.mkdir(parents=True, exist_ok=True)
        if mine_only:
            mark(p)
        else:
            with tempfile.TemporaryFile(dir=p):
                pass
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write there ({e.strerror})") from None
    return p


def _check_writable_under(p: Path, what: str) -> None:
    """The nearest folder of ``p`` that exists (``p`` itself, or a parent) is a writable folder."""
    probe = p
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise ConfigError(f"{what}: {probe} is a file, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{what}: folder {probe} is not writable")


#: How every file the tool writes in place of an ``--out FILE`` begins (a profile, the
#: ``<file>.provenance.json`` beside a profile or a sweep): a file that begins so is the tool's
#: and may be written again; any other needs ``--force``.
OWN_FILE_HEADS = (b'{\n "format": "overlap-lab-profile/', b'{\n "command": ')


def _kind(mode: int) -> str:
    return "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a device"


def file_target(out: str | os.PathLike, option: str = "--out") -> Path:
    """Where an output file ``out`` is written, its symbolic links followed: a regular file or
    none yet (never a folder, a device or a FIFO: ``/dev/null`` would keep nothing), under a
    folder that exists writable or can be made."""
    p = resolved(Path(out), option)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        raise ConfigError(f"{option} {out}: cannot read it ({e.strerror})") from None
    if mode is not None and not stat.S_ISREG(mode):
        raise ConfigError(f"{option} {out}: {_kind(mode)}, not a file")
    _check_writable_under(p.parent, f"{option} {out}")
    return p


def check_out_file(
    out: str | os.PathLike,
    *,
    force: bool = False,
    option: str = "--out",
    beside: tuple[str, ...] = (".provenance.json",),
) -> Path:
    """An output file that may be written (``calibrate --out``, a sweep's provenance record): a
    new file, a regular file the tool wrote (it begins as :data:`OWN_FILE_HEADS` says), or with
    ``force`` any regular file (:func:`file_target`). The files written beside it (``beside``:
    suffixes added to its name) are checked alike. Returns the path to write, links followed."""
    p = file_target(out, option)
    for f in (p, *(p.with_name(p.name + b) for b in beside)):
        f = file_target(f, option) if f != p else f
        if f.exists() and not force and not _own_file(f):
            raise ConfigError(
                f"{option} {out}: {'' if f == p else f.name + ' '}exists and overlap-lab did not "
                "write it; give a new file, or --force to replace it"
            )
    return p


def _own_file(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            head = f.read(64)
    except OSError:
        return False
    return any(head.startswith(h) for h in OWN_FILE_HEADS)
