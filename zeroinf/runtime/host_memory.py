"""Host (CPU) memory of the runtime: one allocator, :class:`HostMemory`, per engine.

Every host buffer the runtime keeps comes from it, in three kinds:

* Long-lived tensors (:meth:`HostMemory.empty`, :meth:`HostMemory.zeros`): the buffers that feed
  copies to and from the device (stage 1/2 gradient accumulation and parameter copies,
  CPU-resident optimizer state, stage 3's host partitions, cache and gradient shards). torch pins
  host memory only where an accelerator exists (``torch.empty(..., pin_memory=True)`` raises on a
  CPU-only build), so they are pinned with CUDA and ordinary memory without. The allocator counts
  the bytes of those that really are pinned (``Tensor.is_pinned()``) for as long as their storage
  lives: a buffer dropped by its owner, and by every view of it, stops counting.
* Recycled scratch (:meth:`HostMemory.take`, :meth:`HostMemory.give`): unit-sized, 4096-aligned
  CPU tensors kept for reuse by (numel, dtype), from 2 MiB on in transparent huge pages; never
  pinned, never counted.
* I/O staging pools (:meth:`HostMemory.pool`): :class:`zeroinf.io.PinnedBufferPool`, page-locked
  on any host, counted from creation until ``close()``.

:attr:`HostMemory.nbytes` is the page-locked memory all of these hold now, which is what
``engine.stats()["pinned_bytes"]`` reports.
"""
from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch

from zeroinf.io.locked import HUGE_PAGE, huge_paged_bytes

__all__ = ["HostMemory"]


