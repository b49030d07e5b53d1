"""Re-judging a recorded loop offline (``--replay``): a small archive of the H200 recordings
(tests/data/README.md: decode 128, serial and TBO, one eager run and one graph replay of each
kernel record) replayed through today's calibration and simulator, and the table's numbers
checked against a computation by hand from the archive's raw records: the gap between the
graph's kernels, the calibrated duration of an op, the predicted step as the graph runs it (its
ops back to back, the measured gap before each), the errors, their median and the verdict."""

from __future__ import annotations

import gzip
import json
import re
import statistics
import tarfile
from pathlib import Path

import pytest

pytest.importorskip("simpy")

from overlap_lab.experiments import gpu_validation as GV  # noqa: E402
from overlap_lab.shared.inputs.hardware import get_gpu  # noqa: E402
from overlap_lab.shared.outputs.trace import Trace  # noqa: E402

ARCHIVE = Path(__file__).parent / "data" / "h200_decode128_replay.tar.gz"
CASE = "h200_decode128_replay/decode_128"
RANGE = re.compile(r"^(.+)\.L(None|\d+)\.mb(\d+)$")


def _member(name: str):
    with tarfile.open(ARCHIVE) as tar:
        return json.load(gzip.open(tar.extractfile(f"{CASE}/{name}")))


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    out = tmp_path_factory.mktemp("replay")
    report = GV.replay(ARCHIVE, out=out)
    with tarfile.open(report["archive"]) as tar:
        tar.extractall(out, filter="data")
    return report, out / Path(report["archive"]).name.removesuffix(".tar.gz") / "decode_128"


def _by_hand(kernels: dict) -> tuple[dict, list]:
    """Each graph-replayed op's kernels (count, device µs), from the raw records: the eager
    run's launches inside each op's range, in launch order, are the graph's kernels in device
    order one for one (one stream); and the replay's device records."""
    ev = kernels["traceEvents"]
    graph = next(e for e in ev if e["name"] == "cudaGraphLaunch")
    ranges = []
    for e in ev:
        if e["cat"] == "user_annotation":
            op, layer, mb = RANGE.match(e["name"]).groups()
            ranges.append((e["ts"], e["ts"] + e["dur"], (op, None if layer == "None" else
                                                          int(layer), int(mb))))  # fmt: skip
    outside = {r[2] for r in ranges if r[0] > graph["ts"]}  # launched by range in the replay
    device = {}
    for e in ev:
        if e["cat"] in ("kernel", "gpu_memcpy", "gpu_memset"):
            device.setdefault(e["args"]["correlation"], []).append(e)
    body = []
    for e in sorted((e for e in ev if e["cat"] in ("cuda_runtime", "cuda_driver")
                     and e["ts"] < graph["ts"]), key=lambda e: e["args"]["correlation"]):  # fmt: skip
        op = next(r[2] for r in ranges if r[0] <= e["ts"] <= r[1])
        if op not in outside:
            body += [(op, k) for k in device.get(e["args"]["correlation"], [])]
    replay = sorted(device[graph["args"]["correlation"]], key=lambda k: k["ts"])
    assert [k["name"] for _, k in body] == [k["name"] for k in replay]
    ops: dict = {}
    for (op, _), k in zip(body, replay, strict=True):
        n, us = ops.get(op, (0, 0.0))
        ops[op] = (n + 1, us + k["dur"])
    return ops, replay


def _ops(trace: Trace) -> list[tuple[str, int | None, float, float]]:
    """(op, layer, start, end) of each op on the stream, its SM-grant segments joined."""
    out: list = []
    for s in sorted((s for s in trace.spans if s.lane == "stream:main"), key=lambda s: s.start):
        if out and out[-1][:2] == (s.op, s.layer) and out[-1][3] == s.start:
            out[-1] = (s.op, s.layer, out[-1][2], s.end)
        else:
            out.append((s.op, s.layer, s.start, s.end))
    return out


def test_the_gap_is_the_recorded_step_less_the_replays_kernels(replayed):
    report, _ = replayed
    measured = _member("serial.measured.trace.json.gz")["otherData"]
    step = measured["graph_replay_step_time_us"]
    _, replay = _by_hand(_member("calibration/serial_128.kernels.json.gz"))
    gap = (step - sum(k["dur"] for k in replay)) / len(replay)
    assert len(replay) == 715
    assert report["cases"]["decode_128"]["graph_kernel_gap_us"]["us"] == pytest.approx(gap)


