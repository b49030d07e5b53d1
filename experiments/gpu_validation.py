"""Predicted vs measured on one device, in one command per mode: ``python -m overlap_lab.experiments.gpu_validation``.

For every schedule, at decode batches 32 and 128 and one prefill size, on 4 layers of
DeepSeek-V3 shape (EP 32 emulated on one GPU by the ``emulated`` backend):
1. calibration: ``serial`` measured at the token counts the schedules run (the batch and its
   half, for micro-batched schedules) under torch.profiler: each op's duration is the sum of
   its kernels' DEVICE times (``overlap_lab.device_time``; graph replays where the op ran in
   one), never its CUDA-event span, which holds launch gaps; made a profile by the simulator's
   own calibration path (``sim.calibrate.profile_from_trace``);
2. prediction: ``overlap_lab.simulate(schedule, ..., profile=that profile)``. Compute ops a
   profile row cannot name (outside ``sim.profile.PROFILED_OPS``: SBO's and LightLLM's split
   expert kernels) get class rows measured in a short profiled run of the schedule itself
   (``own_rows``): no roofline rows in a validation; each row says per op class where the
   predicted durations came from (``cost_sources``) and lists any op the roofline still times
   (``roofline_ops``). Communication: the link model on both sides (``shared.ir.links``: the
   emulated backend times each send by the bytes of the Program's own flows, ``--link-bytes``);
   the ``comm-only`` case (dispatch and combine alone) checks it, target within 5 %;
3. measurement: the schedule on the device (CUDA graphs replayed for the step time, plus an
   eager pass for per-op spans; the trace meta says which number is which);
4. comparison: step time, exposed communication, per-op error; a markdown table, a JSON file,
   the predicted and measured traces (Chrome JSON) and figures, all packed into ONE archive
   ``<out>/<name>.tar.gz`` (``--out``; on a machine that hands back a folder, that folder).

``--device cpu`` is a dry run of exactly the same path on a scaled-down model (tiny-mla, CPU
tensors, the emulated backend's data path): its times are host wall-clock and meaningless, and
the table and JSON say so. It runs in CI (tests/test_real_validation.py).
``--device cuda`` without a GPU prints one line and exits 2. ``pp`` runs both pipeline stages in
one process on one GPU: it is measured and predicted but left out of the error medians and the
ranking. Options: ``--modes decode,prefill``, ``--batches 32,128``, ``--prefill 4096``,
``--schedules a,b``, ``--layers 4``, ``--ep 32``, ``--kv-len 2048``, ``--repeats 5``,
``--warmup 2``, ``--budget-s 540`` (cases left when it is spent are recorded as skipped),
``--pytest`` (run the GPU tests first), ``--name`` (the archive's name), ``--results`` (where
``gpu_<device>.{json,md}`` go: experiments/results on a GPU), ``--kernels`` (also the kernel
table, ``kernels_<device>.{json,md}``), ``--link-bytes program|routing``.

The LAST line printed is the verdict (:func:`verdict_line`): median |step-time error| <= 5 %,
max <= 10 %, the same ranking on both sides (schedules within 2 % tied), exposed communication
within 10 % or 50 µs, and the comm-only case within 5 % where it ran: PASS/FAIL with the numbers.
The exit status does not depend on it (errors and failed GPU tests do).

From other code (``overlap-lab validate --device cuda|cpu``): ``run_validation(parse(argv))``
returns the report (``report["table"]``, ``report["archive"]``, per case and schedule the
comparison of ``overlap_lab.validate.compare``, the simulator's validation).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from overlap_lab.shared.ir.program import ops_of

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = "gpu_validation: no CUDA GPU found; nothing was run (--device cpu for the dry run)"
NOT_COMPARABLE = {
    "pp": "pp runs both pipeline stages in one process on one GPU: not comparable with a "
    "one-stage-per-GPU prediction; excluded from the error medians and the ranking",
    "comm-only": "dispatch and combine alone (the link model on both sides; target: within "
    "5 %): not a schedule, excluded from the error medians and the ranking",
}
CPU_DEFAULTS = dict(model="tiny-mla", layers=3, ep=2, batches="4,8", prefill=24, kv_len=64)
GPU_DEFAULTS = dict(
    model="deepseek-v3", layers=4, ep=32, batches="32,128", prefill=4096, kv_len=2048
)


def _cmd(args: list[str], timeout: float = 20) -> str | None:
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def device_preset(name: str) -> str:
    """The shared.inputs.hardware preset of a device name ("NVIDIA H100 80GB HBM3" -> "h100")."""
    for p in ("h200", "h100", "h800", "h20", "b200", "gb200", "a100"):
        if p in name.lower().replace(" ", ""):
            return p
    return "h100"


def environment(device: str) -> dict:
    import torch

    from overlap_lab.real.deps import probe

    deps = probe()
    env = {
        "device_type": device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "versions": {k: v.get("version") for k, v in deps.items()},
        "distributions": {k: v.get("distribution") for k, v in deps.items()},
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "commit": _cmd(["git", "rev-parse", "HEAD"]),
        "dirty": bool(_cmd(["git", "status", "--porcelain"])),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(
            device=props.name,
            num_sms=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            driver=_cmd(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
            cuda=torch.version.cuda,
        )
    else:
        env.update(device="cpu", num_sms=None)
    return env


def run_pytest(timeout: float) -> dict:
    """``pytest -m gpu tests/test_real_gpu.py`` from the checkout (the working directory when it
    has the tests: the project may be installed elsewhere, without them)."""
    t = time.time()
    cwd = Path.cwd() if (Path.cwd() / "tests" / "test_real_gpu.py").is_file() else ROOT
    try:
        r = subprocess.run(
            [sys.executable, "-P", "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
             "tests/test_real_gpu.py"],
            capture_output=True, text=True, timeout=timeout, cwd=cwd,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "seconds": round(time.time() - t, 1)}
    out = r.stdout.strip().splitlines()
    last = out[-1] if out else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", last)}
    return {
        "status": "ok" if r.returncode == 0 else f"exit {r.returncode}",
        "counts": counts,
        "seconds": round(time.time() - t, 1),
        "tail": out[-25:],
    }


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------


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
        mc = M.get_model_config_layers(opts.model, opts.layers)
        # Precision, the same on both sides: the model's GEMM dtype where the executor can run
        # it (FP8 through DeepGEMM, probed once so a JIT failure makes the whole loop BF16),
        # else BF16 on both sides; dispatch is counted and timed as FP8 + scales on both sides
        # (the emulated backend's link model, the simulator's ops).
        gp = loop_precision(mc.gemm_dtype, self.device)
        self.precision = {
            "gemm": {"model": mc.gemm_dtype, "executor_and_simulator": gp.used,
                     "reason": gp.reason},
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

    def workload(self, mode: str, size: int, *, half: bool = False):
        """Decode: ``size`` sequences. Prefill: two sequences of half the tokens each (TBO
        splits them evenly); ``half``: one of those sequences alone (what a micro-batch of it
        runs: attention cost depends on the sequence, not only on the token count)."""
        from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload

        if mode == "decode":
            b = Batch.decode(size, kv_len=self.opts.kv_len)
        elif half:
            b = Batch.prefill(extend_lens=[size])
        else:
            b = Batch.prefill(extend_lens=[size - size // 2, size // 2])
        return Workload(self.mc, b, Parallel(ep=self.opts.ep))

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

    def measure(self, program, w, *, device_time: bool = False, warmup: int | None = None,
                repeats: int | None = None):  # fmt: skip
        """The executor's run of ``program`` (its trace). ``device_time`` (calibration): on a
        GPU under torch.profiler, each op's spans scaled to its kernels' device time
        (``overlap_lab.calibrate.device_timed``), so no launch gap enters a profile row; on the
        CPU there are no kernel records and the spans stay host wall-clock (meta says which)."""
        from overlap_lab.real.executor import execute

        def run():
            be = self.backend()
            if self.opts.link_bytes == "program":  # the simulator's bytes, its link model
                be.plan_links(program)
            return execute(
                program, w, weights=self.weights, backend=be, device=self.device,
                seed=self.opts.seed, check_hazards=False,
                warmup=self.opts.warmup if warmup is None else warmup,
                repeats=self.opts.repeats if repeats is None else repeats, cuda_graphs=True,
            ).trace  # fmt: skip

        if device_time and self.device == "cuda":
            from overlap_lab.calibrate import device_timed

            return device_timed(run)[0]
        tr = run()
        if device_time:
            tr.meta["device_time"] = None  # no kernel records: the spans are the durations
        return tr


#: The communication-only case: dispatch and combine of every MoE layer, nothing else timed.
COMM_ONLY = "comm-only"
COMM_OPS = frozenset({"dispatch_a", "dispatch_b", "combine_a", "combine_b"})


def _register_comm_kernels() -> None:
    """Two zero-work kernels the communication-only Program needs in place of the MoE layer's
    compute: ``comm.inputs`` (the micro-batch's rows and a fixed balanced routing: token t's
    slot j goes to expert (t*k + j) mod E) and ``comm.expert_out`` (the received rows handed
    back to the combine as they are). The simulator sees ops without work (no time)."""
    import torch

    from overlap_lab.real import kernels as K

    if "comm.inputs" in K.REGISTRY:
        return

    @K.register("comm.inputs")
    def comm_inputs(ctx) -> None:
        n, cfg, final = ctx.mb["padded_tokens"], ctx.cfg, ctx.step.final
        k = cfg.top_k
        slots = torch.arange(n * k, device=final.device)
        ctx.put("mlp_in", torch.zeros(n, cfg.hidden, dtype=final.dtype, device=final.device))
        ctx.put("topk_idx", (slots % cfg.num_experts).view(n, k))
        ctx.put("topk_w", torch.full((n, k), 1.0 / k, dtype=torch.float32, device=final.device))

    @K.register("comm.expert_out")
    def comm_expert_out(ctx) -> None:
        d = ctx.get("recv")
        ctx.put("expert_out", d["recv_x"] if d["ll"] else d["res"].recv_x)


def comm_program(w, gpu):
    """The communication-only Program of ``w`` (:func:`comm_only` of serial's)."""
    from overlap_lab.shared import schedules as S

    return comm_only(S.build("serial", w, gpu))


def comm_only(prog):
    """``prog`` with every launch dropped but dispatch and combine (both halves, with their
    flows: the simulator's bytes), ``comm.inputs`` before each dispatch and ``comm.expert_out``
    before each combine; records, waits and host work kept. Predicted, it is the link model
    (plus the comm kernels' local work); measured, the emulated backend's kernels and data
    path. Also a ``transform`` for ``overlap_lab.simulate``."""
    import dataclasses as dc

    from overlap_lab.shared.ir.program import Graph, Launch, Op

    _register_comm_kernels()

    def zero(op, name: str) -> Op:
        return Op(name, layer=op.layer, mb=op.mb, step=op.step, tokens=op.tokens)

    def body(instrs):
        out = []
        for ins in instrs:
            if isinstance(ins, Graph):
                out.append(dc.replace(ins, body=tuple(body(ins.body))))
            elif isinstance(ins, Launch):
                if ins.op.name == "dispatch_a":
                    out.append(Launch(zero(ins.op, "comm.inputs"), ins.stream))
                elif ins.op.name == "combine_a":
                    out.append(Launch(zero(ins.op, "comm.expert_out"), ins.stream))
                if ins.op.name in COMM_OPS:
                    out.append(ins)
            else:
                out.append(ins)
        return out

    ranks = tuple(
        dc.replace(
            rp, threads=tuple(dc.replace(th, instrs=tuple(body(th.instrs))) for th in rp.threads)
        )  # fmt: skip
        for rp in prog.ranks
    )
    return dc.replace(prog, ranks=ranks, meta=prog.meta.merged(schedule=COMM_ONLY))


def loop_precision(model_dtype: str, device: str):
    """The GEMM dtype both sides use: the model's where the executor can run it here
    (real.fp8.resolve, then one probe call per FP8 entry point), else BF16 with the reason."""
    from overlap_lab.real import fp8
    from overlap_lab.real.gemm import deep_gemm_module

    cuda = device == "cuda"
    mod = deep_gemm_module() if cuda else None
    return fp8.probe(fp8.resolve(model_dtype, cuda=cuda, module=mod), mod, device)


def prediction_workload(w, measured_meta: dict):
    """``w`` as the measured run ran it: a run whose FP8 GEMMs fell back to BF16 (``mixed`` or
    ``bf16`` in ``gemm_precision``) is predicted with gemm_dtype="bf16"."""
    used = (measured_meta.get("gemm_precision") or {}).get("used", w.model.gemm_dtype)
    if w.model.gemm_dtype == "fp8" and used != "fp8":
        return dataclasses.replace(w, model=dataclasses.replace(w.model, gemm_dtype="bf16"))
    return w


def _measured_step(tr) -> tuple[float, str]:
    g = tr.meta.get("graph_replay_step_time_us")
    if g and tr.meta.get("step_time_source") == "graph_replay":
        return g, "graph replay"
    return tr.meta.get("median_step_time_us", tr.step_time_us), "eager"


def calibrate_profile(ctx: Context, runs: list, mode: str):
    """The simulator's calibration path (``sim.calibrate.profile_from_trace``) on measured
    ``serial`` runs [(Program, Trace)]: per profiled compute op, its measured duration by token
    count and SMs. Ops outside ``sim.profile.PROFILED_OPS`` get no row (the roofline times
    them; ``cost_sources`` says so)."""
    from overlap_lab.sim.calibrate import profile_from_trace

    env = ctx.env
    return profile_from_trace(
        [(tr, p) for p, tr in runs], num_sms=ctx.device_sms, name=f"gpu-validation-{mode}",
        device=str(env.get("device")), date=str(env.get("date", "unknown"))[:10],
        software={k: str(v) for k, v in env.get("versions", {}).items() if v},
        source=f"gpu_validation: serial {mode} runs of the real executor on {env.get('device')}",
    )  # fmt: skip


def predict(ctx: Context, name: str, w, profile, transform=None):
    """The simulator's prediction of schedule ``name`` with the calibration ``profile``
    (``overlap_lab.simulate(..., profile=...)``; ``transform`` rewrites the Program first):
    (trace, cost sources per op class)."""
    from overlap_lab.api import simulate
    from overlap_lab.sim.calibrate import cost_sources

    res = simulate(name, w, ctx.gpu, profile=profile, transform=transform)
    return res.trace, cost_sources(res.program, ctx.gpu, profile)


def own_rows(ctx: Context, name: str, profile, prog, w, measured) -> tuple:
    """``profile`` plus rows for the compute ops of ``prog`` that it cannot time (no roofline
    rows in a validation): class rows for names a profile cannot carry (SBO's and LightLLM's
    split expert kernels), name rows for known names serial does not run (SGLang's
    overlap-scheduler ops), measured in a run of ``prog`` itself: on a GPU a short extra run
    under torch.profiler (device time; the timed run stays unprofiled), on the CPU the measured
    run's spans. Ops whose kernels took no time (bound as no-ops in the executor) stay on the
    roofline and are listed. Returns (profile, {row key: [op names]} of the rows added)."""
    from overlap_lab.calibrate import unprofiled_rows, with_rows

    names = set(roofline_ops(ctx, prog, profile))
    if not names:
        return profile, {}
    tr = measured
    if ctx.device == "cuda":
        tr = ctx.measure(prog, w, device_time=True, warmup=1, repeats=1)
    rows = unprofiled_rows([(tr, prog)], num_sms=ctx.device_sms, names=names,
                           source=f"gpu_validation: {name}'s own run")  # fmt: skip
    if not rows:
        return profile, {}
    keys = {r["op"] for r in rows}
    own: dict[str, set[str]] = {}
    for _, op in ops_of(prog):
        if op.name in names and (op.name in keys or op.op_class in keys):
            own.setdefault(op.name if op.name in keys else op.op_class, set()).add(op.name)
    return with_rows(profile, rows), {c: sorted(n) for c, n in sorted(own.items())}


def roofline_ops(ctx: Context, prog, profile) -> list[str]:
    """Compute ops of the simulated Program ``prog`` that no profile row times (the roofline
    does): a validation should have none. Ops without work (the communication-only case's
    stand-ins) take no time either way and are not listed."""
    from overlap_lab.sim.cost import duration_source

    return sorted(
        {op.name for _, op in ops_of(prog)
         if op.kind == "compute" and (op.flops > 0 or op.hbm_bytes > 0)
         and duration_source(op, ctx.gpu, profile) == "roofline"}
    )  # fmt: skip


def comparison(measured, predicted, measured_step_us: float) -> dict:
    """``overlap_lab.validate.compare`` (the simulator's validation), against the step time the
    run reports (graph replay where captured), with each op's error summarised per op name."""
    from overlap_lab.validate import compare

    v = dataclasses.replace(compare(measured, predicted), measured_step_us=measured_step_us)
    by_op: dict[str, list[float]] = {}
    for o in v.ops:
        if o.measured_us > 0:
            by_op.setdefault(o.key[1], []).append(o.error)
    errs = [abs(e) for es in by_op.values() for e in es]
    return {
        "step_time_us": {"predicted": v.predicted_step_us, "measured": v.measured_step_us,
                         "rel_error": v.step_error if v.measured_step_us else None},
        "exposed_comm_us": {"predicted": v.predicted_exposed_us,
                            "measured": v.measured_exposed_us, "abs_error_us": v.exposed_error_us},
        "per_op": {n: {"median_rel_error": statistics.median(es), "n": len(es)}
                   for n, es in sorted(by_op.items())},
        "per_op_median_abs_rel_error": statistics.median(errs) if errs else None,
        "ops_aligned": len(v.ops),
        "ops_only_predicted": v.only_predicted,
        "ops_only_measured": v.only_measured,
    }  # fmt: skip


def sources_text(sources: dict) -> str:
    """``{"gemm": {"profile": 12}, "elementwise": {"profile": 4, "roofline": 6}}`` ->
    "gemm: profile 12; elementwise: profile 4, roofline 6"."""
    return "; ".join(
        f"{c}: " + ", ".join(f"{s} {n}" for s, n in sorted(v.items()))
        for c, v in sorted(sources.items())
    )


def run_case(ctx: Context, mode: str, size: int, names: list[str], work: Path, deadline: float,
             cases: dict, key: str, saved=lambda: None) -> dict:  # fmt: skip
    """Calibrate, predict, measure and compare every schedule on one workload; the case is
    ``cases[key]`` from the start, and ``saved()`` runs after every schedule."""
    from overlap_lab.real.check import workload_variants
    from overlap_lab.shared import schedules as S

    w = ctx.workload(mode, size)
    calib = []
    sizes = sorted({size, max(1, size // 2)}, reverse=True)
    t = time.time()
    case = cases[key] = {
        "workload": {"mode": mode, "tokens": w.batch.num_tokens, "sizes_calibrated": sizes},
        "runs": {},
    }
    try:
        for s in sizes:  # isolated op durations at the token counts the schedules run
            ws = ctx.workload(mode, s, half=s != size)
            p = S.build("serial", ws, ctx.gpu)
            calib.append((p, ctx.measure(p, ws, device_time=True)))
        profile = calibrate_profile(ctx, calib, mode)
    except Exception as e:  # no profile, no prediction: the case is reported, the loop goes on
        case["error"] = f"calibration failed: {type(e).__name__}: {e}"[:500]
        saved()
        return case
    case["calibration_seconds"] = round(time.time() - t, 1)
    case["profile_rows"] = len(profile.rows)
    dt = [tr.meta.get("device_time") for _, tr in calib]
    case["calibration_durations"] = (
        "kernel device time (torch.profiler records mapped to ops; graph replays where the op "
        "ran in one)"
        if all(dt)
        else "CUDA-event / host spans (no kernel records on this device)"
    )
    case["calibration_device_time"] = dt
    case_dir = work / f"{mode}_{size}"
    case_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        if time.time() > deadline:
            case["runs"][name] = {"skipped": "time budget spent"}
            continue
        t = time.time()
        try:
            comm = name == COMM_ONLY
            wv = w if comm else workload_variants(name, w)[0]
            prog = comm_program(wv, ctx.gpu) if comm else S.build(name, wv, ctx.gpu)
            meas = ctx.measure(prog, wv)
            wp = prediction_workload(wv, meas.meta)
            prof, own = own_rows(ctx, name, profile, prog, wv, meas)
            pred, sources = predict(ctx, "serial" if comm else name, wp, prof,
                                    transform=comm_only if comm else None)  # fmt: skip
            missing = roofline_ops(
                ctx, comm_program(wp, ctx.gpu) if comm else S.build(name, wp, ctx.gpu), prof
            )
        except Exception as e:  # recorded; the next schedule goes on
            case["runs"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(f"  {key} {name}: {case['runs'][name]['error'][:200]}", flush=True)
            saved()
            continue
        step_m, source = _measured_step(meas)
        m = meas.meta
        case["runs"][name] = {
            "comparison": comparison(meas, pred, step_m),
            "measured_step_source": source,
            "eager_step_time_us": m.get("eager_step_time_us", m.get("median_step_time_us")),
            "step_times_us": m.get("step_times_us"),
            "cuda_graphs": m.get("cuda_graphs"),
            "sm_budget_mechanisms": m.get("sm_budget_mechanisms"),
            "sm_limits": m.get("sm_limits"),
            "kernel_notes": m.get("kernel_notes"),
            "attention_kernels": m.get("attention_kernels"),
            "gemm_precision": m.get("gemm_precision"),
            "predicted_gemm_dtype": wp.model.gemm_dtype,
            "deep_gemm_errors": m.get("deep_gemm_errors"),
            "cost_sources": sources,
            "rows_from_own_run": own,
            "roofline_ops": missing,
            "comparable": name not in NOT_COMPARABLE,
            "note": NOT_COMPARABLE.get(name),
            "seconds": round(time.time() - t, 1),
        }
        pred.to_chrome(case_dir / f"{name}.predicted.trace.json.gz")
        meas.to_chrome(case_dir / f"{name}.measured.trace.json.gz")
        _figure(ctx, {f"{name} predicted": pred, f"{name} measured": meas},
                case_dir / f"{name}.png", case["runs"][name])  # fmt: skip
        st = case["runs"][name]["comparison"]["step_time_us"]
        print(f"  {key} {name}: predicted {st['predicted']:.1f} us, measured "
              f"{st['measured']:.1f} us ({source})", flush=True)  # fmt: skip
        saved()
    return case


def _figure(ctx, traces, path, rec) -> None:
    if ctx.opts.no_figures:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt

        from overlap_lab.figures import compare_timelines

        plt.close(compare_timelines(traces, path))
    except Exception as e:  # a figure never fails the run; the reason is kept
        rec["figure_error"] = f"{type(e).__name__}: {e}"[:200]


def ranking(step_us: dict[str, float]) -> list[str]:
    """Schedule names, fastest first."""
    return sorted(step_us, key=lambda n: step_us[n])


def summarize(cases: dict) -> dict:
    """Per case: median |step-time error| over comparable schedules, both rankings, and
    whether they agree."""
    out = {}
    for key, case in cases.items():
        runs = {n: r for n, r in case["runs"].items() if "comparison" in r and r["comparable"]}
        if not runs:
            continue
        pred = {n: r["comparison"]["step_time_us"]["predicted"] for n, r in runs.items()}
        meas = {n: r["comparison"]["step_time_us"]["measured"] for n, r in runs.items()}
        errs = [abs(r["comparison"]["step_time_us"]["rel_error"] or 0) for r in runs.values()]
        out[key] = {
            "median_abs_step_error": statistics.median(errs),
            "ranking_predicted": ranking(pred),
            "ranking_measured": ranking(meas),
            "same_ranking": ranking(pred) == ranking(meas),
        }
    return out


#: The loop's targets (the verdict line): step time, ranking ties, exposed communication.
TARGETS = {"median_step": 0.05, "max_step": 0.10, "tie": 0.02, "exposed_rel": 0.10,
           "exposed_abs_us": 50.0, "comm_only": 0.05}  # fmt: skip


def _tied(a: float, b: float, tie: float) -> bool:
    return abs(a - b) <= tie * min(abs(a), abs(b))


def discordant_pairs(pred: dict[str, float], meas: dict[str, float], tie: float) -> list:
    """Pairs of schedules ordered one way by the prediction and the other way by the
    measurement, each side's order counting only where its two step times differ by more than
    ``tie`` (relative to the faster): schedules within ``tie`` are tied, never discordant."""
    out = []
    names = sorted(set(pred) & set(meas))
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if _tied(pred[a], pred[b], tie) or _tied(meas[a], meas[b], tie):
                continue
            if (pred[a] < pred[b]) != (meas[a] < meas[b]):
                out.append((a, b))
    return out


def verdict(cases: dict, targets: dict = TARGETS) -> dict:
    """PASS/FAIL of the loop over every comparable run of every case: median and max
    |step-time error|, the ranking per case (ties within ``tie``), and exposed communication
    within ``exposed_rel`` or ``exposed_abs_us``. No comparable run: FAIL."""
    errs, exposed, bad_rank, cases_ranked, comm = [], [], {}, 0, []
    for key, case in cases.items():
        r = case.get("runs", {}).get(COMM_ONLY) or {}
        if "comparison" in r:
            e = r["comparison"]["step_time_us"]["rel_error"]
            comm.append((abs(e if e is not None else float("inf")), key))
        runs = {n: r for n, r in case.get("runs", {}).items()
                if "comparison" in r and r.get("comparable", True)}  # fmt: skip
        if not runs:
            continue
        pred, meas = {}, {}
        for n, r in runs.items():
            st, ex = r["comparison"]["step_time_us"], r["comparison"]["exposed_comm_us"]
            pred[n], meas[n] = st["predicted"], st["measured"]
            e = st["rel_error"]
            errs.append((abs(e if e is not None else float("inf")), f"{key}/{n}"))
            d = abs(ex["predicted"] - ex["measured"])
            lim = max(targets["exposed_rel"] * abs(ex["measured"]), targets["exposed_abs_us"])
            exposed.append((d <= lim, d, d / ex["measured"] if ex["measured"] else None,
                            f"{key}/{n}"))  # fmt: skip
        cases_ranked += 1
        dis = discordant_pairs(pred, meas, targets["tie"])
        if dis:
            bad_rank[key] = dis
    if not errs:
        return {"pass": False, "reason": "no comparable run", "runs": 0}
    med = statistics.median(e for e, _ in errs)
    worst = max(errs)
    ex_ok = sum(ok for ok, *_ in exposed)
    ex_worst = max(exposed, key=lambda x: x[1])
    checks = {
        "median_step": med <= targets["median_step"],
        "max_step": worst[0] <= targets["max_step"],
        "ranking": not bad_rank,
        "exposed_comm": ex_ok == len(exposed),
    }
    if comm:  # the communication-only case, where it ran: the link model alone
        checks["comm_only"] = max(comm)[0] <= targets["comm_only"]
    return {
        "pass": all(checks.values()), "checks": checks, "runs": len(errs),
        "median_abs_step_error": med, "max_abs_step_error": worst[0], "worst_run": worst[1],
        "cases_ranked": cases_ranked, "ranking_discordant": bad_rank,
        "exposed_ok": ex_ok, "exposed_worst": {"run": ex_worst[3], "abs_us": ex_worst[1],
                                               "rel": ex_worst[2]},
        "comm_only_abs_error": {k: e for e, k in comm},
        "targets": dict(targets),
    }  # fmt: skip


def verdict_line(v: dict, *, dry_run: bool = False) -> str:
    """One line: PASS/FAIL with the numbers behind each check (the loop prints it last)."""
    head = "VERDICT" + (" (CPU dry run: meaningless numbers)" if dry_run else "")
    if v.get("reason"):
        return f"{head} FAIL: {v['reason']}"
    t, c = v["targets"], v["checks"]

    def mark(ok: bool) -> str:
        return "ok" if ok else "MISSED"

    ew = v["exposed_worst"]
    rel = "" if ew["rel"] is None else f", {ew['rel']:.1%}"
    ranked = v["cases_ranked"] - len(v["ranking_discordant"])
    dis = "; ".join(f"{k}: " + ", ".join(f"{a}/{b}" for a, b in p)
                    for k, p in sorted(v["ranking_discordant"].items()))  # fmt: skip
    return (
        f"{head} {'PASS' if v['pass'] else 'FAIL'}: "
        f"median |step error| {v['median_abs_step_error']:.1%} (<= {t['median_step']:.0%} "
        f"{mark(c['median_step'])}); max {v['max_abs_step_error']:.1%} {v['worst_run']} "
        f"(<= {t['max_step']:.0%} {mark(c['max_step'])}); ranking the same in {ranked}/"
        f"{v['cases_ranked']} cases, ties within {t['tie']:.0%} ({mark(c['ranking'])}"
        f"{'; discordant ' + dis if dis else ''}); exposed comm within {t['exposed_rel']:.0%} "
        f"or {t['exposed_abs_us']:.0f} us in {v['exposed_ok']}/{v['runs']} runs (worst "
        f"{ew['run']}: {ew['abs_us']:.1f} us{rel}; {mark(c['exposed_comm'])})"
        + (
            "; comm-only |step error| "
            + ", ".join(f"{k} {e:.1%}" for k, e in sorted(v["comm_only_abs_error"].items()))
            + f" (<= {t['comm_only']:.0%} {mark(c['comm_only'])})"
            if "comm_only" in c
            else ""
        )
    )


def table(report: dict) -> str:
    """The predicted-vs-measured table (markdown)."""
    lines = []
    if not report["timing_meaningful"]:
        lines.append("**DRY RUN on the CPU: times are host wall-clock of a scaled-down model; "
                     "they mean nothing about a GPU.**\n")  # fmt: skip
    env = report["environment"]
    lines.append(f"device {env.get('device')}, preset {report['preset']}, model {report['model']}"
                 f" ({report['layers']} layers, EP {report['ep']} emulated), "
                 f"commit {str(env.get('commit'))[:10]}\n")  # fmt: skip
    gp = (report.get("precision") or {}).get("gemm")
    if gp:
        lines.append(f"GEMMs on both sides: {gp['executor_and_simulator']} (model "
                     f"{gp['model']}; {gp['reason']})\n")  # fmt: skip
    lines.append("| case | schedule | step pred (µs) | step meas (µs) | source | err | "
                 "exposed comm pred/meas (µs) | per-op median abs err | predicted durations "
                 "from (per op class) | note |")  # fmt: skip
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    if report.get("error"):
        lines.insert(0, f"**{report['error']}**\n")
    if not report.get("complete", True):
        lines.insert(0, "**INCOMPLETE: written while the loop was still running.**\n")
    for key, case in report["cases"].items():
        if case.get("error") or case.get("skipped"):
            lines.append(f"| {key} | | | | | | | | | {case.get('error') or case.get('skipped')} |")
        for name, r in case["runs"].items():
            if "comparison" not in r:
                lines.append(
                    f"| {key} | {name} | | | | | | | | {r.get('error') or r.get('skipped')} |"
                )
                continue
            c = r["comparison"]
            st, ex = c["step_time_us"], c["exposed_comm_us"]
            err = st["rel_error"]
            po = c["per_op_median_abs_rel_error"]
            lines.append(
                f"| {key} | {name} | {st['predicted']:.1f} | {st['measured']:.1f} | "
                f"{r['measured_step_source']} | {'' if err is None else f'{err:+.1%}'} | "
                f"{ex['predicted']:.1f} / "
                f"{ex['measured']:.1f} | {'' if po is None else f'{po:.1%}'} | "
                f"{sources_text(r['cost_sources'])}{_rows_text(r)} | "
                f"{_note(name, r)} |"
            )
    lines.append("")
    for key, case in report["cases"].items():
        if case.get("calibration_durations"):
            lines.append(f"- {key}: profile rows from {case['calibration_durations']}")
    for key, s in report.get("summary", {}).items():
        lines.append(f"- {key}: median |step error| {s['median_abs_step_error']:.1%}; ranking "
                     f"{'the same' if s['same_ranking'] else 'DIFFERS'} (predicted "
                     f"{', '.join(s['ranking_predicted'])}; measured "
                     f"{', '.join(s['ranking_measured'])})")  # fmt: skip
    if report.get("verdict"):
        lines += ["", verdict_line(report["verdict"], dry_run=not report["timing_meaningful"])]
    return "\n".join(lines) + "\n"


def _note(name: str, r: dict) -> str:
    if r["comparable"]:
        return ""
    return "comm only: target within 5 %" if name == COMM_ONLY else "excluded: one GPU"


def _rows_text(r: dict) -> str:
    """Which classes took rows measured in the schedule's own run, and which ops the roofline
    still times (the validation's gaps)."""
    own = ", ".join(c if n == [c] else f"{c} ({', '.join(n)})"
                    for c, n in (r.get("rows_from_own_run") or {}).items())  # fmt: skip
    own = f"rows from its own run: {own}" if own else ""
    roof = r.get("roofline_ops")
    return (f"; {own}" if own else "") + (f"; ROOFLINE: {', '.join(roof)}" if roof else "")


def _step_figure(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        return
    cases = [(k, c) for k, c in report["cases"].items() if c["runs"]]
    if not cases:
        return
    fig, axes = plt.subplots(len(cases), 1, figsize=(9, 2.6 * len(cases)), squeeze=False)
    for ax, (key, case) in zip(axes[:, 0], cases, strict=True):
        names = [n for n, r in case["runs"].items() if "comparison" in r]
        p = [case["runs"][n]["comparison"]["step_time_us"]["predicted"] for n in names]
        m = [case["runs"][n]["comparison"]["step_time_us"]["measured"] for n in names]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], p, 0.4, label="predicted")
        ax.bar([x + 0.2 for x in xs], m, 0.4, label="measured")
        ax.set_xticks(list(xs), names, fontsize=7)
        ax.set_ylabel("step (µs)")
        ax.set_title(key + ("" if report["timing_meaningful"] else "  (CPU dry run)"), fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_validation(opts) -> dict:
    """The whole loop; returns the report (also packed with everything into the archive)."""
    from overlap_lab.shared import schedules as S

    t0 = time.time()
    deadline = t0 + opts.budget_s
    env = environment(opts.device)
    if opts.gpu is None:
        opts.gpu = device_preset(env["device"]) if opts.device == "cuda" else "h100"
    report: dict = {
        "environment": env,
        "preset": opts.gpu,
        "model": opts.model,
        "layers": opts.layers,
        "ep": opts.ep,
        "backend": "emulated (single-GPU emulation of DeepEP; not DeepEP)",
        "timing_meaningful": opts.device == "cuda",
        "commands": opts.argv,
    }
    if opts.device == "cpu":
        report["note"] = "dry run: the same path on the CPU; timings are meaningless"
    work = Path(tempfile.mkdtemp(prefix="gpu_validation_"))
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    archive = out / f"{opts.name}.tar.gz"
    cases: dict = {}
    report["cases"] = cases

    def save(final: bool) -> None:
        """Write the report and pack the archive: after every schedule (a command killed at its
        time limit still leaves what it measured) and once at the end."""
        report["complete"] = final
        report["summary"] = summarize(cases)
        report["verdict"] = verdict(cases)
        report["seconds"] = round(time.time() - t0, 1)
        (work / "results.json").write_text(
            json.dumps(report, indent=2, sort_keys=True, default=str) + "\n"
        )
        (work / "table.md").write_text(table(report))
        if final:
            _step_figure(report, work / "step_times.png")
        tmp = archive.with_name(archive.name + ".part")
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(work, arcname=opts.name)
        tmp.replace(archive)

    try:
        report["pytest_gpu"] = (
            run_pytest(opts.pytest_timeout_s) if opts.pytest else {"status": "not run"}
        )
        save(False)
        try:
            ctx = Context(opts, env)
        except Exception as e:  # weights that do not fit, say: reported in the archive
            report["error"] = f"setup failed: {type(e).__name__}: {e}"[:500]
            save(True)
            report.update(archive=str(archive), table=table(report))
            return report
        report["precision"] = ctx.precision
        names = opts.schedules.split(",") if opts.schedules else [*S.available(), COMM_ONLY]
        sizes = {"decode": [int(b) for b in str(opts.batches).split(",") if b],
                 "prefill": [int(opts.prefill)]}  # fmt: skip
        for mode in opts.modes.split(","):
            for size in sizes[mode]:
                key = f"{mode}_{size}"
                if time.time() > deadline:
                    cases[key] = {"skipped": "time budget spent", "runs": {}}
                    continue
                run_case(ctx, mode, size, names, work, deadline, cases, key, lambda: save(False))
                print(f"{key}: {len(cases[key]['runs'])} schedules, "
                      f"{time.time() - t0:.0f} s so far", flush=True)  # fmt: skip
        save(True)
        report["archive"] = str(archive)
        report["table"] = table(report)
        report["results"] = write_results(report, opts)
        if opts.kernels:
            report["results"] += write_kernel_table(report, opts)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report


def results_stem(report: dict) -> str:
    """``gpu_<device>``: the device's preset (``cpu`` for a dry run), ``_fp8`` where the GEMMs
    ran FP8 (a BF16 and an FP8 loop on one device keep both files)."""
    dev = report["preset"] if report["timing_meaningful"] else "cpu"
    gp = ((report.get("precision") or {}).get("gemm") or {}).get("executor_and_simulator")
    return f"gpu_{dev}" + ("_fp8" if gp == "fp8" else "")


def write_results(report: dict, opts) -> list[str]:
    """``<results>/gpu_<device>.{json,md}`` (results.json and table.md of the archive): by
    default only for a GPU run (into experiments/results); a dry run writes them only where
    ``--results`` says."""
    if opts.results is None and not report["timing_meaningful"]:
        return []
    d = Path(opts.results) if opts.results else ROOT / "experiments" / "results"
    d.mkdir(parents=True, exist_ok=True)
    stem = results_stem(report)
    keep = {k: v for k, v in report.items() if k not in ("table", "archive", "results")}
    js, md = d / f"{stem}.json", d / f"{stem}.md"
    keep = merged(keep, js)
    if keep.get("merged_commands"):  # the verdict over every case of the file
        report["merged_verdict"] = keep["verdict"]
    js.write_text(json.dumps(keep, indent=2, sort_keys=True, default=str) + "\n")
    md.write_text(table(keep))
    return [str(js), str(md)]


def merged(report: dict, path: Path) -> dict:
    """``report`` with the cases of an earlier results file of the same device, model and
    precision that this run did not measure (one command per mode fills one file); the summary
    and the verdict are recomputed over all of them. A file of another setup is replaced."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return report
    same = ("preset", "model", "layers", "ep", "timing_meaningful")
    if any(old.get(k) != report.get(k) for k in same) or (old.get("precision") or {}).get(
        "gemm"
    ) != (report.get("precision") or {}).get("gemm"):
        return report
    cases = {**{k: v for k, v in old.get("cases", {}).items()}, **report["cases"]}
    if cases.keys() == report["cases"].keys():
        return report
    out = dict(report, cases=cases, summary=summarize(cases), verdict=verdict(cases))
    out["merged_commands"] = [*(old.get("merged_commands") or [old.get("commands")]),
                              report.get("commands")]  # fmt: skip
    return out


def write_kernel_table(report: dict, opts) -> list[str]:
    """``--kernels``: ``overlap-lab kernels``' table for this device (``real.kernel_table``)
    into ``<results>/kernels_<device>.{json,md}``; its goal line is kept in the report."""
    from overlap_lab.real.kernel_table import kernel_table, table_text

    kt = kernel_table(opts.device)
    text = table_text(kt)
    report["kernels_goal"] = text.rstrip().rpartition("\n")[2]
    if opts.results is None and not report["timing_meaningful"]:
        return []
    d = Path(opts.results) if opts.results else ROOT / "experiments" / "results"
    d.mkdir(parents=True, exist_ok=True)
    stem = "kernels" + results_stem(report)[3:]  # kernels_<device>[_fp8]: deep_gemm loaded
    js, md = d / f"{stem}.json", d / f"{stem}.md"
    js.write_text(json.dumps(kt, indent=2, sort_keys=True) + "\n")
    md.write_text(text)
    return [str(js), str(md)]


def parse(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--modes", default="decode,prefill")
    p.add_argument("--batches", default=None, help="decode batch sizes (GPU: 32,128)")
    p.add_argument("--prefill", type=int, default=None, help="prefill tokens (GPU: 4096)")
    p.add_argument("--schedules", default=None, help="default: every available schedule")
    p.add_argument("--model", default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--ep", type=int, default=None)
    p.add_argument("--kv-len", dest="kv_len", type=int, default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--gpu", default=None, help="shared.inputs.hardware preset (default: from the name)"
    )
    p.add_argument("--budget-s", type=float, default=540.0)
    p.add_argument("--pytest", action="store_true", help="run the GPU tests first")
    p.add_argument("--pytest-timeout-s", type=float, default=150.0)
    p.add_argument("--link-bytes", dest="link_bytes", choices=("program", "routing"),
                   default="program",
                   help="bytes the emulated link times: the Program's flows (the simulator's, "
                   "default) or this run's routing")  # fmt: skip
    p.add_argument("--kernels", action="store_true",
                   help="also write the kernel table (overlap-lab kernels) as "
                   "kernels_<device>.{json,md} beside the results")  # fmt: skip
    p.add_argument("--no-figures", action="store_true")
    p.add_argument("--results", default=None,
                   help="folder for gpu_<device>.{json,md} (default: experiments/results on a "
                   "GPU; a dry run writes them only here)")  # fmt: skip
    p.add_argument("--out", default=str(ROOT / "overlap-lab-out" / "gpu_validation"))
    p.add_argument(
        "--name", default=None, help="archive name (default gpu_validation_<dev>_<modes>)"
    )
    opts = p.parse_args(argv)
    defaults = GPU_DEFAULTS if opts.device == "cuda" else CPU_DEFAULTS
    for k, v in defaults.items():
        if getattr(opts, k) is None:
            setattr(opts, k, v)
    if opts.name is None:
        opts.name = f"gpu_validation_{opts.device}_{opts.modes.replace(',', '-')}"
    opts.argv = ["python -m overlap_lab.experiments.gpu_validation", *(argv or sys.argv[1:])]
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    from overlap_lab.real.deps import no_device

    why = no_device(opts.device)
    if why is not None:
        print(NO_GPU + ("" if why.startswith("no CUDA") else f" ({why})"))
        return 2
    report = run_validation(opts)
    print(report["table"].rstrip("\n").rpartition("\n")[0])  # the verdict goes last
    print(f"wrote {report['archive']}" + "".join(f", {f}" for f in report.get("results") or ()))
    bad = [
        f"{k}/{n}" for k, c in report["cases"].items() for n, r in c["runs"].items() if "error" in r
    ]
    if bad:
        print(f"errors in: {', '.join(bad)} (see results.json in the archive)")
    if report.get("kernels_goal"):
        print(f"kernels: {report['kernels_goal']}")
    dry = not report["timing_meaningful"]
    if report.get("merged_verdict"):  # this run's cases, then every case of the results file
        print("this run: " + verdict_line(report["verdict"], dry_run=dry))
        print(f"all cases of {report['results'][0]}:")
        print(verdict_line(report["merged_verdict"], dry_run=dry))
    else:
        print(verdict_line(report["verdict"], dry_run=dry))
    pyt = report["pytest_gpu"].get("status")
    return 0 if not bad and pyt in ("ok", "not run") else 1


if __name__ == "__main__":
    raise SystemExit(main())
