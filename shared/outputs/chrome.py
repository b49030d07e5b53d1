"""The Chrome Trace Event JSON of a Trace: the one writer, and the one reader (our own export and
torch.profiler's Kineto traces). ``Trace.to_chrome`` and ``Trace.from_chrome``
(``shared/outputs/trace.py``) are its entry points.

Layout (opens in ui.perfetto.dev and chrome://tracing): one process per rank ("rank N"), one
thread per track (``Trace.tracks``: lanes, host first, then streams, then links, with
overlapping spans of a lane on sub-tracks ``"<lane> #2"``...). Deterministic: the same trace
gives the same bytes. This module imports neither matplotlib, torch nor simpy.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.files import MAX_TRACE_BYTES, read_json
from overlap_lab.shared.outputs.span import Span, Track

# torch.profiler kernel names that are communication (NCCL, DeepEP, all-to-all) or copies.
_COMM_NAME = re.compile(
    r"nccl|deep_?ep|dispatch|combine|all_?to_?all|all_?reduce|all_?gather|reduce_?scatter",
    re.IGNORECASE,
)
_COPY_NAME = re.compile(r"memcpy", re.IGNORECASE)
_SUBTRACK = re.compile(r"^(.*) #\d+$")
_PROFILER_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


def document(
    ranks: Iterable[int],
    model_of: Callable[[int], int],
    tracks_of: Callable[[int], Sequence[Track]],
    meta: Mapping[str, Any],
) -> dict[str, Any]:
    """The Chrome Trace Event JSON of a trace's ``ranks``, each drawn as the tracks of its model
    rank ``model_of(rank)`` (itself, or the rank whose spans an alike rank copies:
    ``Trace.replicated``), with ``meta`` in ``otherData``. Events with equal ``args`` share one
    dict (every rank's copy of an op, all the events of ranks alike): the document is for
    writing out, not for editing in place. Callers pause the garbage collector around it
    (``Trace.to_chrome``: ``no_gc``)."""
    events: list[dict[str, Any]] = []
    slices: list[dict[str, Any]] = []
    memo: dict[int, tuple[list[str], list[dict]]] = {}  # model rank -> names, slices
    shared: dict[tuple, dict[str, Any]] = {}  # equal args dicts: one object (see above)
    for r in ranks:
        events.append(_meta_event("process_name", r, None, {"name": f"rank {r}"}))
        events.append(_meta_event("process_sort_index", r, None, {"sort_index": r}))
        m = model_of(r)
        if m not in memo:
            tracks = tracks_of(m)
            memo[m] = (
                [t.name for t in tracks],
                [_slice_event(s, tid, shared) for tid, t in enumerate(tracks, 1) for s in t.spans],
            )
        names, model = memo[m]
        for tid, name in enumerate(names, start=1):
            events.append(_meta_event("thread_name", r, tid, {"name": name}))
            events.append(_meta_event("thread_sort_index", r, tid, {"sort_index": tid}))
        if r == m:
            slices += model
        else:  # an alike rank: the model's events but for pid (their args dicts shared)
            for e in model:
                e = e.copy()
                e["pid"] = r
                slices.append(e)
    return {
        "traceEvents": events + slices,
        "displayTimeUnit": "ns",
        "otherData": jsonable(meta),
    }


def write(doc: dict[str, Any], path: str | Path) -> None:
    """Write a :func:`document` to ``path`` (``.gz`` suffix: gzip, with no timestamp)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, separators=(",", ":"))
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        path.write_text(text)


