"""CLI, experiment runner, figures."""
