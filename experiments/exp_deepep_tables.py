"""DeepEP's published performance tables, side by side with the model.

    python -m overlap_lab.experiments deepep_tables     # prints every row's error

Source: DeepEP README, V1 tables (now docs/legacy.md of github.com/deepseek-ai/DeepEP): H800,
~160 GB/s NVLink, one CX7 400 Gb/s NIC (~50 GB/s) per GPU; hidden 7168, top-8 of 256 experts,
FP8 dispatch, BF16 combine. Normal kernels: 4096 tokens per rank, top-4 groups (a group per
node, as tests/test_internode.py routes); low-latency kernels: 128 tokens per rank, plain top-8.

Each row is simulated, not computed: one dispatch (or combine) with every EP rank explicit,
the routing drawn from uniform random gating (seeded), the bytes per (source, destination, link)
from DeepEP's kernel family (``shared.ir.deepep``), the kernels' SMs and HBM work from
``shared.ir.ops``, the links shared max-min fairly (``sim.network``) at the H800 preset's effective
bandwidths (one global figure per link kind, cited in ``shared.inputs.hardware``; nothing per row).
The figures are reported as DeepEP's tests compute them: normal intranode "bottleneck" bandwidth
= NVLink bytes received per rank (local copies included) / time; internode = RDMA bytes of every
(token, node) pair including the own node / time; low-latency = one message per (token, expert)
/ time, and the time is the kernel's (send + receive of the slowest rank).

What the model holds that a bandwidth alone misses (``shared.inputs.hardware``, one figure each for the
whole table, none per row): the NVLink rate DeepEP's kernels reach over the links (the README's
intranode figure counts the rank's own 1/8 of the received bytes: 153 GB/s x 7/8 = 134 GB/s),
the low-latency kernels' NVLink path for peers inside the node (the 2025-06 kernels,
``shared.ir.deepep``) and the fixed cost of a low-latency receive (``deepep_ll_recv_us``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from overlap_lab.experiments.runner import Case, Experiment, main, md_table, stamp
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.routing import Imbalance, Routing, RoutingConfig
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model
from overlap_lab.shared.ir.builder import RankBuilder, program
from overlap_lab.shared.ir.deepep import RELEASES
from overlap_lab.shared.ir.ops import layer_ops, whole_batch
from overlap_lab.shared.ir.ranks import expand_ranks
from overlap_lab.sim.engine import Engine

# DeepEP README (V1, docs/legacy.md), H800 + CX7.
NORMAL = {  # EP: (dispatch GB/s, combine GB/s, bottleneck link)
    8: (153, 158, "nvlink"),
    16: (43, 43, "rdma"),
    32: (58, 57, "rdma"),
    64: (51, 50, "rdma"),
}
LOW_LATENCY = {  # EP: (dispatch µs, dispatch GB/s, combine µs, combine GB/s)
    8: (77, 98, 114, 127),
    16: (118, 63, 195, 74),
    32: (155, 48, 273, 53),
    64: (173, 43, 314, 46),
    128: (192, 39, 369, 39),
    256: (194, 39, 360, 40),
}
FP8_FACTOR = (1 + 4 / 128) / 2  # DeepEP's tests: FP8 bytes relative to BF16
HIDDEN, TOP_K, EXPERTS = 7168, 8, 256
NET_GROUP_TOL = 0.02
NAME = "deepep_tables"
SOURCE = "DeepEP README V1 tables (github.com/deepseek-ai/DeepEP docs/legacy.md)"
#: Seeded routings each row is the mean of: a row's time is the slowest rank of one draw, and at
#: 128 tokens a rank the draw alone moves it by about +-2 % (EP8, seeds 0-9: -6 % to -10 %).
SEEDS = (0, 1, 2)
#: What "within the published figures" means here (the issue's target, not a fitted tolerance).
TOLERANCE = 0.10


def _workload(ep: int, tokens: int) -> Workload:
    m = get_model("deepseek-v3")
    batch = Batch.decode(tokens) if tokens <= 256 else Batch.prefill(1, extend_len=tokens)
    return Workload(m, batch, Parallel(ep=ep, gpus_per_node=8))


def _routing(ep: int, tokens: int, normal: bool, seed: int) -> Routing:
    nodes = max(1, ep // 8)
    group = normal and nodes > 1
    cfg = RoutingConfig(
        EXPERTS, TOP_K, ep, 8, Imbalance("zipf", 0.0), seed,
        group_limited=group, n_group=nodes if group else 1, topk_group=min(4, nodes),
    )  # fmt: skip
    return Routing(cfg, (tokens,) * ep)


def simulate_collective(ep: int, tokens: int, mode: str, what: str, seed: int = 0):
    """Time (µs, slowest rank, first launch to completion) of one dispatch or combine. The
    normal kernels hold the SMs DeepEP's V1 tables were measured on (24: ``shared.ir.deepep``),
    not the preset's Buffer default (20), on which V1 moves less (``deepep_normal_rate``)."""
    gpu = get_gpu("h800", deepep_normal_sms=RELEASES["v1"].saturating_sms["rdma"])
    w = _workload(ep, tokens)
    mb = whole_batch(w)
    ops = layer_ops(w, gpu, 3, mb, deepep_mode=mode, step=0)
    rb = RankBuilder(0, ("main",))
    t = rb.thread("main")
    t.launch(ops[f"{what}_a"], "main").launch(ops[f"{what}_b"], "main")
    prog = program([rb], world=ep, micro_batches=[mb.as_meta()], deepep_mode=mode)
    routing = _routing(ep, tokens, mode == "normal", seed)
    explicit = expand_ranks(prog, w, gpu, routing)
    trace = Engine(explicit, gpu, net_group_tol=NET_GROUP_TOL).run()
    spans = [s for s in trace.spans if s.lane.startswith("stream:")]
    per_rank: dict[int, list[float]] = {}
    for s in spans:
        lo, hi = per_rank.get(s.rank, [s.start, s.end])
        per_rank[s.rank] = [min(lo, s.start), max(hi, s.end)]
    time = max(hi - lo for lo, hi in per_rank.values())
    return time, routing.layer(0).matrices()


