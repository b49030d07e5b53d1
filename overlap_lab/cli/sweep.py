"""Sweeps: thousands of simulations from one spec file, deduplicated, streamed, resumable.

A spec (YAML or JSON) names fixed knobs and the grid to sweep; a knob is any option of
``overlap-lab sim`` (workload, hardware overrides, schedule knobs, host costs, ranks and routing),
by its option name with ``-`` or ``_``::

    base:                      # the same in every case
      model: deepseek-v3
      gpu: h800
      mode: decode
    grid:                      # the cartesian product, first key slowest
      schedule: [serial, sbo, tbo]
      batch: [32, 64, 128]
      sbo_comm_sms: [8, 16, 24]
    cases:                     # optional: more cases, each merged over base (no grid)
      - {schedule: tbo, ranks: explicit, imbalance: "zipf:1.2", ep: 16}

Each case is built and lowered as ``overlap-lab sim`` does it (explicit ranks when asked) and
simulated on one of ``processes`` local workers or on a Ray cluster (:func:`run_sweep`,
``backend="ray"``). Cases that cannot differ are simulated once: two cases share a result only
when their lowered Programs (every rank, op and flow; meta excluded, as no metric reads it), GPU
presets (every field, overrides included) and network grouping tolerance are equal, compared by
a SHA-256 of their exact ``repr`` (floats print exactly). The first case of a key to reach a
worker claims it and simulates; the others wait for its metrics. A worker learns from each build
which schedule-config fields and which of the GPU fields the key leaves out (schedule defaults,
the name) the build read, by watching the objects it is given; a later case whose other inputs
are equal and whose read fields have the same values has that case's key without a build
(``_input_key``).

Rows stream to a CSV file as cases finish (one row per case: ``case`` index, every knob of the
spec, the metrics, ``sim_key`` and ``error``; cases with one ``sim_key`` were simulated once and
the rows are the same whatever the backend or the order cases finished in), flushed row by row,
so an interrupted
sweep run again on the same file skips the cases it has (a torn last row is dropped, even one
cut inside a quoted field) and reuses their results for duplicates. One sweep writes a file at a
time (a lock file beside it); Ctrl-C stops the workers and keeps the rows written; worker and
manager processes die with a killed parent. With a ``.parquet`` output the rows stream to
``<out>.partial.csv`` and become a Parquet file (pyarrow) when the sweep completes.

The sweep lives in the command line's package, with its subcommand (``overlap-lab sweep SPEC``,
at the end), because a spec's keys are ``sim``'s options: each case is parsed, checked and turned
into the API's records by the very option parser and checks of ``overlap-lab sim``
(:mod:`overlap_lab.cli.options`, :mod:`overlap_lab.cli.inputs`), so that a case means what the
same options mean on the command line. Below the command line it would need those upward.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import functools
import hashlib
import io
import itertools
import json
import marshal
import math
import os
import re
import signal
import sys
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from overlap_lab.shared.errors import ConfigError

#: what produced each row, from the case's own inputs (never copied from a duplicate's owner):
#: the GPU's full name (overrides included, ``h800+hbm-gbps=2000``), the model and its layer
#: count, the calibration profile op durations came from (``roofline``: none)
PROVENANCE = ("gpu_name", "model_name", "model_layers", "profile_name")
#: the metric columns, in order; every time is per iteration unless its name ends in
#: ``_window_us`` (docs/metrics.md). ``step_time_us`` is ``iteration_us``, as in ``sim --json``;
#: ``max/min_rank_window_us``: the slowest and fastest rank; ``cost_sources``: how many ops took
#: their duration from the profile, the roofline and the link model
METRICS = (
    "iterations",
    "window_us",
    "iteration_us",
    "step_time_us",
    "tokens",
    "tokens_per_s_gpu",
    "comm_us",
    "exposed_comm_us",
    "comm_only_us",
    "compute_kernel_us",
    "sm_compute",
    "sm_comm",
    "sm_idle",
    "max_rank_window_us",
    "min_rank_window_us",
    "num_ops",
    "num_spans",
    "cost_sources",
)
TAIL = ("sim_key", "error")
#: `sim` options that are not knobs of a simulation
NOT_KNOBS = frozenset(
    {"command", "func", "out", "figure_format", "json", "window", "rank", "width"}
)


# ---------------------------------------------------------------------------------------------
# The spec


@dataclass(frozen=True)
class Spec:
    """The expanded sweep: ``knobs`` (column names, spec order) and one dict per case."""

    knobs: tuple[str, ...]
    cases: tuple[dict[str, Any], ...]


@functools.cache
def _sim_parser() -> argparse.ArgumentParser:
    from overlap_lab.cli.options import subcommand_parser

    return subcommand_parser("sim")


@functools.cache
def _knob_actions() -> dict[str, argparse.Action]:
    return {
        a.dest: a
        for a in _sim_parser()._actions
        if a.dest not in NOT_KNOBS and a.dest != "help" and a.option_strings
    }


def defaults() -> dict[str, Any]:
    """Every knob of ``overlap-lab sim`` with its default."""
    return dict(_defaults())


@functools.cache
def _defaults() -> dict[str, Any]:
    ns = _sim_parser().parse_args(["--out", ""])
    return {k: v for k, v in vars(ns).items() if k not in NOT_KNOBS}


def _convert(action: argparse.Action, value: Any) -> Any:
    """A spec value as the option's parser reads it (lists for tuple options, YAML booleans)."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        text = ",".join(str(v) for v in value)
    elif isinstance(value, bool):
        text = "true" if value else "false"
    else:
        text = str(value)
    try:
        out = action.type(text) if action.type is not None else text
    except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
        raise ConfigError(f"sweep: {action.dest}={value!r}: {e}") from None
    if action.choices is not None and out not in action.choices:
        raise ConfigError(f"sweep: {action.dest} must be one of {', '.join(action.choices)}")
    return out


