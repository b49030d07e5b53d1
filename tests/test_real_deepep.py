"""The DeepEP wrapper (real/comm/deepep.py) against a fake ``deep_ep`` whose Buffer asserts
DeepEP V1's own preconditions (even SM count, buffer sizing, identical max tokens, previous_event
types, allocate_on_comm_stream only with an async event, async xor hook, clean after normal use),
and computes its results with the exact one-process loopback so whole schedules can run through
the wrapper on the CPU and match serial."""

from __future__ import annotations

import inspect
import types

import pytest

torch = pytest.importorskip("torch")


class FakeEvent:
    def __init__(self, waits=()):
        self.waits = list(waits)

    def current_stream_wait(self):
        for w in self.waits:
            w()
        self.waits = []


class FakeEventOverlap:
    """deep_ep.utils.EventOverlap: ``event`` may be None only for a synchronous call."""

    def __init__(self, event=None, extra_tensors=None):
        self.event = event

    def current_stream_wait(self):
        assert self.event is not None, "DeepEP: current_stream_wait on an event-less EventOverlap"
        self.event.current_stream_wait()


def _check_prev(previous_event, async_finish, allocate_on_comm_stream):
    assert previous_event is None or isinstance(previous_event, FakeEventOverlap), (
        f"previous_event must be DeepEP's EventOverlap, got {type(previous_event).__name__}"
    )
    if allocate_on_comm_stream:  # deep_ep.cpp: EP_HOST_ASSERT(previous_event.has_value() and async)
        assert previous_event is not None and async_finish


class FakeConfig:
    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        return 1 << 20

    def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
        return 1 << 20


