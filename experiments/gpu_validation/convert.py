"""An archive of the loop from before replays, made replayable: ``python -m
overlap_lab.experiments.gpu_validation.convert OLD.tar.gz --calibration CASE=SCHEDULE[:KERNELS]
... --out DIR --name NAME``.

The loop's first archives (2026-11) kept each schedule's measured trace but not its calibration
runs: their profile came from CUDA-event spans, which a replay must not reuse. What they lack is
the kernel records of some run of each case, recorded separately by torch.profiler around one
measured run (a ``k_<case>_<schedule>.json.gz``). This script writes an archive in today's
format (``archive``) whose calibration runs are, per case, the named schedules' measured traces
with those kernel records (``SCHEDULE:KERNELS``; a schedule named without a file calibrates
from its spans, e.g. a prefill's, whose kernels are long beside their launch gaps) and whose
runs are the recorded schedules with their measured traces. A calibration run of a schedule
other than serial gives rows at its micro-batches' token counts (TBO at 128 sequences: 64), so
serial and TBO of one case cover what the loop's serial runs at the batch and its half did.

``--last-runs N`` keeps the last N eager runs and graph replays of each kernel record (a small
fixture: tests/data/ is built with ``--last-runs 1``); ``--schedules`` keeps only those runs;
``--cases`` only those cases. The recorded report (device, preset, model, precision) is kept;
``kv_len`` is the loop's default where the recorded command did not set it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tarfile
from pathlib import Path

from overlap_lab.experiments.gpu_validation.archive import Archive, unpack, write_json_gz
from overlap_lab.experiments.gpu_validation.driver import GPU_DEFAULTS
from overlap_lab.shared.errors import ConfigError


def parse_calibration(items: list[str]) -> dict[str, list[tuple[str, str | None]]]:
    """``["decode_128=serial:k1.json.gz,tbo:k2.json.gz"]`` -> {case: [(schedule, file)]}."""
    out: dict[str, list[tuple[str, str | None]]] = {}
    for item in items:
        case, sep, rest = item.partition("=")
        if not sep or not rest:
            raise ConfigError(f"--calibration takes CASE=SCHEDULE[:KERNELS],..., got {item!r}")
        for part in rest.split(","):
            name, _, path = part.partition(":")
            out.setdefault(case, []).append((name, path or None))
    return out


def _kv_len(commands: list[str] | None) -> int:
    args = list(commands or ())
    for i, a in enumerate(args):
        if a == "--kv-len" and i + 1 < len(args):
            return int(args[i + 1])
        if a.startswith("--kv-len="):
            return int(a.split("=", 1)[1])
    return int(GPU_DEFAULTS["kv_len"])


def convert(old: str | Path, calibration: dict[str, list[tuple[str, str | None]]], out: Path,
            name: str, *, schedules: list[str] | None = None,
            last_runs: int | None = None) -> Path:  # fmt: skip
    """The archive ``<out>/<name>.tar.gz`` (the module docstring); its path."""
    from overlap_lab.device_time import kernel_records, load_chrome
    from overlap_lab.shared.outputs.trace import Trace

    root, rec = unpack(old, "convert")
    archive = Archive(Path(out), name)
    try:
        keep = ("environment", "preset", "model", "layers", "ep", "backend", "precision",
                "timing_meaningful", "commands", "pytest_gpu")  # fmt: skip
        report = {k: rec[k] for k in keep if k in rec}
        report["kv_len"] = _kv_len(rec.get("commands"))
        report["converted_from"] = {
            "archive": Path(old).name,
            "note": "a loop archive from before replays: calibration runs are the named "
            "schedules' measured traces with kernel records recorded beside the loop",
        }
        cases = {}
        for key, cal in calibration.items():
            old_case = rec["cases"].get(key)
            if old_case is None:
                raise ConfigError(f"{old} has no case {key!r} (it has {sorted(rec['cases'])})")
            mode, _, size = key.rpartition("_")
            runs = {}
            for sname, r in old_case["runs"].items():
                if schedules and sname not in schedules or "comparison" not in r:
                    continue
                rel = f"{key}/{sname}.measured.trace.json.gz"
                (archive.work / key).mkdir(parents=True, exist_ok=True)
                shutil.copyfile(root / rel, archive.work / rel)
                runs[sname] = {"comparison": r["comparison"], "files": {"measured": rel}}
            entries = []
            for sname, kpath in cal:
                rel = f"{key}/{sname}.measured.trace.json.gz"
                meta = Trace.from_chrome(root / rel).meta
                step = (meta.get("graph_replay_step_time_us")
                        if meta.get("step_time_source") == "graph_replay" else None)  # fmt: skip
                files = {"trace": rel}
                if sname not in runs:  # a calibration run that is no judged run: kept anyway
                    shutil.copyfile(root / rel, archive.work / rel)
                if kpath:
                    files["kernels"] = f"{key}/calibration/{sname}_{size}.kernels.json.gz"
                    (archive.work / key / "calibration").mkdir(parents=True, exist_ok=True)
                    doc = kernel_records(load_chrome(kpath), last=last_runs)
                    write_json_gz(archive.work / files["kernels"], doc)
                entries.append({"schedule": sname, "size": int(size), "half": False,
                                "replay_step_us": step, "files": files})  # fmt: skip
                if kpath and sname in runs:  # its replay's timeline: the exposed communication
                    runs[sname]["files"]["recorded"] = dict(files)
            cases[key] = {
                "workload": {"mode": mode, "size": int(size),
                             "tokens": old_case["workload"]["tokens"]},
                "calibration_runs": entries,
                "runs": runs,
            }  # fmt: skip
        report["cases"] = cases
        report["complete"] = True
        (archive.work / "results.json").write_text(
            json.dumps(report, indent=1, sort_keys=True, default=str) + "\n"
        )
        return archive.pack()
    finally:
        archive.close()
        shutil.rmtree(root.parent, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m overlap_lab.experiments.gpu_validation.convert",
        description="A loop archive from before replays, made replayable.",
    )
    p.add_argument("archive", help="the recorded archive (<name>.tar.gz)")
    p.add_argument("--calibration", action="append", required=True,
                   metavar="CASE=SCHEDULE[:KERNELS],...",
                   help="per case, the schedules whose measured runs calibrate it, each with "
                   "the torch.profiler trace of such a run (repeat per case)")  # fmt: skip
    p.add_argument("--schedules", default=None, help="keep only these runs (comma-separated)")
    p.add_argument("--last-runs", type=int, default=None,
                   help="keep the last N eager runs and replays of each kernel record")  # fmt: skip
    p.add_argument("--out", required=True)
    p.add_argument("--name", required=True)
    opts = p.parse_args(argv)
    try:
        path = convert(
            opts.archive, parse_calibration(opts.calibration), Path(opts.out), opts.name,
            schedules=opts.schedules.split(",") if opts.schedules else None,
            last_runs=opts.last_runs,
        )  # fmt: skip
    except (ConfigError, OSError, tarfile.TarError) as e:
        print(f"convert: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
