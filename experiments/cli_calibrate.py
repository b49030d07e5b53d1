"""The calibration side of the command line: ``--profile`` and ``analyze``, ``calibrate``,
``validate``.

    overlap-lab sim --profile h800-published ...       # measured durations where rows apply
    overlap-lab analyze TRACE.json                       # busy, overlap, per-kernel-class table
    overlap-lab calibrate --from-trace TRACE.json ...    # a profile from a measured trace
    overlap-lab validate TRACE.json ...                  # measured vs predicted, op by op

Argument parsing and handlers live here; the work is in library modules (``sim.profile``,
``shared.analyze``, ``experiments.calibrate``) that the real executor calls too.
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

from overlap_lab.shared.hardware import GPU
from overlap_lab.shared.program import Program, ops_of
from overlap_lab.sim.profile import BUILTIN, ROOFLINE, Profile, load_profile, resolve


def add_profile_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--profile",
        default="auto",
        help=f"measured kernel durations: a profile file, {', '.join(BUILTIN)}, or {ROOFLINE} "
        "(analytic only); auto: the GPU's built-in profile (h800 -> h800-published), else "
        f"{ROOFLINE} (default: auto)",
    )


def profile_from(args, gpu: GPU) -> Profile | None:
    """The profile ``args.profile`` names for ``gpu`` (None: the roofline alone)."""
    return load_profile(resolve(getattr(args, "profile", "auto"), gpu.name))


def profile_name(profile: Profile | None) -> str:
    return ROOFLINE if profile is None else profile.name


def cost_sources(program: Program, gpu: GPU, profile: Profile | None) -> dict[str, dict[str, int]]:
    """Per op class, how many launched ops take their duration from the profile, the roofline
    or the link model (communication kernels and copies)."""
    from overlap_lab.sim.cost import duration_source

    counts: dict[str, Counter] = {}
    for _, op in ops_of(program):
        counts.setdefault(op.op_class, Counter())[duration_source(op, gpu, profile)] += 1
    return {c: dict(sorted(n.items())) for c, n in sorted(counts.items())}


def add_provenance(res: dict[str, Any], program: Program, gpu: GPU, profile) -> None:
    """The keys a result row gets from calibration: ``profile`` and ``cost_sources``."""
    res["profile"] = profile_name(profile)
    res["cost_sources"] = cost_sources(program, gpu, profile)


def cost_comments(program: Program, gpu: GPU, profile: Profile | None) -> str:
    """``show --profile``: each op's solo duration and where it comes from, as ``#`` lines the
    Program parser skips (first rank only)."""
    from overlap_lab.sim.cost import duration_source, solo_duration_us

    if profile is None:
        return ""
    lines = [f"# durations alone on the GPU, profile {profile.name} (rank {program.ranks[0].rank})"]
    rank = program.ranks[0].rank
    for r, op in ops_of(program):
        if r != rank:
            continue
        src = duration_source(op, gpu, profile)
        us = solo_duration_us(op, gpu, profile=profile if src == "profile" else None)
        lines.append(f"# {op.name} layer={op.layer} mb={op.mb} {us:.3f} us {src}")
    return "\n".join(lines) + "\n"
