"""Shared helper for the scripts in bench/: arguments, median timing, a ratio table, JSON output.

Every bench script in this folder follows the same shape::

    from _util import Row, bench_parser, time_median, print_table, write_json

    parser = bench_parser("what this bench measures")
    parser.add_argument(...)                      # the script's own knobs
    args = parser.parse_args()
    rows = [Row(name="zeroinf", workload="fp32", layout="1x100M",
                ms=1e3 * time_median(fn, repeat=args.repeat, warmup=args.warmup),
                gbps=bytes_moved / seconds)]
    print_table(rows, peer="torch-fused", roof_gbps=roof)
    write_json(args.json, {"n": n, "threads": t, "roof_gbps": roof}, rows)

JSON layout written by :func:`write_json` (``--json PATH``)::

    {<the script's header keys, e.g. "n", "threads", "roof_gbps">,
     "rows": [{"name": str, "workload": str, "layout": str, "ms": float, "gbps": float, ...}]}

Only same-run ratios are meaningful: memory and disk bandwidth on shared machines vary by 1.5x
between processes, so tables print each row's ratio to a peer (and to a roof) measured in the
same process.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional

__all__ = ["Row", "bench_parser", "time_median", "time_interleaved", "print_table", "write_json", "machine_line"]


@dataclass
class Row:
    """One measured configuration.

    Attributes:
        name: whose implementation ran (``"zeroinf"``, ``"torch-fused"``, ``"fio-libaio"``, ...).
        workload: what it did (``"fp32"``, ``"offload-bf16"``, ``"read"``, ``"write"``).
        layout: how the data was laid out (``"1x100M"``, ``"100x1M"``, ``"bs=1M qd=8"``).
        ms: median wall time of one repetition, milliseconds.
        gbps: effective bandwidth, GB/s (10**9 bytes per second) of bytes actually read+written.
        extra: further per-row numbers (e.g. ``{"params_per_s": 2.4e9}``); merged into the JSON row.
    """

    name: str
    workload: str
    layout: str
    ms: float
    gbps: float
    extra: Dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        d = asdict(self)
        d.update(d.pop("extra"))
        return d


def bench_parser(description: str, *, repeat: int = 10, warmup: int = 3) -> argparse.ArgumentParser:
    """An ``argparse`` parser with the options every bench shares.

    Options: ``--json PATH`` (write results there), ``--repeat N`` (timed repetitions, median
    taken; default ``repeat``), ``--warmup N`` (untimed repetitions first; default ``warmup``).
    """
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", metavar="PATH", default=None, help="write the results as JSON to PATH")
    p.add_argument("--repeat", type=int, default=repeat, help=f"timed repetitions, median reported (default {repeat})")
    p.add_argument("--warmup", type=int, default=warmup, help=f"untimed repetitions first (default {warmup})")
    return p


def time_median(fn: Callable[[], object], *, repeat: int = 10, warmup: int = 3,
                sync: Optional[Callable[[], object]] = None) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeat`` calls after ``warmup`` calls.

    Args:
        fn: the work to time; its return value is ignored.
        repeat: timed calls (>= 1).
        warmup: untimed calls made first (page faults, JIT, caches).
        sync: called after ``fn`` inside the timed region (e.g. ``torch.cuda.synchronize``,
            or an I/O handle's ``wait``) so asynchronous work is counted.

    Raises:
        ValueError: ``repeat`` < 1 or ``warmup`` < 0.
    """
    if repeat < 1 or warmup < 0:
        raise ValueError(f"time_median: repeat must be >= 1 and warmup >= 0, got {repeat}, {warmup}")
    for _ in range(warmup):
        fn()
        if sync is not None:
            sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        if sync is not None:
            sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_interleaved(fns: Dict[str, Callable[[], object]], *, repeat: int = 10, warmup: int = 3,
                     sync: Optional[Callable[[], object]] = None,
                     before: Optional[Callable[[], object]] = None) -> Dict[str, float]:
    """Median wall time in seconds of each function, timed in round-robin rounds.

    Each round calls every function once, in order, so slow drift of a shared machine (other
    jobs starting, memory bandwidth changing) falls on all of them alike instead of on whichever
    was timed last. ``warmup`` untimed rounds come first. ``before``, if given, runs untimed
    before every call (e.g. :func:`evict_caches`, so no function finds the data the one before
    it left in cache).

    Returns:
        ``{name: median seconds over `repeat` rounds}``, same keys as ``fns``.

    Raises:
        ValueError: ``repeat`` < 1 or ``warmup`` < 0.
    """
    if repeat < 1 or warmup < 0:
        raise ValueError(f"time_interleaved: repeat must be >= 1 and warmup >= 0, got {repeat}, {warmup}")
    times: Dict[str, List[float]] = {name: [] for name in fns}
    for rnd in range(warmup + repeat):
        for name, fn in fns.items():
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            if sync is not None:
                sync()
            if rnd >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


