"""Calibration profiles: measured kernel durations that replace the roofline where they apply.

A profile is a JSON file (format ``overlap-lab-profile/1``)::

    {
      "format": "overlap-lab-profile/1",
      "device": "H800 SXM (132 SMs)",          # what the rows were measured on
      "date": "2025-03-25",                     # when (ISO date)
      "software": {"DeepGEMM": "8002b769"},     # library versions / commits
      "source": "where the numbers come from",  # a README, a trace file, a benchmark command
      "rows": [
        {"op": "experts", "dtype": "fp8", "size": 256, "sms": 132, "us": 87.5,
         "flops": 1.1e10, "source": "trace.json, rank 0, layers 3-60, mb 0"},
        ...
      ]
    }

Each row is one measured (or published) duration ``us`` of an op, keyed by

- ``op``: an op class (``gemm``, ``grouped_gemm``, ``attention``, ``elementwise``,
  ``sampling``: :data:`PROFILED_CLASSES`) or, for a kernel measured by itself, the name of one
  op (``experts``, ``attn.core``, ``logits``, ...: :data:`PROFILED_OPS`).
- ``dtype``: ``bf16`` or ``fp8``, the op's GEMM/attention dtype.
- ``size`` in ``size_unit``: ``tokens`` (default; the micro-batch's padded tokens, i.e. the GEMM
  rows; at a fixed KV length that fixes attention too) or ``flops`` (the op's FLOPs: for
  grouped GEMMs, whose rows per group follow routing, and for throughput tables).
- ``sms``: the SMs the kernel ran on.

and may carry ``flops``, the op's FLOPs at that row. With ``flops`` the row is read as a
throughput: the op is charged ``op.flops × (us / flops)`` interpolated in size, so an expert
GEMM of an overloaded rank (more FLOPs at the same tokens, ``--ranks explicit``) takes longer, and
several rows at one key (a layer's GEMM shapes at one M) pool into one throughput
(sum of FLOPs / sum of time). Without ``flops`` the row is a plain duration.

A throughput row on the tokens axis may name the GEMM it measured, ``"shape": [[N, K]]``
(``Y[M, N] = X[M, K] W^T``; its ``flops`` must be ``2 · size · N · K``). Rows of one shape form a
curve of their own: an op whose FLOPs per token equal ``2 · Σ N·K`` over a set of the profile's
shapes (within :data:`SHAPE_TOL`) is timed as those GEMMs back to back, each from its own
curve (DeepSeek-V3's ``attn.prepare`` is the fused q_a/kv_a GEMM then q_b; in prefill kv_b too).
An op that matches no set of shapes takes the pool of every shape at its size, as before.

Which ops a profile times is decided by their kind and class alone, never by name: compute
kernels of the profiled classes. Communication kernels and copies, whatever they are called,
are timed by the link model (``sim.network``), whose constants are checked against DeepEP's
tables (``experiments/exp_deepep_tables.py``). For an op a profile times, rows for its own name
win over rows for its class (``Profile.keys_for``), through the same filters (dtype, size axis,
grid). A row may name an op the IR builds as a compute kernel of a profiled class: the names
are read off the ops themselves (:func:`profiled_ops`), so a new op of a known class needs no
edit here.

Lookup (``Profile.lookup``): the rows of the op's SM count (or of the nearest measured count,
whose duration the wave model then carries to other SM counts: ``sim.cost.profile_factor``) are
interpolated log–log in size, which is exact on the table points and monotone between them (the
measured TFLOP/s curve). Above the largest size, rows with ``flops`` keep the largest size's
throughput (saturated GEMMs), rows without do not apply. Below the smallest size ``x0`` (a split
or sliced op: TBO's halves, SBO's down slices, a micro-batch) the rows still apply, so that a
split op is timed by the same source as the whole (:func:`below_smallest`):

- its work is padded to a whole M tile: a GEMM on the tokens axis with fewer rows than
  :data:`M_TILE` computes a whole tile of ``M_TILE`` rows (DeepGEMM's smallest ``BLOCK_M``), so it
  costs as ``min(x0, M_TILE)`` rows;
- the padded work runs at the smallest size's throughput (time per FLOP, or per unit of size for
  plain durations): no GEMM runs faster per FLOP than a bigger one of the same shape, so this
  is a lower bound on its time;
- the cost model then holds it to the time of reading its HBM bytes at the usable rate
  (``sim.cost.profile_factor``): at small M a GEMM reads all its weights whatever its rows, so
  two halves of a decode expert GEMM each pay the whole weight read, as the hardware does.

On the SM axis the wave model carries a duration from the measured SM count to the op's
(``sim.cost.profile_factor``).

Built-in profiles ship in ``sim/profiles/`` (``h800-published``: DeepSeek's published isolated
H800 benchmarks); ``roofline`` names no profile at all.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import GPU
from overlap_lab.shared.ir.program import Op

FORMAT = "overlap-lab-profile/1"
HEADER_KEYS: tuple[str, ...] = ("format", "device", "date", "software", "source", "rows")
#: Optional header keys: ``notes`` (free text) and ``gpu``, the GPU fields of the configuration
#: the rows were measured on (``{"num_sms": 132, "hbm_gbps": 3350, ...}``), which rows' ``depends``
#: name.
OPTIONAL_HEADER_KEYS: tuple[str, ...] = ("notes", "gpu")
#: GPU fields a row's duration may depend on. The SM count is not among them: a row names the SMs
#: it ran on and the wave model carries it to others (``sim.cost.profile_factor``); links and
#: host costs are never a compute kernel's. The peak TFLOP/s stand for the clock and the SMs'
#: tensor throughput (a GPU field has no clock of its own).
DEPENDABLE: tuple[str, ...] = ("hbm_gbps", "bf16_tflops", "fp8_tflops", "num_sms", "arch")


def default_depends(dtype: str) -> tuple[str, ...]:
    """What a compute kernel's measured time depends on when its row does not say: the memory
    bandwidth it streams at and the tensor peak (clock) of its dtype."""
    return ("hbm_gbps", "fp8_tflops" if dtype == "fp8" else "bf16_tflops")


SIZE_UNITS: tuple[str, ...] = ("tokens", "flops")
#: Rows of one M tile: a GEMM with fewer rows computes a whole tile (DeepGEMM
#: ``deep_gemm/jit_kernels/gemm.py``, ``get_best_configs``: ``block_ms = (64 if m <= 64 else 128,)``),
#: so below it the time no longer falls with M.
M_TILE = 64
#: How close an op's FLOPs per token must come to ``2 · Σ N·K`` of a set of shapes to be timed
#: as those GEMMs (relative): the elementwise work fused into a GEMM op (norms, RoPE: 0.06 % of
#: DeepSeek-V3's ``attn.prepare``) stays inside it.
SHAPE_TOL = 2e-3
#: Lookups a profile remembers (one per distinct op and SM count) before it starts again.
_MEMO_SIZE = 1 << 16
#: Op classes whose rows on the tokens axis are GEMMs padded to whole M tiles.
GEMM_CLASSES: tuple[str, ...] = ("gemm", "grouped_gemm")
DTYPES: tuple[str, ...] = ("bf16", "fp8")
#: Op classes a profile times, and a row may name (communication and copies are the link model's).
PROFILED_CLASSES: tuple[str, ...] = ("gemm", "grouped_gemm", "attention", "elementwise", "sampling")


def profiled(op: Op) -> bool:
    """Whether a profile may time ``op``: a compute kernel of a profiled class (kind and class
    decide, not the name)."""
    return op.kind == "compute" and op.op_class in PROFILED_CLASSES


def reference_ops() -> list[Op]:
    """Every op the IR's builders (``shared.ir.ops``, ``shared.ir.ops_sched``) make, on small
    reference workloads that between them emit each op the IR names: MLA and GQA attention, FP8
    and BF16 GEMMs, dense and MoE layers, decode with MTP and prefill, both DeepEP modes, the
    scheduler's ops with logprobs (``tests/test_profile.py`` checks the cover)."""
    from overlap_lab.shared.inputs.presets import load_gpu, load_model
    from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, whole_batch
    from overlap_lab.shared.ir import ops as layer
    from overlap_lab.shared.ir import ops_sched as sched

    gpu, out = load_gpu("h800"), []
    for model in ("deepseek-v3", "qwen3-30b-a3b"):
        m = load_model(model)
        for b in (Batch.decode(8, kv_len=64, tokens_per_seq=2), Batch.prefill(2, extend_len=64)):
            w = Workload(m, b, Parallel(ep=16))
            mb = whole_batch(w)
            for mode in ("low_latency", "normal"):
                for i in (0, m.num_layers - 1):  # dense first, MoE last
                    out += layer.layer_ops(w, gpu, i, mb, deepep_mode=mode).values()
                out += layer.mtp_ops(w, gpu, mb, deepep_mode=mode)
            out += layer.head_ops(w, gpu, mb).values()
            out += sched.schedule_ops(b) + sched.d2h_ops(b, return_logprob=True)
            out += [sched.resolve_future_op(b), sched.store_to_map_op(b)]
    return out


