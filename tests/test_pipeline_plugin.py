"""A second pipeline schedule from another package: installed (a fake dist-info on sys.path),
found by entry point, and run through ``sim``, ``compare``, a sweep and the CPU check, each
taking its own knob, its metric rule, its workload defaults and its drawing from its module
alone (issue 28: a schedule module owns everything about its schedule).

``pp-stall`` is SGLang's pp with one knob of its own (``stall_us``: a host stall on the first
stage before its first round) and its own way of counting its window (one iteration per round
of every micro-batch, where pp counts each micro-batch iteration)."""

from __future__ import annotations

import json

import pytest

from overlap_lab.shared import schedules as S
from overlap_lab.shared.errors import ConfigError
from tests.plugin_dist import installed

PLUGIN = '''\
"""pp-stall: SGLang's event_loop_pp with a host stall on the first stage (a test plug-in)."""

import dataclasses
from dataclasses import dataclass

from overlap_lab.shared.inputs.knobs import knob
from overlap_lab.shared.ir.program import Host
from overlap_lab.shared.schedules import pp

UPSTREAM = "none (a test plug-in over SGLang's event_loop_pp)"
SUMMARY = "pp with a host stall on the first stage before its first round"
SUPPORTS_PP = True
DRAWING = pp.DRAWING
prepare_workload = pp.prepare_workload


@dataclass(frozen=True)
class Knobs(pp.Knobs):
    stall_us: float = knob(0.0, "host stall on stage 0 before its first round", unit="us",
                           lo=0, hi=1e6)


def build(w, gpu, cfg):
    p = pp.build(w, gpu, cfg)
    stall = cfg.of(Knobs).stall_us
    first = p.ranks[0]
    thread = first.threads[0]
    thread = dataclasses.replace(thread, instrs=(Host("stall", stall), *thread.instrs))
    first = dataclasses.replace(first, threads=(thread, *first.threads[1:]))
    meta = p.meta.merged(stall_us=stall)
    return dataclasses.replace(p, ranks=(first, *p.ranks[1:]), meta=meta)


def iterations_and_tokens(program, w):
    """One iteration per round of every micro-batch (pp counts each micro-batch iteration)."""
    rounds = int(program.meta.extra["iterations"])
    mbs = len(program.meta.micro_batches)
    return rounds, rounds * mbs * w.batch.num_tokens // int(program.meta.pp_size)


def window_note(cfg):
    return f"pp-stall: rounds of every micro-batch, {cfg.of(Knobs).stall_us:g} us stall first."


def cpu_check_config(cfg):
    return dataclasses.replace(cfg, stall_us=cfg.of(Knobs).stall_us or 3.0)
'''

SMALL = ["--model", "deepseek-v2-lite", "--layers", "4", "--ep", "8", "--batch", "8"]


@pytest.fixture
def plugin(tmp_path):
    with installed(
        tmp_path / "site",
        "overlap-lab-pp-stall",
        {"overlap_lab_pp_stall": PLUGIN},
        {"overlap_lab.schedules": {"pp-stall": "overlap_lab_pp_stall"}},
    ):
        yield


def _json(capsys, argv: list[str]) -> dict:
    from overlap_lab.cli.main import main

    assert main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_the_registry_learns_its_knob_and_rules(plugin):
    assert S.available()[-1] == "pp-stall" and S.supports_pp("pp-stall")
    assert S.pipeline_schedules() == ["pp", "pp-stall"]
    assert S.knob_readers()["stall_us"] == ("pp-stall",)
    assert S.knob_readers()["micro_batches"] == ("pp", "pp-stall")  # inherited from pp's Knobs
    assert S.drawing("pp-stall").every_rank
    cfg = S.ScheduleConfig(stall_us=250.0)
    assert cfg.stall_us == 250.0 and S.window_note("pp-stall", cfg).endswith("250 us stall first.")
    with pytest.raises(ConfigError, match="^stall_us must be a number in 0..1e"):
        S.ScheduleConfig(stall_us=-1.0)


def test_sim_takes_its_knob_and_counts_its_window_its_way(plugin, capsys):
    from overlap_lab.cli.main import main
    from overlap_lab.cli.options import subcommand_parser

    helps = {a.dest: a.help for a in subcommand_parser("sim")._actions}
    assert helps["stall_us"].startswith("pp-stall: host stall on stage 0")
    base = _json(capsys, ["sim", "--schedule", "pp-stall", *SMALL, "--out", "", "--json"])
    res = _json(
        capsys,
        ["sim", "--schedule", "pp-stall", "--stall-us", "500", *SMALL, "--out", "", "--json"],
    )
    pp = _json(capsys, ["sim", "--schedule", "pp", *SMALL, "--out", "", "--json"])
    assert res["pp"] == 2 and "2 pipeline stages (default)" in res["notes"]  # pp's default, reused
    assert res["iterations"] == 4 and pp["iterations"] == 8  # its rule: rounds, not micro-batches
    assert res["tokens"] == pp["tokens"]  # the same tokens through the pipeline
    assert res["window_us"] - base["window_us"] == pytest.approx(500.0, abs=1.0)
    assert base["window_us"] == pytest.approx(pp["window_us"])  # stall 0: pp's Program
    # its knob applies to it alone
    assert main(["sim", "--schedule", "serial", "--stall-us", "5", *SMALL, "--out", ""]) == 2
    assert "--stall-us applies to --schedule pp-stall only" in capsys.readouterr().err


