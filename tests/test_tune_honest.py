"""What ``overlap-lab tune`` answers must hold for the configuration it names (issue 31,
docs/tune.md "Measured"): pp's memory counts every micro-batch in flight, and the launch's
running requests say the same."""

from __future__ import annotations

import dataclasses

import pytest

import overlap_lab as ol
from overlap_lab.checks import GIB, check_memory, gpu_memory_bytes
from overlap_lab.cli.main import main
from overlap_lab.shared import schedules as registry
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.schedules import ScheduleConfig
from overlap_lab.shared.schedules.launch import Deployment as Launched
from overlap_lab.tune_search import Point
from overlap_lab.tune_space import Deployment, Setting, Space, dims, fits, refusal
from tests.plugin_dist import installed

# ---- memory: pp's micro-batches are each a whole batch ------------------------------------


def test_pp_holds_the_kv_cache_of_every_micro_batch_in_flight():
    """pp's micro-batch is the whole batch (``pp.micro_batch``), so 8 micro-batches of 64
    sequences keep 8 x 64 sequences' KV cache on a stage: refused on an 80 GiB H800, where 2 of
    them fit (DeepSeek-V3, 4096 tokens each, EP16 x PP2)."""
    w = ol.workload("deepseek-v3", batch=64, ep=16, pp=2, kv_len=4096)
    gpu = ol.gpu("h800")
    weights, one = gpu_memory_bytes(w)
    assert gpu_memory_bytes(w, 8) == (weights, 8 * one)
    assert weights + 2 * one < gpu.mem_gib * GIB < weights + 8 * one  # the test's premise
    check_memory(w, gpu, False, schedule="pp", cfg=ScheduleConfig(micro_batches=2))
    with pytest.raises(ConfigError, match="KV cache of 8 batches in flight"):
        check_memory(w, gpu, False, schedule="pp", cfg=ScheduleConfig(micro_batches=8))
    check_memory(w, gpu, True, schedule="pp", cfg=ScheduleConfig(micro_batches=8))  # allowed
    check_memory(w, gpu, False, schedule="serial")  # one batch: no micro-batches to count


def test_the_tune_does_not_try_a_pp_setting_whose_micro_batches_do_not_fit():
    d = Deployment(ol.model("deepseek-v3"), ol.gpu("h800"), 32)
    assert fits(d, Setting("pp", 16, 2), 64)  # 2 micro-batches (pp_size)
    assert not fits(d, Setting("pp", 16, 2, knobs=(("micro_batches", 8),)), 64)
    assert fits(d, Setting("pp", 16, 2, knobs=(("micro_batches", 8),)), 16)


def test_sim_refuses_micro_batches_that_do_not_fit_and_runs_those_that_do(tmp_path, capsys):
    base = ["sim", "--schedule", "pp", "--pp-size", "2", "--ep", "16", "--batch", "64"]
    assert main([*base, "--micro-batches", "8", "--out", str(tmp_path / "a")]) == 2
    assert "8 batches in flight (pp)" in capsys.readouterr().err
    cut = [*base, "--layers", "4", "--micro-batches", "8", "--out", str(tmp_path / "b")]
    assert main(cut) == 0  # 4 layers: 8 micro-batches' KV cache fits


def test_launch_counts_the_sequences_the_memory_check_counts():
    """``--pp-max-micro-batch-size`` is the batch (one micro-batch per DP rank);
    ``--max-running-requests`` every micro-batch in flight on every DP rank."""
    w = ol.workload("deepseek-v3", batch=16, ep=16, pp=2)
    cfg = ScheduleConfig(micro_batches=4)
    launch = registry.launch_flags("pp", Launched(w, ol.gpu("h800"), cfg, 32, "m"))
    flags = {f.name: f.value for f in launch.flags}
    in_flight = registry.batches_in_flight("pp", w, cfg)
    assert in_flight == 4 and registry.batches_in_flight("serial", w, cfg) == 1
    assert flags["--pp-max-micro-batch-size"] == 16
    assert flags["--max-running-requests"] == 16 * in_flight * 16  # 16 DP ranks


# ---- the latency a target bounds: a sequence's wait between tokens --------------------------


def test_latency_iterations_pp_waits_a_round_of_its_micro_batches():
    dec = ol.workload("deepseek-v3", batch=16, ep=8, pp=2, layers=4)
    pre = ol.workload("deepseek-v3", mode="prefill", batch=1, ep=8, pp=2, layers=4)
    cfg = ScheduleConfig(micro_batches=8)
    assert registry.latency_iterations("pp", dec, cfg) == 8  # decode: every micro-batch's turn
    assert registry.latency_iterations("pp", dec, ScheduleConfig()) == 2  # pp_size in flight
    assert registry.latency_iterations("pp", pre, cfg) == 2  # prefill: through each stage
    one = ol.workload("deepseek-v3", batch=16, ep=8, layers=4)
    for name in ("serial", "tbo", "sglang-overlap", "not-registered"):
        assert registry.latency_iterations(name, one, cfg) == 1