@functools.cache
def profiled_ops() -> frozenset[str]:
    """The op names a row may carry: those of :func:`reference_ops` a profile may time
    (:func:`profiled`), read off the ops themselves; built once, when first needed."""
    return frozenset(op.name for op in reference_ops() if profiled(op))


def __getattr__(name: str) -> frozenset[str]:
    """``PROFILED_OPS``: :func:`profiled_ops`, built on first use (it builds ops)."""
    if name == "PROFILED_OPS":
        return profiled_ops()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: Names accepted by ``--profile`` besides a path.
ROOFLINE = "roofline"
BUILTIN: tuple[str, ...] = ("h800-published", "h200-measured")
_ROW_KEYS = frozenset(
    {"op", "dtype", "size", "size_unit", "sms", "us", "flops", "source", "depends", "grid",
     "shape"}
)  # fmt: skip


@dataclass(frozen=True)
class Row:
    """One measured duration: ``us`` µs for ``op`` in ``dtype`` at ``size`` on ``sms`` SMs."""

    op: str
    dtype: str
    size: float
    sms: int
    us: float
    size_unit: str = "tokens"
    flops: float = 0.0
    source: str = ""
    #: GPU fields the duration depends on (None: ``default_depends(dtype)``); an override of one
    #: of them (``--hbm-gbps``) invalidates the row, any other override keeps it.
    depends: tuple[str, ...] | None = None
    #: The kernel's grid kind when the row holds only for one (``sim.cost.grid_kind``: FlashMLA's
    #: decode split is ``persistent``, FlashAttention-3's prefill ``dynamic``); None: any.
    grid: str | None = None
    #: The GEMMs the row measured, ``((N, K), ...)`` (tokens-axis throughput rows only): rows of
    #: one shape form their own curve (module docstring); None: the row only joins the pool.
    shape: tuple[tuple[int, int], ...] | None = None

    def depends_on(self) -> tuple[str, ...]:
        return self.depends if self.depends is not None else default_depends(self.dtype)


