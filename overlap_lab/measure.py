"""The real executor's two runs from plain values: the CPU equivalence check of schedules
(:func:`check_on_cpu`) and the measured GPU run (:func:`run_on_gpu`), with the communication
backend both pick (:func:`comm_backend`).

They sit beside the API, above ``real/`` and below the command line, so that ``overlap-lab run``
(:mod:`overlap_lab.cli.run`) only turns options into these arguments and prints what comes back,
and the GPU calibration (:mod:`overlap_lab.calibrate`) picks its backend the way a run does.
torch and ``overlap_lab.real`` are imported inside the functions: this module imports on a
machine without them.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from overlap_lab.provenance import workload_inputs
from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.inputs.workload import Workload
from overlap_lab.shared.schedules import ScheduleConfig


def schedules_to_run(name: str | None) -> list[str]:
    """The schedules a run covers: every available one for ``None`` or ``all``; else the one
    named, after serial (the equivalence check's reference)."""
    from overlap_lab.shared import schedules as S

    if name in (None, "all"):  # every schedule that loads; a broken plug-in is said, not run
        from overlap_lab.shared.inputs.preset_files import note

        for _, upstream, why in S.describe():
            if upstream is None:
                note(f"not checked: {why}")
        return S.loadable()
    S.module(name)  # ConfigError for an unknown or missing schedule
    return [S.BASELINE, name] if name != S.BASELINE else [S.BASELINE]


#: The install command the real executor needs, with the CPU torch wheel pinned (without the pin,
#: pip pulls several GB of CUDA packages onto a machine that has no GPU).
INSTALL_REAL = 'pip install "torch==2.13.0" -e ".[real]"'


def require_torch() -> None:
    """A ConfigError saying how to install torch where it is missing (before anything runs)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise ConfigError(
            f"the real executor needs torch; from the repository: {INSTALL_REAL} "
            "(the CPU wheel; on a GPU machine install the torch build for its CUDA driver)"
        )


#: What the CPU equivalence check (:func:`check_on_cpu`) cannot honour, by the name of the
#: workload or run parameter (``api.workload``'s, :func:`run_on_gpu`'s, ``overlap-lab run``'s
#: options): it runs its own small workloads (tiny models, fixed decode and prefill batches:
#: real/check.py), on the local or gloo backend, measures nothing and writes no files. Each is
#: refused when given (:func:`check_cpu_check_inputs`), never silently dropped.
CPU_CHECK_REFUSES = {
    "mode": "the check runs decode and prefill batches of its own",
    "max_events": "the check simulates nothing",
    "allow_oversubscribe": "the check's tiny models fit in any memory",
    "batch": "the check's batches are fixed (real/check.py)",
    "kv_len": "the check's batches are fixed",
    "kv_lens": "the check's batches are fixed",
    "tokens_per_seq": "the check's batches are fixed (one has 2 tokens per sequence)",
    "extend_len": "the check's batches are fixed",
    "extend_lens": "the check's batches are fixed",
    "prefix_len": "the check's batches are fixed",
    "prefix_lens": "the check's batches are fixed",
    "layers": "the check's tiny models have their own layers",
    "mtp": "the check's tiny models have no MTP modules",
    "model_file": "the check runs its tiny models",
    "ep": "the check's EP size is max(2, --ranks)",
    "gpus_per_node": "the check runs no network",
    "attn_tp": "the check runs without attention TP",
    "dp_attention": "the check runs DP attention",
    "pp_size": "the check runs pp with 2 and 3 stages itself",
    "backend": "the check runs the local backend (gloo with --ranks N); --backend applies on a GPU",
    "warmup": "the check measures nothing",
    "repeats": "the check measures nothing",
    "out": "the check writes no files (use --json > FILE)",
    "force": "the check writes no files",
}


def check_cpu_check_inputs(given: Collection[str], model: str | None) -> None:
    """Refuse, in one line, the inputs of ``given`` (names set to other than their defaults)
    that the CPU check cannot honour (:data:`CPU_CHECK_REFUSES`), and a ``model`` given that is
    none of its tiny models (None: not given)."""
    from overlap_lab.real.model import TINY_NAMES

    bad = [k for k in CPU_CHECK_REFUSES if k in given]
    if bad:
        why = "; ".join(f"--{k.replace('_', '-')}: {CPU_CHECK_REFUSES[k]}" for k in bad)
        raise ConfigError(f"run --device cpu --check does not take {why}")
    if model is not None and model not in TINY_NAMES:
        raise ConfigError(
            f"run --device cpu --check runs the tiny models ({', '.join(TINY_NAMES)}); "
            f"--model {model} runs on a GPU"
        )


def check_on_cpu(
    names: list[str],
    *,
    model: str,
    gpu: str,
    ranks: int,
    seed: int,
    tolerance: float | None,
    cfg: ScheduleConfig | None,
    kernels: Sequence[str] = (),
    command: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Each schedule of ``names`` against serial on the CPU (``ranks`` > 1: through that many
    gloo processes, against one process), on the tiny ``model``'s own workloads. The report:
    device, model, tolerance, backend, the differences (``max_rel_diff_vs_serial``, or
    ``max_rel_diff_vs_one_process`` with ``ranks``), errors, skipped schedules, ``unsplit`` (the
    schedules that ran one micro-batch on some workload, so checked less than a split) and
    ``ok``. ``kernels``: kernel families whose kernels bind their ops first
    (:func:`kernel_families`), on both sides of every comparison. ``provenance``: what ran
    (``provenance.check_record``, with ``command`` as typed; the check writes no file).
    A ``model`` that is none of the check's tiny ones runs as ``tiny-mla``, said in a note once
    the check has run (never a line before an error's)."""
    from overlap_lab.provenance import check_record
    from overlap_lab.real.model import TINY_NAMES

    given, model = model, model if model in TINY_NAMES else "tiny-mla"

    asked = cfg
    from overlap_lab.real.check import (
        DEFAULT_TOLERANCE,
        check_equivalence,
        default_workloads,
        split_config,
        unsplit_runs,
    )

    cfg = split_config(cfg, names)  # the tiny workloads reach vllm-dbo's split path
    tol = tolerance or DEFAULT_TOLERANCE
    workloads = default_workloads(model, ep=max(2, ranks))
    out: dict = {"device": "cpu", "model": model, "tolerance": tol}
    if ranks > 1:
        from overlap_lab.real.distributed import run_gloo, split_cases

        cases, skipped = split_cases([(n, w) for n in names for w in workloads], gpu=gpu, cfg=cfg)
        errors: dict[str, str] = {}
        try:
            res = run_gloo(cases, world=ranks, seed=seed, gpu=gpu, cfg=cfg, kernels=kernels)
        except (RuntimeError, ValueError) as e:  # a rank failed: reported, not a traceback
            res, errors["gloo"] = [], str(e)
        diffs: dict[str, float] = {}
        for r in res:
            diffs[r["schedule"]] = max(diffs.get(r["schedule"], 0.0), r["max_rel_diff"])
        out.update(
            backend="torch (gloo)",
            ranks=ranks,
            max_rel_diff_vs_one_process=diffs,
            errors=errors,
            skipped=skipped,
            unsplit=unsplit_runs(names, workloads, gpu=gpu, cfg=cfg),
        )
        ok = not errors and all(v <= tol for v in diffs.values())
    else:
        cr = check_equivalence(
            names, workloads, gpu=gpu, seed=seed, tolerance=tol, cfg=cfg, kernels=kernels
        )
        out.update(
            backend="local",
            max_rel_diff_vs_serial=cr.max_rel_diff_vs_serial,
            errors=cr.errors,
            skipped=cr.skipped,
            unsplit=cr.unsplit,
        )
        ok = cr.ok
    out["ok"] = ok
    out["provenance"] = check_record(
        command, names, model=model, gpu=gpu, ranks=ranks, seed=seed, tolerance=tol,
        cfg=asked, kernels=list(kernels),
    )  # fmt: skip
    if model != given:
        from overlap_lab.shared.inputs.preset_files import note

        note(f"the CPU check ran {model} (scaled down), not {given}")
    return out


def comm_backends() -> list[str]:
    """The names ``comm_backend`` takes: every registered communication backend (the entry-point
    group ``overlap_lab.comm_backends``: local, torch, emulated, deepep and any a package adds),
    then ``auto``. Read without loading any backend (no torch)."""
    from overlap_lab.real.comm import BACKENDS

    return [*BACKENDS.names(), "auto"]


def kernel_families() -> list[str]:
    """Every registered kernel family (the entry-point group ``overlap_lab.kernel_families``),
    by name, in listing order; read without loading any (no torch)."""
    from overlap_lab.real.kernels.registry import FAMILIES

    return FAMILIES.names()


def run_choices(device: str, backend: str, kernels: str | Sequence[str]) -> tuple:
    """``device``, ``backend`` and ``kernels`` of a run checked and as the executor takes them
    (lower case where the registered name is, kernels as a tuple), or a ConfigError naming the
    parameter; a device other than cpu needs torch with a CUDA GPU, said before anything runs."""
    device, backends, families = str(device).lower(), comm_backends(), kernel_families()
    backend = str(backend)
    backend = (
        backend.lower() if backend not in backends and backend.lower() in backends else backend
    )
    if backend not in backends:
        raise ConfigError(
            f"backend must be one of {', '.join(backends)}, got {backend!r}", names=("backend",)
        )
    kernels = tuple(k for k in kernels.split(",") if k) if isinstance(kernels, str) else kernels
    unknown = [k for k in kernels if k not in families]
    if unknown:
        raise ConfigError(
            f"kernels: unknown kernel family {unknown[0]!r}; choose from {', '.join(families)}",
            names=("kernels",),
        )
    if device not in ("auto", "cuda", "cpu"):
        raise ConfigError(
            f"device must be one of auto, cuda, cpu, got {device!r}", names=("device",)
        )
    if device != "cpu":
        try:
            import torch
        except ImportError:
            raise ConfigError("run: the real executor needs torch (pip install torch)") from None
        if not torch.cuda.is_available():
            raise ConfigError(
                "no CUDA GPU found: `overlap-lab run` measures on a GPU; use --device cpu --check "
                "for the CPU equivalence check"
            )
    return device, backend, tuple(kernels)


def comm_backend(name: str, w: Workload, gpu: GPU):
    """The communication backend ``name`` (one of :func:`comm_backends`) for ``w`` on ``gpu``;
    auto: DeepEP (or torch) when launched by torchrun over several GPUs, else emulated. Every
    backend gets num_experts, hidden, link and num_sms; local and emulated rank 0 of the
    workload's EP size, emulated the device's SMs, deepep its buffer size."""
    import torch

    from overlap_lab.real.comm import make_backend
    from overlap_lab.real.comm.bytes import LinkParams
    from overlap_lab.real.model import from_model_config

    rc = from_model_config(w.model)
    link = LinkParams.from_gpu(gpu)
    if name == "auto":
        import os

        import torch.distributed as dist

        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            from overlap_lab.real.comm.deepep import ensure_process_group

            ensure_process_group()  # launched by torchrun: one process per GPU
        multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        from overlap_lab.real.deps import available

        name = ("deepep" if available("deep_ep") else "torch") if multi else "emulated"
    kw = dict(
        num_experts=rc.num_experts, hidden=rc.hidden, link=link, num_sms=gpu.deepep_normal_sms
    )
    if name in ("local", "emulated"):
        kw.update(rank=0, world=w.parallel.ep)
    if name == "emulated":
        kw["device_sms"] = torch.cuda.get_device_properties(0).multi_processor_count
    if name == "deepep":  # the LL buffer is sized for this rank's largest dispatch
        kw["num_max_dispatch_tokens_per_rank"] = min(1024, w.batch.num_tokens)
    return make_backend(name, **kw)


def run_on_gpu(
    names: list[str],
    w: Workload,
    *,
    gpu: str,
    cfg: ScheduleConfig | None,
    backend: str,
    seed: int,
    warmup: int,
    repeats: int,
    out_dir: str | Path,
    command: Sequence[str] | None = None,
    kernels: Sequence[str] = (),
) -> dict[str, dict[str, Any]]:
    """Run each schedule of ``names`` on ``w`` on the CUDA device (its Program validated for
    ``gpu`` first; ``kernels``: kernel families whose kernels bind their ops first); write its
    measured trace (Chrome JSON, with :func:`run_provenance`'s record of ``command`` in
    ``otherData``) and timeline under ``out_dir``; the summary of each (the keys of `sim`, plus
    backend and device), by schedule."""
    import torch

    from overlap_lab.real.check import workload_variants
    from overlap_lab.real.deps import probe
    from overlap_lab.real.executor import execute
    from overlap_lab.shared import schedules as S
    from overlap_lab.shared.inputs.hardware import get_gpu

    g = get_gpu(gpu)
    from overlap_lab.outdir import mark

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mark(out_dir)  # sim, validate, analyze may write there after the run
    props = torch.cuda.get_device_properties(0)
    deps = probe()
    summaries = {}
    for name in names:
        wv = workload_variants(name, w)[0]  # pp runs on a pp >= 2 copy of a pp = 1 workload
        prog = S.build(name, wv, g, cfg)
        be = comm_backend(backend, wv, g)
        res = execute(
            prog,
            wv,
            backend=be,
            device="cuda",
            seed=seed,
            warmup=warmup,
            repeats=repeats,
            host_spin=False,  # the real Python launch overhead IS the host time: not twice
            gpu=g,
            kernels=kernels,
            meta=dict(
                schedule=name,
                model=w.model.label,
                gpu=g.name,
                device_name=props.name,
                num_sms=props.multi_processor_count,
                mode=w.batch.mode,
                torch=torch.__version__,
                cuda=torch.version.cuda,
                driver=_driver(),
                packages={k: v.get("version") for k, v in deps.items()},
            ),
        )
        tr = res.trace
        prov = run_provenance(
            name, wv, g, cfg, backend=backend, seed=seed, warmup=warmup, repeats=repeats,
            command=command, kernels=kernels,
        )  # fmt: skip
        tr.to_chrome(out_dir / f"{name}.trace.json", provenance=prov)
        try:
            from overlap_lab.figures import save_timeline

            save_timeline(tr, out_dir / f"{name}.png")
        except ImportError:
            pass
        s = tr.summary()
        s.update(
            backend=tr.meta.get("backend"),
            device=props.name,
            emulated=tr.meta.get("emulated"),
            link=tr.meta.get("link"),
            step_times_us=tr.meta.get("step_times_us"),
            cuda_graphs=tr.meta.get("cuda_graphs"),
            sm_budget_mechanisms=tr.meta.get("sm_budget_mechanisms"),
            sm_limits=tr.meta.get("sm_limits"),
            step_time_source=tr.meta.get("step_time_source"),
            spans_source=tr.meta.get("spans_source"),
            graph_replay_step_time_us=tr.meta.get("graph_replay_step_time_us"),
            eager_step_time_us=tr.meta.get("eager_step_time_us"),
        )
        if (prog.meta.pp_size or 1) > 1:  # in-process stages: not a pipeline's timing
            s["note"] = (
                "pp: every pipeline stage runs in this one process on one GPU; its times are "
                "not those of one stage per GPU (do not compare them with other schedules)"
            )
        summaries[name] = s
    return summaries


def run_provenance(
    name: str,
    w: Workload,
    gpu: GPU,
    cfg: ScheduleConfig | None,
    *,
    backend: str,
    seed: int,
    warmup: int,
    repeats: int,
    command: Sequence[str] | None,
    kernels: Sequence[str] = (),
) -> dict[str, Any]:
    """The provenance record of one measured run (``shared.outputs.trace.provenance``): the command line
    and the inputs as run (the workload after ``workload_variants``, the GPU preset, every knob,
    the backend asked for, seed, warmup, repeats, the kernel families preferred), with the keys
    of `sim`'s record where they mean the same, so that a measured trace and its prediction can
    be matched input by input.
    What the machine turned out to be (device, driver, library versions) is measured, not an
    input: the trace's meta holds it."""
    from overlap_lab.shared.outputs.trace import provenance

    inputs = {
        "schedule": name,
        **workload_inputs(w, gpu, cfg if cfg is not None else ScheduleConfig()),
        "backend": backend,
        "seed": seed,
        "warmup": warmup,
        "repeats": repeats,
        "kernels": list(kernels),
    }
    return provenance(command, inputs)


def _driver() -> str | None:
    import subprocess

    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


#: The most timed and untimed calls per kernel of the kernel table's CPU dry run
#: (:func:`check_kernel_run`): its host timings of tiny shapes mean nothing, and at the GPU's
#: maxima (10,000 and 1,000) it ran past two minutes.
KERNELS_CPU_REPEATS = 100
KERNELS_CPU_WARMUP = 10


def check_kernel_run(device: str, *, warmup: int, repeats: int) -> None:
    """Refuse in one line a kernel table (``real.kernel_table.kernel_table``) that cannot run:
    no torch, ``cuda`` without a GPU, counts out of range (the CPU dry run's bounds above)."""
    try:
        import torch
    except ImportError:
        raise ConfigError("kernels needs torch") from None
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("kernels --device cuda needs a CUDA GPU; none is visible "
                          "(--device cpu for the dry run)")  # fmt: skip
    if repeats < 1 or warmup < 0:
        raise ConfigError("--repeats must be >= 1 and --warmup >= 0")
    if device == "cpu" and (repeats > KERNELS_CPU_REPEATS or warmup > KERNELS_CPU_WARMUP):
        raise ConfigError(
            f"kernels --device cpu is a dry run: --repeats at most {KERNELS_CPU_REPEATS} and "
            f"--warmup at most {KERNELS_CPU_WARMUP}, got {repeats} and {warmup}"
        )


def write_kernel_report(
    report: Mapping[str, Any],
    text: str,
    out: str | Path,
    command: Sequence[str] | None,
    inputs: Mapping[str, Any],
) -> tuple[Path, Path]:
    """``kernels.json`` (the report with its ``provenance``: the version, ``command`` and the
    ``inputs`` it ran with) and ``kernels.md`` (``text``, its table) in the folder ``out``."""
    from overlap_lab.shared.outputs.trace import provenance

    prov = provenance(command, dict(inputs))
    js, md = Path(out) / "kernels.json", Path(out) / "kernels.md"
    js.write_text(json.dumps({**report, "provenance": prov}, indent=2, sort_keys=True) + "\n")
    md.write_text(text)
    return js, md