def test_tune_compares_the_target_with_a_sequences_wait_and_shows_both(tmp_path):
    """pp's points carry micro_batches iterations per token; the best is within the target by
    that latency, not by ms per iteration, and the table shows both."""
    from overlap_lab.tune import tune

    space = Space(schedules=("serial", "pp"), batches=(8, 32), ep=(4,), pp=(2,), drafts=(),
                  values={"deepep_mode": (), "micro_batches": (4,)})  # fmt: skip
    t = tune("deepseek-v3", "h800", gpus=8, max_ms=2.0, layers=2, space=space,
             sensitivity=False, processes=1)  # fmt: skip
    pp = [p for p in t.points if p.setting.schedule == "pp"]
    assert pp and all(p.iterations == (p.setting.value("micro_batches") or 2) for p in pp)
    assert all(abs(p.ms - p.iterations * p.iteration_ms) <= 1e-12 * p.ms for p in pp)
    assert all(p.iterations == 1 for p in t.points if p.setting.schedule == "serial")
    assert t.best is not None and t.best.ms <= 2.0
    text = t.text()
    assert "ms/token" in text and "ms/iter" in text
    assert "within 2 ms between a sequence's tokens" in text
    best = t.as_dict()["best"]
    assert best["latency_ms"] == t.best.ms and best["latency_iterations"] == t.best.iterations


# ---- values a schedule always refuses are not tried -------------------------------------------


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_deepep_modes_a_schedule_refuses_are_not_searched(mode):
    """lightllm and deepseek run the phase's DeepEP kernels only (``two_mb.system_deepep_mode``):
    the other mode is never tried for them (it was counted as a failure), still for serial."""
    d = Deployment(ol.model("deepseek-v3"), ol.gpu("h800"), 32, mode)
    other = "normal" if mode == "decode" else "low_latency"
    for name in ("lightllm", "deepseek"):
        assert refusal(d, name, "deepep_mode", other) is not None
        assert "deepep_mode" not in {x.name for x in dims(d, Space(), name, False)}
    assert refusal(d, "serial", "deepep_mode", other) is None
    serial = {x.name: x.values for x in dims(d, Space(), "serial", False)}
    assert serial["deepep_mode"] == (other,)


PICKY = """
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.schedules import serial

UPSTREAM = "none (a test plugin)"
SUMMARY = "picky: serial, without DeepEP's normal kernels on Qwen3 models or on an H100"


def build(workload, gpu, cfg):
    if cfg.deepep_mode == "normal" and (workload.model.name.startswith("qwen3") or gpu.name == "h100"):
        raise ConfigError("picky has no normal-kernel path on " + workload.model.name + "/" + gpu.name)
    return serial.build(workload, gpu, cfg)
"""


def test_a_refusal_is_asked_on_the_deployments_own_model_and_gpu(tmp_path):
    """A schedule that refuses a knob value by model or by GPU is asked on the deployment's own
    (cut to two layers), not on another deployment's: a plug-in refusing DeepEP's normal kernels
    on Qwen3 and on H100s has them searched on DeepSeek-V3 on H800s only."""
    eps = {"overlap_lab.schedules": {"picky-normal": "overlap_lab_picky"}}
    with installed(tmp_path / "site", "overlap-lab-picky", {"overlap_lab_picky": PICKY}, eps):
        for model, gpu, refused in [
            ("qwen3-30b-a3b", "h800", True),
            ("deepseek-v3", "h100", True),
            ("deepseek-v3", "h800", False),
        ]:
            d = Deployment(ol.model(model), ol.gpu(gpu), 8)
            why = refusal(d, "picky-normal", "deepep_mode", "normal")
            assert (why is not None) == refused, (model, gpu, why)
            if refused:
                assert f"no normal-kernel path on {model}/{gpu}" in why
            tried = {x.name: x.values for x in dims(d, Space(), "picky-normal", False)}
            assert tried.get("deepep_mode") == (None if refused else ("normal",))


# ---- the figure counts configurations as the text does --------------------------------------


def test_frontier_title_counts_simulated_and_shared_as_the_text_does():
    from overlap_lab.figures.curves import _counted
    from overlap_lab.tune import Tuning

    d = Deployment(ol.model("deepseek-v3"), ol.gpu("h800"), 32)
    counts = {"simulated": 158, "duplicates": 21, "errors": 2, "resumed": 0, "rounds": 21}
    t = Tuning(d, 50.0, (), (), {}, None, counts=counts)
    title = _counted(counts)
    assert title == "158 configurations simulated, 21 more shared an identical simulation"
    assert "simulated 158 configurations (21 more shared an identical simulation" in t.text()
    assert "181 read back" in _counted({"simulated": 0, "resumed": 181})


# ---- rows that ran as another schedule say so ---------------------------------------------------


