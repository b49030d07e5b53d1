"""Run a test file's Triton checks in a child process under Triton's CPU interpreter.

TRITON_INTERPRET=1 must be set before ``import triton`` (triton.language's own helpers are @jit
functions decorated at import), so the test file runs itself once as a script in a child and
prints its results as one JSON line, which the tests read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def interpreted(test_file: str) -> dict:
    """The JSON the script ``test_file`` prints last, run under the interpreter (skips without
    triton)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, test_file], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def report(checks: dict) -> None:
    """The child's side: run each named check and print one JSON line, ``"ok"`` or the error
    per check, for :func:`interpreted` to return to the parent test, which names the check."""
    out = {}
    for name, fn in checks.items():
        try:
            fn()
            out[name] = "ok"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    print(json.dumps(out))