@dataclass(frozen=True)
class _Curve:
    """Points of one (op, dtype, unit, sms) key, sorted by size, duplicates pooled."""

    sizes: tuple[float, ...]
    us: tuple[float, ...]
    flops: tuple[float, ...]  # all > 0 (throughput rows) or all 0 (duration rows)

    @property
    def per_flop(self) -> bool:
        return self.flops[0] > 0


@dataclass(frozen=True)
class Match:
    """What a lookup found: the duration at ``sms`` SMs the rows were measured on."""

    us: float
    sms: int
    key: str  # the row key that matched (op name or class)


@dataclass(frozen=True)
class Profile:
    """A parsed, validated profile (see the module docstring for the format)."""

    name: str
    device: str
    date: str
    software: dict[str, str]
    source: str
    rows: tuple[Row, ...]
    notes: str = ""
    #: GPU fields of the configuration the rows were measured on (header ``gpu``); empty: not
    #: stated, so no override can be checked against them and every row is kept.
    gpu: tuple[tuple[str, Any], ...] = ()
    _curves: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    #: per-shape curves: (op, dtype, unit, sms, grid) -> {shape: _Curve}
    _shaped: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    _for_gpu: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    _memo: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        groups: dict[tuple, list[Row]] = defaultdict(list)
        for r in self.rows:
            groups[(r.op, r.dtype, r.size_unit, r.sms, r.grid)].append(r)
        for key, rows in groups.items():
            self._curves[key] = self._curve(key, rows)
            shapes: dict[tuple, list[Row]] = defaultdict(list)
            for r in rows:
                if r.shape is not None:
                    shapes[r.shape].append(r)
            if shapes:
                self._shaped[key] = {sh: self._curve(key, rs) for sh, rs in shapes.items()}

    def _curve(self, key: tuple, rows: list[Row]) -> _Curve:
        """The rows of one key (and shape) as a curve over size, rows of one size pooled."""
        by_size: dict[float, list[Row]] = defaultdict(list)
        for r in rows:
            by_size[r.size].append(r)
        with_flops = {r.flops > 0 for r in rows}
        if len(with_flops) > 1:
            raise ConfigError(
                f"profile {self.name}: rows of {key[0]} {key[1]} on {key[3]} SMs mix rows "
                "with and without flops"
            )
        sizes = sorted(by_size)
        if not with_flops.pop():
            dup = [s for s in sizes if len(by_size[s]) > 1]
            if dup:
                raise ConfigError(
                    f"profile {self.name}: two rows for {key[0]} {key[1]} size {dup[0]:g} "
                    f"on {key[3]} SMs (give flops to pool them as a throughput)"
                )
        return _Curve(
            tuple(sizes),
            tuple(sum(r.us for r in by_size[s]) for s in sizes),
            tuple(sum(r.flops for r in by_size[s]) for s in sizes),
        )

    # -- lookup -------------------------------------------------------------------------------

    def keys_for(self, op: Op) -> tuple[str, ...]:
        """The row keys that may time ``op``, the first that applies wins: rows measured for the
        op itself (its name), then rows of its class."""
        return (op.name, op.op_class)

    def lookup(self, op: Op, sms: int, gpu: GPU | None = None) -> Match | None:
        """The op's duration from the rows, at the measured SM count nearest ``sms`` (the caller
        carries it to ``sms`` by the wave model: ``sim.cost.profile_factor``); None when no row
        applies. With ``gpu``, only the rows that GPU keeps (:meth:`for_gpu`) are searched."""
        if gpu is not None and self.gpu:
            return self.for_gpu(gpu)[0].lookup(op, sms)
        if not profiled(op):
            return None
        memo = (op.name, op.op_class, op.dtype, op.tokens, op.flops, op.grid, sms)
        hit = self._memo.get(memo, self._memo)  # the dict itself: not looked up yet
        if hit is self._memo:
            if len(self._memo) >= _MEMO_SIZE:  # a long sweep: start again rather than grow
                self._memo.clear()
            hit = self._memo[memo] = self._lookup(op, sms)
        return hit

    def _lookup(self, op: Op, sms: int) -> Match | None:
        kind = _grid_kind(op)
        for key in self.keys_for(op):
            for unit in SIZE_UNITS:
                counts = [
                    s
                    for (o, d, u, s, g) in self._curves
                    if (o, d, u) == (key, op.dtype, unit) and g in (None, kind)
                ]
                if not counts:
                    continue
                # the nearest SM count whose rows span the op's size, else the nearest whose rows
                # apply at all: a kernel's cohorts on fewer SMs (a waved kernel's last wave) must
                # read the same row as the kernel, not a row of another size on closer SMs
                by_near = sorted(set(counts), key=lambda s: (abs(math.log(s / max(sms, 1))), -s))
                x = op_size(op, unit)
                for inside in (True, False):
                    for near in by_near:
                        for g in (kind, None):
                            c = self._curves.get((key, op.dtype, unit, near, g))
                            if c is None or (inside and not c.sizes[0] <= x <= c.sizes[-1]):
                                continue
                            us = self._shaped_us((key, op.dtype, unit, near, g), op, unit)
                            if us is None:
                                us = evaluate(c, x, op.flops, _tile(op, unit))
                            if us is not None:
                                return Match(us, near, key)
        return None

    def _shaped_us(self, key: tuple, op: Op, unit: str) -> float | None:
        """The op timed as the GEMMs of its shape, each from its own curve, back to back (None:
        the key has no per-shape rows, or no set of its shapes makes the op's FLOPs per token)."""
        curves = self._shaped.get(key)
        if not curves or unit != "tokens" or op.tokens <= 0 or op.flops <= 0:
            return None
        parts = match_shapes(tuple(sorted(curves)), op.flops / op.tokens)
        if parts is None:
            return None
        total = 0.0
        for sh in parts:
            flops = 2.0 * op.tokens * sum(n * k for n, k in sh)
            us = evaluate(curves[sh], float(op.tokens), flops, _tile(op, unit))
            if us is None:
                return None
            total += us
        return total

    def invalidated(self, gpu: GPU) -> dict[str, tuple[Any, Any]]:
        """The GPU fields the rows may depend on whose value on ``gpu`` differs from the measured
        configuration's: field -> (measured, now)."""
        out = {}
        for k, v in self.gpu:
            now = getattr(gpu, k, None)
            if now is not None and now != v:
                out[k] = (v, now)
        return out

    def for_gpu(self, gpu: GPU) -> tuple[Profile, str | None]:
        """The profile with only the rows ``gpu`` keeps: a row is dropped when a field it
        depends on (``Row.depends_on``) differs from the measured configuration (``--hbm-gbps``
        drops every row; ``--rdma-gbps`` or ``--sbo-comm-sms`` none, since no compute row depends
        on links or on the communication SMs). Also a one-line note saying what was dropped and
        why (None: every row kept)."""
        hit = self._for_gpu.get(gpu)
        if hit is not None:
            return hit
        changed = self.invalidated(gpu)
        kept = tuple(r for r in self.rows if not set(r.depends_on()) & set(changed))
        if len(kept) == len(self.rows):
            out: tuple[Profile, str | None] = (self, None)
        else:
            why = ", ".join(f"{k} {a:g} -> {b:g}" if isinstance(a, (int, float)) else
                            f"{k} {a} -> {b}" for k, (a, b) in sorted(changed.items()))  # fmt: skip
            note = (
                f"profile {self.name}: {len(self.rows) - len(kept)} of {len(self.rows)} rows "
                f"dropped ({why} on {gpu.name}); those ops fall back to the roofline"
            )
            sub = dataclasses.replace(
                self, rows=kept, gpu=(), _curves={}, _shaped={}, _for_gpu={}, _memo={}
            )
            out = (sub, note)
        self._for_gpu[gpu] = out
        return out

    def to_json(self) -> dict[str, Any]:
        rows = []
        for r in self.rows:
            d = {"op": r.op, "dtype": r.dtype, "size": r.size, "sms": r.sms, "us": r.us}
            if r.size_unit != "tokens":
                d["size_unit"] = r.size_unit
            if r.flops > 0:
                d["flops"] = r.flops
            if r.source:
                d["source"] = r.source
            if r.depends is not None:
                d["depends"] = list(r.depends)
            if r.grid is not None:
                d["grid"] = r.grid
            if r.shape is not None:
                d["shape"] = [list(p) for p in r.shape]
            rows.append(d)
        return {
            "format": FORMAT,
            "device": self.device,
            "date": self.date,
            "software": dict(self.software),
            "source": self.source,
            **({"notes": self.notes} if self.notes else {}),
            **({"gpu": dict(self.gpu)} if self.gpu else {}),
            "rows": rows,
        }

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return p


