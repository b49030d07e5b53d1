"""What ``sim`` and ``compare`` print and write, for the command line and a notebook alike: one
run's summary in words (:func:`summary`), the files a run or a comparison writes into a folder
(:func:`write_run`, :func:`write_comparison`: the Chrome/Perfetto trace with its provenance, the
timeline, the stacked comparison, the sensitivity ranges; ``analyze``'s timeline of a measured
trace), the CPU check's and a measured run's results in words, and strict JSON
(:func:`to_json`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from overlap_lab.shared.errors import ConfigError


def summary(res: Mapping[str, Any]) -> str:
    """``sim``'s summary of one run in words, from its JSON (``Result.as_dict``)."""
    lines = []
    say = lines.append
    stages = res["gpus"] // res["ep"]  # pipeline stages of EP-sized groups of GPUs
    say(
        f"{res['schedule']}: {res['model']} {res['mode']} on {res['gpu']}, "
        f"{res['batch']} seqs ({res['tokens']} tokens) per GPU, EP {res['ep']}"
        + (f", PP {stages} ({res['gpus']} GPUs)" if stages > 1 else "")
    )
    it = res["iterations"]
    per = f" per iteration ({it} simulated)" if it > 1 else ""
    say(f"  step time        {res['iteration_us'] / 1e3:10.3f} ms{per}")
    say(f"  throughput       {res['tokens_per_s_gpu']:10.0f} tokens/s per GPU")
    say(f"  communication    {res['comm_us'] / 1e3:10.3f} ms{per}")
    say(f"  exposed comm     {res['exposed_comm_us'] / 1e3:10.3f} ms{per}")
    say(
        f"  SM time          {res['sm_compute'] * 100:9.1f} % compute, "
        f"{res['sm_comm'] * 100:.1f} % comm, {res['sm_idle'] * 100:.1f} % idle"
    )
    say(f"  ops              {res['num_ops']:10d}")
    if "cost_sources" in res:  # where the durations come from: a measurement or the roofline
        n: dict[str, int] = {}
        for by in res["cost_sources"].values():
            for s, k in by.items():
                n[s] = n.get(s, 0) + k
        measured = f"{n['profile']} from profile {res['profile']}, " if n.get("profile") else ""
        if n.keys() <= {"profile", "roofline", "link"}:
            say(
                f"  op durations     {measured}{n.get('roofline', 0)} from the roofline "
                f"(no measurement), {n.get('link', 0)} from the link model"
            )
        else:  # a plugged cost model's own sources
            say(f"  op durations     {', '.join(f'{k} from {s}' for s, k in sorted(n.items()))}")
    if "straggler_cost_us" in res:
        steps = [r["window_us"] for r in res["per_rank"]]
        say(f"  ranks explicit   {len(steps):10d}  ({res['imbalance']})")
        say(f"  straggler cost   {res['straggler_cost_us'] / 1e3:10.3f} ms{per}")
        say(f"  rank window ms   {min(steps) / 1e3:10.3f} .. {max(steps) / 1e3:.3f}")
    for mb in res["micro_batches"]:
        cut = ", splits a sequence" if mb.get("split_seq") else ""
        say(
            f"  micro-batch {mb['index']}: seqs [{mb['seq_lo']}, {mb['seq_hi']}), "
            f"{mb['tokens']} tokens padded to {mb['padded_tokens']}{cut}"
        )
    if "comm_sms" in res:
        say(f"  communication SMs {res['comm_sms']}")
    for note in res.get("notes", []):
        say(f"  note: {note}")
    for caveat in res.get("caveats", []):
        say(f"  {caveat}")
    for lane, busy in sorted(res["busy_us"].items()):
        say(f"  busy {lane:<22s} {busy / 1e3:10.3f} ms{per}")
    return "\n".join(lines)


