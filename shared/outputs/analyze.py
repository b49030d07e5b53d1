"""What a measured GPU trace says about overlap: busy streams, hidden and exposed communication,
and where the kernel time goes, by kernel class.

Any torch.profiler (Kineto) Chrome trace goes in (read by ``Trace.from_chrome``, the one Chrome
reader); so does our own export. Each kernel's name maps to a *kernel class* through an ordered
list of regular expressions (:data:`BUILTIN_CLASSES`, first match wins), each class with a kind:
``comm`` (moves data between GPUs), ``compute`` or ``copy``. A user's mapping file comes first,
so it can add classes or override built-ins; an entry's optional ``op`` names the Program op
its kernels belong to (``label_ops``, for ``calibrate --from-trace`` and ``validate`` of a
foreign trace)::

    [{"pattern": "my_all2all_kernel", "class": "custom_a2a", "kind": "comm"},
     {"pattern": "grouped_gemm", "class": "deepgemm", "kind": "compute", "op": "experts"}]

A *stream's role* is the kind holding most of its busy time: DeepEP's communication stream also
runs small cast kernels, and it is the stream, not each kernel, that a schedule overlaps. With C
the union of the communication streams' kernels and K that of the compute streams' (copies count
with their stream):

- overlap = |C ∩ K|, exposed communication = |C| - |C ∩ K|, hidden fraction = |C ∩ K| / |C|;
- the per-class table sums kernel durations (kernels of one class on two streams count twice);
- the same three figures at kernel level (communication kernels against compute kernels, whatever
  their stream) are reported too: they differ where a stream mixes both, as a serial schedule's
  single stream does.

This module imports neither matplotlib nor torch; ``overlap-lab analyze`` draws the timeline.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.files import read_json
from overlap_lab.shared.outputs.trace import Span, Trace, intersect, length, union

KINDS: tuple[str, ...] = ("comm", "compute", "copy")


@dataclass(frozen=True)
class KernelClass:
    """Kernels whose name matches ``pattern`` (re.search, case-insensitive) are ``name``."""

    pattern: str
    name: str
    kind: str
    op: str | None = None  # the Program op these kernels belong to (``label_ops``), if any

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"kernel class {self.name!r}: kind must be one of {KINDS}")
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ConfigError(f"kernel class {self.name!r}: bad pattern ({e})") from None


#: The simulator's own op names, as the schedules emit them (``shared/ir/ops.py``,
#: ``shared/ir/ops_sched.py``, ``shared/ir/ops_pp.py``), so that ``analyze`` of a trace this tool wrote
#: names its ops instead of calling them all ``other``. Each pattern is anchored to the whole name,
#: so no library's kernel name matches one by accident; tests/test_trace_provenance.py checks that
#: every op every schedule emits falls in one of them.
OWN_CLASSES: tuple[KernelClass, ...] = (
    # the per-token FP8 quantisation kernels in front of FP8 GEMMs (attn.quant, mlp.quant, ...)
    KernelClass(r"^[\w.]+\.(\w+_)?quant$", "fp8_quant", "compute"),
    KernelClass(r"^attn\.\w+$", "attention", "compute"),
    KernelClass(r"^mtp\.\w+$", "mtp", "compute"),
    KernelClass(r"^(gate|select_experts(\.ids)?)$", "router", "compute"),
    # DeepEP normal mode's layout kernel: a compute kernel on its comm stream
    KernelClass(r"^get_dispatch_layout$", "dispatch_layout", "compute"),
    KernelClass(r"^(dispatch(_[ab])?|notify_dispatch)$", "dispatch", "comm"),
    KernelClass(r"^(combine(_[ab])?|cached_notify)$", "combine", "comm"),
    KernelClass(r"^experts(\.[\w.]+)?$", "routed_experts", "compute"),
    KernelClass(r"^shared_experts(\.act)?$", "shared_experts", "compute"),
    KernelClass(r"^mlp(\.act)?$", "dense_mlp", "compute"),
    KernelClass(r"^pp_(send|recv)_\w+$", "pp_send_recv", "comm"),
    KernelClass(r"^(embed|final_norm|logits|output)$", "embed_logits", "compute"),
    KernelClass(r"^sample$", "sampling", "compute"),
    KernelClass(r"^comm_(prepare|postprocess)_\w+$", "comm_prepare", "compute"),
    KernelClass(
        r"^(seq_lens_\w+|req_to_token_\w+|write_req_to_token_pool_triton|out_cache_loc_cast|"
        r"resolve_future|store_to_map)$",
        "batch_metadata",
        "compute",
    ),
    KernelClass(r"^(d2h|h2d)(_\w+)?$", "memcpy", "copy"),
)

#: Built-in kernel classes, in match order. Sources: kernel names as they appear in
#: torch.profiler traces of each library (symbol namespaces of DeepEP ``deep_ep::`` and DeepSeek's
#: internal ``dpsk::ep::``, DeepGEMM ``deep_gemm::`` / ``dpsk::grouped_gemm``, FlashMLA
#: ``flash_fwd_splitkv_mla`` / ``flash::``, FlashInfer ``flashinfer::``, NCCL ``ncclDevKernel`` /
#: ``ncclKernel``, Triton's generated ``triton_`` names, cuBLAS's ``sm90_xmma`` / ``cutlass``).
BUILTIN_CLASSES: tuple[KernelClass, ...] = (
    *OWN_CLASSES,
    KernelClass(r"memcpy|memset", "memcpy", "copy"),
    KernelClass(r"(deep_ep|dpsk::ep)::\w*ll\b|internode_ll|low_latency", "deepep_ll", "comm"),
    KernelClass(r"deep_ep::|dpsk::ep::", "deepep_normal", "comm"),
    KernelClass(r"nccl", "nccl", "comm"),
    KernelClass(r"deep_gemm|dpsk::grouped_gemm|fp8_gemm|m_grouped", "deepgemm", "compute"),
    KernelClass(r"flash_mla|flashmla|splitkv_mla|mla_decode", "flashmla", "compute"),
    KernelClass(r"flashinfer", "flashinfer", "compute"),
    KernelClass(r"flash::|flash_attn|flash_fwd|flash_bwd|fmha", "flashattention", "compute"),
    KernelClass(r"^triton_|triton", "triton", "compute"),
    KernelClass(r"xmma_gemm|cublas|cutlass|gemm|sm\d\d_", "cublas", "compute"),
    KernelClass(
        r"at::native|elementwise|reduce|layer_?norm|rms_?norm|rotary|cast|transpose|"
        r"topk|softmax|copy|fill|swiglu|silu|scatter|gather",
        "elementwise",
        "compute",
    ),
)
OTHER = KernelClass(r".", "other", "compute")
#: Kernels no class matches keep the kind their trace gives them (our own traces know it; the
#: Chrome reader guesses it from the name for foreign ones): "other", "other_comm", "other_copy".
_FALLBACK = {
    "compute": OTHER,
    "comm": KernelClass(r".", "other_comm", "comm"),
    "copy": KernelClass(r".", "other_copy", "copy"),
}


@dataclass(frozen=True)
class Mapping:
    """An ordered list of kernel classes: first match wins; ``other`` (compute) catches all."""

    classes: tuple[KernelClass, ...] = BUILTIN_CLASSES

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "_compiled", [(re.compile(c.pattern, re.IGNORECASE), c) for c in self.classes]
        )

    def classify(self, kernel: str, kind: str = "compute") -> KernelClass:
        """The first class whose pattern matches; else the fallback of the span's ``kind``."""
        for rx, c in self._compiled:  # type: ignore[attr-defined]
            if rx.search(kernel):
                return c
        return _FALLBACK.get(kind, OTHER)

    def with_user(self, user: tuple[KernelClass, ...]) -> Mapping:
        return Mapping(tuple(user) + self.classes)