def _normalise(knobs: Mapping[str, Any], actions: Mapping[str, argparse.Action], where: str):
    out = {}
    for k, v in knobs.items():
        name = str(k).replace("-", "_")
        if name not in actions:
            raise ConfigError(
                f"sweep: unknown knob {k!r} in {where} (an option of overlap-lab sim)"
            )
        out[name] = v
    return out


#: The most cases one spec may expand to. Counted from the grid's sizes before anything is
#: expanded, so a grid that multiplies out to 1e8 cases is refused at once instead of filling
#: memory (each expanded case is a dict of its knobs, ~1 KB); 100,000 cases take hours to
#: simulate on a workstation, so a larger study is several specs (or a Ray cluster's sweeps).
MAX_CASES = 100_000


def _read_spec(path: Path) -> Any:
    """A spec file's document: read with the input size cap, one-line errors for bad JSON/YAML."""
    from overlap_lab.shared.inputs.preset_files import read_capped

    if not path.is_file():
        raise ConfigError(f"sweep: no such spec file {path}")
    try:
        text = read_capped(path, "sweep spec").decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"sweep: {path}: not a UTF-8 text file") from None
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"sweep: {path}: invalid JSON ({e.msg} at line {e.lineno})") from None
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or type(e).__name__
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"sweep: {path}: invalid YAML ({problem}{where})") from None


def load_spec(src: str | Path | Mapping[str, Any]) -> Spec:
    """Read and expand a spec (a YAML/JSON file, or the mapping itself); every value is checked
    by its option's own parser before any simulation starts, once per distinct value."""
    if not isinstance(src, Mapping):
        src = _read_spec(Path(src)) or {}
    if not isinstance(src, Mapping):
        raise ConfigError("sweep: the spec must be a mapping with base, grid and/or cases")
    extra = set(src) - {"base", "grid", "cases"}
    if extra:
        raise ConfigError(f"sweep: unknown spec keys {sorted(extra)} (base, grid, cases)")
    for key in ("base", "grid"):
        if not isinstance(src.get(key) or {}, Mapping):
            raise ConfigError(f"sweep: {key} must be a mapping of knob: value")
    raw_cases = src.get("cases") or []
    if not isinstance(raw_cases, list):
        raise ConfigError("sweep: cases must be a list of mappings of knob: value")
    for i, c in enumerate(raw_cases):
        if not isinstance(c, Mapping):
            raise ConfigError(f"sweep: cases[{i}] must be a mapping of knob: value, got {c!r:.40}")
    actions = _knob_actions()
    base = _normalise(src.get("base") or {}, actions, "base")
    grid = _normalise(src.get("grid") or {}, actions, "grid")
    for k, v in grid.items():
        if not isinstance(v, list) or not v:
            raise ConfigError(f"sweep: grid {k} needs a non-empty list of values")
    count = math.prod(len(v) for v in grid.values()) if grid or not raw_cases else 0
    count += len(raw_cases)
    if count > MAX_CASES:
        raise ConfigError(
            f"sweep: the spec expands to {count:,} cases, more than {MAX_CASES:,}: "
            "split it into several specs"
        )
    listed = [_normalise(c, actions, "cases") for c in raw_cases]
    for k, v in base.items():
        _convert(actions[k], v)
    for k, values in grid.items():
        for v in values:
            _convert(actions[k], v)
    for c in listed:
        for k, v in c.items():
            _convert(actions[k], v)
    knobs = list(base)
    for k in [*grid, *(k for c in listed for k in c)]:
        if k not in knobs:
            knobs.append(k)
    if "schedule" not in knobs:
        knobs.insert(0, "schedule")
    cases = []
    if grid or not listed:
        for values in itertools.product(*grid.values()):
            c = {**base, **dict(zip(grid, values))}
            cases.append({k: c.get(k) for k in knobs})
    cases += [{k: {**base, **c}.get(k) for k in knobs} for c in listed]
    return Spec(tuple(knobs), tuple(cases))


# ---------------------------------------------------------------------------------------------
# One case


#: GPU preset fields that are schedule defaults, read when a schedule builds its Program (so
#: already in it) and never by the simulator (tests/test_sweep.py checks that sim/ does not name
#: them): left out of the key, so that e.g. serial cases differing only in ``sbo_comm_sms`` merge.
SCHEDULE_ONLY_GPU_FIELDS = ("sbo_comm_sms", "deepep_normal_sms")


def sim_key(program, gpu, net_group_tol: float, profile=None) -> str:
    """What a simulation's metrics depend on, hashed: the Program's ranks, world and symmetry (its
    meta is reporting only), every field of the GPU preset the simulator may read and the
    network tolerance, and the calibration profile's rows (None: the roofline). The ranks are
    hashed as exact values (``_ranks_bytes``; any object it does not know: as their ``repr``,
    which prints every dataclass field and floats exactly), so different Programs give different
    keys."""
    hw = {f.name: getattr(gpu, f.name) for f in dataclasses.fields(gpu)}
    for name in (*SCHEDULE_ONLY_GPU_FIELDS, "name"):  # the name only labels the trace
        hw.pop(name, None)
    h = hashlib.sha256()
    h.update(repr((program.world, program.symmetric, net_group_tol)).encode())
    h.update(repr(sorted(hw.items())).encode())
    try:
        h.update(b"marshal" + _ranks_bytes(program.ranks))
    except (TypeError, ValueError):  # an object the encoding does not know
        h.update(b"repr" + repr(program.ranks).encode())
    h.update(repr(None if profile is None else (profile.name, profile.rows)).encode())
    return h.hexdigest()[:24]


