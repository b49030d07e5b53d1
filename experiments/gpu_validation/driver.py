"""The loop itself: each case calibrated, every schedule predicted, measured and compared
(:func:`run_case`), the whole written into one archive after every schedule
(:func:`run_validation`), and the command line (:func:`parse`, :func:`main`)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from overlap_lab.experiments.gpu_validation.archive import Archive
from overlap_lab.experiments.gpu_validation.comm_only import COMM_ONLY, comm_only, comm_program
from overlap_lab.experiments.gpu_validation.context import Context
from overlap_lab.experiments.gpu_validation.environment import (
    ROOT,
    device_preset,
    environment,
    run_pytest,
)
from overlap_lab.experiments.gpu_validation.predict import (
    calibrate_profile,
    comparison,
    measured_step,
    own_rows,
    predict,
    prediction_workload,
    roofline_ops,
)
from overlap_lab.experiments.gpu_validation.report import (
    figure,
    table,
    write_kernel_table,
    write_results,
)
from overlap_lab.experiments.gpu_validation.verdict import summarize, verdict, verdict_line

DESCRIPTION = "Predicted vs measured on one device, in one command per mode."
NO_GPU = "gpu_validation: no CUDA GPU found; nothing was run (--device cpu for the dry run)"
NOT_COMPARABLE = {
    "comm-only": "dispatch and combine alone (the link model on both sides; target: within "
    "5 %): not a schedule, excluded from the error medians and the ranking",
}
#: why a schedule that runs pipeline stages (``schedules.supports_pp``) is not judged here
PIPELINE_NOTE = (
    "{name} runs every pipeline stage in one process on one GPU: not comparable with a "
    "one-stage-per-GPU prediction; excluded from the error medians and the ranking"
)


def not_comparable(name: str) -> str | None:
    """Why ``name``'s measurement is excluded from the verdict (None: it is judged)."""
    from overlap_lab.shared import schedules as S

    if name in NOT_COMPARABLE:
        return NOT_COMPARABLE[name]
    return PIPELINE_NOTE.format(name=name) if S.supports_pp(name) else None


CPU_DEFAULTS = dict(model="tiny-mla", layers=3, ep=2, batches="4,8", prefill=24, kv_len=64)
GPU_DEFAULTS = dict(
    model="deepseek-v3", layers=4, ep=32, batches="32,128", prefill=4096, kv_len=2048
)


