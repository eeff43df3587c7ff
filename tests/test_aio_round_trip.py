"""AsyncIOHandle: byte-exact round trips under every backend: sizes and offsets, typed tensors, pool
buffers and odd views, many requests at once, knob combinations, DeepSpeed's calls, threads
sharing one handle, block sizes below 4096 and writes through a descriptor.

The reference for every read is the file's bytes read back with plain ``open().read()``; the
reference for every write is the source tensor's bytes.
"""
import os
import threading
import time

import pytest
import torch

from zeroinf.io import AsyncIOHandle, PinnedBufferPool
from aio_helpers import MiB, _bytes, _rand_bytes
from aio_helpers import backend, handle  # noqa: F401, F811 - pytest fixtures, requested by name


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
