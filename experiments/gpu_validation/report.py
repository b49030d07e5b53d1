"""What the loop writes: the predicted-vs-measured table, the figures, and the results files
``gpu_<device>.{json,md}`` (merged with an earlier command's cases of the same setup) and
``kernels_<device>.{json,md}``."""

from __future__ import annotations

import json
from pathlib import Path

from overlap_lab.experiments.gpu_validation.comm_only import COMM_ONLY
from overlap_lab.experiments.gpu_validation.environment import ROOT
from overlap_lab.experiments.gpu_validation.predict import sources_text
from overlap_lab.experiments.gpu_validation.verdict import summarize, verdict, verdict_line


def table(report: dict) -> str:
    """The predicted-vs-measured table (markdown)."""
    lines = []
    if not report["timing_meaningful"]:
        lines.append("**DRY RUN on the CPU: times are host wall-clock of a scaled-down model; "
                     "they mean nothing about a GPU.**\n")  # fmt: skip
    env = report["environment"]
    rp = report.get("replay")
    if rp:
        lines.append(f"**REPLAY of {rp['archive']}** (recorded at commit "
                     f"{str(rp.get('recorded_commit'))[:10]}): every schedule predicted again by "
                     f"today's calibration and simulator (commit {str(rp.get('commit'))[:10]}); "
                     "the measured side as recorded.\n")  # fmt: skip
    lines.append(f"device {env.get('device')}, preset {report['preset']}, model {report['model']}"
                 f" ({report['layers']} layers, EP {report['ep']} emulated), "
                 f"commit {str(env.get('commit'))[:10]}\n")  # fmt: skip
    gp = (report.get("precision") or {}).get("gemm")
    if gp:
        lines.append(f"GEMMs on both sides: {gp['executor_and_simulator']} (model "
                     f"{gp['model']}; {gp['reason']})\n")  # fmt: skip
    lines.append("| case | schedule | step pred (µs) | step meas (µs) | source | err | "
                 "exposed comm pred/meas (µs) | per-op median abs err | predicted durations "
                 "from (per op class) | note |")  # fmt: skip
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    if report.get("error"):
        lines.insert(0, f"**{report['error']}**\n")
    if not report.get("complete", True):
        lines.insert(0, "**INCOMPLETE: written while the loop was still running.**\n")
    for key, case in report["cases"].items():
        if case.get("error") or case.get("skipped"):
            lines.append(f"| {key} | | | | | | | | | {case.get('error') or case.get('skipped')} |")
        for name, r in case["runs"].items():
            if "comparison" not in r:
                lines.append(
                    f"| {key} | {name} | | | | | | | | {r.get('error') or r.get('skipped')} |"
                )
                continue
            c = r["comparison"]
            st, ex = c["step_time_us"], c["exposed_comm_us"]
            err = st["rel_error"]
            po = c["per_op_median_abs_rel_error"]
            lines.append(
                f"| {key} | {name} | {st['predicted']:.1f} | {st['measured']:.1f} | "
                f"{r['measured_step_source']} | {'' if err is None else f'{err:+.1%}'} | "
                f"{ex['predicted']:.1f} / "
                f"{ex['measured']:.1f} | {'' if po is None else f'{po:.1%}'} | "
                f"{sources_text(r['cost_sources'])}{_rows_text(r)} | "
                f"{_note(name, r)} |"
            )
    lines.append("")
    for key, case in report["cases"].items():
        if case.get("calibration_durations"):
            gap = case.get("graph_kernel_gap_us") or {}
            wait = case.get("graph_launch_us") or {}
            host = case.get("host_launch_us") or {}
            lines.append(f"- {key}: profile rows from {case['calibration_durations']}"
                         + (f"; graph gap {gap['us']:.3f} µs per kernel ({gap['source']})"
                            if gap else "")
                         + (f"; graph launch {wait['us']:.1f} µs per replay ({wait['source']})"
                            if wait else "")
                         + _unprofiled_text(wait.get("unprofiled"))
                         + (f"; eager launches: each op's host steps {host['source']}"
                            if host.get("ops") else ""))  # fmt: skip
    for key, s in report.get("summary", {}).items():
        lines.append(f"- {key}: median |step error| {s['median_abs_step_error']:.1%}; ranking "
                     f"{'the same' if s['same_ranking'] else 'DIFFERS'} (predicted "
                     f"{', '.join(s['ranking_predicted'])}; measured "
                     f"{', '.join(s['ranking_measured'])})")  # fmt: skip
    if report.get("verdict"):
        lines += ["", verdict_line(report["verdict"], dry_run=not report["timing_meaningful"])]
    return "\n".join(lines) + "\n"


def _note(name: str, r: dict) -> str:
    if r["comparable"]:
        return ""
    return "comm only: target within 5 %" if name == COMM_ONLY else "excluded: one GPU"


def _unprofiled_text(u: dict | None) -> str:
    """serial's unprofiled replays as recorded (``graph_launch.unprofiled_launch``)."""
    if not u:
        return ""
    got = [
        f"{k.replace('_us', '').replace('_', ' ')} {v:.1f} µs"
        for k, v in u.items()
        if v is not None
    ]
    return f"; serial's unprofiled replays: {', '.join(got)}" if got else ""


