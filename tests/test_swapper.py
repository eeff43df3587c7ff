"""TensorSwapper and PinnedBufferPool: exact round trips, stale/truncated/corrupt files, budgets."""
import errno
import json
import os
import stat
import subprocess
import sys
import warnings

import pytest
import torch

from zeroinf.io import (AsyncIOHandle, ChecksumMismatchError, DiskFullError, PinnedBufferPool, PinnedMemoryError,
                        PoolExhaustedError, StaleSwapFileError, TensorSwapper, pinned_pool_bytes)
from zeroinf.io import pool as io_pool
from zeroinf.io.checksum import crc32c

KEYS = {"rank0/subgroup0/fp32": (1000, torch.float32, (10, 100)),
        "rank0/subgroup0/exp_avg": (4097, torch.float32, None),
        "rank0/subgroup1/param bf16": (333, torch.bfloat16, None),
        "rank0/unit:3.weight": (1, torch.float16, None)}


def _make(numel, dtype, shape):
    t = torch.randn(numel).to(dtype)
    return t.view(shape) if shape else t


@pytest.fixture
def swapper(tmp_path):
    s = TensorSwapper(tmp_path, AsyncIOHandle(block_size=64 * 1024, queue_depth=4))
    for k, (n, dt, sh) in KEYS.items():
        s.register(k, n, dt, sh)
    return s


@pytest.mark.parametrize("async_op", [True, False], ids=["async", "sync"])
def test_round_trip_exact(swapper, async_op):
    src = {k: _make(*v) for k, v in KEYS.items()}
    swapper.swap_out(src.items(), async_op=async_op)
    assert swapper.wait() == (len(src) if async_op else 0)
    dst = {k: torch.zeros_like(t) for k, t in src.items()}
    swapper.swap_in(dst.items(), async_op=async_op)
    swapper.wait()
    for k in src:
        assert torch.equal(src[k].view(torch.uint8), dst[k].view(torch.uint8)), k
        assert swapper.path_for(k).read_bytes() == src[k].reshape(-1).view(torch.uint8).numpy().tobytes()


def test_remove_frees_the_file_and_forgets_the_key(swapper):
    key = "rank0/subgroup0/exp_avg"
    t = _make(*KEYS[key])
    swapper.swap_out([(key, t)])
    with pytest.raises(RuntimeError, match="queued"):
        swapper.remove(key)  # its write still in flight
    swapper.wait()
    files = [swapper.path_for(key), swapper._meta_path(key)]
    assert all(f.exists() for f in files)
    swapper.remove(key)
    assert not any(f.exists() for f in files) and key not in swapper.manifest()
    assert not set(files) & set(swapper.files())
    with pytest.raises(KeyError, match="not registered"):
        swapper.remove(key)
    with pytest.raises(KeyError, match="not registered"):
        swapper.swap_in([(key, torch.zeros_like(t))])
    swapper.register(key, KEYS[key][0], KEYS[key][1])  # a new, empty file
    assert swapper.path_for(key).stat().st_size == t.numel() * 4


def test_a_ctrl_c_while_waiting_loses_no_outcome(swapper):
    """A Ctrl-C landing while the engine waits was raised as soon as wait_all() returned, before
    the handle recorded the outcomes: the writes stayed pending for good and every file of the
    batch was stale, so each later optimizer step and a rescue save_checkpoint failed
    (helper-41, /tmp/tester25/t31). The KeyboardInterrupt now comes after the bookkeeping; the
    batch is finished by the next wait and reads back exact."""
    import signal

    class CtrlCWhileWaiting:
        def __init__(self, engine):
            self.engine = engine

        def wait_all(self):
            out = self.engine.wait_all()
            os.kill(os.getpid(), signal.SIGINT)  # delivered as the C call returns
            return out

        def __getattr__(self, name):
            return getattr(self.engine, name)
    src = {k: _make(*v) for k, v in KEYS.items()}
    swapper.swap_out(src.items(), async_op=True)
    h = swapper.handle
    h._engine = CtrlCWhileWaiting(h._engine)
    with pytest.raises(KeyboardInterrupt):
        swapper.wait()
    h._engine = h._engine.engine
    assert h.pending() == 0 and swapper.wait() == len(src)
    dst = {k: torch.zeros_like(t) for k, t in src.items()}
    swapper.swap_in(dst.items(), async_op=False)
    assert all(torch.equal(src[k].view(torch.uint8), dst[k].view(torch.uint8)) for k in src)


