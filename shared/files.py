"""Reading a user's file: the one path every input file takes.

Models, GPUs, sweep specs, routing samples, calibration profiles, kernel mappings, measured
traces, experiment results and Program texts are all read here, so that each is bounded in every
way a file can be unbounded:

- regular files only: a FIFO blocks ``open`` until a writer comes (forever), a device
  (``/dev/zero``) reads forever; the file is opened without blocking and checked by ``fstat``
  before a byte is read;
- a size cap checked before reading (the regular file's size) and while reading (a file that
  grows), so no input takes more memory than its cap;
- gzip decompressed in a stream whose output is capped too (a 1 MB bomb expands to gigabytes);
- a nesting bound on JSON and YAML (deep nesting overflows the parsers' and the readers' stacks);
- YAML aliases bounded by the size of the value they stand for (a 2 KB file of aliases of
  aliases is a value of 10^10 nodes once printed or converted; PyYAML shares the nodes, so the
  file loads at once and explodes later, wherever the value is walked).

It sits at the top of ``shared/`` beside ``errors``, below the sub-packages that read files
(``inputs``, ``outputs``, ``ir``), and imports nothing of them. Every failure is one
:class:`~overlap_lab.shared.errors.ConfigError` naming the file.
"""

from __future__ import annotations

import json
import os
import stat
import zlib
from pathlib import Path
from typing import Any

from overlap_lab.shared.errors import ConfigError

#: Input files (models, GPUs, sweep specs, profiles, mappings, results) larger than this are
#: refused: the largest real one is a few MB.
MAX_INPUT_BYTES = 16 << 20
#: Measured traces (``analyze``, ``validate``, ``calibrate --from-trace``), after decompression:
#: a trace of a few steps of a 61-layer model is tens of MB; parsed, JSON takes ~6x its size in
#: memory, so this keeps a read under about 1 GB. Cut a larger trace to the steps to analyze.
MAX_TRACE_BYTES = 128 << 20
#: How deeply a JSON or YAML value may nest (lists and mappings): real files nest a few levels.
MAX_DEPTH = 100
#: The most values (scalars, lists, mappings) a YAML or JSON settings file may expand to, its
#: aliases expanded: a model, GPU or sweep spec holds at most a few hundred thousand (a sweep's
#: ``kv-lens`` list of 65,536 sequences is the largest).
MAX_VALUES = 1_000_000


def _mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB"


def _file_kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "is a directory"
    if stat.S_ISFIFO(mode):
        return "is a FIFO, not a regular file"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "is a device, not a regular file"
    if stat.S_ISSOCK(mode):
        return "is a socket, not a regular file"
    return "is not a regular file"


