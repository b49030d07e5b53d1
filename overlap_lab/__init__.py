"""overlap-lab: simulate, run and compare overlap schedules of Mixture-of-Experts LLM inference.

The repository keeps its four top-level folders (``shared/``, ``sim/``, ``real/``,
``experiments/``); they install as subpackages of this one namespace (``overlap_lab.shared``,
``overlap_lab.sim``, ``overlap_lab.real``, ``overlap_lab.experiments``, mapped in pyproject.toml's
``package-dir``) so that nothing with a generic name lands in site-packages.
"""

__version__ = "0.1.0"
