"""Measured profiles under overrides and the built-in h200-measured profile: an override drops
only the rows it invalidates (and says so), the API's link overrides move DeepEP's rate as the
command line does, ``--gpu h200`` takes its GEMM and decode-attention durations from
``h200-measured``, and the wave model's check against that profile's SM-count rows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import overlap_lab as ol
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.ir.ops import gemm
from overlap_lab.shared.ir.program import Op
from overlap_lab.sim import cost
from overlap_lab.sim.profile import default_profile, from_json, load_profile
from overlap_lab.sim.profiles import h200_measured

ROOT = Path(__file__).resolve().parents[1]


def _sources(res) -> dict[str, int]:
    d = res.as_dict()
    by = d["cost_sources"].values()
    return {s: sum(c.get(s, 0) for c in by) for s in ("profile", "roofline")}


def _wl(**kw):
    return ol.workload("deepseek-v3", batch=128, layers=4, **kw)


def test_link_override_keeps_every_measured_row():
    base = ol.simulate("serial", _wl(), "h800")
    moved = ol.simulate("serial", _wl(), ol.gpu("h800", rdma_gbps=50.001))
    assert _sources(moved) == _sources(base) and _sources(base)["profile"] > 0
    assert moved.as_dict()["profile"] == "h800-published"
    assert not any("dropped" in n for n in moved.as_dict()["notes"])


def test_sbo_comm_sms_override_keeps_rows():
    base = ol.simulate("serial", _wl(), "h800")
    other = ol.simulate("serial", _wl(), ol.gpu("h800", sbo_comm_sms=8))
    assert _sources(other) == _sources(base)


def test_hbm_override_drops_rows_and_says_so():
    res = ol.simulate("serial", _wl(), ol.gpu("h800", hbm_gbps=2000.0))
    d = res.as_dict()
    assert _sources(res)["profile"] == 0
    notes = [n for n in d["notes"] if "dropped" in n]
    assert len(notes) == 1 and "hbm_gbps 3350 -> 2000" in notes[0]


def test_api_rdma_override_moves_deepep_rate_as_the_cli():
    g = ol.gpu("h800", rdma_gbps=25.0)
    assert g.rdma_eff_gbps == pytest.approx(44.0 * 25.0 / 50.0)
    slow = ol.simulate("serial", _wl(), g).metrics.iteration_us
    fast = ol.simulate("serial", _wl(), "h800").metrics.iteration_us
    assert slow > fast


def test_default_profile_of_an_overridden_preset_is_the_preset_profile():
    assert default_profile("h800+rdma-gbps=50.001") == "h800-published"
    assert default_profile("h200") == "h200-measured"


def test_h200_takes_gemm_and_decode_attention_from_h200_measured():
    res = ol.simulate("serial", _wl(), "h200")
    d = res.as_dict()
    assert d["profile"] == "h200-measured"
    assert d["cost_sources"]["gemm"].get("profile", 0) > 0
    assert d["cost_sources"]["attention"] == {"profile": 4}


def test_h200_profile_builds_from_the_repo_and_cites_lines():
    doc = h200_measured.build()
    shipped = json.loads((ROOT / "sim/profiles/h200-measured.json").read_text())
    assert json.loads(json.dumps(doc, ensure_ascii=False)) == shipped
    lines = (ROOT / "sim/profiles/h200-measured-rows.jsonl").read_text().splitlines()
    assert len(doc["rows"]) == len(lines)
    for i, r in enumerate(doc["rows"], start=1):
        assert f"line {i} (2026-11-26" in r["source"]
    assert load_profile("h200-measured").gpu


def test_prefill_attention_takes_no_decode_attention_row():
    res = ol.simulate("serial", ol.workload("deepseek-v3", mode="prefill", batch=1,
                                            extend_len=1024, layers=4), "h200")  # fmt: skip
    assert res.as_dict()["cost_sources"]["attention"] == {"roofline": 4}


def _wave_errors() -> dict[tuple[int, int, int, int], float]:
    """Relative error of the wave model carrying each 132-SM FP8 row to 108 and 66 SMs."""
    g = get_gpu("h200")
    rows = [json.loads(t) for t in h200_measured.RAW.read_text().splitlines()]
    fp8 = [r for r in rows if r["kind"] == "fp8_gemm_nt"]
    base = {(r["M"], r["N"], r["K"]): r for r in fp8 if r["sms"] == 132}
    out = {}
    for r in rows:
        if r["kind"] != "fp8_gemm_nt" or r["sms"] == 132:
            continue
        w = gemm(r["M"], r["K"], r["N"], 1)
        op = Op("attn.prepare", tokens=r["M"], flops=w.flops, hbm_bytes=w.hbm_bytes,
                op_class="gemm", dtype="fp8")  # fmt: skip
        one = {"op": "gemm", "dtype": "fp8", "size": r["M"], "sms": 132,
               "us": base[(r["M"], r["N"], r["K"])]["us"], "flops": w.flops}  # fmt: skip
        p = from_json({"format": "overlap-lab-profile/1", "device": "H200", "date": "d",
                       "software": {}, "source": "test", "rows": [one]})  # fmt: skip
        out[(r["M"], r["N"], r["K"], r["sms"])] = cost.profiled_us(op, g, r["sms"], p) / r["us"] - 1
    return out


def test_wave_model_against_h200_sm_rows_or_the_doc_says_where_not():
    """Within 10 %, or the row is listed in docs/models-and-gpus.md's table of misses."""
    doc = (ROOT / "docs/models-and-gpus.md").read_text()
    listed = set(re.findall(r"\| (\d+) \| (\d+)×(\d+) \| (\d+) \|", doc))
    errs = _wave_errors()
    assert len(errs) == 18
    for (m, n, k, sms), e in errs.items():
        miss = abs(e) > 0.10
        assert miss == ((str(m), str(n), str(k), str(sms)) in listed), (m, n, k, sms, e)


def test_a_renamed_copy_of_a_preset_keeps_its_profile(tmp_path):
    """A GPU file equal to the h800 preset but for its name (and its links) takes
    h800-published: the rows' measured configuration, not the name, decides."""
    fields = dict(get_gpu("h800").__dict__, name="my-h800", rdma_gbps=25.0)
    path = tmp_path / "my-h800.json"
    path.write_text(json.dumps(fields))
    base = ol.simulate("serial", _wl(), "h800")
    mine = ol.simulate("serial", _wl(), ol.gpu(path))
    assert mine.as_dict()["profile"] == "h800-published"
    assert _sources(mine) == _sources(base)
    assert default_profile("h100") == "roofline"  # another preset keeps its own default
