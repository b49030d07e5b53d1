"""What every schedule module shares: the knobs every schedule reads (:class:`CommonKnobs`), the
base of a module's own knobs (:class:`ScheduleKnobs`), ``comm_sms``'s declaration and GPU check,
and the record a module fills to say how its runs are drawn (:class:`Drawing`).

A schedule's own knobs are declared in its module (``Knobs``: a frozen dataclass of
:func:`~overlap_lab.shared.inputs.knobs.knob` fields, docs/schedules.md); a ``ScheduleConfig``
(``shared.schedules.config``) carries the values given for them by name, and the schedule reads
its record with ``cfg.of(Knobs)``, defaults and validation included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import GPU, HOST_COSTS, HostCosts
from overlap_lab.shared.inputs.knobs import knob, validate_all

DEEPEP_MODES = ("auto", "normal", "low_latency")
MAX_TOKENS = 1 << 20  # tokens of one batch or sequence a knob may name
MAX_SEQS = 1 << 16  # requests per GPU
MAX_ITERATIONS = 64  # scheduler iterations one window may simulate


class KnobValues(dict):
    """Schedule knobs given by name, in name order: a dict that cannot change, so a
    configuration holding it stays frozen and hashable (and JSON-writes as a mapping)."""

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(self.items()))

    def __reduce__(self):
        return (KnobValues, (tuple(self.items()),))

    def _refuse(self, *args: Any, **kw: Any) -> Any:
        raise TypeError("a ScheduleConfig's knobs do not change; use dataclasses.replace")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse


class ScheduleKnobs:
    """The base of a schedule module's ``Knobs``: a frozen dataclass of
    :func:`~overlap_lab.shared.inputs.knobs.knob` fields whose values are checked as each knob
    declares them (a list given for a tuple knob is stored as a tuple)."""

    def __post_init__(self) -> None:
        validate_all(self)


@dataclass(frozen=True)
class CommonKnobs(ScheduleKnobs):
    """The knobs every schedule reads (a :class:`~overlap_lab.shared.schedules.config.
    ScheduleConfig` holds them as fields, beside each schedule's own). None means "the system's
    own default" (taken from upstream or the hardware preset)."""

    deepep_mode: str = knob(
        "auto",
        "auto: low_latency for decode, normal for prefill (SGLang)",
        choices=DEEPEP_MODES,
        tune=("low_latency", "normal"),
    )
    cuda_graph: bool | None = knob(None, "None: decode uses CUDA graphs, prefill does not")
    host: HostCosts = knob(HOST_COSTS, "host (CPU) costs of the scheduler loop", unit="µs")

    def resolved_deepep_mode(self, mode: str) -> str:
        """SGLang's `auto`: low-latency kernels for decode, normal kernels for prefill."""
        if self.deepep_mode != "auto":
            return self.deepep_mode
        return "low_latency" if mode == "decode" else "normal"

    def use_cuda_graph(self, mode: str) -> bool:
        return self.cuda_graph if self.cuda_graph is not None else mode == "decode"


def comm_sms_knob(help: str, *, least: int = 1, tune: tuple[int, ...] = ()) -> Any:
    """The ``comm_sms`` knob of a schedule that gives communication kernels their own SMs:
    one option (``--comm-sms``) whose meaning each schedule declares (``help``); ``least`` is 0
    where zero SMs means "no SM partition" (vllm-dbo), else 1. The GPU bounds it from above
    (:func:`resolve_comm_sms`). ``tune``: the SM counts a deployment search tries besides the
    default."""
    return knob(None, help, unit="SMs", lo=least, hi=1023, tune=tune)


def resolve_comm_sms(value: int | None, gpu: GPU, *, default: int, least: int = 1) -> int:
    """``--comm-sms`` (``value``) or the schedule's own ``default``, checked against the GPU:
    the one check of the knob beyond its range, for every schedule that declares it.
    ``least`` is 0 where zero SMs means "no SM partition" (vllm-dbo), else 1."""
    n = default if value is None else value
    if not least <= n < gpu.num_sms:
        raise ConfigError(
            f"comm_sms must lie in {least}..{gpu.num_sms - 1} on {gpu.name}, got {n}",
            names=("comm_sms",),
        )
    return n


@dataclass(frozen=True)
class Drawing:
    """How the figures draw a schedule's trace (``overlap_lab.figures``), declared in its module
    as ``DRAWING``. ``whole_window``: ``--window auto`` shows the whole simulated window rather
    than two MoE layers (the schedule's point lies across iterations or ranks);
    ``every_rank``: a timeline without ``--rank`` draws one panel per rank (a pipeline's
    bubbles are across its stages), else rank 0."""

    whole_window: bool = False
    every_rank: bool = False


#: How a schedule's trace is drawn when its module declares nothing (and for traces read from
#: files whose schedule is not registered).
DEFAULT_DRAWING = Drawing()
