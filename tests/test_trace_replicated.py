"""A replicated Trace (``Trace.replicated``: a reduced explicit run, ``shared.ir.symmetry``) must be
the Trace of all its spans: the same spans in the same order, the same per-rank figures, and the
same Chrome export byte for byte, though it works them out on the model rank and copies the other
ranks' spans only when they are read."""

from __future__ import annotations

import json
import pickle

import pytest

from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.routing import routing_for
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model, with_layers
from overlap_lab.shared.ir.ranks import expand_ranks
from overlap_lab.shared.ir.symmetry import Reduction, expand_trace, reduce_program
from overlap_lab.shared.outputs.trace import Span, Trace
from overlap_lab.shared.schedules import build
from overlap_lab.sim import simulate

H800 = get_gpu("h800")


def _fresh(schedule: str, ep: int = 16) -> Trace:
    """The reduced run's replicated Trace, none of its ranks' copies read yet."""
    w = Workload(
        with_layers(get_model("deepseek-v3"), 3), Batch.decode(32, kv_len=1024), Parallel(ep=ep)
    )
    x = expand_ranks(build(schedule, w, H800), w, H800, routing_for(w, "balanced", seed=0))
    red = reduce_program(x, 8)
    assert isinstance(red, Reduction), red
    rep = expand_trace(simulate(red.program, H800), red)
    assert "_alike" in rep.__dict__ and "_spans" not in rep.__dict__
    return rep


def _pair(schedule: str) -> tuple[Trace, Trace]:
    """(a fresh replicated Trace, a plain Trace of the same run's spans and meta)."""
    rep = _fresh(schedule)
    plain = Trace(tuple(_fresh(schedule).spans), dict(rep.meta))
    assert "_alike" not in plain.__dict__
    return rep, plain


@pytest.mark.parametrize("schedule", ["tbo", "sbo", "deepseek"])
def test_replicated_trace_exports_the_same_bytes(schedule):
    fresh, plain = _pair(schedule)
    a = json.dumps(fresh.to_chrome(), separators=(",", ":"))
    done = "_spans" in fresh.__dict__
    assert not done  # exported from rank 0's spans alone, no rank's copies made
    assert a == json.dumps(plain.to_chrome(), separators=(",", ":"))
    assert Trace.from_chrome(json.loads(a)).spans == plain.spans


@pytest.mark.parametrize("schedule", ["tbo", "deepseek"])
def test_replicated_trace_figures_match_the_plain_trace(schedule):
    fresh, plain = _pair(schedule)
    assert fresh.ranks == plain.ranks == tuple(range(16))
    assert fresh.step_time_us == plain.step_time_us
    assert fresh.busy_us() == plain.busy_us()
    assert list(fresh.busy_us()) == list(plain.busy_us())  # the same key order too
    assert fresh.per_rank_step_us() == plain.per_rank_step_us()
    assert fresh.summary() == plain.summary()
    for r in (0, 5, 15):
        assert fresh.lanes(r) == plain.lanes(r)
        assert fresh.tracks(r) == plain.tracks(r)
        assert fresh.busy_us(rank=r) == plain.busy_us(rank=r)
        assert fresh.spans_of(r) == plain.spans_of(r)
        assert fresh.exposed_comm_us(r) == plain.exposed_comm_us(r)
    assert fresh == plain and fresh.spans == plain.spans  # materialised on demand, in order
    assert all(s.rank == r for r in fresh.ranks for s in fresh.spans_of(r))


def test_replicated_trace_pickles_and_rejects_a_wrong_model():
    plain = _pair("tbo")[1]
    back = pickle.loads(pickle.dumps(_fresh("tbo")))
    assert back == plain and back.busy_us() == plain.busy_us()
    s = Span(1, "stream:main", "x", "compute", 0.0, 1.0)
    with pytest.raises(ValueError):
        Trace.replicated((s,), (0, 1), {})  # the model's spans must be the first rank's
    assert Trace().spans == () and Trace.__dataclass_fields__["spans"].default == ()


def test_chrome_export_shares_only_equal_args():
    """Events share an args dict only where JSON writes the same: 1, 1.0 and True differ."""
    spans = [
        Span(r, "stream:main", "x", "compute", 0.0, 1.0, sms=v, layer=2)
        for r, v in enumerate((1, 1.0, True, 1))
    ]
    doc = Trace(spans).to_chrome()
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [json.dumps(e["args"]["sms"]) for e in slices] == ["1", "1.0", "true", "1"]
    assert slices[0]["args"] is slices[3]["args"]
