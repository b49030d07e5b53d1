"""Helpers for the LightLLM and DeepSeek schedule tests: layer windows, goldens, simulation checks."""

from __future__ import annotations

import os
import re
from pathlib import Path

from overlap_lab.shared.ir.program import (
    HostThread,
    Launch,
    Program,
    RankProgram,
    Record,
    Sync,
    Wait,
    iter_gpu_instrs,
    to_text,
)
from overlap_lab.sim import simulate
from tests.invariants import check_all, kernels_on

GOLDEN = Path(__file__).parent / "golden"
_WORK = re.compile(r" (flops|hbm_bytes|flow)=\S+")


def main_thread(p: Program) -> HostThread:
    (th,) = p.rank(0).threads
    return th


def moe_mid_layer(model) -> int:
    """A MoE layer in the middle of the model (previous and next layers are MoE too)."""
    return (model.first_k_dense + model.num_layers) // 2


def layer_window(p: Program, L: int, *, instrs: bool = False):
    """Issue-order instructions from the first launch of layer L up to the first launch of layer
    L+1: the window the schedule interleaves around layer L (it may hold ops of L-1 too).
    Launches only, as (stream, op), unless ``instrs``."""
    flat = [
        i
        for i in iter_gpu_instrs(main_thread(p).instrs)
        if isinstance(i, (Launch, Record, Wait, Sync))
    ]
    start = next(k for k, i in enumerate(flat) if isinstance(i, Launch) and i.op.layer == L)
    end = next(
        k for k, i in enumerate(flat) if k > start and isinstance(i, Launch) and i.op.layer == L + 1
    )
    window = flat[start:end]
    if instrs:
        return window
    return [(i.stream, i.op) for i in window if isinstance(i, Launch)]


def layer_instrs(p: Program, L: int) -> list:
    """Every GPU instruction of rank 0's first thread from the first launch of layer L to the
    first launch of layer L+1 (for schedules that do not interleave layers, the layer)."""
    flat = list(iter_gpu_instrs(p.ranks[0].threads[0].instrs))
    first = [
        next(k for k, i in enumerate(flat) if isinstance(i, Launch) and i.op.layer == x)
        for x in (L, L + 1)
    ]
    return flat[first[0] : first[1]]


def window_text(p: Program, L: int) -> str:
    """The window as Program text (meta included), work numbers stripped."""
    rp = p.rank(0)
    sub = Program(
        (
            RankProgram(
                0, rp.streams, (HostThread(f"layer{L}", tuple(layer_window(p, L, instrs=True))),)
            ),
        ),
        world=p.world,
        symmetric=p.symmetric,
        meta=p.meta,
    )
    return _WORK.sub("", to_text(sub))


def check_golden(name: str, p: Program, L: int) -> None:
    """Compare the layer window with tests/golden/<name>.txt (UPDATE_GOLDEN=1 rewrites it)."""
    path = GOLDEN / f"{name}.txt"
    text = window_text(p, L)
    if os.environ.get("UPDATE_GOLDEN") == "1" or not path.exists():
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs (UPDATE_GOLDEN=1 to accept)"


def check_simulated(p: Program, gpu) -> None:
    """The foundation's invariants, every launch run once, and the step time between the
    longest single lane (a lower bound: each lane is serial) and the sum of all spans."""
    trace = simulate(p, gpu)
    check_all(p, trace, gpu.num_sms)
    launches = [i for i in iter_gpu_instrs(main_thread(p).instrs) if isinstance(i, Launch)]
    ran = sum(len(kernels_on(trace, 0, f"stream:{s}")) for s in p.rank(0).streams)
    assert ran == len(launches)
    busy = trace.busy_us(0)
    step = trace.step_time_us
    assert step >= max(busy.values()) - 1e-6
    assert step <= sum(s.end - s.start for s in trace.spans) + 1e-6
    return trace


def _keyify(item, keep=frozenset()):
    """``item`` with every op name that is a part of a key (``shared.ir.ops.PARTS``) replaced by
    the key, but those in ``keep``: tuples element-wise, ``stream:name`` strings by their name."""
    from overlap_lab.shared.ir.ops import KEY_OF

    if isinstance(item, tuple):
        return tuple(_keyify(x, keep) for x in item)
    if isinstance(item, str):
        head, sep, name = item.rpartition(":")
        if name in KEY_OF and name not in keep:
            return head + sep + KEY_OF[name]
    return item


def collapse(items, keep=frozenset()) -> list:
    """A launch sequence with each key's parts folded back into the key they run for: the order
    the schedules name (attn.quant, attn.prepare, attn.uk_quant, attn.absorb_k -> attn.prepare).
    Consecutive entries of one key collapse into one. Names in ``keep`` stay as they are (a
    schedule that launches a key's parts one by one, as LightLLM its expert kernels)."""
    out: list = []
    last_changed = False
    for it in items:
        k = _keyify(it, keep)
        changed = k != it or (isinstance(it, (str, tuple)) and _is_key(it))
        if out and out[-1] == k and (changed or last_changed):
            last_changed = last_changed or changed
            continue
        out.append(k)
        last_changed = changed
    return out


def _is_key(item) -> bool:
    from overlap_lab.shared.ir.ops import PARTS

    if isinstance(item, tuple):
        return any(_is_key(x) for x in item)
    return isinstance(item, str) and item.rpartition(":")[2] in PARTS
