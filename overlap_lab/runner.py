"""One runner for every batch of simulations: cases in, results out.

A sweep's cases (:mod:`overlap_lab.sweep`), an experiment's (``experiments/runner.py``) and a
sensitivity design's points (:mod:`overlap_lab.sensitivity`) all run through :func:`run`, on
worker processes of this machine (:class:`Local`) or on a Ray cluster (:class:`Ray`), so every
batch gets the same pool, the same progress bar, the same handling of Ctrl-C and of a killed
parent, and the same deduplication.

A job is a function of one case, or a :class:`KeyedJob`: its ``prepare(case)`` builds what the
case needs and names the simulation by a content key (a Program's ``content_key`` and what else
the simulation reads); its ``finish(prepared)`` simulates. Cases that need one simulation run it
once: the first case of a key to reach a worker claims it and finishes; every other case of the
key returns only its own part (``Prepared.own``: what it says of itself, its inputs as it names
them) and the runner hands it the claimant's result once that is done (``Outcome.shared``).
Claims are shared by every worker (a manager process locally, an actor on Ray) and can start
from the keys of an earlier, interrupted run (``known``). Results do not depend on the order in
which cases finish: a key names one deterministic simulation.

Local workers are forked: they inherit the job (a sensitivity design's Programs, an experiment's
measure functions) instead of receiving it pickled; only cases and results cross processes. They
ignore Ctrl-C, which the caller's process reports, and die with their parent (Linux's
``PR_SET_PDEATHSIG``) rather than finishing a case into a closed pipe. Inside a daemonic process
(a pool's worker), or where the platform cannot fork, the cases run in the calling process.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from overlap_lab.shared.errors import ConfigError

C = TypeVar("C")
R = TypeVar("R")

#: ``claim(key, index)``: the index of the case that owns ``key`` (``index`` when it is new)
Claim = Callable[[str, int], int]


@dataclass(frozen=True)
class Prepared:
    """What a :class:`KeyedJob` made of one case before simulating it: the simulation's content
    ``key`` (None: nothing to share, e.g. the case failed), the ``state`` its ``finish`` needs
    (kept in the worker) and ``own``, the case's part of its result that a duplicate returns
    instead of simulating (small: it crosses processes)."""

    key: str | None
    state: Any = None
    own: Any = None


@runtime_checkable
class KeyedJob(Protocol):
    """A job whose cases name their simulation before running it (see the module docstring)."""

    def prepare(self, case: Any) -> Prepared: ...

    def finish(self, prepared: Prepared) -> Any: ...


@dataclass(frozen=True)
class Outcome:
    """One case done: its ``index``, its ``result`` (for a duplicate: its own part), its key,
    and for a duplicate ``same_as`` (the case whose simulation it shares) and ``shared`` (that
    case's result)."""

    index: int
    result: Any
    key: str | None = None
    same_as: int | None = None
    shared: Any = None


def step(job: Any, claim: Claim | None, index: int, case: Any) -> Outcome:
    """One case, in a worker: a plain job called on it; a keyed job prepared, its key claimed
    (``claim`` None: no deduplication) and finished only if the claim is this case's."""
    if not isinstance(job, KeyedJob):
        return Outcome(index, job(case))
    prepared = job.prepare(case)
    if prepared.key is not None and claim is not None:
        owner = claim(prepared.key, index)
        if owner != index:
            return Outcome(index, prepared.own, prepared.key, owner)
    return Outcome(index, job.finish(prepared), prepared.key)


class Backend(Protocol):
    """Where cases run: ``outcomes`` runs :func:`step` on each case and yields the Outcomes as
    they finish; ``owners`` (key -> owning case) seeds the shared claims, None: no claims."""

    def outcomes(
        self, job: Any, cases: Sequence[tuple[int, Any]], owners: dict[str, int] | None
    ) -> Iterator[Outcome]: ...


def run(
    job: Callable[[C], R] | KeyedJob,
    cases: Iterable[tuple[int, C]],
    *,
    backend: Backend | None = None,
    known: Mapping[str, tuple[int, Any]] | None = None,
    dedupe: bool = True,
    progress: str | None = None,
    unit: str = "case",
    leave: bool = True,
) -> Iterator[Outcome]:
    """Run ``job`` on every ``(index, case)`` and yield each case's :class:`Outcome` as it is
    done (a duplicate once the case it shares with is done), in no particular order.

    ``backend``: :class:`Local` (the default: one worker per CPU) or :class:`Ray`. For a keyed
    job, ``known`` maps keys simulated before (an interrupted run's) to ``(index, result)``,
    whose cases' results later duplicates share; ``dedupe=False`` simulates every case.
    ``progress``: the label of a progress bar on stderr (None: no bar), counting ``unit``s; the
    bar is closed before this generator ends, so what the caller prints next starts on its own
    line. Closing the generator early (Ctrl-C) stops the workers."""
    from tqdm import tqdm

    todo = list(cases)
    owners: dict[str, int] | None = None
    results: dict[int, Any] = {}
    if isinstance(job, KeyedJob) and dedupe:
        owners = {}
        for key, (index, result) in (known or {}).items():
            owners[key], results[index] = index, result
    stream = (backend or Local()).outcomes(job, todo, owners)
    waiting: dict[int, list[Outcome]] = {}  # owner index -> duplicates waiting for its result
    bar = tqdm(
        total=len(todo),
        desc=progress,
        unit=unit,
        disable=progress is None,
        leave=leave,
        file=sys.stderr,
    )
    try:
        for o in stream:
            if o.same_as is not None:
                if o.same_as in results:
                    bar.update()
                    yield dataclasses.replace(o, shared=results[o.same_as])
                else:
                    waiting.setdefault(o.same_as, []).append(o)
                continue
            if owners is not None and o.key is not None:
                results[o.index] = o.result
            bar.update()
            yield o
            for dup in waiting.pop(o.index, ()):
                bar.update()
                yield dataclasses.replace(dup, shared=o.result)
    finally:
        bar.close()
        close = getattr(stream, "close", None)
        if close is not None:
            close()  # the pool and the manager stop here, also on Ctrl-C


def in_order(job: Callable[[C], R], cases: Sequence[C], **kw: Any) -> list[R]:
    """``[job(c) for c in cases]`` through :func:`run` (``kw``: its keywords)."""
    out: dict[int, R] = {o.index: o.result for o in run(job, enumerate(cases), **kw)}
    return [out[i] for i in range(len(cases))]


# ---------------------------------------------------------------------------------------------
# Local worker processes


def cpus() -> int:
    """The CPUs this process may run on (its affinity, where the platform says)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def can_fork() -> bool:
    """Whether this process may start forked workers: the platform forks and this process is
    not a daemonic pool worker (which may have no children)."""
    return (
        "fork" in multiprocessing.get_all_start_methods()
        and not multiprocessing.current_process().daemon
    )


@dataclass(frozen=True)
class Local:
    """Forked worker processes of this machine: ``processes`` of them (None: one per CPU), never
    more than cases or CPUs; one, or none possible (:func:`can_fork`), runs in this process."""

    processes: int | None = None

    def __post_init__(self) -> None:
        if self.processes is not None and self.processes < 1:
            raise ConfigError(
                f"processes must be at least 1, got {self.processes}", names=("processes",)
            )

    def workers(self, cases: int) -> int:
        """How many processes ``cases`` cases run on (1: this one)."""
        n = min(self.processes or cpus(), cases, cpus())
        return n if n > 1 and can_fork() else 1

    def outcomes(
        self, job: Any, cases: Sequence[tuple[int, Any]], owners: dict[str, int] | None
    ) -> Iterator[Outcome]:
        n = self.workers(len(cases))
        if n == 1:
            claim = None if owners is None else dict(owners).setdefault
            for index, case in cases:
                yield step(job, claim, index, case)
            return
        from multiprocessing.managers import SyncManager

        ctx = multiprocessing.get_context("fork")
        manager = None
        try:
            claims = None
            if owners is not None:  # the claims workers share: a manager, orphan-proof too
                manager = SyncManager(ctx=ctx)
                manager.start(_orphan_proof, (os.getpid(),))
                claims = manager.dict(owners)
            init = (os.getpid(), job, claims)
            with ctx.Pool(n, initializer=_init_worker, initargs=init) as pool:
                yield from pool.imap_unordered(_pool_step, cases, chunksize=1)
        finally:
            if manager is not None:
                manager.shutdown()


def _orphan_proof(parent: int) -> None:
    """In a child process of a run (a pool worker, the manager): die with the run's process
    (pid ``parent``), and leave Ctrl-C to it.

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


#: The job and the shared claims of this worker process (set by ``_init_worker``; forked
#: workers inherit them from the pool's arguments, unpickled)
_JOB: Any = None
_CLAIM: Claim | None = None


def _init_worker(parent: int, job: Any, claims: Any) -> None:
    global _JOB, _CLAIM
    _orphan_proof(parent)
    _JOB = job
    _CLAIM = None if claims is None else claims.setdefault  # one call in the manager: atomic


def _pool_step(item: tuple[int, Any]) -> Outcome:
    return step(_JOB, _CLAIM, item[0], item[1])


# ---------------------------------------------------------------------------------------------
# Ray


@dataclass(frozen=True)
class Ray:
    """A Ray cluster: ``address`` (None: ``RAY_ADDRESS``, else a Ray started on this machine).
    One task per case; the claims live in one actor. Of Ray it uses ``is_initialized``,
    ``init``, ``remote`` (on a function and on a class), ``put``, ``get`` and ``wait``."""

    address: str | None = None

    def outcomes(
        self, job: Any, cases: Sequence[tuple[int, Any]], owners: dict[str, int] | None
    ) -> Iterator[Outcome]:
        try:
            import ray
        except ImportError as e:
            raise ConfigError("--backend ray needs Ray: pip install 'overlap-lab[ray]'") from e
        if not ray.is_initialized():
            ray.init(address=self.address, log_to_driver=False)
        claims = None if owners is None else ray.remote(_Claims).remote(dict(owners))
        task = ray.remote(_ray_step)
        shared = ray.put(job)  # sent to the cluster once, not with every case
        pending = [task.remote(shared, claims, i, c) for i, c in cases]
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            yield ray.get(done[0])


class _Claims:
    """The Ray actor that holds a run's claims (its methods run one at a time: atomic)."""

    def __init__(self, owners: dict[str, int]) -> None:
        self.owners = owners

    def claim(self, key: str, index: int) -> int:
        return self.owners.setdefault(key, index)


def _ray_step(job: Any, claims: Any, index: int, case: Any) -> Outcome:
    import ray

    claim = None if claims is None else (lambda k, i: ray.get(claims.claim.remote(k, i)))
    return step(job, claim, index, case)


def backend_of(name: str, *, processes: int | None = None, address: str | None = None) -> Backend:
    """A backend by name: ``local`` (``processes`` workers) or ``ray`` (at ``address``)."""
    if name == "local":
        return Local(processes)
    if name == "ray":
        return Ray(address)
    raise ConfigError(f"backend must be local or ray, got {name!r}")
