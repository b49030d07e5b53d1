"""overlap-lab: simulate, run and compare overlap schedules of Mixture-of-Experts LLM inference.

The public API (:mod:`overlap_lab.api`)::

    import overlap_lab as ol
    w = ol.workload("deepseek-v3", mode="decode", batch=128, ep=32)
    ol.simulate("tbo", w, gpu="h800").metrics
    print(ol.compare(["serial", "tbo", "sbo"], w).text())

The repository keeps its four top-level folders (``shared/``, ``sim/``, ``real/``,
``experiments/``); they install as subpackages of this one namespace (``overlap_lab.shared``,
``overlap_lab.sim``, ``overlap_lab.real``, ``overlap_lab.experiments``, mapped in pyproject.toml's
``package-dir``) so that nothing with a generic name lands in site-packages. The names below load
on first use, so ``import overlap_lab.shared.ir.program`` does not pull in the simulator.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: public name -> module that defines it
_EXPORTS = {
    "simulate": "overlap_lab.api",
    "simulate_program": "overlap_lab.program_sim",
    "ProgramResult": "overlap_lab.program_sim",
    "compare": "overlap_lab.api",
    "lower_ranks": "overlap_lab.api",
    "workload": "overlap_lab.api",
    "model": "overlap_lab.api",
    "gpu": "overlap_lab.api",
    "Result": "overlap_lab.api",
    "Comparison": "overlap_lab.api",
    "CompareRow": "overlap_lab.api",
    "Ranks": "overlap_lab.api",
    "Metrics": "overlap_lab.metrics",
    "Workload": "overlap_lab.shared.inputs.workload",
    "Batch": "overlap_lab.shared.inputs.workload",
    "Parallel": "overlap_lab.shared.inputs.workload",
    "ModelConfig": "overlap_lab.shared.inputs.workload",
    "GPU": "overlap_lab.shared.inputs.hardware",
    "ScheduleConfig": "overlap_lab.shared.schedules",
    "SCHEDULES": "overlap_lab.shared.schedules",
    "Trace": "overlap_lab.shared.outputs.trace",
    "Span": "overlap_lab.shared.outputs.trace",
    "ConfigError": "overlap_lab.shared.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in ("api", "metrics"):
        return importlib.import_module(f"overlap_lab.{name}")
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'overlap_lab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
