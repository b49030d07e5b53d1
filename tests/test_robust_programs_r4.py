"""Issue 32's validated Programs that crashed or hung, and the rules that fixed them: every
one now ends validated-and-simulated (every invariant of
``tests.invariants`` holding) or refused naming its instruction; a waved kernel's waves are
handed out in closed form, so its CTA count does not set the run's events; one kernel's CTAs
pull HBM alike on every SM they hold.

The Program texts are in ``tests/data/issue32_programs`` (the round's reproducers, as found)."""

from __future__ import annotations

from pathlib import Path

import pytest

from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.ir.program import parse
from overlap_lab.shared.ir.validate import ProgramError, validate
from overlap_lab.sim.engine import Engine
from tests.invariants import check_all, critical_path_us, never_faster_than_alone

H800 = get_gpu("h800")
DATA = Path(__file__).parent / "data" / "issue32_programs"
#: Events any of these Programs may take: each has a handful of kernels, whatever their grids
BUDGET = 1000


def _programs() -> list[str]:
    return sorted(p.name for p in DATA.glob("*.txt"))


def outcome(text: str) -> str:
    """``validated`` (simulated within BUDGET events, every invariant holding) or ``refused``
    (a ProgramError whose first line names where and whose text marks it)."""
    program = parse(text)
    try:
        validate(program, H800.num_sms)
    except ProgramError as e:
        assert "<-- ERROR HERE" in str(e), str(e)
        return "refused"
    trace = Engine(program, H800, max_events=BUDGET).run()
    check_all(program, trace, H800.num_sms)
    never_faster_than_alone(program, trace, H800)
    assert trace.step_time_us >= critical_path_us(program, H800) * (1 - 1e-9) - 1e-6
    return "validated"


@pytest.mark.parametrize("name", _programs())
def test_every_reproducer_simulates_or_is_refused(name):
    """11 crashed the simulator (a KeyError on a ``pcie`` flow, ...), 6 ran without bound (CTA
    counts 1e6-1e10 beside a competitor: one event per wave)."""
    assert outcome((DATA / name).read_text()) in ("validated", "refused")


def _pair(ctas: float, small: str = "hbm_bytes=1000000.0 sms=1") -> str:
    return (
        "rank 0 streams=a,b\n  thread t\n"
        f"    launch b small {small}\n"
        f"    launch a big hbm_bytes=1000000000.0 ctas={int(ctas)}\n"
    )


@pytest.mark.parametrize("ctas", [1e3, 1e5, 1e7, 1e10])
@pytest.mark.parametrize(
    "small", ["hbm_bytes=1000000.0 sms=1", "hbm_bytes=3e7 sms=8", "flops=1e9 sms=4"]
)
def test_a_waved_kernel_beside_another_takes_a_few_events_whatever_its_ctas(ctas, small):
    """Beside a kernel that held one SM, the waved kernel's pending CTAs all went to the first
    SMs to come free; each wave boundary then cut them back and handed the SMs over again: an
    event per wave (1e7 CTAs: 97,000 events; 1e10 never ended). Each new cohort now takes as
    many waves as the kernel's SMs all have left (``sim.resources.Gpu._share``)."""
    program = parse(_pair(ctas, small))
    engine = Engine(program, H800, max_events=60)
    trace = engine.run()
    never_faster_than_alone(program, trace, H800)
    assert trace.step_time_us >= critical_path_us(program, H800) * (1 - 1e-9)


def test_the_step_time_does_not_depend_on_how_a_grid_is_cut():
    """The same work in 1e5 or 1e10 CTAs: waves of tiny CTAs, the same bytes; the times agree
    to well under one of the kernel's 1e5-CTA waves (~3.9 µs)."""
    times = [Engine(parse(_pair(c)), H800).run().step_time_us for c in (1e5, 1e7, 1e10)]
    assert max(times) - min(times) < 0.1, times