@functools.cache
def _encoders():
    """Per instruction class: (tag, C-level getter of its fields in field order)."""
    import operator

    from overlap_lab.shared.ir import program as P

    def getter(cls):
        names = [f.name for f in dataclasses.fields(cls)]
        if not names:
            return lambda _o: ()
        return operator.attrgetter(*names) if len(names) > 1 else lambda o: (getattr(o, names[0]),)

    simple = {
        cls: (cls.__name__, getter(cls))
        for cls in (P.Record, P.Wait, P.WaitStream, P.Host, P.Sync, P.Yield)
    }
    op_fields = [f.name for f in dataclasses.fields(P.Op)]
    kind_at, coll_at = op_fields.index("kind"), op_fields.index("coll")

    op_fields_of = getter(P.Op)

    def op_get(op):  # marshal writes exact strs only: the IR's words as str
        v = op_fields_of(op)
        return (*v[:kind_at], v[kind_at]._value_, *v[kind_at + 1 :])

    def flow_get(f):
        return (f.link._value_, f.nbytes, f.dst)

    return P, simple, op_get, coll_at, flow_get


def _ranks_bytes(ranks) -> bytes:
    """The ranks of a Program as one exact byte string, ~3x cheaper than their ``repr``.

    Every dataclass becomes a tuple of its field values in field order (C-level getters), each
    instruction tagged by its class; ``marshal`` version 2 writes them by value (type code, then
    value: floats as their 8 bytes, no references to shared or interned objects). The tags and
    the fixed arity of each tuple make the encoding unambiguous, so equal bytes mean equal ranks.
    An object of any other type (an Op subclass, a non-Flow flow) raises TypeError and one that
    marshal cannot write raises ValueError: the caller then hashes the ``repr``."""
    P, simple, op_get, coll_at, flow_get = _encoders()
    flows_memo: dict[int, tuple] = {}  # id of a flows tuple (shared by stamped ops) -> encoding

    def op_enc(op) -> tuple:
        if type(op) is not P.Op:
            raise TypeError(type(op))
        v = op_get(op)
        c = v[coll_at]
        if c is None:
            return v
        if type(c) is not P.Coll or type(c.flows) is not tuple:
            raise TypeError(type(c))
        fl = c.flows
        e = flows_memo.get(id(fl))
        if e is None:
            if any(type(f) is not P.Flow for f in fl):
                raise TypeError("flow")
            e = flows_memo[id(fl)] = tuple([flow_get(f) for f in fl])
        return (*v[:coll_at], (c.key, c.role._value_, e), *v[coll_at + 1 :])

    def ins_enc(ins) -> tuple:
        t = type(ins)
        if t is P.Launch:
            return ("L", ins.stream, op_enc(ins.op))
        if t is P.Graph:
            return ("G", ins.name, tuple([ins_enc(b) for b in ins.body]))
        tag, get = simple[t]  # KeyError for any other type
        return (tag, get(ins))

    def rank_enc(rp) -> tuple:
        if type(rp) is not P.RankProgram:
            raise TypeError(type(rp))
        threads = []
        for th in rp.threads:
            if type(th) is not P.HostThread:
                raise TypeError(type(th))
            threads.append((th.name, tuple([ins_enc(i) for i in th.instrs])))
        return (rp.rank, rp.streams, rp.priorities, tuple(threads))

    try:
        return marshal.dumps(tuple([rank_enc(rp) for rp in ranks]), 2)
    except KeyError as e:
        raise TypeError(e) from None


def lower_case(knobs: Mapping[str, Any], base: Mapping[str, Any] | None = None):
    """Build and lower one case as ``overlap-lab sim`` would, with the same input checks:
    (schedule, lowered Program, GPU, network tolerance, profile, args)."""
    return _lower(_inputs(knobs, base))


@dataclass
class _Inputs:
    """One case's checked inputs, before the (costly) build: all the build and lowering read."""

    args: argparse.Namespace
    workload: Any
    gpu: Any
    cfg: Any
    ranks: Any
    profile: Any


def _inputs(knobs: Mapping[str, Any], base: Mapping[str, Any] | None = None) -> _Inputs:
    """Parse and check one case as ``overlap-lab sim`` does (the memory check included)."""
    from overlap_lab import api
    from overlap_lab.cli import inputs
    from overlap_lab.cli.options import config_from, gpu_from, ranks_from, workload_from

    actions = _knob_actions()
    vals = dict(base if base is not None else defaults())
    for k, v in knobs.items():
        if v is not None:
            vals[k] = _convert(actions[k], v)
    # a grid crosses schedules with knobs of one schedule (serial x --comm-sms): where a knob
    # does not apply to the case's schedule it keeps its default, and such cases merge below
    schedule = str(vals.get("schedule", "serial")).strip().lower()
    plain = defaults()
    for dest, owners in inputs.KNOB_SCHEDULES.items():
        if dest in vals and schedule not in owners:
            vals[dest] = plain.get(dest)
    args = argparse.Namespace(**{**vals, "command": "sim", "out": ""})
    inputs.check_args(args)  # fills the mode's defaults; a bad case is an error row
    w, gpu, cfg = workload_from(args), gpu_from(args), config_from(args)
    inputs.check_workload(w, gpu, args)
    if args.schedule == "pp" and w.parallel.pp == 1:  # as api.simulate: pp's default stages
        w = dataclasses.replace(
            w, parallel=dataclasses.replace(w.parallel, pp=api.PP_DEFAULT_STAGES)
        )
    args.workload = w  # run_case simulates explicit ranks as api.simulate does
    profile = api.resolve_profile(getattr(args, "profile", "auto"), gpu)
    return _Inputs(args, w, gpu, cfg, ranks_from(args), profile)