def read(
    src: str | Path | dict | list, *, rank: int | None = None, num_sms: int | None = None
) -> tuple[list[Span], dict[str, Any]]:
    """The spans and meta of a Chrome trace: our own export, or a torch.profiler (Kineto) trace.

    Our events (args carry ``lane`` and ``kind``) come back as the exact spans written.
    torch.profiler GPU events (cat ``kernel``/``gpu_memcpy``/``gpu_memset``) become spans on
    lane ``"stream:<args.stream>"``: kind ``comm`` when the name looks like communication
    (nccl, deep_ep, dispatch, combine, all-to-all...), ``copy`` for memcpy, else ``compute``;
    times are rebased so the first kernel starts at 0 (origin in meta["time_origin_us"]).
    Their rank is ``rank``, else the trace's distributedInfo.rank, else args.device, else 0;
    ``sms`` is min(grid blocks, num_sms) when the SM count is known (argument or the trace's
    deviceProperties), else 0. Other events (CPU ops, flows, annotations) are ignored.
    """
    doc = _read_json(src)
    if isinstance(doc, list):
        doc = {"traceEvents": doc}
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        raise ConfigError("not a Chrome trace: no traceEvents list")
    names: dict[tuple[Any, Any], str] = {}
    ours: list[Span] = []
    foreign: list[tuple[int, dict[str, Any]]] = []
    with _event_errors() as at:
        for at.i, e in enumerate(events):
            at.event = e
            if not isinstance(e, dict):
                raise ValueError("not a JSON object")
            if e.get("ph") == "M" and e.get("name") == "thread_name":
                names[(e.get("pid"), e.get("tid"))] = str((e.get("args") or {}).get("name", ""))
        for at.i, e in enumerate(events):
            at.event = e
            if e.get("ph") != "X":
                continue
            args = e.get("args") or {}
            if not isinstance(args, dict):
                raise ValueError("args is not a JSON object")
            if "lane" in args and "kind" in args:
                ours.append(_span_from_ours(e, args))
            elif e.get("cat") in _PROFILER_CATS:
                foreign.append((at.i, e))
            elif "kind" in args and (e.get("pid"), e.get("tid")) in names:
                ours.append(
                    _span_from_ours(e, {**args, "lane": _lane_of(names[(e["pid"], e["tid"])])})
                )
    meta = dict(doc.get("otherData") or {}) if ours else {}
    spans = ours
    if foreign:
        spans = spans + _spans_from_profiler(doc, foreign, rank, num_sms, meta)
    return spans, meta


def _meta_event(name: str, pid: int, tid: int | None, args: dict[str, Any]) -> dict[str, Any]:
    e: dict[str, Any] = {"name": name, "ph": "M", "pid": pid}
    if tid is not None:
        e["tid"] = tid
    e["args"] = args
    return e


def _slice_event(s: Span, tid: int, shared: dict[tuple, dict[str, Any]]) -> dict[str, Any]:
    """``s``'s complete event on track ``tid``; its ``args`` taken from ``shared`` where an
    event had equal ones (every rank's copy of an op has: fewer objects to build)."""
    kind, start, end = s.kind, s.start, s.end
    dur = end - start
    exact = start + dur == end  # else the round trip needs args["end"], despite float rounding
    sms, mb, layer, step = s.sms, s.mb, s.layer, s.step
    # types too: 1 == 1.0 == True, but JSON writes them apart
    key = (s.lane, kind, sms, mb, layer, step, None if exact else end,
           type(sms), type(mb), type(layer), type(step))  # fmt: skip
    args = shared.get(key)
    if args is None:
        args = shared[key] = {"lane": s.lane, "kind": kind, "sms": sms}
        if mb is not None:
            args["mb"] = mb
        if layer is not None:
            args["layer"] = layer
        if step is not None:
            args["step"] = step
        if not exact:
            args["end"] = end
    return {
        "name": s.op,
        "cat": kind,
        "ph": "X",
        "pid": s.rank,
        "tid": tid,
        "ts": start,
        "dur": dur,
        "args": args,
    }


#: The largest time an imported event may carry, in µs from the trace's origin (about 11.6 days):
#: far beyond any step, and small enough that a kernel's duration added to it is not lost to
#: rounding (at 1e300 every sum and difference is, and the reports come out infinite).
MAX_IMPORT_US = 1e12


class _event_errors:
    """Turns the KeyError/ValueError/TypeError/OverflowError of a malformed event into one
    ConfigError naming the event (its index and name): the command line prints it as one line.
    ``i`` and ``event`` are set by the loop reading the events."""

    i: int = 0
    event: Any = None

    def __enter__(self) -> _event_errors:
        return self

    def __exit__(self, typ, exc, tb) -> None:
        if exc is None or not isinstance(exc, (KeyError, ValueError, TypeError, OverflowError)):
            return
        why = f"no {exc.args[0]!r} field" if isinstance(exc, KeyError) else str(exc)
        name = self.event.get("name") if isinstance(self.event, dict) else None
        raise ConfigError(f"trace event {self.i} ({name!r}): {why}") from None


def _number(x: Any, field: str) -> float:
    """``x`` as a finite float (JSON numbers, or their text as some writers leave them)."""
    if isinstance(x, bool) or not isinstance(x, (int, float, str)):
        raise ValueError(f"{field} {x!r} is not a number")
    try:
        t = float(x)
    except ValueError:
        raise ValueError(f"{field} {x!r} is not a number") from None
    if t != t or t in (float("inf"), float("-inf")):
        raise ValueError(f"{field} {x!r} is not a finite number")
    return t


