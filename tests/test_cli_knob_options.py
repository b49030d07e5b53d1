"""The command line's knob options come from the knob records: no class source is read, no
annotation evaluated, and every range and schedule restriction is the record's."""

from __future__ import annotations

import inspect

import pytest

from overlap_lab.checks import partial_knob_readers
from overlap_lab.cli import inputs, options
from overlap_lab.shared.inputs.hardware import gpu_fields, host_cost_fields
from overlap_lab.shared.schedules import SCHEDULES, knobs_of, schedule_knobs


def test_options_are_built_without_reading_source(monkeypatch):
    """Editing a comment in a configuration class no longer changes the command line."""

    def no_source(*a, **kw):
        raise AssertionError("the command line read class source")

    monkeypatch.setattr(inspect, "getsource", no_source)
    monkeypatch.setattr("builtins.eval", no_source)
    p = options.subcommand_parser("sim")
    helps = {a.dest: a.help for a in p._actions}
    for k in schedule_knobs():
        if k.name != "host":
            said = k.default is None and "None" in k.help  # its help says what None means
            default = "" if said else f" (default: {k.default})"
            assert helps[k.name].startswith(f"{k.help}{default}".strip()), k.name
    for k in host_cost_fields():
        assert helps["host_" + k.name].startswith(k.help), k.name
    assert "name" not in helps and "arch" not in helps
    assert not hasattr(options, "_field_comments")


@pytest.mark.parametrize(
    "prefix, records", [("", schedule_knobs()), ("host_", host_cost_fields()), ("", gpu_fields())]
)
def test_every_ranged_record_is_one_limit(prefix, records):
    for k in records:
        if k.lo is None:
            assert prefix + k.name not in inputs.LIMITS, k.name
            continue
        assert inputs.LIMITS[prefix + k.name] == k  # the option is checked by the record itself


def test_knob_schedules_are_the_schedules_declared_knobs():
    """--micro-batches is read by pp alone (tbo splits its own way): the table said tbo too."""
    readers = {
        k.name: [s for s in SCHEDULES if k.name in {r.name for r in knobs_of(s)}]
        for k in schedule_knobs()
    }
    expect = {n: tuple(r) for n, r in readers.items() if len(r) < len(SCHEDULES)}
    readers = partial_knob_readers()
    assert readers == expect
    assert readers["micro_batches"] == ("pp",)
    assert "comm_sms" in readers and "serial" not in readers["comm_sms"]


SMALL = ["sim", "--out", "", "--model", "deepseek-v2-lite", "--layers", "2", "--ep", "8"]


def test_every_ranged_option_states_its_unit():
    parser = options.subcommand_parser("sim")
    helps = {a.dest: " ".join((a.help or "").split()) for a in parser._actions}
    groups = (("", schedule_knobs()), ("host_", host_cost_fields()), ("", gpu_fields()))
    for prefix, records in groups:
        for k in records:
            if k.unit and k.lo is not None:
                assert f" {k.unit}]" in helps[prefix + k.name], k.name
    assert "[1..100000 GB/s]" in helps["rdma_gbps"]


def test_a_value_typed_in_another_unit_is_warned_about_in_one_line(capsys):
    """--rdma-gbps 400 (Gb/s typed, GB/s meant) was taken silently."""
    from overlap_lab.cli.main import main

    assert main([*SMALL, "--rdma-gbps", "400"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warning: --rdma-gbps 400 GB/s" in err and "Gb/s" in err, err
    assert main([*SMALL, "--rdma-gbps", "100", "--nvlink-lat-us", "1"]) == 0
    assert capsys.readouterr().err == ""
