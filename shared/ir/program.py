"""The Program: the stream-level IR that every schedule emits and both interpreters run.

Instructions carry CUDA's meaning (docs/architecture.md, "The Program"):

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

import dataclasses
import enum
import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Union

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.ir.content import content_key
from overlap_lab.shared.ir.program_meta import ProgramMeta


class _Vocabulary(enum.StrEnum):
    """A closed set of words of the IR. Members are their strings (``OpKind.COMM == "comm"``,
    ``str()`` and f-strings give the word), so comparisons, hashing, JSON and the text form are
    those of plain strings; ``of`` turns a word into a member once, when a record is built."""

    def __repr__(self) -> str:  # records print as before: Flow(link='rdma', ...)
        return repr(self._value_)

    @classmethod
    def of(cls, word: str, what: str):
        """The member for ``word`` (a dict lookup: records are built by the hundred thousand)."""
        member = cls._value2member_map_.get(word) if isinstance(word, str) else None
        if member is None:
            raise ConfigError(f"unknown {what} {word!r}; expected one of {', '.join(cls)}")
        return member


class OpKind(_Vocabulary):
    """What runs an op: SMs (``compute``, ``comm``) or a copy engine (``copy``)."""

    COMPUTE = "compute"
    COMM = "comm"
    COPY = "copy"


class Role(_Vocabulary):
    """An op's half of a collective: issue (``send``), completion (``recv``) or both."""

    SEND = "send"
    RECV = "recv"
    SENDRECV = "sendrecv"


class LinkKind(_Vocabulary):
    """The fabric a flow crosses."""

    NVLINK = "nvlink"
    RDMA = "rdma"
    PCIE = "pcie"


#: Link kinds a flow with an explicit destination may cross (the network's ports; PCIe is local).
NET_LINK_KINDS: tuple[LinkKind, ...] = (LinkKind.NVLINK, LinkKind.RDMA)
DTYPES: tuple[str, ...] = ("bf16", "fp8")
#: Op classes: what a cost model keys an op's cost on, never its name (``sim.cost``). ``comm``
#: is DeepEP's dispatch and combine kernels, ``nccl`` NCCL's point-to-point and collective
#: kernels (the pipeline's send, recv and all-gather): they move the same bytes over the same
#: links but cost differently (DeepEP's low-latency receive, its normal kernels' channels).
OP_CLASSES: tuple[str, ...] = (
    "gemm",
    "grouped_gemm",
    "attention",
    "elementwise",
    "sampling",
    "comm",
    "nccl",
    "copy",
)
#: The op class of DeepEP's kernels: the costs that are DeepEP's key on it, with the op's kind and
#: collective role (``sim.cost.is_deepep_ll_recv``, ``shared.ir.deepep.below_published_sms``).
DEEPEP_CLASS = "comm"
#: Bounds the validator puts on a Program (docs/program.md): FLOPs or bytes of one op or flow,
#: host time of one ``Host`` (µs, about 17 minutes) and ranks in ``world``.
MAX_WORK = 1e18
MAX_HOST_US = 1e9
MAX_RANKS = 1 << 16
#: How a kernel's thread blocks hold SMs (see ``sim.cost``, "How kernels share the SMs").
GRIDS: tuple[str, ...] = ("persistent", "dynamic", "waved", "coresident")


@dataclass(frozen=True)
class Flow:
    """Bytes one rank pushes over one link kind toward ``dst`` (None: the symmetric mirror)."""

    link: LinkKind
    nbytes: float
    dst: int | None = None

    def __post_init__(self) -> None:
        if self.link.__class__ is not LinkKind:  # a plain word: checked and converted once
            object.__setattr__(self, "link", LinkKind.of(self.link, "link kind"))


