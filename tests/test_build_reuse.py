"""Program build reuses what cannot differ: one layer's ops computed once and stamped per layer,
no numpy-heavy module imported to build a Program, and the starvation check's need groups give
the verdicts of a scan of every launch."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from hypothesis import given

from overlap_lab.shared.errors import ConfigError
from overlap_lab.shared.inputs.hardware import get_gpu
from overlap_lab.shared.inputs.workload import Batch, MicroBatch, Parallel, Workload, get_model
from overlap_lab.shared.ir.ops import MOE_OP_NAMES, expand_keys, layer_ops
from tests.fuzz_helpers import fuzz_settings
from tests.test_fuzz_program import mutated


def _workload(ep: int = 32) -> Workload:
    return Workload(get_model("deepseek-v3"), Batch.decode(64, kv_len=4096), Parallel(ep=ep))


def test_layers_differ_only_in_layer_and_collective_key():
    w, gpu = _workload(), get_gpu("h800")
    n = w.batch.num_tokens
    mb = MicroBatch(0, 0, w.batch.num_seqs, 0, n, n)
    a, b = layer_ops(w, gpu, 5, mb, step=2), layer_ops(w, gpu, 40, mb, step=2)
    assert list(a) == [k for k in expand_keys(MOE_OP_NAMES) if k in a] == list(b)
    for name in a:
        assert (a[name].layer, b[name].layer) == (5, 40)
        if a[name].coll is not None:
            assert a[name].coll.key == f"s2.L5.mb0.{name.split('_')[0]}"
            assert b[name].coll.key == f"s2.L40.mb0.{name.split('_')[0]}"
            assert dataclasses.replace(a[name].coll, key="") == dataclasses.replace(
                b[name].coll, key=""
            )
        assert dataclasses.replace(a[name], layer=0, coll=None) == dataclasses.replace(
            b[name], layer=0, coll=None
        )
    # a dense layer is not a MoE layer's template with another layer number
    dense = layer_ops(w, gpu, 0, mb, step=2)
    assert "mlp" in dense and "experts" not in dense


def test_template_depends_on_what_an_op_depends_on():
    gpu = get_gpu("h800")
    w16, w32 = _workload(16), _workload(32)
    mb = MicroBatch(0, 0, 64, 0, 64, 64)
    d16 = layer_ops(w16, gpu, 3, mb)["dispatch_a"]
    d32 = layer_ops(w32, gpu, 3, mb)["dispatch_a"]
    assert d16.coll.flows != d32.coll.flows
    assert layer_ops(w32, gpu, 3, mb, step=None)["dispatch_a"].coll.key == "sNone.L3.mb0.dispatch"
    normal = layer_ops(w32, gpu, 3, mb, deepep_mode="normal")["dispatch_a"]
    assert normal.coll.role == "sendrecv" and d32.coll.role == "send"


def test_building_a_program_imports_no_routing_sampler():
    code = (
        "import sys\n"
        "from overlap_lab.shared.inputs.hardware import get_gpu\n"
        "from overlap_lab.shared.schedules import build\n"
        "from overlap_lab.shared.inputs.workload import Batch, Parallel, Workload, get_model\n"
        "w = Workload(get_model('deepseek-v3'), Batch.decode(128, kv_len=4096), Parallel(ep=32))\n"
        "build('tbo', w, get_gpu('h800'))\n"
        "print(sorted(m for m in ('overlap_lab.shared.ir.deepep', 'overlap_lab.shared.inputs.routing')"
        " if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _every_need(by_need, sender, started, start) -> int:
    """The starvation check's largest competing need by a scan of every launch (the reference)."""
    return max(
        (
            n
            for n, ps in by_need
            for p in ps
            if p <= sender and p[1] not in started and p[1] != start
        ),
        default=0,
    )


def _verdict(text: str, reference: bool) -> str:
    """The validator's verdict; ``reference``: a scan of every launch for the competing need, as
    before the need groups."""
    from overlap_lab.shared.ir import starvation
    from overlap_lab.shared.ir import validate as v
    from overlap_lab.shared.ir.program import ParseError, parse

    old = starvation._largest_need
    if reference:
        starvation._largest_need = _every_need
    try:
        v._SOUND.clear()
        v.validate(parse(text), get_gpu("h800").num_sms)
    except (ParseError, v.ProgramError, ConfigError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        starvation._largest_need = old
        v._SOUND.clear()
    return "ok"


@fuzz_settings(80)
@given(mutated())
def test_starvation_need_groups_give_the_scans_verdicts(text):
    """The starvation check's need groups against a scan of every launch (the check itself
    against the one it replaced: tests/test_starvation_linear.py)."""
    assert _verdict(text, False) == _verdict(text, True)


def test_a_sound_program_is_validated_once_while_it_lives(monkeypatch):
    import gc

    from overlap_lab.shared.ir import validate as v
    from overlap_lab.shared.schedules import build

    w = _workload()
    program = build("tbo", w, get_gpu("h800"))
    walks = []
    real = v._validate
    monkeypatch.setattr(v, "_validate", lambda p, n, w=None: walks.append(n) or real(p, n, w))
    v.validate(program, 132)
    v.validate(program, 132)
    v.validate(program, 200)  # another GPU: walked again
    assert walks == [132, 200]
    key = (id(program), 132)
    assert key in v._SOUND
    del program
    gc.collect()
    assert key not in v._SOUND
    # an unsound Program is walked (and refused) every time
    bad = build("tbo", w, get_gpu("h800"))
    bad = dataclasses.replace(bad, world=0)
    for _ in range(2):
        try:
            v.validate(bad, 132)
        except v.ProgramError:
            pass
    assert walks[-2:] == [132, 132]
