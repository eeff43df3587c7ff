"""I/O exceptions: ``OSError`` subclasses that say which file, where, and how much.

Every failed transfer of :class:`zeroinf.io.AsyncIOHandle` and :class:`zeroinf.io.TensorSwapper`
raises an :class:`AIOError` (an ``OSError``), so ``except OSError`` catches them all. Attributes
beyond ``errno``/``strerror``/``filename``:

* ``offset``: file offset (bytes) of the transfer that failed, or of the request when the
  failure is found before any transfer (size checks);
* ``nbytes_requested``: bytes the request asked for;
* ``nbytes_done``: bytes that were transferred before the failure (a failed request is never
  reported done, whatever this says).
"""
from __future__ import annotations

import errno as _errno
import os
from typing import Optional

__all__ = [
    "AIOError",
    "AIOFileNotFoundError",
    "ReadPastEndError",
    "SizeMismatchError",
    "DiskFullError",
    "DeviceIOError",
    "StaleSwapFileError",
    "ChecksumMismatchError",
    "BackendUnavailableError",
    "make_error",
]


class AIOError(OSError):
    """A failed or refused file transfer.

    Args:
        errno: the ``errno`` value (``errno.ENOSPC``, ...).
        message: what went wrong, in words.
        path: the file.
        offset: file offset in bytes where the failure happened.
        nbytes_requested: bytes asked for by the request.
        nbytes_done: bytes transferred before the failure.
    """

    def __init__(self, errno: int, message: str, path: str, offset: int = 0,
                 nbytes_requested: int = 0, nbytes_done: int = 0):
        reason = os.strerror(errno) if errno else "error"
        super().__init__(errno, f"{message} ({reason}; offset {offset}, "
                                f"{nbytes_done} of {nbytes_requested} bytes done)", str(path))
        self.offset = int(offset)
        self.nbytes_requested = int(nbytes_requested)
        self.nbytes_done = int(nbytes_done)
        self.message = message

    def __reduce__(self):
        return (type(self), (self.errno, self.message, self.filename, self.offset,
                             self.nbytes_requested, self.nbytes_done))


class AIOFileNotFoundError(AIOError, FileNotFoundError):
    """The file or its directory does not exist (``ENOENT``)."""


class ReadPastEndError(AIOError):
    """A read asked for bytes past the end of the file (``ENODATA``)."""


class SizeMismatchError(AIOError):
    """A whole-file read (``AsyncIOHandle.read``, or ``whole_file=True``) with a buffer larger or
    smaller than the file."""


class DiskFullError(AIOError):
    """The filesystem is full (``ENOSPC``); the bytes after ``offset`` were not written."""


class DeviceIOError(AIOError):
    """The device reported an I/O error (``EIO``)."""


class StaleSwapFileError(AIOError):
    """A swap file does not hold what the swapper wrote: other size, truncated, or never written."""


class ChecksumMismatchError(StaleSwapFileError):
    """A swapped-in tensor's CRC32 differs from the one recorded when it was swapped out."""


class BackendUnavailableError(RuntimeError):
    """An I/O backend was asked for (by env var or argument) but cannot run here; says why."""


_BY_ERRNO = {
    _errno.ENOENT: AIOFileNotFoundError,
    _errno.ENODATA: ReadPastEndError,
    _errno.ENOSPC: DiskFullError,
    _errno.EIO: DeviceIOError,
}


def make_error(err: int, message: str, path: str, offset: int, requested: int, done: int,
               cls: Optional[type] = None) -> AIOError:
    """Build the :class:`AIOError` subclass that fits ``err`` (or ``cls`` when given)."""
    cls = cls or _BY_ERRNO.get(err, AIOError)
    return cls(err, message, path, offset, requested, done)