def _lower(c: _Inputs):
    from overlap_lab import api
    from overlap_lab.shared.schedules import build as build_schedule

    program = build_schedule(c.args.schedule, c.workload, c.gpu, c.cfg)
    lowered = api.lower_ranks(program, c.workload, c.gpu, c.ranks)
    tol = 0.0 if lowered is program else api.NET_GROUP_TOL
    return c.args.schedule, lowered, c.gpu, tol, c.profile, c.args


# ---------------------------------------------------------------------------------------------
# Keys known before the build


#: GPU fields ``sim_key`` leaves out: a case differing from a built one only in these has the
#: same key when its build did not read them (the build is watched, ``_watching``)
_UNKEYED_GPU_FIELDS = (*SCHEDULE_ONLY_GPU_FIELDS, "name")
#: attributes through which code sees every field at once (copy, pickle, ``vars``)
_WHOLE = frozenset({"__dict__", "__getstate__", "__reduce__", "__reduce_ex__", "__copy__"})


def _watched_fields(c: _Inputs) -> dict[str, tuple[str, ...]]:
    """The inputs watched during a build, by ``_Inputs`` attribute: the GPU fields the key leaves
    out and every field of the schedule config (each schedule reads only the knobs that concern
    it, so a sweep crossing schedules with one schedule's knob learns which cases cannot differ
    from what their builds read, not from a list)."""
    return {
        "gpu": _UNKEYED_GPU_FIELDS,
        "cfg": tuple(f.name for f in dataclasses.fields(c.cfg)),
    }


def _input_key(c: _Inputs) -> str:
    """Everything a case's ``sim_key`` depends on except the watched inputs (``_watched_fields``):
    the schedule, workload, ranks, profile, event budget and every other GPU field, hashed. The
    build and the lowering are functions of (schedule, workload, GPU, config, ranks),
    deterministic like the rest of the project, and the tolerance follows from them; so two
    cases with one input key whose watched fields read by the build have equal values (their
    ``repr``: exact, and 1 and 1.0 differ) give equal Programs, equal simulator-visible GPUs,
    tolerance and profile: one ``sim_key``. The unwatched config fields need no value: the build
    did not read them."""
    hw = {f.name: getattr(c.gpu, f.name) for f in dataclasses.fields(c.gpu)}
    for name in _UNKEYED_GPU_FIELDS:
        hw.pop(name, None)
    prof = None if c.profile is None else (c.profile.name, c.profile.rows)
    parts = (c.args.schedule, c.workload, type(c.cfg), c.ranks, prof, c.args.max_events)
    h = hashlib.sha256(repr(parts).encode())
    h.update(repr(sorted(hw.items())).encode())
    return h.hexdigest()


#: (input, field) pairs of watched inputs read by the build being watched (None: no watch)
_reads: set[tuple[str, str]] | None = None


@functools.cache
def _watched_class(cls: type, role: str, names: tuple[str, ...]) -> type:
    """A subclass of an input's class (the GPU's, the config's) that notes reads of the fields
    ``names`` as ``(role, name)``. Any reader of the whole object (``dataclasses.replace``,
    ``vars``, pickle, copy) reads every field by name or through ``_WHOLE``, so it counts as
    reading them all. Equality and hashing are by identity: a cache keyed on the input
    (``ops._layer_template`` on the GPU) would otherwise return a value computed for an equal
    input in an earlier build, and the fields that computation read would go unnoticed in this
    one; by identity it misses across builds, so every value this build uses is computed from
    reads it makes (within one build the one watched object still hits)."""
    watched = frozenset(names)

    def __getattribute__(self, name: str):
        if _reads is not None:
            if name in watched:
                _reads.add((role, name))
            elif name in _WHOLE:
                _reads.update((role, n) for n in names)
        return cls.__getattribute__(self, name)

    return type(
        cls.__name__,
        (cls,),
        {
            "__getattribute__": __getattribute__,
            "__eq__": object.__eq__,
            "__hash__": object.__hash__,
            "__reduce_ex__": lambda self, protocol: (_unwatched, (cls, _init_fields(self))),
            "__slots__": (),
        },
    )


def _init_fields(obj) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}


def _unwatched(cls: type, fields: dict[str, Any]):
    """A watched input pickled or copied comes back as a plain one (its reads already counted)."""
    return cls(**fields)


def _watching(c: _Inputs) -> tuple[_Inputs, set[tuple[str, str]]]:
    """``c`` with its GPU and config replaced by equal-valued watched copies, and the set their
    reads go to (filled while ``_lower_watched`` runs)."""
    swap = {}
    for role, names in _watched_fields(c).items():
        obj = getattr(c, role)
        watched = object.__new__(_watched_class(type(obj), role, names))
        # no __post_init__ checks: they would read the fields being watched
        for k, v in _init_fields(obj).items():
            object.__setattr__(watched, k, v)
        swap[role] = watched
    return dataclasses.replace(c, **swap), set()


