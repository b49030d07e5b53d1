"""GPU paths (skipped without CUDA): streams/events timing, the emulated backend's kernels."""

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _tiny_workload(mode="decode"):
    from real import model as M
    from shared.workload import Batch, Parallel, Workload

    b = Batch.decode(kv_lens=[64] * 8) if mode == "decode" else Batch.prefill(extend_lens=[96, 40])
    return Workload(M.get_model_config("tiny-mla"), b, Parallel(ep=4))


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_gpu_schedules_match_serial_and_time_every_op(mode):
    pytest.importorskip("triton")
    from real.check import compare_steps
    from real.comm import make_backend
    from real.executor import execute
    from shared import schedules as S
    from shared.hardware import get_gpu

    w = _tiny_workload(mode)
    gpu = get_gpu("h100")
    outs = {}
    for name in S.available():
        be = make_backend("emulated", rank=0, world=4, num_experts=8, hidden=64)
        res = execute(S.build(name, w, gpu), w, backend=be, device="cuda", warmup=1, repeats=3)
        assert res.trace.meta["backend"] == "emulated" and res.trace.meta["emulated"]
        assert all(s.end >= s.start for s in res.trace.spans)
        outs[name] = res.outputs[0]
    for name, states in outs.items():
        assert compare_steps(states, outs["serial"][0]) < 2e-2, name  # bf16


def test_emulated_link_kernel_holds_until_arrival():
    pytest.importorskip("triton")
    from real.comm import make_backend
    from real.comm.bytes import LinkParams

    link = LinkParams(nvlink_gbps=1.0, nvlink_lat_us=50.0)  # slow link: arrival dominates
    be = make_backend("emulated", rank=0, world=2, num_experts=8, hidden=1024, link=link, num_sms=4)
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, 8, (64, 2), device="cuda")
    w = torch.ones(64, 2, device="cuda")
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    r = be.dispatch(x, idx, w, async_finish=True)
    r.event.current_stream_wait()
    b.record()
    torch.cuda.synchronize()
    expected_us = be.launches[-1]["delay_us"]
    assert a.elapsed_time(b) * 1e3 >= 0.9 * expected_us
