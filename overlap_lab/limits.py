"""The range of every numeric input of a run, as the knob records that check them.

The schedule knobs, host costs and GPU fields declare their ranges where the field is (their
knob records: ``shared.inputs.knobs``); the workload's parameters (``api.workload``: batch,
lengths, layout) and the real executor's (``run``: warm-up, repeats, tolerance) are no
configuration's field, so their ranges are declared here, as the same records
(:func:`Limit`). The command line checks every option against :data:`LIMITS`
(``cli.inputs.apply_limits``), names and units as the record says them; the API checks the
values it is given against the same records (:func:`check_values`: ``api.workload``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import gpu_fields, host_cost_fields
from overlap_lab.shared.inputs.knobs import Knob
from overlap_lab.shared.schedules import schedule_knobs
from overlap_lab.shared.schedules.common import MAX_SEQS, MAX_TOKENS


def Limit(kind: type, lo: float, hi: float, *, is_list: bool = False, **kw: Any) -> Knob:
    """The range of an option that is no configuration's field (the workload's, ``run``'s), as
    the knob record every option is checked by (``Knob.refusal``), the API's fields too."""
    tp = tuple[kind, ...] if is_list else kind  # type: ignore[valid-type]
    return Knob("", tp, None, "", lo=lo, hi=hi, **kw)


def record_limits() -> dict[str, Knob]:
    """The knob records of the schedule knobs, host costs (``host_`` options) and GPU fields
    with a range, declared once where the field is (the API checks the same records)."""
    out = {}
    for prefix, records in (
        ("", schedule_knobs()),
        ("host_", host_cost_fields()),
        ("", gpu_fields()),
    ):
        for k in records:
            if k.scalar in (int, float) and k.lo is not None and k.hi is not None:
                out[prefix + k.name] = k
    return out


_I, _F = int, float
#: Option destination -> the record of its range: the workload's and ``run``'s here, every
#: knob's its own. Hardware ranges bracket every real device with a wide margin and keep
#: simulated times far from floating-point trouble.
LIMITS: dict[str, Knob] = {
    # workload and parallelism
    "batch": Limit(_I, 1, MAX_SEQS),
    "kv_len": Limit(_I, 1, MAX_TOKENS),
    "kv_lens": Limit(_I, 1, MAX_TOKENS, is_list=True),
    "tokens_per_seq": Limit(_I, 1, 64),
    "extend_len": Limit(_I, 1, MAX_TOKENS),
    "extend_lens": Limit(_I, 1, MAX_TOKENS, is_list=True),
    "prefix_len": Limit(_I, 0, MAX_TOKENS),
    "prefix_lens": Limit(_I, 0, MAX_TOKENS, is_list=True),
    "layers": Limit(_I, 1, 1000),
    "mtp": Limit(_I, 0, 8, unit="draft steps"),
    "ep": Limit(_I, 1, 1024),
    "gpus_per_node": Limit(_I, 1, 72),
    "attn_tp": Limit(_I, 1, 1024),
    "pp_size": Limit(_I, 1, 16),
    "seed": Limit(_I, 0, 2**32 - 1),
    "dp_imbalance": Limit(_F, 0, 1, unit="(1 excluded)", check=lambda v, _: _below_one(v)),
    "max_events": Limit(_I, 1, 10**10),
    # `run`
    "warmup": Limit(_I, 0, 1000),
    "repeats": Limit(_I, 1, 10000),
    "tolerance": Limit(_F, 1e-12, 1),
}
LIMITS.update(record_limits())
#: `run` (CPU equivalence check and GPU) sizes: the real executor allocates them.
RUN_LIMITS = {"batch": 4096, "ranks": 16}


def _below_one(v: float) -> str | None:
    return f"must be below 1, got {v!r}" if v >= 1 else None


def check_values(values: Mapping[str, Any], records: Mapping[str, str] | None = None) -> None:
    """Refuse a value outside its :data:`LIMITS` range, in the words an option's refusal uses
    (``batch must be an integer in 1..65536, got 0``): what the API checks that the command
    line's options check before it. ``values``: parameter -> value (None: not given; a list is
    read as the tuple a list option gives); ``records``: a parameter whose range is another
    option's (the API's ``pp`` is ``--pp-size``)."""
    for name, v in values.items():
        if v is None:
            continue
        lim = LIMITS[(records or {}).get(name, name)]
        why = lim.refusal(tuple(v) if lim.is_tuple and isinstance(v, list) else v)
        if why:
            raise ConfigError(f"{name} {why}", names=(name,))
