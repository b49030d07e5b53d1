"""Kernels side by side on one GPU: each alone, then every ordered pair on two streams.

Why: the simulator shares a GPU among concurrent kernels by rules (block scheduler, HBM
water-fill) that the pairs test (``tests/test_interference.py``, docs/sm-sharing.md). Two pairs
measured on an H200 are not reproduced, and the times alone cannot tell why: a large kernel
runs 1.21x slower beside a stream of decode-size GEMMs that barely progress beside it. This
probe measures the pairs as the test replays them and, for each pair, records every kernel
the profiler saw (name, stream, start, end, grid, block, shared memory, registers), so the next
run says which kernels ran, with which grids, and how the two streams' kernels interleaved.

Protocol (the test's): B is issued ``n_b = max(3, 40 * alone_A / alone_B) + 5`` times on one
stream, then A :data:`CALLS` times on another, right after; per-call time of each is its first
call's start to its last call's end over its calls (CUDA events). ``device="cpu"`` runs the same
code on tiny shapes, one call after another: a dry run whose numbers mean nothing.
"""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CALLS = 20
WARMUP = 3


@dataclass(frozen=True)
class Shapes:
    """The probe's four kernels: a large GEMM (``big`` x ``k`` by ``n`` x ``k``), a decode-size
    one (``small`` rows), a ``copy_mib`` MiB device copy, and a decode attention (``seqs``
    sequences x ``heads`` heads, ``kv`` cached tokens, head dims 576 / 512, KV expanded from one
    head, as the project's decode attention calls SDPA, without its all-true mask)."""

    big: int = 8192
    small: int = 128
    k: int = 7168
    n: int = 4096
    copy_mib: int = 512
    seqs: int = 128
    heads: int = 128
    kv: int = 2048
    dk: int = 576
    dv: int = 512


SHAPES = {
    "cuda": Shapes(),
    "cpu": Shapes(big=64, small=8, k=64, n=32, copy_mib=1, seqs=2, heads=2, kv=16, dk=24, dv=16),
}


