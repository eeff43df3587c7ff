"""Pinned host memory accounting: ``zeroinf.runtime.host_memory.HostMemory``, the stage 1/2
manager's pinned buffers and ``engine.stats()["pinned_bytes"]``.

torch pins only with CUDA, and this suite runs on CPU-only hosts, so the CUDA paths run here with
a stand-in for the pinned allocator (``fake_pinning``): ``torch.cuda.is_available()`` says True,
``torch.empty``/``torch.zeros(..., pin_memory=True)`` return ordinary tensors whose storages it
records, and ``Tensor.is_pinned()`` answers from that record. The reference is what that
allocator holds: the bytes of its storages still alive, which no counter of ours maintains."""
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeroinf
from zeroinf.runtime.flat import STAGING_NUMEL, FlatParamManager
from zeroinf.runtime.host_memory import HostMemory
from zeroinf.runtime.streams import HostTransfers


@pytest.fixture
def fake_pinning(monkeypatch):
    """Yields a function: bytes of the live storages the stand-in pinned allocator handed out."""
    live = weakref.WeakValueDictionary()  # id(storage) -> storage, for as long as it lives

    def allocator(real):
        def alloc(*args, pin_memory=False, **kwargs):
            t = real(*args, **kwargs)
            if pin_memory:
                live[id(t.untyped_storage())] = t.untyped_storage()
            return t
        return alloc

    def is_pinned(self, *args):
        s = self.untyped_storage()
        return live.get(id(s)) is s

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "empty", allocator(torch.empty))
    monkeypatch.setattr(torch, "zeros", allocator(torch.zeros))
    monkeypatch.setattr(torch.Tensor, "is_pinned", is_pinned)

    def allocated() -> int:
        gc.collect()
        return sum(s.nbytes() for s in list(live.values()))
    return allocated


def test_host_memory_allocates_ordinary_memory_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA host pins")
    h = HostMemory()
    t = h.zeros(1000, torch.float32)
    assert not t.is_pinned() and h.nbytes == 0 and bool((t == 0).all())


def test_host_memory_counts_the_pinned_storages_alive(fake_pinning):
    h = HostMemory()
    a = h.empty(4097, torch.bfloat16)
    b = h.zeros(17, torch.float32)
    c = h.empty(1000, torch.float32, pin=False)  # asked unpinned: ordinary memory, not counted
    assert a.is_pinned() and b.is_pinned() and not c.is_pinned()
    assert h.nbytes == fake_pinning() == 4097 * 2 + 17 * 4
    view = a[5:9]  # a view keeps the storage, so the bytes stay pinned
    del a
    assert h.nbytes == fake_pinning() == 4097 * 2 + 17 * 4
    del view, b
    assert h.nbytes == fake_pinning() == 0


class SyncSideStreams(HostTransfers):
    """HostTransfers (copies done on return, events None) that takes the side-stream paths of
    FlatParamManager: pinned ``host_part`` copies and the staging buffers of accumulation."""

    side_streams = True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_manager_counts_grad_acc_host_part_and_staging(fake_pinning, dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5)).to(dtype)  # 174 parameters
    before = fake_pinning()
    m = FlatParamManager([list(model.parameters())], stage=2, sub_group_size=33, reduce_bucket_size=30,
                         transfers=SyncSideStreams())
    x = torch.randn(4, 7, dtype=dtype)
    for _ in range(2):  # the second micro-batch lands through the two staging buffers
        model(x).square().mean().backward()
        m.reduce_gradients()
    for i in range(len(m.sub_group_specs())):
        m.param_target(i)  # allocates the pinned host copy of the slice
    n = 174
    want = 4 * n + dtype.itemsize * n + 2 * 4 * min(STAGING_NUMEL, n)  # grad_acc, host_part, staging
    assert m.host.nbytes == fake_pinning() - before == want


def test_engine_pinned_bytes_are_what_the_allocator_holds(fake_pinning):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))  # 174 parameters, fp32
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 2, "sub_group_size": 33,
                                 "offload_optimizer": {"device": "cpu", "pin_memory": True}},
           # the stand-in pinned allocator says CUDA is available, and the memory check would ask
           # this CPU build for the device's free memory
           "zeroinf": {"check_memory": False}}
    before = fake_pinning()
    engine, *_ = zeroinf.initialize(model, config=cfg)
    x, y = torch.randn(4, 7), torch.randn(4, 5)
    for _ in range(2):
        engine.backward(F.mse_loss(engine(x), y))
        engine.step()
    # grad_acc (4 B) and the CPU-resident exp_avg, exp_avg_sq (8 B); the master is the fp32 flat
    # parameter itself (CPU parameters: no host copy); the engine's stats counted no byte of it
    assert engine.stats()["pinned_bytes"] == fake_pinning() - before == 12 * 174
    engine.close()


def test_stage3_manager_counts_pinned_host_partitions(fake_pinning):
    from zeroinf.runtime.stage3 import Stage3Options, Stage3ParameterManager

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))  # 174 parameters
    before = fake_pinning()
    m = Stage3ParameterManager(model, Stage3Options(offload_param_device="cpu", pin_memory=True,
                                                    param_persistence_threshold=0), device="cpu")
    # every partition lives in pinned host memory; old counts saw the NVMe pool only (0 here)
    assert m.host.nbytes == fake_pinning() - before == 4 * 174
    m.close()


