"""The IR's content keys (shared/ir/content.py): by value, exact, canonical across processes."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import overlap_lab as ol
from overlap_lab.shared.ir.content import canonical, content_key
from overlap_lab.shared.ir.program import Graph, Launch, Op, OpKind
from overlap_lab.shared.schedules import build


def _program(schedule="sbo"):
    w = ol.workload("deepseek-v3", batch=16, ep=8, layers=3)
    return build(schedule, w, ol.gpu("h800"))


def _first_graph_op(p):
    for th in p.ranks[0].threads:
        for k, ins in enumerate(th.instrs):
            if isinstance(ins, Graph):
                j = next(j for j, b in enumerate(ins.body) if isinstance(b, Launch))
                return th, k, ins, j
    raise AssertionError("no graph")


def _with_op(p, op):
    """``p`` with the first launch of its first graph running ``op``."""
    th, k, graph, j = _first_graph_op(p)
    body = (*graph.body[:j], dataclasses.replace(graph.body[j], op=op), *graph.body[j + 1 :])
    g2 = dataclasses.replace(graph, body=body)
    th2 = dataclasses.replace(th, instrs=(*th.instrs[:k], g2, *th.instrs[k + 1 :]))
    rp = p.ranks[0]
    threads = tuple(th2 if t is th else t for t in rp.threads)
    return dataclasses.replace(p, ranks=(dataclasses.replace(rp, threads=threads),))


def test_the_key_is_by_value_and_exact():
    p = _program()
    th, k, graph, j = _first_graph_op(p)
    op = graph.body[j].op
    assert p.content_key() == copy.deepcopy(p).content_key()  # no object shared: same key
    assert p.content_key() == _with_op(p, copy.deepcopy(op)).content_key()
    changed = [
        dataclasses.replace(op, flops=math.nextafter(op.flops, math.inf)),  # one ulp
        dataclasses.replace(op, hbm_bytes=float(op.hbm_bytes) + 0.5),
        dataclasses.replace(op, tokens=float(op.tokens)),  # 16 == 16.0, but not the same Program
        dataclasses.replace(op, sms=True if op.sms == 1 else 1),
        dataclasses.replace(op, layer=None if op.layer is not None else 0),
        dataclasses.replace(op, waits=(*op.waits, "x")),
        dataclasses.replace(op, kind=OpKind.COMM if op.kind != OpKind.COMM else OpKind.COMPUTE),
    ]
    keys = {p.content_key()} | {_with_op(p, o).content_key() for o in changed}
    assert len(keys) == 1 + len(changed)

    class Sub(Op):  # another class with the same fields: another key
        pass

    sub = Sub(**{f.name: getattr(op, f.name) for f in dataclasses.fields(Op)})
    assert _with_op(p, sub).content_key() != p.content_key()


def test_every_schedule_keys_differently():
    keys = {s: _program(s).content_key() for s in ("serial", "sbo", "tbo", "tbo+sbo")}
    assert len(set(keys.values())) == len(keys)


def test_containers_are_told_apart_and_dicts_ignore_order():
    values = [(1, 2), [1, 2], {1: 2}, {1, 2}, (1.0, 2), (True, 2), ("1", 2), (None, 2), ()]
    assert len({canonical(v) for v in values}) == len(values)
    assert canonical({"a": 1, "b": [2]}) == canonical({"b": [2], "a": 1})
    assert canonical(np.float64(0.5)) == canonical(0.5)  # a numpy scalar: the number it holds
    assert canonical(OpKind.COMM) != canonical("comm")  # an enum member is not its value
    with pytest.raises(TypeError, match="no content key"):
        canonical(np.zeros(3))  # no exact encoding: refused, never guessed


def test_the_key_is_the_same_in_another_process():
    """Keys are compared across workers and runs: the same under another hash seed."""
    p = _program("tbo")
    code = (
        "import overlap_lab as ol; from overlap_lab.shared.schedules import build; "
        "w = ol.workload('deepseek-v3', batch=16, ep=8, layers=3); "
        "print(build('tbo', w, ol.gpu('h800')).content_key())"
    )
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        assert out.stdout.strip() == p.content_key()


def test_content_key_of_any_value():
    assert content_key((1, "a")) == content_key((1, "a")) != content_key((1, "b"))
    assert len(content_key(None)) == 64
