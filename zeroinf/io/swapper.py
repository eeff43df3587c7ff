"""``TensorSwapper``: named tensors swapped out to and in from files under one directory.

Layout: ``<swap_dir>/zeroinf-swap/`` (mode 0700) holds, per key, ``<name>.swp`` (mode 0600,
exactly the tensor's bytes) and ``<name>.json`` (its manifest entry: key, numel, dtype, shape,
nbytes, whether it holds swapped-out data, its CRC-32Cs). ``<name>`` comes from the key alone
(a readable slug plus a hash of the key), so a later process that registers the same keys uses
the same files — never ``id()`` or registration order. Swappers alive at the same time (two
engines on one ``nvme_path``) get folders of their own: ``zeroinf-swap.1``, ... ([Note: one
swapper per folder]).

[Note: stale files] A file is read as weights only when its manifest entry says it was written
for this key with the same numel/dtype/shape *and* the file has exactly that many bytes. Files
left by another config are reset and reported by one ``RuntimeWarning`` per batch of
registrations, counting them and naming the folder (see :meth:`register`; a caller that
registers each key only at its first write removes them all first, :meth:`discard_stale`);
reading a key that was never written, or whose file was truncated or removed since, raises
:class:`~zeroinf.io.errors.StaleSwapFileError`.

[Note: verified swaps] With ``checksum`` on (the default, from the handle's
``verify_checksums``), every swap out records in the key's entry one CRC-32C per
:data:`~zeroinf.io.checksum.CHUNK_BYTES` of the file, computed by the I/O threads as they
write; every swap in gets the CRC-32Cs of the bytes read the same way, and :meth:`wait`
compares them before it returns, so callers (which wait before they use the data) never use
changed bytes: :class:`~zeroinf.io.errors.ChecksumMismatchError` names the file, the byte
offset of the first differing chunk and both CRCs. An entry adopted from an earlier run must
carry CRC-32Cs then, or it is stale.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import warnings
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from .checksum import CHUNK_BYTES, ChunkChecksums, first_mismatch
from .errors import AIOError, ChecksumMismatchError, StaleSwapFileError, make_error
from .handle import AsyncIOHandle

__all__ = ["TensorSwapper"]

_SUBDIR = "zeroinf-swap"


@dataclass
class _Entry:
    """Manifest entry of one key (also written as ``<name>.json``)."""

    key: str
    numel: int
    dtype: str
    shape: List[int]
    nbytes: int
    written: bool = False
    #: CRC-32C of each CHUNK_BYTES chunk of the file, recorded by the write that set ``written``
    #: (None: written by a swapper with checksums off)
    crc32c: Optional[List[int]] = None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def tensor_crc32(t: torch.Tensor, value: int = 0) -> int:
    """CRC-32 (zlib, unsigned 32-bit int) of a tensor's bytes in row-major order, any dtype and
    shape; ``value`` continues a running CRC (as ``zlib.crc32``'s second argument), so several
    tensors can be checksummed as one stream. A non-contiguous tensor is copied first, one on an
    accelerator is copied to the host first."""
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return zlib.crc32(memoryview(flat.view(torch.uint8).numpy()), value)


def _swap_folders(base: Path) -> Iterator[Path]:
    """The candidate swap folders under ``base``, in the order swappers take them:
    ``zeroinf-swap``, ``zeroinf-swap.1``, ... (1000 in all)."""
    for i in range(1000):
        yield base / (_SUBDIR if i == 0 else f"{_SUBDIR}.{i}")


def _claim(base: Path) -> Tuple[Path, int]:
    """[Note: one swapper per folder] The swap folder under ``base`` for a new swapper, and the
    descriptor that holds its lock: ``zeroinf-swap``, or ``zeroinf-swap.1``, ``.2``, ... when a
    live swapper (this process or another) holds the first. File names come from the keys alone,
    so two engines with one config and one ``nvme_path`` (an actor and a reference model, or two
    jobs) would write each other's swap files and change each other's weights silently. The lock is a ``flock`` on
    ``.lock`` in the folder, released by :meth:`TensorSwapper.close` or when the process ends,
    so a later run adopts the folder (and the data of the same keys, see [Note: stale files]).
    A file system without ``flock`` (ENOLCK, EOPNOTSUPP) gets the first folder, unlocked."""
    import fcntl

    for d in _swap_folders(base):
        d.mkdir(mode=0o700, exist_ok=True)
        os.chmod(d, 0o700)
        fd = os.open(d / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return d, fd
        except BlockingIOError:
            os.close(fd)
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                os.close(fd)
                raise
            return d, fd
    raise make_error(errno.EBUSY, f"swap directory {base}: 1000 swap folders are in use", str(base), 0, 0, 0)


def reusable_bytes(swap_dir) -> int:
    """Bytes already in the swap folder that a :class:`TensorSwapper` on ``swap_dir`` would
    claim now (the first folder no live swapper holds, see [Note: one swapper per folder]): a
    run overwrites its own files, so a disk check may count them as free. Folders that live
    swappers hold, and the other ``zeroinf-swap.N`` siblings, are not counted (they belonged to
    another engine, whose files stay). Nothing is claimed or created."""
    import fcntl

    for d in _swap_folders(Path(swap_dir)):
        if not d.is_dir():
            return 0  # _claim would create it: nothing to reuse
        try:
            fd = os.open(d / ".lock", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            fd = None  # no lock file yet: free
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live swapper holds it
            except OSError:
                pass  # no flock on this file system: _claim takes the first folder
            finally:
                os.close(fd)
        total = 0
        for f in d.iterdir():
            try:
                if f.is_file():
                    total += f.stat().st_size
            except OSError:
                pass
        return total
    return 0


class TensorSwapper:
    """Swap named CPU tensors to files and back through an :class:`AsyncIOHandle`.

    Args:
        swap_dir: an existing directory (e.g. on NVMe); files go in its ``zeroinf-swap/`` subdir.
        handle: the I/O handle to use (default: ``AsyncIOHandle()`` with default knobs).
        checksum: record CRC-32Cs at swap out and verify them at swap in ([Note: verified
            swaps]); None (default) takes the handle's ``verify_checksums`` (true unless the
            ``aio.verify_checksums`` config key says false).

    Raises:
        AIOFileNotFoundError: ``swap_dir`` does not exist.
        NotADirectoryError: ``swap_dir`` is not a directory.

    Keys are caller-chosen stable strings such as ``"rank0/subgroup3/exp_avg"``.
    """

    def __init__(self, swap_dir, handle: Optional[AsyncIOHandle] = None, *, checksum: Optional[bool] = None):
        base = Path(swap_dir).absolute()  # the process may change directory later
        if not base.exists():
            raise make_error(errno.ENOENT, f"swap directory {base} does not exist", str(base), 0, 0, 0)
        if not base.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "swap_dir is not a directory", str(base))
        self.directory, self._lock_fd = _claim(base)
        self._own_handle = handle is None
        self.handle = handle if handle is not None else AsyncIOHandle()
        self.checksum = bool(getattr(self.handle, "verify_checksums", True) if checksum is None else checksum)
        self._entries: Dict[str, _Entry] = {}
        # (op, key, tensor, the CRC-32Cs the handle fills: None with checksums off)
        self._pending: List[Tuple[str, str, torch.Tensor, Optional[ChunkChecksums]]] = []
        self._stale: List[Tuple[Path, str]] = []  # stale files reset by register(), not reported yet

    # -- names and manifest -------------------------------------------------------------------
    @staticmethod
    def file_stem(key: str) -> str:
        """File name stem for ``key``: a readable slug plus 12 hex digits of its SHA-256."""
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", key).strip("._")[:80] or "key"
        return f"{slug}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"

    def path_for(self, key: str) -> Path:
        """The swap file of ``key`` (whether or not it is registered)."""
        return self.directory / (self.file_stem(key) + ".swp")

    def _meta_path(self, key: str) -> Path:
        return self.directory / (self.file_stem(key) + ".json")

    def _save_entry(self, e: _Entry) -> None:
        # [Note: manifest writes] Rewritten in place (pwrite + ftruncate to the new length), not
        # by write-to-temp + rename: on ext4 a rename over an existing file forces the new file's
        # data to disk (auto_da_alloc), which cost ~24 ms per swap while O_DIRECT writes were in
        # flight. A write torn by a crash leaves an entry that fails to parse or says
        # written=false, and either way the file is treated as stale, never read as data.
        data = json.dumps(asdict(e)).encode()
        path = self._meta_path(e.key)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.pwrite(fd, data, 0)
                os.ftruncate(fd, len(data))
            finally:
                os.close(fd)
        except OSError as exc:  # e.g. the swap folder was removed (ENOENT), a full disk (ENOSPC)
            raise make_error(exc.errno or errno.EIO, f"cannot write the manifest entry of swap key {e.key!r}",
                             str(path), 0, len(data), 0) from exc

    def _load_entry(self, key: str) -> Optional[_Entry]:
        try:
            data = json.loads(self._meta_path(key).read_text())
            return _Entry(**data)
        except (OSError, ValueError, TypeError):
            return None

    def manifest(self) -> Dict[str, dict]:
        """Registered keys -> {numel, dtype, shape, nbytes, written, crc32c, path}."""
        return {k: {**asdict(e), "path": str(self.path_for(k))} for k, e in self._entries.items()}

    def files(self) -> List[Path]:
        """The swap files and manifest files of the registered keys (whether written yet or not);
        other files in the folder (an earlier run's, with other keys) are not this swapper's."""
        return [p for k in self._entries for p in (self.path_for(k), self._meta_path(k))]

    # -- set-up -------------------------------------------------------------------------------
    def register(self, key: str, numel: int, dtype: torch.dtype, shape=None) -> Path:
        """Declare ``key`` and preallocate its file (``fallocate``) so later writes overwrite.

        A file already holding this key's data from an earlier run (same numel, dtype and shape,
        exact size, marked written) is adopted and can be swapped in. Any other existing file is
        stale and is reset. Callers register many keys at once (one per sub-group), so stale
        files are reported together: one ``RuntimeWarning`` that counts them and names the
        folder, issued by the next :meth:`swap_out`, :meth:`swap_in`, :meth:`wait`,
        :meth:`close` or :meth:`report_stale`.

        Args:
            key: non-empty stable name.
            numel: elements (>= 0).
            dtype: torch dtype.
            shape: optional shape with ``prod(shape) == numel`` (default ``(numel,)``).

        Returns:
            The file's path.

        Raises:
            ValueError: bad arguments, or ``key`` already registered with another numel/dtype/shape.
            AIOError: the file cannot be created or preallocated (e.g. DiskFullError).
        """
        if not isinstance(key, str) or not key:
            raise ValueError(f"swap key must be a non-empty string, got {key!r}")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{key}: dtype must be a torch.dtype, got {dtype!r}")
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
            raise ValueError(f"{key}: numel must be an integer >= 0, got {numel!r}")
        shape = [numel] if shape is None else [int(s) for s in shape]
        prod = 1
        for s in shape:
            prod *= s
        if prod != numel:
            raise ValueError(f"{key}: shape {tuple(shape)} holds {prod} elements, not numel={numel}")
        want = _Entry(key, numel, _dtype_name(dtype), shape, numel * torch.empty((), dtype=dtype).element_size())
        old = self._entries.get(key)
        if old is not None:
            if (old.numel, old.dtype, old.shape) != (want.numel, want.dtype, want.shape):
                raise ValueError(f"{key}: already registered as {old.numel} x {old.dtype} {tuple(old.shape)}")
            return self.path_for(key)
        path = self.path_for(key)
        on_disk, stale = self._on_disk(want)
        if on_disk is not None:
            self._entries[key] = on_disk
            return path
        if stale is not None:
            self._stale.append((path, stale))
        self._preallocate(path, want.nbytes)
        self._save_entry(want)
        self._entries[key] = want
        return path

    def _on_disk(self, want: _Entry) -> Tuple[Optional[_Entry], Optional[str]]:
        """What the folder holds for ``want``'s key: (its manifest entry, None) when the file
        holds that key's data and can be adopted; (None, why) when a file is there that is stale
        ([Note: stale files]); (None, None) when there is no file, or one of the same size never
        written (nothing stale in it)."""
        key, nbytes = want.key, want.nbytes
        path = self.path_for(key)
        on_disk = self._load_entry(key)
        size = path.stat().st_size if path.exists() else None
        same = (on_disk is not None and size == nbytes and
                (on_disk.key, on_disk.numel, on_disk.dtype, on_disk.shape) == (key, want.numel, want.dtype, want.shape))
        verifiable = (on_disk is not None and isinstance(on_disk.crc32c, list)
                      and len(on_disk.crc32c) == -(-nbytes // CHUNK_BYTES))
        if same and on_disk.written and (verifiable or not self.checksum):
            return on_disk, None
        if size is None or (same and not on_disk.written):
            return None, None
        why = ("no manifest entry" if on_disk is None else
               f"manifest says {on_disk.numel} x {on_disk.dtype} {tuple(on_disk.shape)}, written={on_disk.written}"
               + ("" if not same else ", no CRC-32Cs to verify it"))
        return None, f"key {key!r}: {size} bytes, {why}; expected {nbytes} bytes of {want.dtype}"

    def discard_stale(self, keys: Iterable[Tuple[str, int, torch.dtype]], *, only_these: bool = False) -> int:
        """Remove the stale files ([Note: stale files]) of keys not registered yet, given as
        ``(key, numel, dtype)``, and report them in one ``RuntimeWarning`` as :meth:`register`
        does; returns how many it removed. A caller that registers each key only before its first
        write (so its file takes disk space only from then on) calls this first for all of them:
        the stale files are reported together and their space is free at once. Files that
        :meth:`register` would adopt, and those of the same size never written, stay.

        ``only_these``: ``keys`` (with those registered already) are every key this swapper will
        ever hold, so the files of any other key in its folder are an earlier run's that nothing
        reads or overwrites: they go too. A disk check counts all of the folder's files as free
        (:func:`reusable_bytes`), which holds only once they are gone.

        Raises:
            AIOError: a stale file cannot be removed.
        """
        keys = list(keys)
        n = 0
        if only_these:
            mine = {self.file_stem(k) for k, _, _ in keys} | {self.file_stem(k) for k in self._entries}
            for f in sorted(self.directory.glob("*.swp")):
                if f.stem not in mine:
                    size = f.stat().st_size
                    self._unlink_stem(f.stem)
                    self._stale.append((f, f"{size} bytes of a key this run does not use"))
                    n += 1
        for key, numel, dtype in keys:
            if key in self._entries:
                continue
            want = _Entry(key, numel, _dtype_name(dtype), [numel], numel * torch.empty((), dtype=dtype).element_size())
            _entry, stale = self._on_disk(want)
            if stale is None:
                continue
            self._unlink(key)
            self._stale.append((self.path_for(key), stale))
            n += 1
        self.report_stale()
        return n

    def remove(self, key: str) -> None:
        """Delete ``key``'s swap file and manifest entry and forget the key (its disk space is
        free at once; registering it again makes a new file).

        Raises:
            KeyError: ``key`` is not registered.
            RuntimeError: a swap of ``key`` is still queued (call :meth:`wait` first).
            AIOError: the file cannot be removed (other than already gone).
        """
        if key not in self._entries:
            raise KeyError(f"swap key {key!r} is not registered")
        if any(k == key for _, k, _, _ in self._pending):
            raise RuntimeError(f"swap key {key!r} has a swap queued; wait() before removing it")
        del self._entries[key]
        self._unlink(key)

    def _unlink(self, key: str) -> None:
        """Delete ``key``'s swap file and manifest entry, if there (AIOError when one stays)."""
        self._unlink_stem(self.file_stem(key))

    def _unlink_stem(self, stem: str) -> None:
        """Delete the swap file and manifest entry named ``stem``, if there (AIOError when one stays)."""
        for path in (self.directory / (stem + ".swp"), self.directory / (stem + ".json")):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise make_error(exc.errno or errno.EIO, f"cannot remove swap file {path}",
                                 str(path), 0, 0, 0) from exc

    @staticmethod
    def _preallocate(path: Path, nbytes: int) -> None:
        fd = None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, 0)
            if nbytes:
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    os.ftruncate(fd, nbytes)  # no fallocate here: a sparse file of the right size
        except OSError as exc:
            if fd is not None:  # a file being reset: it goes, with whatever fallocate allocated
                with contextlib.suppress(OSError):
                    path.unlink()
            raise make_error(exc.errno or errno.EIO, f"cannot preallocate swap file {path} ({nbytes} bytes)",
                             str(path), 0, nbytes, 0) from exc
        finally:
            if fd is not None:
                os.close(fd)

    def report_stale(self) -> int:
        """Issue the one ``RuntimeWarning`` for stale files reset since the last report (see
        :meth:`register`); returns how many it counted (0: no warning)."""
        stale, self._stale = self._stale, []
        if stale:
            path, first = stale[0]
            warnings.warn(f"{len(stale)} stale swap file(s) in {self.directory} (left by a run with other sizes, "
                          f"e.g. another sub_group_size, or without checksums) were reset and will not be read as data; first: "
                          f"{path.name} ({first})", RuntimeWarning, stacklevel=3)
        return len(stale)

    # -- swapping -----------------------------------------------------------------------------
    def _check(self, key: str, tensor) -> _Entry:
        e = self._entries.get(key)
        if e is None:
            raise KeyError(f"swap key {key!r} is not registered")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{key}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.numel() != e.numel or _dtype_name(tensor.dtype) != e.dtype:
            raise ValueError(f"{key}: registered as {e.numel} x {e.dtype}, got a tensor of "
                             f"{tensor.numel()} x {_dtype_name(tensor.dtype)}")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"{key}: tensor must be a contiguous CPU tensor")
        return e

    def swap_out(self, items: Iterable[Tuple[str, torch.Tensor]], async_op: bool = True) -> None:
        """Write each ``(key, tensor)`` to its file. With ``async_op`` the writes are only
        queued: keep the tensors unchanged until :meth:`wait`. An empty ``items`` is a no-op.

        Raises:
            KeyError: unregistered key. ValueError/TypeError: tensor of the wrong numel/dtype.
            AIOError: opening failed (here) or a write failed (here if sync, else at :meth:`wait`).
        """
        self.report_stale()
        items = list(items)
        for key, tensor in items:
            self._check(key, tensor)
        for key, tensor in items:
            e = self._entries[key]
            if e.written:  # the file is about to change: never leave it marked valid meanwhile
                e.written = False
                self._save_entry(e)
            sums = ChunkChecksums(CHUNK_BYTES) if self.checksum else None
            self.handle.async_pwrite(tensor, self.path_for(key), checksums=sums)
            self._pending.append(("out", key, tensor, sums))
        if not async_op and items:
            self.wait()

    def swap_in(self, items: Iterable[Tuple[str, torch.Tensor]], async_op: bool = True) -> None:
        """Read each key's file into its ``tensor``. With ``async_op`` the data is there only
        after :meth:`wait`. An empty ``items`` is a no-op.

        Raises:
            KeyError: unregistered key. ValueError/TypeError: tensor of the wrong numel/dtype.
            StaleSwapFileError: the key was never swapped out, or its file changed size or was
                removed since.
            AIOError: a read failed (here if sync, else at :meth:`wait`).
            ChecksumMismatchError: with ``checksum``, the bytes read differ from those written
                (here if sync, else at :meth:`wait`).
        """
        self.report_stale()
        items = list(items)
        for key, tensor in items:
            e = self._check(key, tensor)
            path = self.path_for(key)
            if not e.written:
                raise StaleSwapFileError(errno.ENODATA, f"swap file of key {key!r} holds no swapped-out data "
                                         "(never written, stale, its last write failed, or a swap-out of it is still pending)", str(path), 0, e.nbytes, 0)
            try:
                size = path.stat().st_size
            except OSError as exc:
                raise StaleSwapFileError(exc.errno or errno.EIO, f"swap file of key {key!r} is missing "
                                         f"(removed since it was written; expected {e.nbytes} bytes)",
                                         str(path), 0, e.nbytes, 0) from None
            if size != e.nbytes:
                raise StaleSwapFileError(errno.EIO, f"swap file of key {key!r} has {size} bytes, expected "
                                         f"{e.nbytes} (truncated or replaced)", str(path), min(size, e.nbytes),
                                         e.nbytes, 0)
        for key, tensor in items:
            sums = ChunkChecksums(CHUNK_BYTES) if self.checksum else None
            self.handle.async_pread(tensor, self.path_for(key), checksums=sums)
            self._pending.append(("in", key, tensor, sums))
        if not async_op and items:
            self.wait()

    def wait(self) -> int:
        """Wait for queued swaps; returns how many finished (0 when none were pending).

        Raises:
            AIOError: the first failed transfer (every write of this batch is then treated as
                not done: its key cannot be swapped in until written again).
            ChecksumMismatchError: with ``checksum``, a swapped-in tensor's bytes differ from those
                written ([Note: verified swaps]); the other transfers of the batch are still
                recorded (writes marked written) before it raises.
        """
        self.report_stale()
        pending, self._pending = self._pending, []
        if not pending:
            return 0
        try:
            self.handle.wait()
        except AIOError:
            for op, key, _t, _c in pending:
                if op == "out":
                    self._entries[key].written = False
            raise
        except BaseException:
            # a KeyboardInterrupt: the requests are finished or still queued in the handle, which
            # keeps their outcome for its next wait; they stay pending here (dropped, every file
            # of the batch would be stale for good)
            self._pending = pending + self._pending
            raise
        first: Optional[AIOError] = None
        for op, key, _tensor, sums in pending:
            e = self._entries[key]
            if op == "out":
                e.written, e.crc32c = True, (sums.crcs if sums is not None else None)
                try:
                    self._save_entry(e)
                except AIOError as exc:
                    e.written = False
                    first = first or exc
            elif sums is not None:
                first = first or self._verify(key, e, sums.crcs)
        if first is not None:
            raise first
        return len(pending)

    def _verify(self, key: str, e: _Entry, got: Optional[List[int]]) -> Optional[ChecksumMismatchError]:
        """The error for a read of ``key`` whose CRC-32Cs ``got`` differ from the entry's; None
        when they agree. With checksums on, every written entry carries CRC-32Cs
        (:meth:`register` adopts no other), so a missing list is a mismatch too."""
        expected = e.crc32c
        path = str(self.path_for(key))
        if expected is None or got is None:
            return ChecksumMismatchError(errno.EIO, f"swap file of key {key!r}: no CRC-32C "
                                         f"{'recorded at write' if expected is None else 'computed at read'}",
                                         path, 0, e.nbytes, e.nbytes)
        i = first_mismatch(expected, got)
        if i is None:
            return None
        start = i * CHUNK_BYTES
        end = min(e.nbytes, start + CHUNK_BYTES)
        exp = f"{expected[i]:#010x}" if i < len(expected) else "none"
        was = f"{got[i]:#010x}" if i < len(got) else "none"
        return ChecksumMismatchError(errno.EIO, f"swap file of key {key!r} changed since it was written: CRC-32C of "
                                     f"bytes [{start}, {end}) is {was}, {exp} was written", path, start,
                                     e.nbytes, e.nbytes)

    def __del__(self) -> None:
        fd = getattr(self, "_lock_fd", -1)  # dropped unclosed: let the folder go
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        """Wait for queued swaps (raising their errors); files stay for a later run, and the
        folder's lock goes ([Note: one swapper per folder])."""
        self.report_stale()
        try:
            self.wait()
        finally:
            if self._own_handle:
                self.handle.close()
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1
