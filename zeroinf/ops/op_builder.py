"""DeepSpeed's op-builder entry points (``deepspeed.ops.op_builder``) over zeroinf's ops.

``CPUAdamBuilder().load()`` and ``AsyncIOBuilder().load()`` return objects with the functions
DeepSpeed's compiled ops expose (``create_adam``/``adam_update``/``destroy_adam``;
``aio_handle``), so code written against those ops runs on zeroinf. Both ops always load: when
the C++ op cannot be built, the pure-PyTorch Adam and the Python I/O backend run (one
``RuntimeWarning`` says so). ``FusedAdamBuilder`` stands for DeepSpeed's CUDA multi-tensor Adam,
which zeroinf does not implement: it is never compatible and its ``load`` raises.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from .loader import OpUnavailableError

__all__ = ["AsyncIOBuilder", "CPUAdamBuilder", "FusedAdamBuilder", "compatible_ops"]


class CPUAdamOp:
    """DeepSpeed's ``cpu_adam`` op functions over :func:`zeroinf.optim.adam_step`.

    ``create_adam`` records an optimizer's ``adamw_mode`` under an id; ``adam_update`` steps one
    parameter in place with it. fp32 tensors are stepped directly; bf16/fp16 parameters or
    moments are stepped through float32 copies and rounded back (round to nearest even).
    """

    def __init__(self):
        self._adamw_mode: Dict[int, bool] = {}

    def create_adam(self, optimizer_id: int, alpha: float = 1e-3, betta1: float = 0.9, betta2: float = 0.999,
                    eps: float = 1e-8, weight_decay: float = 0.0, adamw_mode: bool = True,
                    should_log: bool = False) -> int:
        """Register optimizer ``optimizer_id`` (DeepSpeed's positional order); returns 0. Only
        ``adamw_mode`` is kept: ``adam_update`` passes the other hyper-parameters per call."""
        self._adamw_mode[int(optimizer_id)] = bool(adamw_mode)
        return 0

    def adam_update(self, optimizer_id: int, step: int, lr: float, beta1: float, beta2: float, epsilon: float,
                    weight_decay: float, bias_correction: bool, params: torch.Tensor, grads: torch.Tensor,
                    exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> int:
        """One Adam step of ``params`` (any CPU float dtype, contiguous, updated in place) with
        ``grads``, ``exp_avg`` and ``exp_avg_sq`` of the same numel; ``step`` is 1-based. Returns 0.

        Raises:
            KeyError: ``optimizer_id`` was not created.
            ValueError: as :func:`zeroinf.optim.adam_step` (device, dtype, numel, contiguity).
        """
        from ..optim import adam_step

        if int(optimizer_id) not in self._adamw_mode:
            raise KeyError(f"adam_update: optimizer {optimizer_id} was not created (call create_adam first)")
        flat = [t.view(-1) if t.is_contiguous() else t for t in (params, grads, exp_avg, exp_avg_sq)]
        master = flat[0] if params.dtype == torch.float32 else flat[0].float()
        moments = [m if m.dtype == torch.float32 else m.float() for m in flat[2:]]
        adam_step(master, flat[1], *moments, step=int(step), lr=float(lr), beta1=float(beta1), beta2=float(beta2),
                  eps=float(epsilon), weight_decay=float(weight_decay),
                  adamw_mode=self._adamw_mode[int(optimizer_id)], bias_correction=bool(bias_correction),
                  params_out=None if master is flat[0] else flat[0])
        for dst, src in zip(flat[2:], moments):
            if dst is not src:
                dst.copy_(src)
        return 0

    def destroy_adam(self, optimizer_id: int) -> int:
        """Forget optimizer ``optimizer_id``; returns 0."""
        self._adamw_mode.pop(int(optimizer_id), None)
        return 0


class AsyncIOOp:
    """DeepSpeed's ``async_io`` op: ``aio_handle`` with DeepSpeed's constructor defaults."""

    @staticmethod
    def aio_handle(block_size: int = 1024 * 1024, queue_depth: int = 128, single_submit: bool = False,
                   overlap_events: bool = False, intra_op_parallelism: int = 1):
        """A :class:`zeroinf.io.AsyncIOHandle` (DeepSpeed's positional order and defaults);
        its methods return DeepSpeed's values. Raises ``ValueError`` for a knob < 1."""
        from ..io import AsyncIOHandle

        return AsyncIOHandle(block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism)


class _Builder:
    NAME = ""
    _OP = None

    def is_compatible(self, verbose: bool = False) -> bool:
        """Whether :meth:`load` works here: always, for the ops zeroinf implements."""
        return self._OP is not None

    def load(self, verbose: bool = True):
        """The op's functions (see the module docstring)."""
        return self._OP()


class CPUAdamBuilder(_Builder):
    """``deepspeed.ops.op_builder.CPUAdamBuilder``: ``load()`` gives a :class:`CPUAdamOp`."""
    NAME = "cpu_adam"
    _OP = CPUAdamOp


class AsyncIOBuilder(_Builder):
    """``deepspeed.ops.op_builder.AsyncIOBuilder``: ``load()`` gives an :class:`AsyncIOOp`."""
    NAME = "async_io"
    _OP = AsyncIOOp


class FusedAdamBuilder(_Builder):
    """DeepSpeed's CUDA ``fused_adam`` op, not part of zeroinf: ``is_compatible()`` is False."""
    NAME = "fused_adam"

    def load(self, verbose: bool = True):
        """Raises :class:`~zeroinf.ops.OpUnavailableError`: use ``torch.optim.AdamW(fused=True)``."""
        raise OpUnavailableError("fused_adam: DeepSpeed's CUDA FusedAdam is not part of zeroinf; use "
                                 "torch.optim.AdamW(fused=True) for accelerator parameters")


_BUILDERS: Tuple[type, ...] = (CPUAdamBuilder, AsyncIOBuilder, FusedAdamBuilder)


def compatible_ops() -> Dict[str, bool]:
    """DeepSpeed's ``deepspeed.ops.__compatible_ops__``: op name -> whether it loads here."""
    return {b.NAME: b().is_compatible() for b in _BUILDERS}
