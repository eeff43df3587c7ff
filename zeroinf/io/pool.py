"""A fixed budget of aligned, page-locked host buffers for swapping.

With CUDA present the buffers are CUDA pinned memory (``torch.empty(..., pin_memory=True)``),
so host↔device copies are DMA. Without CUDA they are one anonymous ``mmap``, aligned to 2 MiB and
advised ``MADV_HUGEPAGE`` before ``mlock`` faults it in, so the kernel never pages it out or
faults it in during an O_DIRECT transfer, and its pages are physically contiguous 2 MiB runs
(where transparent huge pages are enabled): a request's scatter list then merges into large
device requests. bench/README.md (aio) measured 4 KiB-page pool buffers 1.11–1.26× slower than
huge-page buffers for the same O_DIRECT transfers on a virtio disk.

:func:`pinned_pool_bytes` gives the exact number of bytes a pool will lock, so a config can be
checked before anything is allocated.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import resource
import threading
from typing import List, Optional

import torch

__all__ = ["PinnedBufferPool", "PinnedMemoryError", "PoolExhaustedError", "pinned_pool_bytes"]

_PAGE = mmap.PAGESIZE
HUGE_PAGE = 2 << 20  # transparent huge page size on x86-64 and arm64 (4 KiB base pages)
_CAP_IPC_LOCK = 14  # linux/capability.h


class PinnedMemoryError(MemoryError):
    """The pool's budget exceeds available memory or the memlock limit, or locking failed."""


class PoolExhaustedError(RuntimeError):
    """:meth:`PinnedBufferPool.acquire` found every buffer in use."""


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")


def _slot_bytes(buffer_size: int, alignment: int) -> int:
    step = max(alignment, _PAGE)
    return -(-buffer_size // step) * step


def pinned_pool_bytes(buffer_count: int, buffer_size: int, alignment: int = 4096) -> int:
    """Exact bytes a ``PinnedBufferPool(buffer_count, buffer_size, alignment)`` locks.

    Each buffer occupies ``buffer_size`` rounded up to ``max(alignment, page size)``, so every
    buffer starts aligned: ``buffer_count * ceil(buffer_size / step) * step``. (With CUDA the
    buffers come from CUDA's caching host allocator, which adds ``alignment`` bytes per buffer
    for alignment and may round further.)

    Args:
        buffer_count: number of buffers (>= 1).
        buffer_size: bytes per buffer (>= 1).
        alignment: byte alignment of each buffer's start, a power of two (default 4096, the
            O_DIRECT alignment).

    Raises:
        ValueError: a non-positive count or size, or an alignment that is not a power of two.
    """
    _check_positive("buffer_count", buffer_count)
    _check_positive("buffer_size", buffer_size)
    _check_positive("alignment", alignment)
    if alignment & (alignment - 1):
        raise ValueError(f"alignment: expected a power of two, got {alignment}")
    return buffer_count * _slot_bytes(buffer_size, alignment)


def _has_cap_ipc_lock() -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_IPC_LOCK & 1)
    except OSError:
        pass
    return False


def _locked_bytes() -> int:
    """Bytes this process has locked already (VmLck), 0 if unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmLck:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _memlock_limit() -> Optional[int]:
    """The soft RLIMIT_MEMLOCK in bytes, or None when unlimited or not enforced (CAP_IPC_LOCK)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or _has_cap_ipc_lock():
        return None
    return soft


def _available_bytes() -> int:
    import psutil

    return psutil.virtual_memory().available


_libc = None


def _mlock(addr: int, length: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.mlock.argtypes = _libc.munlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    if _libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(length)) != 0:
        e = ctypes.get_errno()
        raise PinnedMemoryError(f"mlock of {length} bytes failed: {os.strerror(e)}")


def _munlock(addr: int, length: int) -> None:
    if _libc is not None:
        _libc.munlock(ctypes.c_void_p(addr), ctypes.c_size_t(length))


