"""The real executor's two plug-in kinds, registered as any package registers them (entry points,
here monkeypatched as in tests/test_plugins.py): EP communication backends
(``overlap_lab.comm_backends``) and kernel families (``overlap_lab.kernel_families``), each
picked by name on the command line. The backend and the attention family are
docs/architecture.md's worked examples, as written."""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from overlap_lab import measure  # noqa: E402
from overlap_lab.cli.main import main  # noqa: E402
from overlap_lab.real import comm  # noqa: E402
from overlap_lab.real import kernels as K  # noqa: E402
from overlap_lab.real import model as M  # noqa: E402
from overlap_lab.real.check import compare_steps, default_workloads  # noqa: E402
from overlap_lab.real.executor import execute  # noqa: E402
from overlap_lab.real.kernels import registry as R  # noqa: E402
from overlap_lab.shared import schedules as S  # noqa: E402
from overlap_lab.shared.errors import ConfigError  # noqa: E402
from overlap_lab.shared.inputs.hardware import get_gpu  # noqa: E402
from overlap_lab.shared.ir.builder import RankBuilder, program  # noqa: E402
from overlap_lab.shared.ir.program import Op  # noqa: E402
from overlap_lab.shared.plugins import Registry  # noqa: E402

GPU = get_gpu("h100")


class Plugins:
    """Entry points the test adds to a group, and the module each points into."""

    def __init__(self, monkeypatch):
        self.mp, self.found = monkeypatch, {}
        real = md.entry_points

        def entry_points(**kw):
            extra = self.found.get(kw.get("group"), [])
            return (*real(**kw), *extra) if extra else real(**kw)

        monkeypatch.setattr(md, "entry_points", entry_points)
        self._fresh()

    def _fresh(self) -> None:
        """New registries, which discover the entry points added so far."""
        self.mp.setattr(
            comm, "BACKENDS", Registry(comm.GROUP, "backend", comm.BUILTINS, comm._check)
        )
        self.mp.setattr(R, "FAMILIES", Registry(R.GROUP, "kernel family", R.BUILTINS, R._check))

    def add(self, group: str, name: str, target: str, **attrs) -> None:
        module = target.partition(":")[0]
        if attrs:
            mod = sys.modules.get(module) or types.ModuleType(module)
            for k, v in attrs.items():
                setattr(mod, k, v)
            self.mp.setitem(sys.modules, module, mod)
        ep = md.EntryPoint(name=name, value=target, group=group)
        self.found.setdefault(group, []).append(ep)
        self._fresh()


@pytest.fixture
def plugins(monkeypatch):
    return Plugins(monkeypatch)


def _doc_example(group: str) -> dict:
    """The names the example of docs/architecture.md's plug-in section for ``group`` defines,
    as written (the block that names the group)."""
    text = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    section = text.split("## Plug-ins: one way for every kind", 1)[1].split("\n## ", 1)[0]
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", section, re.S) if group in b]
    names: dict = {}
    exec(compile(code, "docs/architecture.md", "exec"), names)
    return names


CountingBackend = _doc_example(comm.GROUP)["CountingBackend"]


def test_a_backend_plugin_is_built_by_name_and_computes_serials_numbers(plugins):
    plugins.add(
        comm.GROUP, "counting", "_ol_fake_backend:CountingBackend", CountingBackend=CountingBackend
    )
    plugins.add(comm.GROUP, "broken", "_ol_no_such_backend:Backend")
    assert measure.comm_backends() == [
        "local",
        "torch",
        "emulated",
        "deepep",
        "broken",  # others after the built-ins, by name
        "counting",
        "auto",
    ]
    w = default_workloads()[0]
    rc = M.from_model_config(w.model)
    be = measure.comm_backend("counting", w, GPU)  # the run's path: the name, the run's keywords
    assert isinstance(be, CountingBackend) and be.num_experts == rc.num_experts
    weights = M.init_weights(rc, seed=0)
    prog = S.build("tbo", w, GPU)
    out = execute(
        prog,
        w,
        weights=weights,
        backend=comm.make_backend("counting", num_experts=rc.num_experts, hidden=rc.hidden),
    )
    ref = execute(S.build("serial", w, GPU), w, weights=weights)
    assert compare_steps(out.outputs[0], ref.outputs[0][0]) < 1e-5
    assert out.trace.meta["backend"] == "counting"
    with pytest.raises(ConfigError) as e:  # a broken plug-in costs its own name, in one line
        comm.make_backend("broken", num_experts=8, hidden=16)
    assert "'broken' (_ol_no_such_backend" in str(e.value) and "\n" not in str(e.value)


def test_the_command_line_takes_a_registered_backend_and_names_the_choices(plugins, capsys):
    plugins.add(
        comm.GROUP, "counting", "_ol_fake_backend:CountingBackend", CountingBackend=CountingBackend
    )
    from overlap_lab.cli import inputs
    from overlap_lab.cli.options import subcommand_parser

    args = subcommand_parser("run").parse_args(["--backend", "counting", "--device", "cpu"])
    args.command = "run"
    inputs.check_args(args)
    assert args.backend == "counting"
    assert main(["run", "--backend", "nope", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "counting" in err and "'nope'" in err


def test_a_kernel_family_plugin_is_preferred_by_name_and_never_silently(plugins, capsys):
    """A family that rebinds attn.core: named with --kernels, its kernel runs (and the check
    still proves the schedule equals serial); not named, the op two families bind is refused in
    one line naming both; an unknown name is refused before anything runs."""
    doc = _doc_example(R.GROUP)
    calls = doc["TIMES"]
    plugins.add(R.GROUP, "traced-attention", "_ol_fake_kernels:FAMILY", FAMILY=doc["FAMILY"])
    assert measure.kernel_families()[-1] == "traced-attention"
    argv = ["run", "--device", "cpu", "--check", "--schedule", "tbo", "--model", "tiny-mla"]
    assert main([*argv, "--kernels", "traced-attention"]) == 0
    assert "tbo" in capsys.readouterr().out and calls
    n = len(calls)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and "bound by two kernel families, attention and traced-attention" in err
    )
    assert len(calls) == n  # refused when the op is bound: its kernel did not run
    assert main([*argv, "--kernels", "nope"]) == 2
    assert "unknown kernel family 'nope'" in capsys.readouterr().err


def test_a_family_with_ops_of_its_own_binds_them_without_being_named(plugins):
    """A plug-in schedule's new op needs no --kernels: a family that binds only new names binds
    them by default; a family that fails to load leaves only its own ops unbound, and says so."""
    seen = []
    fam = K.KernelFamily(
        "mine", "one op of a plug-in schedule", {"my_op": lambda ctx: seen.append(ctx.op.mb)}
    )
    plugins.add(R.GROUP, "mine", "_ol_fake_family:FAMILY", FAMILY=fam)
    plugins.add(R.GROUP, "gone", "_ol_no_such_family:FAMILY")
    w = default_workloads()[0]
    r = RankBuilder(0, ("main",))
    r.thread("main").launch(Op("my_op", mb=7), "main")
    res = execute(program([r], world=1), w)
    assert seen == [7] and res.trace.meta["kernel_families"] == {"mine": 1}
    assert K.unbound(["my_op", "attn.core", "their_op"]) == ["their_op"]
    with pytest.raises(KeyError, match=r"their_op.*kernel family 'gone' \(_ol_no_such_family"):
        K.bind("their_op")
    with pytest.raises(ConfigError, match="kernel family 'gone'"):  # named, it must load
        K.bindings(["gone"])
