"""The engine's seams (``sim.models``): the table-driven cost model and the contention-free
network of docs/architecture.md, plugged into ``overlap_lab.simulate``, give the step time
computed by hand; both kinds are chosen by registered name as well, and a bad name or a broken
plug-in is one ConfigError naming it."""

from __future__ import annotations

import re
import sys
import tomllib
import types
from pathlib import Path

import pytest

import overlap_lab as ol
from overlap_lab.cli.main import main
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.ir.builder import RankBuilder, program
from overlap_lab.shared.ir.program import Coll, Flow, Op, Program
from overlap_lab.shared.plugins import Entry
from overlap_lab.sim import models

DOC = Path(__file__).parents[1] / "docs" / "architecture.md"


def doc_blocks() -> tuple[dict, list[str]]:
    """The entry points (TOML) and the module's code blocks (Python) that docs/architecture.md's
    section on plugging in models shows, as written."""
    text = DOC.read_text()
    section = text.split("## Plugging in a cost model or a network", 1)[1].split("\n## ", 1)[0]
    tomls = re.findall(r"```toml\n(.*?)```", section, re.S)
    code = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(tomls) == 1 and len(code) == 2
    return tomllib.loads(tomls[0]), code


def _doc_examples() -> dict:
    names: dict = {}
    for code in doc_blocks()[1]:
        exec(compile(code, "docs/architecture.md", "exec"), names)
    return names


_DOC = _doc_examples()
TablePredictor = _DOC["TablePredictor"]
ContentionFreeNetwork = _DOC["ContentionFreeNetwork"]


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


def test_the_doc_declares_its_examples_as_entry_points():
    eps = doc_blocks()[0]["project"]["entry-points"]
    assert set(eps) == {models.COST_MODEL_GROUP, models.NETWORK_GROUP}
    for group in eps:
        ((_, target),) = eps[group].items()
        module, attr = target.split(":")
        assert module == "my_models" and attr in _DOC, (group, target)
    factory = _DOC[eps[models.COST_MODEL_GROUP]["table"].split(":")[1]]
    assert isinstance(factory(None), TablePredictor)  # the factory builds the predictor
    assert _DOC[eps[models.NETWORK_GROUP]["contention-free"].split(":")[1]] is ContentionFreeNetwork


def test_a_plugged_cost_model_and_network_give_the_step_time_by_hand():
    w = ol.workload("deepseek-v3", layers=2)
    table = TablePredictor({"gemm": 32.0, "comm": 0.0})  # by op class
    net = ContentionFreeNetwork
    res = ol.simulate("serial", w, transform=_two_ranks, cost_model=table, network=net)
    g = res.gpu
    bw, latency = table.link(g, "rdma")  # the port rate and latency the network is given
    assert 3 * g.launch_us < g.launch_us + 32.0  # the host launches all before the GEMM ends
    assert g.kernel_min_us < 32.0
    # the GEMM starts after one launch and runs 32 µs; the send leaves at once; the receive
    # ends when the other rank's bytes have crossed the network, alone on it
    assert res.trace.step_time_us == (g.launch_us + 32.0) + (NBYTES / bw + latency)
    assert res.trace.meta["cost_model"] == "TablePredictor"
    assert res.trace.meta["network"] == "ContentionFreeNetwork"
    assert res.as_dict()["cost_sources"] == {
        "comm": {"TablePredictor": 4},
        "gemm": {"TablePredictor": 2},
    }
    default = ol.simulate("serial", w, transform=_two_ranks)
    assert default.trace.step_time_us != res.trace.step_time_us
    assert (default.trace.meta["cost_model"], default.trace.meta["network"]) == (
        "roofline",
        "max-min",
    )


def test_compare_hands_the_models_to_every_run():
    w = ol.workload("deepseek-v3", layers=2, batch=8)
    table = TablePredictor(_Every(1.0))  # every op 1 µs
    c = ol.compare(["serial", "tbo"], w, cost_model=table, network=ContentionFreeNetwork)
    for row in c.rows:
        assert row.result.trace.meta["cost_model"] == "TablePredictor"
        assert row.result.trace.meta["network"] == "ContentionFreeNetwork"


def test_the_built_in_models_by_name_are_the_defaults():
    w = ol.workload("deepseek-v3", layers=3, batch=16)
    kw = dict(ranks="explicit", imbalance="zipf:1.2")
    default = ol.simulate("tbo", w, **kw)
    named = ol.simulate("tbo", w, cost_model="roofline", network="max-min", **kw)
    assert named.trace.step_time_us == default.trace.step_time_us
    assert named.as_dict() == default.as_dict()
    assert named.trace.meta["profile"] == default.trace.meta["profile"] == "h800-published"
    assert models.COST_MODELS.names()[0] == "roofline"
    assert models.NETWORKS.names()[0] == "max-min"


class _Every(dict):
    def __init__(self, us: float):
        super().__init__()
        self.value = us

    def __missing__(self, key: str) -> float:
        return self.value


def test_an_unknown_name_is_one_line_listing_the_choices(capsys):
    w = ol.workload("deepseek-v3", layers=2)
    with pytest.raises(ConfigError, match=r"^unknown cost model 'nope'; choose from roofline"):
        ol.simulate("serial", w, cost_model="nope")
    with pytest.raises(ConfigError, match=r"^unknown network 'nope'; choose from max-min"):
        ol.simulate("serial", w, network="nope")
    for cmd in ("sim", "compare"):  # compare: before its progress bar starts
        for opt in ("--cost-model", "--network"):
            assert main([cmd, "--layers", "2", "--out", "", opt, "nope"]) == 2
            err = capsys.readouterr().err
            assert err.startswith("overlap-lab: error: unknown "), err
            assert err.count("\n") == 1 and "choose from" in err, err


def _registered(monkeypatch, **targets: str) -> None:
    """Cost models registered under these names (by another package), beside the built-in."""
    entries = dict(models.COST_MODELS.entries)
    entries.update({n: Entry(n, t, "overlap-lab-broken") for n, t in targets.items()})
    monkeypatch.setattr(models.COST_MODELS, "_entries", entries)
    monkeypatch.setattr(models.COST_MODELS, "_loaded", {})


def test_a_cost_model_plugin_that_fails_is_one_line_naming_its_package(monkeypatch):
    mod = types.ModuleType("_ol_test_models")
    mod.raises = lambda profile: 1 / 0
    mod.lacks = lambda profile: object()
    mod.THING = 3
    monkeypatch.setitem(sys.modules, "_ol_test_models", mod)
    _registered(
        monkeypatch,
        raises="_ol_test_models:raises",
        lacks="_ol_test_models:lacks",
        thing="_ol_test_models:THING",
        gone="_ol_no_such_module:f",
    )
    w = ol.workload("deepseek-v3", layers=2)
    for name, why in (
        ("raises", "cannot be built: ZeroDivisionError"),
        ("lacks", "built a model without key, grid, demand"),
        ("thing", "is not callable"),
        ("gone", "cannot be loaded: ModuleNotFoundError"),
    ):
        with pytest.raises(ConfigError) as e:
            ol.simulate("serial", w, cost_model=name)
        msg = str(e.value)
        assert f"cost model {name!r}" in msg and "overlap-lab-broken" in msg, msg
        assert why in msg and "\n" not in msg, msg
    assert ol.simulate("serial", w, cost_model="roofline").trace.step_time_us > 0
