"""Optional GPU dependencies behind one boundary: detect, report, and fail with an actionable
message. Nothing here is required to install the project or run its CPU tests.

DeepEP and DeepGEMM: the PyPI packages named ``deep-ep`` and ``deep-gemm`` (1.0.0) are broken
source snapshots (headers missing) and must not be used. Working binary builds are published under
other names and install the same import names:
- DeepEP V1 API (``import deep_ep``): ``tokenspeed-deepep==1.2.1.post20251110`` (CUDA 13, cp312,
  links against torch 2.11); ``sgl-deep-ep`` (SGLang's fork, pins newer torch).
- DeepGEMM (``import deep_gemm``): ``sgl-deep-gemm==0.1.5`` or
  ``tokenspeed-deepgemm==2.3.0.post20251110`` (torch 2.11 symbols; JIT needs nvcc >= 12.3).
These are third-party or fork builds: their name and version are recorded in every trace.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
from functools import cache

# import name -> distributions that provide it, best first
DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "triton": ("triton", "pytorch-triton"),
    "deep_ep": ("tokenspeed-deepep", "sgl-deep-ep", "deep-ep"),
    "deep_gemm": ("sgl-deep-gemm", "tokenspeed-deepgemm", "deep-gemm"),
    "flash_mla": ("sgl-flash-mla", "tokenspeed-flashmla", "flash-mla"),
}

INSTALL_HINTS: dict[str, str] = {
    "torch": 'pip install "torch==2.13.0" -e ".[real]"  (the CPU wheel; on a GPU, a CUDA build of torch)',
    "triton": "pip install triton  (ships with CUDA torch wheels)",
    "deep_ep": (
        "pip install --no-deps tokenspeed-deepep==1.2.1.post20251110  (DeepEP V1 API, CUDA 13, "
        "torch 2.11; NOT the broken 'deep-ep' 1.0.0 sdist); needs >= 2 GPUs and torchrun"
    ),
    "deep_gemm": (
        "pip install --no-deps sgl-deep-gemm==0.1.5  (or tokenspeed-deepgemm==2.3.0.post20251110; "
        "NOT the broken 'deep-gemm' 1.0.0 sdist); its JIT needs CUDA_HOME and nvcc >= 12.3"
    ),
    "flash_mla": (
        "pip install --no-deps sgl-flash-mla  (FlashMLA decode attention, Hopper; builds for "
        "other torch versions may not import: the executor then runs torch SDPA and says so)"
    ),
}

BROKEN = {"deep-ep": "1.0.0", "deep-gemm": "1.0.0"}


def _dist_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


@cache
def probe() -> dict[str, dict]:
    """For each optional module: importable?, version, providing distribution, error, hint."""
    out: dict[str, dict] = {}
    for mod, dists in DISTRIBUTIONS.items():
        info: dict = {"importable": False, "hint": INSTALL_HINTS[mod]}
        for d in dists:
            v = _dist_version(d)
            if v is not None:
                info.update(distribution=d, version=v)
                if BROKEN.get(d) == v:
                    info["warning"] = f"{d}=={v} on PyPI is a broken source snapshot"
                break
        try:
            m = importlib.import_module(mod)
            info["importable"] = True
            info.setdefault("version", getattr(m, "__version__", None))
        except Exception as e:  # ImportError, or an undefined symbol in a binary wheel
            info["error"] = f"{type(e).__name__}: {e}"
        out[mod] = info
    if out["torch"]["importable"]:
        import torch

        out["torch"]["cuda"] = torch.version.cuda
        out["torch"]["gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return out


def interpreting() -> bool:
    """Triton kernels run in its CPU interpreter (TRITON_INTERPRET=1): the CPU tests' mode."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(mod: str) -> bool:
    return probe()[mod]["importable"]


def require(mod: str, *, why: str = ""):
    """Import ``mod`` or raise ImportError with what to install and why it is needed."""
    try:
        return importlib.import_module(mod)
    except Exception as e:
        reason = f" (needed for {why})" if why else ""
        raise ImportError(
            f"{mod} is not importable{reason}: {e}. Install: {INSTALL_HINTS[mod]}"
        ) from e


def no_device(device: str) -> str | None:
    """Why a command for ``device`` (``cuda`` or ``cpu``) cannot run here, or None: torch is
    missing, or CUDA is asked for and absent."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device here"
    return None


def report() -> list[str]:
    """One line per optional dependency, for `overlap-lab run --deps` or error messages."""
    lines = []
    for mod, info in probe().items():
        if info["importable"]:
            src = info.get("distribution", "?")
            lines.append(f"{mod}: ok ({src} {info.get('version')})")
        else:
            lines.append(f"{mod}: missing — {info['hint']}")
        if "warning" in info:
            lines.append(f"  warning: {info['warning']}")
    return lines