def kernels(device: str, seed: int = 0) -> dict[str, Callable[[], Any]]:
    """The four calls, inputs made (seeded), named as the test's data names them."""
    import torch
    import torch.nn.functional as F

    dev = torch.device(device)
    s = SHAPES["cuda" if dev.type == "cuda" else "cpu"]
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dev, dt)

    a, w, small = rnd(s.big, s.k), rnd(s.n, s.k), rnd(s.small, s.k)
    x = torch.empty(s.copy_mib * 2**20, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    q, kv = rnd(s.seqs, s.heads, 1, s.dk), rnd(s.seqs, 1, s.kv, s.dk)
    k_all = kv.expand(s.seqs, s.heads, s.kv, s.dk)
    v_all = kv[..., : s.dv].expand(s.seqs, s.heads, s.kv, s.dv)
    return {
        "gemm8192": lambda: a @ w.t(),
        "gemm128": lambda: small @ w.t(),
        "copy": lambda: y.copy_(x),
        "attn": lambda: F.scaled_dot_product_attention(q, k_all, v_all),
    }


class _Clock:
    """Per-call time of calls issued on a stream: CUDA events on a GPU, the host clock on CPU."""

    def __init__(self, device: torch.device):
        import torch

        self.torch = torch
        self.cuda = device.type == "cuda"

    def stream(self) -> Any:
        return self.torch.cuda.Stream() if self.cuda else None

    def issue(self, fn: Callable[[], Any], n: int, stream: Any) -> Callable[[], float]:
        """Issue ``fn`` ``n`` times on ``stream``; the returned call gives µs per call (after a
        synchronize)."""
        if not self.cuda:
            t = time.perf_counter()
            for _ in range(n):
                fn()
            us = (time.perf_counter() - t) * 1e6 / n
            return lambda: us
        cuda = self.torch.cuda
        start = cuda.Event(enable_timing=True)
        end = cuda.Event(enable_timing=True)
        with cuda.stream(stream):
            start.record(stream)
            for _ in range(n):
                fn()
            end.record(stream)
        return lambda: start.elapsed_time(end) * 1e3 / n

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()


def calls_beside(alone_a: float, alone_b: float) -> int:
    """B's calls for a pair: enough to outlast A's :data:`CALLS` (the probe's rule)."""
    return int(max(3, 40 * alone_a / alone_b)) + 5


def kernel_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The device kernels among a Chrome trace's events: name, stream, start and duration (µs),
    launch shape."""
    out = []
    for e in events:
        if e.get("cat") != "kernel":
            continue
        a = e.get("args", {})
        out.append({
            "name": e.get("name", ""), "stream": a.get("stream"), "ts": e.get("ts"),
            "dur": e.get("dur"), "grid": a.get("grid"), "block": a.get("block"),
            "smem": a.get("shared memory"), "regs": a.get("registers per thread"),
        })  # fmt: skip
    return out


def _profiled(run: Callable[[], None], device: torch.device, tmp: str) -> list[dict[str, Any]]:
    """Kernels of one run of ``run`` under torch.profiler (none on CPU: no device kernels)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        run()
    path = f"{tmp}/pair.json"
    prof.export_chrome_trace(path)
    with open(path) as f:
        doc = json.load(f)
    return kernel_events(doc["traceEvents"] if isinstance(doc, dict) else doc)


def measure(
    device: str = "cuda",
    *,
    names: list[str] | None = None,
    profile: bool = True,
    progress: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """Each kernel alone, every ordered pair, and (``profile``) each pair's kernels."""
    import tempfile

    import torch

    dev = torch.device(device)
    ops = kernels(device)
    names = names or list(ops)
    clock = _Clock(dev)
    alone: dict[str, float] = {}
    for k in names:
        st = clock.stream()
        for _ in range(WARMUP):
            clock.issue(ops[k], 1, st)
        clock.sync()
        t = clock.issue(ops[k], CALLS, st)
        clock.sync()
        alone[k] = t()
        progress(f"alone {k}: {alone[k]:.1f} us")
    pairs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for a in names:
            for b in names:
                nb = calls_beside(alone[a], alone[b])

                def run(a: str = a, b: str = b, nb: int = nb) -> tuple[float, float]:
                    s1, s2 = clock.stream(), clock.stream()
                    clock.sync()
                    tb = clock.issue(ops[b], nb, s2)
                    ta = clock.issue(ops[a], CALLS, s1)
                    clock.sync()
                    return ta(), tb()

                ta, tb = run()
                rec: dict[str, Any] = {"a": a, "b": b, "calls_b": nb, "a_us": ta, "b_us": tb}
                if profile:
                    rec["kernels"] = _profiled(lambda: run(), dev, tmp)
                pairs[f"{a}|{b}"] = rec
                progress(f"{a} beside {b}: {ta:.1f} us ({ta / alone[a]:.2f}x); "
                         f"{b} {tb:.1f} us ({tb / alone[b]:.2f}x)")  # fmt: skip
    return {"device": device, "calls": CALLS, "alone_us": alone, "pairs": pairs}


def data_text(doc: dict[str, Any], header: list[str]) -> str:
    """The measurement in the format of ``tests/data/interference_h200.txt``."""
    lines = [f"# {h}" for h in header]
    lines.append("# alone  kernel  us")
    lines += [f"alone {k} {v:.1f}" for k, v in doc["alone_us"].items()]
    lines.append("# pair  A  B  A_beside_us  B_us")
    lines += [
        f"pair {p['a']} {p['b']} {p['a_us']:.1f} {p['b_us']:.1f}" for p in doc["pairs"].values()
    ]
    return "\n".join(lines) + "\n"


def launch_shapes(doc: dict[str, Any]) -> dict[str, set[tuple]]:
    """Per kernel of the probe, the (kernel name, grid, block, shared memory, registers) the
    profiler saw in its pair with itself (the only pair where every kernel is its own)."""
    out: dict[str, set[tuple]] = {}
    for k in doc["alone_us"]:
        p = doc["pairs"].get(f"{k}|{k}")
        if not p or "kernels" not in p:
            continue
        out[k] = {
            (e["name"], str(e["grid"]), str(e["block"]), e["smem"], e["regs"]) for e in p["kernels"]
        }
    return out


def write_kernels(doc: dict[str, Any], path: str) -> None:
    """Every pair's kernel events, gzipped JSON (they run to thousands per pair)."""
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
