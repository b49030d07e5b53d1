"""The engine's seams (``sim.models``): the table-driven cost model and the constant-bandwidth
network of docs/architecture.md, plugged into ``overlap_lab.simulate``, give the step time
computed by hand."""

from __future__ import annotations

import re
from pathlib import Path

import overlap_lab as ol
from overlap_lab.shared.ir.builder import RankBuilder, program
from overlap_lab.shared.ir.program import Coll, Flow, Op, Program


def _doc_examples() -> dict:
    """The classes docs/architecture.md's section on plugging in models defines, as written."""
    text = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    section = text.split("## Plugging in a cost model or a network", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    names: dict = {}
    for code in blocks:
        exec(compile(code, "docs/architecture.md", "exec"), names)
    return names


_DOC = _doc_examples()
TablePredictor = _DOC["TablePredictor"]
ConstantBandwidthNetwork = _DOC["ConstantBandwidthNetwork"]


NBYTES = 4096.0


def _two_ranks(_p: Program) -> Program:
    """Each of two ranks runs a GEMM, then sends ``NBYTES`` to the other and receives its
    bytes, all on one stream."""
    ranks = []
    for r in range(2):
        b = RankBuilder(r, ("main",))
        t = b.thread("main")
        t.launch(Op("gemm", flops=1e12, hbm_bytes=1e9, op_class="gemm"), "main")
        flows = (Flow("rdma", NBYTES, 1 - r),)
        send = Coll("x", "send", flows)
        t.launch(Op("send", kind="comm", sms=8, op_class="comm", coll=send), "main")
        t.launch(Op("recv", kind="comm", sms=8, op_class="comm", coll=Coll("x", "recv")), "main")
        ranks.append(b)
    return program(ranks, world=2, symmetric=False)


def test_a_plugged_cost_model_and_network_give_the_step_time_by_hand():
    w = ol.workload("deepseek-v3", layers=2)
    table = TablePredictor({"gemm": 32.0, "send": 0.0, "recv": 0.0})
    net = ConstantBandwidthNetwork(2.0, latency_us=3.0)
    res = ol.simulate("serial", w, transform=_two_ranks, cost_model=table, network=net)
    g = res.gpu
    assert 3 * g.launch_us < g.launch_us + 32.0  # the host launches all before the GEMM ends
    assert g.kernel_min_us < 32.0
    # the GEMM starts after one launch and runs 32 µs; the send leaves at once; the receive
    # ends when the other rank's bytes have crossed the network
    assert res.trace.step_time_us == g.launch_us + 32.0 + NBYTES / 2.0 + 3.0
    assert res.trace.meta["cost_model"] == "TablePredictor"
    assert res.trace.meta["network"] == "ConstantBandwidthNetwork"
    default = ol.simulate("serial", w, transform=_two_ranks)
    assert default.trace.step_time_us != res.trace.step_time_us
    assert "cost_model" not in default.trace.meta and "network" not in default.trace.meta


def test_compare_hands_the_models_to_every_run():
    w = ol.workload("deepseek-v3", layers=2, batch=8)
    table = TablePredictor(_Every(1.0))  # every op 1 µs
    c = ol.compare(["serial", "tbo"], w, cost_model=table, network=ConstantBandwidthNetwork(1.0))
    for row in c.rows:
        assert row.result.trace.meta["cost_model"] == "TablePredictor"
        assert row.result.trace.meta["network"] == "ConstantBandwidthNetwork"


class _Every(dict):
    def __init__(self, us: float):
        super().__init__()
        self.value = us

    def __missing__(self, key: str) -> float:
        return self.value
