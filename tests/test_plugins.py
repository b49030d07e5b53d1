"""The one plug-in registry (``shared.plugins``): every kind of plug-in is found by entry point,
loaded by name when used, and a broken one costs only its own name."""

from __future__ import annotations

import importlib.metadata as md
import sys
import types

import pytest

from overlap_lab.shared import plugins
from overlap_lab.shared.errors import ConfigError

GROUP = "overlap_lab.test_kind"


def _ep(name: str, value: str) -> md.EntryPoint:
    return md.EntryPoint(name=name, value=value, group=GROUP)


@pytest.fixture
def eps(monkeypatch):
    """The group's entry points, as a list the test fills."""
    found: list[md.EntryPoint] = []
    real = md.entry_points

    def entry_points(**kw):
        return tuple(found) if kw.get("group") == GROUP else real(**kw)

    monkeypatch.setattr(md, "entry_points", entry_points)
    good = types.ModuleType("_ol_test_good")
    good.THING = 42
    monkeypatch.setitem(sys.modules, "_ol_test_good", good)
    return found


def test_builtins_first_then_others_by_name_and_loaded_by_target(eps):
    eps += [_ep("zeta", "_ol_test_good:THING"), _ep("alpha", "_ol_test_good")]
    reg = plugins.Registry(GROUP, "thing", {"one": "_ol_test_good:THING"})
    assert reg.names() == ["one", "alpha", "zeta"]
    assert reg.load("one") == 42 and reg.load("zeta") == 42
    assert reg.load("alpha") is sys.modules["_ol_test_good"]


def test_a_broken_plugin_costs_its_own_name_only(eps):
    eps += [_ep("bad", "_ol_no_such_module"), _ep("ok", "_ol_test_good:THING")]
    reg = plugins.Registry(GROUP, "thing", {})
    assert reg.load("ok") == 42
    with pytest.raises(ConfigError) as e:
        reg.load("bad")
    assert "thing 'bad' (_ol_no_such_module" in str(e.value) and "\n" not in str(e.value)
    assert list(reg.broken()) == ["bad"]


def test_two_packages_claiming_one_name_make_it_unusable(eps):
    eps += [_ep("x", "_ol_test_good:THING"), _ep("x", "_ol_test_good")]
    reg = plugins.Registry(GROUP, "thing", {})
    with pytest.raises(ConfigError, match="registered twice"):
        reg.load("x")
    assert reg.usable() == []


def test_a_check_refuses_a_malformed_plugin_by_name(eps):
    eps += [_ep("x", "_ol_test_good:THING")]
    reg = plugins.Registry(GROUP, "thing", {}, check=lambda v: None if v == 0 else "is not 0")
    with pytest.raises(ConfigError, match=r"thing 'x' .* is not 0"):
        reg.load("x")
    with pytest.raises(ConfigError, match="unknown thing 'y'"):
        reg.load("y")