def make_fake_deep_ep(*, sbo: bool = False):
    """A module ``deep_ep`` with a Buffer class; ``sbo``: the antgroup-opt LL-SBO signature."""
    from overlap_lab.real.comm.loopback import LoopbackBackend

    log: dict = {"num_sms": [], "clean": 0, "ll_max": set(), "sbo": []}

    class Buffer:
        num_sms = 20

        @staticmethod
        def set_num_sms(new_num_sms: int):
            assert new_num_sms % 2 == 0, "The SM count must be even"
            Buffer.num_sms = new_num_sms
            log["num_sms"].append(new_num_sms)

        @staticmethod
        def get_dispatch_config(num_ranks):
            assert num_ranks in (2, 4, 8, 16, 24, 32, 64, 128, 144, 160), num_ranks
            return FakeConfig()

        get_combine_config = get_dispatch_config

        @staticmethod
        def get_low_latency_rdma_size_hint(m, hidden, num_ranks, num_experts):
            return m * hidden * num_ranks * 8 + num_experts

        def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                     num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True):  # fmt: skip
            assert num_nvl_bytes >= 0 and num_rdma_bytes >= 0
            if low_latency_mode:
                assert num_rdma_bytes > 0, "low-latency mode needs an RDMA buffer"
            self.rdma = num_rdma_bytes
            self.low_latency_mode = low_latency_mode
            self.num_qps = num_qps_per_rank
            self.dirty = False  # normal kernels used the buffer since the last clean
            self.lb = None  # the loopback computing results, built on first use
            self.ll_max = None

        def _lb(self, num_experts, hidden):
            if self.lb is None:
                self.lb = LoopbackBackend(rank=0, world=WORLD, num_experts=num_experts,
                                          hidden=hidden)  # fmt: skip
            return self.lb

        def capture(self):
            return FakeEventOverlap(FakeEvent())

        def clean_low_latency_buffer(self, m, hidden, num_experts):
            assert self.ll_max in (None, m), "clean with another num_max_dispatch_tokens_per_rank"
            self.dirty = False
            log["clean"] += 1

        # normal mode
        def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None,
                                async_finish=False, allocate_on_comm_stream=False):  # fmt: skip
            _check_prev(previous_event, async_finish, allocate_on_comm_stream)
            assert topk_idx.dtype == torch.int64
            self._experts = num_experts
            ev = FakeEventOverlap(FakeEvent()) if async_finish else FakeEventOverlap()
            return "n_rank", None, "n_expert", "in_rank", ev

        def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                     is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                     topk_weights=None, expert_alignment=1, num_worst_tokens=0, config=None,
                     previous_event=None, async_finish=False, allocate_on_comm_stream=False):  # fmt: skip
            _check_prev(previous_event, async_finish, allocate_on_comm_stream)
            assert num_tokens_per_rank == "n_rank" and is_token_in_rank == "in_rank"
            assert topk_weights.dtype == torch.float32, "DeepEP takes float32 topk_weights"
            self.dirty = True
            lb = self._lb(self._experts, x.shape[1])
            r = lb.dispatch(x, topk_idx, topk_weights)
            r.event.current_stream_wait()
            ev = FakeEventOverlap(FakeEvent()) if async_finish else FakeEventOverlap()
            counts = [0] * lb.experts_per_rank
            return r.recv_x, r.recv_topk_idx, r.recv_topk_weights, counts, r.handle, ev

        def combine(self, x, handle, topk_weights=None, bias=None, config=None,
                    previous_event=None, async_finish=False, allocate_on_comm_stream=False):  # fmt: skip
            _check_prev(previous_event, async_finish, allocate_on_comm_stream)
            self.dirty = True
            out, _, ev = self.lb.combine(x, handle)
            ev.current_stream_wait()
            return out, None, FakeEventOverlap(FakeEvent()) if async_finish else FakeEventOverlap()

        # low-latency mode
        def _ll_checks(self, m, async_finish, return_recv_hook):
            assert self.low_latency_mode, "Buffer built without low_latency_mode"
            assert not (async_finish and return_recv_hook), "EP_HOST_ASSERT(not (async and hook))"
            assert not self.dirty, "clean_low_latency_buffer must follow normal-mode use"
            assert self.ll_max in (None, m), "num_max_dispatch_tokens_per_rank changed"
            assert self.rdma >= Buffer.get_low_latency_rdma_size_hint(
                m, self.lb.hidden if self.lb else 0, WORLD, 0
            ), "RDMA buffer too small for num_max_dispatch_tokens_per_rank"
            self.ll_max = m
            log["ll_max"].add(m)

        def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                 cumulative_local_expert_recv_stats=None,
                                 dispatch_wait_recv_cost_stats=None, use_fp8=True,
                                 round_scale=False, use_ue8m0=False, async_finish=False,
                                 return_recv_hook=False):  # fmt: skip
            lb = self._lb(num_experts, x.shape[1])
            self._ll_checks(num_max_dispatch_tokens_per_rank, async_finish, return_recv_hook)
            assert x.shape[0] <= num_max_dispatch_tokens_per_rank, "too many tokens"
            assert x.shape[1] == lb.hidden
            rx, cnt, handle, ev, hook = lb.low_latency_dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                use_fp8=False, return_recv_hook=True,
            )  # fmt: skip
            assert rx.shape[1] == num_max_dispatch_tokens_per_rank * WORLD
            if return_recv_hook:
                return rx, cnt, handle, FakeEventOverlap(), hook
            hook()
            return rx, cnt, handle, FakeEventOverlap(FakeEvent()), None

        def _ll_combine(self, x, topk_idx, topk_weights, handle, async_finish, return_recv_hook):
            self._ll_checks(self.ll_max, async_finish, return_recv_hook)
            assert topk_weights.dtype == torch.float32
            out, ev, hook = self.lb.low_latency_combine(
                x, topk_idx, topk_weights, handle, return_recv_hook=True
            )
            if return_recv_hook:
                return out, FakeEventOverlap(), hook
            hook()
            return out, FakeEventOverlap(FakeEvent()), None

        if sbo:

            def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False,
                                    zero_copy=False, async_finish=False, return_recv_hook=False,
                                    out=None, overlap=False, packed_recv_count=None,
                                    comp_signal=None, block_m=64, threshold=0, num_sms=3):  # fmt: skip
                if overlap:
                    assert comp_signal is not None and comp_signal.dtype == torch.int32
                    assert packed_recv_count is not None and threshold > 0 and num_sms > 0
                    log["sbo"].append(num_sms)
                return self._ll_combine(x, topk_idx, topk_weights, handle, async_finish,
                                        return_recv_hook)  # fmt: skip

        else:

            def low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt=False,
                                    zero_copy=False, async_finish=False, return_recv_hook=False,
                                    out=None, combine_wait_recv_cost_stats=None):  # fmt: skip
                return self._ll_combine(x, topk_idx, topk_weights, handle, async_finish,
                                        return_recv_hook)  # fmt: skip

    mod = types.ModuleType("deep_ep")
    mod.Buffer = Buffer
    mod.log = log
    return mod


