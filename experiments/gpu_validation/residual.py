"""What a replay of a recording from an older executor leaves, per schedule, and why:
``python -m overlap_lab.experiments.gpu_validation.residual ARCHIVE [--out FILE.md]``.

A replay (``replay``) predicts a recorded run with today's calibration and simulator; where the
recording's executor differs from today's, the difference shows in the errors. This script
replays ARCHIVE (a converted recording, ``convert``) and attributes what is left to the
recording's executor, with the numbers:

- compute: per calibration run with kernel records, each compute op's predicted duration
  against its recorded device time (they must agree: the calibration is those records);
- communication: the recording's emulated backend ran its data path on the measured stream
  after the modelled flight and without the channel bound (today it counts the flight from the
  op's start and holds a normal kernel by its channels: ``shared.ir.links``). Where the step is
  a graph replay (decode), each comm op's recorded device time less its predicted span, per op
  and micro-batch count, from the kernel records, added up over the schedule's comm ops (the
  recorded decode graphs run every op on one stream, so it adds to the step); where the step
  is the eager pass (prefill), the measured exposed communication less the predicted;
- own rows from eager spans: a schedule whose split ops took rows from its measured run (the
  recording kept no kernel records of it) is timed by CUDA-event spans, which hold launch gaps;
  their sum is listed beside the same work in the calibration (serial's unsplit ``experts``).

The per-schedule error without the communication difference is ``(predicted + difference) /
measured - 1``: an attribution, not a prediction (docs/validation.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tarfile
import tempfile
from collections import defaultdict
from pathlib import Path

from overlap_lab.experiments.gpu_validation.replay import replay

COMM = ("dispatch_a", "dispatch_b", "combine_a", "combine_b")


def _stream_us(trace, steps: bool = False) -> dict[tuple, float]:
    """Per (op, layer, mb[, step]) its spans' time on the trace's first rank."""
    out: dict[tuple, float] = defaultdict(float)
    first = trace.ranks[0] if trace.ranks else 0
    for s in trace.spans:
        if s.lane.startswith("stream:") and s.rank == first:
            out[(s.op, s.layer, s.mb, s.step) if steps else (s.op, s.layer, s.mb)] += s.duration
    return out


def _mbs(trace) -> int:
    return len({s.mb for s in trace.spans if s.op == "dispatch_a"}) or 1


def split_experts(measured_file: Path, experts: dict, mbs: int) -> tuple[float, float] | None:
    """A schedule that splits the experts (``experts.*`` ops: SBO, LightLLM): their measured
    spans summed, and the calibration's device time of the unsplit ``experts`` of the same
    layers and micro-batches (``experts``: {(micro-batches, layer, mb): µs}); None for a
    schedule that does not split them or whose work the calibration did not record."""
    from overlap_lab.shared.outputs.trace import Trace

    spans = {k: v for k, v in _stream_us(Trace.from_chrome(measured_file)).items()
             if k[0].startswith("experts.")}  # fmt: skip
    if not spans:
        return None
    same = [experts.get((mbs, layer, mb)) for layer, mb in {(k[1], k[2]) for k in spans}]
    if not same or any(v is None for v in same):
        return None
    return sum(spans.values()), sum(same)


def explain(path: str | Path) -> dict:
    """The replay of ``path`` and, per case, the attribution of the module docstring."""
    from overlap_lab.device_time import load_chrome, map_kernels, op_device_us
    from overlap_lab.shared.outputs.trace import Trace

    with tempfile.TemporaryDirectory() as d:
        report = replay(path, out=d)
        with tarfile.open(report["archive"]) as tar:
            tar.extractall(d, filter="data")
        with tarfile.open(path) as tar:
            tar.extractall(Path(d) / "recorded", filter="data")
        pred_root = next(p for p in Path(d).iterdir() if p.is_dir() and p.name != "recorded")
        rec_root = next((Path(d) / "recorded").iterdir())
        out = {"report": report, "cases": {}}
        for key, case in report["cases"].items():
            gap = (case.get("graph_kernel_gap_us") or {}).get("us", 0.0)
            preds = {n: Trace.from_chrome(pred_root / key / f"{n}.predicted.trace.json.gz")
                     for n, r in case["runs"].items() if "comparison" in r}  # fmt: skip
            compute, excess, experts = {}, defaultdict(list), {}
            for e in case.get("calibration_runs", ()):
                name, kfile = e["schedule"], e["files"].get("kernels")
                if not kfile or name not in preds:
                    continue
                dev = op_device_us(map_kernels(load_chrome(rec_root / kfile)), gap)
                pred = _stream_us(preds[name])
                rec_c = sum(t for k, t in dev.items() if k[0] not in COMM and k in pred)
                pre_c = sum(pred[k] for k in dev if k[0] not in COMM and k in pred)
                compute[name] = (pre_c, rec_c)
                for k, t in dev.items():
                    if k[0] in COMM:
                        excess[(k[0], _mbs(preds[name]))].append(t - pred.get(k, 0.0))
                    elif k[0] == "experts":
                        experts[(_mbs(preds[name]), k[1], k[2])] = t
            per = {k: statistics.mean(v) for k, v in excess.items()}
            rows = {}
            for name, r in sorted(case["runs"].items()):
                if "comparison" not in r:
                    continue
                st, ex = r["comparison"]["step_time_us"], r["comparison"]["exposed_comm_us"]
                if r["measured_step_source"] == "graph replay":
                    n = _mbs(preds[name])
                    n = min((m for _, m in per), key=lambda m: abs(m - n)) if per else n
                    diff = sum(
                        per.get((k[0], n), 0.0)
                        for k in _stream_us(preds[name], steps=True)
                        if k[0] in COMM
                    )
                    how = "recorded comm kernels less predicted spans"
                else:
                    diff = ex["measured"] - ex["predicted"]
                    how = "measured exposed comm less predicted"
                own = sorted({o for v in (r.get("rows_from_own_run") or {}).values() for o in v})
                split = split_experts(rec_root / r["files"]["measured"], experts, _mbs(preds[name]))
                rows[name] = {
                    "predicted_us": st["predicted"], "measured_us": st["measured"],
                    "error": st["rel_error"], "comm_difference_us": diff, "comm_method": how,
                    "error_without_comm_difference": (st["predicted"] + diff) / st["measured"] - 1,
                    "own_rows": own, "own_rows_from": r.get("own_run_durations"),
                    "split_experts_us": split,
                    "comparable": r["comparable"],
                }  # fmt: skip
            out["cases"][key] = {"compute": compute, "comm_excess_per_op": per, "runs": rows}
        return out


def text(x: dict) -> str:
    """The attribution as markdown (one table per case)."""
    lines = []
    for key, c in x["cases"].items():
        lines += [f"### {key}", ""]
        for name, (p, m) in c["compute"].items():
            lines.append(f"- {name}'s compute ops: predicted {p:,.1f} µs, recorded device time "
                         f"{m:,.1f} µs ({p / m - 1:+.2%})")  # fmt: skip
        for (op, n), v in sorted(c["comm_excess_per_op"].items()):
            lines.append(f"- recorded {op} beyond today's link model, {n} micro-batch(es): "
                         f"{v:+,.1f} µs per op")  # fmt: skip
        lines += [
            "",
            "| schedule | predicted (µs) | measured (µs) | error | comm difference "
            "(µs) | error without it | own rows (from) | split experts: measured spans / "
            "unsplit device time (µs) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, r in c["runs"].items():
            own = f"{len(r['own_rows'])} ops ({r['own_rows_from']})" if r["own_rows"] else ""
            sp = r["split_experts_us"]
            split = f"{sp[0]:,.0f} / {sp[1]:,.0f}" if sp else ""
            note = "" if r["comparable"] else " (excluded: one GPU)"
            lines.append(
                f"| {name}{note} | {r['predicted_us']:,.1f} | {r['measured_us']:,.1f} | "
                f"{r['error']:+.1%} | {r['comm_difference_us']:+,.1f} | "
                f"{r['error_without_comm_difference']:+.1%} | {own} | {split} |"
            )
        methods = sorted({r["comm_method"] for r in c["runs"].values()})
        lines += ["", f"comm difference: {'; '.join(methods)}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m overlap_lab.experiments.gpu_validation.residual",
                                description=__doc__.splitlines()[0])  # fmt: skip
    p.add_argument("archive")
    p.add_argument("--out", default=None, help="write the markdown here too")
    opts = p.parse_args(argv)
    x = explain(opts.archive)
    body = x["report"]["table"] + "\n" + text(x)
    print(body)
    if opts.out:
        Path(opts.out).write_text(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
