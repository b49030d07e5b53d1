"""``ProgramMeta``: what a schedule reports about the Program it built.

The report is read by the metrics, the real executor, the experiments and the Program's text
form. What several schedules (or the explicit-rank lowering) report alike is a typed field; what
only one schedule family reports stays in ``extra`` under the schedule's own key.

The text form writes ``as_dict()`` as sorted JSON and ``parse`` reads it back with ``from_dict``;
traces copy ``as_dict()`` into their own meta. ``as_dict`` gives the keys back in the order the
schedule reported them, with the values it reported (``None`` included), so both stay byte for
byte what they were when the report was a plain dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, get_args, get_origin, get_type_hints

#: A JSON value as the schedule reported it (the text form writes it with ``json.dumps``).
Json = Any


@dataclass(frozen=True)
class ProgramMeta:
    """A schedule's report on its Program. A field the schedule did not report reads ``None``
    (``reported`` tells it apart from a reported ``None``)."""

    #: The schedule's registry name (``"tbo"``, ``"sglang-overlap"``, ...).
    schedule: str | None = None
    #: One ``MicroBatch.as_meta()`` row per micro-batch, in index order (sglang-overlap adds
    #: each row's ``step``): the token and sequence ranges the explicit-rank lowering and the
    #: real executor cut the batch by.
    micro_batches: list[dict[str, Json]] | None = None
    #: The DeepEP kernels the batch uses (``"normal"``, ``"low_latency"``; sglang-overlap reports
    #: its setting ``"auto"`` and each iteration's resolution in ``extra["iterations"]``).
    deepep_mode: str | None = None
    #: Whether the forward is one captured CUDA graph replay.
    cuda_graph: bool | None = None
    #: Why the schedule ran the batch unsplit (the upstream refusal, in words).
    fallback_reason: str | None = None
    #: SMs given to communication kernels, where the schedule partitions the GPU.
    comm_sms: int | None = None
    #: SMs left to computation beside ``comm_sms``.
    compute_sms: int | None = None
    #: Pipeline stages (the pp schedule): the real executor refuses to time a pipeline in-process.
    pp_size: int | None = None
    #: SBO's mode (SGLANG_SBO_MODE, 1-3) under sbo and tbo+sbo.
    sbo_mode: int | None = None
    #: The comm<->compute pairs SBO overlaps in this Program (``"combine<->down_gemm"``, ...).
    sbo_overlaps: list[str] | None = None
    #: Whether SGLang itself runs this SBO mode on this architecture (otherwise a what-if).
    sbo_upstream: bool | None = None
    #: Down-GEMM signals per combine: one count (sbo) or one per micro-batch (tbo+sbo).
    sbo_signals: int | list[int] | None = None
    #: Why SBO is off although asked for (tbo+sbo on DeepEP's normal kernels or unsplit).
    sbo_inactive_reason: str | None = None
    #: Tokens of each DP rank (vllm-dbo's all-reduce input; the explicit-rank lowering's draw).
    dp_tokens: list[int] | None = None
    #: ``"explicit"`` once ``shared.ir.ranks.expand_ranks`` lowered the Program to every rank.
    ranks: str | None = None
    #: The routing imbalance the explicit ranks were drawn under.
    imbalance: str | None = None
    #: The routing draw's seed for the explicit ranks.
    routing_seed: int | None = None
    #: What only one schedule family reports (tbo's ``strategy``, sglang-overlap's ``loop``,
    #: ``overlap`` and per-iteration ``iterations``, pp's iteration count ``iterations``, ...).
    extra: Mapping[str, Json] = field(default_factory=dict)
    #: The reported keys in the order they were reported: ``as_dict`` keeps it so traces (whose
    #: Chrome JSON keeps key order) stay byte-identical. Not part of equality, as for a dict.
    order: tuple[str, ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Json]) -> ProgramMeta:
        """The record of a report given as a dict (a schedule's keywords, parsed JSON)."""
        typed = {k: v for k, v in d.items() if k in _FIELDS}
        extra = {k: v for k, v in d.items() if k not in _FIELDS}
        return cls(**typed, extra=extra, order=tuple(d))

    def __post_init__(self) -> None:
        if not self.order:  # built field by field: the fields set, then extra, are the report
            keys = [f for f in _FIELD_ORDER if getattr(self, f) is not None] + list(self.extra)
            object.__setattr__(self, "order", tuple(keys))

    def as_dict(self) -> dict[str, Json]:
        """The report as the dict it was given as, key for key and in order."""
        extra = self.extra
        return {k: extra[k] if k in extra else getattr(self, k) for k in self.order}

    def reported(self, key: str) -> bool:
        """Whether the schedule reported ``key`` (a field or an ``extra`` key)."""
        return key in self.order

    def merged(self, **changes: Json) -> ProgramMeta:
        """This report with ``changes`` added or replacing earlier values (``dict.update``)."""
        return ProgramMeta.from_dict({**self.as_dict(), **changes})

    def fault(self) -> str | None:
        """Why this record is no report a Program can carry (a field of the wrong type, an
        ``extra`` key that shadows a field, an ``order`` that is not the reported keys), or
        None."""
        if not isinstance(self.extra, Mapping):
            return f"extra must be a mapping, got {type(self.extra).__name__}"
        if clash := _FIELDS.intersection(self.extra):
            return f"extra repeats the field(s) {sorted(clash)}"
        have = {f for f in _FIELD_ORDER if getattr(self, f) is not None} | set(self.extra)
        if not have <= set(self.order) <= have | _FIELDS:
            return f"order {list(self.order)} is not the reported keys {sorted(have)}"
        for name, kinds in _KINDS.items():
            v = getattr(self, name)
            if v is not None and not isinstance(v, kinds):
                return f"{name} must be {' or '.join(k.__name__ for k in kinds)}, got {v!r}"
        return None

    def __bool__(self) -> bool:
        """Whether anything was reported (the text form writes no ``meta`` line otherwise)."""
        return bool(self.order)


_FIELD_ORDER = tuple(f.name for f in fields(ProgramMeta) if f.name not in ("extra", "order"))
_FIELDS = frozenset(_FIELD_ORDER)
#: Each field's types as its annotation names them (``None``, "not reported", left out).
_KINDS = {
    name: tuple(get_origin(a) or a for a in get_args(hint) if a is not type(None))
    for name, hint in get_type_hints(ProgramMeta).items()
    if name in _FIELDS
}
