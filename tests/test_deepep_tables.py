"""DeepEP's published tables through the model's byte accounting, one README at a time: which
bytes each figure counts (the own rank or node included), what crosses the links, each
release's NIC rate converted from its own README, and every row simulated under the routing
DeepEP's tests draw (``experiments/exp_deepep_tables.py``; EP 128 and 256 low-latency rows, 256
explicit ranks each, run in the experiment alone)."""

from __future__ import annotations

import numpy as np
import pytest

from overlap_lab.experiments import exp_deepep_tables as X
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.topology import Topology
from overlap_lab.shared.ir.deepep import (
    RELEASES,
    V1_TABLES,
    byte_matrices,
    link_share,
    logical_bytes,
    nic_gbps,
    readme_routing,
)


def _share(ep, mode, link, normal=True, ll_nvlink=True, seeds=(0, 1, 2)):
    topo = Topology(ep, min(8, ep))
    tokens = 4096 if mode == "normal" else 128
    return np.mean([
        link_share(readme_routing(ep, tokens, normal, s).layer(0).matrices(), topo, mode, link,
                   ll_nvlink)
        for s in seeds
    ])  # fmt: skip


# ---- which bytes a figure counts, and what crosses the link -------------------------------------


def test_intranode_figures_count_the_ranks_own_eighth():
    assert _share(8, "normal", "nvlink") == pytest.approx(7 / 8, rel=0.01)


@pytest.mark.parametrize("ep, nic", [(16, 1 / 2), (32, 3 / 4), (64, 7 / 8)])
def test_internode_figures_count_the_senders_own_node(ep, nic):
    """Group-limited to min(nodes, 4) nodes: at 2 and 4 nodes every node is a candidate and a
    token reaches nearly all of them, its own among them (1/2, 3/4 cross the NIC); at 8 nodes it
    reaches about 4 of 8, its own with chance 1/2 (1 - 1/2 / 4 = 7/8)."""
    assert _share(ep, "normal", "rdma") == pytest.approx(nic, rel=0.01)


def test_low_latency_figures_count_every_selection():
    """Before PR #173 every peer was reached over RDMA: 7/8 of the selections at EP 8; after,
    none at EP 8 (one node), and at EP 32 the 24 ranks of other nodes: 3/4."""
    assert _share(8, "low_latency", "rdma", False, ll_nvlink=False) == pytest.approx(
        7 / 8, rel=0.02
    )
    assert _share(8, "low_latency", "rdma", False) == 0.0
    assert _share(32, "low_latency", "rdma", False) == pytest.approx(3 / 4, rel=0.02)


def test_logical_bytes_are_the_tests_counters():
    ep = 16
    m = readme_routing(ep, 4096, True, 0).layer(0).matrices()
    topo = Topology(ep, 8)
    assert np.array_equal(logical_bytes(m, topo, "normal", 1.0), m.node_tokens.sum(axis=1))
    assert np.array_equal(logical_bytes(m, topo, "low_latency", 1.0), m.copies.sum(axis=1))
    rdma = byte_matrices(m, topo, "normal", "dispatch", 1.0)["rdma"]
    own = np.array([m.node_tokens[s, s // 8] for s in range(ep)])
    assert np.allclose(rdma.sum(axis=1), m.node_tokens.sum(axis=1) - own)


# ---- each release's rate, as its README states it -----------------------------------------------


@pytest.mark.parametrize("name", sorted(RELEASES))
def test_each_releases_nic_rate_is_its_last_readme_converted(name):
    r = RELEASES[name]
    rates = [x for pair in nic_gbps(r.tables[-1]).values() for x in pair]
    assert r.gbps["rdma"] == pytest.approx(np.mean(rates), abs=0.5)


def test_the_presets_nic_rate_is_v1s():
    for g in ("h800", "h100", "h200", "b200"):
        assert get_gpu(g).rdma_eff_gbps == RELEASES["v1"].gbps["rdma"]
    assert get_gpu("h800").nvlink_eff_gbps == pytest.approx(153 * 7 / 8, abs=0.5)


def test_the_first_readme_reached_less_of_the_nic():
    """2025-02-24: 44/46 GB/s at EP 32/64 are 33 and 40 GB/s over the NIC; 2025-04-22 on,
    43.5 and 44.6."""
    first, later = (nic_gbps(t) for t in V1_TABLES[:2])
    assert first[32][0] == pytest.approx(33.0, abs=0.3) and first[64][0] == pytest.approx(
        40.2, abs=0.3
    )
    assert later[32][0] == pytest.approx(43.5, abs=0.3) and later[64][0] == pytest.approx(
        44.6, abs=0.3
    )


# ---- every row through the model, under the tests' routing --------------------------------------

#: Rows the model misses by more than the tolerance (the experiment's mean of three seeds): the
#: first README's normal rows span 33-40 GB/s over the NIC, so no single rate holds both EP 32
#: and 64; low-latency rows whose slowest rank under a random draw exceeds the published figure
#: (balanced routing holds them within 5 %). A change that reproduces one fails until its mark goes.
MISSES = {
    (
        "normal@2025-02-24",
        32,
        "dispatch",
    ): "+11 %: its NIC rate (33 GB/s) is below the table's mean",
    (
        "normal@2025-02-24",
        64,
        "dispatch",
    ): "-10 %: its NIC rate (40 GB/s) is above the table's mean",
    ("low_latency@2025-02-24", 16, "dispatch"): "+12 % at the slowest rank of a random draw",
    ("low_latency@2025-02-24", 16, "combine"): "+11 % at the slowest rank of a random draw",
    ("low_latency@2025-02-24", 64, "dispatch"): "+11 % at the slowest rank of a random draw",
    ("low_latency@2025-06-05", 64, "combine"): "+11 % at the slowest rank of a random draw",
}


def _rows():
    for label, (kind, rows, _) in X.tables().items():
        for ep, *_ in rows:
            if kind == "low_latency" and ep > 64:
                continue
            for what in ("dispatch", "combine"):
                key = (label, ep, what)
                marks = (
                    [pytest.mark.xfail(strict=True, reason=MISSES[key])] if key in MISSES else []
                )
                yield pytest.param(label, ep, what, marks=marks, id=f"{label}-ep{ep}-{what}")


@pytest.fixture(scope="module")
def rows():
    return {}


@pytest.mark.parametrize("label, ep, what", list(_rows()))
def test_each_published_row_is_reproduced(rows, label, ep, what):
    kind, date = label.split("@")
    if (label, ep) not in rows:
        rows[(label, ep)] = X.mean_row(kind, ep, date=date)
    assert abs(rows[(label, ep)][what]["error"]) <= X.TOLERANCE


def test_balanced_routing_is_faster_than_the_tables_random_draw():
    r = X.mean_row("low_latency", 32, seeds=(0,))
    for what in ("dispatch", "combine"):
        assert r[what]["balanced_us"] < r[what]["time_us"]
