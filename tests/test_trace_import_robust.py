"""Malformed Chrome traces and out-of-range sizes end in one line and exit 2, not a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from overlap_lab.cli.main import main
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.outputs.trace import Trace


def kernel(**kw) -> dict:
    e = {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 5, "pid": 0, "tid": 7}
    return {**e, "args": {"device": 0, "stream": 7}, **kw}


def ours(**kw) -> dict:
    e = {"ph": "X", "name": "a", "ts": 0, "dur": 1, "pid": 0}
    return {**e, "args": {"lane": "stream:main", "kind": "compute"}, **kw}


def no_ts() -> list:
    e = kernel()
    del e["ts"]
    return [e, kernel(ts=10)]


CASES = {
    "no ts": (no_ts(), "trace event 0 ('gemm'): no 'ts' field"),
    "dur x": ([kernel(dur="x")], "dur 'x' is not a number"),
    "pid rank x": ([ours(pid="rank x")], "pid 'rank x' is not an integer"),
    "ours no ts": ([{k: v for k, v in ours().items() if k != "ts"}], "no 'ts' field"),
    "args a list": ([ours(args=[1])], "args is not a JSON object"),
    "event a number": ([3], "trace event 0 (None): not a JSON object"),
    "sms text": (
        [ours(args={"lane": "stream:main", "kind": "compute", "sms": "x"})],
        "sms 'x' is not an integer",
    ),
    "ts 1e300": ([kernel(ts=1e300), kernel()], "ts 1e+300 lies more than"),
}


def one_line_error(capsys, argv: list[str], expect: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("overlap-lab: error: ") and err.count("\n") == 1, err
    assert expect in err, err


@pytest.mark.parametrize("case", sorted(CASES))
def test_analyze_refuses_a_malformed_event(tmp_path: Path, capsys, case: str) -> None:
    events, expect = CASES[case]
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"traceEvents": events}))
    one_line_error(capsys, ["analyze", str(f), "--out", ""], expect)


@pytest.mark.parametrize("text", ["Infinity", "NaN", "-Infinity"])
def test_a_time_that_is_not_finite_is_refused(tmp_path: Path, capsys, text: str) -> None:
    good = json.dumps(kernel())
    bad = good.replace('"ts": 0', f'"ts": {text}')
    f = tmp_path / "t.json"
    f.write_text(f'{{"traceEvents": [{bad}, {good}]}}')
    one_line_error(capsys, ["analyze", str(f), "--json"], "is not a finite number")
    bad = good.replace('"dur": 5', f'"dur": {text}')
    f.write_text(f'{{"traceEvents": [{bad}]}}')
    one_line_error(capsys, ["analyze", str(f), "--json"], "dur")


def test_deeply_nested_json_is_refused(tmp_path: Path, capsys) -> None:
    f = tmp_path / "deep.json"
    f.write_text("[" * 100_000 + "]" * 100_000)
    one_line_error(capsys, ["analyze", str(f), "--out", ""], "not JSON (nested more than 100")
    m = tmp_path / "map.json"
    m.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match="nested more than 100 deep"):
        from overlap_lab.shared.outputs.analyze import load_mapping

        load_mapping(m)


def test_validate_refuses_a_span_at_1e300(tmp_path: Path, capsys) -> None:
    out = tmp_path / "sim"
    assert main(["sim", "--schedule", "serial", "--layers", "2", "--out", str(out)]) == 0
    doc = json.loads((out / "trace.json").read_text())
    x = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    x[3]["ts"] = 1e300
    f = tmp_path / "v.json"
    f.write_text(json.dumps(doc))
    capsys.readouterr()
    one_line_error(capsys, ["validate", str(f), "--layers", "2", "--out", ""], "ts 1e+300")


def test_epoch_based_profiler_times_are_rebased_not_refused() -> None:
    t0 = 1.7e15  # Kineto: µs since the epoch
    t = Trace.from_chrome([kernel(ts=t0), kernel(ts=t0 + 10)])
    assert [s.start for s in t.spans] == [0.0, 10.0] and t.meta["time_origin_us"] == t0


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_calibrate_sizes_beyond_a_workload_are_refused(capsys, mode: str) -> None:
    argv = ["calibrate", "--device", "cuda", "--mode", mode, "--sizes", "99999999999999999999"]
    one_line_error(capsys, argv, "--sizes: 99999999999999999999 is beyond")
