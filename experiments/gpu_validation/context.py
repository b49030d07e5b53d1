"""What every case of the loop shares (device, GPU preset, model, weights, options) and how it
measures a Program: the executor with the emulated backend, recorded with its kernels' device
time for a calibration. :class:`Setup` and :func:`case_workload` are the part a replay of a
recorded archive needs too (no torch)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from overlap_lab.experiments.gpu_validation.comm_only import comm_kernels


@dataclass(frozen=True)
class Setup:
    """What a prediction needs of the machine a loop ran on: its GPU preset (with the graph gap
    the calibration measured, where it did), its SMs and its environment record."""

    gpu: Any
    device_sms: int
    env: Mapping = field(default_factory=dict)
    #: the emulated backend's data path per (comm op, tokens), µs: ``emulated_comm.local_work``
    comm_local: Mapping = field(default_factory=dict)
    #: the executor's host time per eager launch (``device_time.HostLaunch``), None: the
    #: preset's ``launch_us`` per op
    host_launch: Any = None
    #: the wait before a replayed graph's first kernel by the records of the graph's first
    #: segment (``overlap_lab.graph_launch.LaunchWait``), None: ``gpu.graph_launch_us`` each
    graph_wait: Any = None
    #: per op name the share of its host work the executor spends per sequence piece
    #: (``host_pieces.PieceShare``): an op it runs once per piece of its micro-batch
    host_pieces: Mapping = field(default_factory=dict)


def model_config(name: str, layers: int | None):
    """The model of a loop: a shared preset (no torch) or one of the executor's tiny ones,
    cut to ``layers`` layers."""
    from overlap_lab.shared.errors import ConfigError
    from overlap_lab.shared.inputs.workload import get_model, with_layers

    try:
        return with_layers(get_model(name), layers)
    except ConfigError:
        from overlap_lab.real import model as M

        return M.get_model_config_layers(name, layers)


def case_workload(mc, mode: str, size: int, *, ep: int, kv_len: int, half: bool = False):
    """Decode: ``size`` sequences of ``kv_len`` cached tokens. Prefill: two sequences of half
    the tokens each (TBO splits them evenly); ``half``: one of those sequences alone (what a
    micro-batch of it runs: attention cost depends on the sequence, not only on the token
    count)."""
    from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload

    if mode == "decode":
        b = Batch.decode(size, kv_len=kv_len)
    elif half:
        b = Batch.prefill(extend_lens=[size])
    else:
        b = Batch.prefill(extend_lens=[size - size // 2, size // 2])
    return Workload(mc, b, Parallel(ep=ep))


class Context:
    """What every case shares: device, GPU preset, model, weights, options."""

    def __init__(self, opts, env: dict | None = None):
        import torch

        from overlap_lab.real import model as M
        from overlap_lab.shared.inputs.hardware import get_gpu

        self.opts = opts
        self.env = env or {}
        self.device = opts.device
        self.gpu = get_gpu(opts.gpu)
        mc = model_config(opts.model, opts.layers)
        asked = "bf16" if getattr(opts, "gemm_dtype", "model") == "bf16" else mc.gemm_dtype
        # Precision, the same on both sides: the model's GEMM dtype where the executor can run
        # it (FP8 through DeepGEMM, probed once so a JIT failure makes the whole loop BF16),
        # else BF16 on both sides; dispatch is counted and timed as FP8 + scales on both sides
        # (the emulated backend's link model, the simulator's ops).
        gp = loop_precision(asked, self.device)
        self.precision = {
            "gemm": {"model": mc.gemm_dtype, "asked": asked,
                     "executor_and_simulator": gp.used, "reason": gp.reason},
            "gemm_scope": "FP8 where an op's dtype is the model's GEMM dtype and its GEMMs run "
            "through the SM budget (routed and shared experts, dense MLP); attention "
            "projections (attn.prepare, o_proj) run BF16 (their measured durations are the "
            "profile's)",
            "dispatch": "fp8 bytes on both sides (emulated link timing; data moved in "
            + ("bf16" if self.device == "cuda" else "fp32 on the CPU")
            + ")",
            "attention": mc.attn_dtype,
        }  # fmt: skip
        self.mc = dataclasses.replace(mc, gemm_dtype=gp.used)
        self.cfg = M.from_model_config(self.mc)
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        self.weights = M.init_weights(
            self.cfg, seed=opts.seed, dtype=dtype, device=self.device, ep_rank=0, ep_size=opts.ep
        )
        if self.device == "cuda":
            self.device_sms = torch.cuda.get_device_properties(0).multi_processor_count
        else:
            self.device_sms = self.gpu.num_sms

    @property
    def setup(self) -> Setup:
        return Setup(self.gpu, self.device_sms, self.env)

    def workload(self, mode: str, size: int, *, half: bool = False):
        """:func:`case_workload` of this loop's model and options."""
        return case_workload(
            self.mc, mode, size, ep=self.opts.ep, kv_len=self.opts.kv_len, half=half
        )

    def backend(self):
        from overlap_lab.real.comm import make_backend
        from overlap_lab.real.comm.bytes import LinkParams

        be = make_backend(
            "emulated", rank=0, world=self.opts.ep, num_experts=self.cfg.num_experts,
            hidden=self.cfg.hidden, link=LinkParams.from_gpu(self.gpu),
            num_sms=self.gpu.deepep_normal_sms, device_sms=self.device_sms,
        )  # fmt: skip
        be.dispatch_fp8 = True  # the simulator models DeepEP's FP8 dispatch
        return be

    def measure(self, program, w, *, warmup: int | None = None, repeats: int | None = None):
        """The executor's run of ``program`` (its trace), unprofiled: the timed run."""
        from overlap_lab.real.executor import execute

        be = self.backend()
        if self.opts.link_bytes == "program":  # the simulator's bytes, its link model
            be.plan_links(program)
        return execute(
            program, w, weights=self.weights, backend=be, device=self.device,
            seed=self.opts.seed, check_hazards=False,
            warmup=self.opts.warmup if warmup is None else warmup,
            repeats=self.opts.repeats if repeats is None else repeats, cuda_graphs=True,
            gpu=self.gpu, kernels=[comm_kernels()],
        ).trace  # fmt: skip

    def record(self, program, w, *, warmup: int | None = None, repeats: int | None = None):
        """A run recorded for calibration (``overlap_lab.calibrate.DeviceTimed``): on a GPU under
        torch.profiler, with its kernel records, each op's spans scaled to its kernels' device
        time, so no launch gap enters a profile row; on the CPU there are no kernel records
        (``kernels`` None) and the spans stay host wall-clock (meta ``device_time`` None)."""
        from overlap_lab.calibrate import DeviceTimed, device_timed

        def run():
            return self.measure(program, w, warmup=warmup, repeats=repeats)

        if self.device == "cuda":
            return device_timed(run, self.gpu.graph_kernel_gap_us)
        tr = run()
        tr.meta["device_time"] = None  # no kernel records: the spans are the durations
        return DeviceTimed(tr, tr, None, None)


def loop_precision(model_dtype: str, device: str):
    """The GEMM dtype both sides use: the model's where the executor can run it here
    (real.fp8.resolve, then one probe call per FP8 entry point), else BF16 with the reason."""
    from overlap_lab.real import fp8
    from overlap_lab.real.gemm import deep_gemm_module

    cuda = device == "cuda"
    mod = deep_gemm_module() if cuda else None
    return fp8.probe(fp8.resolve(model_dtype, cuda=cuda, module=mod), mod, device)