def run_case(ctx: Context, mode: str, size: int, names: list[str], work: Path, deadline: float,
             cases: dict, key: str, saved=lambda: None) -> dict:  # fmt: skip
    """Calibrate, predict, measure and compare every schedule on one workload; the case is
    ``cases[key]`` from the start, and ``saved()`` runs after every schedule."""
    from overlap_lab.real.check import workload_variants
    from overlap_lab.shared import schedules as S

    w = ctx.workload(mode, size)
    calib = []
    sizes = sorted({size, max(1, size // 2)}, reverse=True)
    t = time.time()
    case = cases[key] = {
        "workload": {"mode": mode, "tokens": w.batch.num_tokens, "sizes_calibrated": sizes},
        "runs": {},
    }
    try:
        for s in sizes:  # isolated op durations at the token counts the schedules run
            ws = ctx.workload(mode, s, half=s != size)
            p = S.build("serial", ws, ctx.gpu)
            calib.append((p, ctx.measure(p, ws, device_time=True)))
        profile = calibrate_profile(ctx, calib, mode)
    except Exception as e:  # no profile, no prediction: the case is reported, the loop goes on
        case["error"] = f"calibration failed: {type(e).__name__}: {e}"[:500]
        saved()
        return case
    case["calibration_seconds"] = round(time.time() - t, 1)
    case["profile_rows"] = len(profile.rows)
    dt = [tr.meta.get("device_time") for _, tr in calib]
    case["calibration_durations"] = (
        "kernel device time (torch.profiler records mapped to ops; graph replays where the op "
        "ran in one)"
        if all(dt)
        else "CUDA-event / host spans (no kernel records on this device)"
    )
    case["calibration_device_time"] = dt
    case_dir = work / f"{mode}_{size}"
    case_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        if time.time() > deadline:
            case["runs"][name] = {"skipped": "time budget spent"}
            continue
        t = time.time()
        try:
            comm = name == COMM_ONLY
            wv = w if comm else workload_variants(name, w)[0]
            prog = comm_program(wv, ctx.gpu) if comm else S.build(name, wv, ctx.gpu)
            meas = ctx.measure(prog, wv)
            wp = prediction_workload(wv, meas.meta)
            prof, own = own_rows(ctx, name, profile, prog, wv, meas)
            pred, sources = predict(ctx, "serial" if comm else name, wp, prof,
                                    transform=comm_only if comm else None)  # fmt: skip
            missing = roofline_ops(
                ctx, comm_program(wp, ctx.gpu) if comm else S.build(name, wp, ctx.gpu), prof
            )
        except Exception as e:  # recorded; the next schedule goes on
            case["runs"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(f"  {key} {name}: {case['runs'][name]['error'][:200]}", flush=True)
            saved()
            continue
        step_m, source = measured_step(meas)
        m = meas.meta
        case["runs"][name] = {
            "comparison": comparison(meas, pred, step_m),
            "measured_step_source": source,
            "eager_step_time_us": m.get("eager_step_time_us", m.get("median_step_time_us")),
            "step_times_us": m.get("step_times_us"),
            "cuda_graphs": m.get("cuda_graphs"),
            "sm_budget_mechanisms": m.get("sm_budget_mechanisms"),
            "sm_limits": m.get("sm_limits"),
            "kernel_notes": m.get("kernel_notes"),
            "attention_kernels": m.get("attention_kernels"),
            "gemm_precision": m.get("gemm_precision"),
            "predicted_gemm_dtype": wp.model.gemm_dtype,
            "deep_gemm_errors": m.get("deep_gemm_errors"),
            "cost_sources": sources,
            "rows_from_own_run": own,
            "roofline_ops": missing,
            "comparable": not_comparable(name) is None,
            "note": not_comparable(name),
            "seconds": round(time.time() - t, 1),
        }
        pred.to_chrome(case_dir / f"{name}.predicted.trace.json.gz")
        meas.to_chrome(case_dir / f"{name}.measured.trace.json.gz")
        figure(ctx, {f"{name} predicted": pred, f"{name} measured": meas},
                case_dir / f"{name}.png", case["runs"][name])  # fmt: skip
        st = case["runs"][name]["comparison"]["step_time_us"]
        print(f"  {key} {name}: predicted {st['predicted']:.1f} us, measured "
              f"{st['measured']:.1f} us ({source})", flush=True)  # fmt: skip
        saved()
    return case


def run_validation(opts) -> dict:
    """The whole loop; returns the report (also packed with everything into the archive)."""
    from overlap_lab.shared import schedules as S

    t0 = time.time()
    deadline = t0 + opts.budget_s
    env = environment(opts.device)
    if opts.gpu is None:
        opts.gpu = device_preset(env["device"]) if opts.device == "cuda" else "h100"
    report: dict = {
        "environment": env,
        "preset": opts.gpu,
        "model": opts.model,
        "layers": opts.layers,
        "ep": opts.ep,
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
            run_pytest(opts.pytest_timeout_s) if opts.pytest else {"status": "not run"}
        )
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
                run_case(ctx, mode, size, names, archive.work, deadline, cases, key,
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
    p.add_argument("--modes", default="decode,prefill")
    p.add_argument("--batches", default=None, help="decode batch sizes (GPU: 32,128)")
    p.add_argument("--prefill", type=int, default=None, help="prefill tokens (GPU: 4096)")
    p.add_argument("--schedules", default=None, help="default: every available schedule")
    p.add_argument("--model", default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--ep", type=int, default=None)
    p.add_argument("--kv-len", dest="kv_len", type=int, default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--gpu", default=None, help="shared.inputs.hardware preset (default: from the name)"
    )
    p.add_argument("--budget-s", type=float, default=540.0)
    p.add_argument("--pytest", action="store_true", help="run the GPU tests first")
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