WORLD = 2


def _backend(fake, **kw):
    from overlap_lab.real.comm.deepep import DeepEPBackend

    args = dict(group=object(), rank=0, world=WORLD, num_experts=8, hidden=64, deep_ep=fake)
    args.update(kw)
    return DeepEPBackend(**args)


def test_odd_sm_counts_are_rounded_up_to_even_and_reported():
    fake = make_fake_deep_ep()
    be = _backend(fake)
    be.set_num_sms(3, kind="normal_combine")
    be.set_num_sms(24, kind="normal_dispatch")
    assert fake.log["num_sms"] == [4, 24]
    assert "rounded up to 4" in be.sm_limits["normal_combine"]["status"]
    be.set_num_sms(3, kind="ll_combine")  # LL kernels take no SM count: reported, not passed on
    assert fake.log["num_sms"] == [4, 24]
    assert be.sm_limits["ll_combine"]["status"].startswith("not enforced")


def test_ll_buffer_is_sized_for_the_workload_and_refuses_more():
    from overlap_lab.shared.errors import ConfigError

    fake = make_fake_deep_ep()
    be = _backend(fake, num_max_dispatch_tokens_per_rank=256)
    x = torch.randn(200, 64)
    idx = torch.randint(0, 8, (200, 2))
    rx, cnt, handle, ev, hook = be.low_latency_dispatch(x, idx, 200, 8, return_recv_hook=True)
    hook()
    assert rx.shape[1] == 256 * WORLD and fake.log["ll_max"] == {256}
    with pytest.raises(ConfigError, match="exceed"):
        be.low_latency_dispatch(torch.randn(300, 64), idx[:1].repeat(300, 1), 300, 8)
    with pytest.raises(ConfigError, match="1..1024"):
        _backend(fake, num_max_dispatch_tokens_per_rank=4096)


def test_normal_mode_passes_deepep_events_and_ll_after_normal_is_cleaned():
    fake = make_fake_deep_ep()
    be = _backend(fake, num_max_dispatch_tokens_per_rank=64)
    x, idx = torch.randn(16, 64), torch.randint(0, 8, (16, 2))
    w = torch.rand(16, 2)
    r = be.dispatch(x, idx, w, async_finish=True)  # previous_event: a capture of ours
    r.event.current_stream_wait()
    r2 = be.dispatch(x, idx, w, previous_event=be.capture(), async_finish=False)
    out, _, ev = be.combine(r2.recv_x, r2.handle, async_finish=True)
    ev.current_stream_wait()
    assert fake.log["clean"] == 0
    _, _, _, _, hook = be.low_latency_dispatch(x, idx, 16, 8, return_recv_hook=True)
    hook()
    assert fake.log["clean"] == 1 and be.cleans == 1
    _, _, _, _, hook = be.low_latency_dispatch(x, idx, 16, 8, return_recv_hook=True)
    assert fake.log["clean"] == 1  # LL after LL: no clean


