"""Re-judge a recorded loop offline: ``python -m overlap_lab.experiments.gpu_validation --replay
ARCHIVE``.

Researchers record once on a GPU and re-judge as the model changes. A loop's archive keeps what
a prediction needs (``archive``): per case the calibration runs (the executor's trace and its
kernel records), per schedule its measured trace and, where it took rows from its own run, that
run's. A replay reads them back, calibrates again with today's code (``predict.calibrate``: the
kernel records mapped to ops, the graph gap measured), predicts every schedule again with
today's simulator as the executor ran it (``predict.judge``) and prints the same table and
verdict; the measured side is the recording's, untouched. It needs no GPU and no torch (a
pipeline schedule's workload variants excepted).

The Programs are today's builds of the recorded workloads: a schedule whose ops were renamed
since the recording finds fewer measured ops (``ops_only_predicted`` in the table's record);
an op today's calibration cannot time from the recording stays on the roofline and is listed
(``roofline_ops``).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from overlap_lab.experiments.gpu_validation.archive import Archive, unpack
from overlap_lab.experiments.gpu_validation.comm_only import COMM_ONLY
from overlap_lab.experiments.gpu_validation.context import Setup, case_workload, model_config
from overlap_lab.experiments.gpu_validation.predict import (
    CalibrationRun,
    build,
    calibrate,
    graphs_per_run,
    judge,
)
from overlap_lab.experiments.gpu_validation.report import table
from overlap_lab.experiments.gpu_validation.verdict import not_comparable, summarize, verdict

#: What a case of an archive without calibration runs says (a loop older than replays).
NO_CALIBRATION = "no calibration runs recorded: an archive older than replays (convert it)"


def setup_of(report: dict) -> tuple[Setup, object]:
    """The recording's machine (GPU preset, SMs, environment) and its model, at the GEMM
    precision both sides ran."""
    from overlap_lab.shared.inputs.hardware import get_gpu

    gpu = get_gpu(report["preset"])
    env = report.get("environment") or {}
    mc = model_config(report["model"], report["layers"])
    used = ((report.get("precision") or {}).get("gemm") or {}).get("executor_and_simulator")
    if used:
        mc = dataclasses.replace(mc, gemm_dtype=used)
    return Setup(gpu, int(env.get("num_sms") or gpu.num_sms), env), mc


def replay_setup(path: str | Path) -> tuple[Setup, object]:
    """:func:`setup_of` the archive ``path`` (its machine and model), read without the rest."""
    root, report = unpack(path, "--replay")
    shutil.rmtree(root.parent, ignore_errors=True)
    return setup_of(report)


def _trace(root: Path, rel: str | None):
    from overlap_lab.shared.outputs.trace import Trace

    return None if rel is None else Trace.from_chrome(root / rel)


def _kernels(root: Path, rel: str | None):
    from overlap_lab.device_time import load_chrome

    return None if rel is None else load_chrome(root / rel)


def replay_case(root: Path, report: dict, key: str, case: dict, setup: Setup, mc,
                work: Path | None = None) -> dict:  # fmt: skip
    """One case again: calibrated from its recorded runs, every recorded schedule predicted
    with today's simulator and compared with its recorded measurement (the predicted traces
    written under ``work/<key>/`` where given)."""
    from overlap_lab.calibrate import apply_device_time
    from overlap_lab.kernel_timeline import run_timeline
    from overlap_lab.shared import schedules as S

    runs_in = case.get("calibration_runs")
    if not runs_in:
        return {"workload": case.get("workload"), "runs": {}, "error": NO_CALIBRATION}
    wl = case["workload"]
    mode, size = wl["mode"], int(wl.get("size", wl.get("tokens")))
    kw = {"ep": report["ep"], "kv_len": report["kv_len"]}

    def workload(size: int, half: bool = False):
        return case_workload(mc, mode, size, half=half, **kw)

    # the unprofiled run of a calibration's Program: the schedule's measured run at that size
    # (not where the calibration run is that measured run: an archive converted from before)
    measured = {name: (rec.get("files") or {}).get("measured")
                for name, rec in case.get("runs", {}).items()}  # fmt: skip
    runs = [
        CalibrationRun(
            S.build(e["schedule"], workload(int(e["size"]), bool(e.get("half"))), setup.gpu),
            _trace(root, e["files"]["trace"]),
            _kernels(root, e["files"].get("kernels")),
            e.get("replay_step_us"),
            f"{e['schedule']} {e['size']}",
            e.get("host_launch_us"),
            _trace(root, unprofiled)
            if int(e["size"]) == size
            and (unprofiled := measured.get(e["schedule"])) != e["files"]["trace"]
            else None,
            # the calibration trace is the measured run itself: unprofiled
            trace_unprofiled=bool(e["files"].get("kernels"))
            and measured.get(e["schedule"]) == e["files"]["trace"],
        )
        for e in runs_in
    ]
    profile, at, info = calibrate(setup, runs, mode)
    out = {"workload": wl, "calibration_runs": runs_in, **info, "runs": {}}
    w = workload(size)
    for name, rec in case.get("runs", {}).items():
        files = rec.get("files") or {}
        if "measured" not in files:
            out["runs"][name] = {k: v for k, v in rec.items() if k in ("error", "skipped")}
            continue
        wv = w
        if name != COMM_ONLY and S.supports_pp(name):
            from overlap_lab.real.check import workload_variants  # torch: pipelines only

            wv = workload_variants(name, w)[0]
        rec_files = files.get("recorded") or {}  # a run under the profiler, where kept
        own = replayed = _trace(root, rec_files.get("trace"))
        kernels = None
        if own is not None and rec_files.get("kernels"):
            kernels = _kernels(root, rec_files["kernels"])
            own = apply_device_time(own, kernels, at.gpu.graph_kernel_gap_us)
            replayed = run_timeline(replayed, kernels, graphs_per_run(build(at, name, wv)))
        try:
            measured = _trace(root, files["measured"])
            run, pred = judge(at, name, wv, measured, profile, own, replayed, kernels)
        except Exception as e:  # recorded; the next schedule goes on
            out["runs"][name] = {"error": f"{type(e).__name__}: {e}"[:500], "files": files}
            continue
        run.update(comparable=not_comparable(name) is None, note=not_comparable(name),
                   files=files)  # fmt: skip
        if "comparison" in rec:
            run["recorded_prediction_us"] = rec["comparison"]["step_time_us"]["predicted"]
        out["runs"][name] = run
        if work is not None:
            (work / key).mkdir(parents=True, exist_ok=True)
            pred.to_chrome(work / key / f"{name}.predicted.trace.json.gz")
    return out


def replay(path: str | Path, out: str | Path | None = None, name: str | None = None) -> dict:
    """Re-judge the archive ``path`` (the module docstring); the report, with ``table``, and
    with ``archive`` where ``out`` is given (``<out>/<name>.tar.gz``: results.json and
    table.md of the replay)."""
    from overlap_lab.experiments.gpu_validation.environment import environment_commit

    root, recorded = unpack(path, "--replay")
    archive = None
    if out is not None:
        archive = Archive(Path(out), name or f"{Path(path).name.split('.')[0]}_replay")
    try:
        setup, mc = setup_of(recorded)
        work = archive.work if archive is not None else None
        cases = {k: replay_case(root, recorded, k, c, setup, mc, work)
                 for k, c in recorded.get("cases", {}).items()}  # fmt: skip
    except BaseException:
        if archive is not None:
            archive.close()
        raise
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)
    report = {
        **{k: v for k, v in recorded.items()
           if k not in ("cases", "summary", "verdict", "table", "archive", "results")},
        "cases": cases,
        "summary": summarize(cases),
        "verdict": verdict(cases),
        "complete": True,
        "replay": {"archive": Path(path).name, "commit": environment_commit(),
                   "recorded_commit": (recorded.get("environment") or {}).get("commit")},
    }  # fmt: skip
    if archive is not None:
        try:
            archive.write(report, final=False)
            report["archive"] = str(archive.path)
        finally:
            archive.close()
    report["table"] = table(report)
    return report
