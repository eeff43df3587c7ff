"""DeepSpeed's ``deepspeed.ops.adam`` names: :class:`DeepSpeedCPUAdam` and ``FusedAdam``."""
from __future__ import annotations

from ..optim.deepspeed_cpu_adam import DeepSpeedCPUAdam
from .loader import OpUnavailableError

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


class FusedAdam:
    """DeepSpeed's CUDA multi-tensor Adam, not part of zeroinf (``FusedAdamBuilder`` is never
    compatible). Constructing one raises :class:`~zeroinf.ops.OpUnavailableError`; use
    ``torch.optim.AdamW(fused=True)`` for accelerator parameters, :class:`DeepSpeedCPUAdam` for
    CPU ones."""

    def __init__(self, *args, **kwargs):
        raise OpUnavailableError("FusedAdam: DeepSpeed's CUDA FusedAdam is not part of zeroinf; use "
                                 "torch.optim.AdamW(fused=True) for accelerator parameters, or "
                                 "zeroinf.ops.adam.DeepSpeedCPUAdam for CPU ones")
