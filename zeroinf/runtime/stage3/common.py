"""Small tensor and future helpers shared by the stage-3 modules."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Optional, Sequence, Tuple

import torch

from .units import ParamSlot


def _finished(value: Any) -> Future:
    """A future already holding ``value``."""
    f: Future = Future()
    f.set_result(value)
    return f


def _run_inline(fn, *args, **kwargs) -> Future:
    """Run ``fn`` now, on this thread; a finished future holding its result or exception."""
    f: Future = Future()
    try:
        f.set_result(fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
        f.set_exception(exc)
    return f


def _sole_owner(t: torch.Tensor) -> bool:
    """True when ``t`` is the only tensor on its storage (no view of it survives), so the
    memory can be reused without changing values someone still reads. False when torch
    cannot tell (then the buffer is simply freed)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    return use_count(t.untyped_storage()._cdata) <= 2  # t, and the temporary storage object here


def pool_tensor(buf: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The first ``numel`` elements of ``dtype`` of ``buf`` (a uint8 staging buffer of a
    ``PinnedBufferPool``) as a tensor with a storage of its own, which keeps ``buf`` alive.
    The pool's buffers share one storage, so only a storage of its own tells (by its use
    count, :func:`_sole_owner`) whether a view of it survives."""
    with torch.inference_mode(False):
        raw = torch.from_numpy(buf[: numel * dtype.itemsize].numpy())
        return raw.view(dtype)


def views_its_slot(p: torch.Tensor, s: ParamSlot, base: int, size: int) -> bool:
    """Whether parameter ``p`` is still the contiguous view of its slot ``s`` in a gathered
    buffer whose first element is at address ``base`` (``size`` bytes per element); not after
    ``p.data = t``, a re-view (``p.data.t()``, ``.reshape``) or a move."""
    return p.data_ptr() == base + s.offset * size and p.shape == s.shape and p.is_contiguous()


def refreshed_master(master: torch.Tensor, shard: torch.Tensor, lo: int, hi: int,
                     written: Optional[Sequence[Tuple[int, int]]]) -> torch.Tensor:
    """The fp32 master of the partition slice ``[lo, hi)`` after values were written into the
    partition ``shard`` (1-D, the group's dtype) at the element ranges ``written`` (partition
    coordinates; None: everywhere): each written element whose value differs from ``master``
    rounded to ``shard.dtype`` is taken from ``shard``; the others keep their fp32 bits. So a
    bf16 partition written back unchanged (a ``gathered_parameters(..., modifier_rank=0)`` block
    that changed one weight of a unit, or none) does not round the master of the rest to bf16.
    ``master``: fp32, ``hi - lo`` elements. Returns a new tensor."""
    out = master.clone()
    for a, b in ([(lo, hi)] if written is None else written):
        a, b = max(a, lo), min(b, hi)
        if a < b:
            new, old = shard[a:b], out[a - lo:b - lo]
            changed = new != old.to(shard.dtype)
            old[changed] = new[changed].float()
    return out