def program_summary(res: Mapping[str, Any]) -> str:
    """``sim --program``'s summary in words, from its JSON (``ProgramResult.as_dict``): the
    window, not per iteration, and what a bare Program cannot say."""
    named = "" if res["schedule"] == "program" else f" of {res['schedule']}"
    lines = [
        f"{res['program']}: a Program{named}, world {res['world']}"
        f"{'' if res['symmetric'] else ' (explicit ranks)'}, on {res['gpu']}",
        f"  window           {res['window_us'] / 1e3:10.3f} ms",
        f"  communication    {res['comm_window_us'] / 1e3:10.3f} ms",
        f"  exposed comm     {res['exposed_comm_window_us'] / 1e3:10.3f} ms",
        f"  SM time          {res['sm_compute'] * 100:9.1f} % compute, "
        f"{res['sm_comm'] * 100:.1f} % comm, {res['sm_idle'] * 100:.1f} % idle",
        f"  ops              {res['num_ops']:10d}  (durations: profile {res['profile']})",
    ]
    for lane, busy in sorted(res["busy_window_us"].items()):
        lines.append(f"  busy {lane:<22s} {busy / 1e3:10.3f} ms")
    lines.append(f"  not available without a workload: {', '.join(res['not_available'])}")
    return "\n".join(lines)


def workload_title(result: Any) -> str:
    """The workload in a figure's title: model, mode, batch, layout, GPU (a bare Program's run,
    ``program_sim.ProgramResult``, has none: its file and the GPU)."""
    w = result.workload
    if w is None:
        return f"{result.schedule}: Program {result.source or ''}, {result.gpu.name}"
    lay = f"EP{w.parallel.ep}" + (f" PP{w.parallel.pp}" if w.parallel.pp > 1 else "")
    tok = f" ({w.batch.num_tokens} tok)" if w.batch.num_tokens != w.batch.num_seqs else ""
    return (
        f"{result.schedule}: {w.model.label} {w.batch.mode}, {w.batch.num_seqs} seqs/GPU{tok}, "
        f"{lay}, {result.gpu.name}"
    )


def write_run(
    result: Any,
    out: Path,
    *,
    provenance: Mapping[str, Any] | None = None,
    figure_format: str = "png",
    window: str = "auto",
    rank: int | None = None,
    width: str = "double",
    title: str | None = None,
) -> list[Path]:
    """``out/trace.json`` (with ``provenance``) and ``out/timeline.<figure_format>`` of one
    simulated run (an ``overlap_lab.api.Result``), headed ``title`` (None: the workload, '':
    none); the paths written."""
    from overlap_lab.figures import save_timeline

    out.mkdir(parents=True, exist_ok=True)
    result.trace.to_chrome(out / "trace.json", provenance=provenance)
    fig = out / f"timeline.{figure_format}"
    head = workload_title(result) if title is None else title  # a title given: all of it
    save_timeline(
        result.trace, fig, window=window, rank=rank, width=width, title=head,
        say_window=title is None,
    )  # fmt: skip
    return [out / "trace.json", fig]


def write_comparison(
    table: Any,
    out: Path,
    *,
    provenance_of: Callable[[Any], Mapping[str, Any] | None] = lambda _result: None,
    figure_format: str = "png",
    window: str = "auto",
    rank: int | None = None,
    width: str = "double",
    title: str | None = None,
) -> list[Path]:
    """The figures of a comparison (an ``overlap_lab.api.Comparison``), headed ``title`` (None:
    the workload, '': none): its sensitivity ranges when it has them (docs/uncertainty.md) and
    the stacked timelines; then each schedule's trace (``trace_<schedule>.json``, with
    ``provenance_of(result)``). The figures' paths."""
    from overlap_lab.figures import compare_timelines, sensitivity_ranges

    out.mkdir(parents=True, exist_ok=True)
    head = workload_title(table.baseline).split(": ", 1)[1] if title is None else title
    files = []
    if table.sensitivity is not None:
        files.append(out / f"sensitivity.{figure_format}")
        sensitivity_ranges(table.sensitivity, files[-1], title=head)
    files.append(out / f"compare.{figure_format}")
    compare_timelines(
        table, files[-1], window=window, rank=rank, width=width, title=head,
        say_window=title is None,
    )  # fmt: skip
    for row in table.rows:
        if row.result is not None:
            row.result.trace.to_chrome(
                out / f"trace_{row.schedule.replace('+', '_')}.json",
                provenance=provenance_of(row.result),
            )
    return files


