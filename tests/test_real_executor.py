"""The executor (real/executor.py, real/runner.py) on the CPU: every schedule computes serial's
numbers, every op is bound, races the GPU would have are caught, host threads hand over at yields
in the shared issue order, padding is inert, and an invalid Program is the validator's error."""

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from overlap_lab.real import kernels as K  # noqa: E402
from overlap_lab.real import model as M  # noqa: E402
from overlap_lab.real.check import (  # noqa: E402
    check_equivalence,
    check_pp_outputs,
    compare_steps,
    default_workloads,
    workload_variants,
)
from overlap_lab.real.executor import HazardError, execute  # noqa: E402
from overlap_lab.shared import schedules as S  # noqa: E402
from overlap_lab.shared.inputs.hardware import get_gpu  # noqa: E402
from overlap_lab.shared.inputs.workload import Batch, MicroBatch, Parallel, Workload  # noqa: E402
from overlap_lab.shared.ir.builder import RankBuilder, program  # noqa: E402
from overlap_lab.shared.ir.ops import head_ops, layer_ops  # noqa: E402
from overlap_lab.shared.ir.program import Coll, Op, ops_of  # noqa: E402
from overlap_lab.shared.ir.validate import ProgramError  # noqa: E402

GPU = get_gpu("h100")


@pytest.fixture(scope="module")
def workloads():
    return default_workloads()


@pytest.fixture(scope="module")
def weights():
    return M.init_weights(M.get_config("tiny-mla"), seed=0)


def _forward(w, mb, step=0, layers=None):
    h = head_ops(w, GPU, mb, step=step)
    ops = [h["embed"]]
    for layer in layers if layers is not None else range(w.model.num_layers):
        ops += layer_ops(w, GPU, layer, mb, step=step).values()
    return ops + [h["logits"], h["sample"], h["d2h"]]


def _serial_ref(w, weights):
    return execute(S.build("serial", w, GPU), w, weights=weights).outputs[0][0]


def test_every_op_name_emitted_by_every_schedule_is_bound(workloads):
    names = set()
    built = set()
    for name in S.available():
        for w in workloads:
            for wv in workload_variants(name, w):  # pp: pp=2 and pp=3 copies
                try:
                    prog = S.build(name, wv, GPU)
                except Exception:  # a schedule may refuse a workload (ConfigError)
                    continue
                built.add(name)
                names |= {op.name for _, op in ops_of(prog)}
    assert built == set(S.available())
    assert {"pp_send_hidden", "pp_recv_hidden", "pp_send_out", "pp_recv_out"} <= names
    assert K.unbound(names) == []
    tp2 = dataclasses.replace(workloads[0], parallel=Parallel(ep=2, attn_tp=2, pp=2))
    assert K.unbound({op.name for _, op in ops_of(S.build("pp", tp2, GPU))}) == []


def test_every_schedule_matches_serial(workloads):
    res = check_equivalence(workloads=workloads)
    assert not res.errors, res.errors
    assert set(res.max_rel_diff_vs_serial) | set(res.skipped) == set(S.available())
    assert res.ok, res.max_rel_diff_vs_serial


def test_every_schedule_matches_serial_on_gqa():
    res = check_equivalence(workloads=default_workloads("tiny-gqa")[::3])
    assert not res.errors and res.ok, (res.errors, res.max_rel_diff_vs_serial)


def test_two_chunk_workload_really_splits_a_sequence(workloads):
    if "tbo" not in S.available():
        pytest.skip("tbo not implemented yet")
    prog = S.build("tbo", workloads[3], GPU)
    assert any(m["split_seq"] for m in prog.meta.micro_batches)


def test_unordered_cross_stream_read_is_caught(weights):
    w = Workload(M.get_model_config("tiny-mla"), Batch.decode(kv_lens=[4, 6]), Parallel(ep=2))
    mb = MicroBatch(0, 0, 2, 0, 2, 2)
    ops = _forward(w, mb)
    i = next(k for k, op in enumerate(ops) if op.name == "experts")

    def build(with_wait: bool):
        r = RankBuilder(0, ("main", "alt"))
        t = r.thread("main")
        for k, op in enumerate(ops):
            if k == i:
                if with_wait:
                    t.wait_stream("alt", "main")
                t.launch(op, "alt")
                t.wait_stream("main", "alt")
            else:
                t.launch(op, "main")
        return program([r], world=2, schedule="racy", micro_batches=[mb.as_meta()])

    with pytest.raises(HazardError, match="experts .* reads recv"):
        execute(build(False), w, weights=weights)
    out = execute(build(True), w, weights=weights).outputs[0][0]
    assert compare_steps({0: out}, _serial_ref(w, weights)) == 0.0


