"""SGLang's DeepEP MoE path with SBO off: the baseline SBO is measured against
[docs/schedules.md, "sbo-off"].

``DeepseekV2MoE.forward_deepep`` (SGLang ``python/sglang/srt/models/deepseek_v2.py``) without
``--enable-single-batch-overlap`` (``sbo_enabled_flag`` false) runs, per MoE layer:

    main: ... gate | select_experts | dispatch_a | dispatch_b | experts | combine_a | combine_b |
                                                                      wait shared_done | output
    alt:         wait main | shared_experts | record shared_done

- Right after the router GEMM, ``self.alt_stream.wait_stream(current_stream())``; the shared
  experts run under ``torch.cuda.stream(self.alt_stream)`` and ``shared_event =
  self.alt_stream.record_event()`` follows them.
- The routed path stays on the compute stream: top-k, then ``self.experts`` (FusedMoE.forward:
  ``dispatcher.dispatch`` = dispatch_a + dispatch_b, ``run_moe_core``, ``dispatcher.combine`` =
  combine_a + combine_b). DeepEP's low-latency kernels launch on the caller's stream
  (``return_recv_hook``); its normal kernels (prefill) go through the Buffer's high-priority
  comm stream exactly as TBO lowers them (``tbo.lower_op``).
- After ``self.experts`` returns, ``current_stream().wait_event(shared_event)``, then the
  ``shared_output.add_(routed)`` (``output``).
- The alt stream is one ``torch.cuda.Stream()`` per model (``DeepseekV2Model``): default
  priority. Nothing limits SMs on either side: no ``configure_deep_gemm_num_sms`` around the
  shared experts and no ``num_sms`` for the combine, so each kernel takes what the block
  scheduler gives it (docs/sm-sharing.md).

Older SGLang (before SBO existed) called the shared experts inline on the compute stream between
the gate and top-k; with the same kernels that is the ``serial`` schedule.
"""

from __future__ import annotations

from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.inputs.workload import Workload
from overlap_lab.shared.ir.builder import program
from overlap_lab.shared.ir.ops import parts, whole_batch
from overlap_lab.shared.ir.program import (
    HIGH_PRIORITY,
    GpuInstr,
    Launch,
    Op,
    Program,
    Record,
    Wait,
    WaitStream,
)
from overlap_lab.shared.schedules import sbo, tbo
from overlap_lab.shared.schedules.config import ScheduleConfig
from overlap_lab.shared.schedules.frame import step_frame
from overlap_lab.shared.schedules.launch import Deployment, ServerLaunch, sglang
from overlap_lab.shared.schedules.stages import launches

UPSTREAM = "SGLang python/sglang/srt/models/deepseek_v2.py (DeepseekV2MoE.forward_deepep, SBO off)"
SUMMARY = (
    "SGLang's DeepEP MoE without SBO (what SBO is compared with): shared experts on the "
    "default-priority alt stream beside dispatch, routed experts and combine on main"
)

SCHEDULE = "sbo-off"
MAIN, ALT, COMM = sbo.MAIN, sbo.ALT, tbo.COMM
ROUTED = ("select_experts", "dispatch_a", "dispatch_b", "experts", "combine_a", "combine_b")


def moe_layer(ops: dict[str, Op]) -> list[GpuInstr]:
    """One MoE layer as forward_deepep issues it with SBO off."""
    shared = ops["shared_experts"]
    done = f"s{shared.step}.L{shared.layer}.mb{shared.mb}.shared_done"
    keys = ("comm_prepare_attn", "attn.prepare", "attn.core", "comm_prepare_mlp")
    body: list[GpuInstr] = launches(op for k in keys for op in parts(ops, k))
    body += [Launch(ops["gate"], MAIN), WaitStream(ALT, MAIN)]
    body += [*(Launch(op, ALT) for op in parts(ops, "shared_experts")), Record(done, ALT)]
    for key in ROUTED:
        body += tbo.lower_op(key, ops)
    body.append(Wait(MAIN, done))
    body += launches(ops[k] for k in ("output", "comm_postprocess_layer"))
    return body


def build(w: Workload, gpu: GPU, cfg: ScheduleConfig) -> Program:
    mode = cfg.resolved_deepep_mode(w.batch.mode)
    mb = whole_batch(w)
    body = sbo.forward_body(w, gpu, mb, moe_layer, mode=mode, step=0)
    normal = mode == "normal"
    rank = step_frame(
        w,
        gpu,
        cfg,
        body,
        streams=(MAIN, ALT, COMM) if normal else (MAIN, ALT),
        # DeepEP's Buffer comm_stream: at::cuda::getStreamFromPool(true) (csrc/deep_ep.cpp)
        priorities=((COMM, HIGH_PRIORITY),) if normal else (),
    )
    return program(
        [rank],
        world=w.parallel.ep,
        schedule=SCHEDULE,
        deepep_mode=mode,
        micro_batches=[mb.as_meta()],
        shared_experts_stream=ALT,
    )


def launch_flags(d: Deployment) -> ServerLaunch:
    """SGLang's DeepEP MoE path as it runs by default: SBO off (no
    ``--enable-single-batch-overlap``), shared experts on the alt stream (docs/tune.md)."""
    return sglang(d)
