"""The two models the engine takes from outside: what a kernel costs, and how flows cross ranks.

``sim.engine.Engine`` (and ``overlap_lab.simulate``/``compare``) receive a ``CostModel`` and a
``NetworkFactory``, each as an object or by the name it is registered under. Both register as
every plug-in does (``shared.plugins``): a package declares an entry point in
``overlap_lab.cost_models`` or ``overlap_lab.networks``, this project's built-ins included
(``roofline``: ``sim.cost.RooflineCostModel``, the roofline with per-class efficiencies, a
calibration profile where it has rows, and the wave model of CTA grids; ``max-min``:
``sim.network.Network``, per-rank ports shared max-min fairly). None gives those two. A learned
predictor or another network model plugs in without editing the engine (docs/architecture.md,
"Plugging in a cost model or a network", has a worked example of each).

What an entry point names (the construction contract, checked when the name is used):

- a cost model: a factory called once per run with the calibration profile the run resolved
  (a ``sim.profile.Profile``, or None for the roofline alone: ``--profile``), returning a
  ``CostModel``; ``RooflineCostModel`` itself is one. A model that reads no profile ignores it.
- a network: a ``NetworkFactory`` itself (``Network``, the class, is one), called once per run.

A model passed as an object is used as it is (a cost model object then reads no profile) and
recorded under its class name; one chosen by name is recorded under that name
(``trace.meta["cost_model"]``, ``trace.meta["network"]``).

What stays the engine's: the block scheduler (which kernel holds which SMs, whole waves of CTAs),
the HBM water-fill among concurrent kernels, host launch costs, streams and events, and the
per-rank links that carry symmetric flows (``dst=None``) and PCIe copies.

Units throughout: µs, bytes, bytes per µs (B/µs), SMs.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.plugins import Registry

if TYPE_CHECKING:
    import simpy

    from overlap_lab.shared.inputs.hardware import GPU
    from overlap_lab.shared.ir.program import Op
    from overlap_lab.sim.cost import Grid, KernelDemand
    from overlap_lab.sim.profile import Profile


class CostModel(Protocol):
    """What a kernel costs: its CTA grid and what it asks of the GPU on a number of SMs.

    The engine asks each distinct question once per run (answers are cached by ``key``, shared
    by every rank), so a method may be slow, but must be a pure function of its arguments: the
    same op (by ``key``), SMs and GPU must give the same answer, or runs stop being
    deterministic. A kernel lasts (``sim.cost.duration_us``)

        fixed_us + max(t_compute, nbytes / share)

    where ``share`` is the HBM bandwidth (B/µs) the engine's water-fill grants it among the
    kernels running beside it (at most ``cap``; a kernel alone gets ``min(cap, hbm_bytes_per_us)``),
    times the fraction of the grid's CTAs in the wave it runs (whole waves: ``grid``). A kernel
    with work (``op.flops`` or ``op.hbm_bytes`` above 0) also lasts at least
    ``gpu.kernel_min_us`` from its first SMs (the engine's floor). A predictor of plain
    durations returns ``KernelDemand(t_compute=us, nbytes=0, cap=0)``: HBM contention then no
    longer slows the kernel.

    A model keys its answers on what an op is (its kind, class, dtype, work, collective role),
    not on its name, so that a new op of a known class is costed with no edit; a name is for
    what was measured of that op alone (a calibration profile's row for ``attn.core``).
    """

    def key(self, op: Op) -> Hashable:
        """Every field of ``op`` that ``grid`` and ``demand`` read: two ops with equal keys must
        cost the same. Called once per kernel launch (it keys the cache)."""
        ...

    def grid(self, op: Op, limit: int) -> Grid:
        """The CTA grid of ``op`` allowed at most ``limit`` SMs: its kind (``persistent``,
        ``dynamic``, ``waved``, ``coresident``), CTAs and CTAs per SM (``sim.cost.Grid``; 0 CTAs:
        a hook that holds no SMs). Called the first time a key is launched with a limit."""
        ...

    def demand(self, op: Op, gpu: GPU, sms: int) -> KernelDemand:
        """What the whole of ``op`` asks of ``gpu`` on ``sms`` SMs (>= 1): ``t_compute`` (µs at
        its compute roof), ``nbytes`` (HBM bytes it moves), ``cap`` (B/µs: the most HBM
        bandwidth it can use there) and ``fixed_us`` (µs on top, not shared). Called whenever
        the engine re-rates a kernel on an SM count it has not asked about for that key."""
        ...

    def hbm_bytes_per_us(self, gpu: GPU) -> float:
        """The HBM bandwidth (B/µs) all kernels of ``gpu`` together may pull (the pool the
        water-fill splits). Called once per GPU when the engine is built."""
        ...

    def link(self, gpu: GPU, kind: str) -> tuple[float, float]:
        """Link ``kind`` (``nvlink``, ``rdma``, ``pcie``) of ``gpu``: (bytes per µs of one
        rank's port, latency in µs from a flow's last byte leaving to its arrival). Called once
        per kind when the engine is built: per-rank links and the network's ports."""
        ...


class NetworkModel(Protocol):
    """Flows between ranks: what the engine sends, and the arrivals it is told of.

    The engine sends every flow with an explicit destination (explicit ranks, ``Flow.dst`` set)
    here; a collective op's flows leave together, in one ``send``, when its kernel starts."""

    def send(
        self,
        src: int,
        dsts: list[int],
        kinds: list[int],
        nbytes: list[float],
        tags: list[int],
    ) -> None:
        """Start flows from rank ``src``, flow ``i`` to rank ``dsts[i]`` over the link kind of
        index ``kinds[i]`` (into the ``kinds`` the model was built with), ``nbytes[i]`` (>= 0)
        bytes, named ``tags[i]``. Each flow must be reported once, through ``on_done``, at the
        simulated time its last byte has arrived (latency included); never from inside ``send``
        (schedule a SimPy event, even of delay 0)."""
        ...


class NetworkFactory(Protocol):
    """Builds the network of one run: ``sim.network.Network`` itself is one (its class)."""

    def __call__(
        self,
        env: simpy.Environment,
        world: int,
        kinds: dict[str, tuple[float, float]],
        on_done: Callable[[np.ndarray, np.ndarray], None],
        group_tol: float,
    ) -> NetworkModel:
        """The network of ``world`` ranks on ``env``. ``kinds``: link kind (``nvlink``, then
        ``rdma``) -> (bytes per µs of one rank's egress or ingress port, latency µs), from the
        cost model's ``link``; a kind's index is its position. ``on_done(tags, kinds)``: int64
        arrays of the tags and kind indices of flows arriving now (one call may report many).
        ``group_tol``: how far the run lets arrivals be grouped (0 exact; the API's explicit
        ranks use 0.02), which a model may ignore. Called once, when the engine is built."""
        ...


#: The entry-point groups of cost models and networks, and the names used when none is given.
COST_MODEL_GROUP, NETWORK_GROUP = "overlap_lab.cost_models", "overlap_lab.networks"
DEFAULT_COST_MODEL, DEFAULT_NETWORK = "roofline", "max-min"
#: What a cost model must answer (``CostModel``), checked on the object a factory returns.
COST_MODEL_METHODS = ("key", "grid", "demand", "hbm_bytes_per_us", "link")


def _a_factory(obj: Any) -> str | None:
    return None if callable(obj) else "is not callable (an entry point names a factory)"


#: The registries of both groups (``shared.plugins``): built-ins first, found by entry point,
#: loaded when used.
COST_MODELS = Registry(
    COST_MODEL_GROUP,
    "cost model",
    {DEFAULT_COST_MODEL: "overlap_lab.sim.cost:RooflineCostModel"},
    _a_factory,
)
NETWORKS = Registry(
    NETWORK_GROUP, "network", {DEFAULT_NETWORK: "overlap_lab.sim.network:Network"}, _a_factory
)


def class_name(obj: Any) -> str:
    """The name a model passed as an object is recorded under: its class's (a function's own)."""
    return getattr(obj, "__name__", type(obj).__name__)


def cost_model(spec: CostModel | str | None, profile: Profile | None) -> tuple[CostModel, str]:
    """The cost model ``spec`` gives and the name it is recorded under: None, the default; a
    name, its registered factory called with ``profile``; an object, itself (``profile`` unread).
    A plug-in that fails to build, or builds a model that lacks a method, is one ConfigError
    naming its package."""
    if spec is not None and not isinstance(spec, str):
        return spec, class_name(spec)
    name = DEFAULT_COST_MODEL if spec is None else spec
    factory = COST_MODELS.load(name)
    try:
        model = factory(profile)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure of a plug-in is its own
        msg = str(err).splitlines()[0] if str(err) else ""
        raise ConfigError(
            f"{COST_MODELS.where(name)} cannot be built: {type(err).__name__}: {msg}"
        ) from None
    missing = [m for m in COST_MODEL_METHODS if not callable(getattr(model, m, None))]
    if missing:
        raise ConfigError(f"{COST_MODELS.where(name)} built a model without {', '.join(missing)}")
    return model, name


def network(spec: NetworkFactory | str | None) -> tuple[NetworkFactory, str]:
    """The network factory ``spec`` gives and the name it is recorded under: None, the default;
    a name, its registered factory; an object, itself."""
    if spec is not None and not isinstance(spec, str):
        return spec, class_name(spec)
    name = DEFAULT_NETWORK if spec is None else spec
    return NETWORKS.load(name), name


def check_model_names(cost_model: Any, network: Any) -> None:
    """ConfigError (one line, the choices listed) when either is a name nobody registered, or
    whose plug-in cannot load: before a run builds anything."""
    for spec, registry in ((cost_model, COST_MODELS), (network, NETWORKS)):
        if isinstance(spec, str):
            registry.load(spec)
