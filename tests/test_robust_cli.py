"""Bad input on the command line: exit 2, one line on stderr, no traceback, nothing run.

Every reproducer of issues 13 and 14 is a case here; then a fuzz over every option of every
subcommand (bad types, NaN/inf, 0, negatives, huge, empty; files missing, empty, binary,
malformed or folders), run in-process through ``main([...])``, each simulation under a small
``--max-events`` budget. OVERLAP_LAB_FUZZ_EXAMPLES scales the random part (tests/fuzz_helpers.py).
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from overlap_lab.cli.main import main, parser
from overlap_lab.experiments import runner
from overlap_lab.limits import LIMITS
from tests.fuzz_helpers import fuzz_settings

SMALL = ["--model", "deepseek-v2-lite", "--layers", "2", "--ep", "8", "--batch", "4"]
BUDGET = ["--max-events", "300000"]
OUTCOMES: Counter = Counter()


def call(capsys, *argv, fn=main):
    try:
        code = fn(list(argv))
    except SystemExit as e:  # argparse's own errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, *argv, fragment: str = "", fn=main) -> str:
    code, out, err = call(capsys, *argv, fn=fn)
    assert code == 2, (argv, code, out, err)
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err and fragment in err, err
    assert out == "", out
    return err


# ---- reproducers of issues 13 and 14 -------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--hbm-gbps", "1e-3"], "10..1e+06"),
        (["--bf16-tflops", "1e-12"], "--bf16-tflops"),
        (["--nvlink-lat-us", "1e16"], "--nvlink-lat-us"),
        (["--nvlink-eff-gbps", "nan"], "finite"),
        (["--rdma-eff-gbps", "nan"], "finite"),
        (["--kernel-min-us", "inf"], "finite"),
        (["--pcie-lat-us", "inf"], "finite"),
        (["--hbm-gbps", "1e300"], "--hbm-gbps"),
        (["--fp8-tflops", "1e-300"], "--fp8-tflops"),
        (["--mode", "prefill", "--prefix-len", "-1"], "--prefix-len"),
        (["--mode", "prefill", "--extend-lens", "8,8", "--prefix-lens", "-1,0"], "--prefix-lens"),
        (["--kv-lens", "1,,2"], "none empty"),
        (["--gpus-per-node", "1000000000"], "1..72"),
        (["--seed", "-1"], "--seed"),
        (["--mode", "prefill", "--kv-len", "8"], "--kv-len applies to --mode decode only"),
        (["--mode", "prefill", "--tokens-per-seq", "2"], "decode only"),
        (["--extend-len", "8"], "--extend-len applies to --mode prefill only"),
        (["--prefix-len", "8"], "prefill only"),
        (["--mem-gib", "1"], "does not fit in GPU memory"),
        (["--kv-len", "1000000", "--batch", "128"], "does not fit in GPU memory"),
        (["--batch", "1000000"], "1..65536"),
        (["--schedule", "sglang-overlap", "--context-len", "1"], "below the longest sequence"),
        (["--model", "qwen3-30b-a3b", "--group-limited", "true"], "expert groups"),
        (["--schedule", "pp", "--micro-batches", "1000000000"], "1..64"),
        (["--schedule", "pp", "--micro-batches", "200", "--batch", "1"], "1..64"),
        (["--schedule", "sglang-overlap", "--iterations", "1000000"], "1..64"),
        (["--schedule", "pp", "--pp-size", "61"], "1..16"),
        (["--sbo-mode", "2"], "applies to --schedule sbo or tbo+sbo only"),
        (["--schedule", "nope"], "unknown schedule"),
        (["--schedule", "sbo", "--comm-sms", "1000"], "below the GPU's 132 SMs"),
        (["--max-events", "0"], "--max-events"),
        (["--max-events", "1"], "more than 1 events"),
        (["--schedule", "pp", "--ranks", "explicit"], "does not apply to --schedule pp"),
    ],
)
def test_sim_reproducers(capsys, argv, fragment):
    base = list(SMALL)
    if "--model" in argv:
        base = base[2:]
    if "--batch" in argv:
        base = base[:-2]
    refused(capsys, "sim", "--out", "", *base, *argv, fragment=fragment)


def test_explicit_deepseek_prefill_ep32_zipf_refused_with_memory(capsys):
    err = refused(
        capsys,
        "sim",
        "--out",
        "",
        "--mode",
        "prefill",
        "--ep",
        "32",
        "--ranks",
        "explicit",
        "--imbalance",
        "zipf:1.2",
        fragment="the simulation would need about",
    )
    assert "GiB" in err


@pytest.mark.parametrize("schedules", ["", ",", " , "])
def test_compare_needs_schedules(capsys, schedules):
    refused(
        capsys, "compare", "--out", "", *SMALL, "--schedules", schedules, fragment="at least one"
    )


def test_schedule_names_are_case_insensitive_like_model_and_gpu(capsys):
    code, out, _ = call(capsys, "sim", "--out", "", "--json", *SMALL, "--schedule", "TBO",
                        "--model", "DeepSeek-V2-Lite", "--gpu", "H800")  # fmt: skip
    assert code == 0 and json.loads(out)["schedule"] == "tbo"


def test_mem_gib_has_an_effect_and_oversubscribe_goes_on(capsys):
    refused(capsys, "sim", "--out", "", *SMALL, "--mem-gib", "1", fragment="--allow-oversubscribe")
    code, _, _ = call(capsys, "sim", "--out", "", *SMALL, "--mem-gib", "1", "--allow-oversubscribe")
    assert code == 0


def test_nominal_link_bandwidth_overrides_take_effect(capsys):
    def step(*extra):
        code, out, err = call(capsys, "sim", "--out", "", "--json", *SMALL, *extra)
        assert code == 0, err
        return json.loads(out)["step_time_us"]

    assert step("--nvlink-gbps", "20") > step()  # EP 8: one node, NVLink only
    assert step("--ep", "16", "--rdma-gbps", "5") > step("--ep", "16")  # two nodes: RDMA


@pytest.mark.parametrize("out", ["/dev/null", "FILE", "FILE/sub", "RO/sub"])
def test_out_checked_before_any_simulation(capsys, tmp_path, out, monkeypatch):
    f = tmp_path / "file"
    f.write_text("x")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    path = out.replace("FILE", str(f)).replace("RO", str(ro))
    if out.startswith("RO") and os.access(ro, os.W_OK):  # root ignores modes
        pytest.skip("cannot make an unwritable folder as root")
    import overlap_lab.api as api

    monkeypatch.setattr(api, "simulate", lambda *a, **k: pytest.fail("simulated"))
    for cmd in ("sim", "compare"):
        refused(capsys, cmd, *SMALL, "--out", path, fragment="--out")


def test_out_under_proc_is_one_line(capsys):
    refused(capsys, "sim", *SMALL, "--out", "/proc/overlap-lab-out", fragment="--out")


def test_json_output_is_strict_json(capsys):
    code, out, _ = call(capsys, "sim", "--out", "", "--json", *SMALL, "--pcie-lat-us", "1e4")
    assert code == 0
    json.loads(out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def test_non_finite_results_refused_not_printed():
    from overlap_lab.report import to_json
    from overlap_lab.shared.errors import ConfigError

    with pytest.raises(ConfigError, match=r"busy_us\.x"):
        to_json({"busy_us": {"x": float("inf")}})


def test_closed_stdout_is_not_a_traceback(capsys, monkeypatch):
    import overlap_lab.cli.main as cli

    def broken(_args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "cmd_schedules", broken)
    p = cli.parser()
    monkeypatch.setattr(cli, "parser", lambda: p)
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            a.choices["schedules"].set_defaults(func=broken)
    code, _, err = call(capsys, "schedules")
    assert code == 1 and "Traceback" not in err


def test_closed_stdout_pipe_in_a_real_process(tmp_path):
    import subprocess
    import sys

    r = subprocess.run(
        f"{sys.executable} -m overlap_lab.cli show --layers 2 --ep 8 | head -1",
        shell=True, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "Traceback" not in r.stderr and r.stdout.startswith("program")


# ---- run: the command-line checks (the executor itself is real/'s) --------------------------------


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--backend", "bogus"], "--backend must be one of"),
        (["--device", "bogus"], "--device must be one of"),
        (["--warmup", "-1"], "--warmup"),
        (["--comm-sms", "1000"], "below the GPU's"),
        (["--device", "cpu", "--check", "--batch", "1000000"], "--batch"),
        (["--device", "cpu", "--check", "--batch", "5000"], "at most 4096"),
        (["--tolerance", "0"], "--tolerance"),
        (["--tolerance", "nan"], "finite"),
        (["--repeats", "0"], "--repeats"),
        (["--ranks", "100"], "at most 16"),
    ],
)
def test_run_argument_checks(capsys, argv, fragment):
    refused(capsys, "run", *argv, fragment=fragment)


# ---- routing files ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, content, fragment",
    [
        ("missing.json", None, "no such file"),
        ("dir.json", "DIR", "is a directory"),
        ("empty.csv", "", "empty file"),
        ("empty.json", "", "invalid JSON"),
        ("binary.json", b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "not a UTF-8 text file"),
        ("nul.csv", "0\x00,1\n", "NUL"),
        ("nan.json", '{"expert_counts": [NaN' + ", 1" * 63 + "]}", "finite"),
        ("inf.json", '{"expert_counts": [Infinity' + ", 1" * 63 + "]}", "finite"),
        ("inf.csv", "expert,count\n0,inf\n", "finite"),
        ("huge.json", '{"expert_counts": [1e300' + ", 1" * 63 + "]}", "finite numbers in"),
        ("bad.json", "{", "invalid JSON"),
        ("list.json", "[1, 2]", "expected an object"),
        ("ids.csv", "1,2,x\n", "integer expert ids"),
        ("ext.txt", "1,2\n", ".json or .csv"),
    ],
)
def test_routing_files(capsys, tmp_path, name, content, fragment):
    path = tmp_path / name
    if content == "DIR":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    refused(capsys, "sim", "--out", "", *SMALL, "--ranks", "explicit",
            "--imbalance", f"file:{path}", fragment=fragment)  # fmt: skip


# ---- experiments -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--processes", "0"], "--processes"),
        (["--processes", "-1"], "--processes"),
        (["--processes", "x"], "--processes"),
        (["--bogus"], "unrecognized"),
        (["nope"], "unknown experiment"),
    ],
)
def test_experiments_argument_errors_one_line(capsys, argv, fragment):
    refused(capsys, *argv, fragment=fragment, fn=runner.main)


def test_experiments_out_checked_before_work(capsys, tmp_path, monkeypatch):
    f = tmp_path / "file"
    f.write_text("x")
    monkeypatch.setattr(runner, "run", lambda *a, **k: pytest.fail("ran"))
    refused(capsys, "pp_bubbles", "--out", str(f), fragment="--out", fn=runner.main)


@pytest.mark.parametrize("content", [None, "", "{", "[]", "{}", "\x00\xff"])
def test_experiments_draw_bad_results(capsys, tmp_path, content):
    if content is not None:
        (tmp_path / "pp_bubbles.json").write_text(content, errors="surrogateescape")
    refused(
        capsys, "pp_bubbles", "--draw", "--out", str(tmp_path), fragment="--draw", fn=runner.main
    )


# ---- fuzz over every option ------------------------------------------------------------------------

ALWAYS_BAD = ["", "x", "nan", "inf", "-inf", "1e300", "-1e300", "99999999999999999999", "1,,2"]
MAYBE = ["0", "-1", "1e-300", "1", "3", "0.5", "64"]


def _options(cmd: str) -> list[str]:
    for a in parser()._actions:
        if isinstance(a, argparse._SubParsersAction):
            sub = a.choices[cmd]
            return [
                s
                for b in sub._actions
                for s in b.option_strings[-1:]
                if s.startswith("--") and b.nargs != 0 and s not in ("--help",)
            ]
    raise AssertionError(cmd)


NUMERIC = {f"--{d.replace('_', '-')}" for d in LIMITS} | {"--processes"}


def _base(cmd: str) -> list[str]:
    if cmd == "run":
        return []
    base = [*SMALL]
    return [*base, "--out", ""] + (BUDGET if cmd != "show" else [])


def _cases() -> list[tuple[str, str, str]]:
    """Every bad value for every numeric option of `sim`; three of them, in turn, elsewhere."""
    out = []
    for cmd in ("sim", "show", "compare", "run"):
        for i, opt in enumerate(o for o in _options(cmd) if o in NUMERIC):
            values = ALWAYS_BAD if cmd == "sim" else ALWAYS_BAD[i % 3 :: 3]
            out += [(cmd, opt, v) for v in values]
    return out


CASES = _cases()


@pytest.mark.parametrize("cmd, opt, value", CASES)
def test_every_numeric_option_refuses_nonsense(capsys, cmd, opt, value):
    refused(capsys, cmd, *_base(cmd), opt, value)


def _ends_cleanly(capsys, argv) -> str:
    code, out, err = call(capsys, *argv)
    assert "Traceback" not in err, (argv, err)
    if code == 0:
        return "ran"
    assert code == 2, (argv, code, err)
    assert err.count("\n") == 1 and err.startswith("overlap-lab: error: "), (argv, err)
    return "refused"


@fuzz_settings(150)
@given(data=st.data())
def test_option_combinations_end_cleanly(capsys, data):
    cmd = data.draw(st.sampled_from(["sim", "show", "compare"]))
    opts = _options(cmd)
    argv = ["--model", "deepseek-v2-lite", "--ep", "8", "--batch", "4", "--layers", "2"]
    argv += ["--out", ""] + (BUDGET if cmd != "show" else [])
    if cmd == "compare":
        argv += ["--schedules", data.draw(st.sampled_from(["serial,tbo", "SBO", "pp", "x,serial"]))]
    for _ in range(data.draw(st.integers(1, 3))):
        opt = data.draw(st.sampled_from(opts))
        if opt in ("--out", "--max-events", "--layers", "--batch", "--ep"):
            continue
        argv += [
            opt,
            data.draw(st.sampled_from(ALWAYS_BAD + MAYBE + ["true", "explicit", "zipf:1"])),
        ]
    OUTCOMES[_ends_cleanly(capsys, [cmd, *argv])] += 1


def teardown_module(module):
    if OUTCOMES:
        print("\nCLI fuzz outcomes:", dict(sorted(OUTCOMES.items())))


# ---- determinism -----------------------------------------------------------------------------------


def test_svg_figures_identical_across_runs(tmp_path):
    """matplotlib's SVG ids are random per process unless svg.hashsalt is fixed: two processes."""
    import subprocess
    import sys

    outs = []
    for i in range(2):
        out = tmp_path / f"run{i}"
        subprocess.run(
            [sys.executable, "-m", "overlap_lab.cli", "sim", *SMALL,
             "--out", str(out), "--figure-format", "svg"],
            check=True, capture_output=True, timeout=300,
        )  # fmt: skip
        outs.append((out / "timeline.svg").read_bytes())
    assert outs[0] == outs[1] and b"<svg" in outs[0]


def test_run_cpu_check_reaches_tiny_gqa(capsys):
    pytest.importorskip("torch")
    code, out, err = call(capsys, "run", "--device", "cpu", "--check", "--model", "tiny-gqa",
                          "--schedule", "tbo")  # fmt: skip
    assert code == 0, err
    assert "tbo" in out and "ok" in out


def test_every_name_is_case_insensitive(capsys):
    code, out, err = call(capsys, "show", *SMALL, "--ranks", "EXPLICIT", "--mode", "Decode",
                          "--schedule", "SGLang-Overlap", "--deepep-mode", "LOW_LATENCY")  # fmt: skip
    assert code == 0, err
    assert "symmetric=false" in out.splitlines()[0]


def test_a_programs_fault_is_one_line_on_the_command_line(capsys):
    """A workload whose attention work leaves the Program's range printed the instructions
    around the fault (a listing for a schedule's author, which the API keeps): one line here."""
    from overlap_lab.cli.main import main

    argv = ["sim", "--mode", "prefill", "--extend-len", "1048576", "--batch", "64",
            "--allow-oversubscribe", "--layers", "4", "--out", ""]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "must be finite numbers" in err, err