def _grid_kind(op: Op) -> str:
    """The op's grid as a row's ``grid`` names it: its own (``Op.grid``), else ``persistent``
    for the persistent classes (``sim.cost.PERSISTENT_CLASSES``: attention and FP8 GEMMs, the
    kernels rows are measured for), else ``waved``. Here, not ``sim.cost.grid_kind``: the cost
    model imports this module."""
    if op.grid is not None:
        return op.grid
    persistent = op.op_class == "attention" or (
        op.op_class in ("gemm", "grouped_gemm") and op.dtype == "fp8"
    )
    return "persistent" if persistent else "waved"


def op_size(op: Op, unit: str) -> float:
    """The op's size along a profile's size axis."""
    return float(op.tokens) if unit == "tokens" else float(op.flops)


def interpolate_loglog(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise-linear in (log x, log y) through the points; exact at each xs[i]. ``x`` must
    lie in [xs[0], xs[-1]]."""
    i = bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return ys[i]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))


def _tile(op: Op, unit: str) -> int:
    """Rows of one M tile when ``op`` is a GEMM on the tokens axis (:data:`M_TILE`), else 0."""
    return M_TILE if unit == "tokens" and op.op_class in GEMM_CLASSES else 0


def below_smallest(x: float, x0: float, tile: int = 0) -> float:
    """The size an op of size ``x`` below the smallest measured size ``x0`` is charged as, at
    ``x0``'s time per unit: ``x`` padded to a whole tile of ``tile`` rows (0: no tile), never
    beyond ``x0`` (the measured row already holds its own padding). With ``tile`` = 64 and the
    published rows' ``x0`` = 64, any M below 64 costs as M = 64: the kernel computes the same
    tiles; on the FLOPs axis (grouped GEMMs, whose rows per group follow routing) no tile."""
    return min(x0, max(x, float(tile))) if tile else x


def evaluate(c: _Curve, x: float, flops: float, tile: int = 0) -> float | None:
    """Duration of an op of size ``x`` (and ``flops`` FLOPs) from curve ``c``: log-log between
    the measured sizes; above the largest, the largest's throughput (rows with flops) or None;
    below the smallest, :func:`below_smallest`'s padded work at the smallest size's throughput
    (module docstring). None: the curve does not apply."""
    if x <= 0:
        return None
    if c.per_flop:
        if flops <= 0:
            return None
        q = [u / f for u, f in zip(c.us, c.flops)]
        if x < c.sizes[0]:
            return flops * below_smallest(x, c.sizes[0], tile) / x * q[0]
        per = q[-1] if x >= c.sizes[-1] else interpolate_loglog(c.sizes, tuple(q), x)
        return flops * per
    if x < c.sizes[0]:
        return c.us[0] * below_smallest(x, c.sizes[0], tile) / c.sizes[0]
    if x > c.sizes[-1]:
        return None
    return interpolate_loglog(c.sizes, c.us, x)


@functools.lru_cache(maxsize=4096)
def match_shapes(
    shapes: tuple[tuple[tuple[int, int], ...], ...], per_token: float
) -> tuple[tuple[tuple[int, int], ...], ...] | None:
    """The set of ``shapes`` (each a row's ``((N, K), ...)``) whose ``2 · Σ N·K`` comes closest
    to ``per_token`` FLOPs, within :data:`SHAPE_TOL`; fewer shapes win a tie. None: no set
    does. A profile holds a handful of shapes (DeepGEMM's table: six), so every set is tried."""
    best, err = None, SHAPE_TOL
    for n in range(1, len(shapes) + 1):
        for combo in itertools.combinations(shapes, n):
            f = 2.0 * sum(a * b for sh in combo for a, b in sh)
            e = abs(f - per_token) / per_token
            if e <= err and (best is None or e < err):
                best, err = combo, e
    return best


# ---------------------------------------------------------------------------------------------
# Reading


def _row(name: str, i: int, d: Any) -> Row:
    where = f"profile {name}: row {i}"
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected an object, got {type(d).__name__}")
    extra = set(d) - _ROW_KEYS
    if extra:
        raise ConfigError(f"{where}: unknown field {sorted(extra)[0]!r}")
    for k in ("op", "dtype", "size", "sms", "us"):
        if k not in d:
            raise ConfigError(f"{where}: missing {k!r}")
    op = d["op"]
    if op not in PROFILED_CLASSES and op not in profiled_ops():
        raise ConfigError(
            f"{where}: unknown op {op!r}; expected an op name the schedules emit or one of "
            f"{', '.join(PROFILED_CLASSES)} (communication is timed by the link model)"
        )
    if d["dtype"] not in DTYPES:
        raise ConfigError(f"{where}: dtype must be one of {DTYPES}, got {d['dtype']!r}")
    unit = d.get("size_unit", "tokens")
    if unit not in SIZE_UNITS:
        raise ConfigError(f"{where}: size_unit must be one of {SIZE_UNITS}, got {unit!r}")
    for k in ("size", "us", "flops"):
        v = d.get(k, 0.0 if k == "flops" else None)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"{where}: {k} must be a number, got {v!r}")
        if v < 0 or (v == 0 and k != "flops"):
            raise ConfigError(f"{where}: {k} must be positive, got {v!r}")
    sms = d["sms"]
    if isinstance(sms, bool) or not isinstance(sms, int) or sms <= 0:
        raise ConfigError(f"{where}: sms must be a positive integer, got {sms!r}")
    depends = d.get("depends")
    if depends is not None:
        if not isinstance(depends, list) or any(x not in DEPENDABLE for x in depends):
            raise ConfigError(f"{where}: depends must list GPU fields among {DEPENDABLE}")
        depends = tuple(depends)
    g = d.get("grid")
    if g is not None and g not in ("persistent", "dynamic", "waved"):
        raise ConfigError(f"{where}: grid must be persistent, dynamic or waved, got {g!r}")
    flops = float(d.get("flops", 0.0))
    shape = _shape(where, d.get("shape"), unit, float(d["size"]), flops)
    return Row(
        op, d["dtype"], float(d["size"]), sms, float(d["us"]), unit, flops,
        str(d.get("source", "")), depends, g, shape,
    )  # fmt: skip


def _shape(
    where: str, v: Any, unit: str, size: float, flops: float
) -> tuple[tuple[int, int], ...] | None:
    """A row's ``shape``, checked: a list of [N, K] pairs on a tokens-axis throughput row whose
    ``flops`` are ``2 · size · Σ N·K``."""
    if v is None:
        return None
    ok = isinstance(v, list) and v and all(
        isinstance(p, list) and len(p) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in p)
        for p in v
    )  # fmt: skip
    if not ok:
        raise ConfigError(f"{where}: shape must be a list of [N, K] pairs of positive integers")
    if unit != "tokens" or flops <= 0:
        raise ConfigError(f"{where}: shape needs a tokens-axis row with flops")
    want = 2.0 * size * sum(n * k for n, k in v)
    if abs(flops - want) > 1e-6 * want:
        raise ConfigError(f"{where}: flops {flops:g} are not 2 x size x N x K = {want:g}")
    return tuple((n, k) for n, k in v)


def from_json(doc: Any, name: str = "<profile>") -> Profile:
    """A Profile from a parsed JSON document; ConfigError (one line) on anything malformed."""
    if not isinstance(doc, dict):
        raise ConfigError(f"profile {name}: expected a JSON object with {', '.join(HEADER_KEYS)}")
    for k in HEADER_KEYS:
        if k not in doc:
            raise ConfigError(
                f"profile {name}: header lacks {k!r} (needs {', '.join(HEADER_KEYS)})"
            )
    if doc["format"] != FORMAT:
        raise ConfigError(f"profile {name}: format must be {FORMAT!r}, got {doc['format']!r}")
    for k in ("device", "date", "source"):
        if not isinstance(doc[k], str) or not doc[k].strip():
            raise ConfigError(f"profile {name}: header {k!r} must be a non-empty string")
    if not isinstance(doc["software"], dict):
        raise ConfigError(f"profile {name}: header 'software' must map library to version")
    if "notes" in doc and not isinstance(doc["notes"], str):
        raise ConfigError(f"profile {name}: header 'notes' must be a string")
    ref = doc.get("gpu", {})
    if not isinstance(ref, dict) or any(k not in DEPENDABLE for k in ref):
        raise ConfigError(f"profile {name}: header 'gpu' must map GPU fields among {DEPENDABLE}")
    unknown = set(doc) - set(HEADER_KEYS) - set(OPTIONAL_HEADER_KEYS)
    if unknown:
        raise ConfigError(f"profile {name}: unknown header field {sorted(unknown)[0]!r}")
    if not isinstance(doc["rows"], list) or not doc["rows"]:
        raise ConfigError(f"profile {name}: 'rows' must be a non-empty list")
    rows = tuple(_row(name, i, d) for i, d in enumerate(doc["rows"]))
    software = {str(k): str(v) for k, v in doc["software"].items()}
    return Profile(
        name, doc["device"], doc["date"], software, doc["source"], rows, doc.get("notes", ""),
        tuple(sorted(ref.items())),
    )  # fmt: skip


def load_profile(spec: str | Path | None) -> Profile | None:
    """``roofline``/None: no profile; a built-in name (``h800-published``); else a file path."""
    if spec is None or str(spec) == ROOFLINE:
        return None
    s = str(spec)
    if s in BUILTIN:
        text = resources.files("overlap_lab.sim").joinpath("profiles", f"{s}.json").read_text()
        return from_json(json.loads(text), s)
    p = Path(s)
    if not p.is_file():
        raise ConfigError(
            f"profile {s!r}: no such file (or use {ROOFLINE} or one of {', '.join(BUILTIN)})"
        )
    try:
        doc = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"profile {s}: not JSON ({e})") from None
    return from_json(doc, p.name)