def test_an_op_is_predicted_with_its_kernels_and_their_inner_gaps(replayed):
    """``experts`` runs at 128 tokens only in serial's three MoE layers: its profile row is
    their mean device time, each with the gaps between its own kernels; ``attn.core`` at 128
    tokens also in TBO's dense layer (it runs the whole batch), pooled."""
    report, folder = replayed
    gap = report["cases"]["decode_128"]["graph_kernel_gap_us"]["us"]
    serial, _ = _by_hand(_member("calibration/serial_128.kernels.json.gz"))
    tbo, _ = _by_hand(_member("calibration/tbo_128.kernels.json.gz"))
    pred = Trace.from_chrome(folder / "serial.predicted.trace.json.gz")
    span = {(op, layer): end - start for op, layer, start, end in _ops(pred)}

    def calibrated(ops, name, mbs=(0,)):
        return [us + (n - 1) * gap for (op, layer, mb), (n, us) in ops.items()
                if op == name and layer is not None and mb in mbs]  # fmt: skip

    experts = statistics.mean(calibrated(serial, "experts"))
    assert [span[("experts", i)] for i in (1, 2, 3)] == pytest.approx([experts] * 3)
    attn = calibrated(serial, "attn.core") + [
        us + (n - 1) * gap for (op, layer, _), (n, us) in tbo.items()
        if op == "attn.core" and layer == 0
    ]  # fmt: skip
    assert len(attn) == 5
    assert span[("attn.core", 2)] == pytest.approx(statistics.mean(attn))


def test_the_predicted_step_is_the_graph_as_replayed(replayed):
    """serial's prediction, by hand: the executor's host work (its measured spans, not SGLang's
    scheduler costs), one graph launch, then every op of the graph after the gap, back to back
    on the one stream; the copy after the graph (no gap: it is launched alone), the host's
    result processing."""
    report, folder = replayed
    gap = report["cases"]["decode_128"]["graph_kernel_gap_us"]["us"]
    launch = report["cases"]["decode_128"]["graph_launch_us"]["us"]  # the measured wait
    measured = Trace.from_chrome(_member("serial.measured.trace.json.gz"))
    host = {s.op: s.duration for s in measured.spans if s.kind == "host"}
    assert set(host) == {"schedule", "process_result"} and max(host.values()) < 1.0
    pred = Trace.from_chrome(folder / "serial.predicted.trace.json.gz")
    ops = _ops(pred)
    graph, d2h = ops[:-1], ops[-1]
    assert d2h[0] == "d2h" and d2h[2] == pytest.approx(graph[-1][3])
    assert graph[0][2] == pytest.approx(host["schedule"] + launch + gap)
    assert [b[2] - a[3] for a, b in zip(graph, graph[1:])] == pytest.approx(
        [gap] * (len(graph) - 1)
    )
    by_hand = (host["schedule"] + launch + sum(gap + e - s for *_, s, e in graph)
               + d2h[3] - d2h[2] + host["process_result"])  # fmt: skip
    row = report["cases"]["decode_128"]["runs"]["serial"]["comparison"]["step_time_us"]
    assert row["predicted"] == pytest.approx(by_hand, rel=1e-12)
    assert pred.step_time_us == pytest.approx(by_hand, rel=1e-12)


def test_the_table_and_verdict_are_the_numbers_by_hand(replayed):
    report, _ = replayed
    runs = report["cases"]["decode_128"]["runs"]
    rows = {}
    for name in ("serial", "tbo"):
        meas = _member(f"{name}.measured.trace.json.gz")["otherData"]["graph_replay_step_time_us"]
        st = runs[name]["comparison"]["step_time_us"]
        assert st["measured"] == meas
        rows[name] = (st["predicted"], meas, st["predicted"] / meas - 1)
        assert runs[name]["roofline_ops"] == [] and runs[name]["comparable"]
    text = report["table"]
    assert text.startswith("**REPLAY of h200_decode128_replay.tar.gz**")
    for name, (p, m, e) in rows.items():
        assert f"| decode_128 | {name} | {p:.1f} | {m:.1f} | graph replay | {e:+.1%} |" in text
    med = statistics.median(abs(e) for _, _, e in rows.values())
    worst = max(rows, key=lambda n: abs(rows[n][2]))
    line = text.rstrip().splitlines()[-1]
    assert line == GV.verdict_line(report["verdict"])
    assert line.startswith(f"VERDICT {'PASS' if report['verdict']['pass'] else 'FAIL'}: "
                           f"median |step error| {med:.1%} (<= 5% ")  # fmt: skip
    assert f"max {abs(rows[worst][2]):.1%} decode_128/{worst} " in line
    same = rows["serial"][0] < rows["tbo"][0] and rows["serial"][1] < rows["tbo"][1]
    assert same and "ranking the same in 1/1 cases" in line
    # what the prediction changed to run as the executor ran: its host work, no kernel-less op
    assert runs["serial"]["predicted_as_executed"].startswith("host work as the executor's")