class _KnownKeys:
    """This worker's input keys: input key -> [(the watched fields the build read, as
    ``(input, field, repr of the value)``, sim_key)]. Only the sweep's worker consults it,
    before building a case."""

    def __init__(self, table: MutableMapping[str, list] | None = None) -> None:
        #: a plain dict, or the pool's shared one (a manager's proxy: each entry is a fact about
        #: deterministic builds, true in every worker; an update lost in a race costs a build)
        self.by_input: MutableMapping[str, list] = {} if table is None else table

    def lookup(self, ikey: str, c: _Inputs) -> str | None:
        for read, key in self.by_input.get(ikey, ()):
            if all(repr(getattr(getattr(c, r), f)) == v for r, f, v in read):
                return key
        return None

    def add(self, ikey: str, reads: set[tuple[str, str]], c: _Inputs, key: str) -> None:
        read = tuple((r, f, repr(getattr(getattr(c, r), f))) for r, f in sorted(reads))
        entries = self.by_input.get(ikey, [])
        if (read, key) not in entries:  # assigned, not appended: a proxy's get is a copy
            self.by_input[ikey] = [*entries, (read, key)]


_known = _KnownKeys()


def _lower_watched(c: _Inputs):
    """``_lower(c)`` on watched inputs: (its result with the case's own GPU, the watched fields
    it read)."""
    global _reads
    watched, reads = _watching(c)
    _reads = reads
    try:
        schedule, lowered, _, tol, profile, args = _lower(watched)
    finally:
        _reads = None
    return (schedule, lowered, c.gpu, tol, profile, args), reads


def metrics(trace, program, gpu, workload, profile=None) -> dict[str, Any]:
    """The metric columns of one simulated trace: :func:`overlap_lab.metrics.measure`'s
    definitions, so that a row and ``overlap-lab sim`` agree number for number."""
    from overlap_lab.api import _one_of_alike
    from overlap_lab.metrics import compute_kernel_us, measure
    from overlap_lab.shared.ir.program import num_ops
    from overlap_lab.sim.calibrate import cost_sources

    m = measure(trace, program, workload, gpu.num_sms)
    per_rank = trace.per_rank_step_us()
    rank = min(trace.ranks, default=0)
    one = _one_of_alike(program, trace)  # a reduced run: rank 0's ops stand for every rank's
    alike = 1 if one is program else len(program.ranks)
    counts: dict[str, int] = {}
    for by in cost_sources(one, gpu, profile).values():
        for src, n in by.items():
            counts[src] = counts.get(src, 0) + n
    return {
        "iterations": m.iterations,
        "window_us": m.window_us,
        "iteration_us": m.iteration_us,
        "step_time_us": m.iteration_us,
        "tokens": m.tokens,
        "tokens_per_s_gpu": m.tokens_per_s_gpu,
        "comm_us": m.comm_us,
        "exposed_comm_us": m.exposed_comm_us,
        "comm_only_us": trace.comm_only_us(rank) / m.iterations,
        "compute_kernel_us": compute_kernel_us(trace, rank) / m.iterations,
        "sm_compute": m.sm_compute,
        "sm_comm": m.sm_comm,
        "sm_idle": m.sm_idle,
        "max_rank_window_us": max(per_rank.values(), default=0.0),
        "min_rank_window_us": min(per_rank.values(), default=0.0),
        "num_ops": num_ops(program),
        "num_spans": len(trace.spans),
        "cost_sources": ";".join(f"{k}={n * alike}" for k, n in sorted(counts.items())),
    }


def provenance(case: _Inputs) -> dict[str, Any]:
    """The :data:`PROVENANCE` columns of one case, from its checked inputs."""
    from overlap_lab.sim.calibrate import profile_name

    w = case.workload
    return {
        "gpu_name": case.gpu.name,
        "model_name": w.model.label,  # a cut model says so: deepseek-v3[8 of 61 layers]
        "model_layers": w.model.num_layers,
        "profile_name": profile_name(case.profile),
    }


def run_case(index: int, knobs: Mapping[str, Any], claim: Callable[[str, int], int]) -> dict:
    """Lower case ``index``, claim its key, simulate it if the claim is ours.

    ``claim(key, index)`` returns the index of the case that owns ``key`` (this one when it is
    new). Returns ``{"case", "sim_key", "same_as"}`` plus the metrics (or ``error``) when this case
    simulated; a duplicate returns no metrics: its owner's are copied in by the caller."""
    from overlap_lab.shared.outputs.trace import no_gc

    out: dict[str, Any] = {"case": index, "sim_key": "", "same_as": "", "error": ""}
    # a case makes ~10^5 short-lived acyclic objects (ops, nodes, spans): the cyclic collector
    # would walk them over and over (~12 % of a case's CPU); the few cycles a case leaves are
    # freed by the first collection after it
    with no_gc():
        return _run_case(index, knobs, claim, out)


