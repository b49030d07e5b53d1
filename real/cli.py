"""`overlap-lab run`: the real executor from the command line (wired in experiments/cli.py).

``run_main(args) -> exit code`` takes the parsed options (any object with attributes; missing
ones take the defaults below): schedule, model, gpu, mode, batch, workload (the GPU run's,
built by experiments/cli.py like `sim`'s), prefix_len,
ep, layers, backend, device, check, ranks, json, out, warmup, repeats, seed, tolerance.

- GPU: run the schedule, write the measured trace (Chrome JSON) and a timeline figure under
  ``out``, print the summary (the keys of `sim`, plus backend and device).
- ``--device cpu --check``: the equivalence check for every schedule (or the one named); with
  ``--json`` prints ``{"max_rel_diff_vs_serial": {schedule: diff}, ...}``; exit 1 if any
  difference exceeds the tolerance or a schedule fails (an unordered read counts).
- ``--device cpu --ranks N``: the same through N gloo processes with EP over them; schedules
  that refuse a workload or whose Program is not symmetric (``pp``) are listed in ``skipped``,
  a failing rank in ``errors`` (exit 1), never a traceback.
- No GPU and no ``--device cpu``: one line saying so, exit 2.
"""

from __future__ import annotations

import json as _json
import sys
from pathlib import Path

DEFAULTS = dict(
    schedule=None,
    model="deepseek-v3",
    gpu="h100",
    mode="decode",
    batch=None,
    workload=None,
    prefix_len=0,
    ep=None,
    layers=None,
    backend="auto",
    device="auto",
    check=False,
    ranks=1,
    json=False,
    out="results/run",
    warmup=2,
    repeats=5,
    seed=0,
    tolerance=None,
    cfg=None,
)

NO_GPU = (
    "no CUDA GPU found: `overlap-lab run` measures on a GPU; use --device cpu --check for the "
    "CPU equivalence check"
)


def _opt(args, name):
    v = getattr(args, name, None)
    return DEFAULTS[name] if v is None else v


def _say(line: str) -> None:
    print(line, file=sys.stderr)


def run_main(args) -> int:
    from overlap_lab.shared.errors import ConfigError

    try:
        return _run(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _schedules(args) -> list[str]:
    from overlap_lab.shared import schedules as S

    name = _opt(args, "schedule")
    if name in (None, "all"):
        return S.available()
    S.module(name)  # ConfigError for an unknown or missing schedule
    return ["serial", name] if name != "serial" else ["serial"]


def _cpu_model(args) -> str:
    from overlap_lab.real.model import TINY_NAMES

    m = _opt(args, "model")
    return m if m in TINY_NAMES else "tiny-mla"


def _run(args) -> int:
    device = _opt(args, "device")
    if device == "cpu":
        return _run_cpu(args)
    import torch

    if not torch.cuda.is_available():
        print(NO_GPU)
        return 2
    return _run_gpu(args)


# -- CPU ---------------------------------------------------------------------------------------


def _run_cpu(args) -> int:
    from overlap_lab.real.check import DEFAULT_TOLERANCE, check_equivalence, default_workloads

    model = _cpu_model(args)
    if model != _opt(args, "model"):
        _say(f"note: the CPU check runs {model} (scaled down), not {_opt(args, 'model')}")
    names = _schedules(args)
    tol = _opt(args, "tolerance") or DEFAULT_TOLERANCE
    ranks = int(_opt(args, "ranks"))
    workloads = default_workloads(model, ep=max(2, ranks))
    out: dict = {"device": "cpu", "model": model, "tolerance": tol}
    if ranks > 1:
        from overlap_lab.real.distributed import run_gloo, split_cases

        cases, skipped = split_cases(
            [(n, w) for n in names for w in workloads], gpu=_opt(args, "gpu"), cfg=_opt(args, "cfg")
        )
        errors: dict[str, str] = {}
        try:
            res = run_gloo(
                cases,
                world=ranks,
                seed=_opt(args, "seed"),
                gpu=_opt(args, "gpu"),
                cfg=_opt(args, "cfg"),
            )
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
        )
        ok = not errors and all(v <= tol for v in diffs.values())
        key = "max_rel_diff_vs_one_process"
    else:
        cr = check_equivalence(
            names,
            workloads,
            gpu=_opt(args, "gpu"),
            seed=_opt(args, "seed"),
            tolerance=tol,
            cfg=_opt(args, "cfg"),
        )
        out.update(
            backend="local",
            max_rel_diff_vs_serial=cr.max_rel_diff_vs_serial,
            errors=cr.errors,
            skipped=cr.skipped,
        )
        ok, key = cr.ok, "max_rel_diff_vs_serial"
    out["ok"] = ok
    if _opt(args, "json"):
        print(_json.dumps(out, indent=2, sort_keys=True))
    else:
        for name, d in out[key].items():
            flag = "ok" if d <= tol else "FAIL"
            print(f"{name:16s} max rel diff {d:.2e}  {flag}")
        for name, e in out.get("errors", {}).items():
            print(f"{name:16s} ERROR {e}")
        for name, e in out.get("skipped", {}).items():
            print(f"{name:16s} skipped for a workload: {e}")
    return 0 if ok else 1


