"""``zeroinf tune-io --path DIR``: the command line of :func:`zeroinf.io.tune.sweep`; prints the
sweep and the best configuration as a DeepSpeed ``aio`` block, ready to paste into a config.
``bench/aio.py`` is the full benchmark."""
from __future__ import annotations

import argparse
import json
import os
import sys

from zeroinf.io.tune import parse_block_sizes, sweep
from zeroinf.sizes import SIZE_HELP, format_bytes, parse_bytes

__all__ = ["add_arguments", "main"]


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
    from zeroinf.io.backends import BACKENDS
    from zeroinf.io.errors import AIOError

    def fail(msg: str) -> int:
        print(f"zeroinf tune-io: error: {msg}", file=sys.stderr)
        return 2
    if not os.path.isdir(args.path):
        return fail(f"--path {args.path}: not an existing directory")
    try:
        size = parse_bytes(args.size)
        if size <= 0:
            raise ValueError(f"--size: must be positive, got {args.size!r}")
        bss = parse_block_sizes(args.block_sizes)
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
        print(f"{r['backend']:<8} {format_bytes(r['block_size']):>6} {r['queue_depth']:>4} "
              f"{r['write_gbps']:11.2f} {r['read_gbps']:10.2f}")
    best = min(rows, key=lambda r: r["seconds"])
    block = {"aio": {"block_size": best["block_size"], "queue_depth": best["queue_depth"],
                     "intra_op_parallelism": 1, "single_submit": False, "overlap_events": True}}
    print(f"best (least write + read time, backend {best['backend']}):")
    print(json.dumps(block, indent=2))
    return 0