def _run_case(index: int, knobs: Mapping[str, Any], claim, out: dict[str, Any]) -> dict:
    from overlap_lab import api
    from overlap_lab.shared.ir.validate import validate
    from overlap_lab.sim.engine import Engine

    try:
        case = _inputs(knobs)
        out.update(provenance(case))
        ikey = _input_key(case)
        known = _known.lookup(ikey, case)
        if known is not None:  # a case this worker built had the same inputs: no build
            owner = claim(known, index)
            if owner != index:
                out["sim_key"], out["same_as"] = known, owner
                return out
        (_, program, gpu, tol, profile, args), reads = _lower_watched(case)
        key = out["sim_key"] = sim_key(program, gpu, tol, profile)
        _known.add(ikey, reads, case, key)
        owner = claim(key, index)
        if owner != index:
            out["same_as"] = owner
            return out
        max_events = getattr(args, "max_events", None)
        # validated once per distinct Program (its duplicates copy this row, error included);
        # explicit ranks are validated as they are simulated
        if program.symmetric:
            validate(program, gpu.num_sms)
            trace = Engine(
                program,
                gpu,
                getattr(args, "seed", 0),
                net_group_tol=tol,
                profile=profile,
                max_events=max_events,
            ).run()
        else:  # as api.simulate: ranks that cannot differ are simulated once
            trace = api.simulate_explicit(
                program, args.workload, gpu, case.ranks, profile, max_events
            )
        out.update(metrics(trace, program, gpu, case.workload, profile))
    except Exception as e:  # noqa: BLE001 - a failing case is a row, the sweep goes on
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    return out


# ---------------------------------------------------------------------------------------------
# Backends: each yields result dicts of run_case as cases finish


class _LocalClaims:
    def __init__(self, initial: Mapping[str, int] | None):
        self.owners = None if initial is None else dict(initial)

    def __call__(self, key: str, index: int) -> int:
        return index if self.owners is None else self.owners.setdefault(key, index)


_worker_claims = None


def _orphan_proof(parent: int) -> None:
    """In a child process of the sweep (a pool worker, the manager): die with the sweep (pid
    ``parent``), and leave Ctrl-C to it.

    Killed parent (SIGKILL): Linux's ``PR_SET_PDEATHSIG`` sends this process SIGTERM, whose
    default action ends it without a word, instead of a worker finishing its case and printing
    a BrokenPipe traceback into the terminal and the manager living on. A parent already gone
    before the call is seen by ``getppid`` no longer being it. Ctrl-C reaches the whole process
    group: the parent stops the pool, so the children ignore SIGINT rather than each printing
    its KeyboardInterrupt traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        try:
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
        except (OSError, AttributeError):  # no prctl: the check below still runs
            pass
    if os.getppid() != parent:
        os._exit(0)


def _init_worker(parent: int, owners, known=None) -> None:
    global _worker_claims, _known
    _orphan_proof(parent)
    _worker_claims = owners
    if known is not None:
        _known = _KnownKeys(known)


def _claim_shared(key: str, index: int) -> int:
    if _worker_claims is None:  # no deduplication
        return index
    return _worker_claims.setdefault(key, index)  # one call in the manager: atomic


def _pool_case(item: tuple[int, dict]) -> dict:
    return run_case(item[0], item[1], _claim_shared)


def _local(todo: list[tuple[int, dict]], owners: dict[str, int] | None, processes: int):
    if processes <= 1:
        claims = _LocalClaims(owners)
        for index, knobs in todo:
            yield run_case(index, knobs, claims)
        return
    from multiprocessing import Pool
    from multiprocessing.managers import SyncManager

    manager = None
    shared = known = None
    if owners is not None:  # the claims workers share: a manager process, orphan-proof too
        manager = SyncManager()
        manager.start(_orphan_proof, (os.getpid(),))
    try:
        if manager is not None:
            shared, known = manager.dict(owners), manager.dict()
        init = (os.getpid(), shared, known)
        with Pool(processes, initializer=_init_worker, initargs=init) as pool:
            yield from pool.imap_unordered(_pool_case, _spread(todo), chunksize=1)
    finally:
        if manager is not None:
            manager.shutdown()


def _spread(todo: list[tuple[int, dict]]) -> list[tuple[int, dict]]:
    """The cases in the order the workers take them: the spec's last knob slowest (each knob's
    values in their order of first appearance), so cases differing in one knob are apart.

    Workers share what their builds taught them (``_KnownKeys`` on the manager), but a case
    can use it only once the build that taught it is done. In spec order the cases of a
    knob the build does not read (serial's ``sbo_comm_sms`` values) are adjacent and the
    workers built two of them side by side; spread out, the later ones find the first one's
    key. Rows do not depend on the order (one ``sim_key``: one simulation, same metrics)."""
    if not todo:
        return todo
    names = list(todo[0][1])
    firsts: list[dict[str, int]] = [{} for _ in names]
    for _, knobs in todo:
        for seen, n in zip(firsts, names):
            seen.setdefault(repr(knobs.get(n)), len(seen))

    def order(item: tuple[int, dict]) -> tuple:
        knobs = item[1]
        at = [seen[repr(knobs.get(n))] for seen, n in zip(firsts, names)]
        return (*reversed(at), item[0])

    return sorted(todo, key=order)


def _ray(todo: list[tuple[int, dict]], owners: dict[str, int] | None, address: str | None):
    try:
        import ray
    except ImportError as e:
        raise ConfigError("--backend ray needs Ray: pip install 'overlap-lab[ray]'") from e
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)

    @ray.remote
    class Claims:
        def __init__(self, initial):
            self.owners = dict(initial)

        def claim(self, key, index):
            return self.owners.setdefault(key, index)

    @ray.remote
    def one(index, knobs, claims):
        if claims is None:
            return run_case(index, knobs, lambda k, i: i)
        return run_case(index, knobs, lambda k, i: ray.get(claims.claim.remote(k, i)))

    claims = None if owners is None else Claims.remote(owners)
    pending = [one.remote(i, k, claims) for i, k in todo]
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        yield ray.get(done[0])


# ---------------------------------------------------------------------------------------------
# The results file


def _columns(spec: Spec) -> list[str]:
    return ["case", *spec.knobs, *PROVENANCE, *METRICS, *TAIL]


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v)  # exact round trip
    if isinstance(v, (list, tuple)):
        return ",".join(str(x) for x in v)
    return str(v)


def _complete(raw: bytes) -> tuple[int, list[list[str]]]:
    """The records of a sweep CSV that were written whole, and the byte length they span.

    Rows are written by one ``csv.writer`` and flushed one by one, so a record is whole exactly
    when writing it again gives back its bytes; the first that does not (an interrupted write:
    a missing newline, a quoted field cut after a newline inside it) and anything after it is
    torn. Only the last record can be: an interrupted run appends nothing after it."""
    lines = re.findall(r"[^\n]*\n|[^\n]+", raw.decode(errors="replace"))
    consumed = 0

    def feed():
        nonlocal consumed
        for line in lines:
            consumed += 1
            yield line

    records: list[list[str]] = []
    end = done = 0
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    try:
        for rec in csv.reader(feed()):
            text = "".join(lines[done:consumed])
            buf.seek(0)
            buf.truncate()
            writer.writerow(rec)
            if buf.getvalue() != text:
                break
            records.append(rec)
            end += len(text.encode())
            done = consumed
    except csv.Error:  # a NUL byte or the like in the torn tail
        pass
    return end, records


def read_rows(path: str | Path) -> list[dict[str, str]]:
    """The complete rows of a sweep CSV (a torn last row of an interrupted run is left out)."""
    path = Path(path)
    if not path.exists():
        return []
    _, records = _complete(path.read_bytes())
    if not records:
        return []
    head, rows = records[0], records[1:]
    return [dict(zip(head, r)) for r in rows if len(r) == len(head)]


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive lock on ``path``'s lock file (``<out>.lock``, beside it) while a sweep
    writes it: a second sweep on the same file would append duplicate and interleaved rows, so
    it is refused. The lock goes with the process (flock), so a killed sweep leaves none; the
    empty file stays, as removing it could race with a sweep taking it."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_name(path.name + ".lock")
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(
                f"sweep: another sweep is writing {path}; wait for it or choose another --out"
            ) from None
        yield


def _open_csv(path: Path, columns: list[str]) -> tuple[Any, list[dict[str, str]]]:
    """Open the CSV for appending, keeping its complete rows; check it is this sweep's file."""
    done: list[dict[str, str]] = []
    if path.exists() and path.stat().st_size > 0:
        raw = path.read_bytes()
        head = raw.split(b"\n", 1)[0].decode().rstrip("\r")
        if next(csv.reader([head])) != columns:
            raise ConfigError(f"sweep: {path} holds another sweep's columns; choose another --out")
        cut, _ = _complete(raw)
        if cut < len(raw):  # a torn last row: drop it before appending
            with open(path, "rb+") as f:
                f.truncate(cut)
        done = read_rows(path)
        f = open(path, "a", newline="")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "w", newline="")
        csv.writer(f, lineterminator="\n").writerow(columns)
        f.flush()
    return f, done


