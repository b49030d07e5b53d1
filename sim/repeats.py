"""Repeated blocks of a Program's issue order: where a run of layers is one block of instructions
repeated with its layer numbers shifted (the fast-forward's input: ``sim.fastforward``).

A model's layers are the same work with another layer index, so a rank's issue order
(``sim.host_plan``: its instructions and graph bodies by position) is, past its first
layers and before its last, one block repeated: every field of every instruction equal but the
layer, and the layer tokens ``L<n>`` of event and collective names (``shift_name``) shifted by
the same amount. ``find_regions`` finds every such run (a scheduler iteration each, in a
multi-step Program), ``index_rank`` what the fast-forward's cuts look up of the rank.
"""

from __future__ import annotations

import dataclasses
import re
from functools import lru_cache
from operator import attrgetter

from overlap_lab.shared.ir.program import (
    Coll,
    Graph,
    Host,
    Launch,
    Op,
    Record,
    Sync,
    Wait,
    WaitStream,
)

#: A layer token in an event or collective name: ``L<n>`` between dots (``s0.L12.mb0.dispatch``).
_L_TOKEN = re.compile(r"(?<![^.])L(0|-?[1-9][0-9]*)(?![^.])")
#: Fewest repeated blocks worth watching for.
MIN_BLOCKS = 4

#: Op fields compared as they are (layer, coll and waits are compared shifted).
_OP_FIELDS = attrgetter(
    "name",
    "kind",
    "mb",
    "step",
    "flops",
    "hbm_bytes",
    "dtype",
    "op_class",
    "sms",
    "tokens",
    "grid",
    "ctas",
    "ctas_per_sm",
)