@dataclass(frozen=True)
class Coll:
    """Membership of an op in a collective: ``key`` pairs issue and completion halves."""

    key: str
    role: Role
    flows: tuple[Flow, ...] = ()

    def __post_init__(self) -> None:
        if self.role.__class__ is not Role:
            object.__setattr__(self, "role", Role.of(self.role, "collective role"))


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
    kind: OpKind = OpKind.COMPUTE
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

    def __post_init__(self) -> None:
        if self.kind.__class__ is not OpKind:
            object.__setattr__(self, "kind", OpKind.of(self.kind, "op kind"))


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
    meta: ProgramMeta = field(default_factory=ProgramMeta, compare=True, hash=False)

    def rank(self, r: int) -> RankProgram:
        for rp in self.ranks:
            if rp.rank == r:
                return rp
        raise KeyError(r)

    def __str__(self) -> str:
        return to_text(self)

    def content_key(self) -> str:
        """A SHA-256 of what an interpreter runs of this Program: its ranks, world and symmetry
        (``shared.ir.content``). Programs that run alike share it, and only they, so a batch of
        simulations runs each once; ``meta``, the schedule's report about the Program, is not
        part of it (two seeds of balanced routing report two seeds and run alike)."""
        return content_key((self.ranks, self.world, self.symmetric))


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


def first_rank_ops(program: Program) -> list[Op]:
    """The ops the Program's first rank launches, in issue order per thread (a symmetric
    Program's one rank): what a measured trace's kernels are labelled with."""
    return [
        ins.op
        for th in program.ranks[0].threads
        for ins in iter_gpu_instrs(th.instrs)
        if isinstance(ins, Launch)
    ]


def num_ops(program: Program) -> int:
    """``len(ops_of(program))``, without building the list."""
    n = 0
    for rp in program.ranks:
        for th in rp.threads:
            for ins in th.instrs:
                if isinstance(ins, Launch):
                    n += 1
                elif isinstance(ins, Graph):
                    n += sum(isinstance(b, Launch) for b in ins.body)
    return n


def map_ops(program: Program, fn: Callable[[Op], Op]) -> Program:
    """``program`` with every launched op (graph bodies included) replaced by ``fn(op)``; ranks,
    streams, their priorities, threads and meta are kept as they are."""

    def instr(ins: Instr) -> Instr:
        if isinstance(ins, Launch):
            return dataclasses.replace(ins, op=fn(ins.op))
        if isinstance(ins, Graph):
            return dataclasses.replace(ins, body=tuple(instr(b) for b in ins.body))
        return ins

    ranks = tuple(
        dataclasses.replace(
            rp,
            threads=tuple(
                dataclasses.replace(th, instrs=tuple(instr(i) for i in th.instrs))
                for th in rp.threads
            ),
        )
        for rp in program.ranks
    )
    return dataclasses.replace(program, ranks=ranks)


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
        lines.append("meta " + json.dumps(program.meta.as_dict(), sort_keys=True))
    for rp in program.ranks:
        prio = dict(rp.priorities)
        decl = ",".join(f"{s}@{prio[s]}" if prio.get(s, 0) != 0 else s for s in rp.streams)
        lines.append(f"rank {rp.rank} streams={decl}")
        for th in rp.threads:
            lines.append(f"  thread {th.name}")
            for ins in th.instrs:
                lines += _instr_text(ins, "    ")
    return "\n".join(lines) + "\n"


class ParseError(ConfigError):
    """Text that is not a Program; the message names the line."""


_GPU_VERBS = ("launch", "record", "wait", "wait_stream")
_INT_FIELDS = ("layer", "mb", "step", "sms", "tokens", "ctas", "ctas_per_sm")
_FLOAT_FIELDS = ("flops", "hbm_bytes")
_HEADER_KEYS = ("world", "symmetric")


def _int(s: str, what: str) -> int:
    try:
        return int(s)
    except ValueError:
        raise ValueError(f"{what} must be an integer, got {s!r}") from None


def _float(s: str, what: str) -> float:
    try:
        return float(s)
    except ValueError:
        raise ValueError(f"{what} must be a number, got {s!r}") from None


def _parse_value(name: str, raw: str):
    default = _OP_DEFAULTS[name]
    if raw.startswith('"'):
        v = json.loads(raw)
        if not isinstance(v, str) or not isinstance(default, str):
            raise ValueError(f"{name} takes a {type(default).__name__}, got {raw}")
        return v
    if name == "waits":
        try:
            v = json.loads(raw)
        except json.JSONDecodeError:
            raise ValueError(f"waits takes a JSON list of event names, got {raw}") from None
        if not isinstance(v, list) or not all(isinstance(e, str) for e in v):
            raise ValueError(f"waits takes a JSON list of event names, got {raw}")
        return tuple(v)
    if name == "grid":
        if raw not in GRIDS:
            raise ValueError(f"grid must be one of {', '.join(GRIDS)}, got {raw!r}")
        return raw
    if name in _FLOAT_FIELDS:
        return _float(raw, name)
    if name in _INT_FIELDS:
        return _int(raw, name)
    return raw


