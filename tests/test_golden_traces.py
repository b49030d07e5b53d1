"""Golden Traces: the simulator's output, byte for byte, for symmetric and explicit-rank cases.

Each case stores the SHA-256 of its Chrome trace JSON and of the `sim --json` result (busy times,
per-rank link times, report) in ``tests/golden/traces.json``, plus the step time and span count to
read a failure by. Speed work on the trace post-processing, the network model or the engine must
keep these identical; a deliberate change of the model (or of the seeded routing draws)
regenerates them with ``UPDATE_GOLDEN=1 pytest tests/test_golden_traces.py`` and says why in the
commit. The cases simulate every layer (``fast_forward=False``): the fast-forward gives the same
spans to float round-off, not bit for bit, and tests/test_fast_forward.py holds it to that.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from overlap_lab.api import Result
from overlap_lab.metrics import measure
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.routing import routing_for
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model, with_layers
from overlap_lab.shared.ir.ranks import expand_ranks
from overlap_lab.shared.schedules import ScheduleConfig, build
from overlap_lab.sim import simulate
from overlap_lab.sim.engine import Engine

GOLDEN = Path(__file__).parent / "golden" / "traces.json"
H800 = get_gpu("h800")


def _model(layers: int):
    return with_layers(get_model("deepseek-v3"), layers)  # one dense layer, the rest MoE


def _topk_file(tmp: Path, tokens: int, experts: int = 256, k: int = 8) -> str:
    """A skewed routing sample that does not depend on any random generator: token i's experts
    come from a fixed multiplicative hash, biased towards low ids."""
    rows = []
    for i in range(tokens):
        row: list[int] = []
        j = 0
        while len(row) < k:
            h = (i * 2654435761 + j * 40503 + 12345) % (2**32)
            e = (h % experts) * (h % 7 + 1) // 8  # skew towards low ids
            if e not in row:
                row.append(e)
            j += 1
        rows.append(",".join(map(str, row)))
    path = tmp / "topk.csv"
    path.write_text("\n".join(rows) + "\n")
    return f"file:{path}"


# name -> (schedule, mode, layers, ep, batch, ranks, imbalance, net_group_tol)
CASES = {
    "serial_decode_sym": ("serial", "decode", 5, 32, 128, "symmetric", "balanced", 0.0),
    "tbo_decode_sym": ("tbo", "decode", 5, 32, 128, "symmetric", "balanced", 0.0),
    "sbo_prefill_sym": ("sbo", "prefill", 4, 16, 2, "symmetric", "balanced", 0.0),
    "sbo_off_decode_sym": ("sbo-off", "decode", 5, 32, 128, "symmetric", "balanced", 0.0),
    "deepseek_decode_sym": ("deepseek", "decode", 4, 16, 64, "symmetric", "balanced", 0.0),
    "tbo_decode_explicit_balanced": ("tbo", "decode", 4, 16, 32, "explicit", "balanced", 0.0),
    "tbo_decode_explicit_zipf_tol": ("tbo", "decode", 4, 16, 32, "explicit", "zipf:1.2", 0.02),
    "serial_decode_explicit_zipf_exact": (
        "serial",
        "decode",
        3,
        16,
        32,
        "explicit",
        "zipf:0.8",
        0.0,
    ),
    "tbo_prefill_explicit_file_tol": ("tbo", "prefill", 3, 16, 1, "explicit", "file", 0.02),
    "serial_decode_explicit_file_exact": (
        "serial",
        "decode",
        3,
        16,
        24,
        "explicit",
        "file",
        0.0,
    ),
}


def run_case(name: str, tmp: Path) -> dict:
    schedule, mode, layers, ep, batch, ranks, imb, tol = CASES[name]
    b = (
        Batch.decode(batch, kv_len=2048)
        if mode == "decode"
        else Batch.prefill(batch, extend_len=1024)
    )
    w = Workload(_model(layers), b, Parallel(ep=ep))
    p = build(schedule, w, H800)
    if ranks == "symmetric":
        lowered, trace = p, simulate(p, H800, fast_forward=False)
    else:
        if imb == "file":
            imb = _topk_file(tmp, w.batch.num_tokens * ep)
        lowered = expand_ranks(p, w, H800, routing_for(w, imb, seed=7))
        trace = Engine(lowered, H800, 7, net_group_tol=tol, fast_forward=False).run()
    chrome = json.dumps(trace.to_chrome(), separators=(",", ":"), sort_keys=True)
    metrics = measure(trace, lowered, w, H800.num_sms)
    result = Result(schedule, w, H800, ScheduleConfig(), lowered, trace, metrics)
    res = json.dumps(result.as_dict(), sort_keys=True)  # what `sim --json` prints
    chrome, res = (s.replace(str(tmp), "TMP") for s in (chrome, res))  # the routing file's path
    return {
        "trace_sha256": hashlib.sha256(chrome.encode()).hexdigest(),
        "result_sha256": hashlib.sha256(res.encode()).hexdigest(),
        "step_time_us": trace.step_time_us,
        "num_spans": len(trace.spans),
    }


@pytest.mark.parametrize("name", list(CASES))
def test_golden_trace(name, tmp_path):
    got = run_case(name, tmp_path)
    stored = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if os.environ.get("UPDATE_GOLDEN"):
        stored[name] = got
        GOLDEN.write_text(json.dumps(dict(sorted(stored.items())), indent=1) + "\n")
        return
    assert name in stored, f"no golden trace {name}; run with UPDATE_GOLDEN=1"
    assert got == stored[name]
