"""I/O backends and how one is chosen.

Three backends run the same requests with the same alignment rules (see
``csrc/aio/aio_handle.h``):

* ``libaio`` — the C++ engine submitting O_DIRECT blocks with ``io_submit``; ``queue_depth``
  requests in flight per ``intra_op_parallelism`` lane. Needs libaio at build time and a kernel
  that accepts ``io_setup`` (some containers refuse it).
* ``threads`` — the C++ engine with ``intra_op_parallelism × queue_depth`` threads, each doing
  blocking ``pread``/``pwrite`` of one block; for machines without libaio.
* ``python`` — the same thread pool in pure Python (``os.preadv``/``os.pwrite``), used when C++
  ops are unavailable (``ZEROINF_DISABLE_OPS=1``, no compiler). It is also the tests' reference.
  Buffers whose address is not 4096-aligned go through the buffered file descriptor instead of
  a bounce buffer.

Choice, highest first: the ``ZEROINF_AIO_BACKEND`` env var, the ``backend=`` argument, then the
first backend of :data:`BACKENDS` that is available *and* passes a real write/read round trip on a
temporary file. A backend named by env var or argument that cannot run raises
:class:`~zeroinf.io.errors.BackendUnavailableError` with its reasons — never a silent fallback.

Test hook: ``ZEROINF_AIO_FAULT`` injects faults into every backend: ``enospc:N`` (writes touching
file bytes >= N fail with ENOSPC after writing the bytes before N), ``eio:N`` (same with EIO, reads
too), ``short`` (every transfer moves at most half of what it asked for, so the retry path runs),
``nodirect`` (opening with O_DIRECT fails with EINVAL, as on filesystems that refuse it).
"""
from __future__ import annotations

import errno
import itertools
import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import torch

from .errors import BackendUnavailableError

__all__ = ["BACKENDS", "ALIGN", "PythonEngine", "backend_reasons", "backend_report", "choose_backend",
           "make_engine", "fault_spec"]

#: Probe order: the first available backend that passes a round trip wins.
BACKENDS = ("libaio", "threads", "python")
#: O_DIRECT alignment in bytes for buffer addresses, lengths and file offsets.
ALIGN = 4096

_ENV_BACKEND = "ZEROINF_AIO_BACKEND"
_ENV_FAULT = "ZEROINF_AIO_FAULT"


def fault_spec() -> str:
    """The ``ZEROINF_AIO_FAULT`` test hook's value ("" when unset)."""
    return os.environ.get(_ENV_FAULT, "").strip()


def _parse_fault(text: str) -> Tuple[str, int]:
    if not text or text == "nodirect":
        return "", 0
    kind, _, arg = text.partition(":")
    if kind not in ("enospc", "eio", "short"):
        raise ValueError(f"{_ENV_FAULT}={text!r}: kind must be enospc, eio, short or nodirect")
    try:
        offset = int(arg) if arg else 0
    except ValueError:
        raise ValueError(f"{_ENV_FAULT}={text!r}: offset must be an integer") from None
    if offset < 0:
        raise ValueError(f"{_ENV_FAULT}={text!r}: offset must be >= 0")
    return kind, offset


def _fault_clip(kind: str, at: int, is_write: bool, offset: int, nbytes: int, direct: bool) -> int:
    """Mirror of ``fault_clip`` in aio_handle.cpp: bytes to move now, or -errno."""
    if kind == "short":
        half = nbytes // 2
        if direct:
            half &= ~(ALIGN - 1)
        return half if half > 0 else nbytes
    if kind in ("enospc", "eio"):
        if kind == "enospc" and not is_write:
            return nbytes
        e = errno.ENOSPC if kind == "enospc" else errno.EIO
        if offset >= at:
            return -e
        if offset + nbytes <= at:
            return nbytes
        n = at - offset
        if direct:
            n &= ~(ALIGN - 1)
        return n if n > 0 else -e
    return nbytes


