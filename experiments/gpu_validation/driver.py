"""The loop itself: each case calibrated, every schedule predicted, measured and compared
(:func:`run_case`), the whole written into one archive after every schedule
(:func:`run_validation`), and the command line (:func:`parse`, :func:`main`)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from overlap_lab.experiments.gpu_validation.archive import Archive
from overlap_lab.experiments.gpu_validation.comm_only import COMM_ONLY
from overlap_lab.experiments.gpu_validation.context import Context
from overlap_lab.experiments.gpu_validation.environment import (
    ROOT,
    device_preset,
    environment,
    run_pytest,
)
from overlap_lab.experiments.gpu_validation.predict import (
    CalibrationRun,
    build,
    calibrate,
    graphs_per_run,
    judge,
)
from overlap_lab.experiments.gpu_validation.report import (
    figure,
    table,
    write_kernel_table,
    write_results,
)
from overlap_lab.experiments.gpu_validation.verdict import (
    not_comparable,
    summarize,
    verdict,
    verdict_line,
)

DESCRIPTION = "Predicted vs measured on one device, in one command per mode."
NO_GPU = "gpu_validation: no CUDA GPU found; nothing was run (--device cpu for the dry run)"
#: The dry run's: one decode batch and one prefill of the tiny model, one timed run each (it
#: checks the path, not times: under a minute on a CPU).
CPU_DEFAULTS = dict(
    model="tiny-mla", layers=3, ep=2, batches="4", prefill=16, kv_len=64, repeats=1, warmup=0
)
GPU_DEFAULTS = dict(
    model="deepseek-v3", layers=4, ep=32, batches="32,128", prefill=4096, kv_len=2048,
    repeats=5, warmup=2,
)  # fmt: skip


def run_case(ctx: Context, mode: str, size: int, names: list[str], archive: Archive,
             deadline: float, cases: dict, key: str, saved=lambda: None) -> dict:  # fmt: skip
    """Calibrate, predict, measure and compare every schedule on one workload; the case is
    ``cases[key]`` from the start, and ``saved()`` runs after every schedule. The calibration
    runs, and each schedule's own-rows run, are kept in the archive for a replay."""
    from overlap_lab.kernel_timeline import run_timeline
    from overlap_lab.real.check import workload_variants
    from overlap_lab.shared import schedules as S

    w = ctx.workload(mode, size)
    sizes = sorted({size, max(1, size // 2)}, reverse=True)
    t = time.time()
    case = cases[key] = {
        "workload": {"mode": mode, "size": size, "tokens": w.batch.num_tokens,
                     "sizes_calibrated": sizes},
        "runs": {},
    }  # fmt: skip
    serial_run = None  # serial's unprofiled run at the case's size: the gap, the launches, its step
    try:
        runs, kept = [], []
        for s in sizes:  # isolated op durations at the token counts the schedules run
            ws = ctx.workload(mode, s, half=s != size)
            p = S.build("serial", ws, ctx.gpu)
            rec = ctx.record(p, ws)
            step = host = None
            if s == size:
                serial_run = ctx.measure(p, ws)
                step = serial_run.meta.get("graph_replay_step_time_us")
                host = serial_run.meta.get("host_launch_us")  # unprofiled, per op
            elif ctx.device == "cuda" and graphs_per_run(p):
                # the graph launch's wait at a second first segment (graph_launch.fit_wait)
                step = ctx.measure(p, ws).meta.get("graph_replay_step_time_us")
            runs.append(CalibrationRun(p, rec.executor_trace, rec.kernels, step, f"serial {s}",
                                       host, serial_run if s == size else None))  # fmt: skip
            kept.append({"schedule": "serial", "size": s, "half": s != size,
                         "replay_step_us": step, "host_launch_us": host,
                         "files": archive.keep_run(f"{key}/calibration", f"serial_{s}", rec)})  # fmt: skip
        profile, setup, info = calibrate(ctx.setup, runs, mode)
    except Exception as e:  # no profile, no prediction: the case is reported, the loop goes on
        case["error"] = f"calibration failed: {type(e).__name__}: {e}"[:500]
        saved()
        return case
    case["calibration_seconds"] = round(time.time() - t, 1)
    case["calibration_runs"] = kept
    case.update(info)
    case_dir = archive.work / key
    for name in names:
        if time.time() > deadline:
            case["runs"][name] = {"skipped": "time budget spent"}
            continue
        t = time.time()
        files = {}
        try:
            comm = name == COMM_ONLY
            wv = w if comm else workload_variants(name, w)[0]
            prog = build(setup, name, wv)
            if name == S.BASELINE and serial_run is not None:
                meas = serial_run
            else:
                meas = ctx.measure(prog, wv)
            own = replayed = kernels = None
            if ctx.device == "cuda":  # a short run under the profiler: the replay's timeline,
                rec = ctx.record(prog, wv, warmup=1, repeats=1)  # and own rows' device time
                own = rec.trace
                replayed = run_timeline(rec.executor_trace, rec.kernels, graphs_per_run(prog))
                kernels = rec.kernels
                files["recorded"] = archive.keep_run(key, f"{name}.recorded", rec)
            run, pred = judge(setup, name, wv, meas, profile, own, replayed, kernels)
        except Exception as e:  # recorded; the next schedule goes on
            case["runs"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(f"  {key} {name}: {case['runs'][name]['error'][:200]}", flush=True)
            saved()
            continue
        run.update(comparable=not_comparable(name) is None, note=not_comparable(name),
                   seconds=round(time.time() - t, 1))  # fmt: skip
        files["measured"] = f"{key}/{name}.measured.trace.json.gz"
        run["files"] = files
        case["runs"][name] = run
        pred.to_chrome(case_dir / f"{name}.predicted.trace.json.gz")
        meas.to_chrome(archive.work / files["measured"])
        figure(ctx, {f"{name} predicted": pred, f"{name} measured": meas},
               case_dir / f"{name}.png", run)  # fmt: skip
        st = run["comparison"]["step_time_us"]
        print(f"  {key} {name}: predicted {st['predicted']:.1f} us, measured "
              f"{st['measured']:.1f} us ({run['measured_step_source']})", flush=True)  # fmt: skip
        saved()
    return case


def run_validation(opts) -> dict:
    """The whole loop; returns the report (also packed with everything into the archive)."""
    t0 = time.time()
    deadline = t0 + opts.budget_s
    if opts.device == "cpu":  # the tiny model's tensors: threads would only add waiting
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return _run_validation(opts, t0, deadline)
        finally:
            torch.set_num_threads(threads)
    return _run_validation(opts, t0, deadline)


def _run_validation(opts, t0: float, deadline: float) -> dict:
    from overlap_lab.shared import schedules as S

    env = environment(opts.device)
    if opts.gpu is None:
        opts.gpu = device_preset(env["device"]) if opts.device == "cuda" else "h100"
    report: dict = {
        "environment": env,
        "preset": opts.gpu,
        "model": opts.model,
        "layers": opts.layers,
        "ep": opts.ep,
        "kv_len": opts.kv_len,
        "seed": opts.seed,
        "backend": "emulated (single-GPU emulation of DeepEP; not DeepEP)",
        "timing_meaningful": opts.device == "cuda",
        "commands": opts.argv,
    }
    if opts.device == "cpu":
        report["note"] = "dry run: the same path on the CPU; timings are meaningless"
    archive = Archive(Path(opts.out), opts.name)
    cases: dict = {}
    report["cases"] = cases

    def save(final: bool) -> None:
        """The report, summarised and judged, into the archive: after every schedule (a command
        killed at its time limit still leaves what it measured) and once at the end."""
        report["complete"] = final
        report["summary"] = summarize(cases)
        report["verdict"] = verdict(cases)
        report["seconds"] = round(time.time() - t0, 1)
        archive.write(report, final=final)

    try:
        report["pytest_gpu"] = (
            run_pytest(opts.pytest_timeout_s, Path(opts.out) / f"{opts.name}.pytest.log")
            if opts.pytest
            else {"status": "not run"}
        )
        deadline += report["pytest_gpu"].get("seconds", 0.0)  # the budget is the schedules'
        save(False)
        try:
            ctx = Context(opts, env)
        except Exception as e:  # weights that do not fit, say: reported in the archive
            report["error"] = f"setup failed: {type(e).__name__}: {e}"[:500]
            save(True)
            report.update(archive=str(archive.path), table=table(report))
            return report
        report["precision"] = ctx.precision
        names = opts.schedules.split(",") if opts.schedules else [*S.available(), COMM_ONLY]
        sizes = {"decode": [int(b) for b in str(opts.batches).split(",") if b],
                 "prefill": [int(opts.prefill)]}  # fmt: skip
        for mode in opts.modes.split(","):
            for size in sizes[mode]:
                key = f"{mode}_{size}"
                if time.time() > deadline:
                    cases[key] = {"skipped": "time budget spent", "runs": {}}
                    continue
                run_case(ctx, mode, size, names, archive, deadline, cases, key,
                         lambda: save(False))  # fmt: skip
                print(f"{key}: {len(cases[key]['runs'])} schedules, "
                      f"{time.time() - t0:.0f} s so far", flush=True)  # fmt: skip
        save(True)
        report["archive"] = str(archive.path)
        report["table"] = table(report)
        report["results"] = write_results(report, opts)
        if opts.kernels:
            report["results"] += write_kernel_table(report, opts)
    finally:
        archive.close()
    return report


def parse(argv: list[str] | None = None):
    p = argparse.ArgumentParser(
        prog="python -m overlap_lab.experiments.gpu_validation", description=DESCRIPTION
    )
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--replay", metavar="ARCHIVE", default=None,
                   help="re-judge a recorded archive offline: every schedule predicted again "
                   "with today's simulator (no GPU; --out, --name: where its archive goes)")  # fmt: skip
    p.add_argument("--modes", default="decode,prefill")
    p.add_argument("--batches", default=None, help="decode batch sizes (GPU: 32,128)")
    p.add_argument("--prefill", type=int, default=None, help="prefill tokens (GPU: 4096)")
    p.add_argument("--schedules", default=None, help="default: every available schedule")
    p.add_argument("--model", default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--ep", type=int, default=None)
    p.add_argument("--kv-len", dest="kv_len", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None, help="timed runs (GPU: 5, CPU: 1)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up runs (GPU: 2, CPU: 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gemm-dtype", dest="gemm_dtype", choices=("model", "bf16"), default="model",
                   help="GEMM precision of both sides: the model's where the executor can run "
                   "it (DeepSeek-V3: FP8 through DeepGEMM), or BF16")  # fmt: skip
    p.add_argument(
        "--gpu", default=None, help="shared.inputs.hardware preset (default: from the name)"
    )
    p.add_argument("--budget-s", type=float, default=540.0)
    p.add_argument(
        "--pytest",
        action="store_true",
        help="run the GPU tests first (their log beside the archive; DeepGEMM's JIT "
        "test last; not counted in --budget-s)",
    )
    p.add_argument("--pytest-timeout-s", type=float, default=150.0)
    p.add_argument("--link-bytes", dest="link_bytes", choices=("program", "routing"),
                   default="program",
                   help="bytes the emulated link times: the Program's flows (the simulator's, "
                   "default) or this run's routing")  # fmt: skip
    p.add_argument("--kernels", action="store_true",
                   help="also write the kernel table (overlap-lab kernels) as "
                   "kernels_<device>.{json,md} beside the results")  # fmt: skip
    p.add_argument("--no-figures", action="store_true")
    p.add_argument("--results", default=None,
                   help="folder for gpu_<device>.{json,md} (default: experiments/results on a "
                   "GPU; a dry run writes them only here)")  # fmt: skip
    p.add_argument("--out", default=str(ROOT / "overlap-lab-out" / "gpu_validation"))
    p.add_argument(
        "--name", default=None, help="archive name (default gpu_validation_<dev>_<modes>)"
    )
    opts = p.parse_args(argv)
    opts.out_given = any(a == "--out" or a.startswith("--out=") for a in (argv or sys.argv[1:]))
    opts.name_given = opts.name
    defaults = GPU_DEFAULTS if opts.device == "cuda" else CPU_DEFAULTS
    for k, v in defaults.items():
        if getattr(opts, k) is None:
            setattr(opts, k, v)
    if opts.name is None:
        opts.name = f"gpu_validation_{opts.device}_{opts.modes.replace(',', '-')}"
    opts.argv = ["python -m overlap_lab.experiments.gpu_validation", *(argv or sys.argv[1:])]
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    if opts.replay:
        return main_replay(opts)
    from overlap_lab.real.deps import no_device

    why = no_device(opts.device)
    if why is not None:
        print(NO_GPU + ("" if why.startswith("no CUDA") else f" ({why})"))
        return 2
    report = run_validation(opts)
    print(report["table"].rstrip("\n").rpartition("\n")[0])  # the verdict goes last
    print(f"wrote {report['archive']}" + "".join(f", {f}" for f in report.get("results") or ()))
    bad = [
        f"{k}/{n}" for k, c in report["cases"].items() for n, r in c["runs"].items() if "error" in r
    ]
    if bad:
        print(f"errors in: {', '.join(bad)} (see results.json in the archive)")
    if report.get("kernels_goal"):
        print(f"kernels: {report['kernels_goal']}")
    dry = not report["timing_meaningful"]
    if report.get("merged_verdict"):  # this run's cases, then every case of the results file
        print("this run: " + verdict_line(report["verdict"], dry_run=dry))
        print(f"all cases of {report['results'][0]}:")
        print(verdict_line(report["merged_verdict"], dry_run=dry))
    else:
        print(verdict_line(report["verdict"], dry_run=dry))
    pyt = report["pytest_gpu"].get("status")
    return 0 if not bad and pyt in ("ok", "not run") else 1


def main_replay(opts) -> int:
    """``--replay ARCHIVE``: the table of the archive predicted again, the verdict last."""
    from overlap_lab.experiments.gpu_validation.replay import replay
    from overlap_lab.shared.errors import ConfigError

    try:
        report = replay(opts.replay, opts.out if opts.out_given else None, opts.name_given)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    print(report["table"].rstrip("\n").rpartition("\n")[0])
    if report.get("archive"):
        print(f"wrote {report['archive']}")
    print(verdict_line(report["verdict"], dry_run=not report["timing_meaningful"]))
    return 0