def test_files_private_and_preallocated(swapper):
    assert stat.S_IMODE(swapper.directory.stat().st_mode) == 0o700
    for k, (n, dt, _sh) in KEYS.items():
        st = swapper.path_for(k).stat()
        nbytes = n * torch.empty((), dtype=dt).element_size()
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == nbytes
        assert st.st_blocks * 512 >= nbytes  # blocks allocated up front (fallocate), not sparse
    man = swapper.manifest()
    assert man["rank0/subgroup0/fp32"]["shape"] == [10, 100]
    assert man["rank0/subgroup1/param bf16"]["dtype"] == "bfloat16"


def test_empty_and_idle_are_noops(swapper):
    swapper.swap_out([])
    swapper.swap_in([])
    assert swapper.wait() == 0


def test_stale_file_of_other_size_detected(tmp_path):
    a = TensorSwapper(tmp_path)
    a.register("k", 100, torch.float32)
    a.swap_out([("k", torch.ones(100))], async_op=False)
    a.close()
    b = TensorSwapper(tmp_path)  # a later run with another config
    b.register("k", 200, torch.float32)
    with pytest.warns(RuntimeWarning, match=r"1 stale swap file\(s\) in .*zeroinf-swap"):
        with pytest.raises(StaleSwapFileError, match="holds no swapped-out data") as ei:
            b.swap_in([("k", torch.zeros(200))])
    assert ei.value.filename == str(b.path_for("k"))


def test_many_stale_files_give_one_warning_that_counts_them(tmp_path):
    a = TensorSwapper(tmp_path)
    for i in range(37):
        a.register(f"sub{i}", 100, torch.float32)
        a.swap_out([(f"sub{i}", torch.ones(100))])
    a.close()
    b = TensorSwapper(tmp_path)  # another sub_group_size: every key has another size
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for i in range(37):
            b.register(f"sub{i}", 150, torch.float32)
        b.register("new", 10, torch.float32)  # no file yet: not stale
        b.swap_out([("sub0", torch.zeros(150))], async_op=False)
        b.close()
    msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
    assert len(msgs) == 1, msgs
    assert msgs[0].startswith(f"37 stale swap file(s) in {b.directory} ")
    assert b.report_stale() == 0  # reported once only


