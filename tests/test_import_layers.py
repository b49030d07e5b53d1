"""The package's layers only point down, and no modules import each other in a cycle.

Layers, lowest first: ``shared`` (the Program, workloads, schedules); ``sim`` and ``real`` (the
simulator and the real executor: each over ``shared``, never over each other); the top-level
modules of ``overlap_lab`` (the API, metrics, figures, ...); ``overlap_lab.cli`` (the command
line, over the API); ``overlap_lab.experiments`` (anything). A module may import its own layer
or any below it. Every import statement counts, those inside functions too: a lazy import still
ties the modules together. Names the package loads by string (``overlap_lab.__init__``'s lazy
export map) are not imports.

The modules are found through pyproject.toml's ``package-dir`` map, as setuptools installs them.
"""

from __future__ import annotations

import ast
import tomllib
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: rank of each layer by the subpackage a module sits in; any other module of ``overlap_lab``
#: (the package itself, ``api``, ``metrics``, ...) is on ``TOP_LEVEL``
LAYERS = {"shared": 0, "sim": 1, "real": 1, "cli": 3, "experiments": 4}
TOP_LEVEL = 2
#: layers of the same rank that must not import each other
APART = frozenset({"sim", "real"})


#: inside ``shared``, by sub-package: what a user describes and what the interpreters return sit
#: below the IR and its passes, which sit below the schedules that emit them
SHARED_LAYERS = {"inputs": 0, "outputs": 0, "ir": 1, "schedules": 2}


@cache
def _modules() -> dict[str, Path]:
    """Every module of the installed namespace, by dotted name, from pyproject's package-dir."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dir = cfg["tool"]["setuptools"]["package-dir"]
    mods = {}
    for pkg, folder in package_dir.items():
        for f in (ROOT / folder).rglob("*.py"):
            parts = list(f.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([pkg, *parts])] = f
    return mods


def _owner(name: str, mods: dict[str, Path]) -> str | None:
    """The module of ours that an imported name lives in (its longest known prefix)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


@cache
def _graph() -> dict[str, frozenset[str]]:
    """module -> the modules of ours it imports, anywhere in its body."""
    mods = _modules()
    graph = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    pkg = package
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                # ``from pkg import mod`` imports the submodule; ``from mod import name`` the module
                names = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names
                ]
            else:
                continue
            for name in names:
                owner = _owner(name, mods)
                if owner is not None and owner != mod:
                    targets.add(owner)
        graph[mod] = frozenset(targets)
    return graph


def _layer(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "overlap_lab"


def _rank(mod: str) -> int:
    return LAYERS.get(_layer(mod), TOP_LEVEL)


def _cycles() -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(frozenset(comp))
    return out


def test_the_graph_sees_the_package():
    """Guards the two tests below against passing on an empty or misread graph."""
    graph = _graph()
    assert "overlap_lab.api" in graph["overlap_lab.cli.main"] | graph["overlap_lab.cli.options"]
    assert "overlap_lab.shared.ir.program" in graph["overlap_lab.api"]
    assert {"overlap_lab.cli", "overlap_lab.experiments.runner"} <= graph.keys()


def test_layers_only_point_down():
    upward = sorted(
        f"{a} -> {b}"
        for a, targets in _graph().items()
        for b in targets
        if _rank(b) > _rank(a) or {_layer(a), _layer(b)} == APART
    )
    assert not upward, "imports that point up (or between sim and real):\n" + "\n".join(upward)


def test_no_import_cycles():
    cycles = [" <-> ".join(sorted(c)) for c in _cycles()]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _shared_part(mod: str) -> str | None:
    parts = mod.split(".")
    if len(parts) > 2 and parts[1] == "shared":
        return parts[2] if parts[2] in SHARED_LAYERS else None
    return None


def test_shared_sub_packages_only_point_down():
    """shared/'s sub-packages by job: inputs and outputs import neither the IR nor the
    schedules, the IR does not import the schedules (the shared modules ``errors`` and ``jit``
    sit below them all)."""
    upward = []
    for a, targets in _graph().items():
        pa = _shared_part(a)
        if pa is None and _layer(a) == "shared" and a.count(".") >= 2:  # errors, jit
            upward += [f"{a} -> {b}" for b in targets if _layer(b) == "shared" and _shared_part(b)]
            continue
        for b in targets:
            pb = _shared_part(b)
            if pa is not None and pb is not None and SHARED_LAYERS[pb] > SHARED_LAYERS[pa]:
                upward.append(f"{a} -> {b}")
            if pa is not None and pb is not None and {pa, pb} == {"inputs", "outputs"}:
                upward.append(f"{a} -> {b}")
    assert not upward, "shared/ imports that point up or across:\n" + "\n".join(sorted(upward))
