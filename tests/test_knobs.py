"""Knob records: every schedule knob, GPU field and host cost described once, with the help the
command line shows, one validator per knob, and each schedule's own knobs declared in its
module (``Knobs``) and read through ``ScheduleConfig.of``."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from overlap_lab.shared import schedules as S
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import GPU, HostCosts, get_gpu, gpu_fields, host_cost_fields
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model
from overlap_lab.shared.schedules import SCHEDULES, ScheduleConfig, build, knobs_of, schedule_knobs
from overlap_lab.shared.schedules.common import CommonKnobs, resolve_comm_sms

HELP = Path(__file__).parent / "golden" / "cli_help" / "sim.txt"
H800 = get_gpu("h800")


def _shown(k, default) -> str:
    rng = k.range_text()
    if rng and k.is_tuple:
        rng = "each " + rng
    if rng and k.unit:
        rng += " " + k.unit
    # a default of None is said in the knob's own help, never as "(default: None)"
    shown = k.help if default is None else f"{k.help} (default: {default})"
    return shown.strip() + (f" [{rng}]" if rng else "")


@pytest.mark.parametrize(
    "records, shown_default, skip",
    [
        (schedule_knobs(), None, ("host",)),
        (host_cost_fields(), None, ()),
        (gpu_fields(), "preset", ("name", "arch")),
    ],
    ids=["schedule", "host", "gpu"],
)
def test_records_hold_the_help_the_command_line_shows(records, shown_default, skip):
    """`overlap-lab sim -h` (golden) shows each option as "HELP (default: D) [RANGE UNIT]" (no
    default where it is None: the help says what None does): a
    command line built from the records shows the same text."""
    golden = " ".join(HELP.read_text().split())
    golden = re.sub(r"(\w)- (\w)", r"\1-\2", golden)  # argparse wraps after a hyphen
    for k in records:
        if k.name in skip:
            continue
        default = shown_default if shown_default is not None else k.default
        assert _shown(k, default) in golden, k.name


def test_every_config_field_is_a_knob():
    assert [f.name for f in dataclasses.fields(GPU)] == [k.name for k in gpu_fields()]
    assert [f.name for f in dataclasses.fields(HostCosts)] == [k.name for k in host_cost_fields()]
    common = [k.name for k in S.common_knobs()]
    assert [f.name for f in dataclasses.fields(CommonKnobs)] == common
    assert [f.name for f in dataclasses.fields(ScheduleConfig)] == [*common, "own"]
    for name in SCHEDULES:  # a module's own knobs: every field a knob record
        own = getattr(S.module(name), "Knobs", None)
        if own is not None:
            assert [f.name for f in dataclasses.fields(own)] == [k.name for k in S.own_knobs(name)]


def test_only_what_every_schedule_reads_is_a_field():
    """ScheduleConfig holds deepep_mode, cuda_graph and host; every other knob is declared by
    the schedules that read it, and a knob no schedule declares is refused."""
    assert [k.name for k in S.common_knobs()] == ["deepep_mode", "cuda_graph", "host"]
    readers = S.knob_readers()
    assert readers["micro_batches"] == ("pp",)
    assert readers["comm_sms"] == ("sbo", "tbo+sbo", "vllm-dbo", "deepseek")
    assert readers["iterations"] == ("sglang-overlap", "pp")
    with pytest.raises(ConfigError, match="unknown schedule knob 'comm_smz'"):
        ScheduleConfig(comm_smz=3)


def test_comm_sms_means_what_each_schedule_declares():
    """One option, three declarations: sbo's LL combine send SMs, deepseek's partition and
    vllm-dbo's VLLM_DBO_COMM_SMS, each with its own help and range (0 is vllm-dbo's "off")."""
    decl = {
        s: next(k for k in S.own_knobs(s) if k.name == "comm_sms")
        for s in S.knob_readers()["comm_sms"]
    }
    assert "COMBINE_SEND" in decl["sbo"].help and "partition" in decl["deepseek"].help
    assert "VLLM_DBO_COMM_SMS" in decl["vllm-dbo"].help
    assert decl["vllm-dbo"].lo == 0 and decl["sbo"].lo == decl["deepseek"].lo == 1
    cfg = ScheduleConfig(comm_sms=0)  # vllm-dbo takes it, so the configuration does
    w = Workload(
        get_model("deepseek-v2-lite", num_layers=3),
        Batch.prefill(2, extend_len=256),
        Parallel(ep=8),
    )
    build("vllm-dbo", w, H800, cfg)
    with pytest.raises(ConfigError, match=r"comm_sms must be an integer in 1\.\.1023"):
        build("sbo", w, H800, cfg)
    merged = next(k for k in schedule_knobs() if k.name == "comm_sms")
    assert (merged.lo, merged.hi) == (0, 1023)
    assert merged.help.startswith("sbo, tbo+sbo: ") and "; deepseek: " in merged.help


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(comm_sms=-1), "comm_sms must be an integer in 0..1023 or None, got -1"),
        (dict(comm_sms=True), "comm_sms must be an integer"),
        (dict(sbo_mode=4), "sbo_mode must be an integer in 1..3, got 4"),
        (dict(tbo_threshold=0.6), "tbo_threshold must be a number in 0.01..0.5"),
        (dict(delta_stages=-1), "delta_stages"),
        (dict(iterations=0), "iterations must be an integer in 1..64"),
        (dict(micro_batches=0), "micro_batches"),
        (dict(deepep_mode="fast"), "deepep_mode must be one of auto, normal, low_latency"),
        (dict(cuda_graph="yes"), "cuda_graph must be true or false or None"),
        (dict(dbo_decode_token_threshold=-1), "dbo_decode_token_threshold"),
        (dict(dp_ranks_disagree=1), "dp_ranks_disagree must be true or false"),
        (dict(dp_peer_tokens=(4, -1)), "dp_peer_tokens must be a list, each an integer"),
        (dict(iteration_modes=("extend",)), "iteration_modes must be a list, each one of"),
        (dict(iterations=1, iteration_modes=("prefill", "decode")), "lists 2 modes for"),
        (dict(max_running_requests=0), "max_running_requests"),
        (dict(chunked_prefill_size=0), "chunked_prefill_size"),
        (dict(context_len=0), "context_len"),
        (dict(host=None), "host must be a HostCosts"),
    ],
)
def test_each_knob_has_one_validator(kw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ScheduleConfig(**kw)


def test_none_and_lists_where_a_knob_allows_them():
    cfg = ScheduleConfig(chunked_prefill_size=None, dp_peer_tokens=[4, 8], iteration_modes=[])
    assert cfg.dp_peer_tokens == (4, 8) and cfg.iteration_modes == ()
    assert [k.name for k in schedule_knobs() if k.optional] == [
        "cuda_graph",
        "max_running_requests",
        "chunked_prefill_size",
        "context_len",
        "comm_sms",
        "delta_stages",
        "micro_batches",
    ]


def test_comm_sms_is_checked_against_the_gpu_in_one_place():
    assert resolve_comm_sms(8, H800, default=3) == 8
    assert resolve_comm_sms(None, H800, default=3) == 3
    assert resolve_comm_sms(0, H800, default=20, least=0) == 0
    for bad, least in ((132, 1), (0, 1), (132, 0)):
        with pytest.raises(ConfigError, match=f"comm_sms must lie in {least}..131 on h800"):
            resolve_comm_sms(bad, H800, default=3, least=least)


#: A valid value other than the default for every knob.
OTHER = dict(
    comm_sms=8,
    sbo_mode=2,
    tbo_threshold=0.3,
    delta_stages=1,
    iterations=3,
    micro_batches=3,
    deepep_mode="auto",  # read by every schedule: nothing to vary
    cuda_graph=False,
    dbo_decode_token_threshold=1,
    dbo_prefill_token_threshold=1,
    host=HostCosts(schedule_base_us=7.0, process_result_base_us=9.0, recv_requests_us=3.0),
    dp_ranks_disagree=True,
    dp_peer_tokens=(3,),
    disable_overlap_schedule=True,
    disable_consecutive_prefill_overlap=True,
    spec_v2=True,
    grammar=True,
    return_logprob=True,
    iteration_modes=("prefill",),
    max_running_requests=64,
    chunked_prefill_size=None,
    context_len=1 << 20,
)


def test_other_is_complete():
    assert set(OTHER) == {k.name for k in schedule_knobs()}


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_a_schedule_reads_no_knob_it_does_not_declare(name, mode):
    """Changing a knob outside a schedule's KNOBS leaves its Program unchanged."""
    batch = Batch.decode(16, kv_len=256) if mode == "decode" else Batch.prefill(2, extend_len=256)
    par = Parallel(ep=8, pp=2 if name == "pp" else 1)
    w = Workload(get_model("deepseek-v2-lite", num_layers=3), batch, par)
    own = {k.name for k in knobs_of(name)}
    assert own, name
    base = build(name, w, H800)
    for knob, value in OTHER.items():
        if knob not in own:
            assert build(name, w, H800, ScheduleConfig(**{knob: value})) == base, knob