class PinnedBufferPool:
    """``buffer_count`` aligned, page-locked uint8 buffers of ``buffer_size`` bytes each.

    Args:
        buffer_count: number of buffers (>= 1).
        buffer_size: bytes per buffer (>= 1).
        alignment: start alignment of each buffer in bytes, a power of two (default 4096).

    Raises:
        ValueError: bad arguments.
        PinnedMemoryError: raised *before allocating* when :func:`pinned_pool_bytes` exceeds the
            available memory or the soft ``RLIMIT_MEMLOCK`` (unless the process has
            CAP_IPC_LOCK); or when ``mlock`` itself fails (the memory is released first).

    Buffers are 1-D ``torch.uint8`` CPU tensors of exactly ``buffer_size`` elements; use
    :meth:`view` for a typed view. :meth:`acquire` hands one out, :meth:`release` takes it back.
    """

    def __init__(self, buffer_count: int, buffer_size: int, alignment: int = 4096):
        total = pinned_pool_bytes(buffer_count, buffer_size, alignment)
        self.buffer_count, self.buffer_size, self.alignment = buffer_count, buffer_size, alignment
        self.pinned_bytes = total
        budget = f"{buffer_count} x {buffer_size} bytes = {total} bytes pinned"
        avail = _available_bytes()
        if total > avail:
            raise PinnedMemoryError(f"pinned buffer pool of {budget} exceeds the {avail} bytes of available memory")
        self._cuda = torch.cuda.is_available()
        if not self._cuda:
            limit = _memlock_limit()
            if limit is not None and total + _locked_bytes() > limit:
                raise PinnedMemoryError(
                    f"pinned buffer pool of {budget} exceeds the memlock limit (RLIMIT_MEMLOCK soft = {limit} "
                    f"bytes, {_locked_bytes()} already locked); raise it with `ulimit -l` or use fewer/smaller buffers")
        self._lock = threading.RLock()  # re-entered by close() from a signal handler
        self._mmap = None
        self._addr = 0
        slot = _slot_bytes(buffer_size, alignment)
        if self._cuda:  # not exercised on CPU-only CI machines
            self._buffers = []
            for _ in range(buffer_count):
                raw = torch.empty(slot + alignment, dtype=torch.uint8, pin_memory=True)
                skip = (-raw.data_ptr()) % alignment
                self._buffers.append(raw[skip:skip + buffer_size])
        else:
            # over-map so a start aligned to both `alignment` and a huge page exists; the slack is
            # never touched, so it costs no memory. mlock faults the pages in after the advice.
            start_align = max(alignment, HUGE_PAGE)
            extra = start_align - _PAGE
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            self._mmap = mmap.mmap(-1, total + extra, flags=flags)
            whole = torch.frombuffer(self._mmap, dtype=torch.uint8)
            skip = (-whole.data_ptr()) % start_align
            self._addr = whole.data_ptr() + skip
            whole_huge = total // HUGE_PAGE * HUGE_PAGE  # only whole huge pages inside the locked range
            if whole_huge and hasattr(mmap, "MADV_HUGEPAGE"):
                self._mmap.madvise(mmap.MADV_HUGEPAGE, skip, whole_huge)
            try:
                _mlock(self._addr, total)
            except PinnedMemoryError as exc:
                del whole
                self._release_mapping()
                raise PinnedMemoryError(f"pinned buffer pool of {budget}: {exc}") from None
            self._buffers = [whole[skip + i * slot: skip + i * slot + buffer_size] for i in range(buffer_count)]
        self._free: List[int] = list(range(buffer_count - 1, -1, -1))
        self._ptrs = {b.data_ptr(): i for i, b in enumerate(self._buffers)}
        self._closed = False

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran: the buffers are dropped and no longer locked
        (:attr:`pinned_bytes` still gives the size the pool had)."""
        return self._closed

    @property
    def pinned(self) -> bool:
        """True while the buffers are locked (CUDA-pinned or mlock-ed)."""
        return self._cuda or self._addr != 0

    def buffers(self) -> List[torch.Tensor]:
        """All buffers, in order (whether acquired or not)."""
        return list(self._buffers)

    def free_count(self) -> int:
        """Buffers not currently acquired."""
        with self._lock:
            return len(self._free)

    def acquire(self) -> torch.Tensor:
        """Take a free buffer (uint8, ``buffer_size`` elements, ``alignment``-aligned).

        Raises:
            PoolExhaustedError: every buffer is in use.
        """
        with self._lock:
            if not self._free:
                raise PoolExhaustedError(f"all {self.buffer_count} pinned buffers of {self.buffer_size} bytes "
                                         "are in use; release one first or enlarge buffer_count")
            return self._buffers[self._free.pop()]

    def acquire_leaving(self, count: int, keep_free: int) -> Optional[List[torch.Tensor]]:
        """Take ``count`` free buffers only if ``keep_free`` stay free after, in one step under the
        pool's lock (a check of :meth:`free_count` followed by :meth:`acquire` calls lets another
        thread take buffers in between). Returns the buffers (each as from :meth:`acquire`: uint8,
        ``buffer_size`` bytes), or None, taking nothing, when fewer than ``count + keep_free`` are free.

        Raises:
            ValueError: ``count`` < 1 or ``keep_free`` < 0.
        """
        if count < 1 or keep_free < 0:
            raise ValueError(f"acquire_leaving(): count must be >= 1 and keep_free >= 0, got {count}, {keep_free}")
        with self._lock:
            if len(self._free) - count < keep_free:
                return None
            return [self._buffers[self._free.pop()] for _ in range(count)]

    def release(self, buffer: torch.Tensor) -> None:
        """Return a buffer obtained from :meth:`acquire` (or a view starting at its first byte).

        Raises:
            ValueError: the tensor is not one of this pool's buffers, or it is already free.
        """
        idx = self._ptrs.get(buffer.data_ptr()) if isinstance(buffer, torch.Tensor) else None
        if idx is None:
            raise ValueError("release(): the tensor does not start at one of this pool's buffers")
        with self._lock:
            if idx in self._free:
                raise ValueError(f"release(): buffer {idx} is already free (released twice?)")
            self._free.append(idx)

    def replace(self, buffer: torch.Tensor) -> None:
        """Give up an acquired buffer that something still reads (``buffer`` or a view starting
        at its first byte): it stays valid for its readers and is never handed out again; its
        place in the pool gets a new aligned buffer of the same size, which is free. The new
        buffer is not page-locked (on CUDA, it is pinned); :attr:`pinned_bytes` is unchanged.

        Raises:
            ValueError: the tensor is not one of this pool's buffers, or it is already free.
        """
        idx = self._ptrs.get(buffer.data_ptr()) if isinstance(buffer, torch.Tensor) else None
        if idx is None:
            raise ValueError("replace(): the tensor does not start at one of this pool's buffers")
        raw = torch.empty(self.buffer_size + self.alignment, dtype=torch.uint8, pin_memory=self._cuda)
        skip = (-raw.data_ptr()) % self.alignment
        new = raw[skip:skip + self.buffer_size]
        with self._lock:
            if idx in self._free:
                raise ValueError(f"replace(): buffer {idx} is free (released already?)")
            del self._ptrs[self._buffers[idx].data_ptr()]
            self._buffers[idx] = new
            self._ptrs[new.data_ptr()] = idx
            self._free.append(idx)

    @staticmethod
    def view(buffer: torch.Tensor, dtype: torch.dtype, numel: int, shape=None) -> torch.Tensor:
        """The first ``numel`` elements of ``buffer`` as ``dtype`` (optionally reshaped to ``shape``).

        Raises:
            ValueError: ``numel`` elements of ``dtype`` do not fit in the buffer.
        """
        itemsize = torch.empty((), dtype=dtype).element_size()
        need = numel * itemsize
        if need > buffer.numel() * buffer.element_size():
            raise ValueError(f"{numel} x {dtype} ({need} bytes) does not fit a buffer of "
                             f"{buffer.numel() * buffer.element_size()} bytes")
        out = buffer.view(torch.uint8)[:need].view(dtype)
        return out.view(shape) if shape is not None else out

    def _release_mapping(self) -> None:
        if self._addr:
            _munlock(self._addr, self.pinned_bytes)
            self._addr = 0
        # the buffers' storage holds the mmap object: dropping this reference unmaps it once no
        # tensor views it (mmap.close() would unmap it under buffers still held, which then crash)
        self._mmap = None

    def close(self) -> None:
        """Unlock and drop the buffers. Tensors still held by the caller stay valid (unlocked)."""
        self._buffers = []
        self._free = []
        self._ptrs = {}
        self._closed = True
        self._release_mapping()

    def __enter__(self) -> "PinnedBufferPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
