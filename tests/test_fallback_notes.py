"""Every fallback a schedule takes is a note: in ``Result.notes`` (the JSON's ``notes``), in the
``sim`` summary and in ``compare``'s note column; and the docs say what DeepSeek's schedule does
with one prefill request."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from overlap_lab import api
from overlap_lab.cli.main import main
from overlap_lab.shared.ir.program_meta import ProgramMeta
from overlap_lab.shared.outputs.trace import Span, Trace
from overlap_lab.shared.schedules.fallbacks import fallback_notes

ROOT = Path(__file__).parents[1]
LITE = dict(model_spec="deepseek-v2-lite", layers=3, ep=8)


def one_prefill(**kw):
    return api.workload(**LITE, mode="prefill", batch=1, extend_len=512, **kw)


def notes_of(schedule: str, w, **cfg) -> list[str]:
    return list(api.simulate(schedule, w, config=cfg or None).notes)


@pytest.mark.parametrize(
    "schedule, w, fragment",
    [
        ("tbo+sbo", api.workload(**LITE, mode="prefill", batch=4, extend_len=512), "ran as tbo"),
        ("sbo", api.workload(**LITE, mode="prefill", batch=4, extend_len=512), "ran as serial"),
        ("lightllm", one_prefill(), "micro-batch 1 empty: 0 tokens padded to 1"),
        ("lightllm", api.workload(**LITE, batch=1), "micro-batch 1 empty: 0 tokens padded to 1"),
        ("tbo", api.workload(**LITE, batch=1), "ran unsplit"),
        ("deepseek", api.workload(**LITE, batch=1), "ran unsplit"),
        ("vllm-dbo", api.workload(**LITE, batch=1), "ran unsplit"),
    ],
)
def test_each_fallback_is_a_note(schedule, w, fragment):
    notes = notes_of(schedule, w)
    assert any(fragment in n for n in notes), notes
    assert api.simulate(schedule, w).as_dict()["notes"] == notes


def test_sbo_off_says_it_ran_as_serial():
    """Serial's time: its shared experts on the other stream overlap nothing but the gaps a
    replayed graph leaves before each kernel (``graph_kernel_gap_us``: one per MoE layer)."""
    for w in (api.workload(**LITE, batch=16), one_prefill()):
        res, ser = api.simulate("sbo-off", w), api.simulate("serial", w)
        gaps = w.model.num_layers * api.gpu("h800").graph_kernel_gap_us
        # the shared experts' GEMM overlaps nothing; only their SiLU-and-mul, a small waved
        # kernel, may run beside top-k's for a few µs
        assert res.metrics.iteration_us == pytest.approx(
            ser.metrics.iteration_us, rel=0.01, abs=gaps
        )
        assert res.metrics.iteration_us <= ser.metrics.iteration_us
        assert any(n.startswith("ran as serial: the shared experts") for n in res.notes)


def test_sbo_off_overlapping_says_nothing():
    """The note reads the trace: shared experts beside another kernel are no fallback."""

    def span(op, lane, start, end):
        return Span(0, lane, op, "compute", start, end)

    meta = ProgramMeta.from_dict({"schedule": "sbo-off", "shared_experts_stream": "alt"})
    alone = Trace([span("gate", "stream:main", 0, 1), span("shared_experts", "stream:alt", 1, 2)])
    beside = Trace([span("topk", "stream:main", 0, 2), span("shared_experts", "stream:alt", 1, 3)])
    assert fallback_notes(meta, alone) and not fallback_notes(meta, beside)


def test_forced_serial_iterations_are_a_note():
    w = api.workload(**LITE, batch=16)
    notes = notes_of("sglang-overlap", w, disable_overlap_schedule=True)
    assert any("without overlap: --disable-overlap-schedule" in n for n in notes), notes


def test_sim_summary_and_compare_column_print_the_notes(capsys, tmp_path):
    empty = "micro-batch 1 empty: 0 tokens padded to 1"
    argv = ["sim", "--schedule", "lightllm", "--model", "deepseek-v2-lite", "--layers", "3"]
    argv += ["--ep", "8", "--batch", "1"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    assert f"note: {empty}" in capsys.readouterr().out
    assert main([*argv, "--json", "--out", str(tmp_path / "b")]) == 0
    assert empty in json.loads(capsys.readouterr().out)["notes"]
    table = api.compare(["serial", "sbo-off", "lightllm"], api.workload(**LITE, batch=1))
    assert table["lightllm"].note == empty
    assert table["sbo-off"].note.startswith("ran as serial")
    row = next(line for line in table.text().splitlines() if line.startswith("lightllm"))
    assert row.endswith(empty)


def test_deepseek_splits_one_prefill_request_as_the_docs_say():
    w = api.workload(**LITE, mode="prefill", batch=1, extend_len=8192)
    res = api.simulate("deepseek", w)
    split = [mb["tokens"] for mb in res.as_dict()["micro_batches"]]
    assert split == [5792, 2400] and not res.notes
    docs = (ROOT / "docs" / "schedules.md").read_text()
    section = docs[docs.index("## deepseek") : docs.index("## pp")]
    assert "5792 + 2400" in section and "same prompt may be split" in section
    assert not re.search(r"one-request batch runs unsplit", section)
