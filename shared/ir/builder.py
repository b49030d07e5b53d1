"""A small helper for emitting Programs, so schedule modules read like their diagrams."""

from __future__ import annotations

from dataclasses import dataclass, field

from overlap_lab.shared.ir.program import (
    Graph,
    Host,
    HostThread,
    Instr,
    Launch,
    Op,
    Program,
    RankProgram,
    Record,
    Sync,
    Wait,
    WaitStream,
    Yield,
)
from overlap_lab.shared.ir.program_meta import ProgramMeta


@dataclass
class ThreadBuilder:
    """Appends instructions to one host thread. Methods return the builder for chaining."""

    name: str
    instrs: list[Instr] = field(default_factory=list)
    _graph: list | None = None

    def emit(self, ins: Instr) -> ThreadBuilder:
        """Append any instruction (as built elsewhere, e.g. a stage list of Launch objects)."""
        (self._graph if self._graph is not None else self.instrs).append(ins)  # ``_emit``, inline
        return self

    def _emit(self, ins: Instr) -> ThreadBuilder:
        (self._graph if self._graph is not None else self.instrs).append(ins)
        return self

    def launch(self, op: Op, stream: str) -> ThreadBuilder:
        return self._emit(Launch(op, stream))

    def record(self, event: str, stream: str) -> ThreadBuilder:
        return self._emit(Record(event, stream))

    def wait(self, stream: str, event: str) -> ThreadBuilder:
        return self._emit(Wait(stream, event))

    def wait_stream(self, stream: str, other: str) -> ThreadBuilder:
        return self._emit(WaitStream(stream, other))

    def host(self, name: str, us: float, **kw) -> ThreadBuilder:
        assert self._graph is None, "host work cannot be captured in a graph"
        return self._emit(Host(name, float(us), **kw))

    def sync(self, event: str) -> ThreadBuilder:
        assert self._graph is None, "a host sync cannot be captured in a graph"
        return self._emit(Sync(event))

    def yield_(self) -> ThreadBuilder:
        return self._emit(Yield())

    def begin_graph(self) -> None:
        assert self._graph is None, "graphs do not nest"
        self._graph = []

    def end_graph(self, name: str) -> ThreadBuilder:
        body, self._graph = tuple(self._graph), None
        self.instrs.append(Graph(name, body))
        return self

    def build(self) -> HostThread:
        assert self._graph is None, f"graph left open on thread {self.name}"
        return HostThread(self.name, tuple(self.instrs))


@dataclass
class RankBuilder:
    rank: int
    streams: tuple[str, ...]
    threads: list[ThreadBuilder] = field(default_factory=list)
    priorities: tuple[tuple[str, int], ...] = ()

    def thread(self, name: str) -> ThreadBuilder:
        tb = ThreadBuilder(name)
        self.threads.append(tb)
        return tb

    def build(self) -> RankProgram:
        return RankProgram(
            self.rank, self.streams, tuple(t.build() for t in self.threads), self.priorities
        )


def program(ranks: list[RankBuilder], world: int, symmetric: bool = True, **meta) -> Program:
    """The Program of ``ranks``; the keywords are the schedule's report (``ProgramMeta``)."""
    return Program(
        tuple(r.build() for r in ranks),
        world=world,
        symmetric=symmetric,
        meta=ProgramMeta.from_dict(meta),
    )