def test_same_config_adopts_data_of_earlier_run(tmp_path):
    src = torch.randn(321)
    a = TensorSwapper(tmp_path)
    a.register("k", 321, torch.float32)
    a.swap_out([("k", src)], async_op=False)
    a.close()
    b = TensorSwapper(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b.register("k", 321, torch.float32)
    dst = torch.zeros(321)
    b.swap_in([("k", dst)], async_op=False)
    assert torch.equal(dst, src)


def test_a_file_of_the_same_size_never_written_is_not_called_stale(tmp_path):
    """A run that registered its keys but never swapped out (stage 3 with no backward: its
    gradient files) left files of the right size marked unwritten; the next run with the same
    config warned of "stale swap files left by a run with other sizes" (helper-36 t10_stale.py,
    helper-38 t07b)."""
    TensorSwapper(tmp_path).register("grad", 224, torch.float32)
    b = TensorSwapper(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b.register("grad", 224, torch.float32)
        assert b.report_stale() == 0
    with pytest.raises(StaleSwapFileError, match="holds no swapped-out data"):  # still nothing to read
        b.swap_in([("grad", torch.zeros(224))])


def test_discard_stale_removes_only_stale_files_and_warns_once(tmp_path):
    """A caller that registers each key at its first write discards the stale files of all its
    keys first: those of other sizes go (one warning counting them), an adoptable file and one
    of the same size never written stay, and a registered key is not touched."""
    a = TensorSwapper(tmp_path)
    for k in ("old0", "old1", "same"):
        a.register(k, 100, torch.float32)
        a.swap_out([(k, torch.full((100,), 5.0))], async_op=False)
    a.register("unwritten", 100, torch.float32)
    a.close()
    b = TensorSwapper(tmp_path)
    b.register("old1", 300, torch.float32)  # registered first: reset by register, reported with the others
    with pytest.warns(RuntimeWarning, match=r"^2 stale swap file\(s\) in "):
        n = b.discard_stale([(k, 200 if k.startswith("old") else 100, torch.float32)
                             for k in ("old0", "old1", "same", "unwritten", "new")])
    assert n == 1 and not b.path_for("old0").exists() and b.path_for("old1").stat().st_size == 1200
    assert b.path_for("unwritten").stat().st_size == 400
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b.register("same", 100, torch.float32)
    dst = torch.zeros(100)
    b.swap_in([("same", dst)], async_op=False)
    assert torch.equal(dst, torch.full((100,), 5.0))
    b.close()


def test_two_live_swappers_on_one_folder_do_not_share_files(tmp_path):
    """Two engines with one config and one nvme_path (an actor and a reference model) used the
    same swap files, and the first one's weights changed silently (helper-39,
    /tmp/tester23/t02_two_engines_same_nvme.py) [Note: one swapper per folder]."""
    a, b = TensorSwapper(tmp_path), TensorSwapper(tmp_path)
    assert a.directory != b.directory and b.directory.name == "zeroinf-swap.1"
    for s, value in ((a, 1.0), (b, 2.0)):
        s.register("k", 1000, torch.float32)
        s.swap_out([("k", torch.full((1000,), value))], async_op=False)
    got = torch.zeros(1000)
    a.swap_in([("k", got)], async_op=False)
    assert torch.equal(got, torch.ones(1000))
    a.close()
    b.close()
    c = TensorSwapper(tmp_path)  # a later run takes the first folder again, and its data
    assert c.directory == a.directory
    c.register("k", 1000, torch.float32)
    c.swap_in([("k", got)], async_op=False)
    assert torch.equal(got, torch.ones(1000))
    c.close()


def test_truncated_file_detected(swapper):
    k = "rank0/subgroup0/exp_avg"
    swapper.swap_out([(k, torch.randn(4097))], async_op=False)
    os.truncate(swapper.path_for(k), 4096)
    with pytest.raises(StaleSwapFileError, match="has 4096 bytes, expected 16388"):
        swapper.swap_in([(k, torch.zeros(4097))])
    # and across processes: a fresh swapper refuses the truncated file as well
    swapper.close()
    again = TensorSwapper(swapper.directory.parent)
    again.register(k, 4097, torch.float32)
    with pytest.warns(RuntimeWarning, match="1 stale swap file"):  # reported at the first swap
        with pytest.raises(StaleSwapFileError):
            again.swap_in([(k, torch.zeros(4097))])


def test_checksum_detects_corruption(tmp_path):
    s = TensorSwapper(tmp_path)  # verified by default
    assert s.checksum
    s.register("k", 5000, torch.float32)
    src = torch.randn(5000)
    s.swap_out([("k", src)], async_op=False)
    with open(s.path_for("k"), "r+b") as f:  # same size, one byte flipped
        f.seek(12345)
        b = f.read(1)
        f.seek(12345)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ChecksumMismatchError, match=r"CRC-32C of bytes \[0, 20000\)") as info:
        s.swap_in([("k", torch.zeros(5000))], async_op=False)
    assert info.value.filename == str(s.path_for("k")) and info.value.offset == 0
    assert "\n" not in str(info.value)
    entry = json.loads(s.path_for("k").with_suffix(".json").read_text())
    assert entry["written"] is True and entry["crc32c"] == [crc32c(src)]


def test_failed_write_is_never_read(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROINF_AIO_FAULT", "enospc:4096")
    s = TensorSwapper(tmp_path, AsyncIOHandle(backend="python"))
    s.register("k", 4096, torch.float32)
    s.swap_out([("k", torch.randn(4096))])
    with pytest.raises(DiskFullError):
        s.wait()
    with pytest.raises(StaleSwapFileError):
        s.swap_in([("k", torch.zeros(4096))])


def test_bad_items_name_the_key(swapper):
    with pytest.raises(KeyError, match="nope"):
        swapper.swap_out([("nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="rank0/subgroup0/exp_avg: registered as 4097 x float32"):
        swapper.swap_out([("rank0/subgroup0/exp_avg", torch.zeros(4097, dtype=torch.float16))])
    with pytest.raises(ValueError, match="already registered"):
        swapper.register("rank0/subgroup0/exp_avg", 10, torch.float32)
    with pytest.raises(ValueError, match="shape"):
        swapper.register("x", 10, torch.float32, (3, 3))


def test_file_names_identical_across_processes(tmp_path):
    code = ("import sys, torch; from zeroinf.io import TensorSwapper, AsyncIOHandle\n"
            "s = TensorSwapper(sys.argv[1], AsyncIOHandle(backend='python'))\n"
            f"keys = {sorted(KEYS)!r}\n"
            "print('\\n'.join(s.register(k, 8, torch.float32).name for k in keys))\n")
    procs = []
    for sub in ("p1", "p2"):  # two processes at once, each with its own directory
        d = tmp_path / sub
        d.mkdir()
        procs.append(subprocess.Popen([sys.executable, "-c", code, str(d)], stdout=subprocess.PIPE, text=True))
    names = [p.communicate()[0].split() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert names[0] == names[1] and len(set(names[0])) == len(KEYS)
    here = TensorSwapper(tmp_path, AsyncIOHandle(backend="python"))
    assert names[0] == [here.path_for(k).name for k in sorted(KEYS)]


def test_missing_swap_dir(tmp_path):
    with pytest.raises(FileNotFoundError) as ei:
        TensorSwapper(tmp_path / "missing")
    assert ei.value.errno == errno.ENOENT


# -- pinned buffer pool ----------------------------------------------------------------------


def test_pinned_pool_bytes_exact():
    assert pinned_pool_bytes(3, 1000) == 3 * 4096
    assert pinned_pool_bytes(2, 4096) == 8192
    assert pinned_pool_bytes(2, 4097) == 2 * 8192
    assert pinned_pool_bytes(1, 5000, alignment=1 << 16) == 1 << 16
    with pytest.raises(ValueError, match="alignment"):
        pinned_pool_bytes(1, 10, alignment=3000)
    with pytest.raises(ValueError, match="buffer_count"):
        pinned_pool_bytes(0, 10)


def _vm_locked() -> int:
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmLck:"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA pinned memory comes from CUDA's host allocator")
def test_pool_buffers_are_backed_by_huge_pages_where_the_kernel_allows():
    """4 KiB pages scattered in physical memory cap O_DIRECT requests near 1 MiB (bench/README.md)."""
    from zeroinf.io.locked import _thp_mode, huge_page_bytes

    if _thp_mode() not in ("always", "madvise"):
        pytest.skip(f"transparent huge pages are {_thp_mode() or 'unknown'} on this kernel")
    before = _vm_locked()
    pool = PinnedBufferPool(2, 5 * 2**20 + 1000)  # locked bytes stay exact: whole huge pages inside only
    try:
        assert _vm_locked() - before == pinned_pool_bytes(2, 5 * 2**20 + 1000)
        assert huge_page_bytes(pool.buffers()[0]) >= 4 * 2**20, huge_page_bytes(pool.buffers()[0])
    finally:
        pool.close()


def test_pool_buffers_aligned_locked_and_recycled():
    before = _vm_locked()
    pool = PinnedBufferPool(3, 100_000, alignment=8192)
    try:
        assert _vm_locked() - before == pinned_pool_bytes(3, 100_000, 8192)
        bufs = [pool.acquire() for _ in range(3)]
        assert all(b.data_ptr() % 8192 == 0 and b.numel() == 100_000 for b in bufs)
        assert len({b.data_ptr() for b in bufs}) == 3
        for i, b in enumerate(bufs):
            b.fill_(i)
        assert [int(b[-1]) for b in bufs] == [0, 1, 2]  # no overlap between buffers
        with pytest.raises(PoolExhaustedError):
            pool.acquire()
        pool.release(bufs[1])
        with pytest.raises(ValueError, match="already free"):
            pool.release(bufs[1])
        with pytest.raises(ValueError, match="does not start"):
            pool.release(torch.zeros(4))
        assert pool.acquire().data_ptr() == bufs[1].data_ptr()
        assert not pool.closed
    finally:
        pool.close()
    assert _vm_locked() == before and pool.closed and pool.buffers() == []


def test_pool_budget_checked_before_allocating(monkeypatch):
    with pytest.raises(PinnedMemoryError, match="available memory"):
        PinnedBufferPool(1 << 20, 1 << 30)  # 1 PiB
    monkeypatch.setattr(io_pool, "_memlock_limit", lambda: 8 << 20)
    with pytest.raises(PinnedMemoryError, match="memlock limit"):
        PinnedBufferPool(4, 4 << 20)


def test_real_memlock_limit_without_cap_ipc_lock():
    """A process without CAP_IPC_LOCK and a 1 MiB memlock limit: the pool refuses 4 MiB up front."""
    import shutil

    if shutil.which("capsh") is None or os.geteuid() != 0:
        pytest.skip("needs root and capsh to drop CAP_IPC_LOCK")
    code = ("from zeroinf.io import PinnedBufferPool, PinnedMemoryError\n"
            "try:\n    PinnedBufferPool(4, 1 << 20)\nexcept PinnedMemoryError as e:\n    print('refused:', e)\n"
            "p = PinnedBufferPool(1, 1 << 19)\nprint('small pinned:', p.pinned)\n")
    r = subprocess.run(["capsh", "--drop=cap_ipc_lock", "--", "-c", f"ulimit -l 1024; exec {sys.executable} -c \"$0\"",
                        code], capture_output=True, text=True)
    if r.returncode != 0 and "refused" not in r.stdout:
        pytest.skip(f"capsh could not drop the capability here: {r.stderr.strip()[:200]}")
    assert "refused:" in r.stdout and "memlock limit" in r.stdout
    assert "small pinned: True" in r.stdout