def run_sweep(
    spec: Spec | str | Path | Mapping[str, Any],
    out: str | Path,
    *,
    processes: int = 2,
    backend: str = "local",
    address: str | None = None,
    progress: bool = True,
    limit: int | None = None,
    dedupe: bool = True,
    command: Sequence[str] | None = None,
) -> dict[str, int]:
    """Run the cases of ``spec`` not yet in ``out`` and append their rows as they finish.

    Beside ``out``, ``<out>.provenance.json`` records what produced it: the tool's version,
    ``command`` (the command line as typed; None from Python) and the full inputs (the spec's
    knobs and cases, and the default of every knob a case leaves out); each row names its own
    GPU, model and profile (:data:`PROVENANCE`).

    ``backend``: ``local`` (``processes`` worker processes; 1 runs here) or ``ray`` (a Ray
    cluster: ``address``, else ``RAY_ADDRESS``, else a local Ray). ``limit`` stops after that
    many new rows (as an interruption would); ``dedupe=False`` simulates every case (to measure
    what deduplication saves). Returns counts: cases, done before, simulated,
    duplicates, errors."""
    if limit is not None and limit < 1:
        raise ConfigError(f"sweep: --limit must be a positive number of cases, got {limit}")
    if processes < 1:
        raise ConfigError(f"sweep: --processes must be at least 1, got {processes}")
    if not isinstance(spec, Spec):
        spec = load_spec(spec)
    out = Path(out)
    parquet = out.suffix == ".parquet"
    csv_path = out.with_name(out.name + ".partial.csv") if parquet else out
    with _locked(csv_path):
        _write_provenance(out, spec, command)
        stats = _run_locked(spec, csv_path, processes, backend, address, progress, limit, dedupe)
    if parquet and len(read_rows(csv_path)) == len(spec.cases):
        to_parquet(csv_path, out)
        csv_path.unlink()
    return stats


def _write_provenance(out: Path, spec: Spec, command: Sequence[str] | None) -> Path:
    """``<out>.provenance.json`` (see :func:`run_sweep`); the same sweep writes the same bytes."""
    from overlap_lab.shared.outputs.trace import provenance

    doc = provenance(
        command,
        {"knobs": list(spec.knobs), "cases": list(spec.cases), "defaults": defaults()},
    )
    path = out.with_name(out.name + ".provenance.json")
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return path