def _rows_text(r: dict) -> str:
    """Which classes took rows measured in the schedule's own run, and which ops the roofline
    still times (the validation's gaps)."""
    own = ", ".join(c if n == [c] else f"{c} ({', '.join(n)})"
                    for c, n in (r.get("rows_from_own_run") or {}).items())  # fmt: skip
    own = f"rows from its own run: {own}" if own else ""
    roof = r.get("roofline_ops")
    wait = r.get("graph_launch_us") or {}
    seg = wait.get("first_segment")
    wait = f"graph launch {wait['us']:.1f} µs ({seg} records to its first memset)" if seg else ""
    return ((f"; {own}" if own else "") + (f"; {wait}" if wait else "")
            + (f"; ROOFLINE: {', '.join(roof)}" if roof else ""))  # fmt: skip


def step_figure(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        return
    cases = [(k, c) for k, c in report["cases"].items() if c["runs"]]
    if not cases:
        return
    fig, axes = plt.subplots(len(cases), 1, figsize=(9, 2.6 * len(cases)), squeeze=False)
    for ax, (key, case) in zip(axes[:, 0], cases, strict=True):
        names = [n for n, r in case["runs"].items() if "comparison" in r]
        p = [case["runs"][n]["comparison"]["step_time_us"]["predicted"] for n in names]
        m = [case["runs"][n]["comparison"]["step_time_us"]["measured"] for n in names]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], p, 0.4, label="predicted")
        ax.bar([x + 0.2 for x in xs], m, 0.4, label="measured")
        ax.set_xticks(list(xs), names, fontsize=7)
        ax.set_ylabel("step (µs)")
        ax.set_title(key + ("" if report["timing_meaningful"] else "  (CPU dry run)"), fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def figure(ctx, traces, path, rec) -> None:
    if ctx.opts.no_figures:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt

        from overlap_lab.figures import compare_timelines

        plt.close(compare_timelines(traces, path))
    except Exception as e:  # a figure never fails the run; the reason is kept
        rec["figure_error"] = f"{type(e).__name__}: {e}"[:200]


def results_stem(report: dict) -> str:
    """``gpu_<device>``: the device's preset (``cpu`` for a dry run), ``_fp8`` where the GEMMs
    ran FP8 (a BF16 and an FP8 loop on one device keep both files)."""
    dev = report["preset"] if report["timing_meaningful"] else "cpu"
    gp = ((report.get("precision") or {}).get("gemm") or {}).get("executor_and_simulator")
    return f"gpu_{dev}" + ("_fp8" if gp == "fp8" else "")


def write_results(report: dict, opts) -> list[str]:
    """``<results>/gpu_<device>.{json,md}`` (results.json and table.md of the archive): by
    default only for a GPU run (into experiments/results); a dry run writes them only where
    ``--results`` says."""
    if opts.results is None and not report["timing_meaningful"]:
        return []
    d = Path(opts.results) if opts.results else ROOT / "experiments" / "results"
    d.mkdir(parents=True, exist_ok=True)
    stem = results_stem(report)
    keep = {k: v for k, v in report.items() if k not in ("table", "archive", "results")}
    js, md = d / f"{stem}.json", d / f"{stem}.md"
    keep = merged(keep, js)
    if keep.get("merged_commands"):  # the verdict over every case of the file
        report["merged_verdict"] = keep["verdict"]
    js.write_text(json.dumps(keep, indent=2, sort_keys=True, default=str) + "\n")
    md.write_text(table(keep))
    return [str(js), str(md)]


def merged(report: dict, path: Path) -> dict:
    """``report`` with the cases of an earlier results file of the same device, model and
    precision that this run did not measure (one command per mode fills one file); the summary
    and the verdict are recomputed over all of them. A file of another setup is replaced."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return report
    same = ("preset", "model", "layers", "ep", "timing_meaningful")
    if any(old.get(k) != report.get(k) for k in same) or (old.get("precision") or {}).get(
        "gemm"
    ) != (report.get("precision") or {}).get("gemm"):
        return report
    cases = {**{k: v for k, v in old.get("cases", {}).items()}, **report["cases"]}
    if cases.keys() == report["cases"].keys():
        return report
    out = dict(report, cases=cases, summary=summarize(cases), verdict=verdict(cases))
    out["merged_commands"] = [*(old.get("merged_commands") or [old.get("commands")]),
                              report.get("commands")]  # fmt: skip
    return out


def write_kernel_table(report: dict, opts) -> list[str]:
    """``--kernels``: ``overlap-lab kernels``' table for this device (``real.kernel_table``)
    into ``<results>/kernels_<device>.{json,md}``; its goal line is kept in the report."""
    from overlap_lab.real.kernel_table import kernel_table, table_text

    kt = kernel_table(opts.device)
    text = table_text(kt)
    report["kernels_goal"] = text.rstrip().rpartition("\n")[2]
    if opts.results is None and not report["timing_meaningful"]:
        return []
    d = Path(opts.results) if opts.results else ROOT / "experiments" / "results"
    d.mkdir(parents=True, exist_ok=True)
    stem = "kernels" + results_stem(report)[3:]  # kernels_<device>[_fp8]: deep_gemm loaded
    js, md = d / f"{stem}.json", d / f"{stem}.md"
    js.write_text(json.dumps(kt, indent=2, sort_keys=True) + "\n")
    md.write_text(text)
    return [str(js), str(md)]
