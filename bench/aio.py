"""Sequential O_DIRECT write then read of one file: zeroinf's aio backends against their peers.

Rows (``name``), all on the same preallocated file, in one run; ``layout`` says the block size,
queue depth and which buffer the bytes came from / went to:

* ``zeroinf-<backend>`` — AsyncIOHandle, swept over block size × queue depth × backend × buffer;
* ``raw-odirect`` — a plain loop of O_DIRECT ``preadv``/``pwritev`` calls of up to 1 GiB each
  (the kernel splits each into device-sized requests itself), on each buffer;
* ``deepspeed`` — DeepSpeed's ``aio_handle`` with its own locked buffer (``buf=ds-locked``), same
  block size and depth, when ``deepspeed`` is importable; zeroinf's libaio backend and
  raw-odirect also run on that same buffer, so engine and memory can be told apart;
* ``fio-libaio`` — fio (ioengine=libaio, direct=1, its own buffer: ``buf=fio``) with the same
  block size and depth, when the ``fio`` binary is installed.

Buffers (``--buffers``): ``locked`` is :func:`zeroinf.io.locked.locked_cpu_tensor` (page-locked,
2 MiB huge pages; ``AsyncIOHandle.new_cpu_locked_tensor``), ``pool`` a
:class:`~zeroinf.io.PinnedBufferPool` buffer (mlock-ed 4 KiB pages). The buffer decides much of
the speed on a virtio disk: device requests are capped by how many physically scattered pages
they span (see bench/README.md).

Timing: per workload and block size × depth, every row of that group (raw-odirect on each buffer
included) is timed in rounds (``--warmup`` untimed, ``--repeat`` timed, median), each round in a
new shuffled order (fixed seed), so drift of the shared disk falls on all rows alike and no row
always runs first or after the same neighbour. Prints GB/s with each row's ratio to
raw-odirect on the same buffer in the same rounds, then per workload the best zeroinf row with its
ratios to raw-odirect, fio and deepspeed. Only same-run ratios mean anything on a shared disk.

    python bench/aio.py --dir /path/on/nvme [--size 2G] [--json out.json]
"""
from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _util import Row, bench_parser, machine_line, print_table, time_interleaved, write_json  # noqa: E402

import torch  # noqa: E402

