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
        tmp = self.path.with_name(self.path.name + ".part")
        # rewritten after every schedule: fast compression until the last write
        with tarfile.open(tmp, "w:gz", compresslevel=6 if final else 1) as tar:
            tar.add(self.work, arcname=self.name)
        tmp.replace(self.path)

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
