"""CPU equivalence: every schedule computes what the serial schedule computes.

Each schedule's Program is executed on the CPU (real/executor.py, hazards checked) for several
workloads, and its outputs (final normed hidden states of every real token, logits of the
sampled tokens) are compared with the serial schedule's on the same seeded weights and inputs.
Every step of a multi-step Program is an independent forward of the same batch, compared with
serial's single step. The result per schedule is the largest relative difference
max|a - b| / max|b| over workloads, steps and both outputs.

A schedule that needs another parallel layout than the workload's runs on copies of it
(``workload_variants``): a schedule that runs pipeline stages (its module sets ``SUPPORTS_PP``)
on pp=2 and pp=3 copies (as many stages as the model has layers), compared with serial on the
pp=1 workload (layer i has the same weights on whichever stage holds it); its last stage's
outputs are compared, and the ids that reached rank 0 must be those the last stage sampled.
Each schedule runs with the configuration its module asks the check for
(``shared.schedules.cpu_check_config``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from overlap_lab.real import model as M
from overlap_lab.real.executor import HazardError, execute

DEFAULT_TOLERANCE = 1e-4  # FP32 on the CPU; splits change GEMM shapes, hence rounding


def default_workloads(model: str = "tiny-mla", ep: int = 2) -> list:
    """Decode, an uneven prefill split, and a prefill TBO cuts in two (two-chunk split)."""
    from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload

    mc = M.get_model_config(model)
    par = Parallel(ep=ep)
    batches = [
        Batch.decode(kv_lens=[7, 12, 5, 9]),
        Batch.decode(kv_lens=[6, 3, 11], tokens_per_seq=2),
        Batch.prefill(extend_lens=[5, 9, 3], prefix_lens=[0, 4, 2]),
        Batch.prefill(extend_lens=[30, 2], prefix_lens=[3, 0]),  # two-chunk split of seq 0
    ]
    return [Workload(mc, b, par) for b in batches]


PP_SIZES = (2, 3)  # pipeline stages a schedule that runs them is checked with


def split_config(cfg=None, names: list[str] | None = None):
    """``cfg`` as the check runs ``names`` (None: every schedule): each one's module's
    ``cpu_check_config`` applied in turn, each changing only its own knobs (vllm-dbo lowers its
    split thresholds to 1 where they are at their defaults: the check's workloads have 4 to 32
    tokens, under the defaults, so its check would otherwise compare serial with itself;
    thresholds the caller set are kept and its unsplit runs reported)."""
    from overlap_lab.shared import schedules as S

    cfg = cfg or S.ScheduleConfig()
    for name in names or S.available():
        cfg = S.cpu_check_config(name, cfg)
    return cfg


def unsplit_runs(names: list[str], workloads: list, *, gpu: str = "h100", cfg=None) -> dict:
    """{schedule: "k of n workloads: why"} for the schedules whose Program fell back to one
    micro-batch on some workload (``fallback_reason``): their check did not cover the split path
    there, which a bare "ok" would hide."""
    from overlap_lab.shared import schedules as S
    from overlap_lab.shared.errors import ConfigError
    from overlap_lab.shared.inputs.hardware import get_gpu

    g = get_gpu(gpu)
    out: dict[str, str] = {}
    for name in names:
        reasons, total = [], 0
        for w in workloads:
            for wv in workload_variants(name, w):
                try:
                    meta = S.build(name, wv, g, cfg).meta
                except ConfigError:
                    continue
                total += 1
                if meta.fallback_reason:
                    reasons.append(meta.fallback_reason)
        if reasons:
            out[name] = f"{len(reasons)} of {total} workloads: {reasons[0]}"
    return out


def pp_variants(w) -> list:
    """Copies of ``w`` with pp = 2, 3 (no more stages than the model has layers)."""
    if w.parallel.pp > 1:
        return [w]
    return [
        replace(w, parallel=replace(w.parallel, pp=p)) for p in PP_SIZES if p <= w.model.num_layers
    ]


def workload_variants(name: str, w) -> list:
    """The workloads schedule ``name`` is checked on for ``w``: its pp copies for a schedule
    that runs pipeline stages (the registry's ``SUPPORTS_PP``), ``w`` itself for the others."""
    from overlap_lab.shared import schedules as S

    return pp_variants(w) if S.supports_pp(name) else [w]


def check_pp_outputs(outputs: dict) -> None:
    """The next_token_ids rank 0 received are those the last stage of a pipeline sampled (every
    iteration runs the same forward, so all must be equal)."""
    first, last = outputs[min(outputs)], outputs[max(outputs)]
    sampled = [m["next_ids"] for st in last.values() for m in st.mbs.values() if "next_ids" in m]
    got = [m["next_ids"] for st in first.values() for m in st.mbs.values() if "next_ids" in m]
    if not sampled or not got:
        raise AssertionError(f"pipeline: {len(sampled)} sampled, {len(got)} ids reached rank 0")
    rows, ids = sampled[0]
    for r, i in (*sampled, *got):
        if not (torch.equal(r, rows) and torch.equal(i, ids)):
            raise AssertionError("pipeline: next_token_ids on rank 0 differ from the last stage's")


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.abs().max()) if b.numel() else 0.0
    d = float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
    return d / scale if scale > 0 else d