def check_regular(path: str | Path, what: str = "file") -> None:
    """Refuse ``path`` unless it is missing or a regular file (through symlinks): what an output
    about to be written, or a file about to be read, must be. A FIFO would block the open until
    another process opened its other end; a device would be read or written forever."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise ConfigError(f"{what} {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{what} {path}: {_file_kind(st.st_mode)}")


def read_bytes(
    path: str | Path, what: str = "file", cap: int = MAX_INPUT_BYTES, *, gunzip: bool = False
) -> bytes:
    """The bytes of the regular file ``path``, at most ``cap`` of them (refused beyond, by its
    size before reading); ``gunzip``: a gzip file (by its magic bytes) is decompressed, its
    output held to ``cap`` too. ``what`` names the file in errors (``gpu file``, ``trace``)."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise ConfigError(f"{what} {p}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {p}: is a directory") from None
    except OSError as e:
        raise ConfigError(f"cannot read {what} {p}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what} {p}: {_file_kind(st.st_mode)}")
        if st.st_size > cap:
            raise ConfigError(f"{what} {p}: larger than {_mib(cap)}")
        chunks, n = [], 0
        while n <= cap:  # a file growing while read stops at cap + 1
            chunk = os.read(fd, min(cap + 1 - n, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            n += len(chunk)
    except OSError as e:
        raise ConfigError(f"cannot read {what} {p}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if n > cap:
        raise ConfigError(f"{what} {p}: larger than {_mib(cap)}")
    if gunzip and data[:2] == b"\x1f\x8b":
        data = _gunzip(data, p, what, cap)
    return data


def _gunzip(data: bytes, p: Path, what: str, cap: int) -> bytes:
    """``data`` (one or more gzip members) decompressed, at most ``cap`` bytes of output."""
    out, n = [], 0
    try:
        while data:
            d = zlib.decompressobj(wbits=31)
            chunk = d.decompress(data, cap + 1 - n)
            out.append(chunk)
            n += len(chunk)
            if n > cap or d.unconsumed_tail:
                raise ConfigError(f"{what} {p}: decompresses to more than {_mib(cap)}")
            if not d.eof:
                raise ConfigError(f"{what} {p}: not a whole gzip file (cut short?)")
            data = d.unused_data
    except zlib.error as e:
        raise ConfigError(f"{what} {p}: not a gzip file ({e})") from None
    return b"".join(out)


def read_text(
    path: str | Path, what: str = "file", cap: int = MAX_INPUT_BYTES, *, gunzip: bool = False
) -> str:
    """:func:`read_bytes` decoded as UTF-8 (refused in one line when it is not)."""
    try:
        return read_bytes(path, what, cap, gunzip=gunzip).decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {Path(path)}: not a UTF-8 text file (binary?)") from None


def read_json(
    path: str | Path, what: str = "file", cap: int = MAX_INPUT_BYTES, *, gunzip: bool = False
) -> Any:
    """The JSON value of a file (:func:`read_bytes`), nested at most :data:`MAX_DEPTH` deep."""
    p = Path(path)
    raw = read_bytes(p, what, cap, gunzip=gunzip)
    try:
        value = json.loads(raw)
    except RecursionError:
        raise ConfigError(f"{what} {p}: not JSON (nested more than {MAX_DEPTH} deep)") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {p}: not a UTF-8 text file (binary?)") from None
    except ValueError as e:
        raise ConfigError(f"{what} {p}: not JSON ({e})") from None
    check_shape(value, f"{what} {p}", max_values=None)
    return value


def read_mapping(path: str | Path, what: str = "file") -> dict[str, Any]:
    """A YAML or JSON settings file's top-level mapping (JSON is YAML, but its errors read
    better), read with :func:`read_text`'s bounds; its value, aliases expanded, holds at most
    :data:`MAX_VALUES` values nested at most :data:`MAX_DEPTH` deep."""
    p = Path(path)
    text = read_text(p, what)
    kind = "JSON" if p.suffix == ".json" else "YAML"
    try:
        if kind == "JSON":
            data = json.loads(text)
        else:
            import yaml

            # libyaml's parser where PyYAML has it (the same safe subset, ~10x faster)
            data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except RecursionError:
        raise ConfigError(f"{p}: not valid {kind}: nested more than {MAX_DEPTH} deep") from None
    except (ValueError, ImportError) as e:
        raise ConfigError(f"{p}: not valid {kind}: {e}") from None
    except Exception as e:  # yaml.YAMLError
        raise ConfigError(f"{p}: not valid YAML: {str(e).splitlines()[0]}") from None
    check_shape(data, str(p))
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping of fields, got {type(data).__name__}")
    return data


_CONTAINERS = (list, tuple, dict, set, frozenset)


def _children(v) -> Any:
    return v.values() if isinstance(v, dict) else v


def check_shape(value: Any, where: str, max_values: int | None = MAX_VALUES) -> None:
    """Refuse ``value`` (parsed JSON or YAML) when it nests deeper than :data:`MAX_DEPTH`, holds
    more than ``max_values`` values with every alias expanded (None: no count), or contains
    itself (a YAML alias of its own anchor). Each list or mapping is visited once (an alias is
    counted by the size of what it stands for, not walked again), so a file of aliases of
    aliases is measured in the time it takes to read it."""
    if not isinstance(value, _CONTAINERS):
        return
    done: dict[int, tuple[int, int]] = {}  # id -> (depth below and including it, values)
    open_: set[int] = set()  # containers whose children are being measured: their ancestors
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        v, children_done = stack.pop()
        i = id(v)
        if children_done:
            depth, count = 1, 1
            for c in _children(v):
                if isinstance(c, _CONTAINERS):
                    d, n = done[id(c)]
                    depth, count = max(depth, d + 1), count + n
                else:
                    count += 1
            open_.discard(i)
            done[i] = (depth, count)
            if depth > MAX_DEPTH:
                raise ConfigError(f"{where}: nested more than {MAX_DEPTH} deep")
            if max_values is not None and count > max_values:
                raise ConfigError(
                    f"{where}: holds more than {max_values:,} values with its aliases "
                    "expanded (YAML anchors and aliases that repeat each other?)"
                )
            continue
        if i in done:
            continue
        if i in open_:
            raise ConfigError(f"{where}: a value contains itself (a YAML alias of its own anchor)")
        open_.add(i)
        if len(open_) > MAX_DEPTH:
            raise ConfigError(f"{where}: nested more than {MAX_DEPTH} deep")
        stack.append((v, True))
        for c in _children(v):
            if isinstance(c, _CONTAINERS) and id(c) not in done:
                if id(c) in open_:
                    raise ConfigError(
                        f"{where}: a value contains itself (a YAML alias of its own anchor)"
                    )
                stack.append((c, False))