def test_host_memory_counts_its_pools_until_they_close():
    from zeroinf.io import pinned_pool_bytes

    h = HostMemory()
    a, b = h.pool(2, 5000), h.pool(1, 4096)
    tensors = h.nbytes - pinned_pool_bytes(2, 5000) - pinned_pool_bytes(1, 4096)
    assert a.pinned and b.pinned and tensors == 0
    a.close()
    assert h.nbytes == pinned_pool_bytes(1, 4096)
    b.close()
    assert h.nbytes == 0


@pytest.mark.parametrize("stage", [2, 3])
def test_one_engine_s_parts_share_one_allocator_that_stats_read(tmp_path, stage):
    """The engine's stage (its parameter manager) and its optimizer take their host buffers from
    the engine's one HostMemory, and stats()["pinned_bytes"] is that allocator's count: here the
    NVMe swap pools, locked on any host (torch pins no tensor without CUDA)."""
    from zeroinf.io import pinned_pool_bytes

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    zero = {"stage": stage, "sub_group_size": 100, "offload_optimizer": dict(nvme, buffer_count=4)}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0,
                    offload_param=dict(nvme, buffer_count=2, buffer_size=4096, max_in_cpu=0))
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": zero}
    engine, *_ = zeroinf.initialize(model, config=cfg)
    parts = [engine.params.manager if stage == 3 else engine.params, engine.sub_optimizer]
    assert all(p.host is engine.host for p in parts)
    pools = [engine.sub_optimizer._pool] + ([engine.params.manager._pool] if stage == 3 else [])
    locked = sum(pinned_pool_bytes(p.buffer_count, p.buffer_size) for p in pools)
    x, y = torch.randn(4, 7), torch.randn(4, 5)
    engine.backward(F.mse_loss(engine(x), y))
    engine.step()
    assert engine.stats()["pinned_bytes"] == engine.host.nbytes
    if not torch.cuda.is_available():
        assert engine.host.nbytes == locked > 0
    engine.close()
    if not torch.cuda.is_available():  # the pools are closed; the parts' tensors pin nothing
        assert engine.host.nbytes == 0


def test_a_pool_buffer_held_past_close_stays_readable_and_writable():
    """``PinnedBufferPool.close()`` unlocks the buffers and drops the pool's own references; a
    buffer the caller still holds stays valid. The CPU pool's mapping was unmapped under it and
    the next write crashed the process (a subprocess here, so a crash fails this test)."""
    import subprocess
    import sys
    code = ("import torch\nfrom zeroinf.io import PinnedBufferPool\n"
            "p = PinnedBufferPool(3, 1 << 20)\nb = p.acquire()\nb.fill_(7)\np.close()\n"
            "b[: 1 << 19].fill_(9)\nprint(int(b.sum()))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.split()[-1] == str(9 * (1 << 19) + 7 * (1 << 19))


def test_pool_replace_leaves_the_old_buffer_to_its_reader_and_frees_a_new_one():
    from zeroinf.io import PinnedBufferPool
    with PinnedBufferPool(2, 8192) as p:
        a = p.acquire()
        a.fill_(5)
        kept = a[100:200]
        old = {b.data_ptr() for b in p.buffers()}
        p.replace(a)
        assert p.free_count() == 2
        new = [b for b in p.buffers() if b.data_ptr() not in old]
        assert len(new) == 1 and new[0].numel() == 8192 and new[0].data_ptr() % 4096 == 0
        got = [p.acquire(), p.acquire()]  # neither is the replaced buffer
        assert a.data_ptr() not in {b.data_ptr() for b in got}
        for b in got:
            b.fill_(1)
        assert torch.equal(kept, torch.full((100,), 5, dtype=torch.uint8))
        with pytest.raises(ValueError, match="does not start at one of this pool's buffers"):
            p.replace(a)
        p.release(got[0])
        with pytest.raises(ValueError, match="is free"):
            p.replace(got[0])


def test_pool_acquire_leaving_takes_all_or_nothing_and_keeps_the_margin():
    from zeroinf.io.pool import PinnedBufferPool
    with PinnedBufferPool(5, 4096) as p:
        assert p.acquire_leaving(4, keep_free=2) is None and p.free_count() == 5  # nothing taken
        two = p.acquire_leaving(2, keep_free=3)
        assert len(two) == 2 and p.free_count() == 3
        assert len({b.data_ptr() for b in two}) == 2
        assert p.acquire_leaving(1, keep_free=3) is None and p.free_count() == 3
        for b in two:
            p.release(b)
        with pytest.raises(ValueError, match="count"):
            p.acquire_leaving(0, keep_free=0)


def test_pool_acquire_leaving_keeps_the_margin_between_threads():
    """Two threads taking buffers under margins (the read-ahead and the optimizer's staged
    write-backs) never leave fewer free buffers than the larger margin asked."""
    import threading
    from zeroinf.io.pool import PinnedBufferPool
    with PinnedBufferPool(8, 4096) as p:
        lowest = [8]
        lock = threading.Lock()

        def worker(count, keep):
            for _ in range(3000):
                got = p.acquire_leaving(count, keep_free=keep)
                if got is not None:
                    with lock:
                        lowest[0] = min(lowest[0], p.free_count())
                    for b in got:
                        p.release(b)
        threads = [threading.Thread(target=worker, args=(3, 2)), threading.Thread(target=worker, args=(1, 3)),
                   threading.Thread(target=worker, args=(2, 2))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert lowest[0] >= 2 and p.free_count() == 8
