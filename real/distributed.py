"""EP across processes on one machine: torch.distributed on gloo, spawned by
torch.multiprocessing. Proves that dispatch/combine across ranks computes what one process with
every expert computes on the same inputs.

Each rank runs the same (symmetric) Program on its own batch (inputs seeded by rank), holds
experts [r*E/N, (r+1)*E/N) and exchanges rows with the ``torch`` backend; then it runs the same
Program alone with every expert and the ``local`` backend, and reports the largest relative
difference. On GPUs the same function runs under torchrun with NCCL (``run_rank``).

``split_cases`` builds each case's Program first (in the parent): a schedule that refuses the
workload (ConfigError, e.g. ``pp`` on a pp=1 workload) or whose Program is not symmetric (``pp``:
its stages run as in-process ranks, real/check.py) is skipped with the reason, never spawned.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from collections.abc import Sequence
from datetime import timedelta

import torch


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(
    rank: int,
    world: int,
    schedule: str,
    workload,
    *,
    gpu: str = "h100",
    cfg=None,
    seed: int = 0,
    device: str = "cpu",
    kernels: Sequence[str] = (),
) -> dict:
    """This rank's EP run and its one-process reference (both with the kernel families
    ``kernels`` preferred); torch.distributed must be initialised."""
    import torch.distributed as dist

    from overlap_lab.real import model as M
    from overlap_lab.real.check import compare_steps
    from overlap_lab.real.comm.loopback import LoopbackBackend
    from overlap_lab.real.comm.torch_dist import TorchDistBackend
    from overlap_lab.real.executor import execute
    from overlap_lab.shared import schedules as S
    from overlap_lab.shared.inputs.hardware import get_gpu

    g = get_gpu(gpu)
    prog = S.build(schedule, workload, g, cfg)
    rc = M.from_model_config(workload.model)
    dev = torch.device(device)
    ep = M.init_weights(rc, seed=seed, device=dev, ep_rank=rank, ep_size=world)
    be = TorchDistBackend(num_experts=rc.num_experts, hidden=rc.hidden)
    out = execute(
        prog,
        workload,
        weights=ep,
        backend=be,
        seed=seed + 1000 * rank,
        device=device,
        check_hazards=True,
        gpu=g,
        kernels=kernels,
    )
    full = M.init_weights(rc, seed=seed, device=dev)
    local = LoopbackBackend(rank=0, world=1, num_experts=rc.num_experts, hidden=rc.hidden)
    ref = execute(
        prog, workload, weights=full, backend=local, seed=seed + 1000 * rank, device=device,
        gpu=g, kernels=kernels,
    )  # fmt: skip
    d = compare_steps(out.outputs[0], ref.outputs[0][0])
    dist.barrier()
    return {"rank": rank, "max_rel_diff": d, "traffic": be.traffic.by_kind}


def _worker(rank: int, world: int, port: int, cases: list, outdir: str, kw: dict):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    res: list[dict] = []
    try:
        for schedule, workload in cases:
            res.append({"schedule": schedule, **run_rank(rank, world, schedule, workload, **kw)})
    except Exception as e:  # reported to the parent, which raises
        res.append({"rank": rank, "error": f"{type(e).__name__}: {e}"})
    finally:
        dist.destroy_process_group()
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


def split_cases(
    cases: list[tuple[str, object]], *, gpu: str = "h100", cfg=None
) -> tuple[list[tuple[str, object]], dict[str, str]]:
    """(the cases that can run over gloo, {schedule: why it was skipped for some workload})."""
    from overlap_lab.real.check import workload_variants
    from overlap_lab.shared import schedules as S
    from overlap_lab.shared.errors import ConfigError
    from overlap_lab.shared.inputs.hardware import get_gpu

    g = get_gpu(gpu)
    runnable: list[tuple[str, object]] = []
    skipped: dict[str, str] = {}
    for name, w0 in cases:
        for w in workload_variants(name, w0) or [w0]:  # pp: its pp >= 2 copies
            try:
                prog = S.build(name, w, g, cfg)
            except ConfigError as e:
                skipped.setdefault(name, str(e))
                continue
            if prog.symmetric:
                runnable.append((name, w))
                continue
            skipped.setdefault(
                name,
                "non-symmetric Program (its ranks run in one process: the CPU check covers it); "
                "gloo runs symmetric EP Programs only",
            )
    return runnable, skipped


def run_gloo(cases: list[tuple[str, object]], world: int = 2, **kw) -> list[dict]:
    """Spawn ``world`` gloo processes (once) and run every (schedule, workload) case with EP
    over them; one result per case and rank: schedule, rank, max_rel_diff, traffic. Filter the
    cases with ``split_cases`` first."""
    import torch.multiprocessing as mp

    if not cases:
        return []

    for _, w in cases:
        if w.model.num_experts % world:
            raise ValueError(f"{world} ranks do not divide {w.model.num_experts} experts")
    with tempfile.TemporaryDirectory() as d:
        # fork: the children inherit the imported modules (spawn re-imports torch in each)
        mp.start_processes(
            _worker,
            args=(world, free_port(), list(cases), d, kw),
            nprocs=world,
            join=True,
            start_method="fork",
        )
        out = []
        for r in range(world):
            with open(os.path.join(d, f"rank{r}.json")) as f:
                out += json.load(f)
    errors = [r["error"] for r in out if "error" in r]
    if errors:
        raise RuntimeError(f"gloo EP run failed: {errors[0]}")
    return out
