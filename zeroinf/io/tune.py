"""``zeroinf tune-io --path DIR``: a short block-size × queue-depth sweep, then the best ``aio`` block.

Each configuration writes then reads one file of ``--size`` bytes (O_DIRECT, from a pinned
buffer) under ``DIR``; the best configuration is the one with the least write + read time. The
printed JSON is a DeepSpeed ``aio`` block, ready to paste into a config. Figures from a shared
or busy disk vary between runs; rerun when in doubt. ``bench/aio.py`` is the full benchmark.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

from zeroinf.sizes import SIZE_HELP, format_bytes, parse_bytes

__all__ = ["add_arguments", "main", "parse_bytes", "sweep"]

_fmt = format_bytes  # bench/aio.py's name


def _block_sizes(text: str) -> List[int]:
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
        for bs in block_sizes:
            for qd in queue_depths:
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", required=True, help="directory on the device to tune for (must exist)")
    parser.add_argument("--size", default="256MiB", help=f"test file size ({SIZE_HELP}; default 256MiB)")
    parser.add_argument("--block-sizes", default="256KiB,1MiB,4MiB",
                        help="comma list of sizes, each a multiple of 4096 bytes (default 256KiB,1MiB,4MiB)")
    parser.add_argument("--queue-depths", default="4,8,32", help="comma list (default 4,8,32)")
    parser.add_argument("--backend", default=None, help="libaio, threads or python (default: probed)")
    parser.add_argument("--repeat", type=int, default=2, help="timed repetitions per point (default 2)")


def main(args: argparse.Namespace) -> int:
    """Run ``zeroinf tune-io``: 0 with the sweep printed, 2 on a usage error or an I/O failure
    (one line on stderr naming it)."""
    from .backends import BACKENDS
    from .errors import AIOError

    def fail(msg: str) -> int:
        print(f"zeroinf tune-io: error: {msg}", file=sys.stderr)
        return 2
    if not os.path.isdir(args.path):
        return fail(f"--path {args.path}: not an existing directory")
    try:
        size = parse_bytes(args.size)
        if size <= 0:
            raise ValueError(f"--size: must be positive, got {args.size!r}")
        bss = _block_sizes(args.block_sizes)
        qds = [int(q) for q in args.queue_depths.split(",")]
        if any(q < 1 for q in qds):
            raise ValueError(f"--queue-depths: each must be >= 1, got {args.queue_depths!r}")
        if args.repeat < 1:
            raise ValueError(f"--repeat: must be >= 1, got {args.repeat}")
        if args.backend is not None and args.backend not in BACKENDS:
            raise ValueError(f"--backend: {args.backend!r} is not one of {', '.join(BACKENDS)}")
    except ValueError as exc:
        return fail(str(exc))
    try:
        rows = sweep(args.path, size, bss, qds, args.backend, args.repeat)
    except (OSError, MemoryError, AIOError) as exc:  # a path that takes no file, a size beyond memory
        return fail(f"--path {args.path}, --size {args.size}: {type(exc).__name__}: {exc}")
    print(f"{'backend':<8} {'block':>6} {'qd':>4} {'write GB/s':>11} {'read GB/s':>10}")
    for r in rows:
        print(f"{r['backend']:<8} {_fmt(r['block_size']):>6} {r['queue_depth']:>4} "
              f"{r['write_gbps']:11.2f} {r['read_gbps']:10.2f}")
    best = min(rows, key=lambda r: r["seconds"])
    block = {"aio": {"block_size": best["block_size"], "queue_depth": best["queue_depth"],
                     "intra_op_parallelism": 1, "single_submit": False, "overlap_events": True}}
    print(f"best (least write + read time, backend {best['backend']}):")
    print(json.dumps(block, indent=2))
    return 0
