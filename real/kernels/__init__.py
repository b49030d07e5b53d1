"""Op names bound to kernels: the IR names work (``"attn.core"``, ``"dispatch_a"``), never a kernel.

A kernel is ``fn(ctx: KernelCtx) -> None``; kernels come in families (``KernelFamily``), each a
plug-in of the entry-point group ``overlap_lab.kernel_families``, the built-ins too:

| family | module | ops |
| --- | --- | --- |
| ``head`` | ``head.py`` | embed, logits, sample |
| ``copies`` | ``copies.py`` | the D2H copies of sampled ids and logprobs |
| ``comm-prep`` | ``comm_prep.py`` | the norms and residual adds around a layer's halves |
| ``attention`` | ``attention.py`` | attn.prepare, attn.core |
| ``moe`` | ``moe.py`` | mlp, router, experts (whole and split), shared expert, output |
| ``ep-comm`` | ``ep_comm.py`` | dispatch and combine halves |
| ``p2p`` | ``p2p.py`` | send / recv between in-process ranks (pp) |
| ``placeholders`` | ``placeholders.py`` | no-ops and ops folded into another |

``registry.py`` resolves op name -> kernel for a run (``bindings``: some families preferred by
name) and imports without torch; ``context.py`` holds what a kernel sees (``KernelCtx``,
``StepState``, ``BatchLayout``).
``bind(name)`` raises KeyError naming the op when nothing is bound, and ``unbound(names)`` lists
the gaps (tests check every schedule).
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public name -> the module that holds it. Loaded when first used, so that the registry (and
#: the command line's list of family names) imports without torch; the kernels need it.
_EXPORTS = {
    **dict.fromkeys(
        ("ROW_KEYS", "BatchLayout", "KernelCtx", "StepState", "WouldBlock", "new_step_state"),
        "overlap_lab.real.kernels.context",
    ),
    **dict.fromkeys(
        ("FAMILIES", "GROUP", "Bindings", "Kernel", "KernelFamily", "Table", "bind", "bindings",
         "split_piece", "unbound"),
        "overlap_lab.real.kernels.registry",
    ),
}  # fmt: skip

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
