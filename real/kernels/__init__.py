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
name); ``context.py`` holds what a kernel sees (``KernelCtx``, ``StepState``, ``BatchLayout``).
``bind(name)`` raises KeyError naming the op when nothing is bound, and ``unbound(names)`` lists
the gaps (tests check every schedule).
"""

from overlap_lab.real.kernels.context import (
    ROW_KEYS,
    BatchLayout,
    KernelCtx,
    StepState,
    WouldBlock,
    new_step_state,
)
from overlap_lab.real.kernels.registry import (
    FAMILIES,
    GROUP,
    Bindings,
    Kernel,
    KernelFamily,
    bind,
    bindings,
    split_piece,
    unbound,
)

__all__ = [
    "FAMILIES",
    "GROUP",
    "ROW_KEYS",
    "BatchLayout",
    "Bindings",
    "Kernel",
    "KernelCtx",
    "KernelFamily",
    "StepState",
    "WouldBlock",
    "bind",
    "bindings",
    "new_step_state",
    "split_piece",
    "unbound",
]
