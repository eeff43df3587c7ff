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


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("where", [0, 1, 2])
def test_a_nan_part_anywhere_makes_the_value_nan(norm_type, where):
    t = torch.ones(3, 4)
    t[where, 1] = math.nan
    parts = [grad_norm.norm_part(row, norm_type) for row in t]
    assert math.isnan(grad_norm.combine(parts, norm_type))
    assert not math.isfinite(grad_norm.finish(grad_norm.combine(parts, norm_type), norm_type))
    # torch agrees: the total norm of these gradients is NaN
    assert math.isnan(_torch_total_norm(list(t), norm_type))


def _ranks_worker(rank, tmp, values, norm_type):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=len(values))
    try:
        got = grad_norm.all_ranks(values[rank], norm_type)
    finally:
        dist.destroy_process_group()
    torch.save(got, f"{tmp}/rank{rank}.pt")


@pytest.mark.parametrize("norm_type,values,expected", [
    (2.0, [1.5, 2.5], 4.0),
    (math.inf, [1.5, 2.5], 2.5),
    (math.inf, [3.0, math.nan], math.nan),
    (math.inf, [math.nan, 3.0], math.nan),
    (2.0, [math.nan, 3.0], math.nan),
])
def test_all_ranks_combines_as_combine_does(tmp_path, norm_type, values, expected):
    import torch.multiprocessing as mp
    mp.spawn(_ranks_worker, args=(str(tmp_path), values, norm_type), nprocs=len(values), join=True)
    for r in range(len(values)):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert (math.isnan(got) if math.isnan(expected) else got == expected), (r, got)


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