def test_sbo_signal_arguments_reach_an_sbo_capable_deepep_only():
    for sbo in (False, True):
        fake = make_fake_deep_ep(sbo=sbo)
        be = _backend(fake, num_max_dispatch_tokens_per_rank=16)
        assert ("sbo_signal" in be.capabilities) == sbo
        x, idx = torch.randn(8, 64), torch.randint(0, 8, (8, 2))
        rx, cnt, handle, _, hook = be.low_latency_dispatch(x, idx, 8, 8, return_recv_hook=True)
        hook()
        sig = torch.zeros(4 * 1, dtype=torch.int32)
        args = dict(signal=sig, block_m=64, threshold=1, num_sms=3, packed_recv_count=cnt)
        out, _, hook = be.low_latency_combine(
            rx, idx, torch.rand(8, 2), handle, return_recv_hook=True, sbo=args
        )
        hook()
        assert fake.log["sbo"] == ([3] if sbo else [])
        assert be.sbo_calls == int(sbo)
        if not sbo:
            assert be.sm_limits["ll_combine_sbo"]["status"].startswith("not enforced")


def test_no_process_group_is_one_clear_error(monkeypatch):
    import torch.distributed as dist

    from overlap_lab.real.comm.deepep import ensure_process_group
    from overlap_lab.shared.errors import ConfigError

    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="torchrun"):
        ensure_process_group()


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_every_schedule_through_the_deepep_wrapper_matches_serial(mode):
    """Whole Programs through DeepEPBackend over the asserting fake: every Buffer call of every
    schedule satisfies DeepEP's preconditions, and the numbers equal serial's."""
    from overlap_lab.real import model as M
    from overlap_lab.real.check import compare_steps, workload_variants
    from overlap_lab.real.executor import execute
    from overlap_lab.shared import schedules as S
    from overlap_lab.shared.inputs.hardware import get_gpu
    from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload

    mc = M.get_model_config("tiny-mla")
    b = Batch.decode(kv_lens=[40] * 6) if mode == "decode" else Batch.prefill(extend_lens=[20, 9])
    w = Workload(mc, b, Parallel(ep=WORLD))
    cfg = M.from_model_config(mc)
    weights = M.init_weights(cfg, seed=0, ep_rank=0, ep_size=WORLD)
    ref = None
    for name in ["serial"] + [n for n in S.available() if n != "serial"]:
        wv = workload_variants(name, w)[0]
        fake = make_fake_deep_ep()
        be = _backend(
            fake,
            num_experts=cfg.num_experts,
            hidden=cfg.hidden,
            num_max_dispatch_tokens_per_rank=b.num_tokens,
        )
        res = execute(S.build(name, wv, get_gpu("h100")), wv, weights=weights, backend=be)
        states = res.outputs[max(res.outputs)]
        if ref is None:
            ref = states[0]
        assert compare_steps(states, ref) < 1e-5, name
        assert all(v % 2 == 0 for v in fake.log["num_sms"]), name
        if mode == "decode":  # low-latency kernels, sized once from the workload
            assert fake.log["ll_max"] == {b.num_tokens}, name
        else:  # normal kernels with the Program's (even) SM count
            assert fake.log["num_sms"] and not fake.log["ll_max"], name


def test_fake_matches_the_signatures_the_notes_give():
    """The wrapper only passes keyword names DeepEP V1's Buffer has."""
    fake = make_fake_deep_ep()
    for meth, names in {
        "dispatch": ("previous_event", "async_finish", "allocate_on_comm_stream"),
        "combine": ("previous_event", "async_finish", "allocate_on_comm_stream"),
        "get_dispatch_layout": ("previous_event", "async_finish", "allocate_on_comm_stream"),
        "low_latency_dispatch": ("use_fp8", "async_finish", "return_recv_hook"),
    }.items():
        params = inspect.signature(getattr(fake.Buffer, meth)).parameters
        assert all(n in params for n in names), meth
