"""Storage tiers: async O_DIRECT file I/O, a pinned host buffer pool, a tensor swapper.

* :class:`AsyncIOHandle` — DeepSpeed ``aio_handle``-compatible reads/writes of tensor bytes
  (backends: libaio, a C++ thread pool, a pure-Python thread pool; see :mod:`.backends`).
* :class:`PinnedBufferPool` / :func:`pinned_pool_bytes` — aligned, page-locked buffers with a
  budget checked before allocating.
* :func:`locked_cpu_tensor` / :func:`free_locked_cpu_tensor` (:mod:`.locked`) — one page-locked tensor on 2 MiB
  huge pages (DeepSpeed's ``new_cpu_locked_tensor``); :func:`huge_page_bytes` checks it got them.
* :class:`TensorSwapper` — named tensors to preallocated swap files and back, with a manifest;
  every transfer's CRC-32Cs recorded and verified (:class:`ChunkChecksums`, :mod:`.checksum`).
* :func:`backend_report` — which backends run here and why the others do not.

All I/O failures are :class:`AIOError` (``OSError``) subclasses from :mod:`.errors`.
"""
from .backends import BACKENDS, backend_report
from .checksum import ChunkChecksums
from .errors import (AIOError, AIOFileNotFoundError, BackendUnavailableError, ChecksumMismatchError,
                     DeviceIOError, DiskFullError, ReadPastEndError, SizeMismatchError, StaleSwapFileError)
from .handle import AsyncIOHandle, free_locked_cpu_tensor, huge_page_bytes, locked_cpu_tensor
from .pool import PinnedBufferPool, PinnedMemoryError, PoolExhaustedError, pinned_pool_bytes
from .swapper import TensorSwapper

__all__ = [
    "AIOError", "AIOFileNotFoundError", "AsyncIOHandle", "BACKENDS", "BackendUnavailableError",
    "ChecksumMismatchError", "ChunkChecksums", "DeviceIOError", "DiskFullError", "PinnedBufferPool", "PinnedMemoryError",
    "PoolExhaustedError", "ReadPastEndError", "SizeMismatchError", "StaleSwapFileError", "TensorSwapper",
    "backend_report", "free_locked_cpu_tensor", "huge_page_bytes", "locked_cpu_tensor", "pinned_pool_bytes",
]
