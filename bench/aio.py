"""Sequential O_DIRECT write then read of one file: zeroinf's aio backends against their peers.

Rows (``name``), all on the same preallocated file and the same page-locked buffer, in one run:

* ``zeroinf-<backend>`` — AsyncIOHandle, swept over block size × queue depth × backend;
* ``raw-odirect`` — a plain Python loop of O_DIRECT ``preadv``/``pwritev`` calls of up to 1 GiB
  each (the kernel splits each into device-sized requests itself);
* ``fio-libaio`` — fio (ioengine=libaio, direct=1) with the same block size and depth, when the
  ``fio`` binary is installed;
* ``deepspeed`` — DeepSpeed's ``aio_handle`` with its own locked buffer, same block size and
  depth, when ``deepspeed`` is importable (it is not in this project's environment; those rows
  are then skipped with a note).

Prints GB/s (1e9 bytes/s) with each row's ratio to ``raw-odirect``, then per workload the best
zeroinf row with its ratios to raw-odirect, fio (same block/depth) and deepspeed. Only same-run
ratios mean anything on a shared disk.

    python bench/aio.py --dir /path/on/nvme [--size 2G] [--json out.json]
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _util import Row, bench_parser, machine_line, print_table, time_median, write_json  # noqa: E402

import torch  # noqa: E402

from zeroinf.io import AsyncIOHandle, PinnedBufferPool  # noqa: E402
from zeroinf.io.backends import BACKENDS, backend_reasons  # noqa: E402
from zeroinf.io.tune import _block_sizes, _fmt, parse_bytes  # noqa: E402
from zeroinf.sizes import SIZE_HELP  # noqa: E402

CHUNK = 1 << 30  # raw loop: bytes per preadv/pwritev call


def raw_odirect(buf: torch.Tensor, path: str, write: bool) -> None:
    """The peer: O_DIRECT preadv/pwritev over the whole buffer, 1 GiB per call."""
    mv = memoryview(buf.numpy())
    fd = os.open(path, (os.O_WRONLY if write else os.O_RDONLY) | os.O_DIRECT)
    try:
        pos = 0
        while pos < len(mv):
            n = (os.pwritev if write else os.preadv)(fd, [mv[pos:pos + CHUNK]], pos)
            if n <= 0:
                raise OSError(f"raw O_DIRECT {'write' if write else 'read'} returned {n} at {pos}")
            pos += n
    finally:
        os.close(fd)


def fio_row(path: str, size: int, bs: int, qd: int, write: bool):
    """One fio run; returns (seconds, GB/s) or None when fio fails."""
    cmd = ["fio", "--name=zeroinf", f"--filename={path}", f"--rw={'write' if write else 'read'}",
           f"--bs={bs}", f"--iodepth={qd}", "--direct=1", "--ioengine=libaio", f"--size={size}",
           "--numjobs=1", "--output-format=json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"fio failed ({r.returncode}): {r.stderr.strip()[:200]}")
        return None
    job = json.loads(r.stdout[r.stdout.index("{"):])["jobs"][0]["write" if write else "read"]
    bw = float(job["bw_bytes"])
    return size / bw, bw / 1e9


def deepspeed_handle(bs: int, qd: int):
    """DeepSpeed's aio_handle, or None when deepspeed is not importable (rows skipped).

    Not exercised in this project's environment (deepspeed is not installed there)."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError:
        return None
    return AsyncIOBuilder().load().aio_handle(bs, qd, False, True, 1)