def _cpus() -> int:
    """The CPUs this process may run on (its affinity, where the platform says)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def _run_locked(
    spec: Spec,
    csv_path: Path,
    processes: int,
    backend: str,
    address: str | None,
    progress: bool,
    limit: int | None,
    dedupe: bool,
) -> dict[str, int]:
    """:func:`run_sweep` with the output's lock held."""
    _known.by_input.clear()  # one sweep's table (workers fork from here): no growth across sweeps
    columns = _columns(spec)
    f, done_rows = _open_csv(csv_path, columns)
    done = {int(r["case"]) for r in done_rows}
    owners: dict[str, int] = {}
    results: dict[int, dict[str, str]] = {}  # owner index -> its metrics
    for r in done_rows:
        if r["sim_key"] and not r["error"]:
            owners.setdefault(r["sim_key"], int(r["case"]))
            results[int(r["case"])] = r
    todo = [(i, c) for i, c in enumerate(spec.cases) if i not in done]
    if limit is not None:
        todo = todo[:limit]
    # no more workers than cases to run or CPUs to run them on
    processes = max(1, min(processes, len(todo), _cpus()))
    stats = {"cases": len(spec.cases), "done_before": len(done), "simulated": 0, "duplicates": 0}
    stats["errors"] = 0
    writer = csv.writer(f, lineterminator="\n")
    waiting: dict[int, list[dict]] = {}  # owner index -> duplicates waiting for its metrics

    def write(res: dict, owner: Mapping[str, Any] | None = None) -> None:
        row = {"case": res["case"], **spec.cases[res["case"]]}
        row.update({p: res.get(p, "") for p in PROVENANCE})
        src = owner if owner is not None else res
        row.update({m: src.get(m, "") for m in METRICS})
        row.update(sim_key=res["sim_key"], error=res["error"] or "")
        if owner is not None and owner.get("error"):
            row["error"] = owner["error"]
        writer.writerow([_cell(row.get(c)) for c in columns])
        f.flush()

    from tqdm import tqdm

    bar = tqdm(total=len(todo), desc="sweep", unit="case", disable=not progress, file=sys.stderr)
    if backend == "local":
        stream: Iterable[dict] = _local(todo, owners if dedupe else None, processes)
    elif backend == "ray":
        stream = _ray(todo, owners if dedupe else None, address)
    else:
        raise ConfigError(f"sweep: backend must be local or ray, got {backend!r}")
    try:
        for res in stream:
            i = res["case"]
            if res["same_as"] != "":
                stats["duplicates"] += 1
                owner = int(res["same_as"])
                if owner in results:
                    write(res, results[owner])
                else:
                    waiting.setdefault(owner, []).append(res)
                    continue
            else:
                stats["simulated" if not res["error"] else "errors"] += 1
                results[i] = res
                write(res)
                for dup in waiting.pop(i, []):
                    write(dup, res)
                    bar.update()
            bar.update()
    finally:
        bar.close()  # before anything else is printed: the bar's line is finished
        if hasattr(stream, "close"):
            stream.close()  # the pool and the manager stop here, also on Ctrl-C
        f.close()
    return stats


def to_parquet(csv_path: str | Path, out: str | Path) -> Path:
    """A finished sweep CSV as a Parquet file, rows in case order (needs pyarrow)."""
    try:
        import pyarrow.csv as pacsv
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ConfigError("a .parquet sweep output needs pyarrow: pip install pyarrow") from e
    table = pacsv.read_csv(str(csv_path))
    table = table.sort_by("case")
    pq.write_table(table, str(out))
    return Path(out)


# ---------------------------------------------------------------------------------------------
# The subcommand


def add_parser(sub) -> None:
    """Register ``sweep`` on the CLI's subparsers."""
    s = sub.add_parser(
        "sweep",
        help="simulate every case of a sweep spec (YAML/JSON) into a CSV or Parquet file",
        description="Simulate every case of SPEC; rows stream to --out as they finish, and "
        "running again on the same --out resumes where it stopped.",
    )
    s.add_argument("spec", help="the sweep spec: base, grid and/or cases of `sim` options")
    s.add_argument(
        "--out", default=None, help="results file, .csv or .parquet (default: SPEC's name .csv)"
    )
    s.add_argument("--backend", default="local", choices=("local", "ray"))
    s.add_argument(
        "--processes", type=int, default=os.cpu_count() or 1, help="local worker processes"
    )
    s.add_argument(
        "--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else local)"
    )
    s.add_argument("--limit", type=int, default=None, help="stop after N new cases")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_sweep)


def cmd_sweep(args) -> int:
    spec = load_spec(args.spec)
    out = Path(args.out) if args.out else Path(args.spec).with_suffix(".csv")
    try:
        stats = run_sweep(
            spec,
            out,
            processes=args.processes,
            backend=args.backend,
            address=args.address,
            progress=not args.no_progress,
            limit=args.limit,
            command=getattr(args, "command_line", None),
        )
    except KeyboardInterrupt:  # the rows written so far stay: running again resumes
        partial = out.with_name(out.name + ".partial.csv") if out.suffix == ".parquet" else out
        kept = len(read_rows(partial))
        print(
            f"overlap-lab sweep: interrupted; {kept} rows kept in {out}, run again to resume",
            file=sys.stderr,
        )
        return 130
    print(
        f"{out}: {stats['cases']} cases, {stats['done_before']} done before, "
        f"{stats['simulated']} simulated, {stats['duplicates']} duplicates, "
        f"{stats['errors']} errors",
        file=sys.stderr,
    )
    return 0
