"""Predicted against measured: a measured trace of a Program against the simulator's run of the
same Program with a profile, op by op.

    v, predicted, profile = validate(measured, program, gpu)              # profile from the trace
    v, predicted, profile = validate(measured, program, gpu, profile=p)  # a given profile

The profile defaults to the one the measured trace itself yields (``sim.calibrate``): then every
compute op's solo duration is the measured one and what remains, the error, is what the
simulator adds: how kernels share the GPU, the link model's communication, the host. Ops align by
(rank, op, layer, micro-batch, step); an op's time is the sum of its kernels' spans. ``predict``
runs another schedule of the same workload with that profile ("would TBO pay on my GPU?").

Library functions for ``overlap-lab validate`` and the real executor; figures are drawn by
:mod:`overlap_lab.figures` (imported lazily).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.ir.program import Program
from overlap_lab.shared.outputs.trace import Trace
from overlap_lab.sim.calibrate import OpKey, measured_ops, profile_from_trace
from overlap_lab.sim.profile import Profile


def rel_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured; 0 when both are 0, inf when only measured is."""
    if measured == 0:
        return 0.0 if predicted == 0 else float("inf")
    return predicted / measured - 1.0


@dataclass(frozen=True)
class OpError:
    key: OpKey  # rank, op, layer, mb, step
    measured_us: float
    predicted_us: float

    @property
    def error(self) -> float:
        return rel_error(self.predicted_us, self.measured_us)


@dataclass(frozen=True)
class Validation:
    measured_step_us: float
    predicted_step_us: float
    measured_exposed_us: float
    predicted_exposed_us: float
    ops: tuple[OpError, ...]
    only_measured: int  # ops found in one trace and not in the other
    only_predicted: int

    @property
    def step_error(self) -> float:
        return rel_error(self.predicted_step_us, self.measured_step_us)

    @property
    def exposed_error_us(self) -> float:
        """Exposed communication is often ~0: its error is reported in µs, not relative."""
        return self.predicted_exposed_us - self.measured_exposed_us

    @property
    def max_op_error(self) -> float:
        return max((abs(o.error) for o in self.ops), default=0.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "step_time_us": {"measured": self.measured_step_us, "predicted": self.predicted_step_us,
                             "error": self.step_error},
            "exposed_comm_us": {"measured": self.measured_exposed_us,
                                "predicted": self.predicted_exposed_us,
                                "error_us": self.exposed_error_us},
            "max_abs_op_error": self.max_op_error,
            "only_measured": self.only_measured,
            "only_predicted": self.only_predicted,
            "ops": [{"rank": o.key[0], "op": o.key[1], "layer": o.key[2], "mb": o.key[3],
                     "step": o.key[4], "measured_us": o.measured_us,
                     "predicted_us": o.predicted_us, "error": o.error} for o in self.ops],
        }  # fmt: skip


def compare(measured: Trace, predicted: Trace) -> Validation:
    """Step time, exposed communication (of each trace's first rank) and every op's time."""
    if not measured.spans:
        raise ConfigError("the measured trace has no spans")
    m, p = measured_ops(measured), measured_ops(predicted)
    if len(measured.ranks) == 1 and len(predicted.ranks) == 1:
        # one rank each (a symmetric Program; a profiler trace keeps its own rank number)
        r = predicted.ranks[0]
        m = {(r, *k[1:]): v for k, v in m.items()}
    ops = tuple(OpError(k, m[k].us, p[k].us) for k in sorted(m, key=_sort_key) if k in p)
    r_m = measured.ranks[0]
    r_p = predicted.ranks[0] if predicted.ranks else 0
    return Validation(
        measured.step_time_us,
        predicted.step_time_us,
        measured.exposed_comm_us(r_m),
        predicted.exposed_comm_us(r_p),
        ops,
        sum(1 for k in m if k not in p),
        sum(1 for k in p if k not in m),
    )


def _sort_key(k: OpKey) -> tuple:
    return tuple((x is None, x if x is not None else 0) for x in k)