def test_cohorts_of_one_kernel_pull_hbm_alike_per_cta():
    """N4: water-filling cohorts by their own caps gave the big kernel's one-SM cohort its one-SM
    cap, ~3x the even share per SM: its CTAs ran 3x faster than the same kernel's CTAs on the
    other 131 SMs (a waved kernel that ran faster beside a competitor). Now every CTA of a
    kernel progresses at one rate."""
    engine = Engine(parse(_pair(1e5)), H800)
    for r in engine.ranks.values():
        engine.env.process(engine._host(r))
    engine.env.run(until=30.0)  # the small kernel has ended; big runs on two cohorts
    gpu = engine.ranks[0].gpu
    cohorts = [c for c in gpu.jobs if c.kernel.op.name == "big"]
    assert len(cohorts) == 2 and {c.sms for c in cohorts} == {1, 131}
    rates = [c.rate for c in cohorts]  # waves per µs: one wave is one round of CTAs per SM
    assert max(rates) == pytest.approx(min(rates), rel=1e-9), rates


def _run(text: str):
    program = parse(text)
    validate(program, H800.num_sms)
    return program, Engine(program, H800, max_events=BUDGET).run()


def _link_us(nbytes: float) -> float:
    """An NVLink flow alone on its port, last byte leaving to arrival."""
    return nbytes / H800.link_bytes_per_us("nvlink", True) + H800.link_latency_us("nvlink")


def test_a_flow_nobody_receives_ends_no_kernel_and_lands_in_the_step_of_its_sender():
    """below_cp_min: rank 1 sends 1e16 bytes of key ``k`` to rank 0, where no op receives
    ``k`` (pp's last stage does this: rank 0 receives it in the next step). The bytes land in
    rank 0's memory as an NVLink store does, with no kernel of rank 0 waiting: both kernels end
    as they start (nothing to compute, nothing received), rank 0's step is its launch alone, and
    the step ends at the sender's last byte. It was reported below a critical path that let the
    flow end an op of rank 0; ``critical_path_us`` counts received flows only."""
    program, trace = _run((DATA / "below_cp_min.txt").read_text())
    kernels = [s for s in trace.spans if s.lane == "stream:main"]
    assert [(s.rank, s.start, s.end) for s in kernels] == [(0, 5.0, 5.0), (1, 5.0, 5.0)]
    assert trace.per_rank_step_us()[0] == 5.0
    assert trace.step_time_us == pytest.approx(5.0 + _link_us(1e16), rel=1e-12)
    assert trace.step_time_us >= critical_path_us(program, H800)


def test_unreceived_sends_of_one_rank_share_its_port_and_hold_no_stream():
    """raw_inv_below_cp_*_V13: each rank sends the other a key the other does not receive
    (rank 1 twice, 1e16 bytes each). No kernel waits for its own sends (a DeepEP or NCCL send
    of an unreceived key completes nothing), so rank 1's second kernel starts at its launch;
    the two flows share rank 1's NVLink egress and end together, at all 2e16 bytes through it."""
    text = (DATA / "raw_inv_below_cp_repro_V13_recv_sendrecv_self_pair_explicit_2.txt").read_text()
    program, trace = _run(text)
    kernels = [(s.rank, s.start, s.end) for s in trace.spans if s.lane == "stream:main"]
    assert kernels == [(0, 5.0, 5.0), (1, 5.0, 5.0), (1, 10.0, 10.0)]
    assert trace.per_rank_step_us()[0] == pytest.approx(5.0 + _link_us(1000.0), rel=1e-12)
    assert trace.step_time_us == pytest.approx(5.0 + _link_us(2e16), rel=1e-12)
    assert trace.step_time_us >= critical_path_us(program, H800)


@pytest.mark.parametrize("nbytes", [1e6, 1e9])
def test_a_received_flow_bounds_its_receiver(nbytes):
    """The critical path counts the flows some op receives: a recv ends no earlier than its
    data alone on the link could arrive (so the bound is not met by ignoring the network)."""
    text = (
        "program world=2 symmetric=false\n"
        "rank 0 streams=main\n  thread main\n    launch main r kind=comm sms=8 coll=k:recv\n"
        "rank 1 streams=main\n  thread main\n"
        f"    launch main s kind=comm sms=8 coll=k:send flow=nvlink:0:{nbytes}\n"
    )
    program, trace = _run(text)
    bound = critical_path_us(program, H800)
    assert bound == pytest.approx(nbytes / H800.link_bytes_per_us("nvlink", True))
    (recv,) = [s for s in trace.spans if s.rank == 0 and s.lane == "stream:main"]
    assert recv.end == pytest.approx(5.0 + _link_us(nbytes), rel=1e-12)
    assert trace.step_time_us >= bound