#: Tokens per rank of DeepEP's README tables: normal kernels, low-latency kernels.
NORMAL_TOKENS, LL_TOKENS = 4096, 128


def normal_row(ep: int, seed: int = 0) -> dict:
    tokens = NORMAL_TOKENS
    out = {"ep": ep}
    for what, bytes_per in (("dispatch", HIDDEN * 2 * FP8_FACTOR), ("combine", HIDDEN * 2)):
        t, m = simulate_collective(ep, tokens, "normal", what, seed)
        if ep <= 8:  # NVLink: bytes each rank receives (its own copies included)
            logical = m.tokens.sum(axis=0).max() * bytes_per
        else:  # RDMA: every (token, node) pair, own node included (num_rdma_token_sent)
            logical = m.node_tokens.sum(axis=1).max() * bytes_per
        model = float(logical / t / 1e3)
        pub = NORMAL[ep][0 if what == "dispatch" else 1]
        out[what] = {"time_us": float(t), "model_gbps": model, "published_gbps": pub,
                     "error": model / pub - 1}  # fmt: skip
    out["link"] = NORMAL[ep][2]
    return out


def low_latency_row(ep: int, seed: int = 0) -> dict:
    tokens = LL_TOKENS
    out = {"ep": ep}
    pub = LOW_LATENCY[ep]
    msg = {"dispatch": HIDDEN + HIDDEN / 128 * 4 + 16, "combine": HIDDEN * 2}
    for i, what in enumerate(("dispatch", "combine")):
        t, _ = simulate_collective(ep, tokens, "low_latency", what, seed)
        gbps = tokens * TOP_K * msg[what] / t / 1e3
        p_us, p_gbps = pub[2 * i], pub[2 * i + 1]
        out[what] = {"time_us": t, "published_us": p_us, "error": t / p_us - 1,
                     "model_gbps": gbps, "published_gbps": p_gbps}  # fmt: skip
    return out


def cases():
    for ep in NORMAL:
        yield Case(
            {"kernels": "normal", "ep": ep}, "deepep-normal", _workload(ep, NORMAL_TOKENS), "h800"
        )
    for ep in LOW_LATENCY:
        yield Case(
            {"kernels": "low_latency", "ep": ep}, "deepep-ll", _workload(ep, LL_TOKENS), "h800"
        )


def mean_row(kind: str, ep: int, seeds: tuple[int, ...] = SEEDS) -> dict:
    """The row ``kind`` at ``ep`` with times, rates and errors averaged over the seeded
    routings ``seeds`` (the published figures are themselves means over random routings);
    ``error_range`` keeps the spread of the per-seed errors."""
    one = normal_row if kind == "normal" else low_latency_row
    rows = [one(ep, seed) for seed in seeds]
    out = dict(rows[0])
    for what in ("dispatch", "combine"):
        cells = [r[what] for r in rows]
        out[what] = {k: sum(c[k] for c in cells) / len(cells) for k in cells[0]}
        out[what]["error_range"] = [min(c["error"] for c in cells), max(c["error"] for c in cells)]
    return out


def simulate_row(case: Case) -> tuple[dict, None]:
    """One table row, simulated (the runner's ``simulate`` hook: a row, no kept trace)."""
    ep, kind = case.params["ep"], case.params["kernels"]
    r = mean_row(kind, ep)
    return {
        "schedule": case.schedule,
        **case.params,
        **{k: v for k, v in r.items() if k != "ep"},
    }, None


def _split(doc: dict) -> tuple[list[dict], list[dict]]:
    rows = doc["rows"]
    return [r for r in rows if r["kernels"] == "normal"], [
        r for r in rows if r["kernels"] == "low_latency"
    ]