def _time(x: Any, field: str) -> float:
    """``x`` as a time in µs from the trace's origin, within MAX_IMPORT_US of it."""
    t = _number(x, field)
    if abs(t) > MAX_IMPORT_US:
        raise ValueError(f"{field} {x!r} lies more than {MAX_IMPORT_US:.0e} us from the origin")
    return t


def _int(x: Any, field: str) -> int:
    """``x`` as an integer (a pid, rank, SM count): ``int`` would also take 2.7 or True."""
    if isinstance(x, bool) or not isinstance(x, (int, str)):
        raise ValueError(f"{field} {x!r} is not an integer")
    try:
        return int(x)
    except ValueError:
        raise ValueError(f"{field} {x!r} is not an integer") from None


def _span_from_ours(e: dict[str, Any], args: dict[str, Any]) -> Span:
    start = _time(e["ts"], "ts")
    dur = e.get("dur", 0.0)
    end = _time(args["end"], "end") if "end" in args else _time(start + _time(dur, "dur"), "ts+dur")
    return Span(
        rank=_int(e.get("pid", 0), "pid"),
        lane=str(args["lane"]),
        op=str(e.get("name", "")),
        kind=str(args["kind"]),
        start=start,
        end=end,
        sms=_int(args.get("sms", 0), "sms"),
        mb=_opt_int(args.get("mb"), "mb"),
        layer=_opt_int(args.get("layer"), "layer"),
        step=_opt_int(args.get("step"), "step"),
    )


def _lane_of(track_name: str) -> str:
    m = _SUBTRACK.match(track_name)
    return m.group(1) if m else track_name


def _opt_int(x: Any, field: str) -> int | None:
    return None if x is None else _int(x, field)


def profiler_kind(name: str, cat: str = "kernel") -> str:
    """Span kind of a torch.profiler GPU event from its name and category."""
    if cat == "gpu_memcpy" or _COPY_NAME.search(name):
        return "copy"
    if _COMM_NAME.search(name):
        return "comm"
    return "compute"


def _spans_from_profiler(
    doc: dict[str, Any],
    events: list[tuple[int, dict[str, Any]]],
    rank: int | None,
    num_sms: int | None,
    meta: dict,
) -> list[Span]:
    """Spans of the profiler's GPU events ``(index in traceEvents, event)``."""
    with _event_errors() as at:
        at.i, at.event = -1, None
        if rank is None:
            dist = doc.get("distributedInfo") or {}
            rank = dist.get("rank") if isinstance(dist, dict) else None
        sms_by_device: dict[Any, int] = {}
        for p in doc.get("deviceProperties") or []:
            if isinstance(p, dict) and "numSms" in p:
                sms_by_device[p.get("id")] = _int(p["numSms"], "deviceProperties numSms")
        starts = []
        for at.i, at.event in events:
            starts.append(_number(at.event["ts"], "ts"))  # absolute (Kineto: epoch-based)
        origin = min(starts)
        meta.setdefault("backend", "torch.profiler")
        meta["time_origin_us"] = origin
        out = []
        for (at.i, e), ts in zip(events, starts):
            at.event = e
            args = e.get("args") or {}
            device = args.get("device", 0)
            r = rank if rank is not None else (device or 0)
            n = num_sms if num_sms is not None else sms_by_device.get(device)
            sms = 0
            grid = args.get("grid")
            if n and isinstance(grid, list) and grid:
                blocks = 1
                for g in grid:
                    blocks *= _int(g, "grid")
                sms = min(blocks, n)
            if n and "num_sms" not in meta:
                meta["num_sms"] = n
            name = str(e.get("name", ""))
            start = _time(ts - origin, "ts")
            out.append(
                Span(
                    rank=_int(r, "rank"),
                    lane=f"stream:{args.get('stream', e.get('tid', 0))}",
                    op=name,
                    kind=profiler_kind(name, str(e.get("cat", "kernel"))),
                    start=start,
                    end=_time(start + _time(e.get("dur", 0.0), "dur"), "ts+dur"),
                    sms=sms,
                )
            )
    return out


def _read_json(src: str | Path | dict | list) -> Any:
    if isinstance(src, (dict, list)):
        return src
    return read_json(src, "trace", MAX_TRACE_BYTES, gunzip=True)  # bounded (shared.files)


def jsonable(x: Any) -> Any:
    """Meta as JSON: dataclasses to dicts, tuples to lists, unknown objects to their str."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return jsonable(dataclasses.asdict(x))
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)
