"""What the optimizer's state is, per sub-group, and how much of it: the sub-group
description (:class:`SubGroupSpec`), the caller-held master weights' interface
(:class:`MasterIO`), the step's counters (:class:`OptimizerStats`), and the sizes the engine,
the memory check and the estimator count (bytes per element, swap buffers). The optimizer
itself is :class:`zeroinf.runtime.optimizer.SubGroupOptimizer`, which re-exports these."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["MasterIO", "OptimizerStats", "STATE_DTYPES", "SubGroupSpec", "optimizer_buffer_count",
           "state_bytes_per_element"]

#: Element types the Adam moments may be stored in.
STATE_DTYPES = (torch.float32, torch.bfloat16)


def state_bytes_per_element(state_dtype: torch.dtype = torch.float32, master: bool = True) -> int:
    """Bytes of optimizer state per element: the fp32 master (4, when ``master``) plus the two
    Adam moments of ``state_dtype`` (4 + 4 in fp32, 2 + 2 in bf16). Raises ValueError for a dtype
    outside :data:`STATE_DTYPES`."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be torch.float32 or torch.bfloat16, got {state_dtype}")
    return 4 * bool(master) + 2 * state_dtype.itemsize


def optimizer_buffer_count(buffer_count: int, pipeline_read: bool, pipeline_write: bool, n_sub_groups: int) -> int:
    """Swap buffers :class:`SubGroupOptimizer` pins for NVMe state: ``buffer_count``, but no more
    than there are sub-groups, and without ``pipeline_read`` no more than can be in flight
    (``1 + pipeline_write``). With ``pipeline_read`` every buffer is used: :meth:`prefetch`
    fills them all during the last backward, so the step starts with that many sub-groups read."""
    cap = n_sub_groups if pipeline_read else 1 + bool(pipeline_write)
    return max(1, min(buffer_count, cap))


class MasterIO(Protocol):
    """Access to fp32 master weights held by the caller (see ``master_io`` of
    :class:`SubGroupOptimizer`)."""

    def read(self, index: int) -> torch.Tensor:
        """A copy of sub-group ``index``'s master weights: fp32, CPU, ``numel`` elements."""

    def write(self, index: int, values: torch.Tensor) -> None:
        """Store ``values`` (``numel`` elements, any float dtype) as sub-group ``index``'s master
        weights, durably (written to the tier before it returns)."""


@dataclass(frozen=True)
class SubGroupSpec:
    """One sub-group: a stable ``key`` (used in swap-file names and checkpoints), its ``numel``
    (fp32 elements) and the index of the param group whose hyper-parameters apply."""

    key: str
    numel: int
    param_group: int = 0


@dataclass
class OptimizerStats:
    """Counters for the last :meth:`SubGroupOptimizer.step` (seconds, bytes)."""

    adam_s: float = 0.0
    io_wait_s: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
