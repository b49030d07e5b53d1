"""What one run's kernels did, as one object per run handed down explicitly (executor ->
KernelCtx -> ComputeBudget) rather than module globals cleared per run: two runs, or two
executors in one process, never see each other's counts."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunLog:
    """``gemms``: GEMM kernels by label (trace meta ``sm_budget_mechanisms``); ``notes``: what a
    kernel could not do as its op says on this backend, by op name (``kernel_notes``: never
    silently a no-op); ``kernels``: which kernel ran where a kernel has alternatives, by family
    and label (``attention_kernels``); ``launches``: see the field."""

    gemms: dict[str, int] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    kernels: dict[str, dict[str, int]] = field(default_factory=dict)
    #: host µs of each eager launch of an op on a GPU, by op name (``host_launch_us``): the
    #: executor's Python and every kernel launch of the op, without the profiler
    launches: dict[str, list[float]] = field(default_factory=dict)
    #: host µs of each ``graph.replay()`` (its ``cudaGraphLaunch``), by graph name
    #: (``graph_launch_host_us``): what the device waits on before a replay's first kernel
    graph_launches: dict[str, list[float]] = field(default_factory=dict)

    def count_gemm(self, label: str) -> None:
        self.gemms[label] = self.gemms.get(label, 0) + 1

    def note(self, op: str, text: str) -> None:
        self.notes.setdefault(op, text)

    def count_kernel(self, family: str, label: str) -> None:
        d = self.kernels.setdefault(family, {})
        d[label] = d.get(label, 0) + 1

    def launched(self, op: str, us: float) -> None:
        self.launches.setdefault(op, []).append(us)

    def graph_launched(self, graph: str, us: float) -> None:
        self.graph_launches.setdefault(graph, []).append(us)
