"""AsyncIOHandle: byte-exact round trips under every backend, alignment edge cases, errors.

The reference for every read is the file's bytes read back with plain ``open().read()``; the
reference for every write is the source tensor's bytes.
"""
import errno
import os
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

from zeroinf.io import (AIOError, AIOFileNotFoundError, AsyncIOHandle, BackendUnavailableError, DeviceIOError,
                        DiskFullError, PinnedBufferPool, ReadPastEndError, SizeMismatchError)
from zeroinf.io import backends as io_backends
from zeroinf.io import handle as io_handle
from zeroinf.io import locked as io_locked
from zeroinf.ops import OpUnavailableError

MiB = 1 << 20
BACKENDS = list(io_backends.BACKENDS)


def _bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _rand_bytes(n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8)


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """Force each backend through the env var, as users would."""
    why = io_backends.backend_reasons(request.param)
    if why:
        pytest.skip(f"backend {request.param} unavailable: {'; '.join(why)}")
    monkeypatch.setenv("ZEROINF_AIO_BACKEND", request.param)
    return request.param


@pytest.fixture
def handle(backend):
    h = AsyncIOHandle(block_size=256 * 1024, queue_depth=4)
    assert h.backend == backend
    yield h
    h.close()


@pytest.fixture(scope="module")
def pool():
    p = PinnedBufferPool(2, 64 * MiB + 8192)
    yield p
    p.close()


SIZES = [1, 511, 512, 4095, 4096, 4097, MiB + 13, 64 * MiB]


@pytest.mark.parametrize("offset", [0, 3 * 4096, 1000], ids=["off0", "off12288", "off1000"])
@pytest.mark.parametrize("n", SIZES, ids=[f"n{n}" for n in SIZES])
def test_round_trip_exact(handle, pool, tmp_path, n, offset):
    path = tmp_path / "f.bin"
    head = _rand_bytes(offset)
    if offset:
        path.write_bytes(_bytes(head))
    # Source from an aligned pinned buffer (the O_DIRECT path) for large sizes; an unaligned
    # plain tensor (bounce/buffered path) for small ones, so both paths are covered.
    src = pool.buffers()[0][:n] if n >= MiB else torch.empty(n + 1, dtype=torch.uint8)[1:]
    src.copy_(_rand_bytes(n))
    assert handle.sync_pwrite(src, path, offset) == 1  # DeepSpeed's value: one request completed
    on_disk = path.read_bytes()
    assert len(on_disk) == offset + n
    assert on_disk[:offset] == _bytes(head)
    assert on_disk[offset:] == _bytes(src)
    dst = pool.buffers()[1][:n] if n >= MiB else torch.empty(n + 3, dtype=torch.uint8)[3:]
    dst.fill_(0xAB)
    assert handle.sync_pread(dst, path, offset) == 1
    assert torch.equal(dst, src)


NUMELS = [1, 255, 256, 257, 513000, 1_000_003]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("numel", NUMELS, ids=[f"numel{n}" for n in NUMELS])
def test_typed_tensors_pool_and_odd_views(handle, pool, tmp_path, numel, dtype):
    src = torch.randn(numel, dtype=torch.float32).to(dtype)
    nbytes = src.numel() * src.element_size()
    path = tmp_path / "t.bin"
    # write from a caller-owned odd-offset view: the file holds exactly its bytes
    host = torch.zeros(numel + 2, dtype=dtype)
    view = host[1:1 + numel]
    view.copy_(src)
    handle.sync_pwrite(view, path)
    assert path.read_bytes() == _bytes(src)
    # into a pool buffer: exact data, and the buffer's bytes past numel are untouched
    buf = pool.buffers()[0]
    buf[:nbytes + 8192].fill_(0x5A)
    dst = PinnedBufferPool.view(buf, dtype, numel)
    handle.sync_pread(dst, path)
    assert torch.equal(dst.view(torch.int16 if dtype == torch.float16 else torch.int32),
                       src.view(torch.int16 if dtype == torch.float16 else torch.int32))
    assert bool((buf[nbytes:nbytes + 8192] == 0x5A).all())
    # into an odd-offset view of a caller tensor: neighbours untouched
    sentinel = torch.full((numel + 3,), 7.0, dtype=dtype)
    odd = sentinel[1:1 + numel]
    handle.async_pread(odd, path)
    assert handle.wait() == 1
    assert _bytes(odd) == _bytes(src)
    assert sentinel[0].item() == 7.0 and bool((sentinel[1 + numel:] == 7.0).all())


def test_64_concurrent_requests_one_wait(handle, tmp_path):
    srcs = [_rand_bytes(4096 * (i % 5) + 37 * i + 1) for i in range(64)]
    assert handle.wait() == 0  # nothing pending
    for i, s in enumerate(srcs):
        handle.async_pwrite(s, tmp_path / f"r{i}")
    assert handle.wait() == 64
    for i, s in enumerate(srcs):
        assert (tmp_path / f"r{i}").read_bytes() == _bytes(s)
    dsts = [torch.zeros_like(s) for s in srcs]
    for i, d in enumerate(dsts):
        handle.async_pread(d, tmp_path / f"r{i}")
    assert handle.pending() == 64
    assert handle.wait() == 64
    assert all(torch.equal(s, d) for s, d in zip(srcs, dsts))
    assert handle.wait() == 0


def test_many_requests_into_one_file_at_offsets(handle, tmp_path):
    path = tmp_path / "packed"
    parts = [_rand_bytes(8192) for _ in range(16)]
    for i, p in enumerate(parts):
        handle.async_pwrite(p, path, i * 8192)
    assert handle.wait() == 16
    assert path.read_bytes() == b"".join(_bytes(p) for p in parts)


@pytest.mark.parametrize("single_submit,overlap_events,lanes", [(True, True, 2), (False, False, 2), (True, False, 1)],
                         ids=["single-overlap-2lanes", "batch-nooverlap-2lanes", "single-nooverlap-1lane"])
def test_knob_combinations_round_trip(backend, tmp_path, single_submit, overlap_events, lanes):
    h = AsyncIOHandle(block_size=64 * 1024, queue_depth=3, intra_op_parallelism=lanes,
                      single_submit=single_submit, overlap_events=overlap_events)
    srcs = [_rand_bytes(3 * MiB + 5 + i) for i in range(3)]
    for i, s in enumerate(srcs):
        h.async_pwrite(s, tmp_path / f"k{i}")
    assert h.wait() == 3
    dsts = [torch.zeros_like(s) for s in srcs]
    for i, d in enumerate(dsts):
        h.async_pread(d, tmp_path / f"k{i}")
    assert h.wait() == 3
    assert all(torch.equal(s, d) for s, d in zip(srcs, dsts))


# -- errors --------------------------------------------------------------------------------


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

def test_a_handle_dropped_with_pending_requests_finishes_them_and_closes_their_files(backend, tmp_path, monkeypatch):
    """Dropping a handle with a queued write, without wait() or close(), leaked 2 file
    descriptors per request and lost any error (helper-33, t24_drop_pending.py)."""
    import gc

    def fds():
        return len(os.listdir("/proc/self/fd"))
    before = fds()
    src = _rand_bytes(3 * 4096 + 7)
    with pytest.warns(ResourceWarning, match="1 request"):
        for i in range(5):
            h = AsyncIOHandle(block_size=4096, queue_depth=2)
            h.async_pwrite(src, tmp_path / f"f{i}")
            del h
            gc.collect()
    assert fds() == before
    assert all((tmp_path / f"f{i}").read_bytes() == _bytes(src) for i in range(5))
    monkeypatch.setenv("ZEROINF_AIO_FAULT", "enospc:4096")
    h = AsyncIOHandle(block_size=4096, queue_depth=2)
    h.async_pwrite(src, tmp_path / "full")
    with pytest.warns(RuntimeWarning, match="one failed: .*full"):
        del h
        gc.collect()
    assert fds() == before