def test_compare_runs_it_on_a_pipeline_baseline_with_its_note(plugin, capsys, tmp_path):
    from overlap_lab.cli.main import main

    argv = ["compare", "--schedules", "serial,pp,pp-stall", "--stall-us", "500", *SMALL]
    out = _json(capsys, [*argv, "--out", str(tmp_path / "json"), "--json"])
    rows = {r["schedule"]: r for r in out["results"]}
    assert rows["pp-stall"]["baseline"] == rows["pp"]["baseline"] == "serial EP16"
    assert rows["pp-stall"]["iterations"] == 4 and rows["pp"]["iterations"] == 8
    assert rows["pp-stall"]["window_us"] > rows["pp"]["window_us"] + 400
    assert main([*argv, "--out", str(tmp_path / "text")]) == 0
    text = " ".join(capsys.readouterr().out.split())  # the footnotes are wrapped
    assert "pp-stall: rounds of every micro-batch, 500 us stall first." in text
    assert "(pp, pp-stall: serial on its stages x EP GPUs" in text
    assert (tmp_path / "text" / "compare.png").is_file()


def test_a_sweep_crosses_it_with_its_knob(plugin, tmp_path):
    from overlap_lab.cli import sweep

    for cached in (sweep._sim_parser, sweep._knob_actions, sweep._defaults):
        cached.cache_clear()  # the sweep reads sim's options once per process
    spec = {
        "base": {"model": "deepseek-v2-lite", "layers": 4, "ep": 8, "batch": 8, "pp_size": 2},
        "grid": {"schedule": ["pp", "pp-stall"], "stall_us": [0, 500]},
    }
    try:
        stats = sweep.run_sweep(spec, tmp_path / "rows.csv", processes=1, progress=False)
        rows = sweep.read_rows(tmp_path / "rows.csv")
    finally:
        for cached in (sweep._sim_parser, sweep._knob_actions, sweep._defaults):
            cached.cache_clear()
    assert stats["errors"] == 0
    by = {(r["schedule"], float(r["stall_us"])): r for r in rows}
    assert len(by) == 4
    # pp does not read stall_us: its two cases are one simulation
    assert by[("pp", 500.0)]["sim_key"] == by[("pp", 0.0)]["sim_key"]
    stall, plain = by[("pp-stall", 500.0)], by[("pp-stall", 0.0)]
    assert float(stall["window_us"]) - float(plain["window_us"]) == pytest.approx(500.0, abs=1.0)
    assert int(plain["iterations"]) == 4 and int(by[("pp", 0.0)]["iterations"]) == 8


def test_the_cpu_check_runs_it_with_its_own_configuration(plugin, capsys):
    pytest.importorskip("torch")
    from overlap_lab.real.check import split_config

    assert split_config(None, ["pp-stall"]).stall_us == 3.0  # its cpu_check_config
    out = _json(
        capsys,
        ["run", "--device", "cpu", "--check", "--schedule", "pp-stall", "--stall-us", "7",
         "--json"],
    )  # fmt: skip
    assert out["ok"] and out["max_rel_diff_vs_serial"]["pp-stall"] <= out["tolerance"]
    assert out["provenance"]["inputs"]["knobs"]["stall_us"] == 7.0


def test_the_documented_plugin_runs(tmp_path, capsys):
    """docs/schedules.md's example module, installed as written, takes its knob in `sim`."""
    import re
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "schedules.md").read_text()
    (source,) = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "my-schedule" in b]
    with installed(
        tmp_path / "site",
        "my-schedule",
        {"my_schedule": source},
        {"overlap_lab.schedules": {"my-schedule": "my_schedule"}},
    ):
        argv = ["sim", "--schedule", "my-schedule", *SMALL, "--out", "", "--json"]
        plain = _json(capsys, argv)
        stalled = _json(capsys, [*argv, "--stall-us", "300"])
    assert plain["iterations"] == 4 and plain["pp"] == 2
    assert stalled["window_us"] - plain["window_us"] == pytest.approx(300.0, abs=1.0)
