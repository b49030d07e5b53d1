"""pp against its rules in docs/schedules.md (SGLang v0.4.9 event_loop_pp, send/recv_tensor_dict, get_pp_indices).

Golden files: tests/golden/pp_*.txt; regenerate with ``UPDATE_GOLDEN=1 pytest tests/test_sched_pp.py``.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import pytest

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model
from overlap_lab.shared.ir.ops_pp import hidden_bytes, pp_layer_split, pp_link
from overlap_lab.shared.ir.program import Graph, Launch
from overlap_lab.shared.ir.validate import issue_order
from overlap_lab.shared.schedules import ScheduleConfig, build
from overlap_lab.shared.schedules.pp import micro_batch
from overlap_lab.sim import simulate
from tests.invariants import check_all

GPU = get_gpu("h100")
GOLDEN = Path(__file__).parent / "golden"
V3 = get_model("deepseek-v3")
LITE = get_model("deepseek-v2-lite")


def wl(pp, batch=None, model=LITE, **par):
    return Workload(model, batch or Batch.decode(16), Parallel(ep=par.pop("ep", 8), pp=pp, **par))


def pp_prog(w, **kw):
    return build("pp", w, GPU, ScheduleConfig(**kw))


def launches(rp):
    """(iteration index in issue order, stream, op) of a rank, descending into graphs."""
    out = []
    for it in issue_order(rp):
        for ins in it.instr.body if isinstance(it.instr, Graph) else (it.instr,):
            if isinstance(ins, Launch):
                out.append((ins.stream, ins.op))
    return out


# -- layer slices -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pp,sizes",
    [(2, [30, 31]), (4, [15, 15, 15, 16]), (8, [7, 7, 7, 8, 8, 8, 8, 8]), (61, [1] * 61)],
)
def test_sglang_layer_split_deepseek_v3(pp, sizes):
    split = pp_layer_split(V3, pp)
    assert [len(s) for s in split] == sizes
    assert sum(sizes) == V3.num_layers and split[0].start == 0 and split[-1].stop == 61
    assert all(a.stop == b.start for a, b in zip(split, split[1:], strict=False))
    if len(split[0]) >= V3.first_k_dense:  # dense layers on rank 0 (contiguous slices)
        assert all(layer in split[0] for layer in range(V3.first_k_dense))


def test_each_rank_runs_its_slice_and_head_ops():
    w = wl(4, model=V3, ep=16)
    p = pp_prog(w)
    assert p.symmetric is False and p.world == 4 and len(p.ranks) == 4
    split = pp_layer_split(V3, 4)
    for r, rp in enumerate(p.ranks):
        ops = [op for _, op in launches(rp)]
        layers = {op.layer for op in ops if op.layer is not None}
        assert layers == set(split[r])
        names = {op.name for op in ops}
        assert ("embed" in names) is (r == 0)
        assert ({"logits", "sample"} <= names) is (r == 3)
    total = sum(len({op.layer for _, op in launches(rp) if op.layer is not None}) for rp in p.ranks)
    assert total == V3.num_layers


# -- sends and receives -------------------------------------------------------------------------


def _colls(p):
    sends, recvs = defaultdict(list), defaultdict(list)
    for rp in p.ranks:
        for stream, op in launches(rp):
            if op.coll and op.name.startswith("pp_"):
                (sends if op.coll.role == "send" else recvs)[op.coll.key].append(
                    (rp.rank, op, stream)
                )
    return sends, recvs


def test_hidden_states_go_to_the_next_rank_once_per_iteration():
    pp, M, rounds = 4, 4, 2
    w = wl(pp)
    p = pp_prog(w, iterations=rounds)
    sends, recvs = _colls(p)
    hidden = {k: v for k, v in sends.items() if ".hidden." in k}
    assert len(hidden) == (pp - 1) * M * rounds
    for key, [(r, op, stream)] in hidden.items():
        assert stream == "pp_send" and op.coll.flows[0].dst == r + 1
        [(rr, rop, rstream)] = recvs[key]
        assert rr == r + 1 and rstream == "pp_recv" and rop.mb == op.mb and rop.step == op.step
        assert op.coll.flows[0].nbytes == hidden_bytes(w, micro_batch(w, op.mb))


def test_send_allgather_divides_traffic_by_attention_tp():
    w1, w4 = wl(2, attn_tp=1), wl(2, attn_tp=4)
    b1 = next(op for _, op in launches(pp_prog(w1).ranks[0]) if op.name == "pp_send_hidden")
    b4 = next(op for _, op in launches(pp_prog(w4).ranks[0]) if op.name == "pp_send_hidden")
    assert b4.coll.flows[0].nbytes == pytest.approx(b1.coll.flows[0].nbytes / 4)
    ag = [op for _, op in launches(pp_prog(w4).ranks[1]) if op.name == "pp_allgather_hidden"]
    assert ag and ag[0].coll.flows[0].link == "nvlink"
    assert not [
        op for _, op in launches(pp_prog(w1).ranks[1]) if op.name.startswith("pp_allgather")
    ]


def test_pp_link_is_rdma_across_nodes():
    assert pp_link(wl(2, ep=8), 0, 1) == "rdma"
    assert pp_link(wl(2, ep=4), 0, 1) == "nvlink"


def test_next_token_ids_ring_and_forwarding_delay():
    pp, M, rounds = 3, 3, 3
    G = M * rounds
    p = pp_prog(wl(pp), iterations=rounds)
    sends, recvs = _colls(p)
    out_sends = {k: v[0] for k, v in sends.items() if ".out." in k}
    # the last rank sends every iteration's ids to rank 0
    assert sorted(k for k, (r, _, _) in out_sends.items() if r == pp - 1) == sorted(
        f"pp.out.g{g}.r{pp - 1}to0" for g in range(G)
    )
    for key, entries in recvs.items():
        if ".out." not in key:
            continue
        [(dst, rop, _)] = entries
        src, sop, _ = out_sends[key]
        assert sop.coll.flows[0].dst == dst and dst == (src + 1) % pp  # the ring
        if src == pp - 1:  # rank 0 receives it M-1 iterations later, for the next micro-batch
            assert rop.step == sop.step + M - 1 and rop.mb == (rop.step + 1) % M
        else:  # relayed one micro-batch iteration after the relay received it
            assert rop.step == sop.step - 1
    # every rank but the last forwards what it received in the previous iteration
    for r in range(pp - 1):
        fwd = sorted(sop.step for k, (s, sop, _) in out_sends.items() if s == r)
        assert fwd == list(range(M, G))
    # every rank gets each micro-batch's ids (within the window)
    got = defaultdict(set)
    for key, [(dst, rop, _)] in recvs.items():
        if ".out." in key:
            got[dst].add(rop.step)
    assert got[0] == set(range(M - 1, G))
    for r in range(1, pp):
        assert got[r] == set(range(M - 1, G - 1))


def test_process_result_blocks_the_host_on_the_forward():
    p = pp_prog(wl(2))
    rp = p.ranks[0]
    names = [(type(it.instr).__name__, getattr(it.instr, "name", "")) for it in issue_order(rp)]
    syncs = [i for i, n in enumerate(names) if n[0] == "Sync"]
    assert syncs and all(names[i + 1] == ("Host", "process_result") for i in syncs)
    assert p.meta.extra["overlap_schedule"] is False


# -- micro-batches ------------------------------------------------------------------------------


@pytest.mark.parametrize("pp,M", [(2, None), (4, None), (4, 6)])
def test_micro_batch_count_and_round_robin(pp, M):
    rounds = 2
    p = pp_prog(wl(pp), iterations=rounds, micro_batches=M)
    m = M or pp
    assert len(p.meta.micro_batches) == m
    for rp in p.ranks:
        fwd = [op for _, op in launches(rp) if op.layer is not None and op.name == "attn.core"]
        first_layer = min(op.layer for op in fwd)
        order = [op.mb for op in fwd if op.layer == first_layer]
        assert order == [g % m for g in range(m * rounds)]


def test_fewer_micro_batches_than_stages_is_refused():
    with pytest.raises(ConfigError, match="deadlock"):
        pp_prog(wl(4), micro_batches=3)
    with pytest.raises(ConfigError, match="pp-size"):
        pp_prog(wl(1))


def test_speculative_decoding_is_refused():
    """SGLang's server_args: pipeline parallelism is not compatible with speculative decoding,
    so a decode step that verifies drafts (MTP on DeepSeek-V3, or any other drafter) has no pp
    form; compare shows the refusal in pp's row."""
    w = Workload(V3, Batch.decode(16, tokens_per_seq=2), Parallel(ep=8, pp=2))
    with pytest.raises(ConfigError, match="speculative decoding"):
        pp_prog(w)
    pp_prog(Workload(V3, Batch.decode(16), Parallel(ep=8, pp=2)))  # one token per sequence runs