class _PyRequest:
    __slots__ = ("id", "is_read", "nbytes", "jobs_left", "done", "err", "err_offset", "what", "lock", "chunk",
                 "pieces")

    def __init__(self, rid: int, is_read: bool, nbytes: int, chunk: int = 0):
        self.id, self.is_read, self.nbytes = rid, is_read, nbytes
        self.jobs_left = 0
        self.done = 0
        self.err, self.err_offset, self.what = 0, -1, ""
        self.lock = threading.Lock()
        self.chunk = chunk  # checksum chunk in bytes (0: no checksums)
        self.pieces: Dict[int, Tuple[int, int]] = {}  # buffer offset -> (crc, length), as aio_handle.cpp

    def fail(self, err: int, offset: int, what: str) -> None:
        with self.lock:
            if self.err == 0 or offset < self.err_offset:
                self.err, self.err_offset, self.what = err, offset, what

    def checksum(self, view: memoryview, pos: int) -> None:
        """CRC-32C of the pieces of the job at buffer offset ``pos`` (cut at chunk boundaries)."""
        if not self.chunk:
            return
        from .checksum import crc32c

        t = torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)
        a = pos
        while a < pos + len(view):
            b = min(pos + len(view), (a // self.chunk + 1) * self.chunk)
            self.pieces[a] = (crc32c(t[a - pos:b - pos]), b - a)  # one writer per key; dict ops hold the GIL
            a = b

    def record(self) -> tuple:
        crcs: List[int] = []
        if self.chunk and not self.err:
            from .checksum import crc32c_combine

            crcs = [0] * (-(-self.nbytes // self.chunk))
            for a in sorted(self.pieces):
                crc, n = self.pieces[a]
                k = a // self.chunk
                crcs[k] = crc if a % self.chunk == 0 else crc32c_combine(crcs[k], crc, n)
        return (self.id, self.is_read, self.nbytes, self.done, self.err, self.err_offset, self.what, crcs)


class PythonEngine:
    """Pure-Python engine with the C++ ``Engine`` interface: a thread pool of pread/pwrite.

    Args:
        block_size: bytes per job, a positive multiple of 4096.
        queue_depth, intra_op_parallelism: the pool has ``queue_depth × intra_op_parallelism``
            threads (blocking transfers in flight).
        fault: the ``ZEROINF_AIO_FAULT`` spec (test hook).
    """

    def __init__(self, block_size: int, queue_depth: int, intra_op_parallelism: int, fault: str = ""):
        if block_size <= 0 or block_size % ALIGN:
            raise ValueError(f"block_size must be a positive multiple of {ALIGN} bytes, got {block_size}")
        if queue_depth < 1 or intra_op_parallelism < 1:
            raise ValueError("queue_depth and intra_op_parallelism must be >= 1")
        self._fault = _parse_fault(fault)
        self._block = block_size
        self._pool = ThreadPoolExecutor(max_workers=queue_depth * intra_op_parallelism,
                                        thread_name_prefix="zeroinf-aio")
        self._ids = itertools.count(1)
        self._cv = threading.Condition()
        self._running: Dict[int, _PyRequest] = {}
        self._done: Dict[int, tuple] = {}

    def submit(self, is_read: bool, buffer: torch.Tensor, nbytes: int, fd_direct: int, fd_buffered: int,
               file_offset: int, checksum_chunk: int = 0) -> int:
        """Queue a transfer of ``buffer``'s first ``nbytes`` bytes (a flat uint8 CPU tensor);
        ``checksum_chunk`` > 0 asks for one CRC-32C per that many bytes (the record's last field)."""
        mv = memoryview(buffer.numpy()).cast("B")
        if nbytes > len(mv):
            raise ValueError(f"aio request of {nbytes} bytes but the buffer holds {len(mv)}")
        if checksum_chunk < 0:
            raise ValueError(f"checksum_chunk must be >= 0 bytes, got {checksum_chunk}")
        req = _PyRequest(next(self._ids), is_read, nbytes, checksum_chunk)
        jobs = []

        def add(start: int, length: int, fd: int, direct: bool) -> None:
            for pos in range(start, start + length, self._block):
                n = min(self._block, start + length - pos)
                jobs.append((mv[pos:pos + n], file_offset + pos, pos, fd, direct))

        aligned_buf = buffer.data_ptr() % ALIGN == 0
        if fd_direct >= 0 and file_offset % ALIGN == 0 and aligned_buf:
            aligned = nbytes & ~(ALIGN - 1)
            add(0, aligned, fd_direct, True)
            add(aligned, nbytes - aligned, fd_buffered, False)
        else:
            add(0, nbytes, fd_buffered, False)
        req.jobs_left = len(jobs)
        with self._cv:
            if not jobs:
                self._done[req.id] = req.record()
                return req.id
            self._running[req.id] = req
        for job in jobs:
            self._pool.submit(self._run, req, *job)
        return req.id

    def _run(self, req: _PyRequest, view: memoryview, offset: int, pos: int, fd: int, direct: bool) -> None:
        done, zero_writes, n = 0, 0, len(view)
        kind, at = self._fault
        try:
            if not req.is_read:
                req.checksum(view, pos)
            while done < n:
                off = offset + done
                want = _fault_clip(kind, at, not req.is_read, off, n - done, direct)
                if want < 0:
                    req.fail(-want, off, "pread failed" if req.is_read else "pwrite failed")
                    break
                try:
                    if req.is_read:
                        r = os.preadv(fd, [view[done:done + want]], off)
                    else:
                        r = os.pwrite(fd, view[done:done + want], off)
                except InterruptedError:
                    continue
                except OSError as exc:
                    req.fail(exc.errno or errno.EIO, off, "pread failed" if req.is_read else "pwrite failed")
                    break
                if r == 0:
                    if req.is_read:
                        req.fail(errno.ENODATA, off, "pread returned 0 bytes: the file ends before the requested range")
                        break
                    zero_writes += 1
                    if zero_writes >= 3:
                        req.fail(errno.EIO, off, "pwrite wrote 0 bytes three times")
                        break
                    continue
                done += r
                if direct and done < n and r % ALIGN:
                    req.fail(errno.ENODATA if req.is_read else errno.EIO, off + r,
                             "short O_DIRECT read: the file ends before the requested range" if req.is_read
                             else "short unaligned O_DIRECT write")
                    break
            if req.is_read and done == n:
                req.checksum(view, pos)
        except BaseException as exc:  # never lose a job: an unexpected error fails the request
            req.fail(errno.EIO, offset + done, f"unexpected {type(exc).__name__}: {exc}")
        with req.lock:
            req.done += done
            req.jobs_left -= 1
            last = req.jobs_left == 0
        if last:
            with self._cv:
                self._running.pop(req.id, None)
                self._done[req.id] = req.record()
                self._cv.notify_all()

    def wait_one(self, rid: int) -> tuple:
        """Block until request ``rid`` finished; its record (see the C++ ``Engine.wait_one``)."""
        with self._cv:
            if rid not in self._running and rid not in self._done:
                return (rid, False, 0, 0, errno.EINVAL, -1, "unknown or already collected request id", [])
            self._cv.wait_for(lambda: rid in self._done)
            return self._done.pop(rid)

    def wait_all(self) -> List[tuple]:
        """Block until nothing is in flight; every finished record not yet collected."""
        with self._cv:
            self._cv.wait_for(lambda: not self._running)
            out = [self._done[k] for k in sorted(self._done)]
            self._done.clear()
            return out

    def in_flight(self) -> int:
        with self._cv:
            return len(self._running)

    def shutdown(self) -> None:
        """Finish queued jobs and join the pool's threads; idempotent. Later submits raise."""
        self._pool.shutdown(wait=True)


def _load_aio_op():
    from ..ops.loader import load_op

    return load_op("aio")


def backend_reasons(name: str) -> List[str]:
    """Why backend ``name`` cannot run here (an empty list when it can, before any round trip)."""
    if name == "python":
        return []
    if name not in BACKENDS:
        return [f"unknown backend {name!r}; known: {', '.join(BACKENDS)}"]
    from ..ops.loader import OpBuildError, OpUnavailableError

    try:
        op = _load_aio_op()
    except (OpUnavailableError, OpBuildError) as exc:
        return [f"C++ aio op unavailable: {str(exc).splitlines()[0]}"]
    if name == "libaio":
        ok, why = op.libaio_status()
        return [] if ok else [why]
    return []


def make_engine(name: str, block_size: int, queue_depth: int, intra_op_parallelism: int,
                single_submit: bool, overlap_events: bool, fault: str = ""):
    """Construct backend ``name``'s engine (C++ ``Engine`` or :class:`PythonEngine`).

    Raises:
        ValueError: bad knob values or fault spec.
        BackendUnavailableError: the backend cannot start here.
    """
    fault = "" if fault == "nodirect" else fault
    if name == "python":
        return PythonEngine(block_size, queue_depth, intra_op_parallelism, fault)
    reasons = backend_reasons(name)
    if reasons:
        raise BackendUnavailableError(f"aio backend {name!r} unavailable: " + "; ".join(reasons))
    op = _load_aio_op()
    try:
        return op.Engine(name, block_size, queue_depth, intra_op_parallelism, single_submit, overlap_events, fault)
    except RuntimeError as exc:  # io_setup refused, libaio missing (std::invalid_argument -> ValueError)
        raise BackendUnavailableError(f"aio backend {name!r} unavailable: {exc}") from exc


_probe_lock = threading.Lock()
_probe_cache: Dict[str, Optional[str]] = {}


def _round_trip(name: str, directory: Optional[str] = None) -> Optional[str]:
    """Write then read 2 blocks + 100 bytes with backend ``name``; None if exact, else why not."""
    with _probe_lock:
        if name in _probe_cache:
            return _probe_cache[name]
        why = None
        try:
            engine = make_engine(name, 1 << 16, 2, 1, False, True)
            n = 2 * ALIGN + 100
            # A private generator: the probe must not consume draws from the user's global RNG.
            src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
            dst = torch.zeros(n, dtype=torch.uint8)
            with tempfile.TemporaryDirectory(prefix="zeroinf-probe-", dir=directory) as d:
                path = os.path.join(d, "probe")
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fd_direct = os.open(path, os.O_RDWR | os.O_DIRECT)
                except OSError:
                    fd_direct = -1  # filesystem refuses O_DIRECT: probe the buffered path
                try:
                    engine.submit(False, src, n, fd_direct, fd, 0)
                    recs = engine.wait_all()
                    engine.submit(True, dst, n, fd_direct, fd, 0)
                    recs += engine.wait_all()
                finally:
                    engine.shutdown()  # waits for anything still queued, then joins the workers
                    os.close(fd)
                    if fd_direct >= 0:
                        os.close(fd_direct)
            bad = [r for r in recs if r[4]]
            if bad:
                why = f"round trip failed: {os.strerror(bad[0][4])} ({bad[0][6]})"
            elif not torch.equal(src, dst):
                why = "round trip read back different bytes"
        except (OSError, RuntimeError, ValueError) as exc:
            why = f"round trip failed: {exc}"
        _probe_cache[name] = why
        return why


def choose_backend(requested: Optional[str] = None) -> str:
    """Pick the backend: ``ZEROINF_AIO_BACKEND`` > ``requested`` > first that passes a round trip.

    Raises:
        ValueError: an unknown backend name.
        BackendUnavailableError: the named backend cannot run (the message lists why).
    """
    env = os.environ.get(_ENV_BACKEND, "").strip()
    forced, source = (env, f"{_ENV_BACKEND}={env}") if env else (requested, f"backend={requested!r}")
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"{source}: unknown aio backend; choose one of {', '.join(BACKENDS)}")
        reasons = backend_reasons(forced)
        if reasons:
            raise BackendUnavailableError(f"{source}: aio backend unavailable: " + "; ".join(reasons))
        return forced
    for name in BACKENDS:
        if not backend_reasons(name) and _round_trip(name) is None:
            return name
    raise BackendUnavailableError("no aio backend passed a round trip: " + "; ".join(
        f"{n}: {backend_reasons(n) or _round_trip(n)}" for n in BACKENDS))


def backend_report(build: bool = True) -> List[dict]:
    """One dict per backend for ``zeroinf report``: ``name``, ``available`` (bool or None), ``why`` (str).

    ``available`` means the backend started and passed a write/read round trip in the temp dir.
    With ``build`` False a C++ backend whose op would first need a JIT build is not probed (it
    was: ``zeroinf report`` compiled the aio op for 1.5 min while saying it had not):
    ``available`` None, ``why`` says so.
    """
    from ..ops.loader import op_status

    out = []
    for name in BACKENDS:
        if name != "python" and not build and op_status("aio")["state"] == "would JIT":
            out.append({"name": name, "available": None,
                        "why": "not probed: the C++ aio op is not built yet (zeroinf report --build builds it)"})
            continue
        reasons = backend_reasons(name)
        if not reasons:
            rt = _round_trip(name)
            if rt:
                reasons = [rt]
        out.append({"name": name, "available": not reasons,
                    "why": "; ".join(reasons) if reasons else "round trip ok"})
    return out
