"""The schedule registry: what every schedule gets from ``schedules.build`` rather than pasting it
(the one-pipeline-stage refusal, its registered name on the Program), the order the built-ins are
listed in, and what it answers from each module (workload defaults, window counts, drawing,
compare notes, the CPU check's configuration), with the defaults for names it does not know."""

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


def test_pp_owns_its_one_stage_default():
    """ "One stage means default stages" is pp's rule, in its module, applied by every caller."""
    from overlap_lab.shared import schedules as S
    from overlap_lab.shared.schedules import pp

    w = Workload(LITE, Batch.decode(16), Parallel(ep=8))
    staged, notes = S.prepare_workload("pp", w)
    assert staged.parallel.pp == pp.DEFAULT_STAGES == 2 and notes == (
        "2 pipeline stages (default)",
    )
    assert S.prepare_workload("pp", staged) == (staged, ())  # stages given: kept
    assert S.prepare_workload("tbo", w) == (w, ())  # no rule: the workload as it is
    assert S.pipeline_schedules() == ["pp"]


def test_each_schedule_counts_its_window_and_unknown_names_get_the_default():
    from overlap_lab.shared import schedules as S

    w = Workload(LITE, Batch.decode(16), Parallel(ep=8, pp=2))
    g = get_gpu("h800")
    cfg = S.ScheduleConfig(iterations=3, micro_batches=4)
    assert S.iterations_and_tokens("pp", build("pp", w, g, cfg), w) == (12, 12 * 16 // 2)
    one = Workload(LITE, Batch.decode(16), Parallel(ep=8))
    loop = build("sglang-overlap", one, g, cfg)
    assert S.iterations_and_tokens("sglang-overlap", loop, one) == (3, 3 * 16)
    assert S.iterations_and_tokens("serial", build("serial", one, g), one) == (1, 16)
    assert S.iterations_and_tokens("not-registered", loop, one) == (1, 16)
    assert S.drawing("pp").every_rank and S.drawing("sglang-overlap").whole_window
    assert S.drawing("not-registered") == S.drawing("tbo") == S.drawing(None)
    assert S.window_note("serial", cfg) is None
    assert S.window_note("sglang-overlap", cfg).startswith("sglang-overlap runs 3 loop")


def test_the_program_says_which_registered_schedule_built_it(monkeypatch):
    """A module that builds through another's ``build`` (tbo+sbo through sbo's on a prefill;
    a plug-in through a built-in's) gets its own name in ``meta.schedule``, so its own metric
    and figure rules apply."""
    from overlap_lab.shared.schedules import serial

    one = Workload(LITE, Batch.decode(16), Parallel(ep=8))
    p = build("sbo-off", one, get_gpu("h800"))
    assert p.meta.schedule == "sbo-off"
    monkeypatch.setattr(module("sbo-off"), "build", serial.build)
    assert build("sbo-off", one, get_gpu("h800")).meta.schedule == "sbo-off"


def test_the_cpu_check_configuration_is_each_modules():
    from overlap_lab.shared import schedules as S

    cfg = S.ScheduleConfig(dbo_prefill_token_threshold=100)
    got = S.cpu_check_config("vllm-dbo", cfg)
    assert got.dbo_prefill_token_threshold == 100 and got.dbo_decode_token_threshold == 1
    assert S.cpu_check_config("tbo", cfg) is cfg