def schedules_text(rows: Sequence[tuple[str, str | None, str]]) -> str:
    """``overlap-lab schedules``: each schedule's summary and the upstream code it follows
    (``shared.schedules.describe``'s rows; a broken plug-in, upstream None, with its error)."""
    width = max(len(n) for n, _, _ in rows)
    lines = []
    for name, upstream, summary in rows:
        lines.append(f"{name:<{width}}  {summary if upstream else 'BROKEN: ' + summary}")
        if upstream:
            lines.append(f"{'':<{width}}  upstream: {upstream}")
    return (
        "\n".join(lines) + "\n\nRules and references of each: docs/schedules.md in the repository."
    )


def check_text(out: Mapping[str, Any], key: str, tolerance: float) -> str:
    """The CPU equivalence check's result in words (``measure.check_on_cpu``'s ``out``; ``key``:
    its differences against serial or against one process): one line per schedule."""
    lines = []
    for name, d in out[key].items():
        lines.append(f"{name:16s} max rel diff {d:.2e}  {'ok' if d <= tolerance else 'FAIL'}")
    for name, e in out.get("errors", {}).items():
        lines.append(f"{name:16s} ERROR {e}")
    for name, e in out.get("skipped", {}).items():
        lines.append(f"{name:16s} skipped for a workload: {e}")
    for name, e in out.get("unsplit", {}).items():
        lines.append(f"{name:16s} ran unsplit on {e}")
    return "\n".join(lines)


def gpu_run_text(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """Measured GPU runs in words (``measure.run_on_gpu``'s summaries): one line per schedule."""
    lines = []
    for name, s in summaries.items():
        g = s.get("graph_replay_step_time_us")
        lines.append(
            f"{name:16s} step {s['step_time_us']:.1f} us (op-by-op spans)"
            + (f"  graph replay {g:.1f} us" if g else "")
            + f"  exposed comm {s['exposed_comm_us']:.1f} us  backend {s['backend']}"
            f"  device {s['device']}" + ("  [pp: stages share one GPU]" if "note" in s else "")
        )
    return "\n".join(lines)


#: Kernel classes as the timeline's colour families read them (``figures.op_family``).
FIGURE_LABELS = {
    "deepep_normal": "DeepEP dispatch/combine",
    "deepep_ll": "DeepEP LL dispatch/combine",
    "nccl": "NCCL dispatch",
    "deepgemm": "DeepGEMM experts",
    "flashmla": "FlashMLA attention",
    "flashinfer": "FlashInfer attention",
}


def write_analyzed(trace: Any, mapping: Any, rank: int, path: Path, *, title: str) -> Path:
    """``analyze``'s timeline of a measured trace: its kernels by class (``mapping``, as
    ``shared.outputs.analyze`` classifies them), labelled as the figures colour them."""
    from dataclasses import replace

    from overlap_lab.figures import save_timeline
    from overlap_lab.shared.outputs.analyze import classify_trace
    from overlap_lab.shared.outputs.trace import Trace

    shown = classify_trace(trace, mapping)
    spans = tuple(replace(s, op=FIGURE_LABELS.get(s.op, s.op)) for s in shown.spans)
    save_timeline(Trace(spans, shown.meta), path, rank=rank, labels=False, title=title)
    return path


def to_json(obj) -> str:
    """RFC 8259 JSON (no NaN or Infinity): a non-finite result is refused with its key."""
    import json

    try:
        return json.dumps(obj, sort_keys=True, allow_nan=False)
    except ValueError:
        raise ConfigError(
            f"the result holds a non-finite number ({', '.join(_non_finite(obj)) or '?'}); "
            "check the hardware options"
        ) from None


def _non_finite(obj, path: str = "") -> list[str]:
    if isinstance(obj, float) and not math.isfinite(obj):
        return [path or "value"]
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _non_finite(v, f"{path}.{k}".lstrip("."))]
    if isinstance(obj, (list, tuple)):
        return [p for i, v in enumerate(obj) for p in _non_finite(v, f"{path}[{i}]")]
    return []
