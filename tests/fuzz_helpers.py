"""Shared settings of the fuzz suites: case counts from OVERLAP_LAB_FUZZ_EXAMPLES, derandomised.

``OVERLAP_LAB_FUZZ_EXAMPLES=N`` multiplies every fuzz test's default case count by N / 1000
(so N is the Program-mutation suite's count); ``OVERLAP_LAB_FUZZ_RANDOM=1`` draws new cases
each run instead of the fixed, reproducible ones CI runs.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

#: The Program-mutation suite's case count in CI; the other suites are scaled from it.
BASE = 1000


def fuzz_settings(default: int):
    """Hypothesis settings for ``default`` cases (scaled by OVERLAP_LAB_FUZZ_EXAMPLES)."""
    scale = int(os.environ.get("OVERLAP_LAB_FUZZ_EXAMPLES", BASE)) / BASE
    return settings(
        max_examples=max(1, round(default * scale)),
        deadline=None,
        database=None,
        derandomize=os.environ.get("OVERLAP_LAB_FUZZ_RANDOM") != "1",
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )
