"""How much NVMe I/O and CPU compute can overlap on this machine, same run.

An offload step hides its swap I/O behind compute only if (a) the disk serves reads and writes
at once at their separate speeds and (b) the I/O costs the CPU little. Neither holds on every
machine: on a virtual disk the host's I/O emulation runs on the same physical cores as the
guest (it shows as ``steal`` in /proc/stat), and the disk's bandwidth is shared by reads and
writes. This script measures both with the engine's own ``AsyncIOHandle`` (O_DIRECT, pinned
huge-page buffers, ``--chunk-mb`` files of 128 MiB by default):

* ``write``, ``read``, ``read+write``: GB/s of writing, reading, and both at once (two handles,
  two threads);
* ``compute``: seconds of ``--matmuls`` fp32 1024x1024 matmuls (torch's threads) alone and
  while the read+write loop runs, the slowdown factor, and the CPU share the kernel reported
  as ``steal`` during the overlapped run;
* ``I/O during that compute``: the GB/s the read+write loop kept up meanwhile, and the share of
  time the overlap saved against running the same compute and the same bytes one after the
  other (at the read+write GB/s above). Near 0% means I/O cannot be hidden here, only shortened.

    python bench/io_overlap.py [--nvme-path DIR] [--chunk-mb 128] [--files 8] [--matmuls 60]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import machine_line  # noqa: E402

from zeroinf.io import AsyncIOHandle, PinnedBufferPool  # noqa: E402


def _cpu_times():
    """(busy, steal, total) jiffies from /proc/stat (Linux), or None."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    steal = v[7] if len(v) > 7 else 0
    return v[0] + v[1] + v[2], steal, sum(v)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvme-path", default=None, help="directory on the disk to test (default: a temp dir under cwd)")
    p.add_argument("--chunk-mb", type=int, default=128, help="size of each file and transfer, MiB")
    p.add_argument("--files", type=int, default=8, help="files per direction")
    p.add_argument("--matmuls", type=int, default=60, help="1024x1024 fp32 matmuls in the compute probe")
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="zeroinf_bench_overlap_", dir=args.nvme_path or os.getcwd())
    chunk = args.chunk_mb << 20
    wfiles = [os.path.join(root, f"w{i}.bin") for i in range(args.files)]
    rfiles = [os.path.join(root, f"r{i}.bin") for i in range(args.files)]
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)

    def matmuls() -> float:
        t0 = time.perf_counter()
        for _ in range(args.matmuls):
            a @ b
        return time.perf_counter() - t0

    try:
        with PinnedBufferPool(2, chunk) as pool:
            wbuf, rbuf = pool.acquire(), pool.acquire()
            wbuf.fill_(7)
            hw, hr = AsyncIOHandle(), AsyncIOHandle()
            for f in wfiles + rfiles:  # swap files are preallocated and overwritten
                hw.sync_pwrite(wbuf, f)
            stop = threading.Event()
            done = [0, 0]  # transfers finished by the write and the read thread


            def transfers(handle, submit, buf, files, slot, loop=False):
                """Write or read ``files`` one after the other; with ``loop``, until ``stop``."""
                while True:
                    for f in files:
                        submit(buf, f)
                        handle.wait()
                        done[slot] += 1
                    if not loop or stop.is_set():
                        return

            def writes(loop=False):
                transfers(hw, hw.async_pwrite, wbuf, wfiles, 0, loop)

            def reads(loop=False):
                transfers(hr, hr.async_pread, rbuf, rfiles, 1, loop)

            def timed(fns) -> float:
                threads = [threading.Thread(target=fn) for fn in fns]
                t0 = time.perf_counter()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                return time.perf_counter() - t0

            nbytes = args.files * chunk
            w_gbps = nbytes / timed([writes]) / 1e9
            r_gbps = nbytes / timed([reads]) / 1e9
            both_gbps = 2 * nbytes / timed([writes, reads]) / 1e9
            matmuls()  # warm-up
            alone = matmuls()
            threads = [threading.Thread(target=fn, args=(True,)) for fn in (writes, reads)]
            for t in threads:
                t.start()
            time.sleep(0.2)  # I/O in full flow
            c0, n0 = _cpu_times(), sum(done)
            loaded = matmuls()
            c1, n1 = _cpu_times(), sum(done)
            io_loaded = (n1 - n0) * chunk / loaded / 1e9
            stop.set()
            for t in threads:
                t.join()
            hw.close()
            hr.close()
            pool.release(wbuf)
            pool.release(rbuf)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(machine_line())
    print(f"disk ({root}): write {w_gbps:.2f} GB/s, read {r_gbps:.2f} GB/s, read+write at once {both_gbps:.2f} GB/s "
          f"in all ({both_gbps / max(w_gbps, r_gbps):.2f}x the faster direction alone)")
    steal = ""
    if c0 is not None and c1 is not None and c1[2] > c0[2]:
        steal = f", steal {100 * (c1[1] - c0[1]) / (c1[2] - c0[2]):.0f}% of CPU time meanwhile"
    print(f"compute: {args.matmuls} matmuls {alone:.3f} s alone, {loaded:.3f} s during read+write "
          f"({loaded / alone:.2f}x){steal}")
    serial = alone + io_loaded * loaded / both_gbps
    print(f"I/O during that compute: {io_loaded:.2f} GB/s ({io_loaded / both_gbps:.2f}x read+write alone); "
          f"the same compute and bytes one after the other would take {serial:.3f} s "
          f"(overlap saves {100 * (1 - loaded / serial):.0f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
