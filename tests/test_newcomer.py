"""What a newcomer hit (issue 32): a HuggingFace config read quietly wrong, a misspelled schedule
in a sweep grid, --version, help that said its default twice, MTP that cost nothing."""

from __future__ import annotations

import json
import re

import pytest

from overlap_lab.cli.main import main
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs import preset_files
from overlap_lab.shared.inputs.presets import load_model
from overlap_lab.shared.inputs.workload import MODELS
from tests.test_presets import QWEN3_30B


def _config(tmp_path, **changes):
    hf = {k: v for k, v in {**QWEN3_30B, **changes}.items() if v is not ...}
    p = tmp_path / "Qwen3-30B-A3B" / "config.json"
    p.parent.mkdir(exist_ok=True)
    p.write_text(json.dumps(hf))
    return p


def test_the_published_config_is_the_preset(tmp_path):
    assert load_model(_config(tmp_path)) == MODELS["qwen3-30b-a3b"]


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"model_type": ...}, "model_type missing"),
        ({"model_type": "qwen3moe"}, "model_type 'qwen3moe' is not a MoE this reader knows"),
        ({"num_hidden_layers": 48.5}, "num_hidden_layers must be a whole number, got 48.5"),
        ({"hidden_size": "2048"}, "hidden_size must be a whole number, got '2048'"),
        ({"num_experts": ...}, "missing num_experts (a qwen3_moe config gives it)"),
        ({"num_experts_per_tok": ...}, "missing num_experts_per_tok"),
    ],
)
def test_a_wrong_config_is_refused_naming_the_field(tmp_path, changes, fragment):
    p = _config(tmp_path, **changes)
    with pytest.raises(ConfigError) as e:
        load_model(p)
    assert fragment in str(e.value) and str(p) in str(e.value) and "\n" not in str(e.value)
    assert "is not a MoE this reader knows (DeepSeek" not in str(e.value)  # no contradiction


def test_a_missing_head_dim_is_noted(tmp_path, capsys):
    preset_files.hold_notes(False)
    preset_files._NOTED.clear()
    m = load_model(_config(tmp_path, head_dim=...))
    assert m.head_dim == 2048 // 32 and m.qk_norm  # as transformers takes it, and said
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "head_dim missing; took hidden_size / num_attention_heads" in err
    )
    assert main(["sim", "--model-file", str(_config(tmp_path, head_dim=...)), "--ep", "8",
                 "--layers", "2", "--out", ""]) == 0  # fmt: skip
    assert "note: HF config of qwen3-30b-a3b: head_dim missing" in capsys.readouterr().err


# ---- a broken plug-in schedule costs its own name only --------------------------------------

BROKEN = {
    "bad_syntax": "def oops(:\n",
    "bad_nosummary": "UPSTREAM = 'x'\ndef build(w, g, c):\n    return None\n",
    "bad_none": "UPSTREAM = 'x'\nSUMMARY = 'returns None'\ndef build(w, g, c):\n    return None\n",
}


@pytest.fixture
def broken(tmp_path):
    from plugin_dist import installed

    eps = {"syn": "bad_syntax", "nosum": "bad_nosummary", "none": "bad_none"}
    with installed(tmp_path / "site", "badplug", BROKEN, {"overlap_lab.schedules": eps}):
        yield


def test_a_broken_plugin_is_listed_with_its_error(broken, capsys):
    assert main(["schedules"]) == 0
    out = capsys.readouterr().out
    assert "serial " in out and "upstream: " in out
    assert re.search(r"\nsyn +BROKEN: schedule 'syn' \(bad_syntax, package badplug\) cannot be "
                     r"loaded: SyntaxError", out)  # fmt: skip
    assert re.search(r"\nnosum +BROKEN: schedule 'nosum' .* lacks SUMMARY", out)
    assert re.search(r"\nnone +returns None\n +upstream: x", out)  # it loads; its build fails


