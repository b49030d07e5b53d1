"""Bad input is one line on stderr, naming the file or option at fault (issue 32): no traceback,
no progress bar or note before it; the API names its own parameters where the command line
names its options, and both check a value by the same knob record."""

from __future__ import annotations

import gzip
import re
import warnings

import pytest

import overlap_lab as ol
from overlap_lab.cli.main import main
from overlap_lab.shared.errors import ConfigError

COMPARE = ["compare", "--out", "", "--layers", "2", "--schedules", "serial,tbo"]


def _only_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("overlap-lab: error: "), repr(err)
    return err


@pytest.mark.parametrize(
    "design, fragment",
    [
        ("seed=-1", "--sensitivity: seed must lie in 0..4294967295, got -1"),
        ("bogus=1", "--sensitivity: unknown key 'bogus'; keys are lhs, seed, oat, inputs"),
        ("lhs=x", "--sensitivity: lhs needs an integer, got 'x'"),
        ("inputs=nope", "--sensitivity: unknown input 'nope'"),
    ],
)
def test_a_bad_design_is_one_line_before_any_bar(capsys, design, fragment):
    assert main([*COMPARE, f"--sensitivity={design}"]) == 2
    assert fragment in _only_line(capsys)


def test_compare_refusal_is_not_on_the_bars_line(capsys):
    assert main([*COMPARE, "--imbalance", "zipf:1"]) == 2
    assert _only_line(capsys) == (
        "overlap-lab: error: --imbalance and --dp-imbalance need --ranks explicit\n"
    )


def test_no_note_before_an_error(capsys):
    assert main(["run", "--device", "cpu", "--check", "--schedule", "tbo", "--ranks", "3"]) == 2
    assert "must divide the 8 experts" in _only_line(capsys)


@pytest.mark.parametrize(
    "content", [b"\x1f\x8bxxxx", b"\x1f\x8b\x09" + b"x" * 20, gzip.compress(b"{}")[:12]]
)
@pytest.mark.parametrize("cmd", ["analyze", "validate"])
def test_a_bad_gzip_names_its_file(tmp_path, capsys, content, cmd):
    bad = tmp_path / "t.json.gz"
    bad.write_bytes(content)
    assert main([cmd, str(bad), "--out", ""]) == 2
    err = _only_line(capsys)
    assert re.search(rf"{re.escape(str(bad))}: not a (whole )?gzip file", err), err
    assert "None" not in err


def test_an_os_error_without_strerror_is_not_none(monkeypatch, capsys):
    import overlap_lab.cli.main as M

    def fail(args):
        raise gzip.BadGzipFile("Not a gzipped file (b'xx')")

    monkeypatch.setattr(M, "cmd_schedules", fail)
    assert main(["schedules"]) == 2
    assert _only_line(capsys) == "overlap-lab: error: Not a gzipped file (b'xx')\n"


def test_model_and_gpu_files_are_read_as_files(tmp_path, capsys):
    from overlap_lab.shared.inputs.preset_files import PRESETS

    gpu = tmp_path / "mine.yaml"
    gpu.write_text((PRESETS / "gpus" / "h100.yaml").read_text())
    model = tmp_path / "m.yaml"
    model.write_text((PRESETS / "models" / "deepseek-v2-lite.yaml").read_text())
    base = ["sim", "--layers", "2", "--out", "", "--ep", "8"]
    assert main([*base, "--gpu", str(gpu), "--model", str(model)]) == 0
    assert main([*base, "--gpu-file", str(gpu), "--model-file", str(model)]) == 0
    capsys.readouterr()
    bad = tmp_path / "bad.json.gz"  # no YAML/JSON suffix: still a file, never a preset's name
    bad.write_bytes(gzip.compress(b"{"))
    assert main([*base, "--model-file", str(bad)]) == 2
    assert f"model file {bad}: not a UTF-8 text file" in _only_line(capsys)
    assert main([*base, "--gpu-file", str(bad)]) == 2
    assert f"gpu file {bad}: not a UTF-8 text file" in _only_line(capsys)


# ---- the API checks what the command line checks, naming its own parameters ----------------


def test_gpu_overrides_are_held_to_their_ranges_in_the_api_too(capsys):
    from overlap_lab.checks import ImplausibleValue

    with pytest.raises(ConfigError, match=r"^hbm_gbps must be a number in 10\.\.1e\+06, got 3\.35"):
        ol.gpu("h800", hbm_gbps=3.35)  # TB/s typed as GB/s
    with pytest.raises(SystemExit) as e:  # the option's parser: the same record's words
        main(["sim", "--layers", "2", "--out", "", "--hbm-gbps", "3.35"])
    assert e.value.code == 2
    assert "--hbm-gbps: must be a number in 10..1e+06, got 3.35" in _only_line(capsys)
    with pytest.warns(ImplausibleValue, match="^rdma_gbps 400 GB/s is over"):
        ol.gpu("h800", rdma_gbps=400.0)  # 400 Gb/s: in range, said
    assert main(["sim", "--layers", "2", "--out", "", "--rdma-gbps", "400"]) == 0
    err = capsys.readouterr().err
    assert err.count("--rdma-gbps 400 GB/s is over") == 1 and "rdma_gbps" not in err


def test_mode_is_case_insensitive_in_both():
    assert ol.workload("deepseek-v3", mode="Decode", layers=2).batch.mode == "decode"
    with pytest.raises(ConfigError, match="^mode must be decode or prefill, got 'x'"):
        ol.workload(mode="x")


@pytest.mark.parametrize(
    "call, api, option",
    [
        (lambda: ol.ScheduleConfig(comm_sms=-1), "comm_sms must be", "--comm-sms"),
        (lambda: ol.ScheduleConfig(deepep_mode="x"), "deepep_mode must be", "--deepep-mode"),
        (
            lambda: ol.simulate("serial", ol.workload(layers=2), imbalance="zipf:1"),
            "imbalance and dp_imbalance need ranks explicit",
            "--imbalance",
        ),
        (lambda: ol.simulate("serial", imbalance="x"), "imbalance must be balanced", "--imb"),
    ],
)
def test_api_errors_name_the_apis_parameters(call, api, option):
    with pytest.raises(ConfigError) as e:
        call()
    assert str(e.value).startswith(api) and "--" not in str(e.value)
    from overlap_lab.cli.inputs import as_options

    assert option in as_options(str(e.value), e.value.names)


def test_the_command_line_names_its_options_for_api_refusals(capsys):
    assert main(["sim", "--layers", "2", "--out", "", "--imbalance", "zipf:x"]) == 2
    assert "--imbalance zipf:S needs a number S >= 0" in _only_line(capsys)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["sim", "--layers", "2", "--out", "", "--ranks", "explicit",
                     "--dp-imbalance", "0.5"]) == 0  # fmt: skip
