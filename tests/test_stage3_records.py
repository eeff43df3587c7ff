"""The record of a managed stage-3 parameter (``ParamSlot``, from ``manager.slot_of``): its
unit, group, shape and status in one object; and the released/gathered class switch, written in
one module (``released.py``)."""
import ast
import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import zeroinf
from zeroinf.runtime.stage3.released import is_released, mark_gathered, mark_released, released_class
from zeroinf.runtime.stage3.units import UnitState
from stage3_models import TinyLM
from stage3_engine_helpers import _config

REPO = Path(__file__).resolve().parents[1]


def test_record_gives_unit_group_shape_and_status(tmp_path):
    ref = TinyLM(tied=True)
    model = copy.deepcopy(ref)
    engine, *_ = zeroinf.initialize(model=model, config=_config("cpu", "cpu", tmp_path))
    try:
        m = engine.params.manager
        w = model.blocks[1].ff[0].weight
        s = m.slot_of(w)
        assert s.param is w and s.name == "blocks.1.ff.0.weight"
        assert s.shape == ref.blocks[1].ff[0].weight.shape and s.numel == s.shape.numel()
        assert s.group.slots[s.index] is s and s.group in s.unit.groups
        assert s.unit.module is model.blocks[1] and s.unit in m.units
        assert s.status is UnitState.RELEASED and is_released(w) and w.numel() == 0
        # every managed parameter has one record, consistent with its group and unit; tied
        # weights are one parameter, so one record
        for name, p in model.named_parameters():
            r = m.slot_of(p)
            assert r is not None and r.param is p and r.group.slots[r.index] is r, name
            assert r.group in r.unit.groups and r.status is r.unit.state, name
        assert m.slot_of(model.head.weight) is m.slot_of(model.emb.weight)
        assert m.slot_of(torch.zeros(3)) is None and m.slot_of(None) is None
        assert "group=" not in repr(s) and "unit=" not in repr(s)  # back-references stay out of repr

        other = m.slot_of(model.blocks[0].ff[0].weight)
        with zeroinf.gathered_parameters([w]):
            assert s.status is UnitState.GATHERED and type(w) is nn.Parameter and w.shape == s.shape
            assert torch.equal(w, ref.blocks[1].ff[0].weight)
            assert other.status is UnitState.RELEASED and is_released(other.param)
        assert s.status is UnitState.RELEASED and is_released(w) and w.numel() == 0
    finally:
        engine.close()


@pytest.mark.parametrize("held", [False, True])
def test_mark_released_and_mark_gathered_switch_the_class_back_and_forth(held):
    p = nn.Parameter(torch.ones(3))
    p.data = torch.empty(0)
    mark_released(p, held=held)
    assert is_released(p) and isinstance(p, nn.Parameter)
    with pytest.raises(RuntimeError, match="holds only an empty placeholder"):
        p.sum()
    twin = type(p)
    assert twin is released_class(nn.Parameter, held) and twin is not released_class(nn.Parameter, not held)
    mark_released(p, held=held)  # again: the same twin, not a twin of the twin
    assert type(p) is twin
    mark_gathered(p)
    assert type(p) is nn.Parameter and not is_released(p)
    mark_gathered(p)  # a plain parameter stays plain
    assert type(p) is nn.Parameter


def _class_assignments(path: Path):
    """Lines of ``path`` that assign ``__class__``: ``x.__class__ = ...`` (also augmented or in a
    tuple target) or ``setattr(x, "__class__", ...)``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and sub.attr == "__class__" and isinstance(sub.ctx, ast.Store):
                    out.append(node.lineno)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and node.args[1].value == "__class__"):
            out.append(node.lineno)
    return sorted(out)


def test_only_released_py_switches_a_parameters_class():
    found = {str(path.relative_to(REPO)): lines for path in sorted((REPO / "zeroinf").rglob("*.py"))
             if (lines := _class_assignments(path))}
    assert set(found) == {"zeroinf/runtime/stage3/released.py"}, found
    assert len(found["zeroinf/runtime/stage3/released.py"]) == 2  # mark_released, mark_gathered


def test_class_assignments_are_found(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("p.__class__ = A\na, p.__class__ = 1, B\nsetattr(p, '__class__', C)\nq = p.__class__\n")
    assert _class_assignments(f) == [1, 2, 3]
