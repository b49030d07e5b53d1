"""The SimPy interpreter of Programs (never imports torch)."""

from overlap_lab.sim.engine import SimulationStalled, simulate

__all__ = ["SimulationStalled", "simulate"]