@lru_cache(maxsize=1 << 16)
def _parse(name: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``name`` cut at its layer tokens: the text around them and their numbers (names repeat
    from one Program to the next: each is cut once)."""
    parts = _L_TOKEN.split(name)
    return tuple(parts[0::2]), tuple(map(int, parts[1::2]))


def shift_name(name, d: int):
    """``name`` with every layer token ``L<n>`` made ``L<n+d>`` (other names as they are)."""
    if type(name) is not str or "L" not in name:
        return name
    text, nums = _parse(name)
    if not nums or not d:
        return name
    out = [text[0]]
    for n, rest in zip(nums, text[1:]):
        out += ("L", str(n + d), rest)
    return "".join(out)


def _name_shifted(a, b, d: int) -> bool:
    """Whether ``b`` is ``shift_name(a, d)``."""
    if type(a) is not str or type(b) is not str:
        return a == b
    ta, na = _parse(a)
    tb, nb = _parse(b)
    return ta == tb and all(y - x == d for x, y in zip(na, nb))


def _shift_op(op: Op, d: int) -> Op:
    """``op`` with its layer and the layer tokens of its names shifted by ``d``."""
    c = op.coll
    coll = c if c is None else Coll(shift_name(c.key, d), c.role, c.flows)
    waits = tuple(shift_name(w, d) for w in op.waits)
    layer = None if op.layer is None else op.layer + d
    if layer == op.layer and coll == c and waits == op.waits:
        return op
    return dataclasses.replace(op, layer=layer, coll=coll, waits=waits)


def shift_instr(ins, d: int):
    """A GPU or host instruction with its layers and layer tokens shifted by ``d``."""
    t = type(ins)
    if t is Launch:
        op = _shift_op(ins.op, d)
        return ins if op is ins.op else Launch(op, ins.stream)
    if t is Record or t is Wait:
        ev = shift_name(ins.event, d)
        return ins if ev == ins.event else dataclasses.replace(ins, event=ev)
    if t is Sync:
        ev = shift_name(ins.event, d)
        return ins if ev == ins.event else Sync(ev)
    if t is Host and ins.layer is not None:
        return dataclasses.replace(ins, layer=ins.layer + d)
    return ins


def _ops_shifted(a: Op, b: Op, d: int) -> bool:
    """Whether ``b`` is ``a`` shifted by ``d`` layers."""
    if a.layer is None:
        if b.layer is not None:
            return False
    elif b.layer != a.layer + d:
        return False
    if _OP_FIELDS(a) != _OP_FIELDS(b):
        return False
    ca, cb = a.coll, b.coll
    if ca is not cb:
        if ca is None or cb is None or ca.role != cb.role or ca.flows != cb.flows:
            return False
        if not _name_shifted(ca.key, cb.key, d):
            return False
    if a.waits or b.waits:
        return len(a.waits) == len(b.waits) and all(
            _name_shifted(x, y, d) for x, y in zip(a.waits, b.waits)
        )
    return True


def _shifted(x, y, d: int) -> bool:
    """Whether atom ``y`` is atom ``x`` shifted by ``d`` layers (``_atoms``)."""
    t = type(x)
    if t is not type(y):
        return False
    if t is Launch:
        return x.stream == y.stream and _ops_shifted(x.op, y.op, d)
    if t is Record or t is Wait:
        return x.stream == y.stream and _name_shifted(x.event, y.event, d)
    if t is Sync:
        return _name_shifted(x.event, y.event, d)
    if t is Host:
        if (x.name, x.us, x.mb, x.step) != (y.name, y.us, y.mb, y.step):
            return False
        return y.layer is None if x.layer is None else y.layer == x.layer + d
    if t is Graph:  # a graph's launch (its body follows it)
        return _name_shifted(x.name, y.name, d)
    return x == y  # WaitStream, Yield


def _run_end(atoms: list, i: int, p: int, d: int) -> int:
    """The first position from ``i`` on whose instruction a block later is not it shifted by
    ``d`` layers (``_shifted``, with its commonest case, a launch of an op with no collective
    and no signals, inline: this runs once per instruction of the Program)."""
    n = len(atoms) - p
    fields = _OP_FIELDS
    seen: dict[int, tuple] = {}  # position -> its op's fields: each is read twice, made once
    while i < n:
        u, v = atoms[i], atoms[i + p]
        if type(u) is Launch and type(v) is Launch:
            a, b = u.op, v.op
            la = a.layer
            if la is None or b.layer != la + d or u.stream != v.stream:
                if not _shifted(u, v, d):
                    return i
            elif a.coll is None and b.coll is None and not a.waits and not b.waits:
                fa = seen.pop(i, None)
                fb = seen[i + p] = fields(b)
                if (fields(a) if fa is None else fa) != fb:
                    return i
            elif not _ops_shifted(a, b, d):
                return i
        elif not _shifted(u, v, d):
            return i
        i += 1
    return i


def _atoms(plan: list[tuple]) -> list:
    """The rank's instructions by position (``sim.host_plan``): a graph's launch, then its
    body."""
    out: list = []
    for _code, ins, _lane, pos, parts, _where in plan:
        assert pos == len(out)
        if type(ins) is Graph:
            out.append(ins)
            out.extend(p for _, p in parts)
        else:
            out.append(ins)
    return out


@dataclasses.dataclass
class Region:
    """Repeated blocks of one rank's issue order: positions ``[a, a + k * p)`` are ``k`` blocks
    of ``p`` instructions, each the one before shifted by ``d`` layers; ``anchor`` is the first
    launch of the first block (block ``j``'s cut is taking ``anchor + j * p`` from its queue)."""

    a: int
    p: int
    k: int
    d: int
    anchor: int
    #: the earliest position in the blocks whose event or collective an instruction after them
    #: reads (none: ``end``): blocks before it are not taken out (``FastForward._skip``)
    read_after: int = -1

    @property
    def end(self) -> int:
        return self.a + self.k * self.p


@dataclasses.dataclass
class RankIndex:
    """What the cuts read of one rank's issue order (``_atoms``)."""

    atoms: list
    regions: list[Region]
    #: per stream, the positions of its instructions, ascending
    stream_pos: dict[str, list[int]]
    #: event -> the last position that reads it (a wait, a sync, a polled signal)
    last_ref: dict
    #: collective key -> the last position of a half that receives it
    last_recv: dict
    #: positions of the launches that send flows, ascending
    sends: list[int]


def find_regions(atoms: list, plan: list[tuple]) -> list[Region]:
    """Every run of at least ``MIN_BLOCKS`` repeated blocks in a rank's issue order, in order.

    From a launch with a layer, the block is the distance to the next launch of the same name,
    stream, micro-batch and step; the run is as far as each instruction is the one a block
    before shifted (``_shifted``). A graph launched inside a run must end inside it (the blocks
    taken out, and those renamed after the run, are whole graphs)."""
    n = len(atoms)
    graph_end = {
        pos: pos + 1 + len(parts)
        for _code, ins, _lane, pos, parts, _where in plan
        if type(ins) is Graph
    }
    regions: list[Region] = []
    x = 0
    while x < n:
        u = atoms[x]
        if type(u) is not Launch or u.op.layer is None:
            x += 1
            continue
        op = u.op
        y = x + 1
        while y < n:
            v = atoms[y]
            if (
                type(v) is Launch
                and v.op.name == op.name
                and v.stream == u.stream
                and v.op.mb == op.mb
                and v.op.step == op.step
            ):
                break
            y += 1
        if y == n or v.op.layer is None or v.op.layer <= op.layer:
            x += 1
            continue
        p, d = y - x, v.op.layer - op.layer
        hi = _run_end(atoms, x, p, d)  # atoms[i + p] is atoms[i] shifted for i in [lo, hi)
        if (hi - x) // p + 2 < MIN_BLOCKS:  # too short even with a block before ``x``
            x = max(x + 1, hi)
            continue
        # the run may start up to a block before its first launch with a layer (host work, a
        # record): an earlier start would have been found from an earlier launch
        lo, start = x, max(regions[-1].end if regions else 0, x - p)
        while lo > start and _shifted(atoms[lo - 1], atoms[lo - 1 + p], d):
            lo -= 1
        k = (hi + p - lo) // p
        while k >= MIN_BLOCKS and any(lo <= g < lo + k * p < e for g, e in graph_end.items()):
            k -= 1
        anchor = next((i for i in range(lo, lo + p) if type(atoms[i]) is Launch), None)
        if k < MIN_BLOCKS or anchor is None:
            # a run of this period from any later start up to ``hi`` ends at ``hi`` too
            x = max(x + 1, hi)
            continue
        regions.append(Region(lo, p, k, d, anchor))
        x = lo + k * p
    return regions


def index_rank(plan: list[tuple], streams: tuple[str, ...]) -> RankIndex:
    """The rank's instructions by position, its repeated blocks and what its cuts look up
    (nothing to look up where no block repeats)."""
    atoms = _atoms(plan)
    regions = find_regions(atoms, plan)
    if not regions:
        return RankIndex(atoms, [], {}, {}, {}, [])
    stream_pos: dict[str, list[int]] = {s: [] for s in streams}
    last_ref: dict = {}
    last_recv: dict = {}
    sends: list[int] = []
    for i, x in enumerate(atoms):
        t = type(x)
        if t is Launch:
            stream_pos[x.stream].append(i)
            for w in x.op.waits:
                last_ref[w] = i
            c = x.op.coll
            if c is not None and c.role != "send":
                last_recv[c.key] = i
            if c is not None and c.role != "recv" and c.flows:
                sends.append(i)
        elif t is Record:
            stream_pos[x.stream].append(i)
        elif t is Wait:
            stream_pos[x.stream].append(i)
            last_ref[x.event] = i
        elif t is WaitStream:
            stream_pos[x.stream].append(i)
            stream_pos[x.other].append(i)
        elif t is Sync:
            last_ref[x.event] = i
    if regions:
        # (reader, writer) positions of events and collectives: what each run's later
        # instructions read of it
        written: dict = {}
        for i, x in enumerate(atoms):
            t = type(x)
            if t is Record and type(x.event) is str:
                written.setdefault(x.event, i)
            elif t is Launch and x.op.coll is not None and x.op.coll.role != "recv":
                written.setdefault(("coll", x.op.coll.key), i)
        reads = [(i, written.get(n)) for n, i in last_ref.items()]
        reads += [(i, written.get(("coll", k))) for k, i in last_recv.items()]
        reads = [(i, w) for i, w in reads if w is not None and w < i]
        for reg in regions:
            end = reg.end
            reg.read_after = min(
                (w for i, w in reads if i >= end and reg.a <= w < end), default=end
            )
    return RankIndex(atoms, regions, stream_pos, last_ref, last_recv, sends)


def atoms_of(rp):
    for th in rp.threads:
        for ins in th.instrs:
            if type(ins) is Graph:
                yield from ins.body
            else:
                yield ins