def test_frontier_rows_that_ran_as_another_schedule_carry_compares_note():
    """sbo on DeepEP's normal kernels runs as serial, and vllm-dbo below its token threshold runs
    unsplit: their rows carry the note ``compare`` prints; serial's carry none."""
    from overlap_lab.tune import label, tune

    space = Space(schedules=("serial", "sbo", "vllm-dbo"), batches=(8, 16), ep=(8,), drafts=(),
                  values={"deepep_mode": ("normal",), "comm_sms": (), "sbo_mode": (),
                          "dbo_decode_token_threshold": ()})  # fmt: skip
    t = tune("deepseek-v3", "h800", gpus=8, layers=2, space=space, sensitivity=False,
             processes=1, per_schedule=True)  # fmt: skip
    front = [p for pts in t.by_schedule.values() for p in pts]
    for p in front:
        notes = t.notes.get(label(p), ())
        normal = p.setting.value("deepep_mode") == "normal"
        if p.setting.schedule == "sbo" and normal:
            assert notes and notes[0].startswith("ran as serial, without SBO")
        if p.setting.schedule == "vllm-dbo":  # 8 or 16 tokens, below its default threshold 32
            assert notes and notes[0].startswith("ran unsplit")
        if p.setting.schedule == "serial":
            assert not notes
    assert any(p.setting.schedule == "vllm-dbo" for p in front)
    assert "[ran unsplit]" in t.text()
    assert t.as_dict()["notes"] == {k: list(v) for k, v in t.notes.items()}


def test_a_tie_goes_to_the_row_that_ran_as_its_name_not_to_the_fallback():
    """In prefill (DeepEP's normal kernels) sbo runs as serial: the same simulation, the same
    numbers. The best, its star and the overall frontier's first point are serial's, not the
    row labelled ``[ran as serial, without SBO]`` that the label order put first."""
    from overlap_lab.tune import label, tune

    held = ("deepep_mode", "comm_sms", "sbo_mode", "deepep_normal_sms", "deepep_release")
    space = Space(schedules=("sbo", "serial"), batches=(1,), ep=(8,), drafts=(),
                  values=dict.fromkeys(held, ()))  # fmt: skip
    t = tune("deepseek-v3", "h800", gpus=8, mode="prefill", layers=2, extend_len=1024,
             space=space, sensitivity=False, processes=1)  # fmt: skip
    sbo, serial = (next(p for p in t.points if p.setting.schedule == n) for n in ("sbo", "serial"))
    assert (sbo.ms, sbo.tps) == (serial.ms, serial.tps)  # the test's premise: a tie
    assert t.notes[label(sbo)][0].startswith("ran as serial, without SBO")
    assert t.best == serial and t.frontier[0] == serial
    starred = [line for line in t.text().splitlines() if line.startswith(" *")]
    assert len(starred) == 1 and starred[0].split()[0] == "*serial"


# ---- an answer on DeepEP's normal kernels in decode says what it rests on --------------------


def test_a_decode_answer_on_deepeps_normal_kernels_prints_its_caveat():
    """serial on 2 layers, 128 sequences: the model has the normal kernels ahead, so the best
    runs them and the printed answer carries the caveat, in ``compare``'s form; held at the
    low-latency kernels, it does not."""
    from overlap_lab.caveats import NORMAL_DECODE
    from overlap_lab.tune import tune

    def run(modes):
        space = Space(schedules=("serial",), batches=(128,), ep=(8,), drafts=(),
                      values={"deepep_mode": modes, "deepep_normal_sms": (),
                              "deepep_release": ()})  # fmt: skip
        return tune("deepseek-v3", "h800", gpus=8, layers=2, space=space, sensitivity=False,
                    processes=1)  # fmt: skip

    t = run(("normal",))
    assert t.best.setting.value("deepep_mode") == "normal"  # the test's premise
    said = [line.strip() for line in t.text().splitlines() if line.strip().startswith("caveat")]
    assert said == list(t.caveats) == t.as_dict()["caveats"]
    assert said[0].startswith("caveat (serial): decode on DeepEP's normal kernels")
    assert said[0].endswith(f'(docs/uncertainty.md, "{NORMAL_DECODE}")')
    held = run(())
    assert held.best.setting.value("deepep_mode") is None and held.caveats == ()
    assert "caveat" not in held.text()


def test_the_caveat_names_a_rival_the_best_is_not_separated_from():
    """The best on the low-latency kernels, a rival on the normal ones: the caveat is printed
    where the two are not separated (naming the rival), not where they are; nor in prefill,
    whose kernels are the normal ones by default."""
    from types import SimpleNamespace

    from overlap_lab.tune import Tuning, _caveats, label

    normal = (("deepep_mode", "normal"),)
    best = Point(Setting("sbo", 32), 128, 45.0, 2800.0)
    rival = Point(Setting("sbo-off", 32, knobs=normal), 128, 46.0, 2780.0)
    d = Deployment(ol.model("deepseek-v3"), ol.gpu("h800"), 32)

    def caveats(close, mode="decode"):
        sens = {label(best): SimpleNamespace(not_separated=close)}
        t = Tuning(dataclasses.replace(d, mode=mode), 50.0, (best, rival), (), {}, best,
                   rivals=(rival,), sensitivity=sens)  # fmt: skip
        return _caveats(t)

    (line,) = caveats((label(rival),))
    assert line.startswith("caveat (sbo-off): decode on DeepEP's normal kernels")
    assert caveats(()) == ()
    assert caveats((label(rival),), mode="prefill") == ()
