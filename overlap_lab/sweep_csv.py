"""A sweep's results file: one CSV row per case, appended as cases finish, resumable.

Rows are flushed one by one, so an interrupted sweep leaves every finished row whole and at most
one torn last row (:func:`read_rows` drops it; :func:`open_rows` cuts it off before appending).
One sweep writes a file at a time (:func:`locked`, a lock on the file itself). Beside the CSV, ``<out>.provenance.json``
records what produced it (:func:`write_provenance`); a finished sweep may become a Parquet file
(:func:`to_parquet`).
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import re
import stat
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.files import check_regular


def cell(v: Any) -> str:
    """One value as its CSV cell: floats exactly (``repr``), lists comma-joined, None empty."""
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v)  # exact round trip
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    return str(v)


def complete(raw: bytes) -> tuple[int, list[list[str]]]:
    """The records of a sweep CSV that were written whole, and the byte length they span.

    Rows are written by one ``csv.writer`` and flushed one by one, so a record is whole exactly
    when writing it again gives back its bytes; the first that does not (an interrupted write:
    a missing newline, a quoted field cut after a newline inside it) and anything after it is
    torn. Only the last record can be: an interrupted run appends nothing after it."""
    lines = re.findall(r"[^\n]*\n|[^\n]+", raw.decode(errors="replace"))
    consumed = 0

    def feed():
        nonlocal consumed
        for line in lines:
            consumed += 1
            yield line

    records: list[list[str]] = []
    end = done = 0
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    try:
        for rec in csv.reader(feed()):
            text = "".join(lines[done:consumed])
            buf.seek(0)
            buf.truncate()
            writer.writerow(rec)
            if buf.getvalue() != text:
                break
            records.append(rec)
            end += len(text.encode())
            done = consumed
    except csv.Error:  # a NUL byte or the like in the torn tail
        pass
    return end, records


def read_rows(path: str | Path) -> list[dict[str, str]]:
    """The complete rows of a sweep CSV (a torn last row of an interrupted run is left out)."""
    path = Path(path)
    if not path.exists():
        return []
    _, records = complete(path.read_bytes())
    if not records:
        return []
    head, rows = records[0], records[1:]
    return [dict(zip(head, r)) for r in rows if len(r) == len(head)]


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the results file itself (made, empty, if new) while a sweep
    writes it: a second sweep on the same file would append duplicate and interleaved rows, so
    it is refused, whatever name it reaches the file by (a symbolic or a hard link: the lock is
    the file's own). The lock goes with the process (flock), so a killed sweep leaves none, and
    nothing is left beside the results."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o644)  # a FIFO must not block
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"sweep: {path} is not a regular file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"sweep: another sweep is writing {path}; wait for it or choose another --out"
            ) from None
        yield
    finally:
        os.close(fd)


#: The longest first line read to check a results file's columns (this project's are ~1 KB)
MAX_HEADER = 1 << 16


def open_rows(path: Path, columns: Sequence[str]) -> tuple[TextIO, list[dict[str, str]]]:
    """Open the CSV for appending, keeping its complete rows; check it is this sweep's file
    (its first line, read up to :data:`MAX_HEADER` bytes, is ``columns``)."""
    done: list[dict[str, str]] = []
    check_regular(path, "sweep: --out")  # a FIFO would block the read below, a device never end
    if path.exists() and path.stat().st_size > 0:
        with open(path, "rb") as fh:
            head = fh.readline(MAX_HEADER).decode(errors="replace").rstrip("\r\n")
        try:
            ours = next(csv.reader([head]), None) == list(columns)
        except csv.Error:  # a NUL byte, a field over csv's limit: not a sweep's file
            ours = False
        if not ours:
            raise ConfigError(
                f"sweep: {path} is not this sweep's results file (its first line is not the "
                "spec's columns); choose another --out"
            )
        raw = path.read_bytes()
        cut, _ = complete(raw)
        if cut < len(raw):  # a torn last row: drop it before appending
            with open(path, "rb+") as f:
                f.truncate(cut)
        done = read_rows(path)
        f = open(path, "a", newline="")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "w", newline="")
        csv.writer(f, lineterminator="\n").writerow(columns)
        f.flush()
    return f, done


def write_provenance(out: Path, command: Sequence[str] | None, inputs: Mapping[str, Any]) -> Path:
    """``<out>.provenance.json``: the tool's version, ``command`` (as typed; None from Python)
    and the sweep's full ``inputs``; the same sweep writes the same bytes."""
    from overlap_lab.provenance import write_beside
    from overlap_lab.shared.outputs.trace import provenance

    return write_beside(out, provenance(command, inputs))


def to_parquet(csv_path: str | Path, out: str | Path) -> Path:
    """A finished sweep CSV as a Parquet file, rows in case order (needs pyarrow)."""
    try:
        import pyarrow.csv as pacsv
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ConfigError("a .parquet sweep output needs pyarrow: pip install pyarrow") from e
    table = pacsv.read_csv(str(csv_path))
    table = table.sort_by("case")
    pq.write_table(table, str(out))
    return Path(out)


def read_table(path: str | Path) -> tuple[list[str], list[dict[str, str]]]:
    """The columns and complete rows of a results file, as strings: a sweep's (or tune's) CSV,
    or its Parquet file (needs pyarrow)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"no such results file {path}")
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ConfigError("reading a .parquet results file needs pyarrow") from e
        table = pq.read_table(str(p))
        rows = [{k: "" if v is None else str(v) for k, v in r.items()} for r in table.to_pylist()]
        return list(table.column_names), rows
    head = p.read_bytes().split(b"\n", 1)[0].decode(errors="replace").rstrip("\r")
    return next(csv.reader([head]), []), read_rows(p)
