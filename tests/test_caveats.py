"""Caveats: ``compare`` and ``sim`` say in one line where a result rests on something the model
treats roughly, each pointing to its section of docs/uncertainty.md, and print a caveat or a
note shared by several schedules once."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import overlap_lab as ol
from overlap_lab.caveats import (
    EXPOSED,
    NORMAL_DECODE,
    SENSITIVE,
    SLOWED,
    comparison_caveats,
    exposed_share,
    result_caveats,
)
from overlap_lab.cli.main import main
from overlap_lab.sensitivity import Design

DOC = Path(__file__).resolve().parents[1] / "docs" / "uncertainty.md"


def _prefill(layers=None):
    return ol.workload(
        "deepseek-v3", mode="prefill", batch=4, extend_len=4096, ep=32, layers=layers
    )


def test_every_caveat_points_to_a_section_that_exists():
    heads = set(re.findall(r"^### (.+)$", DOC.read_text(), re.M))
    from overlap_lab import caveats

    for name in ("EXPOSED", "SLOWED", "ROOFLINE", "UNLIKE", "SENSITIVE", "NORMAL_DECODE"):
        assert getattr(caveats, name) in heads, name


def _prefill_caveats(capsys, ep: int) -> list[str]:
    argv = ["compare", "--mode", "prefill", "--batch", "4", "--extend-len", "4096", "--ep",
            str(ep), "--gpu", "h800", "--schedules", "serial,tbo", "--out", ""]  # fmt: skip
    assert main(argv) == 0
    return [x for x in capsys.readouterr().out.splitlines() if x.startswith("caveat")]


@pytest.mark.parametrize("ep", [32, 64])
def test_compare_prints_its_caveats_on_deepseek_v3_prefill(capsys, ep):
    """DeepSeek-V3 prefill, H800, 4 prompts of 4K per GPU: the table says once, under it, what
    the result rests on: attention and BF16 GEMMs from the roofline, and, where serial's step
    is more than half exposed communication (EP 64: 63 %; EP 32 sits just below, 49.7 %), that
    TBO's gain over it rests on the link model."""
    lines = _prefill_caveats(capsys, ep)
    assert sum("timed from the roofline" in x for x in lines) == 1, lines
    serial = ol.simulate("serial", _prefill_ep(ep), "h800")
    exposed = [x for x in lines if x.startswith("caveat (serial")]
    assert len(exposed) == (serial.metrics.exposed_comm_us > 0.5 * serial.metrics.iteration_us)
    for x in exposed:
        assert "exposed communication is" in x and f'"{EXPOSED}"' in x
        assert "docs/uncertainty.md" in x
    assert ep != 64 or exposed


def _prefill_ep(ep: int):
    return ol.workload("deepseek-v3", mode="prefill", batch=4, extend_len=4096, ep=ep)


def test_a_shared_note_is_printed_once_under_the_table():
    c = ol.compare(["serial", "tbo", "lightllm"], _prefill(layers=4), "h800")
    note = next(n for n in c["tbo"].note.split("; ") if "DeepEP" in n)
    who = [r.schedule for r in c.rows if note in r.note]
    assert len(who) > 1
    text = c.text()
    flat = text.replace("\n  ", " ")
    assert flat.count(note) == 1 and f"(a) {', '.join(who)}: {note}" in flat
    rows = [x for x in text.splitlines() if x.split(" ")[0] in who]
    assert len(rows) == len(who) and all(x.rstrip().endswith("(a)") for x in rows), rows


def test_sim_prints_its_caveats_and_json_carries_them(capsys):
    argv = ["sim", "--mode", "prefill", "--batch", "4", "--ep", "64", "--out", ""]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert any(
        x.strip().startswith("caveat (serial): exposed communication") for x in out.splitlines()
    )
    assert main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert any(EXPOSED in c for c in d["caveats"])
    assert sum(d["cost_share"].values()) == pytest.approx(1.0)


def test_exposed_caveat_follows_the_threshold():
    r = ol.simulate("serial", _prefill(layers=4), "h800")
    has = any(c.kind == "exposed" for c in result_caveats(r))
    assert has == (exposed_share(r) > 0.5)


def test_tbo_sbo_near_serial_in_decode_names_the_sharing_it_rests_on():
    """TBO+SBO's decode step is slowed by its kernels sharing the GPU (SBO's combine holds 3 SMs
    while the other micro-batch's attention starts): the caveat names it."""
    r = ol.simulate("tbo+sbo", ol.workload("deepseek-v3", batch=128, ep=32), "h800")
    slowed = [c for c in result_caveats(r) if c.kind == "slowed"]
    assert len(slowed) == 1 and f'"{SLOWED}"' in slowed[0].line()


def test_the_roofline_caveat_says_when_everything_is_the_roofline():
    w = ol.workload("deepseek-v3", batch=64, ep=16, layers=3)
    r = ol.simulate("serial", w, "h800", profile="roofline")
    roof = [c for c in result_caveats(r) if c.kind == "roofline"]
    assert len(roof) == 1 and roof[0].text.startswith("100 %")


def test_a_win_inside_the_sensitivity_range_is_named():
    """Whatever the design gives, the caveats say exactly what its ranges say: the schedules
    ahead of serial it does not separate from serial, and the fastest one's close rivals."""
    w = ol.workload("deepseek-v3", batch=128, ep=32, layers=4)
    design = Design(oat=True, lhs=0, inputs=("hbm", "rdma"))
    c = ol.compare(["serial", "tbo", "tbo+sbo"], w, "h800", sensitivity=design)
    s = c.sensitivity
    got = [x for x in comparison_caveats(c) if x.kind == "sensitivity"]
    ahead = {r.schedule for r in c.rows if r.schedule != "serial" and r.speedup > 1
             and not s.separated(r.schedule, "serial")}  # fmt: skip
    gain = [x for x in got if "gain over serial" in x.text]
    assert set(gain[0].schedules if gain else ()) == ahead
    best = max(c.rows, key=lambda r: r.result.metrics.tokens_per_s_gpu).schedule
    rivals = [
        r.schedule for r in c.rows if r.schedule != best and not s.separated(best, r.schedule)
    ]
    fastest = [x for x in got if "fastest" in x.text]
    assert bool(fastest) == bool(rivals)
    assert all(f'"{SENSITIVE}"' in x.line() for x in got)


@pytest.mark.parametrize("mode", ["normal", "low_latency", "auto"])
def test_a_decode_step_on_deepeps_normal_kernels_says_so(mode):
    """sim and compare name the decode runs whose DeepEP mode resolves to normal (the model has
    those kernels ahead of the low-latency ones; nothing measured says so), and only those."""
    w = ol.workload("deepseek-v3", batch=64, ep=16, layers=2)
    r = ol.simulate("serial", w, "h800", {"deepep_mode": mode})
    said = [c for c in result_caveats(r) if c.kind == "normal_decode"]
    assert len(said) == (mode == "normal")
    if said:
        assert said[0].schedules == ("serial",) and NORMAL_DECODE in said[0].line()


def test_prefill_on_the_normal_kernels_is_no_such_caveat():
    r = ol.simulate("serial", _prefill(layers=2), "h800", {"deepep_mode": "normal"})
    assert not [c for c in result_caveats(r) if c.kind == "normal_decode"]
