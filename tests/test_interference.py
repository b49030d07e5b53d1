"""Two kernels overlapped on one GPU: the simulator against measurements.

The data (``tests/data/interference_h200.txt``) were measured on an H200, 2026-11-26, by the
project's interference probe: each kernel alone, then every ordered pair on two streams,
launched as the probe launched them (B ``n_b`` times on one stream, then A 20 times on another).
Each pair is replayed here as a Program launched the same way, and each kernel's slowdown (its
per-call time beside the other over its time alone, both simulated) is compared with the
measured one.

The replay is calibrated as a user's run is: a profile holds each kernel's measured time alone
(``--profile``'s rows, one per kernel), so the test judges how the model shares the GPU (block
scheduler, equal priorities first come, first served; HBM water-fill), not how well the roofline
guesses a kernel's time alone (it takes the decode-size GEMM for 15.1 µs, measured 22.7, which
alone put three pairs outside the tolerance). The attention kernel's grid is the one measured
(the data's ``grid`` line); the others take the model's. Pairs the model does not reproduce within
15 % are ``xfail(strict=True)``: a model change that reproduces one fails here until the mark goes.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from overlap_lab.real.interference import CALLS as PROBE_CALLS
from overlap_lab.real.interference import calls_beside
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.ir.program import parse
from overlap_lab.sim.cost import RooflineCostModel, solo_duration_us
from overlap_lab.sim.engine import Engine
from overlap_lab.sim.profile import from_json
from tests.invariants import kernels_on

pytestmark = pytest.mark.slow  # 16 replays of up to ~1,100 launches each

DATA = Path(__file__).parent / "data" / "interference_h200.txt"
H200 = get_gpu("h200")
TOLERANCE = 0.15
#: A's calls per replay, as the probe made them (a smaller replay changes the slowdowns: B's
#: calls outlast A's, so B's average mixes time beside A with time alone).
CALLS = PROBE_CALLS


def measured(
    path: Path = DATA,
) -> tuple[dict[str, float], dict[tuple[str, str], tuple[float, float]], dict]:
    """The data file's times alone, pairs and measured grids (the format
    ``python -m overlap_lab.experiments.gpu_interference`` writes)."""
    alone, pairs, grids = {}, {}, {}
    for line in path.read_text().splitlines():
        f = line.split()
        if f and f[0] == "alone":
            alone[f[1]] = float(f[2])
        elif f and f[0] == "pair":
            pairs[(f[1], f[2])] = (float(f[3]), float(f[4]))
        elif f and f[0] == "grid":
            grids[f[1]] = f" grid={f[2]} ctas={f[3]} ctas_per_sm={f[4]}"
    return alone, pairs, grids


ALONE, PAIRS, GRIDS = measured()
#: The probe's kernels as ops: work from their shapes (BF16, 2 bytes per element); ``tokens``
#: keys each to its profile row (the GEMMs' rows, the sequences of the decode attention).
KERNELS = {
    "gemm8192": f"flops={2 * 8192 * 4096 * 7168:.6g} "
    f"hbm_bytes={2 * (8192 * 7168 + 4096 * 7168 + 8192 * 4096):.6g} op_class=gemm dtype=bf16 "
    "tokens=8192",
    "gemm128": f"flops={2 * 128 * 4096 * 7168:.6g} "
    f"hbm_bytes={2 * (128 * 7168 + 4096 * 7168 + 128 * 4096):.6g} op_class=gemm dtype=bf16 "
    "tokens=128",
    "copy": f"hbm_bytes={2 * 512 * 2**20:.6g} op_class=elementwise dtype=bf16 tokens=1",
    "attn": f"flops={2 * 128 * 128 * 2048 * (576 + 512):.6g} "
    f"hbm_bytes={2 * 128 * 2048 * (576 + 512):.6g} op_class=attention dtype=bf16 tokens=128",
}
KERNELS = {k: v + GRIDS.get(k, "") for k, v in KERNELS.items()}
#: Each kernel's row: the class it is costed as, and its size (the op's ``tokens``).
ROWS = {"gemm8192": ("gemm", 8192), "gemm128": ("gemm", 128), "copy": ("elementwise", 1)}
ROWS["attn"] = ("attention", 128)


def _row(k: str) -> dict:
    op, size = ROWS[k]
    row = {"op": op, "dtype": "bf16", "size": size, "sms": H200.num_sms, "us": ALONE[k]}
    row["source"] = f"interference_h200.txt: alone {k}"
    if k in GRIDS:
        row["grid"] = GRIDS[k].split()[0].removeprefix("grid=")
    return row


PROFILE = from_json(
    {
        "format": "overlap-lab-profile/1",
        "device": "H200 SXM (132 SMs)",
        "date": "2026-11-26",
        "software": {"torch": "2.11.0+cu130"},
        "source": "tests/data/interference_h200.txt (the kernels alone)",
        "rows": [_row(k) for k in KERNELS],
    },
    "interference-h200",
)
COSTS = RooflineCostModel(PROFILE)
HEAD = "program world=1 symmetric=true\nrank 0 streams=s\n  thread t\n"


def _per_call(text: str, stream: str) -> float:
    ks = kernels_on(Engine(parse(text), H200, cost_model=COSTS).run(), 0, f"stream:{stream}")
    return (ks[-1][2] - ks[0][1]) / len(ks)


@cache
def simulated_alone(k: str) -> float:
    body = "".join(f"    launch s {k}{i} {KERNELS[k]}\n" for i in range(CALLS))
    return _per_call(HEAD + body, "s")


@cache
def simulated_pair(a: str, b: str) -> tuple[float, float]:
    """(A's, B's) slowdown beside each other, launched as the probe launched them."""
    nb = calls_beside(ALONE[a], ALONE[b])
    text = (
        "program world=1 symmetric=true\nrank 0 streams=s1,s2\n  thread t\n"
        + "".join(f"    launch s2 b{i} {KERNELS[b]}\n" for i in range(nb))
        + "".join(f"    launch s1 a{i} {KERNELS[a]}\n" for i in range(CALLS))
    )
    return _per_call(text, "s1") / simulated_alone(a), _per_call(text, "s2") / simulated_alone(b)


#: Pairs the model does not reproduce within TOLERANCE (docs/sm-sharing.md, "What is measured"):
#: the large GEMM runs 1.21x slower beside the decode-size GEMM, which itself barely progresses
#: beside it; the model gives the large GEMM its SMs back within one small call (1.00-1.03x).
NOT_REPRODUCED = {("gemm8192", "gemm128"), ("gemm128", "gemm8192")}


def _case(p: tuple[str, str]):
    return pytest.param(*p, marks=pytest.mark.xfail(strict=True)) if p in NOT_REPRODUCED else p


@pytest.mark.parametrize("k", list(KERNELS))
def test_each_kernel_alone_takes_its_measured_time(k):
    """The calibration holds: a kernel alone costs its measured time, and the replay of 20 calls
    alone gives it back (within 3 %: launch gaps and the attention's partial last wave)."""
    op = parse(f"{HEAD}    launch s x {KERNELS[k]}\n").ranks[0].threads[0].instrs[0].op
    assert solo_duration_us(op, H200, profile=PROFILE) == pytest.approx(ALONE[k], rel=1e-9)
    assert simulated_alone(k) == pytest.approx(ALONE[k], rel=0.03)


@pytest.mark.parametrize("a, b", [_case(p) for p in PAIRS])
def test_pair_slowdowns_match_the_measurement(a, b):
    got = simulated_pair(a, b)
    ta, tb = PAIRS[(a, b)]
    want = (ta / ALONE[a], tb / ALONE[b])
    for g, w in zip(got, want):
        assert abs(g / w - 1) <= TOLERANCE, (a, b, got, want)


def table() -> str:
    """docs/sm-sharing.md's table of the pairs: ``python -m tests.test_interference``."""
    rows = [
        "| pair (A beside B) | measured A, B | simulated A, B | within 15 % |",
        "|---|---|---|---|",
    ]
    for a, b in PAIRS:
        got = simulated_pair(a, b)
        want = (PAIRS[(a, b)][0] / ALONE[a], PAIRS[(a, b)][1] / ALONE[b])
        ok = [abs(g / w - 1) <= TOLERANCE for g, w in zip(got, want)]
        verdict = (
            "yes" if all(ok) else "no (" + ", ".join(n for n, o in zip("AB", ok) if not o) + ")"
        )
        rows.append(
            f"| {a}, {b} | {want[0]:.2f}, {want[1]:.2f} | {got[0]:.2f}, {got[1]:.2f} | {verdict} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