def load_mapping(path: str | Path | None) -> Mapping:
    """The built-in mapping, with the entries of a JSON mapping file (if given) first."""
    base = Mapping()
    if path is None:
        return base
    p = Path(path)
    doc = read_json(p, "mapping")
    if not isinstance(doc, list):
        raise ConfigError(f"mapping {p.name}: expected a list of {{pattern, class, kind}}")
    user = []
    for i, d in enumerate(doc):
        if not isinstance(d, dict) or set(d) - {"pattern", "class", "kind", "op"}:
            raise ConfigError(f"mapping {p.name}: entry {i} must have pattern, class, kind")
        for k in ("pattern", "class", "kind"):
            if not isinstance(d.get(k), str):
                raise ConfigError(f"mapping {p.name}: entry {i} lacks a string {k!r}")
        if "op" in d and not isinstance(d["op"], str):
            raise ConfigError(f"mapping {p.name}: entry {i}: 'op' must be an op name")
        user.append(KernelClass(d["pattern"], d["class"], d["kind"], d.get("op")))
    return base.with_user(tuple(user))


@dataclass(frozen=True)
class StreamStats:
    lane: str
    role: str  # the kind holding most of its busy time
    busy_us: float
    kernels: int


@dataclass(frozen=True)
class ClassStats:
    name: str
    kind: str
    kernels: int
    total_us: float


