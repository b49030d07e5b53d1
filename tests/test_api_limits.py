"""The API checks the workload's values against the ranges the command line's options check
(``overlap_lab.limits``), in the same words: a Python caller passing batch 10**9 or zero layers
gets the ConfigError an option's refusal gives, not a run of what it asked."""

from __future__ import annotations

import pytest

import overlap_lab as ol
from overlap_lab.cli.main import main
from overlap_lab.limits import LIMITS
from overlap_lab.shared.errors import ConfigError

#: api.workload keyword -> (an out-of-range value, the option whose range it is)
OUT_OF_RANGE = {
    "batch": (10**9, "--batch"),
    "layers": (0, "--layers"),
    "kv_len": (0, "--kv-len"),
    "tokens_per_seq": (65, "--tokens-per-seq"),
    "extend_len": (2**21, "--extend-len"),
    "prefix_len": (-1, "--prefix-len"),
    "mtp": (9, "--mtp"),
    "ep": (0, "--ep"),
    "gpus_per_node": (73, "--gpus-per-node"),
    "attn_tp": (0, "--attn-tp"),
    "pp": (17, "--pp-size"),
}


@pytest.mark.parametrize("name", sorted(OUT_OF_RANGE))
def test_workload_refuses_what_the_option_refuses_in_its_words(name, capsys):
    value, option = OUT_OF_RANGE[name]
    mode = "prefill" if name in ("extend_len", "prefix_len") else "decode"
    with pytest.raises(ConfigError) as e:
        ol.workload("deepseek-v3", mode=mode, **{name: value})
    assert e.value.names == (name,)
    why = str(e.value).removeprefix(f"{name} ")
    assert why.startswith("must be ") and why.endswith(f"got {value!r}")
    with pytest.raises(SystemExit) as code:  # argparse's own refusal
        main(["sim", "--mode", mode, option, str(value)])
    assert code.value.code == 2
    assert f"argument {option}: {why}" in capsys.readouterr().err  # the option's own words


def test_workload_checks_each_value_of_a_list_and_accepts_one_in_range():
    with pytest.raises(ConfigError, match=r"^kv_lens must be a list, each an integer in 1\.\."):
        ol.workload("deepseek-v3", batch=2, kv_lens=[4096, 0])
    with pytest.raises(ConfigError, match="^batch must be an integer"):
        ol.workload("deepseek-v3", batch=True)  # a bool is no count
    w = ol.workload("deepseek-v3", batch=2, kv_lens=[4096, 1], layers=LIMITS["layers"].lo)
    assert w.model.num_layers == 1
