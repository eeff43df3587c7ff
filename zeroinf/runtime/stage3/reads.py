"""Stage 3 tier reads: partitions from their home tier into a gathered buffer.

[Note: I/O thread] With NVMe partitions, reads run on one background thread (the CPU stand-in
for a side stream), so the NVMe reads of the next units overlap the current unit's compute.
All swap-file traffic (reads, and write-backs after the optimizer step) goes through that one
thread, so the swapper is never used from two threads at once. Collectives are issued from the
caller's thread only, in the same order on every rank (the trace is the same on every rank, and
no launch depends on timing: see [Note: all-gather ahead]); they run asynchronously in the
backend (gloo's threads, NCCL's stream) and are waited for by their work handles.
From issue() until _complete() a unit is FETCHING: ``g.full`` exists but a read, or an
all-gather launched ahead, may still be filling it, so everything that touches ``g.full``
outside _complete (saved-tensor unpacking, write_group_values, release) waits for both first;
gather_group_copy reads a FETCHING unit's partitions afresh.


``self.transfers`` (``zeroinf/runtime/streams.py``), named ``h2d_stream`` and ``d2h_stream``, and
are handed over with events; the compute stream never waits on the host, and no call on the hot
path synchronises the device:

* gather (host tiers): ``issue()`` allocates ``g.full`` on the compute stream and records an event
  there (``after``: the allocator may hand out a block that earlier kernels still read). The read
  (on the I/O thread for NVMe, inline for the CPU tier) fills pinned staging buffers from NVMe,
  then the H2D stream waits for ``after``, copies ``non_blocking`` into ``g.full`` and records
  ``ready``, which the read returns through ``unit.future``. The I/O thread waits for ``ready``
  (``Event.synchronize``: it blocks the I/O thread only) before the staging buffers go back to
  the pool. ``_complete`` (or the all-gather launched ahead, [Note: all-gather ahead]) makes the
  compute stream wait for ``ready`` (``wait_event``), then launches the all-gather, which NCCL
  runs on its own stream after the compute stream's work so far; ``work.wait()`` at use makes
  the compute stream wait for it. ``g.full`` is ``record_stream``-ed on the H2D stream, so
  freeing it early (a prefetch dropped) is safe. The device tier (``offload_param.device:
  none``) copies device to device on the compute stream as before.
* gradients: ``_reduce`` launches each unit's reduce-scatter (``async_op=True``; NCCL's stream
  waits for the compute stream) and hands it to ``_grad_to_host_cuda``: the D2H stream waits
  for the compute stream and for the collective's work, divides the shard by the world size,
  copies it (converting to fp32 on the device) ``non_blocking`` into a pinned host tensor and
  records ``ready``; the shard and ``grad_full`` are ``record_stream``-ed on the D2H stream. With ``grads_on_nvme`` the I/O thread waits for ``ready`` before adding the shard into
  its swap file; otherwise the compute thread adds landed shards into ``grad_shard`` as their
  events complete, and waits for the rest at the end of the backward (the host needs them for
  the optimizer step; the device does not stall).
* CPU-tier partitions are read by the H2D stream straight from their pinned host tensors, which
  the optimizer writes in place: the last such copy is waited for (host) at the end of the
  backward and before a partition is written (``_host_reads_done``).

On the CPU ``self.transfers`` is a no-op (``HostTransfers``) and these paths are not taken.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, Optional, Sequence

import torch

from .units import FlatGroup, Unit
from .common import _run_inline


def _io_delay() -> None:
    """Test hook: ``ZEROINF_STAGE3_IO_DELAY_S`` (seconds, default 0) delays every background
    partition read, making races between the I/O thread and the caller deterministic."""
    d = float(os.environ.get("ZEROINF_STAGE3_IO_DELAY_S", "0") or 0)
    if d > 0:
        time.sleep(d)


class _Staged:
    """An NVMe read into pinned staging buffers (one per partition) ahead of its gather."""

    __slots__ = ("bufs", "views", "future")

    def __init__(self, bufs, views):
        self.bufs, self.views, self.future = bufs, views, None


def _one_compute_thread() -> None:
    """Cap the torch ops run on the I/O thread (staging copies, casts, norm parts) at one CPU
    thread. Uncapped, each ran an OpenMP team as wide as the process's on the cores the forward
    and backward compute on, and a matmul whose team lost a core waited at its barrier for the
    whole copy. Without the C++ ops (``ZEROINF_DISABLE_OPS=1``) there is no per-thread cap."""
    from ...optim import limit_thread_parallelism
    limit_thread_parallelism(1)


class _IOThread(ThreadPoolExecutor):
    """The stage-3 I/O thread ([Note: I/O thread]). At interpreter exit, concurrent.futures stops
    its workers before ``atexit`` hooks run, and a checkpoint saved from one (stage 3 with NVMe)
    would fail on "cannot schedule new futures after shutdown". The worker has finished
    everything queued by then, so a task submitted after that runs inline, in order, and still
    never beside another.

    ``close()`` from a signal handler that interrupted a ``submit`` would block for good on the
    executor's own lock, which ``submit`` holds: so that lock is re-entrant here."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, initializer=_one_compute_thread, **kwargs)
        if hasattr(self, "_shutdown_lock"):  # CPython's ThreadPoolExecutor: a plain Lock
            self._shutdown_lock = threading.RLock()

    def submit(self, fn, /, *args, **kwargs):
        try:
            return super().submit(fn, *args, **kwargs)
        except RuntimeError:
            import concurrent.futures.thread as cft
            if not getattr(cft, "_shutdown", False):
                raise  # an executor we shut down ourselves (close): not an interpreter exit
        return _run_inline(fn, *args, **kwargs)