@dataclass(frozen=True)
class Analysis:
    """The overlap figures of one rank of a trace (see the module docstring)."""

    rank: int
    streams: tuple[StreamStats, ...]
    classes: tuple[ClassStats, ...]
    span_us: float  # first kernel start to last kernel end
    comm_us: float  # |C|
    compute_us: float  # |K|
    overlap_us: float  # |C ∩ K|
    kernel_comm_us: float = 0.0  # the same at kernel level: communication kernels
    kernel_compute_us: float = 0.0  # compute kernels
    kernel_overlap_us: float = 0.0  # their intersection

    @property
    def exposed_comm_us(self) -> float:
        return self.comm_us - self.overlap_us

    @property
    def hidden_fraction(self) -> float:
        return self.overlap_us / self.comm_us if self.comm_us > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "span_us": self.span_us,
            "comm_busy_us": self.comm_us,
            "compute_busy_us": self.compute_us,
            "overlap_us": self.overlap_us,
            "exposed_comm_us": self.exposed_comm_us,
            "hidden_fraction": self.hidden_fraction,
            "kernel_level": {
                "comm_us": self.kernel_comm_us,
                "compute_us": self.kernel_compute_us,
                "overlap_us": self.kernel_overlap_us,
                "exposed_comm_us": self.kernel_comm_us - self.kernel_overlap_us,
            },
            "streams": [s.__dict__ for s in self.streams],
            "classes": [c.__dict__ for c in self.classes],
        }


def classify_trace(trace: Trace, mapping: Mapping) -> Trace:
    """The GPU kernels of ``trace`` with kind from their class and ``op`` their class name
    (host, sync and link spans are dropped: this is the GPU's view)."""
    out = []
    for s in trace.spans:
        if not s.lane.startswith("stream:"):
            continue
        c = mapping.classify(s.op, s.kind)
        out.append(replace(s, op=c.name, kind=c.kind))
    return Trace(tuple(out), dict(trace.meta))


def analyze(trace: Trace, mapping: Mapping | None = None, rank: int | None = None) -> Analysis:
    """Busy time per stream, communication/computation overlap and the per-class table."""
    mapping = mapping or Mapping()
    ranks = trace.ranks
    if not ranks:
        raise ConfigError("trace has no spans")
    r = ranks[0] if rank is None else rank
    if r not in ranks:
        raise ConfigError(f"trace has no rank {r}; ranks: {', '.join(map(str, ranks))}")
    kernels = [s for s in trace.spans if s.rank == r and s.lane.startswith("stream:")]
    if not kernels:
        raise ConfigError(f"rank {r} has no GPU kernels in the trace")
    by_lane: dict[str, list[Span]] = defaultdict(list)
    by_class: dict[str, list[Span]] = defaultdict(list)
    kinds: dict[str, KernelClass] = {}
    for s in kernels:
        c = mapping.classify(s.op, s.kind)
        by_lane[s.lane].append(s)
        by_class[c.name].append(s)
        kinds[c.name] = c
    streams, comm_iv, comp_iv, k_comm, k_comp = [], [], [], [], []
    for lane in sorted(by_lane, key=_lane_key):
        spans = by_lane[lane]
        per_kind: dict[str, float] = defaultdict(float)
        for s in spans:
            kind = mapping.classify(s.op, s.kind).kind
            per_kind[kind] += s.duration
            if kind != "copy":
                (k_comm if kind == "comm" else k_comp).append((s.start, s.end))
        role = (
            "comm"
            if per_kind["comm"] >= max(per_kind["compute"], per_kind["copy"], 1e-12)
            else "compute"
        )
        iv = [(s.start, s.end) for s in spans]
        streams.append(StreamStats(lane, role, length(iv), len(spans)))
        (comm_iv if role == "comm" else comp_iv).extend(iv)
    c_u, k_u = union(comm_iv), union(comp_iv)
    kc_u, kk_u = union(k_comm), union(k_comp)
    classes = sorted(
        (
            ClassStats(n, kinds[n].kind, len(ss), sum(s.duration for s in ss))
            for n, ss in by_class.items()
        ),
        key=lambda c: (-c.total_us, c.name),
    )
    return Analysis(
        rank=r,
        streams=tuple(streams),
        classes=tuple(classes),
        span_us=max(s.end for s in kernels) - min(s.start for s in kernels),
        comm_us=length(c_u),
        compute_us=length(k_u),
        overlap_us=length(intersect(c_u, k_u)),
        kernel_comm_us=length(kc_u),
        kernel_compute_us=length(kk_u),
        kernel_overlap_us=length(intersect(kc_u, kk_u)),
    )


