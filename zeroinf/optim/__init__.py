"""Optimizers over the fused CPU Adam op.

* :func:`adam_step` — one in-place Adam/AdamW step over flat contiguous CPU buffers (fp32 master,
  fp32/bf16/fp16 grads, optional fused bf16/fp16 parameter copy). The ZeRO runtime calls it per
  sub-group.
* :func:`adam_step_list`, :func:`adam_step_groups` — the same over lists of tensors (of one or several
  param groups) in one call and one parallel region.
* :func:`adam_step_reference` — the same in PyTorch ops (fallback and test reference).
* :class:`CPUAdam` — a ``torch.optim.Optimizer`` drop-in for ``torch.optim.AdamW``.
* :class:`DeepSpeedCPUAdam` — DeepSpeed's class of that name (signature, moment dtypes, sub-group steps).
* :func:`limit_thread_parallelism` — cap the op's (and torch's) CPU threads in the calling thread,
  for background threads that step beside the training loop's compute.
"""
from .cpu_adam import CPUAdam
from .deepspeed_cpu_adam import DeepSpeedCPUAdam
from .functional import (ISA_ENV, AdamHyper, adam_step, adam_step_groups, adam_step_list, adam_step_reference,
                         isa_info, limit_thread_parallelism, stream_rmw)

__all__ = ["AdamHyper", "CPUAdam", "DeepSpeedCPUAdam", "ISA_ENV", "adam_step", "adam_step_groups", "adam_step_list",
           "adam_step_reference", "isa_info", "limit_thread_parallelism", "stream_rmw"]