class HostMemory:
    """Allocates the runtime's host buffers and counts the page-locked bytes still alive.
    Thread-safe (stage 3 allocates on its I/O thread, and the I/O and optimizer threads give
    scratch buffers back).

    Args:
        keep: how many free scratch buffers of one (numel, dtype) to keep; more are dropped.
        max_free_bytes: the most memory the free scratch buffers may hold together (bytes,
            default 512 MiB); a buffer that would exceed it is dropped, so models with very large
            units (a 1B-parameter block in fp32 is 4 GB) fall back to plain allocations instead of
            holding several spare copies in host memory.
    """

    ALIGN = 4096  # bytes: scratch buffers start on this boundary

    def __init__(self, keep: int = 6, max_free_bytes: int = 512 << 20):
        self.keep = int(keep)
        self.max_free_bytes = self._base_free_bytes = int(max_free_bytes)
        self._count_lock = threading.Lock()  # guards _bytes; held without allocating (finalizers take it)
        self._bytes = 0
        # guards _pools and the free scratch; re-entered by close() from a signal handler
        self._lock = threading.RLock()
        self._pools: "weakref.WeakSet" = weakref.WeakSet()  # pools made by pool(); counted until closed
        self._free: dict = {}
        self._free_bytes = 0

    # --- long-lived tensors -------------------------------------------------------------------
    def empty(self, numel: int, dtype: torch.dtype, *, pin: bool = True) -> torch.Tensor:
        """A 1-D CPU tensor of ``numel`` elements of ``dtype``, contents undefined; page-locked when
        ``pin`` and ``torch.cuda.is_available()``, ordinary memory otherwise. A pinned one adds
        its ``numel * element_size`` bytes to :attr:`nbytes` until its storage is freed."""
        pin = pin and torch.cuda.is_available()
        t = torch.empty(numel, dtype=dtype, pin_memory=pin)
        if pin and t.is_pinned():  # no query per tensor where nothing is pinned (stage 3's gradient shards)
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            with self._count_lock:
                self._bytes += nbytes
            weakref.finalize(storage, self._freed, nbytes)
        return t

    def zeros(self, numel: int, dtype: torch.dtype, *, pin: bool = True) -> torch.Tensor:
        """:meth:`empty`, filled with zeros."""
        return self.empty(numel, dtype, pin=pin).zero_()

    def _freed(self, nbytes: int) -> None:
        with self._count_lock:
            self._bytes -= nbytes

    # --- I/O staging pools --------------------------------------------------------------------
    def pool(self, buffer_count: int, buffer_size: int):
        """A new :class:`zeroinf.io.PinnedBufferPool` of ``buffer_count`` page-locked uint8 buffers
        of ``buffer_size`` bytes each (4096-aligned); its
        :func:`~zeroinf.io.pinned_pool_bytes` count in :attr:`nbytes` until its ``close()``.

        Raises:
            ValueError: a non-positive count or size.
            zeroinf.io.PinnedMemoryError: the pool exceeds the available memory or the memlock
                limit, or locking failed (nothing is allocated then).
        """
        from zeroinf.io import PinnedBufferPool

        p = PinnedBufferPool(buffer_count, buffer_size)
        with self._lock:
            self._pools.add(p)
        return p

    @property
    def nbytes(self) -> int:
        """Bytes of page-locked memory held now: live pinned tensors from :meth:`empty` (0 without
        CUDA) and the pools from :meth:`pool` not closed yet (locked on any host)."""
        with self._lock:
            pools = list(self._pools)
        locked = sum(p.pinned_bytes for p in pools if not p.closed)
        with self._count_lock:
            return self._bytes + locked

    # --- recycled scratch ---------------------------------------------------------------------
    def take(self, numel: int, dtype: torch.dtype, device: Optional[torch.device] = None) -> torch.Tensor:
        """A contiguous tensor of ``numel`` elements of ``dtype``, contents undefined: a reused
        or new 4096-aligned CPU buffer, or a plain ``torch.empty`` on another ``device`` (the
        accelerator's caching allocator already reuses memory; :meth:`give` ignores those).
        Never an inference tensor: one taken inside ``torch.inference_mode`` (an eval forward
        first) is written and reused outside it, where torch refuses in-place updates to them.

        A fresh CPU allocation of a unit's size is an ``mmap`` that the kernel page-faults and
        zeroes on first touch, every time (on the yardstick model's backward ~0.1 s per step on
        2 cores, more than the copies themselves); a reused one is not. The 4096-byte start lets
        O_DIRECT reads and writes use it without a bounce copy."""
        if device is not None and torch.device(device).type != "cpu":
            with torch.inference_mode(False):
                return torch.empty(numel, dtype=dtype, device=device)
        with self._lock:
            free = self._free.get((numel, dtype))
            if free:
                t = free.pop()
                self._free_bytes -= t.numel() * t.element_size()
                return t
        nbytes = numel * dtype.itemsize
        with torch.inference_mode(False):
            if nbytes >= HUGE_PAGE:  # 2 MiB pages: O_DIRECT at full rate, one fault per 2 MiB
                return huge_paged_bytes(nbytes).view(dtype)
            raw = torch.empty(nbytes + self.ALIGN, dtype=torch.uint8)
            off = (-raw.data_ptr()) % self.ALIGN
            return raw[off:off + nbytes].view(dtype)

    def fit_units(self, unit_bytes: int) -> None:
        """Let the free scratch hold :attr:`keep` buffers of ``unit_bytes`` bytes (the largest
        unit buffer a caller takes and gives back every step) beyond the budget it was made with,
        up to an eighth of the host's RAM. Never lowers :attr:`max_free_bytes`; raises nothing.

        At the default budget a 1B-parameter fp32 model (143 MB units) drops 11 such buffers a
        step and faults them in afresh (1.6 GB of page faults and zero fill on the cores the
        compute uses). Only buffers that were in use at once are kept, so the peak resident
        memory does not grow.
        """
        import psutil
        cap = psutil.virtual_memory().total // 8
        with self._lock:
            self.max_free_bytes = max(self.max_free_bytes, min(self._base_free_bytes + self.keep * int(unit_bytes), cap))

    def give(self, t: torch.Tensor) -> None:
        """Return a tensor from :meth:`take`; the caller must hold no view of it any more.
        Non-CPU tensors and buffers beyond ``keep`` or ``max_free_bytes`` are simply dropped."""
        if t.device.type != "cpu":
            return
        nbytes = t.numel() * t.element_size()
        with self._lock:
            free = self._free.setdefault((t.numel(), t.dtype), [])
            if len(free) < self.keep and self._free_bytes + nbytes <= self.max_free_bytes:
                free.append(t)
                self._free_bytes += nbytes

    @property
    def free_bytes(self) -> int:
        """Bytes held by the free scratch buffers now."""
        return self._free_bytes

    def clear(self) -> int:
        """Drop every free scratch buffer (memory goes back to the allocator); returns the bytes
        dropped. Buffers taken and not given back are untouched."""
        with self._lock:
            freed, self._free, self._free_bytes = self._free_bytes, {}, 0
        return freed
