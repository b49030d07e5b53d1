"""Two kernels overlapped on one GPU: the simulator against measurements.

The data (``tests/data/interference_h200.txt``) were measured on an H200, 2026-11-26, by the
project's interference probe: each kernel alone, then every ordered pair on two streams,
launched as the probe launched them (B ``n_b`` times on one stream, then A 20 times on another).
Each pair is replayed here as a Program launched the same way, and each kernel's slowdown (its
per-call time beside the other over its time alone, both simulated) is compared with the
measured one. The model shares SMs (block scheduler, equal priorities first come, first served)
and HBM (water-fill); pairs it does not reproduce within 15 % are marked ``xfail(strict=True)``,
so a model change that reproduces one fails here until the mark is removed, and the attention
pairs are skipped (``ATTENTION_UNKNOWN``; docs/sm-sharing.md, "What is measured").
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from overlap_lab.shared.hardware import get_gpu
from overlap_lab.shared.program import parse
from overlap_lab.sim.engine import Engine
from tests.invariants import kernels_on

pytestmark = pytest.mark.slow  # 16 replays of up to ~1,100 launches each

DATA = Path(__file__).parent / "data" / "interference_h200.txt"
H200 = get_gpu("h200")
TOLERANCE = 0.15
#: A's calls per replay, as the probe made them (a smaller replay changes the slowdowns: B's
#: calls outlast A's, so B's average mixes time beside A with time alone).
CALLS = 20
#: The probe's kernels as ops: work from their shapes (BF16, 2 bytes per element).
KERNELS = {
    "gemm8192": f"flops={2 * 8192 * 4096 * 7168:.6g} "
    f"hbm_bytes={2 * (8192 * 7168 + 4096 * 7168 + 8192 * 4096):.6g} op_class=gemm dtype=bf16",
    "gemm128": f"flops={2 * 128 * 4096 * 7168:.6g} "
    f"hbm_bytes={2 * (128 * 7168 + 4096 * 7168 + 128 * 4096):.6g} op_class=gemm dtype=bf16",
    "copy": f"hbm_bytes={2 * 512 * 2**20:.6g} op_class=elementwise dtype=bf16",
    "attn": f"flops={2 * 128 * 128 * 2048 * (576 + 512):.6g} "
    f"hbm_bytes={2 * 128 * 2048 * (576 + 512):.6g} op_class=attention dtype=bf16",
}


def measured() -> tuple[dict[str, float], dict[tuple[str, str], tuple[float, float]]]:
    alone, pairs = {}, {}
    for line in DATA.read_text().splitlines():
        f = line.split()
        if f and f[0] == "alone":
            alone[f[1]] = float(f[2])
        elif f and f[0] == "pair":
            pairs[(f[1], f[2])] = (float(f[3]), float(f[4]))
    return alone, pairs


ALONE, PAIRS = measured()


def _per_call(text: str, stream: str) -> float:
    ks = kernels_on(Engine(parse(text), H200).run(), 0, f"stream:{stream}")
    return (ks[-1][2] - ks[0][1]) / len(ks)


@cache
def simulated_alone(k: str) -> float:
    body = "".join(f"    launch s {k}{i} {KERNELS[k]}\n" for i in range(CALLS))
    return _per_call("program world=1 symmetric=true\nrank 0 streams=s\n  thread t\n" + body, "s")


@cache
def simulated_pair(a: str, b: str) -> tuple[float, float]:
    """(A's, B's) slowdown beside each other, launched as the probe launched them."""
    nb = int(max(3, 40 * ALONE[a] / ALONE[b])) + 5
    text = (
        "program world=1 symmetric=true\nrank 0 streams=s1,s2\n  thread t\n"
        + "".join(f"    launch s2 b{i} {KERNELS[b]}\n" for i in range(nb))
        + "".join(f"    launch s1 a{i} {KERNELS[a]}\n" for i in range(CALLS))
    )
    return _per_call(text, "s1") / simulated_alone(a), _per_call(text, "s2") / simulated_alone(b)


#: Pairs the model reproduces within TOLERANCE today (the rest are expected to fail).
REPRODUCED = {
    ("gemm8192", "gemm8192"),
    ("gemm128", "gemm128"),
    ("copy", "gemm8192"),
    ("copy", "copy"),
}


#: Why the attention pairs are left out: the probe ran ``scaled_dot_product_attention`` with head
#: dims 576/512 on KV expanded from one head, and which backend PyTorch picked (and so the kernel's
#: work and grid, which decide how it shares the SMs) was not recorded. Its time alone, 616 µs, is
#: 4.4 times what its shapes' work takes at the roofline (140 µs), and no backend that reads the
#: expanded KV per head could reach it; a grid and work chosen to match the pairs would be fitted.
ATTENTION_UNKNOWN = "the probe's SDPA backend, and so its work and grid, is not known"


def _case(p: tuple[str, str]):
    if "attn" in p:
        return pytest.param(*p, marks=pytest.mark.skip(reason=ATTENTION_UNKNOWN))
    return p if p in REPRODUCED else pytest.param(*p, marks=pytest.mark.xfail(strict=True))


@pytest.mark.parametrize("a, b", [_case(p) for p in PAIRS])
def test_pair_slowdowns_match_the_measurement(a, b):
    got = simulated_pair(a, b)
    ta, tb = PAIRS[(a, b)]
    want = (ta / ALONE[a], tb / ALONE[b])
    for g, w in zip(got, want):
        assert abs(g / w - 1) <= TOLERANCE, (a, b, got, want)
