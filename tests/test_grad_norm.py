"""The gradient norm's one formula (``zeroinf.runtime.grad_norm``) against torch's own
``clip_grad_norm_``, and the rule that no other module of the package computes a norm."""
from __future__ import annotations

import math
import pathlib
import re

import pytest
import torch

from zeroinf.runtime import grad_norm

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "zeroinf"


def _torch_total_norm(tensors, norm_type: float) -> float:
    params = []
    for t in tensors:
        if t.numel() == 0:  # torch's inf norm cannot reduce an empty gradient
            continue
        p = torch.nn.Parameter(torch.zeros_like(t))
        p.grad = t.clone()
        params.append(p)
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm=1e30, norm_type=norm_type))


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_parts_split_anyhow_give_torch_s_total_norm(norm_type):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=g) * s for n, s in ((1000, 1.0), (37, 5.0), (0, 1.0), (4096, 0.01))]
    expected = _torch_total_norm(tensors, norm_type)
    # the same elements cut into other partitions (as ranks and sub-groups cut them): the same norm
    flat = torch.cat(tensors)
    for cuts in ([flat], list(flat.split(1000)), list(flat.split(7)), tensors):
        parts = [grad_norm.norm_part(t, norm_type) for t in cuts]
        got = grad_norm.finish(grad_norm.combine(parts, norm_type), norm_type)
        assert got == pytest.approx(expected, rel=1e-5), cuts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_part_is_taken_in_fp32(dtype):
    t = torch.full((70000,), 1.0, dtype=dtype)  # sum of squares 70000: beyond fp16's 65504
    assert grad_norm.norm_part(t, 2.0) == pytest.approx(70000.0, rel=1e-6)


def test_empty_and_no_parts_are_zero():
    assert grad_norm.norm_part(torch.empty(0), math.inf) == 0.0
    assert grad_norm.norm_part(torch.empty(0), 2.0) == 0.0
    assert grad_norm.combine([], math.inf) == 0.0 and grad_norm.combine([], 2.0) == 0.0


def test_reduce_op_matches_combine():
    assert grad_norm.reduce_op(math.inf) == torch.distributed.ReduceOp.MAX
    assert grad_norm.reduce_op(2.0) == torch.distributed.ReduceOp.SUM


def test_no_other_module_computes_a_norm():
    pattern = re.compile(r"vector_norm|\.norm\(|abs\(\)\.max\(\)")
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "grad_norm.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if pattern.search(code) and "``" not in code:
                found.append(f"{path.relative_to(PACKAGE)}:{i}: {line.strip()}")
    assert not found, "norms computed outside zeroinf/runtime/grad_norm.py:\n" + "\n".join(found)
