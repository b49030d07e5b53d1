"""Communication backends behind one DeepEP-V1-shaped interface (real/comm/base.py).

Backends are plug-ins of the entry-point group ``overlap_lab.comm_backends`` (name -> a class or
factory called with the backend's keywords: rank, world, num_experts, hidden, link, num_sms,
...), this project's built-ins too (``shared.plugins.Registry``): ``local`` (one process,
exact), ``torch`` (torch.distributed: gloo on the CPU, NCCL on GPUs), ``emulated`` (one GPU,
Triton kernels timed by an α-β link model), ``deepep`` (DeepEP V1, >= 2 GPUs).
``make_backend(name, ...)`` builds one. torch is imported by the backends only.
"""

from __future__ import annotations

from typing import Any

from overlap_lab.shared.plugins import Registry

GROUP = "overlap_lab.comm_backends"
#: The built-in backends, in listing order: the fallback when the entry points are not
#: installed (a source tree), and the order the installed ones keep.
BUILTINS: dict[str, str] = {
    "local": "overlap_lab.real.comm.loopback:LoopbackBackend",
    "torch": "overlap_lab.real.comm.torch_dist:TorchDistBackend",
    "emulated": "overlap_lab.real.comm.emulated:EmulatedBackend",
    "deepep": "overlap_lab.real.comm.deepep:DeepEPBackend",
}


def _check(obj: Any) -> str | None:
    return None if callable(obj) else "is not a class or factory (it is not callable)"


#: The backends' registry (``shared.plugins``): found by entry point, loaded when used.
BACKENDS = Registry(GROUP, "communication backend", BUILTINS, _check)


def make_backend(name: str, **kw):
    """Build backend ``name``; kw: rank, world, num_experts, hidden, link, num_sms, ...
    An unknown name, or a plug-in that fails to load, is one ConfigError naming it."""
    return BACKENDS.load(name)(**kw)
