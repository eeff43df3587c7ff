"""The gradient norm, computed one way for every stage and tier.

The global p-norm of the gradient is assembled in three steps, each written once here:

1. :func:`norm_part` of each gradient partition a rank holds: ``sum |g|^p`` (or ``max |g|`` for
   the inf norm), the power taken in float64 on an fp32 norm so that partitions of any size add
   without losing digits;
2. :func:`combine` of a rank's parts (a sum, or the max for inf), and the same across ranks
   (:func:`all_ranks`); a NaN part stays NaN through both, so a NaN gradient is never applied
   as if finite;
3. :func:`finish` of the global value: its ``1/p``-th power (nothing for inf).

Stages 0-2 compute the parts at the step from their flat gradients; stage 3 computes them where
each partition's final value is in memory anyway (while it is reduced into a swap file, when it
reaches the optimizer in the backward) or, failing that, at the step. The parts are the same
floats either way, so the norm does not depend on where a partition lives.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist

__all__ = ["norm_part", "combine", "all_ranks", "finish"]


def norm_part(t: torch.Tensor, norm_type: float) -> float:
    """``max |t|`` for the inf norm (0.0 for an empty ``t``), else ``sum |t|^p``: the fp32
    ``vector_norm`` of ``t`` (any float dtype, any device) raised to ``p`` in float64."""
    if math.isinf(norm_type):
        return float(t.abs().max()) if t.numel() else 0.0
    return float(torch.linalg.vector_norm(t, norm_type, dtype=torch.float32).double() ** norm_type)


def combine(parts: Iterable[float], norm_type: float) -> float:
    """One value from parts made by :func:`norm_part`: their max for the inf norm, else their
    sum; 0.0 for no parts. A NaN part makes the value NaN, as torch's ``max`` and ``sum`` do
    (Python's ``max`` keeps whichever value came first when compared with NaN, and a NaN
    gradient would then pass for finite and be applied)."""
    if not math.isinf(norm_type):
        return sum(parts)
    out = 0.0
    for p in parts:
        if math.isnan(p):
            return math.nan
        out = max(out, p)
    return out


def all_ranks(value: float, norm_type: float, group=None, device=None) -> float:
    """:func:`combine` of every rank's ``value`` (each rank's own combined parts), through one
    ``all_reduce`` of float64 on ``device`` (NCCL reduces only CUDA tensors). For the inf norm a
    NaN on any rank gives NaN on all: the reduction is a MAX over (value, is-NaN), since how a
    backend's MAX treats NaN is not specified. ``group``: the process group (None: the world);
    ``device``: None is the CPU. Collective: every rank of ``group`` calls it.

    Raises:
        RuntimeError: from ``torch.distributed`` (no initialized process group, a failed
            collective)."""
    if not math.isinf(norm_type):
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return float(t[0])
    nan = math.isnan(value)
    t = torch.tensor([-1.0 if nan else value, 1.0 if nan else 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return math.nan if float(t[1]) > 0 else float(t[0])


def finish(value: float, norm_type: float) -> float:
    """The norm from the combined value over every partition: ``value ** (1/p)``, or ``value``
    itself for the inf norm."""
    return value if math.isinf(norm_type) else value ** (1.0 / norm_type)
