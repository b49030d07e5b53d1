"""CUDA graphs: how each ``Graph`` instruction is captured (pure; tested on the CPU).

The runner (``real.runner``) captures a Graph on its second run and replays it from then on;
this module only decides how: which stream captures, which streams fork and join, which waits
the capture skips, and whether the body must run op by op instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from overlap_lab.real.kernels.placeholders import NOOP_OPS
from overlap_lab.shared.ir.program import (
    Graph,
    Launch,
    Op,
    Record,
    Wait,
    WaitStream,
    iter_gpu_instrs,
)


@dataclass(frozen=True)
class GraphPlan:
    """How one ``Graph`` instruction is captured with torch.cuda.graph.

    ``capture_stream`` (the body's first stream) is the stream captured and replayed on; every
    other stream of the body forks from it (``wait_stream``) at the start of the capture and
    joins it at the end, so all of the body's work is one graph. Before capture and replay the
    capture stream waits for every body stream (work issued before the graph on any of them is
    ordered before it: conservative). Waits in the body on events not recorded earlier in the
    body (``skip_waits``, body indices) are satisfied by that join-in and skipped under capture
    (an event from outside a capture cannot be waited on inside it). After each replay the
    events recorded in the body (``exported_events``) are re-recorded on the capture stream, for
    waits after the graph. ``eager_reason``: why the body must run op by op instead (then None
    of the above is used)."""

    name: str
    capture_stream: str
    streams: tuple[str, ...]
    skip_waits: tuple[int, ...]
    exported_events: tuple[str, ...]
    eager_reason: str | None = None
    step: int = 0


def _streams_of(ins) -> tuple[str, ...]:
    if isinstance(ins, WaitStream):
        return (ins.stream, ins.other)
    return (ins.stream,)


def plan_graph(graph: Graph, before: list[Op] = (), others: list[Op] = ()) -> GraphPlan:
    """The capture plan of ``graph``. ``before``: ops launched before it by its own host thread
    in its step; ``others``: ops of its step launched by other threads. The graph is captured
    once and replayed, so the tensors it reads must be the same objects every run: kernels with
    no tensors (``real.kernels.placeholders.NOOP_OPS``) may precede it, anything else makes it
    run eagerly."""
    streams: list[str] = []
    recorded: set[str] = set()
    skip: list[int] = []
    for i, ins in enumerate(graph.body):
        for s in _streams_of(ins):
            if s not in streams:
                streams.append(s)
        if isinstance(ins, Record):
            recorded.add(ins.event)
        elif isinstance(ins, Wait) and ins.event not in recorded:
            skip.append(i)
    reason = None
    if not graph.body or not any(isinstance(i, Launch) for i in graph.body):
        reason = "empty body"
    feeders = sorted({op.name for op in (*before, *others) if op.name not in NOOP_OPS})
    if feeders:
        reason = (
            f"ops outside the graph in its step ({', '.join(feeders[:4])}) may feed it: "
            "inputs are not static"
        )
    ops = [i.op for i in graph.body if isinstance(i, Launch)]
    return GraphPlan(
        graph.name,
        streams[0] if streams else "main",
        tuple(streams),
        tuple(skip),
        tuple(sorted(recorded)),
        reason,
        (ops[0].step or 0) if ops else 0,
    )


def plan_graphs(rp) -> dict[int, GraphPlan]:
    """Plans of every Graph of a rank, keyed by ``id`` of the Graph instruction."""
    step_of = lambda op: op.step if op.step is not None else 0  # noqa: E731
    out: dict[int, GraphPlan] = {}
    for th in rp.threads:
        seen: list[Op] = []
        for ins in th.instrs:
            if isinstance(ins, Graph):
                ops = [i.op for i in ins.body if isinstance(i, Launch)]
                step = step_of(ops[0]) if ops else 0
                before = [op for op in seen if step_of(op) == step]
                others = [
                    i.op
                    for t2 in rp.threads
                    if t2 is not th
                    for i in iter_gpu_instrs(t2.instrs)
                    if isinstance(i, Launch) and step_of(i.op) == step
                ]
                out[id(ins)] = plan_graph(ins, before, others)
                seen.extend(ops)
            elif isinstance(ins, Launch):
                seen.append(ins.op)
    return out