def test_replay_from_the_command_line_and_its_refusals(tmp_path, capsys):
    rc = GV.main(["--replay", str(ARCHIVE), "--out", str(tmp_path)])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and out[-1].startswith("VERDICT ")
    assert (tmp_path / "h200_decode128_replay_replay.tar.gz").is_file()
    assert GV.main(["--replay", str(tmp_path / "missing.tar.gz")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("--replay: no archive at ")


def test_rows_from_a_schedules_own_run_are_device_time_not_eager_spans():
    """An op the calibration has no row for is timed from the schedule's own run: recorded with
    its kernels, the row is the op's device time (here serial's ``experts``, its row taken out
    of the profile, from the recorded run: the mean of its three layers' replayed kernels and
    their inner gaps), never its eager CUDA-event span, which holds launch gaps; the run's
    record says which."""
    import dataclasses
    import tempfile

    from overlap_lab.calibrate import apply_device_time
    from overlap_lab.sim.profile import from_json

    report_setup, mc = GV.replay_setup(ARCHIVE)
    with tarfile.open(ARCHIVE) as tar, tempfile.TemporaryDirectory() as d:
        tar.extractall(d, filter="data")
        eager = Trace.from_chrome(Path(d) / CASE / "serial.measured.trace.json.gz")
    kernels = _member("calibration/serial_128.kernels.json.gz")
    gap = 0.3
    setup = dataclasses.replace(report_setup, gpu=get_gpu("h200", graph_kernel_gap_us=gap))
    w = GV.case_workload(mc, "decode", 128, ep=32, kv_len=2048)
    prog = GV.build(setup, "serial", w)
    timed = apply_device_time(eager, kernels, gap)
    full = GV.calibrate_profile(setup, [(prog, timed)], "decode")
    doc = full.to_json()
    doc["rows"] = [r for r in doc["rows"] if r["op"] != "experts"]
    profile = from_json(doc, "without-experts")
    ops, _ = _by_hand(kernels)
    device = statistics.mean(us + (n - 1) * gap for (op, *_), (n, us) in ops.items()
                             if op == "experts")  # fmt: skip
    spans = [sum(s.duration for s in eager.spans if s.op == "experts" and s.layer == i)
             for i in (1, 2, 3)]  # fmt: skip
    assert statistics.mean(spans) > 1.05 * device  # the eager span: launch gaps in it
    for own, want, says in ((timed, device, "kernel device time"),
                            (None, statistics.mean(spans), "CUDA-event / host spans")):  # fmt: skip
        run, pred = GV.judge(setup, "serial", w, eager, profile, own)
        assert run["rows_from_own_run"] == {"experts": ["experts"]}
        assert run["own_run_durations"].startswith(says)
        got = [end - start for op, layer, start, end in _ops(pred) if op == "experts"]
        assert got == pytest.approx([want] * 3)


def test_the_gpu_session_scripts_loop_commands_parse():
    """experiments/gpu_session.sh (one GPU session: the kernel table, BF16 and FP8 loops, the
    interference run, the GPU tests): bash reads it, and every loop it starts takes its
    options (a typo would cost a GPU session)."""
    import shlex
    import subprocess

    script = Path(__file__).resolve().parents[1] / "experiments" / "gpu_session.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text().replace("\\\n", " ")
    calls = [shlex.split(line.strip())[3:] for line in text.splitlines()
             if line.strip().startswith("loop ") and "--modes" in line]  # fmt: skip
    assert len(calls) == 4
    for argv in calls:
        opts = GV.parse(["--out", "/tmp/x", "--name", "n", "--results", "/tmp/r", *argv])
        assert opts.modes in ("decode", "prefill") and opts.budget_s > 0
    assert sum("--gemm-dtype" in " ".join(a) for a in calls) == 2
    assert "overlap_lab.experiments.gpu_interference" in text
    assert "gpu_session_steps kernels" in text and "gpu_session_steps pytest" in text


def test_a_replayed_steps_exposed_communication_is_its_replays_not_the_eager_passs(replayed):
    """A graph-replayed step's exposed communication is measured on the replay's timeline (each
    op from its first kernel to its last, on its op's lane): serial runs everything on one
    stream, so its comm ops are all exposed, each with the graph's gaps between its kernels;
    the eager pass's spans, which hold launch gaps, say far more."""
    report, _ = replayed
    ops, replay = _by_hand(_member("calibration/serial_128.kernels.json.gz"))
    comm, i = 0.0, 0
    for (op, *_), (n, _) in ops.items():  # in device order: one stream, op after op
        ks, i = replay[i : i + n], i + n
        if op in ("dispatch_a", "dispatch_b", "combine_a", "combine_b"):
            comm += ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
    ex = report["cases"]["decode_128"]["runs"]["serial"]["comparison"]
    assert ex["exposed_comm_source"].startswith("a graph replay")
    assert ex["exposed_comm_us"]["measured"] == pytest.approx(comm, rel=1e-9)
    eager = Trace.from_chrome(_member("serial.measured.trace.json.gz"))
    assert eager.exposed_comm_us(eager.ranks[0]) > 1.5 * comm


def test_an_archive_packs_the_same_files_into_the_same_bytes(tmp_path):
    """Archive.pack (the loop's archive and convert's): sorted, owner-free, no times, so the
    same working folder makes the same archive, whenever it is packed."""
    import os

    from overlap_lab.experiments.gpu_validation.archive import Archive, unpack

    a = Archive(tmp_path / "a", "x")
    try:
        (a.work / "case").mkdir()
        (a.work / "case" / "b.txt").write_text("b")
        (a.work / "results.json").write_text('{"cases": {}}')
        first = a.pack().read_bytes()
        os.utime(a.work / "case" / "b.txt", (1, 1))
        assert a.pack().read_bytes() == first
    finally:
        a.close()
    root, rec = unpack(tmp_path / "a" / "x.tar.gz", "test")
    assert rec == {"cases": {}} and (root / "case" / "b.txt").read_text() == "b"
