"""The event loop's fast paths give what the general paths give (issue 12): spans written as one
``__dict__``, a pass that cut or grew nothing settled without a second ``_advance``."""

from __future__ import annotations

import dataclasses

import pytest

from overlap_lab.shared import schedules
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model
from overlap_lab.shared.outputs.trace import Span, new_span
from overlap_lab.sim import resources
from overlap_lab.sim.engine import Engine

GPU = get_gpu("h800")
MODEL = get_model("deepseek-v3", num_layers=4)


@pytest.mark.parametrize(
    "args",
    [
        (0, "stream:main", "gemm", "compute", 1.5, 2.25, 132, 0, 3, 1),
        (3, "host:t0", "launch", "host", 0.0, 4.0),
        (1, "link:rdma", "dispatch", "link", 2.0, 2.0, 0, None, 7),
    ],
)
def test_new_span_is_a_span(args):
    a, b = Span(*args), new_span(*args)
    assert type(b) is Span
    assert a == b and hash(a) == hash(b) and repr(a) == repr(b)
    assert [getattr(b, f.name) for f in dataclasses.fields(Span)] == [
        getattr(a, f.name) for f in dataclasses.fields(Span)
    ]
    assert list(vars(b)) == list(vars(a))  # same field order: same pickles and exports
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.end = 9.0


def test_new_span_is_checked_as_a_span():
    with pytest.raises(ConfigError, match="end"):
        new_span(0, "stream:main", "gemm", "compute", 2.0, 1.0)
    with pytest.raises(ConfigError, match="kind"):
        new_span(0, "stream:main", "gemm", "nonsense", 1.0, 2.0)


@pytest.mark.parametrize("name", ["tbo", "sbo", "deepseek", "serial", "sglang-overlap"])
@pytest.mark.parametrize(
    "batch", [Batch.decode(128, kv_len=4096), Batch.prefill(2, extend_len=4096)], ids=str
)
def test_a_pass_settles_as_changed_would(name, batch, monkeypatch):
    """``Gpu._grant`` skips the second ``_advance`` unless a cohort was cut or grew: the trace is
    the one of a run where every pass goes through ``changed`` (``_advance`` again, then
    ``_settle``), as before the fast path."""
    program = schedules.build(name, Workload(MODEL, batch, Parallel(ep=8)), GPU)
    fast = Engine(program, GPU, 0).run()
    calls = {"settled": 0}
    cut = resources.Gpu._cut

    def always_reshaped(self):
        self._reshaped = True  # every pass takes the general path: changed()
        calls["settled"] += 1
        return cut(self)

    monkeypatch.setattr(resources.Gpu, "_cut", always_reshaped)
    assert Engine(program, GPU, 0).run() == fast
    assert calls["settled"] > 0
