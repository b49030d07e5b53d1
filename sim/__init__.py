"""The SimPy interpreter of Programs (never imports torch)."""

from sim.engine import SimulationStalled, simulate

__all__ = ["SimulationStalled", "simulate"]
