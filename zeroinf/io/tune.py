"""A short aio block-size × queue-depth sweep on a directory (the library half of ``zeroinf tune-io``,
whose command line is :mod:`zeroinf.cli.tune_io`).

Each configuration writes then reads one file of ``--size`` bytes (O_DIRECT, from a pinned
buffer) under ``DIR``; the best configuration is the one with the least write + read time. The
printed JSON is a DeepSpeed ``aio`` block, ready to paste into a config. Figures from a shared
or busy disk vary between runs; rerun when in doubt. ``bench/aio.py`` is the full benchmark.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Dict, List, Optional, Sequence

from zeroinf.sizes import parse_bytes

__all__ = ["parse_block_sizes", "parse_bytes", "sweep"]


def parse_block_sizes(text: str) -> List[int]:
    """Comma list of block sizes; each a multiple of 4096 bytes (O_DIRECT).

    Raises:
        ValueError: a size does not parse or is not such a multiple (e.g. ``256K``, which is
            256000 bytes: write ``256KiB``).
    """
    out = []
    for b in text.split(","):
        n = parse_bytes(b)
        if n <= 0 or n % 4096:
            raise ValueError(f"block size {b.strip()!r} = {n} bytes is not a positive multiple of 4096 (O_DIRECT); "
                             f"K/M/G are decimal (1K = 1000): write e.g. 256KiB or 1MiB")
        out.append(n)
    return out


def sweep(directory: str, size: int, block_sizes: Sequence[int], queue_depths: Sequence[int],
          backend: Optional[str] = None, repeat: int = 2) -> List[Dict]:
    """Time write and read of ``size`` bytes for each (block size, queue depth).

    Args:
        directory: an existing directory on the device to measure.
        size: file size in bytes (rounded up to 4096).
        block_sizes, queue_depths: the values to sweep (bytes; requests in flight).
        backend: aio backend (None: the probed default).
        repeat: timed repetitions per point; the median is kept.

    Returns:
        One dict per point: ``block_size``, ``queue_depth``, ``backend``, ``write_gbps``,
        ``read_gbps`` (GB/s = 1e9 bytes/s), ``seconds`` (median write + median read).
    """
    from zeroinf.progress import counting

    from .handle import AsyncIOHandle
    from .pool import PinnedBufferPool

    size = -(-size // 4096) * 4096
    path = os.path.join(directory, f".zeroinf-tune-{os.getpid()}.bin")
    pool = PinnedBufferPool(1, size)
    buf = pool.acquire()
    buf.copy_(_random_bytes(size))
    out = []
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
        points = [(bs, qd) for bs in block_sizes for qd in queue_depths]
        for bs, qd in counting(points, "zeroinf tune-io: measuring", unit="point"):
            h = AsyncIOHandle(block_size=bs, queue_depth=qd, backend=backend)
            h.sync_pwrite(buf, path)  # warm-up: first write converts unwritten extents
            w = statistics.median(_time(lambda: h.sync_pwrite(buf, path)) for _ in range(repeat))
            r = statistics.median(_time(lambda: h.sync_pread(buf, path)) for _ in range(repeat))
            out.append({"block_size": bs, "queue_depth": qd, "backend": h.backend,
                        "write_gbps": size / w / 1e9, "read_gbps": size / r / 1e9, "seconds": w + r})
            h.close()
    finally:
        if os.path.exists(path):
            os.unlink(path)
        pool.close()
    return out


def _random_bytes(n: int):
    import torch

    return torch.randint(0, 256, (n,), dtype=torch.uint8)


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
