"""The loop's one archive, ``<out>/<name>.tar.gz``: ``results.json`` (the report), ``table.md``,
``step_times.png`` and, per case (``<mode>_<size>/``) and schedule, the predicted and measured
traces (Chrome JSON, gzipped) and a two-row timeline.

The archive is packed from a working folder and rewritten whole after every schedule (to a
``.part`` file, then renamed), so a command stopped at its time limit still returns what it
measured; ``complete: false`` in the report says so.
"""

from __future__ import annotations

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
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(self.work, arcname=self.name)
        tmp.replace(self.path)

    def close(self) -> None:
        """Remove the working folder (the archive stays)."""
        shutil.rmtree(self.work, ignore_errors=True)