def test_every_other_command_works_beside_a_broken_plugin(broken, tmp_path, capsys):
    small = ["--layers", "2", "--out", ""]
    assert main(["sim", "--schedule", "serial", *small]) == 0
    assert main(["show", "--schedule", "tbo", "--layers", "1"]) == 0
    with pytest.raises(SystemExit) as e:
        main(["sim", "-h"])
    assert e.value.code == 0
    assert main(["compare", *small]) == 0  # every schedule: the broken ones are refused rows
    out = capsys.readouterr().out
    assert "refused: schedule 'syn'" in out and "refused: schedule 'nosum'" in out
    assert "refused: schedule 'none' (bad_none, package badplug): build() returned NoneType" in out
    assert main(["run", "--device", "cpu", "--check", "--schedule", "serial"]) == 0
    capsys.readouterr()
    assert main(["sim", "--schedule", "none", *small]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "build() returned NoneType, not a Program" in err
    spec = tmp_path / "s.json"
    spec.write_text(json.dumps({"base": {"layers": 2}, "grid": {"schedule": ["serial", "syn"]}}))
    assert main(["sweep", str(spec), "--out", str(tmp_path / "s.csv"), "--no-progress"]) == 2
    assert "sweep: grid: schedule 'syn'" in capsys.readouterr().err
    assert not (tmp_path / "s.csv").exists()


def test_a_misspelled_schedule_in_a_sweep_is_refused_up_front(tmp_path, capsys):
    spec = tmp_path / "s.json"
    spec.write_text(json.dumps({"base": {"layers": 2}, "grid": {"schedule": ["serial", "tbbo"]}}))
    assert main(["sweep", str(spec), "--out", str(tmp_path / "s.csv"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sweep: unknown schedule 'tbbo' in grid; choose from" in err
    assert not (tmp_path / "s.csv").exists()


def test_pps_iteration_is_said_in_the_iteration_column():
    """pp's ms/iter was the lowest at 0.646x serial's throughput: its iteration is a micro-batch."""
    import overlap_lab as ol
    from overlap_lab.shared import schedules as S

    assert S.iteration_unit("pp") == "mb" and S.iteration_unit("serial") == ""
    w = ol.workload("deepseek-v3", layers=2, ep=8, batch=16)
    text = ol.compare(["serial", "pp"], w).text()
    pp = next(ln for ln in text.splitlines() if ln.startswith("pp "))
    serial = next(ln for ln in text.splitlines() if ln.startswith("serial "))
    assert pp.split()[1:4] == ["16", "8", "mb"] and serial.split()[2] == "1"
    assert "iters are micro-batch iterations (mb)" in " ".join(text.split())


# ---- MTP draft steps ------------------------------------------------------------------------


def test_each_mtp_draft_step_runs_the_module_again(capsys):
    """--mtp 2 ... 8 gave --mtp 1's result: the option set the model's module count, which only
    switched MTP on, and the draft steps followed --tokens-per-seq (1 unless given)."""
    import overlap_lab as ol

    def sim(*extra):
        argv = ["sim", "--layers", "3", "--ep", "8", "--batch", "16", "--json", "--out", ""]
        assert main([*argv, *extra]) == 0
        return json.loads(capsys.readouterr().out)

    runs = {n: sim("--mtp", str(n)) for n in (1, 2, 4)}
    assert [runs[n]["tokens"] for n in (1, 2, 4)] == [32, 48, 80]  # verifies N + 1 per sequence
    assert runs[1]["step_time_us"] < runs[2]["step_time_us"] < runs[4]["step_time_us"]
    assert sim("--tokens-per-seq", "3")["step_time_us"] == runs[2]["step_time_us"]
    mtp_layers = {n: {s.layer for s in _spans("mtp.eh_proj", n)} for n in (1, 2, 4)}
    assert {n: len(v) for n, v in mtp_layers.items()} == {1: 1, 2: 2, 4: 4}
    w = ol.workload("deepseek-v3", layers=3, ep=8, batch=16, mtp=2)
    assert w.batch.tokens_per_seq == 3 and w.model.mtp == 1  # one module, run twice


def _spans(op: str, mtp: int):
    import overlap_lab as ol

    w = ol.workload("deepseek-v3", layers=3, ep=8, batch=16, mtp=mtp)
    return [s for s in ol.simulate("serial", w).trace.spans if s.op == op]


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (
            ["--mtp", "2", "--tokens-per-seq", "1"],
            "--mtp 2 drafts 2 tokens per sequence, so the step verifies 3 (--tokens-per-seq 3",
        ),  # fmt: skip
        (["--mtp", "1", "--tokens-per-seq", "4"], "verifies 2 (--tokens-per-seq 2"),
        (["--mtp", "2", "--mode", "prefill"], "--mtp applies to --mode decode only"),
    ],
)
def test_mtp_that_would_be_ignored_is_refused(capsys, extra, fragment):
    assert main(["sim", "--layers", "2", "--out", "", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err, err
    import overlap_lab as ol

    with pytest.raises(ConfigError, match="^mtp 2 drafts 2 tokens per sequence"):
        ol.workload(mtp=2, tokens_per_seq=1)


# ---- --version and help ----------------------------------------------------------------------


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"overlap-lab {version('overlap-lab')}\n"


def _helps():
    import argparse

    from overlap_lab.cli.main import parser

    def walk(p, cmd):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    yield from walk(sub, name)
            elif a.help and a.option_strings:
                yield cmd, a.option_strings[0], a.help

    return list(walk(parser(), ""))


def test_help_says_each_default_once_and_never_none():
    """`(default: GPU preset) (default: None)`: a default said twice, one of them None."""
    helps = _helps()
    assert len(helps) > 300
    for cmd, opt, text in helps:
        assert text.count("(default") <= 1, (cmd, opt, text)
        assert "(default: None)" not in text, (cmd, opt, text)
