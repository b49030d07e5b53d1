"""Stages and the two-micro-batch interleaver of SGLang's TBO (``batch_overlap/operations.py``).

A strategy is a flat list of operations with ``YIELD`` separators; the stages are the chunks
between separators (``_convert_operations_to_stages``). Upstream concatenates the operations of
every sparse layer before chunking (``OperationsStrategy.concat``), so when a layer's list does not
end with a separator its last stage merges with the next layer's first stage; that is kept here by
chunking the concatenated list, never layer by layer.

``interleave`` is ``execute_overlapped_operations``: micro-batch A runs ``delta`` stages alone,
then A and B alternate one stage each, then B runs its last ``delta`` stages. Items are opaque, so
the same function serves plain TBO and TBO+SBO (whose items carry SBO's two-stream lowering).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeVar

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.ir.builder import ThreadBuilder
from overlap_lab.shared.ir.program import GpuInstr, Launch, Op, Record, Wait, WaitStream

T = TypeVar("T")


class _Yield:
    """The separator between stages (SGLang's ``YieldOperation``)."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "YIELD"


YIELD = _Yield()


def to_stages(operations: Sequence[T | _Yield]) -> list[list[T]]:
    """Chunk by ``YIELD``; a trailing separator adds no empty stage, an empty stage is an error."""
    stages: list[list[T]] = []
    pending: list[T] = []
    for op in operations:
        if op is YIELD:
            stages.append(pending)
            pending = []
        else:
            pending.append(op)
    if pending:
        stages.append(pending)
    if any(not s for s in stages):
        raise ConfigError("a TBO strategy has an empty stage (two YIELDs in a row)")
    return stages


def interleave(
    stages_a: Sequence[Sequence[T]], stages_b: Sequence[Sequence[T]], delta: int
) -> list[tuple[int, Sequence[T]]]:
    """The order in which the two executors run their stages: (micro-batch 0|1, stage) pairs."""
    if len(stages_a) != len(stages_b):
        raise ConfigError(f"micro-batches have {len(stages_a)} and {len(stages_b)} stages")
    if not 0 <= delta <= len(stages_a):
        raise ConfigError(f"delta_stages={delta} must lie in 0..{len(stages_a)} stages")
    order: list[tuple[int, Sequence[T]]] = []
    a, b = iter(stages_a), iter(stages_b)
    for _ in range(delta):  # A runs ahead alone
        order.append((0, next(a)))
    for _ in range(len(stages_a) - delta):  # then one stage each, A first
        order.append((0, next(a)))
        order.append((1, next(b)))
    for _ in range(delta):  # B finishes
        order.append((1, next(b)))
    return order


# ----------------------------------------------------------------------------------------------
# Emission: what SBO and TBO share around their layers (the same frame as serial.build)
# ----------------------------------------------------------------------------------------------


def emit(t: ThreadBuilder, instrs: Iterable[GpuInstr]) -> None:
    """Append GPU-side instructions (launch / record / wait / wait_stream) to a host thread."""
    for ins in instrs:
        if isinstance(ins, Launch):
            t.launch(ins.op, ins.stream)
        elif isinstance(ins, Record):
            t.record(ins.event, ins.stream)
        elif isinstance(ins, Wait):
            t.wait(ins.stream, ins.event)
        elif isinstance(ins, WaitStream):
            t.wait_stream(ins.stream, ins.other)
        else:
            raise TypeError(f"not a GPU instruction: {ins!r}")


def launches(ops: Iterable[Op], stream: str = "main") -> list[Launch]:
    return [Launch(op, stream) for op in ops]
