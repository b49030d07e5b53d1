"""The Program: the stream-level IR that every schedule emits and both interpreters run.

Instructions carry CUDA's meaning (see DESIGN.md, "The Program"):

- ``Launch(op, stream)``: the issuing host thread pays the launch cost; the op runs once every
  earlier op of the stream has finished, every event the stream waits on has fired and its SMs
  are free.
- ``Record(event, stream)`` fires when all work issued to the stream before it has finished.
- ``Wait(stream, event)`` holds later work of the stream until the event fires; the host goes on.
- ``WaitStream(stream, other)`` is a record on ``other`` plus a wait on ``stream``.
- ``Host(name, us)`` is host-thread time; ``Sync(event)`` blocks the host thread until the event.
- ``Yield()`` hands control to the next host thread of the rank (one thread runs at a time, as
  vLLM's ubatch threads ping-pong at ``dbo_yield``).
- ``Graph(name, body)`` replays a captured sequence of launches/records/waits for one launch cost.

Collectives are split into an issue half and a completion half (DeepEP's ``return_recv_hook``):
an op whose ``coll.role`` is ``send`` or ``sendrecv`` injects flows into the links when it starts;
an op whose role is ``recv`` (or ``sendrecv``) cannot finish before every flow of the same key
addressed to its rank has arrived.

Events are single-assignment: each is recorded once per rank, and a wait waits for that record
(CUDA would treat a wait on a not-yet-recorded event as a no-op; schedules order such pairs).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field, fields
from typing import Literal, Union

OpKind = Literal["compute", "comm", "copy"]
Role = Literal["send", "recv", "sendrecv"]
LinkKind = Literal["nvlink", "rdma", "pcie"]
OP_KINDS: tuple[str, ...] = ("compute", "comm", "copy")
ROLES: tuple[str, ...] = ("send", "recv", "sendrecv")
LINK_KINDS: tuple[str, ...] = ("nvlink", "rdma", "pcie")
#: How a kernel's thread blocks hold SMs (see ``sim.cost``, "How kernels share the SMs").
GRIDS: tuple[str, ...] = ("persistent", "dynamic", "waved", "coresident")


@dataclass(frozen=True)
class Flow:
    """Bytes one rank pushes over one link kind toward ``dst`` (None: the symmetric mirror)."""

    link: str
    nbytes: float
    dst: int | None = None


@dataclass(frozen=True)
class Coll:
    """Membership of an op in a collective: ``key`` pairs issue and completion halves."""

    key: str
    role: str
    flows: tuple[Flow, ...] = ()


@dataclass(frozen=True)
class Op:
    """One GPU kernel (or copy) with the work the cost model turns into a duration.

    ``sms`` is an upper limit for compute kernels (None: the whole GPU) and the exact number held
    by communication kernels (0 for a hook that polls nothing); copies use a copy engine and no
    SMs. For ``copy`` ops ``hbm_bytes`` are the bytes moved over PCIe.

    ``grid`` (``persistent``, ``dynamic``, ``waved`` or ``coresident``), ``ctas`` and ``ctas_per_sm`` describe
    the kernel as a grid of thread blocks (how it shares SMs with concurrent kernels); None means
    derived from the op's kind, class and work by the cost model (``sim.cost.grid``).

    ``waits`` are events the kernel consumes while it runs, as DeepEP's SBO combine polls the
    down GEMM's per-block signals: its work is cut into ``len(waits)`` equal parts and part ``i``
    cannot finish before ``waits[i]`` has fired; it holds its SMs meanwhile (one resident kernel).
    """

    name: str
    kind: str = "compute"
    layer: int | None = None
    mb: int | None = None
    step: int | None = None
    flops: float = 0.0
    hbm_bytes: float = 0.0
    dtype: str = "bf16"
    op_class: str = "elementwise"
    sms: int | None = None
    tokens: int = 0
    coll: Coll | None = None
    grid: str | None = None
    ctas: int | None = None
    ctas_per_sm: int | None = None
    waits: tuple[str, ...] = ()


@dataclass(frozen=True)
class Launch:
    op: Op
    stream: str


@dataclass(frozen=True)
class Record:
    event: str
    stream: str


@dataclass(frozen=True)
class Wait:
    stream: str
    event: str


@dataclass(frozen=True)
class WaitStream:
    stream: str
    other: str


@dataclass(frozen=True)
class Host:
    name: str
    us: float
    mb: int | None = None
    layer: int | None = None
    step: int | None = None


@dataclass(frozen=True)
class Sync:
    event: str


@dataclass(frozen=True)
class Yield:
    pass


GpuInstr = Union[Launch, Record, Wait, WaitStream]


@dataclass(frozen=True)
class Graph:
    name: str
    body: tuple[GpuInstr, ...]


Instr = Union[Launch, Record, Wait, WaitStream, Host, Sync, Yield, Graph]


@dataclass(frozen=True)
class HostThread:
    name: str
    instrs: tuple[Instr, ...]


#: CUDA stream priorities: a lower number is a higher priority (cudaStreamCreateWithPriority);
#: 0 is the default stream priority, -1 what ``torch.cuda.Stream(priority=-1)`` and PyTorch's
#: high-priority pool (``at::cuda::getStreamFromPool(true)``) give.
DEFAULT_PRIORITY = 0
HIGH_PRIORITY = -1


@dataclass(frozen=True)
class RankProgram:
    """One rank: its streams, their CUDA priorities and its host threads.

    ``priorities`` lists ``(stream, priority)`` for streams created with a non-default priority;
    the block scheduler hands free SMs to pending thread blocks of higher-priority streams first.
    """

    rank: int
    streams: tuple[str, ...]
    threads: tuple[HostThread, ...]
    priorities: tuple[tuple[str, int], ...] = ()

    def priority(self, stream: str) -> int:
        for s, p in self.priorities:
            if s == stream:
                return p
        return DEFAULT_PRIORITY


@dataclass(frozen=True)
class Program:
    """Per-rank host threads issuing to streams.

    ``world`` is the number of ranks the program stands for. With ``symmetric`` true, the program
    holds one rank's instructions and every other rank is assumed to behave identically, so a
    flow with ``dst=None`` arrives back at its sender as the mirror peer's flow would.
    ``meta`` holds what the schedule wants reported (micro-batches, fallback reasons, knobs).
    """

    ranks: tuple[RankProgram, ...]
    world: int = 1
    symmetric: bool = True
    meta: dict = field(default_factory=dict, compare=True, hash=False)

    def rank(self, r: int) -> RankProgram:
        for rp in self.ranks:
            if rp.rank == r:
                return rp
        raise KeyError(r)

    def __str__(self) -> str:
        return to_text(self)


def iter_gpu_instrs(instrs: tuple[Instr, ...]):
    """Yield every instruction, descending into graph bodies (in issue order)."""
    for ins in instrs:
        if isinstance(ins, Graph):
            yield from ins.body
        else:
            yield ins


def ops_of(program: Program) -> list[tuple[int, Op]]:
    """Every launched op with its rank, in issue order per thread."""
    out = []
    for rp in program.ranks:
        for th in rp.threads:
            for ins in iter_gpu_instrs(th.instrs):
                if isinstance(ins, Launch):
                    out.append((rp.rank, ins.op))
    return out


# ----------------------------------------------------------------------------------------------
# Text form: one instruction per line, key=value fields, parses back to the same Program.
# ----------------------------------------------------------------------------------------------

_OP_DEFAULTS = {f.name: f.default for f in fields(Op)}


def _fmt(v) -> str:
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        return str(int(v)) + ".0"
    if isinstance(v, str) and v and all(c.isalnum() or c in "._-:/+" for c in v):
        return v
    return shlex.quote(json.dumps(v)) if not isinstance(v, (int, float)) else repr(v)


def _op_text(op: Op) -> str:
    parts = [op.name]
    for f in fields(Op):
        if f.name in ("name", "coll"):
            continue
        v = getattr(op, f.name)
        if v != _OP_DEFAULTS[f.name]:
            parts.append(f"{f.name}={_fmt(v)}")
    if op.coll is not None:
        parts.append(f"coll={op.coll.key}:{op.coll.role}")
        for fl in op.coll.flows:
            dst = "sym" if fl.dst is None else str(fl.dst)
            parts.append(f"flow={fl.link}:{dst}:{_fmt(float(fl.nbytes))}")
    return " ".join(parts)


def _instr_text(ins: Instr, indent: str) -> list[str]:
    if isinstance(ins, Launch):
        return [f"{indent}launch {ins.stream} {_op_text(ins.op)}"]
    if isinstance(ins, Record):
        return [f"{indent}record {ins.event} {ins.stream}"]
    if isinstance(ins, Wait):
        return [f"{indent}wait {ins.stream} {ins.event}"]
    if isinstance(ins, WaitStream):
        return [f"{indent}wait_stream {ins.stream} {ins.other}"]
    if isinstance(ins, Host):
        extra = "".join(
            f" {k}={getattr(ins, k)}"
            for k in ("mb", "layer", "step")
            if getattr(ins, k) is not None
        )
        return [f"{indent}host {ins.name} {_fmt(float(ins.us))}{extra}"]
    if isinstance(ins, Sync):
        return [f"{indent}sync {ins.event}"]
    if isinstance(ins, Yield):
        return [f"{indent}yield"]
    if isinstance(ins, Graph):
        lines = [f"{indent}graph {ins.name} {{"]
        for b in ins.body:
            lines += _instr_text(b, indent + "  ")
        return lines + [f"{indent}}}"]
    raise TypeError(f"not an instruction: {ins!r}")


def to_text(program: Program) -> str:
    """The Program as text a reader can follow; ``parse`` gives the same Program back."""
    head = f"program world={program.world} symmetric={str(program.symmetric).lower()}"
    lines = [head]
    if program.meta:
        lines.append("meta " + json.dumps(program.meta, sort_keys=True))
    for rp in program.ranks:
        prio = dict(rp.priorities)
        decl = ",".join(f"{s}@{prio[s]}" if prio.get(s, 0) != 0 else s for s in rp.streams)
        lines.append(f"rank {rp.rank} streams={decl}")
        for th in rp.threads:
            lines.append(f"  thread {th.name}")
            for ins in th.instrs:
                lines += _instr_text(ins, "    ")
    return "\n".join(lines) + "\n"


class ParseError(ValueError):
    pass


def _num(s: str):
    try:
        return int(s)
    except ValueError:
        return float(s)


def _parse_value(name: str, raw: str):
    default = _OP_DEFAULTS[name]
    if raw.startswith('"'):
        return json.loads(raw)
    if name in ("flops", "hbm_bytes"):
        return float(raw)
    if name in ("layer", "mb", "step", "sms", "tokens", "ctas", "ctas_per_sm"):
        return int(raw)
    if name == "grid":
        return raw
    if name == "waits":
        return tuple(json.loads(raw))
    if isinstance(default, str):
        return raw
    return _num(raw)


def _parse_op(tokens: list[str], lineno: int) -> Op:
    kw: dict = {"name": tokens[0]}
    coll_key = coll_role = None
    flows: list[Flow] = []
    for tok in tokens[1:]:
        if "=" not in tok:
            raise ParseError(f"line {lineno}: expected key=value, got {tok!r}")
        k, v = tok.split("=", 1)
        if k == "coll":
            coll_key, coll_role = v.rsplit(":", 1)
        elif k == "flow":
            link, dst, nbytes = v.split(":")
            flows.append(Flow(link, float(nbytes), None if dst == "sym" else int(dst)))
        elif k in _OP_DEFAULTS:
            kw[k] = _parse_value(k, v)
        else:
            raise ParseError(f"line {lineno}: unknown op field {k!r}")
    if coll_key is not None:
        kw["coll"] = Coll(coll_key, coll_role, tuple(flows))
    elif flows:
        raise ParseError(f"line {lineno}: flow= without coll=")
    return Op(**kw)


def _parse_instr(toks: list[str], lineno: int) -> Instr:
    verb, args = toks[0], toks[1:]
    try:
        if verb == "launch":
            return Launch(_parse_op(args[1:], lineno), args[0])
        if verb == "record":
            return Record(args[0], args[1])
        if verb == "wait":
            return Wait(args[0], args[1])
        if verb == "wait_stream":
            return WaitStream(args[0], args[1])
        if verb == "host":
            kw = {k: int(v) for k, v in (a.split("=", 1) for a in args[2:])}
            return Host(args[0], float(args[1]), **kw)
        if verb == "sync":
            return Sync(args[0])
        if verb == "yield":
            return Yield()
    except (IndexError, ValueError, TypeError) as e:
        raise ParseError(f"line {lineno}: malformed {verb!r} instruction ({e})") from None
    raise ParseError(f"line {lineno}: unknown instruction {verb!r}")


def parse(text: str) -> Program:
    """Parse the text form written by ``to_text``."""
    world, symmetric, meta = 1, True, {}
    ranks: list[RankProgram] = []
    cur_rank: dict | None = None
    cur_thread: dict | None = None
    graph: dict | None = None

    def close_thread():
        nonlocal cur_thread
        if cur_thread is not None:
            cur_rank["threads"].append(HostThread(cur_thread["name"], tuple(cur_thread["instrs"])))
            cur_thread = None

    def close_rank():
        nonlocal cur_rank
        close_thread()
        if cur_rank is not None:
            ranks.append(
                RankProgram(
                    cur_rank["rank"],
                    cur_rank["streams"],
                    tuple(cur_rank["threads"]),
                    cur_rank["priorities"],
                )
            )
            cur_rank = None

    for lineno, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if s.startswith("meta "):
            meta = json.loads(s[5:])
            continue
        toks = shlex.split(s)
        verb = toks[0]
        if verb == "program":
            for t in toks[1:]:
                k, v = t.split("=", 1)
                if k == "world":
                    world = int(v)
                elif k == "symmetric":
                    symmetric = v == "true"
        elif verb == "rank":
            close_rank()
            decls = [x for x in toks[2].split("=", 1)[1].split(",") if x]
            streams = tuple(d.split("@", 1)[0] for d in decls)
            try:
                prios = tuple((n, int(p)) for n, p in (d.split("@", 1) for d in decls if "@" in d))
            except ValueError:
                raise ParseError(f"line {lineno}: bad stream priority in {toks[2]!r}") from None
            cur_rank = {
                "rank": int(toks[1]),
                "streams": streams,
                "threads": [],
                "priorities": prios,
            }
        elif verb == "thread":
            if cur_rank is None:
                raise ParseError(f"line {lineno}: thread outside a rank")
            close_thread()
            cur_thread = {"name": toks[1], "instrs": []}
        elif verb == "graph":
            if graph is not None:
                raise ParseError(f"line {lineno}: nested graph")
            graph = {"name": toks[1], "body": []}
        elif verb == "}":
            if graph is None:
                raise ParseError(f"line {lineno}: '}}' without graph")
            cur_thread["instrs"].append(Graph(graph["name"], tuple(graph["body"])))
            graph = None
        else:
            if cur_thread is None:
                raise ParseError(f"line {lineno}: instruction outside a thread")
            ins = _parse_instr(toks, lineno)
            (graph["body"] if graph is not None else cur_thread["instrs"]).append(ins)
    close_rank()
    return Program(tuple(ranks), world=world, symmetric=symmetric, meta=meta)
