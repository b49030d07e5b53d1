"""Caveats: one line where a result rests on something the model is known to treat roughly.

``sim`` and ``compare`` print them under their output (``tune`` under its best), each naming
the assumption and the section of docs/uncertainty.md that explains it ("Caveats a result
prints"), so a surprising number arrives with what it depends on. A caveat shared by several schedules of a comparison is
printed once, naming them. The rules:

- **exposed communication** above :data:`EXPOSED_SHARE` of the step: the step, and any gain
  from hiding that communication, rests on DeepEP's rates as the link model carries them and on
  compute not slowing beside communication;
- **kernels slowed beside others**: compute kernels ran more than :data:`SLOWED_SHARE` of the
  step longer than alone, sharing SMs and HBM with concurrent kernels (communication included):
  the result rests on the model's sharing rules (docs/sm-sharing.md), which measured pairs
  show to be close but not exact;
- **timed from the roofline**: more than :data:`ROOFLINE_SHARE` of the kernel time of GEMMs and
  attention (the kernels a profile row would time) comes from the roofline's assumed
  efficiencies, not from a measured row;
- **not like for like**: a kind of kernel (op class and dtype) that one schedule times from the
  profile and another, compared with it, from the roofline (``overlap_lab.sources.unlike``);
- **a win inside the sensitivity range** (``compare --sensitivity``): a schedule ahead of
  serial, or the nominal winner, whose throughput range overlaps the one it beats;
- **DeepEP's normal kernels in decode**: a decode step run on DeepEP's normal kernels (``sim``
  and ``compare``: a schedule whose DeepEP mode resolves to normal; ``tune``: the answer, or a
  configuration it is not separated from), which the model has ahead of the low-latency ones
  where nothing measured says so (:func:`normal_kernels_in_decode`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from overlap_lab.sources import slowed_us, time_by_source, unlike

#: ``overlap_lab.api``'s Result and Comparison (not imported: the API imports this module).
Result = Comparison = Any

DOC = "docs/uncertainty.md"
#: Exposed communication above this share of the step makes the result rest on the link model.
EXPOSED_SHARE = 0.5
#: Compute time lost to sharing the GPU above this share of the step makes the result rest on the
#: model's sharing rules.
SLOWED_SHARE = 0.05
#: Share of a schedule's GEMM and attention kernel time from the roofline above which it says so.
ROOFLINE_SHARE = 0.05
#: The classes whose roofline timing is an assumed efficiency a measured row would replace
#: (elementwise kernels are memory-bound and timed at HBM rate, communication by the links).
RATED_CLASSES: tuple[str, ...] = ("gemm", "grouped_gemm", "attention")


@dataclass(frozen=True)
class Caveat:
    """One caveat: what it is about (``kind``), the schedules it concerns, the text (the
    assumption, without the schedules) and the doc section that explains it."""

    kind: str
    schedules: tuple[str, ...]
    text: str
    section: str

    def line(self) -> str:
        who = f" ({', '.join(self.schedules)})" if self.schedules else ""
        return f'caveat{who}: {self.text} ({DOC}, "{self.section}")'


EXPOSED = "Exposed communication above half the step"
ROOFLINE = "Timed from the roofline"
UNLIKE = "Not like for like"
SLOWED = "Kernels slowed beside others"
SENSITIVE = "A win inside the sensitivity range"
NORMAL_DECODE = "DeepEP's normal kernels in decode"


def _pct(xs: Sequence[float]) -> str:
    lo, hi = min(xs), max(xs)
    return (
        f"{100 * lo:.0f} %"
        if round(100 * lo) == round(100 * hi)
        else f"{100 * lo:.0f}-{100 * hi:.0f} %"
    )


def exposed_share(result: Result) -> float:
    """Exposed communication over the window (rank 0)."""
    m = result.metrics
    return m.exposed_comm_us / m.iteration_us if m.iteration_us > 0 else 0.0


def roofline_kernels(result: Result) -> tuple[float, tuple[str, ...]]:
    """The share of rank 0's GEMM and attention kernel time timed from the roofline, and which
    kinds of kernel (``class dtype``) it is."""
    by = {k: v for k, v in time_by_source(result).items() if k[0] in RATED_CLASSES}
    total = sum(sum(v.values()) for v in by.values())
    roof = {k: v.get("roofline", 0.0) for k, v in by.items()}
    kinds = tuple(f"{c} {d}" for (c, d), t in roof.items() if t > 0)
    return (sum(roof.values()) / total if total > 0 else 0.0), kinds


def _exposed(rows: Sequence[tuple[str, Result]], baseline: str | None) -> list[Caveat]:
    hit = [(n, exposed_share(r)) for n, r in rows if exposed_share(r) > EXPOSED_SHARE]
    if not hit:
        return []
    names = tuple(n for n, _ in hit)
    gain = (
        f", so the gains over {baseline} rest"
        if baseline in names and len(rows) > 1
        else ": it rests"
    )
    text = (
        f"exposed communication is {_pct([s for _, s in hit])} of the step{gain} on DeepEP's "
        "rates in the link model"
    )
    return [Caveat("exposed", names, text, EXPOSED)]


def _slowed(rows: Sequence[tuple[str, Result]]) -> list[Caveat]:
    hit = []
    for n, r in rows:
        w = r.metrics.window_us
        share = slowed_us(r) / w if w > 0 else 0.0
        if share > SLOWED_SHARE:
            hit.append((n, share))
    if not hit:
        return []
    text = (
        f"kernels ran {_pct([s for _, s in hit])} of the step longer than alone beside others, "
        "as the model's SM and HBM sharing rules give it"
    )
    return [Caveat("slowed", tuple(n for n, _ in hit), text, SLOWED)]


def _roofline(rows: Sequence[tuple[str, Result]]) -> list[Caveat]:
    hit, kinds = [], {}
    for n, r in rows:
        share, ks = roofline_kernels(r)
        if share > ROOFLINE_SHARE:
            hit.append((n, share))
            kinds.update(dict.fromkeys(ks))
    if not hit:
        return []
    every = len(hit) == len(rows) and len(rows) > 1
    text = (
        f"{_pct([s for _, s in hit])} of GEMM and attention time ({', '.join(kinds)}) is timed "
        "from the roofline, no measured row"
    )
    return [Caveat("roofline", () if every else tuple(n for n, _ in hit), text, ROOFLINE)]


def result_caveats(result: Result) -> list[Caveat]:
    """The caveats of one simulated schedule (``overlap-lab sim``)."""
    rows = [(result.schedule, result)]
    return _exposed(rows, None) + _slowed(rows) + _roofline(rows) + _normal_decode(rows)


def _normal_decode(rows: Sequence[tuple[str, Result]]) -> list[Caveat]:
    """The schedules among ``rows`` whose decode step ran DeepEP's normal kernels."""
    return normal_kernels_in_decode([n for n, r in rows if runs_normal_in_decode(r)])