from zeroinf.io import AsyncIOHandle, PinnedBufferPool  # noqa: E402
from zeroinf.io.backends import BACKENDS, backend_reasons  # noqa: E402
from zeroinf.io.locked import huge_page_bytes, locked_cpu_tensor  # noqa: E402
from zeroinf.io.tune import parse_block_sizes, parse_bytes  # noqa: E402
from zeroinf.sizes import format_bytes as _fmt  # noqa: E402
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
    """DeepSpeed's aio_handle (single_submit False, overlap_events True, one thread), or None
    when deepspeed is not importable (its rows are skipped)."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError:
        return None
    return AsyncIOBuilder().load().aio_handle(bs, qd, False, True, 1)


def time_shuffled(fns, repeat: int, warmup: int, rng: random.Random):
    """Median seconds of each function over ``repeat`` rounds, each round one call of every
    function in a new shuffled order (``warmup`` untimed rounds first). Returns ``{name: s}``."""
    keys = list(fns)
    times = {k: [] for k in keys}
    for rnd in range(warmup + repeat):
        rng.shuffle(keys)
        for k, t in time_interleaved({k: fns[k] for k in keys}, repeat=1, warmup=0).items():
            if rnd >= warmup:
                times[k].append(t)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    parser = bench_parser("O_DIRECT sequential write/read: zeroinf aio vs raw O_DIRECT, fio, DeepSpeed",
                          repeat=5, warmup=1)
    parser.add_argument("--dir", default=".", help="directory on the device to measure (default: .)")
    parser.add_argument("--size", default="2GiB", help=f"file size ({SIZE_HELP}; default 2GiB)")
    parser.add_argument("--block-sizes", default="256KiB,1MiB,4MiB", help="comma list, multiples of 4096 bytes")
    parser.add_argument("--queue-depths", default="4,8,32")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma list (unavailable ones are skipped)")
    parser.add_argument("--buffers", default="locked,pool",
                        help="zeroinf buffers: locked (huge-page locked_cpu_tensor), pool (PinnedBufferPool)")
    parser.add_argument("--no-fio", action="store_true", help="skip the fio rows")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip the deepspeed rows")
    args = parser.parse_args()
    size = -(-parse_bytes(args.size) // 4096) * 4096
    bss = parse_block_sizes(args.block_sizes)
    qds = [int(q) for q in args.queue_depths.split(",")]
    backends = []
    for b in args.backends.split(","):
        why = backend_reasons(b)
        if why:
            print(f"backend {b} skipped: {'; '.join(why)}")
        else:
            backends.append(b)
    kinds = args.buffers.split(",")
    for k in kinds:
        if k not in ("locked", "pool"):
            parser.error(f"--buffers: unknown buffer {k!r} (known: locked, pool)")
    print(machine_line())
    print(f"file {size} bytes under {os.path.abspath(args.dir)}, repeat {args.repeat}, warmup {args.warmup}")

    src = torch.randint(0, 256, (size,), dtype=torch.uint8)
    pool = PinnedBufferPool(1, size) if "pool" in kinds else None
    bufs = {}
    for k in kinds:
        bufs[k] = locked_cpu_tensor(size) if k == "locked" else pool.acquire()
    ds_probe = None if args.no_deepspeed else deepspeed_handle(bss[0], qds[0])
    if ds_probe is not None:
        bufs["ds-locked"] = ds_probe.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
    elif not args.no_deepspeed:
        print("deepspeed not importable: its rows are skipped")
    for k, b in bufs.items():
        b.copy_(src)
        print(f"buffer {k}: {huge_page_bytes(b) / size:.0%} of it in 2 MiB huge pages")
    del src
    tmpdir = tempfile.mkdtemp(prefix="zeroinf-bench-aio-", dir=args.dir)
    path = os.path.join(tmpdir, "data.bin")
    rows = []
    rng = random.Random(0)

    def add(name, workload, layout, seconds):
        rows.append(Row(name=name, workload=workload, layout=layout, ms=1e3 * seconds, gbps=size / seconds / 1e9))

    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.posix_fallocate(fd, 0, size)  # preallocated: every write below overwrites
        os.close(fd)
        raw_odirect(bufs[kinds[0]], path, True)
        for write in (True, False):
            wl = "write" if write else "read"
            for bs in bss:
                for qd in qds:
                    tag = f"bs={_fmt(bs)} qd={qd}"
                    fns, names, handles = {}, {}, []

                    def entry(name, buf_kind, fn):
                        key = f"{name} {tag} buf={buf_kind}"
                        fns[key], names[key] = fn, (name, f"{tag} buf={buf_kind}")

                    for k, b in bufs.items():
                        entry("raw-odirect", k, lambda b=b: raw_odirect(b, path, write))
                    for be in backends:
                        h = AsyncIOHandle(block_size=bs, queue_depth=qd, backend=be)
                        handles.append(h)
                        op = h.sync_pwrite if write else h.sync_pread
                        for k, b in bufs.items():
                            if k != "ds-locked" or be == "libaio":
                                entry(f"zeroinf-{be}", k, lambda op=op, b=b: op(b, path))
                    ds = deepspeed_handle(bs, qd) if ds_probe is not None else None
                    if ds is not None:
                        dop = ds.sync_pwrite if write else ds.sync_pread
                        entry("deepspeed", "ds-locked", lambda: dop(bufs["ds-locked"], path))
                    times = time_shuffled(fns, args.repeat, args.warmup, rng)
                    for key, t in times.items():
                        add(names[key][0], wl, names[key][1], t)
                    for h in handles:
                        h.close()
                    if not args.no_fio and shutil.which("fio"):
                        res = fio_row(path, size, bs, qd, write)
                        if res is not None:
                            add("fio-libaio", wl, f"{tag} buf=fio", res[0])
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
        if ds_probe is not None:
            ds_probe.free_cpu_locked_tensor(bufs.pop("ds-locked"))
        if pool is not None:
            pool.close()

    print_table(rows, peer="raw-odirect", group_by=("workload", "layout"))
    print("\nbest zeroinf configuration per workload (same run; raw-odirect on the same buffer, same rounds):")
    summary = {}
    for wl in ("write", "read"):
        mine = [r for r in rows if r.workload == wl and r.name.startswith("zeroinf-")]
        best = min(mine, key=lambda r: r.ms)
        raw = next(r for r in rows if r.workload == wl and r.name == "raw-odirect" and r.layout == best.layout)
        line = f"  {wl:<5} {best.name} {best.layout}: {best.gbps:.2f} GB/s, x raw-odirect {raw.ms / best.ms:.3f}"
        summary[wl] = {"best": best.name, "layout": best.layout, "gbps": best.gbps, "x_raw": raw.ms / best.ms}
        for peer in ("fio-libaio", "deepspeed"):
            top = max((r for r in rows if r.workload == wl and r.name == peer), key=lambda r: r.gbps, default=None)
            if top is not None:
                line += f", x best {peer} ({top.layout}) {top.ms / best.ms:.3f}"
                summary[wl][f"x_best_{peer}"] = top.ms / best.ms
        print(line)
        for r in rows:  # the engines alone: zeroinf's libaio backend on DeepSpeed's own buffer
            if r.workload == wl and r.name == "deepspeed":
                z = next((x for x in rows if x.workload == wl and x.name == "zeroinf-libaio" and x.layout == r.layout),
                         None)
                if z is not None:
                    print(f"        same buffer ({r.layout}): zeroinf-libaio {z.gbps:.2f} GB/s vs deepspeed "
                          f"{r.gbps:.2f}, x {r.ms / z.ms:.3f}")
    write_json(args.json, {"size": size, "dir": os.path.abspath(args.dir), "machine": machine_line(),
                           "summary": summary}, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
