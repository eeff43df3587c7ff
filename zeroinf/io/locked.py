"""Page-locked CPU tensors on 2 MiB transparent huge pages: the fastest buffers for
:class:`~zeroinf.io.AsyncIOHandle` (DeepSpeed's ``new_cpu_locked_tensor``).

:func:`locked_cpu_tensor` (also :meth:`AsyncIOHandle.new_cpu_locked_tensor`) gives page-locked
memory backed by 2 MiB transparent huge pages. O_DIRECT hands the buffer's pages to the device
as a scatter list of at most ``max_segments`` entries per request (254 on this project's virtio
disk), so scattered 4 KiB pages cap device requests near 1 MiB, while physically contiguous 2
MiB pages let the block layer merge them up to ``max_sectors_kb`` (4 MiB there). On that disk
this buffer read 1.11-1.18x and wrote 1.17-1.26x faster than a
:class:`~zeroinf.io.PinnedBufferPool` buffer (4 KiB pages), same engine, same run
(bench/README.md, bench/aio.py).
"""
from __future__ import annotations

import mmap
import threading
import warnings
from typing import Dict, Tuple

import torch

from .pool import HUGE_PAGE, PinnedMemoryError, _available_bytes, _locked_bytes, _memlock_limit, _mlock, _munlock

__all__ = ["HUGE_PAGE", "free_locked_cpu_tensor", "huge_page_bytes", "huge_paged_bytes", "is_locked_cpu_tensor",
           "locked_cpu_tensor", "locked_cpu_tensor_bytes"]

_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
_THP_WARNED = False

#: data_ptr -> locked bytes of every buffer made by locked_cpu_tensor and not yet freed.
_LOCKED: Dict[int, int] = {}
_LOCKED_MU = threading.Lock()


def _thp_mode() -> str:
    """The kernel's transparent huge page mode ("always", "madvise", "never"; "" if unknown)."""
    try:
        with open(_THP_ENABLED) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def _huge_page_mapping(nbytes: int, advise: bool = True) -> Tuple[mmap.mmap, torch.Tensor]:
    """A fresh anonymous mapping and a uint8 tensor of its first ``nbytes`` bytes from a
    :data:`HUGE_PAGE`-aligned start (contents zero); the whole huge pages among them advised
    ``MADV_HUGEPAGE`` when ``advise``. Over-mapped by one huge page so that start exists; the
    slack is never touched (no RSS). The tensor's storage holds the mapping, which is unmapped
    when the last view of it is freed."""
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(m, dtype=torch.uint8)
    skip = (-whole.data_ptr()) % HUGE_PAGE
    huge = nbytes // HUGE_PAGE * HUGE_PAGE
    if advise and huge and hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE, skip, huge)
    return m, whole[skip:skip + nbytes]


