"""The schedule registry: what every schedule gets from ``schedules.build`` rather than pasting it
(the one-pipeline-stage refusal), and the order the built-ins are listed in."""

from __future__ import annotations

import pytest

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model
from overlap_lab.shared.schedules import SCHEDULES, build, module

LITE = get_model("deepseek-v2-lite", num_layers=3)
BUILTINS = (
    "serial",
    "sglang-overlap",
    "sbo-off",
    "sbo",
    "tbo",
    "tbo+sbo",
    "lightllm",
    "vllm-dbo",
    "deepseek",
    "pp",
)


def test_builtins_keep_their_order():
    assert tuple(SCHEDULES)[: len(BUILTINS)] == BUILTINS


@pytest.mark.parametrize("name", [n for n in BUILTINS if n != "pp"])
def test_one_stage_schedules_refuse_pp(name):
    w = Workload(LITE, Batch.decode(16), Parallel(ep=8, pp=2))
    assert not getattr(module(name), "SUPPORTS_PP", False)
    with pytest.raises(ConfigError) as e:
        build(name, w, get_gpu("h800"))
    assert str(e.value) == f"{name} runs one pipeline stage; use --schedule pp for --pp-size > 1"


def test_pp_builds_two_stages():
    w = Workload(LITE, Batch.decode(16), Parallel(ep=8, pp=2))
    p = build("pp", w, get_gpu("h800"))  # SUPPORTS_PP: no refusal
    assert p.world == 2 and p.meta.pp_size == 2