def test_host_threads_hand_over_round_robin_at_yields(weights):
    w = Workload(M.get_model_config("tiny-mla"), Batch.decode(kv_lens=[4, 6]), Parallel(ep=2))
    r = RankBuilder(0, ("main",))
    a, b = r.thread("a"), r.thread("b")
    for k in range(3):
        a.launch(Op("noop", mb=10 + k), "main").yield_()
        b.launch(Op("noop", mb=20 + k), "main").yield_()
    res = execute(program([r], world=1), w, weights=weights)
    order = [s.mb for s in sorted(res.trace.spans, key=lambda s: s.start) if s.op == "noop"]
    assert order == [10, 20, 11, 21, 12, 22]


def test_padding_rows_do_not_change_real_tokens(weights):
    w = Workload(M.get_model_config("tiny-mla"), Batch.decode(kv_lens=[5, 9, 3]), Parallel(ep=2))
    padded = MicroBatch(0, 0, 3, 0, 3, 8)
    ops = [dataclasses.replace(op, tokens=8) for op in _forward(w, MicroBatch(0, 0, 3, 0, 3, 3))]
    r = RankBuilder(0, ("main",))
    t = r.thread("main")
    for op in ops:
        t.launch(op, "main")
    prog = program([r], world=2, micro_batches=[padded.as_meta()])
    out = execute(prog, w, weights=weights).outputs[0][0]
    assert compare_steps({0: out}, _serial_ref(w, weights)) < 1e-5


def test_in_process_ranks_meet_at_point_to_point(weights):
    """Two pipeline stages as one non-symmetric Program: rank 0 sends, rank 1 receives."""
    w = Workload(M.get_model_config("tiny-mla"), Batch.decode(kv_lens=[4, 6]), Parallel(ep=2))
    mb = MicroBatch(0, 0, 2, 0, 2, 2)
    ops = _forward(w, mb)
    cut = 1 + len(layer_ops(w, GPU, 0, mb)) + len(layer_ops(w, GPU, 1, mb))
    key = Coll("s0.mb0.pp", "send")
    r0, r1 = RankBuilder(0, ("main",)), RankBuilder(1, ("main",))
    t0, t1 = r0.thread("main"), r1.thread("main")
    t1.launch(Op("recv", mb=0, step=0, coll=Coll(key.key, "recv")), "main")  # blocks first
    for op in ops[cut:]:
        t1.launch(op, "main")
    for op in ops[:cut]:
        t0.launch(op, "main")
    t0.launch(Op("send", mb=0, step=0, coll=key), "main")
    prog = program([r0, r1], world=2, symmetric=False, micro_batches=[mb.as_meta()])
    out = execute(prog, w, weights=weights).outputs
    assert compare_steps(out[1], _serial_ref(w, weights)) == 0.0
    t0.instrs.pop()  # no send: rank 1 would wait forever; the validator refuses it first
    with pytest.raises(ProgramError, match=r"(?s)without its issue half.*recv .*<-- ERROR HERE"):
        execute(
            program([r0, r1], world=2, symmetric=False, micro_batches=[mb.as_meta()]),
            w,
            weights=weights,
        )


