"""Single-process CPU stand-ins for what DeepSpeed's op tests (copied here, imports pointed at
zeroinf) take from DeepSpeed itself: ``unit.common.DistributedTest``, ``deepspeed.accelerator``
and ``deepspeed.comm``.

DeepSpeed runs a ``DistributedTest`` class in ``world_size`` worker processes; the copied classes
set ``world_size = 1`` (or nothing) and need no process group, so here their tests run as plain
pytest tests in the pytest process. The accelerator is DeepSpeed's CPU accelerator (what
``get_accelerator()`` returns on a machine without a GPU): available, named ``"cpu"``, fp32 and
bf16. zeroinf's ops are CPU ops, so it is the CPU on a machine with a GPU too.
"""
from __future__ import annotations

import torch
import torch.distributed as _dist


class DistributedTest:
    """``unit.common.DistributedTest``'s class attributes, with the tests run in-process."""
    world_size = 2
    reuse_dist_env = False
    requires_cuda_env = True
    init_distributed = True
    set_dist_env = True


class _CPUAccelerator:
    """The parts of ``deepspeed.accelerator.cpu_accelerator.CPU_Accelerator`` the copies use."""
    ByteTensor = torch.ByteTensor

    def is_available(self) -> bool:
        return True

    def device_name(self, device_index=None) -> str:
        return "cpu"

    def supported_dtypes(self):
        return [torch.float32, torch.bfloat16]

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor  # DeepSpeed's CPU accelerator returns the tensor as it is


_ACCELERATOR = _CPUAccelerator()


def get_accelerator() -> _CPUAccelerator:
    return _ACCELERATOR


class dist:  # noqa: N801 - stands for the module ``deepspeed.comm``
    """``deepspeed.comm.get_rank``: the process group's rank, 0 without one."""

    @staticmethod
    def get_rank() -> int:
        return _dist.get_rank() if _dist.is_available() and _dist.is_initialized() else 0
