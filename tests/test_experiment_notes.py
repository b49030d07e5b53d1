"""The committed experiment notes say what their data says: every number a note prints is one of
its results file's values (or of a string in it: the command, a preset's name) at the rounding
the note prints it with, possibly scaled to the unit printed (ms, %, K tokens), and each note
is, to the byte, its experiment's template over the committed results file. A hand-edited or
stale note fails here; regenerate with `python -m overlap_lab.experiments --out
experiments/results` (or `--draw` when only the notes changed)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from overlap_lab.experiments.runner import declared

RESULTS = Path(__file__).parents[1] / "experiments" / "results"
#: A number standing alone: not part of a word (EP32, H800, V3, mb0, 4K), a path or a version.
NUMBER = re.compile(r"(?<![\w./])(?:\d+\.\d+|\d+)(?![\w/]|\.\d)")
#: Units a note prints a value in: µs as is, ms, s, a fraction as %, tokens as K, GB/s and B.
SCALES = (1.0, 1e-3, 1e-6, 100.0, 1 / 1024, 1e-9, 1e3)


def numbers_in(text: str) -> list[tuple[float, int]]:
    """(value, decimals printed) of every standalone number of ``text``."""
    out = []
    for m in NUMBER.finditer(text):
        s = m.group(0)
        out.append((float(s), len(s.split(".", 1)[1]) if "." in s else 0))
    return out


def values_of(doc) -> set[float]:
    """Every number of a results file (keys included: a trace label, a size): values, and the
    numbers inside its strings."""
    out: set[float] = set()

    def walk(x) -> None:
        if isinstance(x, bool) or x is None:
            return
        if isinstance(x, (int, float)):
            if math.isfinite(x):
                out.add(abs(float(x)))
        elif isinstance(x, str):  # a command, a date, a label: every digit run in it
            out.update(float(m) for m in re.findall(r"\d+(?:\.\d+)?", x))
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(k)
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    # a commit hash's digit runs would match small numbers by chance (703 prints as 0.7 ms)
    walk({k: v for k, v in doc.items() if k not in ("traces", "commit")})
    return out


def printed_as(value: float, decimals: int, pool: set[float]) -> bool:
    """Whether some value of ``pool``, in some unit of :data:`SCALES`, prints as ``value`` at
    ``decimals`` decimals (half a unit of the last digit either way, for round-half-even)."""
    half = 0.5 * 10.0**-decimals * (1 + 1e-9)
    return any(abs(v * s - value) <= half for v in pool for s in SCALES)


def _notes() -> list[str]:
    return sorted(
        name
        for name, exp in declared().items()
        if exp.notes is not None and (RESULTS / f"{name}.md").is_file()
    )


def test_every_declared_experiment_writes_its_notes():
    """No notes file is hand-written: each experiment with a committed note generates it."""
    for name, exp in declared().items():
        if (RESULTS / f"{name}.md").is_file():
            assert exp.notes is not None, f"{name}.md has no notes function to generate it"


@pytest.mark.parametrize("name", _notes())
def test_the_notes_are_their_template_over_the_committed_json(name):
    """Each committed note is, to the byte, what its experiment's notes template makes of the
    committed results file (no simulation: the generator reads the file alone)."""
    doc = json.loads((RESULTS / f"{name}.json").read_text())
    assert declared()[name].notes(doc) == (RESULTS / f"{name}.md").read_text()


@pytest.mark.parametrize("name", _notes())
def test_every_number_in_the_notes_is_in_the_json(name):
    doc = json.loads((RESULTS / f"{name}.json").read_text())
    pool = values_of(doc)
    text = (RESULTS / f"{name}.md").read_text()
    missing = [
        f"{v:.{d}f}"
        for line in text.splitlines()
        for v, d in numbers_in(line)
        if not printed_as(v, d, pool)
    ]
    assert not missing, f"{name}.md prints numbers its JSON does not hold: {missing}"


def test_the_check_catches_a_wrong_number():
    doc = {"rows": [{"step_time_us": 55789.9, "change": 0.1032}]}
    pool = values_of(doc)
    assert printed_as(55.8, 1, pool) and printed_as(10, 0, pool)  # ms, %
    assert not printed_as(56.2, 1, pool) and not printed_as(11, 0, pool)
    assert [v for v, _ in numbers_in("EP32 on H800: 55.8 ms, 4K, -10 %, 49-52")] == [
        55.8,
        10.0,
        49.0,
        52.0,
    ]