def test_a_config_with_own_knobs_is_a_frozen_value():
    """Sweeps pickle, hash and replace configurations: the own knobs travel with them."""
    import copy
    import pickle

    cfg = ScheduleConfig(micro_batches=4, comm_sms=8)
    assert pickle.loads(pickle.dumps(cfg)) == cfg == copy.deepcopy(cfg)
    assert hash(cfg) == hash(ScheduleConfig(comm_sms=8, micro_batches=4))
    assert dataclasses.replace(cfg, micro_batches=5).own == {"comm_sms": 8, "micro_batches": 5}
    assert cfg.as_dict()["micro_batches"] == 4 and cfg.as_dict()["sbo_mode"] == 1  # defaults too
    with pytest.raises(TypeError):
        cfg.own["micro_batches"] = 2
    with pytest.raises(AttributeError):
        cfg.no_such_knob  # noqa: B018


def test_a_value_is_refused_only_where_no_declaring_schedule_takes_it():
    ScheduleConfig(sbo_mode=2, comm_sms=0)  # sbo refuses 0, vllm-dbo takes it: sbo_mode stays
    with pytest.raises(ConfigError, match=r"^comm_sms must be an integer in 0\.\.1023"):
        ScheduleConfig(comm_sms=-1)  # refused by all three: their ranges' span says so
