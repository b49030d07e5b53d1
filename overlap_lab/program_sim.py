"""A Program simulated as written: the text ``overlap-lab show`` prints, edited and run again.

:func:`simulate` builds a schedule's Program for a workload; :func:`simulate_program` takes the
Program itself (a :class:`~overlap_lab.shared.ir.program.Program`, or its text form read through
``shared.files``: a regular file under the input cap), validates it
(``shared.ir.validate``: a fault is one ``ProgramError`` naming the instruction) and simulates
it on a GPU with the same profile, cost model and network options as a schedule's run. What a
run reports that needs the workload (tokens, throughput, iterations, the schedule's own rules
for its window) is not available for a bare Program: :data:`NOT_AVAILABLE` lists it, and
:meth:`ProgramResult.as_dict` says so under ``not_available``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.ir.program import Program, num_ops, ops_of
from overlap_lab.shared.outputs.trace import Trace, no_gc

if TYPE_CHECKING:
    from overlap_lab.sim.models import CostModel, NetworkFactory

#: What ``sim`` reports of a schedule's run that a bare Program cannot say: each needs the
#: workload the Program was built for (tokens, layout) or its schedule's window rule.
NOT_AVAILABLE = (
    "iterations",
    "iteration_us",
    "tokens",
    "tokens_per_s_gpu",
    "tokens_per_s_node",
    "model",
    "mode",
    "batch",
    "ep",
    "pp",
)


@dataclass(frozen=True)
class ProgramResult:
    """One Program simulated as written (:func:`simulate_program`): the Program, the GPU, the
    Trace, and the profile and cost model its durations came from. ``source``: where the
    Program was read (a path; None: given as a record)."""

    program: Program
    gpu: GPU
    trace: Trace
    profile: Any = None
    cost_model: Any = None
    source: str | None = None

    @property
    def schedule(self) -> str:
        """The schedule the Program's meta names (``show`` prints it), else ``program``."""
        return self.program.meta.schedule or "program"

    @property
    def workload(self) -> None:
        """None: a bare Program carries no workload (what needs one: :data:`NOT_AVAILABLE`)."""
        return None

    def as_dict(self) -> dict[str, Any]:
        """``sim --program --json``'s object: the window, communication and SM time on the
        first rank, per-lane busy time, the op count and where durations came from, all over
        the whole simulated window (``*_window_us``: a Program has no iteration count)."""
        from overlap_lab.metrics import comm_us, sm_time
        from overlap_lab.sim.calibrate import cost_sources, profile_name

        t, p = self.trace, self.program
        rank = min(t.ranks, default=0)
        comp, comm, idle = sm_time(t, self.gpu.num_sms, rank)
        with no_gc():  # every rank's spans walked (see shared.outputs.trace.no_gc)
            busy = t.busy_us()
            return {
                "schedule": self.schedule,
                "program": self.source,
                "gpu": self.gpu.name,
                "world": p.world,
                "symmetric": p.symmetric,
                "window_us": t.step_time_us,
                "comm_window_us": comm_us(t, rank),
                "exposed_comm_window_us": t.exposed_comm_us(rank),
                "sm_compute": comp,
                "sm_comm": comm,
                "sm_idle": idle,
                "busy_window_us": busy,
                "num_ops": num_ops(p),
                "profile": profile_name(self.profile),
                "cost_sources": cost_sources(p, self.gpu, self.profile, self.cost_model),
                "not_available": list(NOT_AVAILABLE),
            }


def load_program(path: str | Path) -> Program:
    """The Program in the text file ``path`` (``Program``'s text form, as ``show`` prints it),
    read through ``shared.files`` (a regular file under the input cap); a malformed line is a
    ``ParseError`` naming the file and the line."""
    from overlap_lab.shared.files import read_text
    from overlap_lab.shared.ir.program import ParseError, parse

    text = read_text(path, "Program")
    try:
        return parse(text)
    except ParseError as e:
        raise ParseError(f"Program {path}: {e}") from None


def simulate_program(
    program: Program | str | Path,
    gpu: str | Path | GPU = "h800",
    *,
    profile: Any = "auto",
    max_events: int | None = None,
    cost_model: CostModel | str | None = None,
    network: NetworkFactory | str | None = None,
    fast_forward: bool = True,
) -> ProgramResult:
    """Validate ``program`` (a Program, or the path of its text form: :func:`load_program`) and
    simulate it on ``gpu``, as written: no schedule builds or lowers it. ``profile``,
    ``max_events``, ``cost_model``, ``network`` and ``fast_forward`` as for
    ``overlap_lab.api.simulate``. A Program the validator refuses is a ``ProgramError`` whose
    first line names the rank, thread and instruction."""
    from overlap_lab.api import gpu as gpu_of
    from overlap_lab.api import resolve_profile
    from overlap_lab.shared.errors import ConfigError
    from overlap_lab.sim import SimulationStalled
    from overlap_lab.sim import simulate as sim_run
    from overlap_lab.sim.models import check_model_names

    source = None
    if not isinstance(program, Program):
        source, program = str(program), load_program(program)
    g = gpu_of(gpu)
    check_model_names(cost_model, network)  # an unknown name fails before the run
    named = cost_model is None or isinstance(cost_model, str)  # built with the profile
    prof = resolve_profile(profile, g) if named else None
    try:
        trace = sim_run(
            program, g, profile=prof, max_events=max_events, cost_model=cost_model,
            network=network, fast_forward=fast_forward,
        )  # fmt: skip
    except SimulationStalled as e:  # validation should have refused it: one line all the same
        raise ConfigError(f"{e} (please report this Program)") from None
    result = ProgramResult(program, g, trace, prof, cost_model, source)
    with no_gc():  # op classes for the timeline's colours, as a schedule's run records them
        classes = {op.name: op.op_class for _, op in ops_of(program)}
    trace.meta.update(schedule=result.schedule, gpu=g.name, op_class=classes)
    return result