_EVICT: List = []


def evict_caches(nbytes: int = 256 << 20) -> None:
    """Read and write ``nbytes`` (default 256 MiB, several times a server's last-level cache) of a
    buffer of its own, so whatever data the caller touched last is out of the CPU caches."""
    import torch
    if not _EVICT or _EVICT[0].numel() * 4 != nbytes:
        _EVICT[:] = [torch.zeros(nbytes // 4)]
    _EVICT[0].add_(1.0)


def machine_line() -> str:
    """One line describing the machine: CPU model, cores, load average, Python."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = "load %.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        load = "load ?"
    return f"{cpu}, {os.cpu_count()} cores, {load}, Python {platform.python_version()}"


def print_table(rows: Iterable[Row], *, peer: Optional[str] = None, roof_gbps: Optional[float] = None,
                roof: Optional[str] = None, group_by=("workload", "layout"),
                extra_columns: Iterable[str] = ()) -> None:
    """Print rows as a table, with ratios to a same-run peer and roof.

    Rows are grouped by ``group_by``; inside a group, ``x peer`` is the row's speed divided by the
    speed of the row whose ``name == peer`` (>1 means faster than the peer; computed from ``ms``,
    so it is a throughput ratio on the same work), and ``x roof`` is ``gbps / roof_gbps``, or,
    when ``roof`` names a row, the row's speed over that group's roof row's speed.
    A missing peer or roof row in a group prints ``-``. ``extra_columns`` names keys of
    ``Row.extra`` printed after GB/s (e.g. ``("params_per_s",)``), in %.3g.
    """
    rows = list(rows)
    groups: Dict[tuple, List[Row]] = {}
    for r in rows:
        groups.setdefault(tuple(getattr(r, g) for g in group_by), []).append(r)
    extra_columns = tuple(extra_columns)
    head = f"{'name':<22} {'workload':<14} {'layout':<14} {'ms':>9} {'GB/s':>8}"
    head += "".join(f" {c:>12}" for c in extra_columns)
    if peer is not None:
        head += f" {'x ' + peer:>16}"
    if roof_gbps or roof:
        head += f" {'x roof':>7}"
    print(head)
    print("-" * len(head))
    for _key, grp in groups.items():
        ref = next((r for r in grp if r.name == peer), None)
        roof_row = next((r for r in grp if r.name == roof), None) if roof else None
        for r in grp:
            line = f"{r.name:<22} {r.workload:<14} {r.layout:<14} {r.ms:9.2f} {r.gbps:8.2f}"
            line += "".join(f" {r.extra[c]:12.3g}" if c in r.extra else f" {'-':>12}" for c in extra_columns)
            if peer is not None:
                line += f" {ref.ms / r.ms:16.3f}" if ref is not None and r.ms > 0 else f" {'-':>16}"
            if roof:
                line += f" {roof_row.ms / r.ms:7.3f}" if roof_row is not None and r.ms > 0 else f" {'-':>7}"
            elif roof_gbps:
                line += f" {r.gbps / roof_gbps:7.3f}"
            print(line)


def write_json(path: Optional[str], header: dict, rows: Iterable[Row]) -> None:
    """Write ``{**header, "rows": [...]}`` to ``path`` (no-op when ``path`` is None).

    The file is written to ``path + ".tmp"`` and renamed, so a crash never leaves half a file.
    """
    if path is None:
        return
    payload = dict(header)
    payload["rows"] = [r.to_json() for r in rows]
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)