def huge_paged_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` (>= 1) bytes of fresh, unlocked memory as a 1-D uint8 CPU tensor whose start is
    :data:`HUGE_PAGE`-aligned and whose whole huge pages are advised ``MADV_HUGEPAGE``, so with
    the kernel's usual THP mode ("madvise") they are 2 MiB pages: O_DIRECT to and from them
    reaches the rate of :func:`locked_cpu_tensor` buffers (bench/io_pages.py), and a first touch
    faults once per 2 MiB. Contents are zero. Unmapped when the last view of it is freed."""
    return _huge_page_mapping(nbytes)[1]


def locked_cpu_tensor_bytes(num_elem: int, dtype: torch.dtype = torch.uint8, huge_pages: bool = True) -> int:
    """Exact bytes :func:`locked_cpu_tensor` locks for ``num_elem`` elements of ``dtype``.

    The tensor's bytes rounded up to :data:`HUGE_PAGE` (``huge_pages``) or to the page size, so
    the last huge page is whole. Raises ``ValueError`` for ``num_elem`` < 1.
    """
    if not isinstance(num_elem, int) or isinstance(num_elem, bool) or num_elem < 1:
        raise ValueError(f"num_elem: expected an integer >= 1, got {num_elem!r}")
    nbytes = num_elem * torch.empty((), dtype=dtype).element_size()
    step = HUGE_PAGE if huge_pages else mmap.PAGESIZE
    return -(-nbytes // step) * step


def locked_cpu_tensor(num_elem: int, dtype: torch.dtype = torch.uint8, huge_pages: bool = True) -> torch.Tensor:
    """A 1-D CPU tensor of ``num_elem`` elements of ``dtype`` in page-locked, pre-faulted memory.

    The memory is an anonymous mapping whose start is :data:`HUGE_PAGE`-aligned (so it also
    meets O_DIRECT's 4096-byte rule), advised ``MADV_HUGEPAGE`` when ``huge_pages`` (the default),
    then ``mlock``-ed, which faults every page in: with transparent huge pages enabled
    ("always" or "madvise") it is backed by 2 MiB pages, the fastest buffer for
    :class:`AsyncIOHandle` (see the module docstring). Contents are zero.

    Lifetime: the mapping lives as long as any view of the tensor; :func:`free_locked_cpu_tensor`
    (or :meth:`AsyncIOHandle.free_cpu_locked_tensor`) unlocks it early.

    Args:
        num_elem: elements (>= 1).
        dtype: element type (default ``torch.uint8``).
        huge_pages: advise 2 MiB pages. When the kernel's THP mode is "never", 4 KiB pages are
            used and one ``RuntimeWarning`` per process says so.

    Raises:
        ValueError: ``num_elem`` < 1.
        PinnedMemoryError: before allocating, when :func:`locked_cpu_tensor_bytes` exceeds the
            available memory or the soft ``RLIMIT_MEMLOCK`` (unless CAP_IPC_LOCK); or when
            ``mlock`` fails (nothing stays allocated then).
    """
    global _THP_WARNED
    total = locked_cpu_tensor_bytes(num_elem, dtype, huge_pages)
    avail = _available_bytes()
    if total > avail:
        raise PinnedMemoryError(f"locked tensor of {num_elem} x {dtype} ({total} bytes locked) exceeds the "
                                f"{avail} bytes of available memory")
    limit = _memlock_limit()
    if limit is not None and total + _locked_bytes() > limit:
        raise PinnedMemoryError(f"locked tensor of {num_elem} x {dtype} ({total} bytes locked) exceeds the memlock "
                                f"limit (RLIMIT_MEMLOCK soft = {limit} bytes, {_locked_bytes()} already locked); "
                                "raise it with `ulimit -l`")
    if huge_pages and _thp_mode() == "never" and not _THP_WARNED:
        _THP_WARNED = True
        warnings.warn(f"transparent huge pages are disabled ({_THP_ENABLED} is 'never'): locked buffers use "
                      "4 KiB pages, which can cap O_DIRECT device requests near 1 MiB", RuntimeWarning, stacklevel=2)
    m, whole = _huge_page_mapping(total, advise=huge_pages)
    addr = whole.data_ptr()
    try:
        _mlock(addr, total)
    except PinnedMemoryError as exc:
        whole = None  # the mapping cannot close while a tensor still exports its buffer
        m.close()
        raise PinnedMemoryError(f"locked tensor of {num_elem} x {dtype} ({total} bytes): {exc}") from None
    with _LOCKED_MU:
        _LOCKED[addr] = total
    nbytes = num_elem * torch.empty((), dtype=dtype).element_size()
    return whole[:nbytes].view(dtype)


def free_locked_cpu_tensor(tensor: torch.Tensor) -> bool:
    """Unlock a tensor made by :func:`locked_cpu_tensor` (DeepSpeed's ``free_cpu_locked_tensor``).

    Returns False, doing nothing, for any other tensor (or one already freed). The memory stays
    valid, unlocked, until the last view of it is dropped.
    """
    if not isinstance(tensor, torch.Tensor):
        return False
    with _LOCKED_MU:
        total = _LOCKED.pop(tensor.data_ptr(), None)
    if total is None:
        return False
    _munlock(tensor.data_ptr(), total)
    return True


def is_locked_cpu_tensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s first byte lies in a buffer made by :func:`locked_cpu_tensor` and not
    yet freed (a view of one counts)."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        return False
    addr = tensor.data_ptr()
    with _LOCKED_MU:
        return any(start <= addr < start + total for start, total in _LOCKED.items())


def huge_page_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the anonymous huge pages (``AnonHugePages`` in /proc/self/smaps) of the memory
    mapping holding ``tensor``'s first byte; 0 when that mapping has none or smaps is unreadable.
    A diagnostic for benches and tests: whether :func:`locked_cpu_tensor` got 2 MiB pages."""
    addr = tensor.data_ptr()
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and ":" not in head:
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= addr < hi
                elif inside and line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
