"""CRC-32C checksums of swap data: one per :data:`CHUNK_BYTES` chunk of a transfer.

A write asked to checksum (``AsyncIOHandle.async_pwrite(..., checksums=ChunkChecksums())``) gets
the CRC-32C of each chunk ``[0, C)``, ``[C, 2C)``, ... of its bytes (the last chunk shorter),
computed by the engine's threads as each block completes (csrc/aio/aio_handle.h says which
thread; csrc/aio/crc32c.cpp: SSE4.2 where the CPU has it, a sliced table elsewhere); a read
asked the same gets the CRCs of the bytes it read. :class:`~zeroinf.io.TensorSwapper` records the write's list and compares
the read's with it, so a mismatch names the first bad chunk's byte offset.

Values are the standard CRC-32C (Castagnoli): ``crc32c(b"123456789") == 0xE3069283``. The
``python`` I/O backend uses the C++ op's function; only where the op cannot load does it use
:func:`crc32c_reference`, a numpy table version (about 100x slower).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import numpy as np
import torch

__all__ = ["CHUNK_BYTES", "ChunkChecksums", "chunk_crcs", "crc32c", "crc32c_combine", "crc32c_reference",
           "first_mismatch"]

#: Bytes per checksum chunk (1 MiB): a 1 GiB swap file keeps 1024 CRCs in its manifest entry.
CHUNK_BYTES = 1 << 20

_POLY = 0x82F63B78  # reflected Castagnoli polynomial


@dataclass
class ChunkChecksums:
    """Filled by :class:`~zeroinf.io.AsyncIOHandle` when the request it was passed with
    succeeds: ``crcs`` is then one CRC-32C (unsigned 32-bit int) per ``chunk_bytes`` bytes of
    the transfer, in file order. A failed request leaves ``crcs`` None."""

    chunk_bytes: int = CHUNK_BYTES
    crcs: Optional[List[int]] = None


def _table() -> np.ndarray:
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = np.where(t & 1, (t >> 1) ^ np.uint32(_POLY), t >> 1).astype(np.uint32)
    return t


_TABLE = _table()


def _as_bytes(data: Union[torch.Tensor, bytes, bytearray, memoryview]) -> np.ndarray:
    if isinstance(data, torch.Tensor):
        flat = data.detach().reshape(-1)
        if flat.device.type != "cpu":
            flat = flat.cpu()
        return flat.contiguous().view(torch.uint8).numpy()
    return np.frombuffer(data, dtype=np.uint8)


def crc32c_reference(data, value: int = 0) -> int:
    """CRC-32C of ``data``'s bytes (tensor or bytes-like) continuing ``value``, in numpy only.

    The bytes are cut into rows of equal length, the rows' CRCs run in lock-step (one table
    lookup per column for all rows), and the rows are merged with :func:`crc32c_combine`.
    """
    b = _as_bytes(data)
    n = b.size
    if n == 0:
        return value & 0xFFFFFFFF
    width = max(64, int((2 * n) ** 0.5))
    rows = n // width
    head = b[:rows * width].reshape(rows, width) if rows else b[:0].reshape(0, width)
    regs = np.zeros(rows, dtype=np.uint32)
    if rows:
        regs[:] = 0xFFFFFFFF
        for j in range(width):
            regs = _TABLE[(regs ^ head[:, j]) & 0xFF] ^ (regs >> 8)
        regs ^= np.uint32(0xFFFFFFFF)
    crc = value & 0xFFFFFFFF
    for r in regs.tolist():
        crc = crc32c_combine(crc, r, width)
    reg = crc ^ 0xFFFFFFFF
    for byte in b[rows * width:].tolist():
        reg = int(_TABLE[(reg ^ byte) & 0xFF]) ^ (reg >> 8)
    return reg ^ 0xFFFFFFFF


def _multmodp(a: int, b: int) -> int:
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X2N = [1 << 30]
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32C of ``A + B`` from ``crc1 = crc32c(A)``, ``crc2 = crc32c(B)``, ``len2 = len(B)``
    (bytes); zlib's ``crc32_combine`` method for the Castagnoli polynomial."""
    p, k, n = 1 << 31, 3, int(len2)
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


_OP = None
_OP_TRIED = False


def _native():
    global _OP, _OP_TRIED
    if not _OP_TRIED:
        _OP_TRIED = True
        from ..ops.loader import OpBuildError, OpUnavailableError, load_op

        try:
            _OP = load_op("aio")
        except (OpUnavailableError, OpBuildError):
            _OP = None
    return _OP


def crc32c(data, value: int = 0) -> int:
    """CRC-32C (unsigned 32-bit int) of a tensor's bytes (row-major, any dtype; copied to the
    host if needed) or of a bytes-like object, continuing ``value`` (0 to start). Uses the C++
    op, or :func:`crc32c_reference` where the op cannot load."""
    op = _native()
    if op is None:
        return crc32c_reference(data, value)
    if not isinstance(data, torch.Tensor):
        data = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    flat = data.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return op.crc32c(flat.contiguous(), value)


def chunk_crcs(data: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> List[int]:
    """One CRC-32C per ``chunk_bytes`` bytes of ``data`` (a CPU tensor), as the engines report."""
    b = data.detach().reshape(-1).contiguous().view(torch.uint8)
    return [crc32c(b[i:i + chunk_bytes]) for i in range(0, b.numel(), chunk_bytes)]


def first_mismatch(expected: Sequence[int], got: Sequence[int]) -> Optional[int]:
    """Index of the first chunk whose CRC differs (a length difference counts at the shorter
    list's end); None when the lists are equal."""
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))
