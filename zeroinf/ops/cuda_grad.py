"""Fused pass over a gradient bucket: count inf/nan, squared L2 norm, copy to the staging buffer.

After backward, the offload runtime needs three things from each flat gradient bucket before the
CPU optimizer can step: whether it holds an inf or nan (loss-scale overflow), its squared L2 norm
(for clipping; the global norm is the square root of the sum over buckets and ranks) and a copy in
pinned host memory, fp32 or bf16, for the CPU Adam. Done with torch ops that is three reads of the
gradient from device memory; the CUDA kernel in ``csrc/cuda/grad_bucket.cu`` does it in one read,
storing the converted copy straight into the pinned buffer (zero-copy, over PCIe).

:func:`grad_bucket_pass` uses that kernel for CUDA gradients when the ``cuda`` op can be loaded and
otherwise the torch implementation :func:`grad_bucket_pass_reference`, which gives the same copy
bit for bit and the norm to fp32 rounding (the summation order differs). The reference also runs
on CPU tensors, where it is the whole implementation.

Both run asynchronously on the current CUDA stream: the returned tensors and ``out`` are valid only
once that stream's work has completed, e.g. after ``event = torch.cuda.Event(); event.record()``
and ``event.synchronize()`` on the thread that reads ``out`` on the CPU. Neither synchronises the
device itself.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .loader import try_load_op

__all__ = ["GradBucketStats", "grad_bucket_pass", "grad_bucket_pass_reference", "kernel_available"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class GradBucketStats(NamedTuple):
    """What the pass learned about one bucket; both are 0-dim tensors on the gradient's device.

    Attributes:
        sq_norm: float32, the sum of squares of the gradient's values, accumulated in fp32
            (``inf`` or ``nan`` when a value is non-finite, ``inf`` when the sum overflows fp32).
        nonfinite: int64, how many values are ``inf``, ``-inf`` or ``nan``.
    """

    sq_norm: torch.Tensor
    nonfinite: torch.Tensor


def _check(grad: torch.Tensor, out: torch.Tensor) -> None:
    for name, t in (("grad", grad), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"grad_bucket_pass: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"grad_bucket_pass: {name} must be float32, bfloat16 or float16, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"grad_bucket_pass: {name} must be contiguous (shape {tuple(t.shape)}, "
                             f"stride {t.stride()})")
    if out.numel() != grad.numel():
        raise ValueError(f"grad_bucket_pass: out has {out.numel()} elements but grad has {grad.numel()}")
    if grad.is_cuda:
        if out.is_cuda:
            if out.device != grad.device:
                raise ValueError(f"grad_bucket_pass: out is on {out.device} but grad is on {grad.device}")
        elif not (out.device.type == "cpu" and out.is_pinned()):
            raise ValueError(f"grad_bucket_pass: out must be on {grad.device} or in pinned CPU memory "
                             f"(Tensor.pin_memory()), got a pageable tensor on {out.device}: a copy to it "
                             "would block the host")
    elif grad.device.type == "cpu":
        if out.device.type != "cpu":
            raise ValueError(f"grad_bucket_pass: grad is on the CPU, so out must be too (got {out.device})")
    else:
        raise ValueError(f"grad_bucket_pass: grad must be a CPU or CUDA tensor, got {grad.device}")


def grad_bucket_pass_reference(grad: torch.Tensor, out: torch.Tensor) -> GradBucketStats:
    """The pass in torch ops (three reads of ``grad``): the fallback and the kernel's reference.

    Args:
        grad: contiguous gradient bucket, float32/bfloat16/float16, CPU or CUDA, any shape.
        out: contiguous tensor with as many elements, float32/bfloat16/float16; on ``grad``'s
            device, or pinned CPU memory when ``grad`` is on CUDA. Receives
            ``grad.to(out.dtype)`` (round to nearest even), element for element.

    Returns:
        :class:`GradBucketStats` on ``grad``'s device; the norm's sum runs in fp32 (``torch.dot``).

    Raises:
        TypeError: a non-tensor or an unsupported dtype (the message names ``grad`` or ``out``).
        ValueError: element counts differ, a tensor is not contiguous, or the devices do not fit.
    """
    _check(grad, out)
    flat = grad.reshape(-1)
    flat32 = flat if flat.dtype == torch.float32 else flat.float()
    # torch.sum reduces in a cascade (rounding error ~log2(n) ulps); torch.dot's BLAS order
    # was 1.6e-5 off float64 for 2**20 elements on AMD EPYC
    sq_norm = torch.sum(flat32 * flat32)
    nonfinite = torch.count_nonzero(~torch.isfinite(flat))
    out.view(-1).copy_(flat, non_blocking=grad.is_cuda and not out.is_cuda)
    return GradBucketStats(sq_norm, nonfinite)


def kernel_available() -> bool:
    """True when the CUDA op can be used here (CUDA build of torch, a GPU, the op built or buildable).

    Builds the op on first call when it is not built yet (minutes, once; cached on disk).

    Raises:
        zeroinf.ops.OpBuildError: a build was attempted and failed.
    """
    return try_load_op("cuda", fallback="the torch gradient-bucket pass") is not None


def grad_bucket_pass(grad: torch.Tensor, out: torch.Tensor, *,
                     use_kernel: Optional[bool] = None) -> GradBucketStats:
    """Count inf/nan, sum the squares and copy ``grad`` into ``out``, reading ``grad`` once on CUDA.

    Args:
        grad: contiguous gradient bucket, float32/bfloat16/float16, CPU or CUDA, any shape.
        out: contiguous tensor with as many elements, float32/bfloat16/float16: the staging buffer.
            For a CUDA ``grad`` it is pinned CPU memory (the usual case) or a tensor on the same
            device. Receives ``grad.to(out.dtype)`` element for element, bit for bit.
        use_kernel: ``None`` (default) uses the CUDA kernel for CUDA tensors when the op is
            available and the torch implementation otherwise (warning once); ``True`` requires the
            kernel; ``False`` always uses the torch implementation.

    Returns:
        :class:`GradBucketStats`: 0-dim ``sq_norm`` (float32) and ``nonfinite`` (int64) on
        ``grad``'s device, written asynchronously on the current stream (see the module notes).
        ``sqrt(sum of sq_norm over buckets and ranks)`` is the global L2 norm used for clipping.

    Raises:
        TypeError, ValueError: as :func:`grad_bucket_pass_reference`.
        zeroinf.ops.OpUnavailableError: ``use_kernel=True`` but the kernel cannot run here (no
            CUDA build of torch, no GPU, ops disabled) or ``grad`` is not a CUDA tensor.
        zeroinf.ops.OpBuildError: the op's build was attempted and failed.
    """
    _check(grad, out)
    if use_kernel is False or (use_kernel is None and not grad.is_cuda):
        return grad_bucket_pass_reference(grad, out)
    if use_kernel:
        from .loader import OpUnavailableError, load_op

        if not grad.is_cuda:
            raise OpUnavailableError(f"grad_bucket_pass: the CUDA kernel needs a CUDA grad, got {grad.device}")
        op = load_op("cuda")
    else:
        op = try_load_op("cuda", fallback="the torch gradient-bucket pass")
        if op is None:
            return grad_bucket_pass_reference(grad, out)
    sq_norm, nonfinite = op.grad_bucket_pass(grad, out)
    return GradBucketStats(sq_norm, nonfinite)