def validate(
    measured: Trace, program: Program, gpu: GPU, profile: Profile | None = None, seed: int = 0
) -> tuple[Validation, Trace, Profile]:
    """Simulate ``program`` with ``profile`` (default: the one ``measured`` yields) and compare."""
    from overlap_lab.sim import simulate

    if profile is None:
        profile = profile_from_trace(
            measured, program, num_sms=gpu.num_sms, name="from-measured-trace",
            source="the measured trace under validation",
        )  # fmt: skip
    predicted = simulate(program, gpu, seed=seed, profile=profile)
    return compare(measured, predicted), predicted, profile


def predict(program: Program, gpu: GPU, profile: Profile, seed: int = 0) -> Trace:
    """Another schedule's trace from a measured profile (the "what if" of ``validate``)."""
    from overlap_lab.sim import simulate

    return simulate(program, gpu, seed=seed, profile=profile)


def to_text(v: Validation, top: int = 15, what_if: Mapping[str, Any] | None = None) -> str:
    """``validate``'s table: the step and exposed communication measured against predicted,
    then the ``top`` ops with the largest error, and :func:`what_if`'s answer when given."""
    lines = [
        f"{'':<24}{'measured':>12}{'predicted':>12}{'error':>10}",
        f"{'step time (µs)':<24}{v.measured_step_us:>12.1f}{v.predicted_step_us:>12.1f}"
        f"{v.step_error:>+10.2%}",
        f"{'exposed comm (µs)':<24}{v.measured_exposed_us:>12.1f}{v.predicted_exposed_us:>12.1f}"
        f"{v.exposed_error_us:>+9.1f}µs",
        "",
        f"{len(v.ops)} ops aligned by (rank, op, layer, micro-batch, step); "
        f"{v.only_measured} only measured, {v.only_predicted} only predicted; "
        f"largest |error| {v.max_op_error:.2%}",
    ]
    worst = sorted(v.ops, key=lambda o: -abs(o.error))[:top]
    if worst:
        lines += ["", f"{'rank':>4} {'op':<24}{'layer':>6}{'mb':>4}{'measured':>11}"
                  f"{'predicted':>11}{'error':>9}"]  # fmt: skip
        for o in worst:
            r, op, layer, mb, _ = o.key
            lines.append(
                f"{r:>4} {op:<24}{'' if layer is None else layer:>6}{'' if mb is None else mb:>4}"
                f"{o.measured_us:>11.1f}{o.predicted_us:>11.1f}{o.error:>+9.2%}"
            )
    if what_if is not None:
        lines += ["", f"what if {what_if['schedule']}: predicted step "
                  f"{what_if['predicted_step_time_us']:.1f} µs, speed-up "
                  f"{what_if['speedup_vs_measured']:.3f} over the measured step"]  # fmt: skip
    return "\n".join(lines) + "\n"


def figure(measured: Trace, predicted: Trace, path: str | Path, extra: dict | None = None) -> Path:
    """The measured and predicted timelines one above the other (and any ``extra`` ones)."""
    from overlap_lab.figures import compare_timelines

    traces = {"measured": measured, "predicted": predicted, **(extra or {})}
    compare_timelines(traces, path)
    return Path(path)


def what_if(schedule: str, trace: Trace, measured: Trace, predicted: Trace) -> dict[str, Any]:
    """``validate --predict``'s answer: ``schedule``'s predicted step (``trace``, from the
    measured trace's profile) and its speed-up over the measured step and over the prediction
    of the schedule that ran."""
    return {
        "schedule": schedule,
        "predicted_step_time_us": trace.step_time_us,
        "speedup_vs_measured": measured.step_time_us / trace.step_time_us,
        "speedup_vs_predicted": predicted.step_time_us / trace.step_time_us,
    }


def load_measured(
    path: str | Path, mapping_path: str | None = None, program: Program | None = None
) -> Trace:
    """A measured trace (ours, or torch.profiler's); with a kernel mapping (``--map``) its
    kernels are labelled with ``program``'s ops (a foreign trace's)."""
    from overlap_lab.shared.ir.program import first_rank_ops
    from overlap_lab.shared.outputs.analyze import label_ops, load_mapping

    trace = Trace.from_chrome(path)
    if mapping_path is not None and program is not None:
        trace = label_ops(trace, load_mapping(mapping_path), first_rank_ops(program))
    return trace