def _lane_key(lane: str) -> tuple:
    tail = lane.split(":", 1)[1]
    return (0, int(tail), "") if tail.isdigit() else (1, 0, tail)


def to_text(a: Analysis) -> str:
    """The analysis as a reader's report: streams, overlap, per-class table."""
    lines = [f"rank {a.rank}: kernels span {a.span_us / 1e3:.3f} ms", ""]
    lines.append(f"{'stream':<16}{'role':<9}{'kernels':>8}{'busy ms':>11}")
    for s in a.streams:
        lines.append(f"{s.lane:<16}{s.role:<9}{s.kernels:>8}{s.busy_us / 1e3:>11.3f}")
    lines += [
        "",
        f"communication streams busy   {a.comm_us / 1e3:10.3f} ms",
        f"compute streams busy         {a.compute_us / 1e3:10.3f} ms",
        f"overlap                      {a.overlap_us / 1e3:10.3f} ms",
        f"exposed communication        {a.exposed_comm_us / 1e3:10.3f} ms",
        f"communication hidden         {a.hidden_fraction * 100:10.1f} %",
        "",
        "kernel level (communication kernels vs compute kernels, any stream):",
        f"  communication {a.kernel_comm_us / 1e3:.3f} ms, overlapped {a.kernel_overlap_us / 1e3:.3f}"
        f" ms, exposed {(a.kernel_comm_us - a.kernel_overlap_us) / 1e3:.3f} ms",
        "",
        f"{'kernel class':<18}{'kind':<9}{'kernels':>8}{'total ms':>11}{'share':>8}",
    ]
    total = sum(c.total_us for c in a.classes) or 1.0
    for c in a.classes:
        lines.append(
            f"{c.name:<18}{c.kind:<9}{c.kernels:>8}{c.total_us / 1e3:>11.3f}"
            f"{c.total_us / total * 100:>7.1f}%"
        )
    return "\n".join(lines) + "\n"


def label_ops(trace: Trace, mapping: Mapping, ops: Iterable) -> Trace:
    """A foreign trace's kernels labelled with ``ops``, the ops a symmetric Program's first rank
    launches in issue order (``first_rank_ops(program)``), so that it can be
    calibrated from and validated op by op.

    Kernels whose class names an ``op`` are kept; consecutive kernels of one op on one stream
    are one *occurrence* of it; on each rank, the occurrences of an op in start order take the
    (layer, micro-batch, step) of that op's launches in the Program's issue order. A count that
    differs from the Program's is an error: the mapping or the Program is not the trace's.
    """
    launches: dict[str, list] = defaultdict(list)
    for o in ops:
        launches[o.name].append(o)
    out: list[Span] = []
    for r in trace.ranks:
        occ: dict[str, list[list[Span]]] = defaultdict(list)
        last: dict[str, tuple[str, int]] = {}  # lane -> (op, index of its open occurrence)
        kernels = sorted(
            (s for s in trace.spans if s.rank == r and s.lane.startswith("stream:")),
            key=lambda s: (s.start, s.lane),
        )
        for s in kernels:
            op = mapping.classify(s.op).op
            if op is None:
                last.pop(s.lane, None)
                continue
            prev = last.get(s.lane)
            if prev is not None and prev[0] == op:
                occ[op][prev[1]].append(s)
            else:
                occ[op].append([s])
                last[s.lane] = (op, len(occ[op]) - 1)
        if not occ:
            raise ConfigError("no kernel maps to an op: give mapping entries an 'op' field")
        for op, groups in occ.items():
            want = launches.get(op, [])
            if len(groups) != len(want):
                raise ConfigError(
                    f"rank {r}: {len(groups)} occurrences of {op!r} in the trace, "
                    f"{len(want)} launches in the Program"
                )
            groups.sort(key=lambda g: g[0].start)
            for g, o in zip(groups, want):
                kind = "comm" if o.kind == "comm" else "compute"
                out += [replace(s, op=op, kind=kind, mb=o.mb, layer=o.layer, step=o.step)
                        for s in g]  # fmt: skip
    return Trace(tuple(out), dict(trace.meta))