def test_a_queue_longer_than_the_file_descriptors_allow_is_finished_early(backend, tmp_path, monkeypatch):
    """Each queued request holds its file open until collected: 125 queued writes ran out of
    descriptors under a limit of 256 ("Too many open files"). A submission that runs out now
    finishes the queue first; wait() still reports every request, and every error."""
    import resource

    src = _rand_bytes(4096 + 7)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for fault in ("", "enospc:4096"):
        monkeypatch.setenv("ZEROINF_AIO_FAULT", fault)
        h = AsyncIOHandle(block_size=4096, queue_depth=2)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 40, hard))
        try:
            for i in range(60):
                h.async_pwrite(src, tmp_path / f"{fault or 'ok'}{i}")
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        if fault:
            with pytest.raises(AIOError) as ei:
                h.wait()
            assert len(ei.value.other_errors) == 59  # none of the early-finished failures is lost
        else:
            assert h.wait() == 60
            assert all((tmp_path / f"ok{i}").read_bytes() == _bytes(src) for i in range(60))
        h.close()


def test_deepspeed_aio_handle_calls_carry_over(backend, tmp_path):
    """DeepSpeed's positional constructor order and its read/write/pread/pwrite; a read at offset
    0 takes the buffer's bytes, as DeepSpeed's sync_pread does (it was a whole-file read: two
    tensors written into one file could not be read back; helper-33, /tmp/tester17/t25_ds_compat.py)."""
    h = AsyncIOHandle(64 * 1024, 4, True, False, 2)  # block_size, queue_depth, single_submit, overlap_events, lanes
    assert (h.get_single_submit(), h.get_overlap_events(), h.get_intra_op_parallelism()) == (True, False, 2)
    a, b = _rand_bytes(4096), _rand_bytes(5000)
    path = tmp_path / "two"
    assert h.sync_pwrite(a, path, 0) == 1 and h.pwrite(b, path, False, True, 4096) == 0 and h.wait() == 1
    got_a, got_b = torch.zeros_like(a), torch.zeros_like(b)
    assert h.sync_pread(got_a, path) == 1  # the first tensor of the file, from offset 0
    assert h.pread(got_b, path, False, False, 4096) == 1
    assert torch.equal(got_a, a) and torch.equal(got_b, b)
    head = torch.zeros(16, dtype=torch.uint8)
    assert h.async_pread(head, path) == 0
    assert h.wait() == 1 and torch.equal(head, a[:16])
    whole = torch.zeros(4096 + 5000, dtype=torch.uint8)
    assert h.read(whole, path) == 0 and torch.equal(whole, torch.cat([a, b]))
    assert h.write(b, tmp_path / "one") == 0
    assert (tmp_path / "one").read_bytes() == _bytes(b)
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


# -- knobs, config, backend choice -------------------------------------------------------------


def test_from_config_deepspeed_block():
    h = AsyncIOHandle.from_config({"block_size": 262144, "queue_depth": 32, "thread_count": 2,
                                   "single_submit": False, "overlap_events": True, "use_gds": False})
    assert (h.get_block_size(), h.get_queue_depth(), h.get_intra_op_parallelism()) == (262144, 32, 2)
    with pytest.raises(ValueError, match=r"^aio\.block_sise: unknown key"):
        AsyncIOHandle.from_config({"block_sise": 4096})
    with pytest.raises(ValueError, match=r"^aio\.block_size: expected an integer >= 1, got 0"):
        AsyncIOHandle.from_config({"block_size": 0})
    with pytest.raises(ValueError, match=r"^aio\.single_submit"):
        AsyncIOHandle.from_config({"single_submit": "yes"})
    with pytest.raises(ValueError, match=r"^aio\.thread_count: 3 disagrees with intra_op_parallelism=2"):
        AsyncIOHandle.from_config({"intra_op_parallelism": 2, "thread_count": 3})  # tester-41 F9


def test_env_var_beats_argument(monkeypatch):
    monkeypatch.setenv("ZEROINF_AIO_BACKEND", "python")
    assert AsyncIOHandle(backend="threads").backend == "python"
    monkeypatch.setenv("ZEROINF_AIO_BACKEND", "uring")
    with pytest.raises(ValueError, match="ZEROINF_AIO_BACKEND=uring"):
        AsyncIOHandle()