def _parse_op(tokens: list[str]) -> Op:
    if not tokens:
        raise ValueError("launch needs a stream and an op name")
    kw: dict = {"name": tokens[0]}
    coll_key = coll_role = None
    flows: list[Flow] = []
    for tok in tokens[1:]:
        if "=" not in tok:
            raise ValueError(f"expected key=value, got {tok!r}")
        k, v = tok.split("=", 1)
        if k == "coll":
            if coll_key is not None:
                raise ValueError("coll= given twice")
            if ":" not in v:
                raise ValueError(f"coll= takes KEY:ROLE, got {v!r}")
            coll_key, coll_role = v.rsplit(":", 1)
        elif k == "flow":
            parts = v.split(":")
            if len(parts) != 3:
                raise ValueError(f"flow= takes LINK:DST:BYTES (DST a rank or sym), got {v!r}")
            link, dst, nbytes = parts
            dst_rank = None if dst == "sym" else _int(dst, "a flow's destination")
            flows.append(Flow(link, _float(nbytes, "a flow's bytes"), dst_rank))
        elif k in _OP_DEFAULTS and k != "name":
            if k in kw:
                raise ValueError(f"op field {k!r} given twice")
            kw[k] = _parse_value(k, v)
        else:
            raise ValueError(f"unknown op field {k!r}")
    if coll_key is not None:
        kw["coll"] = Coll(coll_key, coll_role, tuple(flows))
    elif flows:
        raise ValueError("flow= without coll=")
    return Op(**kw)


def _arity(verb: str, args: list[str], n: int, form: str) -> None:
    if len(args) != n:
        raise ValueError(f"{verb} takes {form}")


def _parse_instr(toks: list[str]) -> Instr:
    verb, args = toks[0], toks[1:]
    if verb == "launch":
        if len(args) < 2:
            raise ValueError("launch takes STREAM OP [key=value ...]")
        return Launch(_parse_op(args[1:]), args[0])
    if verb == "record":
        _arity(verb, args, 2, "EVENT STREAM")
        return Record(args[0], args[1])
    if verb == "wait":
        _arity(verb, args, 2, "STREAM EVENT")
        return Wait(args[0], args[1])
    if verb == "wait_stream":
        _arity(verb, args, 2, "STREAM OTHER")
        return WaitStream(args[0], args[1])
    if verb == "host":
        if len(args) < 2:
            raise ValueError("host takes NAME US [mb=N] [layer=N] [step=N]")
        kw = {}
        for a in args[2:]:
            k, sep, v = a.partition("=")
            if not sep or k not in ("mb", "layer", "step") or k in kw:
                raise ValueError(f"host takes mb=, layer= and step= once each, got {a!r}")
            kw[k] = _int(v, k)
        return Host(args[0], _float(args[1], "host time"), **kw)
    if verb == "sync":
        _arity(verb, args, 1, "EVENT")
        return Sync(args[0])
    if verb == "yield":
        _arity(verb, args, 0, "no arguments")
        return Yield()
    raise ValueError(f"unknown instruction {verb!r}")


