"""AsyncIOHandle's errors under every backend: missing files and directories, reads past the end and
size mismatches, injected and real ENOSPC, EIO, short transfers, a file system refusing O_DIRECT,
and wait() raising the first failure while keeping the others."""
import errno
import os
import subprocess
import warnings

import pytest
import torch

from zeroinf.io import (AIOFileNotFoundError, AsyncIOHandle, DeviceIOError, DiskFullError, ReadPastEndError,
                        SizeMismatchError)
from zeroinf.io import backends as io_backends
from zeroinf.io import handle as io_handle
from aio_helpers import MiB, _bytes, _rand_bytes
from aio_helpers import backend, handle  # noqa: F401, F811 - pytest fixtures, requested by name


def test_missing_directory(handle, tmp_path):
    missing = tmp_path / "nope" / "f"
    with pytest.raises(AIOFileNotFoundError) as ei:
        handle.sync_pwrite(_rand_bytes(10), missing)
    assert isinstance(ei.value, FileNotFoundError) and ei.value.errno == errno.ENOENT
    assert ei.value.filename == str(missing) and ei.value.nbytes_requested == 10 and ei.value.nbytes_done == 0
    with pytest.raises(FileNotFoundError):
        handle.async_pread(torch.zeros(10, dtype=torch.uint8), missing)
    assert handle.wait() == 0


def test_read_past_end_and_size_mismatch(handle, tmp_path):
    path = tmp_path / "f"
    handle.sync_pwrite(_rand_bytes(10000), path)
    with pytest.raises(ReadPastEndError) as ei:
        handle.sync_pread(torch.zeros(8192, dtype=torch.uint8), path, 4096)
    e = ei.value
    assert (e.filename, e.offset, e.nbytes_requested, e.nbytes_done, e.errno) == (str(path), 4096, 8192, 0,
                                                                                   errno.ENODATA)
    for n in (9999, 10001):  # whole-file read with a smaller / larger buffer
        with pytest.raises(SizeMismatchError, match="smaller" if n < 10000 else "larger"):
            handle.sync_pread(torch.zeros(n, dtype=torch.uint8), path, whole_file=True)
        with pytest.raises(SizeMismatchError):
            handle.read(torch.zeros(n, dtype=torch.uint8), path)
    with pytest.raises(ReadPastEndError):  # DeepSpeed's pread: the buffer's bytes from the offset
        handle.sync_pread(torch.zeros(10001, dtype=torch.uint8), path)
    assert isinstance(e, OSError)