# -- GPU ---------------------------------------------------------------------------------------


def _backend(args, w, gpu):
    import torch

    from overlap_lab.real.comm import make_backend
    from overlap_lab.real.comm.bytes import LinkParams
    from overlap_lab.real.model import from_model_config

    rc = from_model_config(w.model)
    name = _opt(args, "backend")
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


def _run_gpu(args) -> int:
    import torch

    from overlap_lab.real.check import workload_variants
    from overlap_lab.real.deps import probe
    from overlap_lab.real.executor import execute
    from overlap_lab.shared import schedules as S
    from overlap_lab.shared.hardware import get_gpu

    gpu = get_gpu(_opt(args, "gpu"))
    w = _opt(args, "workload")  # built by experiments/cli.py, as for `sim`
    if w is None:
        from overlap_lab.shared.errors import ConfigError

        raise ConfigError("a GPU run needs the workload (run it through `overlap-lab run`)")
    names = (
        [n for n in _schedules(args)]
        if _opt(args, "schedule") in (None, "all")
        else [_opt(args, "schedule")]
    )
    out_dir = Path(_opt(args, "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    deps = probe()
    summaries = {}
    for name in names:
        wv = workload_variants(name, w)[0]  # pp runs on a pp >= 2 copy of a pp = 1 workload
        prog = S.build(name, wv, gpu, _opt(args, "cfg"))
        be = _backend(args, wv, gpu)
        res = execute(
            prog,
            wv,
            backend=be,
            device="cuda",
            seed=_opt(args, "seed"),
            warmup=_opt(args, "warmup"),
            repeats=_opt(args, "repeats"),
            host_spin=False,  # the real Python launch overhead IS the host time: not twice
            meta=dict(
                schedule=name,
                model=w.model.name,
                gpu=gpu.name,
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
        tr.to_chrome(out_dir / f"{name}.trace.json")
        try:
            from overlap_lab.experiments.figures import save_timeline

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
        if prog.meta.get("pp_size", 1) > 1:  # in-process stages: not a pipeline's timing
            s["note"] = (
                "pp: every pipeline stage runs in this one process on one GPU; its times are "
                "not those of one stage per GPU (do not compare them with other schedules)"
            )
        summaries[name] = s
    if _opt(args, "json"):
        print(
            _json.dumps(
                summaries if len(summaries) > 1 else summaries[names[0]], indent=2, default=str
            )
        )
    else:
        for name, s in summaries.items():
            g = s.get("graph_replay_step_time_us")
            print(
                f"{name:16s} step {s['step_time_us']:.1f} us (op-by-op spans)"
                + (f"  graph replay {g:.1f} us" if g else "")
                + f"  exposed comm {s['exposed_comm_us']:.1f} us  backend {s['backend']}"
                f"  device {s['device']}" + ("  [pp: stages share one GPU]" if "note" in s else "")
            )
    return 0


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
