"""The ``local`` backend: one process, rows "exchanged" in place, bytes counted as DeepEP would.

With ``world=1`` it is the identity (every expert is local), which is what the CPU equivalence
check uses. With a virtual ``world=R`` it is the mirror exchange of the emulated backend: under
the symmetric assumption every peer p sends this rank what this rank sends p, so the rows this
rank receives from p are its own rows bound for p, relabelled to local experts. Shapes, row
counts and bytes are those of a real R-rank run; the numbers are those of a model whose rank-p
experts are this rank's (``meta["numerics"] = "mirror"``).
"""

from __future__ import annotations

import torch

from real.comm.base import EPBackend, Pending


class LoopbackBackend(EPBackend):
    name = "local"
    capabilities = frozenset({"normal", "ll_hook"})

    def _exchange_start(self, chunks: list[list[torch.Tensor]], kind: str) -> Pending:
        n = len(chunks[0])
        recv = [torch.cat([c[i] for c in chunks]) for i in range(n)]
        pend = Pending(recv, [int(c[0].shape[0]) for c in chunks])
        if recv[0].is_cuda:
            # The receive half may run on another stream (SBO: send on alt, hook on main); the
            # rows are there once the send stream passed this point, as DeepEP's flags say.
            ev = torch.cuda.Event()
            ev.record()
            pend.waits.append(lambda: torch.cuda.current_stream().wait_event(ev))
        return pend

    def describe(self) -> dict:
        d = super().describe()
        d["numerics"] = "exact" if self.world == 1 else "mirror"
        return d