def test_a_directory_is_refused_as_one_without_an_o_direct_warning(backend, tmp_path):
    """A read of a directory path opened (directories open for reading), then failed O_DIRECT
    with EINVAL, so a RuntimeWarning said the file system refuses O_DIRECT (helper-33, t27)."""
    h = AsyncIOHandle(block_size=4096, queue_depth=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(OSError, match="is a directory") as ei:
            h.sync_pread(torch.zeros(4096, dtype=torch.uint8), tmp_path)
    assert (ei.value.errno, ei.value.filename, ei.value.nbytes_requested) == (errno.EISDIR, str(tmp_path), 4096)
    h.close()


def test_smaller_overwrite_never_read_as_whole_file(handle, tmp_path):
    path = tmp_path / "f"
    big = _rand_bytes(3 * 4096 + 5)
    handle.sync_pwrite(big, path)
    small = _rand_bytes(4097)
    handle.sync_pwrite(small, path)  # writes never shrink a file
    assert path.read_bytes() == _bytes(small) + _bytes(big)[4097:]
    with pytest.raises(SizeMismatchError):
        handle.read(torch.zeros_like(small), path)


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_enospc_injected(backend, tmp_path, monkeypatch, sync):
    monkeypatch.setenv("ZEROINF_AIO_FAULT", "enospc:8192")
    h = AsyncIOHandle(block_size=4096, queue_depth=4)
    src = _rand_bytes(5 * 4096 + 100)
    path = tmp_path / "full"
    with pytest.raises(DiskFullError) as ei:
        if sync:
            h.sync_pwrite(src, path)
        else:
            h.async_pwrite(src, path)
            h.wait()
    e = ei.value
    assert e.errno == errno.ENOSPC and e.filename == str(path)
    assert e.offset == 8192 and e.nbytes_requested == src.numel() and e.nbytes_done == 8192
    # the handle is still usable and reports nothing pending
    assert h.wait() == 0
    monkeypatch.delenv("ZEROINF_AIO_FAULT")
    ok = AsyncIOHandle(block_size=4096, queue_depth=4)
    ok.sync_pwrite(src, path)
    assert path.read_bytes() == _bytes(src)


def test_eio_on_read_injected(backend, tmp_path, monkeypatch):
    path = tmp_path / "f"
    src = _rand_bytes(4 * 4096)
    path.write_bytes(_bytes(src))
    monkeypatch.setenv("ZEROINF_AIO_FAULT", "eio:4096")
    h = AsyncIOHandle(block_size=4096, queue_depth=2)
    with pytest.raises(DeviceIOError) as ei:
        h.sync_pread(torch.zeros_like(src), path)
    assert ei.value.errno == errno.EIO and ei.value.offset == 4096


def test_short_transfers_are_retried(backend, tmp_path, monkeypatch):
    """Every transfer moves at most half of what it asked for: the retry loop must finish the job."""
    monkeypatch.setenv("ZEROINF_AIO_FAULT", "short")
    h = AsyncIOHandle(block_size=64 * 1024, queue_depth=4)
    src = torch.empty(300_001, dtype=torch.uint8)
    src.copy_(_rand_bytes(src.numel()))
    path = tmp_path / "short"
    h.sync_pwrite(src, path)
    assert path.read_bytes() == _bytes(src)
    dst = torch.zeros_like(src)
    h.sync_pread(dst, path)
    assert torch.equal(dst, src)


def test_real_enospc_on_small_tmpfs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.decode().strip()}")
    try:
        h = AsyncIOHandle(backend="threads" if not io_backends.backend_reasons("threads") else "python")
        with pytest.raises(DiskFullError) as ei:
            h.sync_pwrite(_rand_bytes(1 * MiB), mnt / "big")
        assert ei.value.nbytes_done < MiB and ei.value.filename == str(mnt / "big")
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_tmpfs_round_trip_and_nodirect_warns_once(backend, monkeypatch):
    shm = "/dev/shm"
    if not os.path.isdir(shm):
        pytest.skip("no /dev/shm")
    path = os.path.join(shm, f"zeroinf-test-{os.getpid()}-{backend}")
    try:
        src = _rand_bytes(3 * 4096 + 11)
        h = AsyncIOHandle()
        h.sync_pwrite(src, path)  # works whether or not this kernel's tmpfs takes O_DIRECT
        dst = torch.zeros_like(src)
        h.sync_pread(dst, path)
        assert torch.equal(src, dst)
        # A filesystem refusing O_DIRECT (EINVAL at open; simulated) falls back with one warning.
        monkeypatch.setenv("ZEROINF_AIO_FAULT", "nodirect")
        monkeypatch.setattr(io_handle, "_NO_DIRECT_WARNED", set())
        h = AsyncIOHandle()
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            h.sync_pwrite(src, path)
            h.sync_pwrite(src, path)
            dst.zero_()
            h.sync_pread(dst, path)
        msgs = [w for w in got if "refuses O_DIRECT" in str(w.message)]
        assert len(msgs) == 1 and issubclass(msgs[0].category, RuntimeWarning)
        assert torch.equal(src, dst)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_wait_raises_first_failure_and_keeps_the_others(backend, tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROINF_AIO_FAULT", "enospc:4096")
    h = AsyncIOHandle(block_size=4096, queue_depth=2)
    h.async_pwrite(_rand_bytes(100), tmp_path / "fits")         # below byte 4096: succeeds
    h.async_pwrite(_rand_bytes(8192), tmp_path / "a")
    h.async_pwrite(_rand_bytes(8192), tmp_path / "b")
    with pytest.raises(DiskFullError) as ei:
        h.wait()
    assert ei.value.filename == str(tmp_path / "a")
    assert [e.filename for e in ei.value.other_errors] == [str(tmp_path / "b")]
    assert (tmp_path / "fits").stat().st_size == 100 and h.pending() == 0
