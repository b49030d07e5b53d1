"""The loop's one archive, ``<out>/<name>.tar.gz``: ``results.json`` (the report), ``table.md``,
``step_times.png`` and, per case (``<mode>_<size>/``) and schedule, the predicted and measured
traces (Chrome JSON, gzipped) and a two-row timeline; and what a replay needs to calibrate
again (``replay``): per case the calibration runs (``calibration/serial_<tokens>``: the
executor's trace and its kernel records, :meth:`Archive.keep_run`) and, on a GPU, per schedule a
short run under the profiler (``<schedule>.recorded``: its graph replay's timeline, the
device time of rows from its own run). The report names each file it refers to by its
path inside the archive, under the archive's name (``files``).

The archive is packed from a working folder and rewritten whole after every schedule (to a
``.part`` file, then renamed), so a command stopped at its time limit still returns what it
measured; ``complete: false`` in the report says so.
"""

from __future__ import annotations

import gzip
import json
import shutil
import tarfile
import tempfile
from pathlib import Path

from overlap_lab.experiments.gpu_validation.report import step_figure, table
from overlap_lab.shared.errors import ConfigError


class Archive:
    """The archive ``<out>/<name>.tar.gz`` and the working folder it is packed from (``work``:
    the runs write their traces and figures under it)."""

    def __init__(self, out: Path, name: str):
        out.mkdir(parents=True, exist_ok=True)
        self.name, self.path = name, out / f"{name}.tar.gz"
        self.work = Path(tempfile.mkdtemp(prefix="gpu_validation_"))

    def write(self, report: dict, *, final: bool) -> None:
        """``report`` as results.json and table.md (and, once ``final``, the step-time figure),
        packed into the archive."""
        (self.work / "results.json").write_text(
            json.dumps(report, indent=2, sort_keys=True, default=str) + "\n"
        )
        (self.work / "table.md").write_text(table(report))
        if final:
            step_figure(report, self.work / "step_times.png")
        self.pack(compresslevel=6 if final else 1)  # after every schedule: fast until the last

    def pack(self, compresslevel: int = 6) -> Path:
        """The working folder packed into the archive (through a ``.part`` file, then renamed):
        sorted, owner-free, no times, so the same files make the same archive; its path."""
        tmp = self.path.with_name(self.path.name + ".part")
        with (
            open(tmp, "wb") as f,
            gzip.GzipFile(fileobj=f, mode="wb", mtime=0, compresslevel=compresslevel) as gz,
            tarfile.open(fileobj=gz, mode="w") as tar,
        ):
            for p in [self.work, *sorted(self.work.rglob("*"))]:
                rel = p.relative_to(self.work)
                info = tar.gettarinfo(p, arcname=f"{self.name}/{rel}" if rel.parts else self.name)
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                info.mtime = 0
                if p.is_file():
                    with open(p, "rb") as fh:
                        tar.addfile(info, fh)
                else:
                    tar.addfile(info)
        tmp.replace(self.path)
        return self.path

    def keep_run(self, rel_dir: str, stem: str, rec) -> dict[str, str]:
        """A recorded run (``overlap_lab.calibrate.DeviceTimed``) kept for a replay: the
        executor's trace as ``<rel_dir>/<stem>.trace.json.gz`` and, where it has them, its
        kernel records as ``<stem>.kernels.json.gz``; their paths (relative to the archive's
        folder) by kind."""
        d = self.work / rel_dir
        d.mkdir(parents=True, exist_ok=True)
        out = {"trace": f"{rel_dir}/{stem}.trace.json.gz"}
        rec.executor_trace.to_chrome(self.work / out["trace"])
        if rec.kernels is not None:
            out["kernels"] = f"{rel_dir}/{stem}.kernels.json.gz"
            write_json_gz(self.work / out["kernels"], rec.kernels)
        return out

    def close(self) -> None:
        """Remove the working folder (the archive stays)."""
        shutil.rmtree(self.work, ignore_errors=True)


def write_json_gz(path: Path, doc) -> None:
    """``doc`` as compact gzipped JSON; the same doc, the same bytes (no time in the header)."""
    data = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    with open(path, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as g:
        g.write(data)


def unpack(path: str | Path, what: str) -> tuple[Path, dict]:
    """A loop's archive ``path`` unpacked into a temporary folder: (its top folder, its
    results.json). The caller removes the top folder's parent when done; ``what`` names the
    reader in its errors (``--replay``, ``convert``)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what}: no archive at {p}")
    tmp = Path(tempfile.mkdtemp(prefix="gpu_validation_unpacked_"))
    try:
        with tarfile.open(p) as tar:
            tar.extractall(tmp, filter="data")
        found = sorted(tmp.glob("*/results.json"))
        if not found:
            raise ConfigError(f"{what}: {p} holds no <name>/results.json")
        return found[0].parent, json.loads(found[0].read_text())
    except (ConfigError, tarfile.TarError, OSError, ValueError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{what}: cannot read {p}: {e}") from None
