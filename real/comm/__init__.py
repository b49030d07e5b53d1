"""Communication backends behind one DeepEP-V1-shaped interface (real/comm/base.py).

``make_backend(name, ...)`` builds one: ``local`` (one process, exact), ``torch``
(torch.distributed: gloo on the CPU, NCCL on GPUs), ``emulated`` (one GPU, Triton kernels timed by
an α-β link model), ``deepep`` (DeepEP V1, >= 2 GPUs). torch is imported by the backends only.
"""

from __future__ import annotations

BACKENDS = ("local", "torch", "emulated", "deepep")


def make_backend(name: str, **kw):
    """Build backend ``name``; kw: rank, world, num_experts, hidden, link, num_sms, ..."""
    from overlap_lab.shared.errors import ConfigError

    if name == "local":
        from overlap_lab.real.comm.loopback import LoopbackBackend

        return LoopbackBackend(**kw)
    if name == "torch":
        from overlap_lab.real.comm.torch_dist import TorchDistBackend

        return TorchDistBackend(**kw)
    if name == "emulated":
        from overlap_lab.real.comm.emulated import EmulatedBackend

        return EmulatedBackend(**kw)
    if name == "deepep":
        from overlap_lab.real.comm.deepep import DeepEPBackend

        return DeepEPBackend(**kw)
    raise ConfigError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
