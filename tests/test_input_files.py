"""Model and GPU files checked like options: every value against its knob record's range, every
required field present, a size cap on what is read; each refusal one line naming the field and
the file."""

from __future__ import annotations

import dataclasses
import time

import pytest
import yaml

from overlap_lab.cli.main import main
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs import preset_files
from overlap_lab.shared.inputs.hardware import GPUS
from overlap_lab.shared.inputs.presets import load_gpu, load_model
from overlap_lab.shared.inputs.workload import MODELS
from tests.test_presets import DEEPSEEK_V3, write

SMALL = ["sim", "--out", "", "--layers", "2", "--ep", "8", "--batch", "4"]


def _gpu_file(tmp_path, **fields) -> str:
    p = tmp_path / "gpu.yaml"
    p.write_text(yaml.safe_dump({**dataclasses.asdict(GPUS["h800"]), **fields}))
    return str(p)


def refused(capsys, *argv: str, fragments: tuple[str, ...]) -> str:
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (code, out, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for f in fragments:
        assert f in err, err
    return err


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("hbm_gbps", float("inf"), "10..1e+06"),
        ("num_sms", 100000, "1..1024"),
        ("nvlink_eff_gbps", float("nan"), "0 or 1..100000"),
        ("launch_us", float("inf"), "0..10000"),
        ("deepep_ll_recv_us", 1e26, "0..10000"),
    ],
)
def test_gpu_file_values_are_checked_against_the_option_ranges(
    tmp_path, capsys, field, value, shown
):
    """These reached the simulator ("simulation stalled") or were accepted silently."""
    path = _gpu_file(tmp_path, **{field: value})
    refused(capsys, *SMALL, "--gpu-file", path, fragments=(path, field, shown))


@pytest.mark.parametrize("value", ["1e26", "inf", "nan"])
def test_deepep_ll_recv_us_option_is_bounded(capsys, value):
    refused(capsys, *SMALL, "--deepep-ll-recv-us", value, fragments=("--deepep-ll-recv-us",))


def test_model_file_values_are_range_checked(tmp_path, capsys):
    m = {**dataclasses.asdict(MODELS["deepseek-v2-lite"]), "num_layers": 10**9}
    p = tmp_path / "big.yaml"
    p.write_text(yaml.safe_dump(m))
    refused(capsys, *SMALL, "--model-file", str(p), fragments=(str(p), "num_layers", "1..1000"))


def test_a_model_file_without_top_k_is_refused(tmp_path, capsys):
    """It ran with top_k = 1, still called deepseek-v3."""
    m = dataclasses.asdict(MODELS["deepseek-v3"])
    del m["top_k"]
    p = tmp_path / "v3.yaml"
    p.write_text(yaml.safe_dump(m))
    refused(capsys, *SMALL, "--model-file", str(p), fragments=(str(p), "top_k", "missing"))


def test_an_hf_config_without_its_experts_is_refused(tmp_path):
    """It reported "top_k=8 > num_experts=1"."""
    hf = {k: v for k, v in DEEPSEEK_V3.items() if k != "n_routed_experts"}
    with pytest.raises(ConfigError, match="missing n_routed_experts"):
        load_model(write(tmp_path, "DeepSeek-V3/config.json", hf))


def test_a_partial_gpu_file_names_the_missing_fields(tmp_path, capsys):
    """It raised "GPU.__init__() missing 16 required positional arguments"."""
    p = tmp_path / "partial.yaml"
    p.write_text("arch: hopper\nhbm_gbps: 3000\n")
    err = refused(capsys, *SMALL, "--gpu-file", str(p), fragments=(str(p), "num_sms", "missing"))
    assert "positional" not in err


def test_defaults_a_file_took_are_said_once(tmp_path, capsys):
    g = dataclasses.asdict(GPUS["h800"])
    for f in ("nvlink_eff_gbps", "rdma_eff_gbps", "deepep_ll_recv_us"):
        del g[f]
    p = write(tmp_path, "lab.json", g)
    preset_files._NOTED.clear()
    assert load_gpu(p) == load_gpu(p)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "note" in err and "nvlink_eff_gbps=0.0" in err, err
    m = dataclasses.asdict(MODELS["deepseek-v3"])
    del m["n_group"], m["topk_group"]
    q = tmp_path / "v3.yaml"
    q.write_text(yaml.safe_dump(m))
    assert load_model(q).n_group == 1
    assert "n_group=1, topk_group=1" in capsys.readouterr().err
    assert load_model(write(tmp_path, "DeepSeek-V3/config.json", DEEPSEEK_V3)).top_k == 8
    assert capsys.readouterr().err == ""  # an HF config: every field mapped, nothing defaulted


@pytest.mark.parametrize(
    "option, device", [("--model-file", "/dev/zero"), ("--gpu-file", "/dev/urandom")]
)
def test_device_files_are_refused_unread(capsys, option, device):
    """They grew at ~0.7 GB/s until killed; then they were read up to the 16 MiB cap; now only
    regular files are read (``shared.files``)."""
    t = time.monotonic()
    refused(capsys, *SMALL, option, device, fragments=(device, "not a regular file"))
    assert time.monotonic() - t < 30


def test_a_large_regular_file_is_refused_unread(tmp_path):
    p = tmp_path / "huge.yaml"
    with open(p, "wb") as f:
        f.truncate((16 << 20) + 1)
    with pytest.raises(ConfigError, match="larger than 16 MiB"):
        load_model(p)


@pytest.mark.parametrize("knob, value", [("deepep_ll_recv_us", float("inf")), ("num_sms", 100000)])
def test_a_sweep_spec_value_is_checked_by_the_same_range(knob, value):
    from overlap_lab.cli import sweep

    with pytest.raises(ConfigError, match=f"sweep: {knob}="):
        sweep._convert(sweep._knob_actions()[knob], value)