def compare_steps(states: dict, ref) -> float:
    """Largest relative difference of every step of ``states`` against the reference step, on
    the tokens each step covered (all of them, for a complete forward)."""
    worst = 0.0
    for st in states.values():
        if not st.covered:
            continue
        toks = sorted(st.covered)
        worst = max(worst, rel_diff(st.final[toks], ref.final[toks]))
        common = sorted(set(st.logits) & set(ref.logits))
        if common:
            a = torch.stack([st.logits[t] for t in common])
            b = torch.stack([ref.logits[t] for t in common])
            worst = max(worst, rel_diff(a, b))
        missing = set(ref.logits) - set(st.logits)
        if missing and st.covered >= set(range(ref.layout.num_tokens)):
            raise AssertionError(f"logits missing for tokens {sorted(missing)[:5]}")
    return worst


@dataclass
class CheckResult:
    max_rel_diff_vs_serial: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    unsplit: dict[str, str] = field(default_factory=dict)  # schedule: which runs did not split
    tolerance: float = DEFAULT_TOLERANCE

    @property
    def ok(self) -> bool:
        return not self.errors and all(
            v <= self.tolerance for v in self.max_rel_diff_vs_serial.values()
        )


def check_equivalence(
    schedule_names: list[str] | None = None,
    workloads: list | None = None,
    *,
    gpu: str = "h100",
    cfg=None,
    seed: int = 0,
    tolerance: float = DEFAULT_TOLERANCE,
    kernels: Sequence = (),
) -> CheckResult:
    """Run each schedule on each workload on the CPU and compare with serial (both with the
    kernel families ``kernels`` preferred: ``real.executor.execute``).

    A schedule that refuses a workload with ConfigError is skipped for it (reported in
    ``skipped``); a Program the validator refuses, a hazard (an unordered read) or a kernel
    error is an error for that schedule.
    ``cfg`` goes through :func:`split_config` (the tiny workloads must reach each schedule's
    split path); the runs that still fell back to one micro-batch are reported in ``unsplit``.
    """
    from overlap_lab.shared import schedules as S
    from overlap_lab.shared.inputs.hardware import get_gpu

    names = schedule_names or S.available()
    workloads = workloads or default_workloads()
    g = get_gpu(gpu)
    cfg = split_config(cfg, names)
    res = CheckResult(tolerance=tolerance, unsplit=unsplit_runs(names, workloads, gpu=gpu, cfg=cfg))
    with one_thread():
        _check(names, workloads, g, cfg, seed, res, kernels)
    return res


class one_thread:
    """Tiny CPU kernels run fastest on one thread (and CI has two cores shared by pytest)."""

    def __enter__(self):
        self.n = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.n)


def _check(names, workloads, g, cfg, seed, res: CheckResult, kernels: Sequence = ()) -> None:
    from overlap_lab.shared import schedules as S
    from overlap_lab.shared.errors import ConfigError
    from overlap_lab.shared.ir.validate import ProgramError

    weights_cache: dict = {}
    for w in workloads:
        key = w.model
        if key not in weights_cache:
            weights_cache[key] = M.init_weights(M.from_model_config(w.model), seed=seed)
        weights = weights_cache[key]
        ref_prog = S.build(S.BASELINE, w, g, cfg)
        ref = execute(ref_prog, w, weights=weights, seed=seed, gpu=g, kernels=kernels)
        ref = ref.outputs[0][0]
        for name in names:
            variants = workload_variants(name, w)
            if not variants:
                res.skipped.setdefault(name, f"no variant of the workload for {w.model.name}")
            for wv in variants:
                if name in res.errors:
                    break
                try:
                    prog = S.build(name, wv, g, cfg)
                except ConfigError as e:
                    res.skipped.setdefault(name, str(e))
                    continue
                try:
                    out = execute(prog, wv, weights=weights, seed=seed, gpu=g, kernels=kernels)
                    d = max(compare_steps(states, ref) for states in out.outputs.values())
                    if (prog.meta.pp_size or 1) > 1:
                        check_pp_outputs(out.outputs)
                except (ProgramError, HazardError, KeyError, RuntimeError, AssertionError) as e:
                    res.errors[name] = f"{type(e).__name__}: {e}"
                    continue
                prev = res.max_rel_diff_vs_serial.get(name, 0.0)
                res.max_rel_diff_vs_serial[name] = max(prev, d)


def grouped_max_abs_diff(y, ref, counts: list[int]) -> list[float]:
    """Per expert, the largest ``|y - ref|`` over its valid rows, 0.0 for an expert without rows
    (the max of nothing). ``y``/``ref``: [E, M, N] (DeepEP's low-latency layout: expert e's
    first ``counts[e]`` rows) or [sum(counts), N] (rows sorted by expert, one segment each)."""
    out, lo = [], 0
    for e, n in enumerate(counts):
        a, b = (y[e, :n], ref[e, :n]) if y.dim() == 3 else (y[lo : lo + n], ref[lo : lo + n])
        lo += n
        out.append(float((a.float() - b.float()).abs().max()) if n else 0.0)
    return out
