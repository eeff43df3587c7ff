"""``AsyncIOHandle``: DeepSpeed ``aio_handle``-compatible reads and writes of tensor bytes.

Alignment and file-size rules (all sizes in bytes, alignment 4096):

* The file always holds exactly the tensor's bytes: a write of ``n`` bytes at ``file_offset``
  touches ``[file_offset, file_offset + n)`` and nothing else — no padding. The 4096-aligned
  prefix goes through O_DIRECT; the tail (``n % 4096`` bytes) through a buffered descriptor.
* A write never shrinks a file (other requests may be filling later offsets of the same file
  concurrently). A new file written at offset 0 therefore holds exactly ``n`` bytes; overwriting
  a longer file with fewer bytes leaves its tail, and a later whole-file read of ``n`` bytes
  raises :class:`~zeroinf.io.errors.SizeMismatchError` rather than returning mixed data.
* A read (``sync_pread``, ``async_pread``, ``pread``) takes the buffer's size in bytes from
  ``file_offset``, as DeepSpeed's do, and must lie inside the file
  (:class:`~zeroinf.io.errors.ReadPastEndError` otherwise). A whole-file read (``read``, or
  ``whole_file=True``) needs a buffer of exactly the file's size
  (:class:`~zeroinf.io.errors.SizeMismatchError` otherwise), so a file left longer by an earlier
  write is not read as if it were the tensor.
* Buffers need not be aligned: unaligned ones are staged through aligned bounce buffers (C++
  backends) or use buffered I/O (``python`` backend); aligned ones (e.g. from
  :class:`~zeroinf.io.PinnedBufferPool`) are fastest. A non-4096-aligned ``file_offset`` makes
  the whole request buffered.
* When the filesystem refuses O_DIRECT (``open`` fails with EINVAL), I/O on it is buffered and
  one ``RuntimeWarning`` per filesystem per process says so.

Lifetime: :meth:`AsyncIOHandle.close` waits for pending requests, then stops the worker threads;
it is idempotent. Every live handle is also closed by an ``atexit`` hook (handles are tracked by
weak reference), so the workers are joined while the interpreter, torch and pybind11 are still
whole, never during interpreter teardown. A handle inherited by a forked child cannot be used
there (its threads exist only in the parent): it raises ``RuntimeError``; create a new one.
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import os
import signal
import stat
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional

import torch

from .backends import ALIGN, choose_backend, fault_spec, make_engine
from .checksum import ChunkChecksums
from .errors import AIOError, SizeMismatchError, ReadPastEndError, make_error
from .locked import (HUGE_PAGE, free_locked_cpu_tensor, huge_page_bytes, is_locked_cpu_tensor, locked_cpu_tensor,
                     locked_cpu_tensor_bytes)
from .request_args import byte_view, writable_fd_path

__all__ = ["AsyncIOHandle", "HUGE_PAGE", "free_locked_cpu_tensor", "huge_page_bytes", "locked_cpu_tensor",
           "locked_cpu_tensor_bytes"]

#: st_dev of filesystems already warned about refusing O_DIRECT (one warning per process each).
_NO_DIRECT_WARNED: set = set()

#: Every handle not yet closed; the atexit hook closes them before interpreter teardown.
_LIVE_HANDLES: "weakref.WeakSet[AsyncIOHandle]" = weakref.WeakSet()


def _close_live_handles() -> None:
    """atexit hook: close every live handle (waiting for its pending requests).

    Errors cannot propagate out of interpreter exit, so each is written to stderr naming the
    handle; none is dropped silently.
    """
    for handle in list(_LIVE_HANDLES):
        try:
            handle.close()
        except BaseException as exc:  # noqa: BLE001 - reported below, exit must go on
            print(f"zeroinf: closing {handle!r} at exit: a pending request failed: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr)


atexit.register(_close_live_handles)

_AIO_KEYS = ("block_size", "queue_depth", "intra_op_parallelism", "thread_count", "single_submit",
             "overlap_events", "use_gds", "backend", "verify_checksums")


@dataclass
class _Pending:
    path: str
    is_read: bool
    offset: int
    nbytes: int
    fd_buffered: int
    fd_direct: int
    tensor: torch.Tensor  # keeps the caller's memory alive until the request is collected
    checksums: Optional[ChunkChecksums] = None  # filled by _finish when the request succeeds


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """[Note: Ctrl-C between the engine and the bookkeeping] A request's outcome lives in one
    place at a time: the engine's queue, then the handle's ``_pending`` and counters. A
    KeyboardInterrupt raised between the two (right after ``wait_all()`` returned) would lose the
    outcomes: the requests would stay pending for good, the swapper above would call their files
    stale, and every later optimizer step and the rescue ``save_checkpoint`` would fail. In the main thread, while SIGINT has Python's default
    handler, a Ctrl-C inside the block is held and raised as KeyboardInterrupt when it ends
    (the block is short: the engine's waits do not run Python signal handlers anyway). A
    handler of the user's own runs as usual."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    held = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


class AsyncIOHandle:
    """Reads and writes contiguous CPU tensors' bytes to files, synchronously or asynchronously.

    Knobs and their meanings follow DeepSpeed's ``aio`` config block, so existing blocks carry
    over (see :meth:`from_config`); the positional order is DeepSpeed's ``aio_handle``'s
    (``block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism``).
    The defaults are those of DeepSpeed's ``aio`` config block; ``aio_handle``'s own
    (queue_depth 128, overlap_events False) are those of
    ``zeroinf.ops.op_builder.AsyncIOBuilder().load().aio_handle``.

    Args:
        block_size: bytes per submitted transfer, an integer >= 1 (default 1 MiB); the engine
            rounds it up to a multiple of 4096 (O_DIRECT's alignment), so 1024 moves 4096-byte
            transfers. :meth:`get_block_size` returns the value given.
        queue_depth: transfers in flight per parallel lane (default 8).
        intra_op_parallelism: parallel lanes splitting each request (libaio: threads each with
            their own io context; threads/python: multiplies the pool size). Old name: ``thread_count``.
        single_submit: submit one transfer per ``io_submit`` call instead of batches (libaio).
        overlap_events: refill the queue as soon as any transfer completes; when False a lane
            waits for all its in-flight transfers before submitting more (libaio).
        backend: ``"libaio"``, ``"threads"`` or ``"python"``; ``ZEROINF_AIO_BACKEND`` overrides
            it; None probes (see :mod:`zeroinf.io.backends`).
        thread_count: DeepSpeed's old name of ``intra_op_parallelism``.

    Raises:
        ValueError: a knob out of range (the message names it).
        BackendUnavailableError: the chosen backend cannot run here (the message says why).

    The caller keeps each buffer unchanged (writes) or unread (reads) until the request is waited
    for; the handle holds a reference so the memory stays alive.
    """

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 8, single_submit: bool = False,
                 overlap_events: bool = True, intra_op_parallelism: int = 1, backend: Optional[str] = None,
                 *, thread_count: Optional[int] = None, verify_checksums: bool = True):
        if thread_count is not None:
            if intra_op_parallelism not in (1, thread_count):
                raise ValueError(f"thread_count: {thread_count} disagrees with intra_op_parallelism="
                                 f"{intra_op_parallelism}; give only intra_op_parallelism")
            intra_op_parallelism = thread_count
        for key, value, ok in (
                ("block_size", block_size, isinstance(block_size, int) and block_size >= 1),
                ("queue_depth", queue_depth, isinstance(queue_depth, int) and queue_depth >= 1),
                ("intra_op_parallelism", intra_op_parallelism,
                 isinstance(intra_op_parallelism, int) and intra_op_parallelism >= 1)):
            if not ok or isinstance(value, bool):
                raise ValueError(f"{key}: expected an integer >= 1, got {value!r}")
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.intra_op_parallelism = intra_op_parallelism
        self.single_submit = bool(single_submit)
        self.overlap_events = bool(overlap_events)
        #: whether a :class:`~zeroinf.io.TensorSwapper` on this handle records and verifies
        #: CRC-32Cs by default (the ``aio.verify_checksums`` config key); the handle itself
        #: checksums exactly the requests passed a ``checksums=`` sink
        self.verify_checksums = bool(verify_checksums)
        self._fault = fault_spec()
        self.backend = choose_backend(backend)
        self._engine = make_engine(self.backend, -(-block_size // ALIGN) * ALIGN, queue_depth, intra_op_parallelism,
                                   self.single_submit, self.overlap_events, self._fault)
        self._lock = threading.RLock()     # guards _pending; re-entered by close() from a signal handler
        self._wait_lock = threading.RLock()  # one collector at a time (sync ops and wait())
        self._pending: Dict[int, _Pending] = {}
        # requests finished early to free file descriptors (_drain), reported by the next wait()
        self._drained = 0
        self._drained_errors: List[AIOError] = []
        self._pid = os.getpid()
        self._closed = False
        _LIVE_HANDLES.add(self)

    @classmethod
    def from_config(cls, aio: dict) -> "AsyncIOHandle":
        """Build a handle from a DeepSpeed ``aio`` config block.

        Accepted keys: ``block_size``, ``queue_depth``, ``intra_op_parallelism`` (or the old
        ``thread_count``), ``single_submit``, ``overlap_events``, ``use_gds`` (must be false), and
        zeroinf's ``backend`` and ``verify_checksums`` (default true: swappers on the handle
        record and verify CRC-32Cs).

        Raises:
            ValueError: an unknown key or a bad value; the message starts with ``aio.<key>:``.
        """
        if not isinstance(aio, dict):
            raise ValueError(f"aio: expected a dict, got {type(aio).__name__}")
        for key in aio:
            if key not in _AIO_KEYS:
                raise ValueError(f"aio.{key}: unknown key; known keys: {', '.join(_AIO_KEYS)}")
        if aio.get("use_gds"):
            raise ValueError("aio.use_gds: GPUDirect Storage is not supported by zeroinf; set it to false")
        for key in ("single_submit", "overlap_events", "verify_checksums"):
            if key in aio and not isinstance(aio[key], bool):
                raise ValueError(f"aio.{key}: expected true or false, got {aio[key]!r}")
        kwargs = {k: aio[k] for k in ("block_size", "queue_depth", "intra_op_parallelism", "single_submit",
                                      "overlap_events", "backend", "thread_count", "verify_checksums") if k in aio}
        try:
            return cls(**kwargs)
        except ValueError as exc:
            if str(exc).split(":", 1)[0] in _AIO_KEYS:  # a knob's own error: give its key path
                raise ValueError(f"aio.{exc}") from exc
            raise

    # DeepSpeed aio_handle getters, so DeepNVMe code can switch.
    def get_block_size(self) -> int:
        return self.block_size

    def get_queue_depth(self) -> int:
        return self.queue_depth

    def get_single_submit(self) -> bool:
        return self.single_submit

    def get_overlap_events(self) -> bool:
        return self.overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self.intra_op_parallelism

    def get_thread_count(self) -> int:
        return self.intra_op_parallelism

    # DeepSpeed aio_handle buffer helpers.
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """:func:`locked_cpu_tensor` of ``num_elem`` elements of ``example_tensor``'s dtype:
        page-locked, 2 MiB huge-page backed where the kernel allows, the fastest buffer for this
        handle. Raises ``ValueError`` / :class:`~zeroinf.io.PinnedMemoryError` as that does."""
        if not isinstance(example_tensor, torch.Tensor):
            raise TypeError(f"example_tensor must be a torch.Tensor, got {type(example_tensor).__name__}")
        return locked_cpu_tensor(num_elem, example_tensor.dtype)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """Unlock a tensor from :meth:`new_cpu_locked_tensor`; see :func:`free_locked_cpu_tensor`."""
        return free_locked_cpu_tensor(tensor)

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        """DeepSpeed's ``is_pinned``: whether ``buffer`` is page-locked (torch-pinned, or from
        :meth:`new_cpu_locked_tensor`). Any contiguous CPU tensor can be read or written; locked
        ones are the fastest."""
        return is_locked_cpu_tensor(buffer) or (isinstance(buffer, torch.Tensor) and bool(buffer.is_pinned()))

    # -- submission ---------------------------------------------------------------------------
    def _open(self, path: str, is_read: bool, offset: int, nbytes: int, whole_file: bool = False):
        flags = os.O_RDONLY if is_read else (os.O_WRONLY | os.O_CREAT)
        what = "reading" if is_read else "writing"
        try:
            fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise make_error(exc.errno or errno.EIO, f"cannot open {path} for {what}", path, offset, nbytes,
                             0) from exc
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):  # opens for reading; O_DIRECT then fails with EINVAL ("refuses O_DIRECT")
                raise make_error(errno.EISDIR, f"{path} is a directory", path, offset, nbytes, 0)
            if is_read:
                if whole_file and nbytes != st.st_size:
                    raise SizeMismatchError(
                        errno.EINVAL, f"whole-file read of {path}: the buffer holds {nbytes} bytes but the file "
                        f"holds {st.st_size} ({'larger' if nbytes > st.st_size else 'smaller'} than the file)",
                        path, offset, nbytes, 0)
                if offset + nbytes > st.st_size:
                    raise ReadPastEndError(
                        errno.ENODATA, f"read of {nbytes} bytes at offset {offset} of {path} goes past its end "
                        f"({st.st_size} bytes)", path, offset, nbytes, 0)
            fd_direct = -1
            if nbytes >= ALIGN and offset % ALIGN == 0:
                fd_direct = self._open_direct(path, flags, st.st_dev, offset, nbytes)
        except BaseException:
            os.close(fd)
            raise
        return fd, fd_direct

    def _open_direct(self, path: str, flags: int, dev: int, offset: int, nbytes: int) -> int:
        try:
            if self._fault == "nodirect":
                raise OSError(errno.EINVAL, "O_DIRECT refused (ZEROINF_AIO_FAULT=nodirect)")
            return os.open(path, (flags & ~os.O_CREAT) | os.O_DIRECT | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise make_error(exc.errno or errno.EIO, f"cannot open {path} with O_DIRECT", path, offset, nbytes,
                                 0) from exc
            if dev not in _NO_DIRECT_WARNED:
                _NO_DIRECT_WARNED.add(dev)
                warnings.warn(f"the filesystem holding {path} refuses O_DIRECT; zeroinf uses buffered I/O "
                              "there (slower, and it fills the page cache)", RuntimeWarning, stacklevel=5)
            return -1

    def _check_usable(self) -> None:
        if self._closed:
            raise ValueError(f"{self!r} is closed")
        if os.getpid() != self._pid:
            raise RuntimeError(f"{self!r} was created in process {self._pid} and cannot be used in the forked "
                               f"process {os.getpid()} (its worker threads exist only in the parent); "
                               "create a new AsyncIOHandle")

    def _submit(self, is_read: bool, buffer, filename, file_offset: int, whole_file: bool = False,
                checksums: Optional[ChunkChecksums] = None) -> int:
        self._check_usable()
        path = os.fspath(filename)
        if not isinstance(file_offset, int) or isinstance(file_offset, bool) or not 0 <= file_offset < 2**63:
            # off_t is 64-bit signed: 2**63 and above would reach the C++ binding as a raw TypeError
            raise ValueError(f"file_offset must be an integer in [0, 2**63), got {file_offset!r}")
        if whole_file and file_offset != 0:
            raise ValueError(f"a whole-file read starts at offset 0, got file_offset={file_offset}")
        if checksums is not None:
            if not isinstance(checksums, ChunkChecksums) or checksums.chunk_bytes < 1:
                raise ValueError(f"checksums: expected a ChunkChecksums with chunk_bytes >= 1, got {checksums!r}")
            checksums.crcs = None
        flat = byte_view(buffer)
        nbytes = flat.numel()
        try:
            fd, fd_direct = self._open(path, is_read, file_offset, nbytes, whole_file)
        except AIOError as exc:
            # each queued request holds its file open (2 descriptors) until it is collected: a
            # long queue runs out of them ("Too many open files" at the 125th 4 KiB write under
            # a limit of 256). Finish the queue, then open again.
            if exc.errno not in (errno.EMFILE, errno.ENFILE) or not self.pending():
                raise
            self._drain()
            fd, fd_direct = self._open(path, is_read, file_offset, nbytes, whole_file)
        # a request the engine runs is always in _pending, and is there before any thread's wait
        # can collect its completion (_finish takes the lock): registered after the submit, a
        # small request could complete on another thread's wait as "a completion for an unknown
        # request" and stay pending for good (the engines' submits do not block)
        with _interrupts_deferred(), self._lock:
            try:
                rid = self._engine.submit(is_read, flat, nbytes, fd_direct, fd, file_offset,
                                          checksums.chunk_bytes if checksums is not None else 0)
            except BaseException:
                os.close(fd)
                if fd_direct >= 0:
                    os.close(fd_direct)
                raise
            self._pending[rid] = _Pending(path, is_read, file_offset, nbytes, fd, fd_direct, buffer, checksums)
        return rid

    def _finish(self, rec: tuple) -> Optional[AIOError]:
        rid, is_read, requested, done, err, err_offset, what, crcs = rec
        with self._lock:
            p = self._pending.pop(rid, None)
        if p is None:
            return AIOError(errno.EINVAL, f"internal: completion for unknown request {rid} ({what})", "?", 0,
                            requested, done)
        exc = None
        op = "read" if is_read else "write"
        if err:
            exc = make_error(err, f"{op} of {p.path}: {what}", p.path, err_offset if err_offset >= 0 else p.offset,
                             requested, done)
        elif done != requested:
            exc = make_error(errno.EIO, f"{op} of {p.path}: short transfer", p.path, p.offset, requested, done)
        for fd in (p.fd_direct, p.fd_buffered):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError as e:
                    exc = exc or make_error(e.errno or errno.EIO, f"closing {p.path} after the {op} failed",
                                            p.path, p.offset, requested, done)
        if exc is None and p.checksums is not None:
            p.checksums.crcs = list(crcs)
        return exc

    # -- DeepSpeed aio_handle operations ------------------------------------------------------
    # Return values are DeepSpeed's: a synchronous pread/pwrite returns 1 (the requests it
    # completed), an asynchronous one 0 (wait() then returns the count), read/write 0. Where
    # DeepSpeed returns -1 for a failure these raise an AIOError subclass instead.
    def sync_pread(self, buffer: torch.Tensor, filename, file_offset: int = 0, *, whole_file: bool = False,
                   checksums: Optional[ChunkChecksums] = None) -> int:
        """Read ``buffer.numel() * buffer.element_size()`` bytes at ``file_offset`` into ``buffer``.

        Args:
            buffer: a contiguous CPU tensor of any dtype and shape (a view with a storage offset
                is fine: exactly its bytes are written, nothing past them).
            filename: the file (str or path-like).
            file_offset: byte offset in the file; the read must lie inside the file.
            whole_file: the buffer must be exactly the file's size (``file_offset`` 0).
            checksums: a :class:`~zeroinf.io.checksum.ChunkChecksums` that receives the CRC-32Cs
                of the bytes read, one per ``chunk_bytes``, computed by the I/O threads.

        Returns:
            1, the requests completed (DeepSpeed's value); the bytes read are always the buffer's.

        Raises:
            AIOError (OSError) subclasses: AIOFileNotFoundError, SizeMismatchError,
            ReadPastEndError, DeviceIOError, ... carrying path, offset, bytes requested/done, errno.
        """
        return self._sync(True, buffer, filename, file_offset, whole_file, checksums)

    def sync_pwrite(self, buffer: torch.Tensor, filename, file_offset: int = 0, *,
                    checksums: Optional[ChunkChecksums] = None) -> int:
        """Write ``buffer``'s bytes at ``file_offset`` (creating the file, mode 0600, if needed);
        ``checksums`` receives the written bytes' CRC-32Cs as in :meth:`sync_pread`.

        Returns:
            1, the requests completed; all of the buffer's bytes are written.

        Raises:
            AIOError (OSError) subclasses: AIOFileNotFoundError (missing directory),
            DiskFullError (ENOSPC), DeviceIOError (EIO), ...; a short write is retried to
            completion or raised, never reported done.
        """
        return self._sync(False, buffer, filename, file_offset, checksums=checksums)

    def _sync(self, is_read: bool, buffer, filename, file_offset: int, whole_file: bool = False,
              checksums: Optional[ChunkChecksums] = None) -> int:
        with self._wait_lock, _interrupts_deferred():
            rid = self._submit(is_read, buffer, filename, file_offset, whole_file, checksums)
            exc = self._finish(self._engine.wait_one(rid))
        if exc is not None:
            raise exc
        return 1

    def async_pread(self, buffer: torch.Tensor, filename, file_offset: int = 0, *, whole_file: bool = False,
                    checksums: Optional[ChunkChecksums] = None) -> int:
        """Queue a read like :meth:`sync_pread`; returns 0 once submitted. Errors in opening or
        size checks raise here; transfer errors raise from :meth:`wait`. Each queued request
        holds its file open until collected; a submission that finds no free file descriptor
        first finishes the queue (its count and errors still come from :meth:`wait`).
        ``checksums`` is filled by the :meth:`wait` that collects the request."""
        self._submit(True, buffer, filename, file_offset, whole_file, checksums)
        return 0

    def async_pwrite(self, buffer: torch.Tensor, filename=None, file_offset: int = 0, *, fd: Optional[int] = None,
                     checksums: Optional[ChunkChecksums] = None) -> int:
        """Queue a write like :meth:`sync_pwrite`; returns 0 once submitted. Do not modify
        ``buffer`` before :meth:`wait` returns. File descriptors and ``checksums`` as in
        :meth:`async_pread`.

        The file is ``filename``, or an open descriptor: ``fd=`` (or an ``int`` in
        ``filename``'s place, DeepSpeed's positional form). The handle writes through
        descriptors of its own opened on the same file (``/proc/self/fd/<fd>``), so the data
        goes by O_DIRECT where aligned whatever flags ``fd`` was opened with; ``fd`` is
        neither moved nor closed.

        Raises:
            ValueError: both or neither of ``filename`` and ``fd``; ``fd`` not open for writing
                or not a regular file (the message names it).
        """
        if isinstance(filename, int) and not isinstance(filename, bool):
            filename, fd = (None, filename) if fd is None else (filename, fd)
        if (filename is None) == (fd is None):
            raise ValueError("async_pwrite: give exactly one of filename and fd")
        self._submit(False, buffer, filename if fd is None else writable_fd_path(fd), file_offset,
                     checksums=checksums)
        return 0

    def read(self, buffer: torch.Tensor, filename, validate: bool = False, file_offset: int = 0) -> int:
        """DeepSpeed's ``read``: a synchronous whole-file read (the buffer must be exactly the
        file's size, as DeepSpeed asserts). ``validate`` is accepted and ignored: sizes are
        always checked, and every transfer is checked complete. Returns 0 (DeepSpeed's success).

        Raises:
            ValueError: ``file_offset`` is not 0 (a whole-file read starts at the file's start).
            SizeMismatchError: the buffer's bytes differ from the file's size (nothing is read);
                the other errors as :meth:`sync_pread`.
        """
        self._sync(True, buffer, filename, file_offset, whole_file=True)
        return 0

    def write(self, buffer: torch.Tensor, filename, validate: bool = False, file_offset: int = 0) -> int:
        """DeepSpeed's ``write``: a synchronous write of ``buffer`` at ``file_offset``
        (``validate`` ignored, as in :meth:`read`). Returns 0 (DeepSpeed's success)."""
        self._sync(False, buffer, filename, file_offset)
        return 0

    def pread(self, buffer: torch.Tensor, filename, validate: bool = False, async_op: bool = False,
              file_offset: int = 0) -> int:
        """DeepSpeed's ``pread`` (its ``async`` is ``async_op`` here, ``async`` being a Python
        keyword): :meth:`sync_pread` (returns 1), or :meth:`async_pread` with ``async_op``
        (returns 0; :meth:`wait` collects it). ``validate`` ignored, as in :meth:`read`."""
        if async_op:
            return self.async_pread(buffer, filename, file_offset)
        return self._sync(True, buffer, filename, file_offset)

    def pwrite(self, buffer: torch.Tensor, filename, validate: bool = False, async_op: bool = False,
               file_offset: int = 0) -> int:
        """DeepSpeed's ``pwrite``: :meth:`sync_pwrite` (returns 1), or :meth:`async_pwrite` with
        ``async_op`` (returns 0). ``validate`` ignored, as in :meth:`read`."""
        if async_op:
            return self.async_pwrite(buffer, filename, file_offset)
        return self._sync(False, buffer, filename, file_offset)

    def wait(self) -> int:
        """Wait for every queued request.

        Returns:
            The number of requests completed since the last wait (0 when nothing was pending),
            including those a submission finished early to free file descriptors.

        Raises:
            AIOError subclass: the first failed request (in submission order); the other
            failures, if any, are in its ``other_errors`` list. All requests are finished and
            their files closed before it raises.
        """
        with self._wait_lock:
            self._drain()
            errors, self._drained_errors = self._drained_errors, []
            count, self._drained = self._drained, 0
        if errors:
            errors[0].other_errors = errors[1:]
            raise errors[0]
        return count

    def _drain(self) -> None:
        """Finish every queued request now, closing its files; their count and errors (in
        submission order) are kept for :meth:`wait` to report."""
        with self._wait_lock, _interrupts_deferred():
            recs = self._engine.wait_all()
            for rec in recs:
                exc = self._finish(rec)
                if exc is not None:
                    self._drained_errors.append(exc)
            self._drained += len(recs)

    def __reduce__(self):
        """Refused: a handle owns threads, file descriptors and in-flight requests of this
        process, so pickling one is refused here with a reason, not on its engine with none.

        Raises:
            TypeError: always.
        """
        raise TypeError("an AsyncIOHandle cannot be pickled or copied to another process: it owns this process's "
                        "I/O threads and open requests; make one in each process (AsyncIOHandle(...) there)")

    def pending(self) -> int:
        """Requests submitted and not yet collected by :meth:`wait`."""
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        """Wait for pending requests (raising their errors), then stop and join the worker threads.

        Idempotent: a second call does nothing. Later submissions raise ``ValueError``. In a
        forked child it only marks the handle closed (the threads belong to the parent).

        Raises:
            AIOError subclass: a pending request failed (see :meth:`wait`); the threads are
            stopped all the same.
        """
        with self._wait_lock:
            if self._closed:
                return
            self._closed = True
        _LIVE_HANDLES.discard(self)
        if os.getpid() != self._pid:
            return
        try:
            self.wait()
        finally:
            self._engine.shutdown()

    def __del__(self) -> None:
        """A handle dropped without :meth:`close`: finish its pending requests and close their
        file descriptors (2 per request, which would leak otherwise). A destructor cannot raise, so a failed request becomes a ``RuntimeWarning`` naming it;
        requests that only were not waited for, a ``ResourceWarning`` (as an unclosed file)."""
        if getattr(self, "_closed", True) or os.getpid() != getattr(self, "_pid", None):
            return
        n = len(self._pending)
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - reported as a warning: nothing can catch it here
            warnings.warn(f"AsyncIOHandle dropped with {n} request(s) never waited for; one failed: {exc}",
                          RuntimeWarning, stacklevel=2)
        else:
            if n:
                warnings.warn(f"AsyncIOHandle dropped with {n} request(s) never waited for (completed now); "
                              "call wait() or close()", ResourceWarning, stacklevel=2)

    def __enter__(self) -> "AsyncIOHandle":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"AsyncIOHandle(backend={self.backend!r}, block_size={self.block_size}, "
                f"queue_depth={self.queue_depth}, intra_op_parallelism={self.intra_op_parallelism}, "
                f"single_submit={self.single_submit}, overlap_events={self.overlap_events})")
