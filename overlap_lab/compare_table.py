"""The table ``overlap-lab compare`` prints (``Comparison.text``): one row per schedule with its
time, throughput, exposed communication and where its durations came from (``p/r/l %``), then
the caveats (``overlap_lab.caveats``), the notes several rows share (printed once, marked in
the rows) and the footnotes that say how each column is measured."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

from overlap_lab.shared import schedules as registry
from overlap_lab.shared.schedules import BASELINE
from overlap_lab.sources import share_text

#: ``overlap_lab.api``'s Comparison and CompareRow (not imported: the API imports this module).
Comparison = CompareRow = Any


def comparison_text(table: Comparison) -> str:
    """``table`` as ``overlap-lab compare`` prints it."""
    b = table.baseline
    w = b.workload
    head = (
        f"{'schedule':<15}{'GPUs':>6}{'iters':>6}{'ms/iter':>10}{'tok/s/GPU':>11}"
        f"{'tok/s/node':>12}{'vs ' + BASELINE:>10}{'exposed comm':>14}{'p/r/l %':>10}  note"
    )
    lines = [
        f"{w.model.label} {w.batch.mode} on {b.gpu.name}: {w.batch.num_seqs} seqs "
        f"({w.batch.num_tokens} tokens) per GPU, EP {w.parallel.ep}, "
        f"{w.parallel.gpus_per_node} GPUs per node",
        head,
    ]
    marks, shared = _shared_notes(table.rows)
    for row in table.rows:
        res = row.result
        note = "; ".join(
            [f"({marks[n]})" for n in _note_parts(row.note) if n in marks]
            + [n for n in _note_parts(row.note) if n not in marks]
        )
        if res is None:
            lines.append(
                f"{row.schedule:<15}{'-':>6}{'-':>6}{'-':>10}{'-':>11}{'-':>12}{'-':>10}"
                f"{'-':>14}{'-':>10}  {note}".rstrip()
            )
            continue
        m = res.metrics
        exposed = m.exposed_comm_us / 1e3
        its = f"{m.iterations} {registry.iteration_unit(row.schedule)}".strip()  # "8 mb"
        lines.append(
            f"{row.schedule:<15}{m.gpus:>6}{its:>6}{m.iteration_us / 1e3:>10.3f}"
            f"{m.tokens_per_s_gpu:>11.0f}{m.tokens_per_s_node:>12.0f}{row.speedup:>10.3f}"
            f"{exposed:>11.3f} ms{share_text(row.cost_share):>10}  {note}".rstrip()
        )
    lines.append("")
    caveats = table.caveats()
    lines += caveats + ([""] if caveats else [])
    for note, mark in marks.items():
        lines += textwrap.wrap(
            f"({mark}) {', '.join(shared[note])}: {note}",
            100,
            subsequent_indent="  ",
            break_on_hyphens=False,
        )
    ran = [r for r in table.rows if r.result is not None]
    windows = [registry.window_note(r.schedule, table.config) for r in ran]
    staged = [r.schedule for r in ran if r.result.workload.parallel.pp > 1]
    from overlap_lab.sensitivity import INPUTS

    slow = 100 * (next(i for i in INPUTS if i.name == "interference").hi - 1)
    notes = [
        "ms/iter: each schedule's simulated window divided by its scheduler iterations "
        "(iters). One-step schedules simulate one iteration: their host waits for each "
        "step's result before scheduling the next, so N iterations take N times as long."
        + "".join(f" {n}" for n in windows if n),
        f"vs {BASELINE}: tokens/s per GPU over {BASELINE}'s on the same GPUs"
        + (
            f" ({', '.join(staged)}: {BASELINE} on its stages x EP GPUs, the same sequences "
            "in flight)."
            if staged
            else "."
        ),
        "exposed comm: per iteration, time with communication in flight and no compute "
        "kernel running (rank 0).",
        "p/r/l %: the share of rank 0's kernel time timed from the calibration profile, the "
        "roofline and the link model (cost_share in --json).",
        "Overlap gains assume kernels running together slow each other only through the "
        f"SMs and HBM they share; measured on an H200, kernels lost up to {slow:.0f} % more "
        "beside decode-size GEMMs (docs/sm-sharing.md), so gains from overlapping GEMMs are "
        "optimistic.",
    ]
    for n in notes:
        lines += textwrap.wrap(n, 100, subsequent_indent="  ", break_on_hyphens=False)
    if table.sensitivity is not None:
        lines.append(table.sensitivity.text())
    return "\n".join(lines)


def _note_parts(note: str) -> list[str]:
    """A row's note as the notes it joins (``"; "``-separated, as ``compare`` joins them)."""
    return [n for n in note.split("; ") if n] if note else []


def _shared_notes(rows: Sequence[CompareRow]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Notes that several rows carry, each printed once under the table: note -> its mark
    (``a``, ``b``, ...) and note -> the schedules that carry it."""
    who: dict[str, list[str]] = {}
    for row in rows:
        for n in dict.fromkeys(_note_parts(row.note)):
            who.setdefault(n, []).append(row.schedule)
    shared = {n: ws for n, ws in who.items() if len(ws) > 1}
    return {n: chr(ord("a") + i) for i, n in enumerate(shared)}, shared