#: The built-in profile ``--profile auto`` picks per GPU preset.
DEFAULTS: dict[str, str] = {"h800": "h800-published", "h200": "h200-measured"}


def default_profile(gpu: str | GPU) -> str:
    """The profile ``--profile auto`` picks: the built-in one of the preset, else the roofline.

    A preset with overridden fields keeps its preset's name before a ``+``
    (``h800+rdma-gbps=50.001``, ``overlap_lab.api.gpu``): it keeps the preset's profile, whose
    rows the changed fields invalidate one by one (``Profile.for_gpu``), not all at once. A GPU
    of another name (a renamed copy of a preset from ``--gpu-file``), given as a ``GPU``, takes
    the built-in profile whose measured configuration (header ``gpu``) it equals field by field."""
    name = gpu if isinstance(gpu, str) else gpu.name
    base = name.split("+", 1)[0].lower()
    if base in DEFAULTS:
        return DEFAULTS[base]
    if isinstance(gpu, GPU) and base not in _preset_names():
        for builtin in BUILTIN:
            ref = _measured_on(builtin)
            if ref and all(getattr(gpu, k, None) == v for k, v in ref):
                return builtin
    return ROOFLINE


@functools.cache
def _measured_on(builtin: str) -> tuple[tuple[str, Any], ...]:
    """The measured configuration (header ``gpu``) of a built-in profile, read once."""
    return load_profile(builtin).gpu


def _preset_names() -> frozenset[str]:
    from overlap_lab.shared.inputs.hardware import GPUS

    return frozenset(GPUS)


def resolve(spec: str | None, gpu: str | GPU) -> str:
    """``auto``/None -> the GPU's default (``default_profile``); anything else as given."""
    return default_profile(gpu) if spec in (None, "auto") else spec


def profile_for(spec: Any, gpu: str | GPU) -> Profile | None:
    """The calibration profile ``spec`` names for ``gpu`` (a Profile passes through; None:
    roofline alone); ``auto`` picks the built-in profile whose measured configuration the GPU
    matches, so a renamed copy of a preset keeps it. Loaded once per (spec, GPU): a sweep, a
    comparison and its sensitivity design resolve it once for all their runs."""
    if spec is None or isinstance(spec, Profile):
        return spec
    return _loaded(str(spec), gpu)


@functools.lru_cache(maxsize=16)
def _loaded(spec: str, gpu: str | GPU) -> Profile | None:
    return load_profile(resolve(spec, gpu))
