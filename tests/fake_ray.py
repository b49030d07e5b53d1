"""A stand-in for the few Ray calls ``overlap_lab.runner.Ray`` makes (``is_initialized``,
``init``, ``remote`` on a function and on a class, ``put``, ``get``, ``wait``), for machines
without Ray: tasks run in this process as they are submitted, their arguments and results
pickled as Ray would send them, and ``wait`` hands them back in a shuffled order (seeded), as a
cluster's workers would finish them (so a duplicate's result can come before its owner's). Install it as the ``ray`` module: ``monkeypatch.setitem(sys.modules, "ray",
FakeRay())``."""

from __future__ import annotations

import pickle
import random
from typing import Any


class ObjectRef:
    def __init__(self, value: Any) -> None:
        self._value = value

    def value(self) -> Any:
        return self._value


def _resolve(arg: Any) -> Any:
    """A task's top-level ObjectRef arguments are passed as their values, as Ray does."""
    return arg.value() if isinstance(arg, ObjectRef) else arg


class _Remote:
    """``ray.remote(fn)``: ``.remote(*args)`` runs it and returns an ObjectRef of the result."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> ObjectRef:
        sent = [a if isinstance(a, (ObjectRef, _Actor)) else pickle.loads(pickle.dumps(a))
                for a in args]  # fmt: skip
        result = self.fn(*[_resolve(a) for a in sent])
        return ObjectRef(pickle.loads(pickle.dumps(result)))


class _Actor:
    """An actor: each method's ``.remote(*args)`` runs at once (one call at a time)."""

    def __init__(self, obj) -> None:
        self._obj = obj

    def __getattr__(self, name: str):
        method = getattr(self._obj, name)
        return _Remote(method)


class _ActorClass:
    def __init__(self, cls) -> None:
        self.cls = cls

    def remote(self, *args: Any) -> _Actor:
        return _Actor(self.cls(*args))


class FakeRay:
    def __init__(self, seed: int = 0) -> None:
        self.initialized = False
        self.calls: list[str] = []
        self._rng = random.Random(seed)

    def is_initialized(self) -> bool:
        return self.initialized

    def init(self, address=None, **kw) -> None:
        self.calls.append(f"init {address}")
        self.initialized = True

    def remote(self, obj):
        self.calls.append(f"remote {getattr(obj, '__name__', obj)}")
        return _ActorClass(obj) if isinstance(obj, type) else _Remote(obj)

    def put(self, value: Any) -> ObjectRef:
        return ObjectRef(value)

    def get(self, ref: ObjectRef) -> Any:
        return ref.value()

    def wait(self, refs: list[ObjectRef], num_returns: int = 1):
        order = list(refs)
        self._rng.shuffle(order)
        done = order[:num_returns]
        return done, [r for r in refs if r not in done]
