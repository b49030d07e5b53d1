"""What `pip install .` puts into site-packages (issue 11, item 2): one namespace, the presets as
package data, and nothing generic at the top level."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_every_installed_package_is_under_overlap_lab():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert all(p == "overlap_lab" or p.startswith("overlap_lab.") for p in cfg["packages"])
    assert set(cfg["package-dir"]) <= set(cfg["packages"])
    for pkg, folder in cfg["package-dir"].items():
        assert (ROOT / folder / "__init__.py").exists(), pkg


def test_presets_ship_as_package_data_and_yaml_is_a_dependency():
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data = doc["tool"]["setuptools"]["package-data"]["overlap_lab.shared.inputs"]
    for pattern in data:
        assert list((ROOT / "shared" / "inputs").glob(pattern)), pattern
    assert any(d.lower().startswith("pyyaml") for d in doc["project"]["dependencies"])
    assert doc["project"]["requires-python"] == ">=3.11"