class _Parser:
    """The text form, line by line; every error becomes one ParseError naming its line."""

    def __init__(self) -> None:
        self.world, self.symmetric, self.meta = 1, True, ProgramMeta()
        self.header = self.meta_seen = False
        self.ranks: list[RankProgram] = []
        self.rank: dict | None = None
        self.thread: dict | None = None
        self.graph: dict | None = None

    def close_thread(self) -> None:
        if self.graph is not None:
            raise ValueError(
                f"graph {self.graph['name']!r} opened on line {self.graph['line']} is not closed"
            )
        if self.thread is not None:
            th = HostThread(self.thread["name"], tuple(self.thread["instrs"]))
            self.rank["threads"].append(th)
            self.thread = None

    def close_rank(self) -> None:
        self.close_thread()
        if self.rank is not None:
            r = self.rank
            self.ranks.append(
                RankProgram(r["rank"], r["streams"], tuple(r["threads"]), r["priorities"])
            )
            self.rank = None

    def line(self, lineno: int, s: str) -> None:
        if s.startswith("meta ") or s == "meta":
            if self.meta_seen or self.rank is not None:
                raise ValueError("meta must come once, before the first rank")
            try:
                meta = json.loads(s[5:])
            except json.JSONDecodeError as e:
                raise ValueError(f"meta is not JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(meta, dict):
                raise ValueError(f"meta must be a JSON object, got {type(meta).__name__}")
            self.meta, self.meta_seen = ProgramMeta.from_dict(meta), True
            return
        toks = shlex.split(s)
        verb = toks[0]
        if verb == "program":
            self.program(toks[1:])
        elif verb == "rank":
            self.close_rank()
            if len(toks) != 3 or not toks[2].startswith("streams="):
                raise ValueError("rank takes N streams=A,B@PRIO,...")
            decls = [x for x in toks[2].split("=", 1)[1].split(",") if x]
            streams = tuple(d.split("@", 1)[0] for d in decls)
            try:
                prios = tuple((n, int(p)) for n, p in (d.split("@", 1) for d in decls if "@" in d))
            except ValueError:
                raise ValueError(f"bad stream priority in {toks[2]!r}") from None
            self.rank = {
                "rank": _int(toks[1], "rank"),
                "streams": streams,
                "threads": [],
                "priorities": prios,
            }
        elif verb == "thread":
            if self.rank is None:
                raise ValueError("thread outside a rank")
            _arity(verb, toks[1:], 1, "NAME")
            self.close_thread()
            self.thread = {"name": toks[1], "instrs": []}
        elif verb == "graph":
            if self.thread is None:
                raise ValueError("graph outside a thread")
            if self.graph is not None:
                raise ValueError("nested graph")
            if len(toks) != 3 or toks[2] != "{":
                raise ValueError("graph takes NAME {")
            self.graph = {"name": toks[1], "body": [], "line": lineno}
        elif verb == "}":
            if self.graph is None:
                raise ValueError("'}' without graph")
            _arity("'}'", toks[1:], 0, "nothing after it")
            g = self.graph
            self.thread["instrs"].append(Graph(g["name"], tuple(g["body"])))
            self.graph = None
        else:
            if self.thread is None:
                raise ValueError("instruction outside a thread")
            if self.graph is not None and verb not in _GPU_VERBS:
                raise ValueError(
                    f"{verb} cannot be captured in a graph ({', '.join(_GPU_VERBS)} only)"
                )
            ins = _parse_instr(toks)
            (self.graph["body"] if self.graph is not None else self.thread["instrs"]).append(ins)

    def program(self, args: list[str]) -> None:
        if self.header or self.rank is not None or self.meta_seen:
            raise ValueError("the program line must come once, first")
        self.header = True
        seen = set()
        for t in args:
            k, sep, v = t.partition("=")
            if not sep or k not in _HEADER_KEYS or k in seen:
                raise ValueError(f"program takes world=N and symmetric=true|false, got {t!r}")
            seen.add(k)
            if k == "world":
                self.world = _int(v, "world")
            elif v in ("true", "false"):
                self.symmetric = v == "true"
            else:
                raise ValueError(f"symmetric must be true or false, got {v!r}")


def parse(text: str) -> Program:
    """Parse the text form written by ``to_text``; ParseError names the first bad line."""
    p = _Parser()
    lineno = 0
    try:
        for lineno, line in enumerate(text.splitlines(), 1):
            s = line.strip()
            if s and not s.startswith("#"):
                p.line(lineno, s)
        lineno += 1
        p.close_rank()
    except (ValueError, TypeError, IndexError) as e:  # json and shlex errors are ValueErrors
        raise ParseError(f"line {lineno}: {e}") from None
    return Program(tuple(p.ranks), world=p.world, symmetric=p.symmetric, meta=p.meta)
