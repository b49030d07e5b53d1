"""An installed package, faked: a module and its ``.dist-info`` (METADATA, entry_points.txt) in a
folder put first on ``sys.path``, which ``importlib.metadata`` finds as it finds a package pip
installed. The schedule registry is rescanned on the way in and out, so a test sees the package
registered and the next test does not."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from overlap_lab.shared import schedules as S


@contextmanager
def installed(
    root: Path,
    dist: str,
    modules: Mapping[str, str],
    entry_points: Mapping[str, Mapping[str, str]],
) -> Iterator[Path]:
    """``modules`` (name -> source) and distribution ``dist`` declaring ``entry_points``
    (group -> {name: target}), importable while the context lasts."""
    root.mkdir(parents=True, exist_ok=True)
    for name, source in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{n} = {t}\n" for n, t in eps.items())
            for group, eps in entry_points.items()
        )
    )
    sys.path.insert(0, str(root))
    S.rescan()
    try:
        yield root
    finally:
        sys.path.remove(str(root))
        for name in modules:
            sys.modules.pop(name, None)
        S.rescan()
