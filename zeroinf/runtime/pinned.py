"""Page-locked host tensors from torch's pinned allocator, with the bytes they hold.

torch pins host memory only where an accelerator exists (``torch.empty(..., pin_memory=True)``
raises on a CPU-only build), so the runtime's host buffers that feed copies to and from the
device (stage 1/2 gradient accumulation and parameter copies, CPU-resident optimizer state,
stage 3's host partitions, cache and gradient shards) are pinned with CUDA and ordinary memory
without. Each owner allocates them through a :class:`PinnedHost`, which counts the bytes of those
that really are pinned (``Tensor.is_pinned()``) for as long as their storage lives: a buffer
dropped by its owner, and by every view of it, stops counting. ``engine.stats()["pinned_bytes"]``
adds these to the swap pools' (:class:`zeroinf.io.PinnedBufferPool`, page-locked on any host).
"""
from __future__ import annotations

import threading
import weakref

import torch

__all__ = ["PinnedHost"]


class PinnedHost:
    """Allocates 1-D host tensors, pinned when asked and torch can pin, and counts the pinned bytes
    still alive. Thread-safe (stage 3 allocates on its I/O thread too)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._bytes = 0

    def empty(self, numel: int, dtype: torch.dtype, *, pin: bool = True) -> torch.Tensor:
        """A CPU tensor of ``numel`` elements of ``dtype``, contents undefined; page-locked when
        ``pin`` and ``torch.cuda.is_available()``, ordinary memory otherwise. A pinned one adds
        its ``numel * element_size`` bytes to :attr:`nbytes` until its storage is freed."""
        pin = pin and torch.cuda.is_available()
        t = torch.empty(numel, dtype=dtype, pin_memory=pin)
        if pin and t.is_pinned():  # no query per tensor where nothing is pinned (stage 3's gradient shards)
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            with self._lock:
                self._bytes += nbytes
            weakref.finalize(storage, self._freed, nbytes)
        return t

    def zeros(self, numel: int, dtype: torch.dtype, *, pin: bool = True) -> torch.Tensor:
        """:meth:`empty`, filled with zeros."""
        return self.empty(numel, dtype, pin=pin).zero_()

    def _freed(self, nbytes: int) -> None:
        with self._lock:
            self._bytes -= nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of page-locked memory held by live tensors from :meth:`empty` (0 without CUDA)."""
        with self._lock:
            return self._bytes