# -- simulation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("pp,batch", [(2, Batch.decode(16)), (3, Batch.prefill(1, extend_len=512))])
def test_simulated_trace_invariants(pp, batch):
    p = pp_prog(wl(pp, batch), iterations=2)
    tr = simulate(p, GPU)
    check_all(p, tr, GPU.num_sms)
    assert set(tr.ranks) == set(range(pp))


def test_more_micro_batches_shrink_the_bubbles():
    def idle(M):
        tr = simulate(pp_prog(wl(4, Batch.decode(64)), iterations=2, micro_batches=M), GPU)
        out = []
        for r in range(4):
            sp = [s for s in tr.spans if s.rank == r and s.lane == "stream:main"]
            busy = sum(s.end - s.start for s in sp)
            out.append(1 - busy / (max(s.end for s in sp) - min(s.start for s in sp)))
        return sum(out) / 4

    assert idle(8) < idle(4)


def test_golden():
    """Rank 1 of a pp=3 decode, first two iterations, one layer per rank kept (deepseek-v2-lite)."""
    p = pp_prog(wl(3), iterations=1)
    keep = {pp_layer_split(LITE, 3)[1].start}
    lines = []
    for line in str(p).splitlines():
        if " layer=" in line and not any(f" layer={k} " in line for k in keep):
            continue
        lines.append(line)
    text = "\n".join(lines) + "\n"
    path = GOLDEN / "pp_decode_pp3.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing golden {path}; run with UPDATE_GOLDEN=1"
    assert text == path.read_text()
