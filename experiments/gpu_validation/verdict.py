"""The loop's verdict over its cases: per case the median step-time error and both rankings;
over all, PASS/FAIL against ``TARGETS`` (:func:`verdict`), said in one line
(:func:`verdict_line`, the last line the loop prints)."""

from __future__ import annotations

import statistics

from overlap_lab.experiments.gpu_validation.comm_only import COMM_ONLY

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


def ranking(step_us: dict[str, float]) -> list[str]:
    """Schedule names, fastest first."""
    return sorted(step_us, key=lambda n: step_us[n])


def summarize(cases: dict) -> dict:
    """Per case: median |step-time error| over comparable schedules, both rankings, and
    whether they agree."""
    out = {}
    for key, case in cases.items():
        runs = {n: r for n, r in case["runs"].items() if "comparison" in r and r["comparable"]}
        if not runs:
            continue
        pred = {n: r["comparison"]["step_time_us"]["predicted"] for n, r in runs.items()}
        meas = {n: r["comparison"]["step_time_us"]["measured"] for n, r in runs.items()}
        errs = [abs(r["comparison"]["step_time_us"]["rel_error"] or 0) for r in runs.values()]
        out[key] = {
            "median_abs_step_error": statistics.median(errs),
            "ranking_predicted": ranking(pred),
            "ranking_measured": ranking(meas),
            "same_ranking": ranking(pred) == ranking(meas),
        }
    return out


#: The loop's targets (the verdict line): step time, ranking ties, exposed communication.
TARGETS = {"median_step": 0.05, "max_step": 0.10, "tie": 0.02, "exposed_rel": 0.10,
           "exposed_abs_us": 50.0, "comm_only": 0.05}  # fmt: skip


def _tied(a: float, b: float, tie: float) -> bool:
    return abs(a - b) <= tie * min(abs(a), abs(b))


def discordant_pairs(pred: dict[str, float], meas: dict[str, float], tie: float) -> list:
    """Pairs of schedules ordered one way by the prediction and the other way by the
    measurement, each side's order counting only where its two step times differ by more than
    ``tie`` (relative to the faster): schedules within ``tie`` are tied, never discordant."""
    out = []
    names = sorted(set(pred) & set(meas))
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if _tied(pred[a], pred[b], tie) or _tied(meas[a], meas[b], tie):
                continue
            if (pred[a] < pred[b]) != (meas[a] < meas[b]):
                out.append((a, b))
    return out


def verdict(cases: dict, targets: dict = TARGETS) -> dict:
    """PASS/FAIL of the loop over every comparable run of every case: median and max
    |step-time error|, the ranking per case (ties within ``tie``), and exposed communication
    within ``exposed_rel`` or ``exposed_abs_us``. No comparable run: FAIL."""
    errs, exposed, bad_rank, cases_ranked, comm = [], [], {}, 0, []
    for key, case in cases.items():
        r = case.get("runs", {}).get(COMM_ONLY) or {}
        if "comparison" in r:
            e = r["comparison"]["step_time_us"]["rel_error"]
            comm.append((abs(e if e is not None else float("inf")), key))
        runs = {n: r for n, r in case.get("runs", {}).items()
                if "comparison" in r and r.get("comparable", True)}  # fmt: skip
        if not runs:
            continue
        pred, meas = {}, {}
        for n, r in runs.items():
            st, ex = r["comparison"]["step_time_us"], r["comparison"]["exposed_comm_us"]
            pred[n], meas[n] = st["predicted"], st["measured"]
            e = st["rel_error"]
            errs.append((abs(e if e is not None else float("inf")), f"{key}/{n}"))
            d = abs(ex["predicted"] - ex["measured"])
            lim = max(targets["exposed_rel"] * abs(ex["measured"]), targets["exposed_abs_us"])
            exposed.append((d <= lim, d, d / ex["measured"] if ex["measured"] else None,
                            f"{key}/{n}"))  # fmt: skip
        cases_ranked += 1
        dis = discordant_pairs(pred, meas, targets["tie"])
        if dis:
            bad_rank[key] = dis
    if not errs:
        return {"pass": False, "reason": "no comparable run", "runs": 0}
    med = statistics.median(e for e, _ in errs)
    worst = max(errs)
    ex_ok = sum(ok for ok, *_ in exposed)
    ex_worst = max(exposed, key=lambda x: x[1])
    checks = {
        "median_step": med <= targets["median_step"],
        "max_step": worst[0] <= targets["max_step"],
        "ranking": not bad_rank,
        "exposed_comm": ex_ok == len(exposed),
    }
    if comm:  # the communication-only case, where it ran: the link model alone
        checks["comm_only"] = max(comm)[0] <= targets["comm_only"]
    return {
        "pass": all(checks.values()), "checks": checks, "runs": len(errs),
        "median_abs_step_error": med, "max_abs_step_error": worst[0], "worst_run": worst[1],
        "cases_ranked": cases_ranked, "ranking_discordant": bad_rank,
        "exposed_ok": ex_ok, "exposed_worst": {"run": ex_worst[3], "abs_us": ex_worst[1],
                                               "rel": ex_worst[2]},
        "comm_only_abs_error": {k: e for e, k in comm},
        "targets": dict(targets),
    }  # fmt: skip


#: The last line of a CPU dry run: its times are host wall-clock, so it judges nothing.
DRY_RUN_LINE = (
    "VERDICT: nothing judged (CPU dry run: host wall-clock times of a scaled-down model; the "
    "loop ran end to end, {runs} runs predicted and compared)"
)


def verdict_line(v: dict, *, dry_run: bool = False) -> str:
    """One line: PASS/FAIL with the numbers behind each check (the loop prints it last); a dry
    run's says that it judged nothing (:data:`DRY_RUN_LINE`)."""
    if dry_run:
        return DRY_RUN_LINE.format(runs=v.get("runs", 0))
    head = "VERDICT"
    if v.get("reason"):
        return f"{head} FAIL: {v['reason']}"
    t, c = v["targets"], v["checks"]

    def mark(ok: bool) -> str:
        return "ok" if ok else "MISSED"

    ew = v["exposed_worst"]
    rel = "" if ew["rel"] is None else f", {ew['rel']:.1%}"
    ranked = v["cases_ranked"] - len(v["ranking_discordant"])
    dis = "; ".join(f"{k}: " + ", ".join(f"{a}/{b}" for a, b in p)
                    for k, p in sorted(v["ranking_discordant"].items()))  # fmt: skip
    return (
        f"{head} {'PASS' if v['pass'] else 'FAIL'}: "
        f"median |step error| {v['median_abs_step_error']:.1%} (<= {t['median_step']:.0%} "
        f"{mark(c['median_step'])}); max {v['max_abs_step_error']:.1%} {v['worst_run']} "
        f"(<= {t['max_step']:.0%} {mark(c['max_step'])}); ranking the same in {ranked}/"
        f"{v['cases_ranked']} cases, ties within {t['tie']:.0%} ({mark(c['ranking'])}"
        f"{'; discordant ' + dis if dis else ''}); exposed comm within {t['exposed_rel']:.0%} "
        f"or {t['exposed_abs_us']:.0f} us in {v['exposed_ok']}/{v['runs']} runs (worst "
        f"{ew['run']}: {ew['abs_us']:.1f} us{rel}; {mark(c['exposed_comm'])})"
        + (
            "; comm-only |step error| "
            + ", ".join(f"{k} {e:.1%}" for k, e in sorted(v["comm_only_abs_error"].items()))
            + f" (<= {t['comm_only']:.0%} {mark(c['comm_only'])})"
            if "comm_only" in c
            else ""
        )
    )