def test_forced_backend_unavailable_says_why(monkeypatch):
    def unavailable():
        raise OpUnavailableError("disabled for the test")

    monkeypatch.setattr(io_backends, "_load_aio_op", unavailable)
    with pytest.raises(BackendUnavailableError, match="disabled for the test"):
        AsyncIOHandle(backend="libaio")
    assert AsyncIOHandle(backend="python").backend == "python"


def test_backend_report_shape():
    rows = io_backends.backend_report()
    assert [r["name"] for r in rows] == BACKENDS
    assert all(isinstance(r["available"], bool) and isinstance(r["why"], str) for r in rows)
    assert rows[-1]["available"]  # the pure-Python backend always runs


def test_bad_buffers(tmp_path):
    h = AsyncIOHandle(backend="python")
    with pytest.raises(ValueError, match="contiguous"):
        h.sync_pwrite(torch.zeros(4, 4)[:, 1], tmp_path / "f")
    with pytest.raises(TypeError, match="torch.Tensor"):
        h.sync_pwrite(b"abc", tmp_path / "f")
    for bad in (-1, 2**63):  # off_t is signed 64-bit: 2**63 was a raw pybind TypeError (tester-44 F5)
        with pytest.raises(ValueError, match=r"file_offset must be an integer in \[0, 2\*\*63\)"):
            h.sync_pwrite(torch.zeros(4), tmp_path / "f", bad)
    assert isinstance(DiskFullError(errno.ENOSPC, "x", "p"), AIOError)
    # views whose bytes are not their values, and sparse tensors, are refused saying so (tester-44 F8)
    for bad, says in ((torch.randn(8, dtype=torch.complex64).conj(), r"lazily conjugated view.*resolve_conj"),
                      (torch.randn(8)._neg_view(), r"lazily negated view.*resolve_neg"),
                      (torch.eye(3).to_sparse(), r"torch.sparse_coo tensor, which has no flat bytes")):
        with pytest.raises(ValueError, match=says):
            h.sync_pwrite(bad, tmp_path / "f")
    with pytest.raises(TypeError, match="cannot be pickled .* make one in each process"):
        import pickle
        pickle.dumps(h)