def main() -> int:
    parser = bench_parser("O_DIRECT sequential write/read: zeroinf aio vs raw O_DIRECT, fio, DeepSpeed",
                          repeat=3, warmup=1)
    parser.add_argument("--dir", default=".", help="directory on the device to measure (default: .)")
    parser.add_argument("--size", default="2GiB", help=f"file size ({SIZE_HELP}; default 2GiB)")
    parser.add_argument("--block-sizes", default="256KiB,1MiB,4MiB", help="comma list, multiples of 4096 bytes")
    parser.add_argument("--queue-depths", default="4,8,32")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma list (unavailable ones are skipped)")
    parser.add_argument("--no-fio", action="store_true", help="skip the fio rows")
    args = parser.parse_args()
    size = -(-parse_bytes(args.size) // 4096) * 4096
    bss = _block_sizes(args.block_sizes)
    qds = [int(q) for q in args.queue_depths.split(",")]
    backends = []
    for b in args.backends.split(","):
        why = backend_reasons(b)
        if why:
            print(f"backend {b} skipped: {'; '.join(why)}")
        else:
            backends.append(b)
    print(machine_line())
    print(f"file {size} bytes under {os.path.abspath(args.dir)}, repeat {args.repeat}, warmup {args.warmup}")

    pool = PinnedBufferPool(1, size)
    buf = pool.acquire()
    buf.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    tmpdir = tempfile.mkdtemp(prefix="zeroinf-bench-aio-", dir=args.dir)
    path = os.path.join(tmpdir, "data.bin")
    rows = []

    def add(name, workload, layout, seconds, extra=None):
        rows.append(Row(name=name, workload=workload, layout=layout, ms=1e3 * seconds, gbps=size / seconds / 1e9,
                        extra=extra or {}))

    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.posix_fallocate(fd, 0, size)  # preallocated: every write below overwrites
        os.close(fd)
        raw_odirect(buf, path, True)
        for write in (True, False):
            wl = "write" if write else "read"
            t = time_median(lambda: raw_odirect(buf, path, write), repeat=args.repeat, warmup=args.warmup)
            add("raw-odirect", wl, f"{_fmt(CHUNK)}/call", t)
            for bs in bss:
                for qd in qds:
                    layout = f"bs={_fmt(bs)} qd={qd}"
                    for b in backends:
                        h = AsyncIOHandle(block_size=bs, queue_depth=qd, backend=b)
                        op = h.sync_pwrite if write else h.sync_pread
                        t = time_median(lambda: op(buf, path), repeat=args.repeat, warmup=args.warmup)
                        add(f"zeroinf-{b}", wl, layout, t)
                        h.close()
                    ds = deepspeed_handle(bs, qd)
                    if ds is not None:
                        dsbuf = ds.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
                        dsbuf.copy_(buf)
                        dop = ds.sync_pwrite if write else ds.sync_pread
                        t = time_median(lambda: dop(dsbuf, path), repeat=args.repeat, warmup=args.warmup)
                        add("deepspeed", wl, layout, t)
                        ds.free_cpu_locked_tensor(dsbuf)
                    if not args.no_fio and shutil.which("fio"):
                        res = fio_row(path, size, bs, qd, write)
                        if res is not None:
                            add("fio-libaio", wl, layout, res[0])
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
        pool.close()
    if deepspeed_handle(bss[0], qds[0]) is None:
        print("deepspeed not importable: its rows are skipped")

    print_table(rows, peer="raw-odirect", group_by=("workload",))
    print("\nbest zeroinf configuration per workload (same run):")
    summary = {}
    for wl in ("write", "read"):
        mine = [r for r in rows if r.workload == wl and r.name.startswith("zeroinf-")]
        best = min(mine, key=lambda r: r.ms)
        raw = next(r for r in rows if r.workload == wl and r.name == "raw-odirect")
        line = f"  {wl:<5} {best.name} {best.layout}: {best.gbps:.2f} GB/s, x raw-odirect {raw.ms / best.ms:.3f}"
        summary[wl] = {"best": best.name, "layout": best.layout, "gbps": best.gbps, "x_raw": raw.ms / best.ms}
        for peer in ("fio-libaio", "deepspeed"):
            same = next((r for r in rows if r.workload == wl and r.name == peer and r.layout == best.layout), None)
            top = max((r for r in rows if r.workload == wl and r.name == peer), key=lambda r: r.gbps, default=None)
            if same is not None:
                line += f", x {peer} (same bs/qd) {same.ms / best.ms:.3f}, x best {peer} {top.ms / best.ms:.3f}"
                summary[wl][f"x_{peer}"] = same.ms / best.ms
        print(line)
    write_json(args.json, {"size": size, "dir": os.path.abspath(args.dir), "machine": machine_line(),
                           "summary": summary}, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
