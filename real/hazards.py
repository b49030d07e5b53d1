"""Happens-before on the CPU: does every read follow its write as the GPU would order them?

On the CPU the executor runs every stream's work in host issue order, which hides races a GPU
would have. So every op's reads are checked against the Program's own ordering: a value must
have been written by an op that happens-before the reader by stream order, events, stream waits
or host syncs, as CUDA would order them (vector clocks over one rank's streams and events; a
collective's receive half is ordered after its send by the collective itself).
"""

from __future__ import annotations

from dataclasses import dataclass

from overlap_lab.shared.ir.program import Op


class HazardError(RuntimeError):
    """An op reads a value whose writer is not ordered before it on the GPU."""


# ----------------------------------------------------------------------------------------------
# Happens-before on the CPU: vector clocks per stream, events and host threads
# ----------------------------------------------------------------------------------------------


@dataclass
class _Stamp:
    stream: str
    seq: int
    clock: dict[str, int]
    desc: str
    coll: str | None = None  # collective key of the op
    recv: bool = False  # a receive half: completes only when the collective's data arrived


def _ordered(cur: _Stamp, w: _Stamp) -> bool:
    """w happens-before cur: by streams and events, or because cur is the receive half of w's
    collective (DeepEP's recv kernel polls arrival flags on the device, whatever its stream)."""
    if w is cur or cur.clock.get(w.stream, 0) >= w.seq:
        return True
    return cur.recv and cur.coll is not None and cur.coll == w.coll


class HazardTracker:
    """Vector clocks over one rank's streams. An op X happens-before op Y iff Y's clock has seen
    X's position on X's stream. Host-side reads (after a Sync) are not checked."""

    def __init__(self):
        self.streams: dict[str, dict[str, int]] = {}
        self.events: dict[str, dict[str, int]] = {}
        self.writers: dict[tuple, list[_Stamp]] = {}
        self.current: _Stamp | None = None
        self.violations: list[str] = []

    def _vc(self, stream: str) -> dict[str, int]:
        return self.streams.setdefault(stream, {})

    @staticmethod
    def _merge(a: dict[str, int], b: dict[str, int]) -> None:
        for k, v in b.items():
            if a.get(k, 0) < v:
                a[k] = v

    def launch(self, op: Op, stream: str) -> None:
        vc = self._vc(stream)
        vc[stream] = vc.get(stream, 0) + 1
        desc = f"{op.name} (layer {op.layer}, mb {op.mb}, step {op.step}) on {stream}"
        coll = op.coll.key if op.coll is not None else None
        recv = op.coll is not None and op.coll.role in ("recv", "sendrecv")
        self.current = _Stamp(stream, vc[stream], dict(vc), desc, coll, recv)

    def record(self, event: str, stream: str) -> None:
        self.events[event] = dict(self._vc(stream))

    def wait(self, stream: str, event: str) -> None:
        if event not in self.events:
            raise HazardError(f"wait on event {event!r} before it was recorded")
        self._merge(self._vc(stream), self.events[event])

    def wait_stream(self, stream: str, other: str) -> None:
        self._merge(self._vc(stream), self._vc(other))

    def write(self, key: tuple, op: Op) -> None:
        if self.current is not None:
            if key[0] == "kv":
                self.writers.setdefault(key, []).append(self.current)
            else:
                self.writers[key] = [self.current]

    def check(self, w: _Stamp, what: str) -> None:
        cur = self.current
        if cur is not None and not _ordered(cur, w):
            self.violations.append(
                f"{cur.desc} reads {what} written by {w.desc}, which is not ordered before it "
                "(missing event wait?)"
            )

    def read(self, key: tuple, op: Op) -> None:
        cur = self.current
        if cur is None:
            return
        for w in self.writers.get(key, ()):
            if not _ordered(cur, w):
                self.violations.append(
                    f"{cur.desc} reads {key[-1] if key[0] == 'mb' else 'kv cache'} "
                    f"written by {w.desc}, which is not ordered before it (missing event wait?)"
                )