class ReadsMixin:
    """Reads of partitions from their tiers, on the I/O thread or inline."""

    # ------------------------------------------------------------------------ I/O plumbing
    def _run_io(self, fn, *args):
        """Run a tier transfer on the I/O thread (NVMe) or inline, and wait for it."""
        self._check_open()
        if self._io is None:
            return fn(*args)
        return self._io.submit(fn, *args).result()

    def submit_io(self, fn, *args) -> "Future":
        """Run ``fn(*args)`` on the I/O thread (after the transfers queued before it) and return
        its future; inline (a finished future) without NVMe partitions."""
        if self._io is not None:
            return self._io.submit(fn, *args)
        return _run_inline(fn, *args)

    def _read_partitions(self, unit: Unit, staged: Optional["_Staged"] = None, after: Any = None,
                         snapshot: bool = False) -> Any:
        """Fill ``unit``'s ``g.full`` shards from their home tier (or from ``staged``). Returns the
        ``ready`` event of the H2D copies on CUDA (see [Note: CUDA streams]; ``after`` is the
        event recorded when ``g.full`` was allocated), None otherwise. ``snapshot`` (host
        buffers only): also keep a copy of each shard in ``g.partition_snapshot`` before any
        code can see ``g.full``."""
        _io_delay()
        failed = staged.future.exception() if staged is not None else None
        if failed is not None:
            # the read-ahead failed: its buffers hold partial data; raise its error, never copy them
            # (buffers the unit adopted go back to the pool when the gather or a release that
            # meets this error releases the unit)
            self._free_staged(staged)
            raise failed
        if self.transfers.side_streams and self.unit_tier(unit) != "none":
            return self._h2d_partitions(unit, staged, after)
        t0 = self.tracer.now()
        nbytes = 0
        if staged is not None:  # the NVMe read is done (earlier on this thread): copy and free
            copied = False
            for g, view in zip(unit.groups, staged.views):
                if g.full_in_pool:
                    continue  # g.full is the staging buffer ([Note: staged buffers adopted])
                lo, hi = self._shard_range(g)
                g.full[lo:hi].copy_(view)
                copied = True
            self._free_staged(staged)
            if copied:
                self.tracer.span(f"copy {unit.name}", "transfer", t0, self.tracer.now(), thread="io")
        else:
            for g in unit.groups:
                lo, hi = self._shard_range(g)
                nbytes += g.store.read_into(g.full[lo:hi])
            self._count_read(unit, nbytes, t0)
        if snapshot and unit.groups and unit.groups[0].full.device.type == "cpu":
            for g in unit.groups:
                lo, hi = self._shard_range(g)
                t = self.host.take(g.shard_numel, g.dtype)
                t.copy_(g.full[lo:hi])
                self._drop_snapshot(g)
                g.partition_snapshot = t

    def _drop_snapshot(self, g: FlatGroup) -> None:
        t, g.partition_snapshot = g.partition_snapshot, None
        if t is not None:
            self.host.give(t)

    def _count_read(self, unit: Unit, nbytes: int, t0: float) -> None:
        t1 = self.tracer.now()
        tier = self.unit_tier(unit)
        if tier == "nvme":
            self.stats.add("bytes_nvme_read", nbytes)
            self.stats.add("io_busy_s", t1 - t0)
        elif tier == "cpu":
            self.stats.add("bytes_host_read", nbytes)
        on_io = self._io is not None and tier == "nvme"  # issue() reads other tiers inline
        self.tracer.span(f"read {unit.name}", "transfer", t0, t1, thread="io" if on_io else "compute",
                         args=self._read_args(unit.groups, nbytes, tier))

    @staticmethod
    def _read_args(groups: Sequence[FlatGroup], nbytes: int, tier: str) -> Dict[str, Any]:
        """A read span's arguments for the partitions of ``groups``: on NVMe the ones the
        ``max_in_cpu`` host cache served are ``cache_bytes``, and a read served by it alone is
        tier ``host cache`` (it showed as an NVMe read of 0 bytes)."""
        if tier != "nvme":
            return {"bytes": nbytes, "tier": tier}
        cached = sum(g.store.nbytes for g in groups) - nbytes
        return {"bytes": nbytes, "cache_bytes": cached, "tier": "nvme" if nbytes else "host cache"}

    def _optimizer_read(self, what: str, g: FlatGroup, nbytes: int, t0: float) -> None:
        """Count and trace a read the optimizer step asked for, ``what`` = "param" (a partition,
        from its tier) or "grad" (a gradient file, on NVMe), as the forward's reads are (the
        trace left them out, so its read spans did not add up to the counters with the optimizer
        on NVMe). ``nbytes``: bytes read from the tier (0 when the host cache
        served a partition, which counts itself); ``t0``: when the read began (``tracer.now()``)."""
        tier = g.store.tier if what == "param" else "nvme"
        if nbytes:
            self.stats.add("bytes_nvme_read" if tier == "nvme" else "bytes_host_read", nbytes)
        args = self._read_args([g], nbytes, tier) if what == "param" else {"bytes": nbytes, "tier": tier}
        self.tracer.span(f"read {what} {g.key}", "transfer", t0, self.tracer.now(),
                         thread="io" if self._io is not None else "compute", args=args)

    def _h2d_partitions(self, unit: Unit, staged: Optional["_Staged"], after: Any) -> Any:
        """CUDA, host tiers: :meth:`_read_partitions` with the copies on the H2D stream; returns
        their ``ready`` event. Staging buffers go back to the pool only once it has completed."""
        t0 = self.tracer.now()
        if staged is not None:  # the NVMe read is done (earlier on this thread): copy, then free
            ready = self._h2d_copy(unit, staged.views, after)
            self.transfers.host_wait(ready)
            self._free_staged(staged)
            self.tracer.span(f"copy {unit.name}", "transfer", t0, self.tracer.now(), thread="io")
            return ready
        if self.unit_tier(unit) == "cpu":  # the pinned partitions are the sources
            ready = self._h2d_copy(unit, [g.store.local() for g in unit.groups], after)
            self._h2d_last = ready
            self._count_read(unit, sum(g.store.tensor.numel() * g.store.tensor.element_size() for g in unit.groups), t0)
            return ready
        bufs, views, nbytes = [], [], 0
        try:
            for g in unit.groups:
                buf = self._pool.acquire()
                bufs.append(buf)
                views.append(buf.view(torch.uint8)[: g.store.nbytes].view(g.dtype))
                nbytes += g.store.read_raw(views[-1])
        except BaseException:
            for b in bufs:
                self._pool.release(b)
            raise
        # if the copy fails to enqueue, the buffers stay out of the pool: a copy may still read them
        ready = self._h2d_copy(unit, views, after)
        self.transfers.host_wait(ready)
        for b in bufs:
            self._pool.release(b)
        self._count_read(unit, nbytes, t0)
        return ready

    def _h2d_copy(self, unit: Unit, sources: Sequence[torch.Tensor], after: Any) -> Any:
        """Enqueue ``g.full[shard] <- source`` for each group of ``unit`` on the H2D stream."""
        pairs = []
        for g, src in zip(unit.groups, sources):
            lo, hi = self._shard_range(g)
            pairs.append((g.full[lo:hi], src))
        return self.transfers.h2d(pairs, after)

    def _host_reads_done(self) -> None:
        """Wait (host) until no H2D copy still reads a CPU-tier partition, before it is written."""
        ready, self._h2d_last = self._h2d_last, None
        self.transfers.host_wait(ready)