def max_error(doc: dict) -> float:
    return max(abs(r[w]["error"]) for r in doc["rows"] for w in ("dispatch", "combine"))


NOTES = """\
# DeepEP published tables vs the model (H800, hidden 7168, top-8)

{stamp}

Source: {doc[source]}. Model: explicit ranks, seeded uniform routing (each row the mean of seeds
{seeds}; the spread of one draw is in the JSON, `error_range`),
preset NVLink {gpu[nvlink_eff_gbps]:g} GB/s, RDMA {gpu[rdma_eff_gbps]:g} GB/s over the links,
low-latency receive fixed cost {gpu[deepep_ll_recv_us]:g} µs (`shared/inputs/hardware.py`).

## Normal kernels ({doc[normal_tokens]} tokens per rank), bottleneck bandwidth

{normal_table}

## Low-latency kernels (128 tokens per rank), latency

{low_latency_table}

Largest |error| {worst:.1%}: {verdict} rows within {tolerance:.0%}.
"""


def to_markdown(doc: dict) -> str:
    gpu = doc["presets"]["gpus"]["h800"]
    normal, ll = _split(doc)
    n_tab = [
        [r["ep"], r["link"], f"{r['dispatch']['published_gbps']} GB/s",
         f"{r['dispatch']['model_gbps']:.1f} GB/s", f"{r['dispatch']['error']:+.1%}",
         f"{r['combine']['published_gbps']} GB/s", f"{r['combine']['model_gbps']:.1f} GB/s",
         f"{r['combine']['error']:+.1%}"]
        for r in normal
    ]  # fmt: skip
    l_tab = [
        [r["ep"], f"{r['dispatch']['published_us']} µs", f"{r['dispatch']['time_us']:.0f} µs",
         f"{r['dispatch']['error']:+.1%}", f"{r['combine']['published_us']} µs",
         f"{r['combine']['time_us']:.0f} µs", f"{r['combine']['error']:+.1%}"]
        for r in ll
    ]  # fmt: skip
    worst = max_error(doc)
    verdict = "all" if worst <= TOLERANCE else "NOT all"
    return NOTES.format(
        tolerance=TOLERANCE,
        doc=doc,
        gpu=gpu,
        verdict=verdict,
        worst=worst,
        stamp=stamp(doc),
        seeds=", ".join(map(str, doc["seeds"])),
        normal_table=md_table(
            [
                "EP",
                "link",
                "dispatch published",
                "dispatch model",
                "error",
                "combine published",
                "combine model",
                "error",
            ],
            n_tab,
            "---:",
        ),
        low_latency_table=md_table(
            [
                "EP",
                "dispatch published",
                "dispatch model",
                "error",
                "combine published",
                "combine model",
                "error",
            ],
            l_tab,
            "---:",
        ),
    )


def plot(doc: dict, path: Path) -> None:
    from matplotlib.figure import Figure

    normal, ll = _split(doc)
    fig = Figure(figsize=(10, 4))
    a, b = fig.subplots(1, 2)
    eps = [r["ep"] for r in ll]
    for what, mk in (("dispatch", "o"), ("combine", "s")):
        a.plot(eps, [r[what]["published_us"] for r in ll], mk + "-", label=f"{what} published")
        a.plot(eps, [r[what]["time_us"] for r in ll], mk + "--", label=f"{what} model")
    a.set_xscale("log", base=2)
    a.set_xlabel("EP")
    a.set_ylabel("latency (µs)")
    a.set_title("low-latency kernels, 128 tokens")
    a.legend(fontsize=8)
    eps = [r["ep"] for r in normal]
    for what, mk in (("dispatch", "o"), ("combine", "s")):
        b.plot(
            eps, [r[what]["published_gbps"] for r in normal], mk + "-", label=f"{what} published"
        )
        b.plot(eps, [r[what]["model_gbps"] for r in normal], mk + "--", label=f"{what} model")
    b.set_xscale("log", base=2)
    b.set_xlabel("EP")
    b.set_ylabel("bottleneck bandwidth (GB/s)")
    b.set_title("normal kernels, 4096 tokens")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=150)


EXPERIMENT = Experiment(
    name=NAME,
    title="DeepEP's published H800 tables against the link model, every row",
    cases=cases,
    simulate=simulate_row,
    figure=plot,
    notes=to_markdown,
    summary=to_markdown,
    meta={
        "source": SOURCE,
        "seeds": list(SEEDS),
        "tolerance": TOLERANCE,
        "normal_tokens": NORMAL_TOKENS,
        "low_latency_tokens": LL_TOKENS,
    },
)

if __name__ == "__main__":
    raise SystemExit(
        main(sys.argv[1:], prog=f"python -m overlap_lab.experiments.exp_{NAME}", default=[NAME])
    )
