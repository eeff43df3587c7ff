"""O_DIRECT reads and writes of one unit-sized buffer by the memory it lies in.

    python bench/io_pages.py [--mib 143] [--rounds 3] [--path DIR]

Times ``AsyncIOHandle`` whole-file reads and writes of the same file into and out of three
buffers of the same size: the NVMe staging pool's (``PinnedBufferPool``: page-locked, huge-page
advised), ``HostMemory.take`` scratch (huge-page advised from 2 MiB on) and a plain
``torch.empty`` buffer (4 KiB pages, 4096-aligned). Reported per buffer: GB/s (1e9 bytes/s) and
the process's kernel CPU milliseconds per transfer (``os.times``, 10 ms ticks: read it over
the rounds, not per row). The pool's rows are this disk's rate for the engine's own staging
reads; a scratch row well below it means gathers read in place pay for their pages.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from zeroinf.io import AsyncIOHandle, PinnedBufferPool
from zeroinf.runtime.host_memory import HostMemory


def _plain(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
    off = (-raw.data_ptr()) % 4096
    return raw[off:off + nbytes]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=143, help="buffer size in MiB (default 143: a 1B-model block in fp32)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of 5 reads and 5 writes per buffer (default 3)")
    p.add_argument("--path", default=None, help="folder for the file (default: a temporary one under /tmp)")
    args = p.parse_args()
    n = args.mib << 20
    folder = tempfile.mkdtemp(dir=args.path)
    path = os.path.join(folder, "io_pages.bin")
    handle = AsyncIOHandle()
    pool = PinnedBufferPool(1, n)
    bufs = {"pool (locked, huge pages)": pool.acquire(), "HostMemory.take": HostMemory().take(n, torch.uint8),
            "torch.empty (4 KiB pages)": _plain(n)}
    for b in bufs.values():
        b.fill_(1)  # touched: no first-touch faults in the timings
    handle.async_pwrite(next(iter(bufs.values())), path)
    handle.wait()
    try:
        for r in range(args.rounds):
            for name, b in bufs.items():
                row = []
                for op in (handle.async_pread, handle.async_pwrite):
                    c0, t0 = os.times(), time.perf_counter()
                    for _ in range(5):
                        op(b, path)
                        handle.wait()
                    c1, t1 = os.times(), time.perf_counter()
                    row.append(f"{5 * n / (t1 - t0) / 1e9:5.2f} GB/s, kernel {(c1.system - c0.system) / 5 * 1e3:4.1f} ms")
                print(f"round {r}  {name:27s} read {row[0]} | write {row[1]}", flush=True)
    finally:
        os.remove(path)
        os.rmdir(folder)
        pool.close()


if __name__ == "__main__":
    main()