def test_tune_io_cli_prints_a_loadable_aio_block(tmp_path, capsys):
    import json

    from zeroinf.cli import main
    from zeroinf.io.tune import parse_bytes

    # the same units as every other tool: K/M/G decimal, KiB/MiB/GiB binary
    assert [parse_bytes(s) for s in ("4096", "256K", "256KiB", "1G", "2GiB")] == [4096, 256_000, 1 << 18, 10**9, 2 << 30]
    with pytest.raises(ValueError, match="expected a number of bytes"):
        parse_bytes("1.5 apples")
    # a decimal block size is no multiple of 4096: refused with the fix, nothing written
    assert main(["tune-io", "--path", str(tmp_path), "--block-sizes", "256K"]) == 2
    assert "'256K' = 256000 bytes is not a positive multiple of 4096" in capsys.readouterr().err
    # bad values end in one line on stderr and exit 2, not a traceback (helper-33, t30_cli_tracebacks.sh)
    for extra, says in ((["--queue-depths", "0"], "--queue-depths: each must be >= 1"),
                        (["--size", "0"], "--size: must be positive"), (["--repeat", "0"], "--repeat: must be >= 1"),
                        (["--backend", "bogus"], "--backend: 'bogus' is not one of libaio, threads, python"),
                        (["--size", "4TB"], "PinnedMemoryError")):
        assert main(["tune-io", "--path", str(tmp_path), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("zeroinf tune-io: error: ") and says in err and err.count("\n") == 1, err
    rc = main(["tune-io", "--path", str(tmp_path), "--size", "1MiB", "--block-sizes", "256KiB,512KiB",
               "--queue-depths", "2", "--repeat", "1", "--backend", "python"])
    assert rc == 0
    out = capsys.readouterr().out
    block = json.loads(out[out.index("{"):])
    assert block["aio"]["block_size"] in (1 << 18, 1 << 19) and block["aio"]["queue_depth"] == 2
    AsyncIOHandle.from_config(block["aio"])
    assert list(tmp_path.iterdir()) == []  # the test file is removed


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


def test_backend_probe_leaves_the_global_rng_alone(monkeypatch):
    from zeroinf.io import backends

    monkeypatch.setattr(backends, "_probe_cache", {})  # force a fresh probe
    torch.manual_seed(0)
    want = torch.rand(4)
    torch.manual_seed(0)
    AsyncIOHandle()
    assert torch.equal(torch.rand(4), want)


# -- lifetime: no std::terminate, no hang, nothing lost at exit ---------------------------------
# A rank of the 2-rank nvme test once aborted with "terminate called without an active exception".
# The script below runs the exits that can tear down engines with work in flight; the parent checks
# each process exits 0, prints no "terminate called", and that every pending write reached its file.
_EXIT_SCRIPT = r'''
import multiprocessing as mp, os, sys, torch
from zeroinf.io import AsyncIOHandle, BackendUnavailableError
from zeroinf.io import backends

BACKENDS = [b for b in ("libaio", "threads") if not backends.backend_reasons(b)]
N = 6 * 4096 + 7

def payload(i):
    return torch.arange(N, dtype=torch.int64).to(torch.uint8) + i

def write_and_leave(d, tag, how):
    handles = [AsyncIOHandle(block_size=4096, queue_depth=4, backend=b) for b in BACKENDS]
    for k, h in enumerate(handles):
        for j in range(4):
            h.async_pwrite(payload(j), os.path.join(d, f"{tag}_{k}_{j}"))
    if how == "sys.exit":
        sys.exit(0)
    del handles  # engines destroyed with requests in flight, never waited for

def fork_child(h, d):
    try:
        h.sync_pwrite(payload(0), os.path.join(d, "forked"))
    except RuntimeError as exc:
        assert "forked" in str(exc), exc
        sys.exit(0)  # exit destroys the inherited engine: must neither hang nor crash
    sys.exit(3)

def thread_start_failure():
    import psutil, resource
    vm = psutil.Process().memory_info().vms
    resource.setrlimit(resource.RLIMIT_AS, (vm + (200 << 20), resource.RLIM_INFINITY))
    try:
        AsyncIOHandle(backend="threads", queue_depth=256)  # 256 threads x 8 MiB stacks > 200 MiB
    except BackendUnavailableError as exc:
        assert "could not start aio worker thread" in str(exc), exc
    else:
        print("thread limit not reached", file=sys.stderr)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

if __name__ == "__main__":
    d, mode = sys.argv[1], sys.argv[2]
    if mode == "spawn":
        ctx = mp.get_context("spawn")
        ps = [ctx.Process(target=write_and_leave, args=(d, f"spawn{r}", "sys.exit")) for r in range(2)]
        [p.start() for p in ps]
        [p.join() for p in ps]
        sys.exit(max(p.exitcode for p in ps))
    if mode == "fork_and_limits":
        h = AsyncIOHandle(block_size=4096, queue_depth=2, backend=BACKENDS[0])
        p = mp.get_context("fork").Process(target=fork_child, args=(h, d))
        p.start()
        p.join(30)
        if p.exitcode is None:
            p.kill()
            sys.exit("forked child hung")
        if p.exitcode != 0:
            sys.exit(f"forked child exited {p.exitcode}")
        thread_start_failure()
        write_and_leave(d, "limits", "return")
        sys.exit(0)
    write_and_leave(d, mode, mode)
'''


def test_exit_with_requests_in_flight_never_terminates(tmp_path):
    if io_backends.backend_reasons("threads"):
        pytest.skip("C++ aio op unavailable")
    script = tmp_path / "exit_script.py"
    script.write_text(_EXIT_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("ZEROINF_AIO_BACKEND", "ZEROINF_AIO_FAULT")}
    runs = ["return", "spawn", "fork_and_limits"]  # spawn children leave through sys.exit
    for i, mode in enumerate(runs):
        d = tmp_path / f"run{i}"
        d.mkdir()
        r = subprocess.run([sys.executable, str(script), str(d), mode], capture_output=True, text=True,
                           env=env, timeout=120)
        assert r.returncode == 0 and "terminate called" not in r.stderr, (mode, r.returncode, r.stderr[-3000:])
        assert "thread limit not reached" not in r.stderr
        written = sorted(p for p in os.listdir(d) if p != "forked")
        assert len(written) == (8 if mode == "spawn" else 4) * (2 if "libaio" in _usable_cpp() else 1)
        for name in written:  # the atexit close waited: every pending write is complete
            j = int(name.rsplit("_", 1)[1])
            want = torch.arange(6 * 4096 + 7, dtype=torch.int64).to(torch.uint8) + j
            assert (d / name).read_bytes() == _bytes(want), name


def _usable_cpp():
    return [b for b in ("libaio", "threads") if not io_backends.backend_reasons(b)]


def test_close_is_idempotent_waits_and_refuses_new_work(backend, tmp_path):
    h = AsyncIOHandle(block_size=4096, queue_depth=2)
    src = _rand_bytes(5 * 4096 + 3)
    for j in range(3):
        h.async_pwrite(src, tmp_path / f"f{j}")
    h.close()  # waits for the three writes before stopping the threads
    for j in range(3):
        assert (tmp_path / f"f{j}").read_bytes() == _bytes(src)
    h.close()
    with pytest.raises(ValueError, match="closed"):
        h.sync_pwrite(src, tmp_path / "late")
    assert not (tmp_path / "late").exists()
    assert h not in list(io_handle._LIVE_HANDLES)


# -- locked_cpu_tensor / new_cpu_locked_tensor: huge-page, page-locked buffers ----------------------

def _vm_flags_and_locked(addr: int):
    """(VmFlags of the mapping holding addr, VmLck bytes of the process), from /proc directly."""
    flags = None
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                flags = line.split()[1:]
    with open("/proc/self/status") as f:
        locked = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmLck:"))
    return flags, locked


@pytest.mark.parametrize("huge", [True, False], ids=["huge", "4k"])
def test_locked_tensor_layout_lock_and_free(huge):
    numel = 3 * MiB + 5  # fp32: 12 MiB + 20 bytes, so the last huge page is partly used
    nbytes = numel * 4
    step = io_locked.HUGE_PAGE if huge else 4096
    expect = -(-nbytes // step) * step
    assert io_locked.locked_cpu_tensor_bytes(numel, torch.float32, huge) == expect
    _, before = _vm_flags_and_locked(0)
    t = io_locked.locked_cpu_tensor(numel, torch.float32, huge_pages=huge)
    assert t.dtype == torch.float32 and t.shape == (numel,) and t.is_contiguous()
    assert t.data_ptr() % io_locked.HUGE_PAGE == 0
    assert not t.any()
    flags, locked = _vm_flags_and_locked(t.data_ptr())
    assert locked - before == expect
    assert ("hg" in flags) == huge  # MADV_HUGEPAGE applied exactly when asked
    assert io_locked.free_locked_cpu_tensor(t)
    assert not io_locked.free_locked_cpu_tensor(t)  # already freed
    assert not io_locked.free_locked_cpu_tensor(torch.zeros(3))  # not ours
    assert _vm_flags_and_locked(0)[1] == before
    t.fill_(1.5)  # still valid memory after free (unlocked), until dropped
    assert float(t[-1]) == 1.5


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("numel", [1, 257, 1_000_003], ids=["numel1", "numel257", "numel1000003"])
def test_locked_tensor_round_trip(handle, tmp_path, numel, dtype):
    src = handle.new_cpu_locked_tensor(numel, torch.empty(0, dtype=dtype))
    dst = handle.new_cpu_locked_tensor(numel, src)
    assert src.dtype == dtype and src.numel() == numel
    src.copy_(torch.randn(numel).to(dtype))
    path = tmp_path / "f.bin"
    assert handle.sync_pwrite(src, path) == 1
    assert path.read_bytes() == _bytes(src)
    handle.async_pread(dst, path)
    assert handle.wait() == 1
    assert torch.equal(dst, src)
    assert handle.is_pinned(src) and handle.is_pinned(dst[numel // 2:]) and not handle.is_pinned(torch.zeros(4))
    assert handle.free_cpu_locked_tensor(src) and handle.free_cpu_locked_tensor(dst)
    assert not handle.is_pinned(src)


def test_locked_tensor_budget_errors_before_allocating(monkeypatch):
    from zeroinf.io import PinnedMemoryError

    with pytest.raises(ValueError, match="num_elem"):
        io_locked.locked_cpu_tensor(0)
    with pytest.raises(TypeError, match="example_tensor"):
        AsyncIOHandle(backend="python").new_cpu_locked_tensor(4, torch.float32)
    monkeypatch.setattr(io_locked, "_memlock_limit", lambda: 4 * MiB)
    with pytest.raises(PinnedMemoryError, match="memlock limit"):
        io_locked.locked_cpu_tensor(4 * MiB + 1)
    monkeypatch.setattr(io_locked, "_memlock_limit", lambda: None)
    monkeypatch.setattr(io_locked, "_available_bytes", lambda: 8 * MiB)
    with pytest.raises(PinnedMemoryError, match="available memory"):
        io_locked.locked_cpu_tensor(8 * MiB + 1)


def test_locked_tensor_warns_once_when_thp_is_off(monkeypatch):
    monkeypatch.setattr(io_locked, "_thp_mode", lambda: "never")
    monkeypatch.setattr(io_locked, "_THP_WARNED", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = io_locked.locked_cpu_tensor(4096)
        b = io_locked.locked_cpu_tensor(4096)
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "huge pages are disabled" in msgs[0]
    assert io_locked.free_locked_cpu_tensor(a) and io_locked.free_locked_cpu_tensor(b)


def test_one_python_backend_handle_shared_by_threads(tmp_path):
    """Four threads each write their own file through one handle and wait: a small request that
    the pure-Python engine finished before its submit registered it was collected by another
    thread's wait as "internal: completion for unknown request", and stayed pending for good
    with its two descriptors open (tester-41 F3)."""
    h = AsyncIOHandle(1 << 16, 4, backend="python")
    submit = h._engine.submit

    def slow_submit(*args):  # widens the window between the engine's submit and its return
        rid = submit(*args)
        time.sleep(0.005)
        return rid
    h._engine.submit = slow_submit
    errors = []

    def worker(t):
        src = torch.full((100,), t, dtype=torch.uint8)
        for _ in range(30):
            try:
                h.async_pwrite(src, str(tmp_path / f"t{t}.bin"))
                h.wait()
            except Exception as exc:  # noqa: BLE001 - collected for the assertion below
                errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:1]
    assert h.pending() == 0
    h.close()
    for t in range(4):
        assert (tmp_path / f"t{t}.bin").read_bytes() == bytes([t]) * 100


def test_block_size_below_4096_and_writes_through_a_descriptor(backend, tmp_path):
    """DeepSpeed's tests use block_size=1024: the engine moves 4096-byte transfers and the getter
    returns 1024. async_pwrite takes an open descriptor (fd=, or an int in filename's place) and
    leaves it open; the bytes land at the offsets given."""
    h = AsyncIOHandle(1024, 2, True, True, 2)
    assert h.get_block_size() == 1024
    data = _rand_bytes(3 * 4096 + 100)
    path = tmp_path / "via_fd"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        assert h.async_pwrite(buffer=data[:4096], fd=fd, file_offset=0) == 0
        assert h.async_pwrite(data[4096:], fd, 4096) == 0
        assert h.wait() == 2
        os.fstat(fd)  # still open
    finally:
        os.close(fd)
    assert path.read_bytes() == _bytes(data)
    back = torch.zeros_like(data)
    assert h.sync_pread(back, path, 0) == 1 and torch.equal(back, data)
    ro = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ValueError, match=f"fd {ro}: opened read-only"):
            h.async_pwrite(data, fd=ro)
    finally:
        os.close(ro)
    with pytest.raises(ValueError, match="exactly one of filename and fd"):
        h.async_pwrite(data, path, fd=3)
    with pytest.raises(ValueError, match="fd 987654: not an open file descriptor"):
        h.async_pwrite(data, fd=987654)
    assert path.read_bytes() == _bytes(data)  # the refused requests wrote nothing
    h.close()
