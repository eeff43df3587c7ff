"""Per-iteration counters and a Chrome/Perfetto trace of transfers and unit executions."""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Dict, List, Optional

from zeroinf.io.atomic import write_then_rename

__all__ = ["Stage3Stats", "TraceRecorder"]

_COUNTERS = (
    "gathers",              # units gathered (prefetched or on demand)
    "prefetch_hits",        # requests served by a prefetch issued earlier
    "prefetch_misses",      # requests that had to gather on demand
    "read_ahead_hits",      # gathers served from an NVMe read staged ahead
    "already_live",         # requests for a unit that was still gathered (reuse)
    "invalidations",        # trace divergences
    "foreign_gathers",      # units gathered because another module read their weights
    "reduces",              # unit gradient reductions
    "releases",
    "live_over_limit",      # gathers that went over stage3_max_live_parameters for gathered_parameters blocks
    "forward_changes_kept", # parameters a forward changed, written into their partitions ([Note: changes in a forward])
    "host_cache_hits",      # NVMe partition reads served by the max_in_cpu host cache
    "bytes_nvme_read", "bytes_nvme_written",
    "bytes_host_read",      # from host memory: the cpu tier, or the NVMe tier's max_in_cpu cache
    "bytes_host_written",
    "allgathers_ahead",     # units whose all-gather was launched ahead of use ([Note: all-gather ahead])
    "bytes_allgather", "bytes_reduce", "elements_reduce",
)


def _zeros() -> Dict[str, float]:
    out: Dict[str, float] = {k: 0 for k in _COUNTERS}
    out.update(wait_io_s=0.0, io_busy_s=0.0, live_high_water=0)
    return out


def _merge(into: Dict[str, float], more: Dict[str, float]) -> None:
    """Add ``more``'s counters into ``into``; ``live_high_water`` takes the maximum."""
    for k, v in more.items():
        if k == "live_high_water":
            into[k] = max(into.get(k, 0), v)
        else:
            into[k] = into.get(k, 0) + v


class Stage3Stats:
    """Counters of one iteration (forward + backward) and of one optimizer step.

    ``snapshot()`` gives the last finished iteration (``finish()``, called at the end of each
    backward or no-grad forward); ``snapshot(step=True)`` the last finished optimizer step:
    every iteration since the previous ``begin_step()`` plus what moved between them (the
    optimizer's parameter write-backs), so with ``gradient_accumulation_steps > 1`` it covers
    all micro-batches. The engine calls ``begin_step()`` at each accumulation boundary.

    Units: ``bytes_*`` in bytes; ``wait_io_s`` seconds the compute thread blocked on gathers;
    ``io_busy_s`` seconds the I/O thread spent reading/writing; ``live_high_water`` elements
    of non-persistent units gathered at once (the maximum, not a sum, over a step's
    iterations; the persistent unit stays gathered and is not counted, as for
    ``stage3_max_live_parameters``).
    """

    def __init__(self):
        self._lock = threading.RLock()  # re-entered by close() from a signal handler
        self.current: Dict[str, float] = {}
        self.last: Dict[str, float] = {}
        self.totals: Dict[str, float] = {}
        self.live_high_water_all = 0
        self._step: Dict[str, float] = _zeros()  # finished iterations of the optimizer step in progress
        self.iterations_this_step = 0
        self.last_step: Dict[str, float] = {}
        self.reset()

    def reset(self) -> None:
        self.current = _zeros()

    def add(self, key: str, value: float = 1) -> None:
        with self._lock:
            self.current[key] = self.current.get(key, 0) + value
            self.totals[key] = self.totals.get(key, 0) + value

    def clear(self) -> None:
        """Forget everything counted so far (totals and high-water marks included): the engine
        calls it once set-up is done, so the first step counts only its own transfers."""
        with self._lock:
            self.reset()
            self.last, self.totals, self.last_step = {}, {}, {}
            self._step = _zeros()
            self.iterations_this_step = 0
            self.live_high_water_all = 0

    def live(self, live_now: int) -> None:
        if live_now > self.current["live_high_water"]:
            self.current["live_high_water"] = live_now
        self.live_high_water_all = max(self.live_high_water_all, live_now)

    def finish(self) -> None:
        """Close the iteration: its counters become ``last``, are added to the optimizer step
        in progress, and a new iteration starts."""
        with self._lock:
            self.last = dict(self.current)
            _merge(self._step, self.current)
            self.iterations_this_step += 1
            self.reset()

    def begin_step(self) -> None:
        """Close the optimizer step: the iterations finished since the last call, plus counters
        of the unfinished iteration (transfers between backward and step, such as parameter
        write-backs), become ``last_step``; the next step starts from zero."""
        with self._lock:
            _merge(self._step, self.current)
            self.last_step = dict(self._step)
            self.last_step["iterations"] = self.iterations_this_step
            self._step = _zeros()
            self.iterations_this_step = 0
            self.reset()

    def snapshot(self, step: bool = False) -> Dict[str, Any]:
        """The last finished iteration's counters (``step``: the last finished optimizer
        step's, with ``iterations``, the forward/backward passes it covers),
        ``io_hidden_fraction`` (share of I/O time the compute did not wait for), and cumulative
        ``totals``."""
        out: Dict[str, Any] = dict(self.last_step if step else self.last)
        busy = out.get("io_busy_s", 0.0)
        out["io_hidden_fraction"] = (max(0.0, 1.0 - out.get("wait_io_s", 0.0) / busy) if busy > 0 else None)
        out["live_high_water_all"] = self.live_high_water_all
        out["totals"] = dict(self.totals)
        return out


class TraceRecorder:
    """Collects complete events (``ph: "X"``) of the current iteration; keeps the last finished
    iteration for :meth:`write`. Times are microseconds since the recorder was made."""

    def __init__(self):
        self._lock = threading.RLock()  # re-entered by close() from a signal handler
        self._t0 = time.perf_counter()
        self._current: List[Dict[str, Any]] = []
        self.last: List[Dict[str, Any]] = []
        self._threads: Dict[str, int] = {}  # thread name -> numeric tid (the format wants numbers)

    def _tid(self, thread: str) -> int:
        with self._lock:
            return self._threads.setdefault(thread, len(self._threads))

    def now(self) -> float:
        return time.perf_counter()

    def span(self, name: str, cat: str, start: float, end: float, thread: str = "compute",
             args: Optional[Dict[str, Any]] = None) -> None:
        ev = {"name": name, "cat": cat, "ph": "X", "pid": os.getpid(), "tid": self._tid(thread),
              "ts": (start - self._t0) * 1e6, "dur": max(0.0, end - start) * 1e6}
        if args:
            ev["args"] = args
        with self._lock:
            self._current.append(ev)

    def finish(self) -> None:
        with self._lock:
            self.last, self._current = self._current, []

    def write(self, path: "str | os.PathLike") -> int:
        """Write the last finished iteration as Chrome trace JSON (open in chrome://tracing or
        ui.perfetto.dev); returns the number of events, thread-name records included. Written
        to a temporary name and renamed, so a failed write never leaves a truncated file under
        ``path`` (the error propagates)."""
        names = [{"name": "thread_name", "ph": "M", "pid": os.getpid(), "tid": tid, "args": {"name": name}}
                 for name, tid in self._threads.items()]
        events = names + list(self.last)

        def write(tmp: str) -> None:
            with open(tmp, "w") as f:
                json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        write_then_rename(path, write)
        return len(events)