def runs_normal_in_decode(result: Result) -> bool:
    """Whether ``result`` is a decode step whose expert parallelism ran DeepEP's normal kernels
    (its DeepEP mode resolved for decode; no DeepEP below EP 2)."""
    w = result.workload
    return (
        w.batch.mode == "decode"
        and w.parallel.ep > 1
        and result.config.resolved_deepep_mode("decode") == "normal"
    )


def comparison_caveats(table: Comparison) -> list[Caveat]:
    """The caveats of a comparison, each printed once for the schedules it concerns."""
    rows = [(r.schedule, r.result) for r in table.rows if r.result is not None]
    base = table.baseline
    from overlap_lab.shared.schedules import BASELINE

    out = _exposed(rows, BASELINE) + _slowed(rows) + _roofline(rows) + _normal_decode(rows)
    for (cls, dtype), p, differ in unlike((BASELINE, base), rows):
        theirs = "; ".join(f"{100 * q:.0f} % in {', '.join(ns)}" for q, ns in differ.items())
        names = tuple(n for ns in differ.values() for n in ns)
        text = (
            f"{cls} {dtype} kernels are {100 * p:.0f} % profile-timed in {BASELINE}, {theirs}: "
            "their difference is partly the two sources'"
        )
        out.append(Caveat("unlike", names, text, UNLIKE))
    out += _sensitive(table)
    return out


def _sensitive(table: Comparison) -> list[Caveat]:
    """Wins the sensitivity design does not separate: schedules ahead of serial whose ranges
    overlap serial's, and the nominal winner's overlap with the schedules it beats."""
    s = table.sensitivity
    if s is None:
        return []
    from overlap_lab.shared.schedules import BASELINE

    ran = [r for r in table.rows if r.result is not None and r.schedule in s.tps]
    out = []
    ahead = tuple(
        r.schedule
        for r in ran
        if r.schedule != BASELINE
        and r.speedup is not None
        and r.speedup > 1
        and BASELINE in s.tps
        and not s.separated(r.schedule, BASELINE)
    )
    if ahead:
        out.append(
            Caveat(
                "sensitivity",
                ahead,
                f"the gain over {BASELINE} lies inside the sensitivity range: plausible costs "
                "reverse it",
                SENSITIVE,
            )
        )
    if len(ran) > 1:
        best = max(ran, key=lambda r: r.result.metrics.tokens_per_s_gpu)
        close = [
            r.schedule for r in ran if r is not best and not s.separated(best.schedule, r.schedule)
        ]
        if close:
            by = defaultdict(list)
            for n in close:
                by[n].append(s.paired_share(best.schedule, n))
            ahead_at = ", ".join(f"{n} at {100 * v[0]:.0f} %" for n, v in by.items())
            out.append(
                Caveat(
                    "sensitivity",
                    (best.schedule,),
                    f"the fastest schedule is not separated from {', '.join(close)} (ahead of "
                    f"{ahead_at} of the points)",
                    SENSITIVE,
                )
            )
    return out


def normal_kernels_in_decode(schedules: Sequence[str]) -> list[Caveat]:
    """The caveat of configurations, named by their ``schedules``, whose decode step runs
    DeepEP's normal kernels (``tune``: its best, and those it is not separated from): where the
    search chose them over the low-latency ones, the answer rests on the model's timing of the
    two modes at decode sizes, which no measurement here checks."""
    if not schedules:
        return []
    text = (
        "decode on DeepEP's normal kernels (CUDA graphs off), which the model has ahead of the "
        "low-latency ones and no measurement checks: the model's answer, not a deployment's"
    )
    return [Caveat("normal_decode", tuple(dict.fromkeys(schedules)), text, NORMAL_DECODE)]