def test_pp_stages_hand_hidden_on_and_ids_back_to_rank_0(workloads, weights):
    """pp=3: hidden + residual cross two stage boundaries, the last stage's ids reach rank 0 and
    are relayed on to rank 1 one iteration later; a wrong hand-over shows up against serial."""
    w = workloads[2]
    w3 = dataclasses.replace(w, parallel=dataclasses.replace(w.parallel, pp=3))
    prog = S.build("pp", w3, GPU)
    ref = _serial_ref(w, weights)
    out = execute(prog, w3, weights=weights).outputs
    assert [sum(bool(s.covered) for s in out[r].values()) for r in (0, 1, 2)] == [0, 0, 12]
    assert compare_steps(out[2], ref) == 0.0
    check_pp_outputs(out)
    relayed = [m for st in out[1].values() for m in st.mbs.values() if "next_ids" in m]
    assert relayed and all(
        torch.equal(m["next_ids"][1], relayed[0]["next_ids"][1]) for m in relayed
    )

    send = K.bind("pp_send_hidden")

    def halve_hidden(ctx):
        send(ctx)
        key = ctx.op.coll.key
        ctx.world.box[key][-1][1]["hidden"] = ctx.world.box[key][-1][1]["hidden"] * 0.5

    halving = K.KernelFamily("halving", "a wrong hand-over", {"pp_send_hidden": halve_hidden})
    bad = execute(prog, w3, weights=weights, kernels=[halving])
    assert compare_steps(bad.outputs[2], ref) > 1e-2
    assert bad.trace.meta["kernel_families"]["halving"] == 1


def test_sglang_overlap_with_logprobs_runs_and_matches_serial():
    """--return-logprob adds D2H copies of the sampled ids' log-probabilities."""
    from overlap_lab.real.check import check_equivalence, default_workloads
    from overlap_lab.shared.schedules import ScheduleConfig

    r = check_equivalence(
        ["sglang-overlap"], default_workloads()[:1], cfg=ScheduleConfig(return_logprob=True)
    )
    assert not r.errors and r.ok, r.errors


def test_an_invalid_program_is_the_validators_error_and_nothing_runs(weights):
    """The executor validates every Program with shared.ir.validate, as the simulator does: a
    wait on an event nobody records is refused naming the instruction (before any kernel runs:
    an op that would fail if it ran does not), and with the GPU it was built for, an SM demand
    above that GPU's SMs too."""
    w = Workload(M.get_model_config("tiny-mla"), Batch.decode(kv_lens=[4, 6]), Parallel(ep=2))

    def ran(ctx):
        raise AssertionError("a kernel ran")

    boom = K.KernelFamily("boom", "fails if run", {"noop": ran})
    r = RankBuilder(0, ("main", "alt"))
    r.thread("main").launch(Op("noop"), "main").wait("main", "never").launch(Op("noop"), "main")
    with pytest.raises(ProgramError, match=r"(?s)event 'never' is never recorded.*ERROR HERE"):
        execute(program([r], world=1), w, weights=weights, kernels=[boom])
    r = RankBuilder(0, ("main",))
    r.thread("main").launch(Op("noop", sms=GPU.num_sms + 1), "main")
    execute(program([r], world=1), w, weights=weights)  # no GPU named: no SM rule
    with pytest.raises(ProgramError, match=f"asks for {GPU.num_sms + 1} SMs but the GPU has"):
        execute(program([r], world=1), w, weights=weights, gpu=GPU)


def test_ranks_run_in_the_shared_issue_order(weights):
    """Three host threads of unequal length that yield at different places: the executor runs
    the ops in shared.ir.issue's order (the simulator's), not an order of its own."""
    from overlap_lab.shared.ir.issue import issue_order

    w = Workload(M.get_model_config("tiny-mla"), Batch.decode(kv_lens=[4, 6]), Parallel(ep=2))
    r = RankBuilder(0, ("main",))
    a, b, c = r.thread("a"), r.thread("b"), r.thread("c")
    for k in range(4):
        a.launch(Op("noop", mb=10 + k), "main")
        if k % 2:
            a.yield_()
    b.launch(Op("noop", mb=20), "main").yield_().yield_()
    b.launch(Op("noop", mb=21), "main")
    for k in range(3):
        c.launch(Op("noop", mb=30 + k), "main").yield_()
    prog = program([r], world=1)
    want = [it.instr.op.mb for it in issue_order(prog.ranks[0]) if hasattr(it.instr, "op")]
    res = execute(prog, w, weights=weights)
    got = [s.mb for s in sorted(res.trace.spans, key=lambda s: s.start) if s.op == "noop"]
    assert got == want and sorted(got) != got  # interleaved, as the issue order says
