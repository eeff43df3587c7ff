"""Stage 3 with NVMe partitions: a parameter read outside its unit's forward (a foreign gather)
is saved for backward; in backward the unit is prefetched (its NVMe read in flight on the I/O
thread) when the saved tensor is unpacked. The unpack must wait for the read, not use the
half-filled buffer. ``ZEROINF_STAGE3_IO_DELAY_S`` delays every background read so the race
happens on every run instead of only on a loaded machine."""
import os
import sys

import pytest
import torch
import torch.nn as nn

import zeroinf


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.l(x))


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x * self.blocks[2].l.bias  # foreign read of a block's parameter


def _make():
    torch.manual_seed(0)
    return _Model()


def test_foreign_saved_param_waits_for_inflight_prefetch(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROINF_STAGE3_IO_DELAY_S", "0.02")
    x = torch.randn(4, 16)
    steps = 4
    ref = _make()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    want = []
    for _ in range(steps):
        loss = (ref(x) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    off = {"device": "nvme", "nvme_path": str(tmp_path)}
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "offload_param": off, "offload_optimizer": {"device": "cpu"},
                                 "stage3_param_persistence_threshold": 0}}
    eng, *_ = zeroinf.initialize(model=_make(), config=cfg)
    got = []
    for _ in range(steps):
        loss = (eng(x) ** 2).mean()
        eng.backward(loss)
        eng.step()
        got.append(loss.item())
    assert max(abs(a - b) for a, b in zip(want, got)) < 1e-6, (want, got)


def test_failed_read_ahead_is_raised_not_used(tmp_path):
    """A read-ahead into a staging buffer that fails (EIO from the swap file) must surface as an
    error at the gather that would use it; the half-filled buffer is never copied into the
    parameters. It used to be copied silently: the next step trained on garbage (NaN here)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    from stage3_step import LM  # blocks large enough for the read-ahead to run

    w = 256
    z = {"stage": 3, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 24 * w * w,
         "offload_param": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 6,
                           "buffer_size": 9 * w * w, "max_in_cpu": 0},
         "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 3,
                               "pipeline_read": True, "pipeline_write": True}}
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": z}
    torch.manual_seed(0)
    engine, *_ = zeroinf.initialize(model=LM(6, w), config=cfg)
    m = engine.params.manager
    x = torch.randint(0, 256, (2, 16))
    read, failed = m._stage_read, []

    def broken(unit, st):
        read(unit, st)
        for v in st.views:  # what a torn read might leave behind
            v.fill_(float("nan"))
        failed.append(unit.name)
        raise OSError(5, "injected read-ahead error")

    def step():
        loss = nn.functional.cross_entropy(engine(x).flatten(0, 1), x.flatten())
        engine.backward(loss)
        engine.step()
        return loss.item()

    first = step()
    assert torch.isfinite(torch.tensor(first))
    m._stage_read = broken
    try:
        with pytest.raises(OSError, match="injected read-ahead error"):
            for _ in range(3):
                loss = step()
                assert torch.isfinite(torch.tensor(loss)), "a failed read-ahead was used as parameters"
    finally:
        m._stage_read = read
    assert failed, "no read-ahead ran: the test did not exercise the staged path"


def test_a_failed_read_ahead_gives_its_staging_buffers_back_to_the_pool(tmp_path):
    """On one CPU rank a read-ahead's staging buffers become the unit's gathered buffers as the
    unit is issued, before the read is known to have failed. The gather that meets the failure
    releases the unit, which hands them back to the pool: the unit, stuck on its error, held one
    pool buffer for good, and every later read-ahead and read on demand had one fewer."""
    from stage3_models import TinyLM, batch, loss_fn
    from zeroinf.runtime.stage3 import Stage3Options, Stage3ParameterManager
    model = TinyLM()
    mgr = Stage3ParameterManager(model, Stage3Options(
        param_persistence_threshold=20, offload_param_device="nvme", nvme_path=str(tmp_path), buffer_count=4,
        buffer_size=4096, max_in_cpu=0, prefetch_bucket_size=2200, max_reuse_distance=0, max_live_parameters=6000))
    for seed in range(2):  # the second iteration reads ahead along the recorded trace
        x, y = batch(seed)
        loss_fn(model(x), y).backward()
    read, failed = mgr._stage_read, []

    def broken(unit, st):
        read(unit, st)
        failed.append(unit)
        raise OSError(5, "injected read-ahead error")
    mgr._stage_read = broken
    x, y = batch(2)
    with pytest.raises(OSError, match="injected read-ahead error"):
        loss_fn(model(x), y).backward()
    mgr._stage_read = read
    assert failed
    try:
        mgr.drop_staged()  # frees every staged buffer, then raises a failed read-ahead's error
    except OSError:
        pass
    for u in failed:
        assert not any(g.full_in_pool for g in u.groups)
    held = sum(g.full_in_pool for u in mgr.units for g in u.groups if u.state.value != "released")
    assert mgr._pool.free_count() + held == 4


def test_a_unit_whose_read_failed_reads_again_at_its_next_gather(tmp_path):
    """A read that fails (here a transient EIO of a read-ahead) raises at the gather that needed
    it, and the unit goes back to released: the next iteration reads it afresh and trains on.
    The unit stayed FETCHING with its error, so every later forward raised it again, for good."""
    import copy
    from stage3_models import TinyLM, batch, loss_fn
    from zeroinf.runtime.stage3 import Stage3Options, Stage3ParameterManager
    from zeroinf.runtime.stage3.units import UnitState
    ref = TinyLM()
    model = copy.deepcopy(ref)
    mgr = Stage3ParameterManager(model, Stage3Options(
        param_persistence_threshold=20, offload_param_device="nvme", nvme_path=str(tmp_path), buffer_count=4,
        buffer_size=4096, max_in_cpu=0, prefetch_bucket_size=2200, max_reuse_distance=0, max_live_parameters=6000))
    for seed in range(2):
        x, y = batch(seed)
        loss_fn(model(x), y).backward()
        loss_fn(ref(x), y).backward()
    read, failed = mgr._stage_read, []

    def once(unit, st):
        read(unit, st)
        if not failed:
            failed.append(unit)
            raise OSError(5, "injected transient read error")
    mgr._stage_read = once
    with pytest.raises(OSError, match="injected transient read error"):
        x, y = batch(2)
        loss_fn(model(x), y).backward()
    assert failed and failed[0].state is UnitState.RELEASED
    mgr._stage_read = read
    try:
        mgr.drop_staged()
    except OSError:
        pass
    for seed in (3, 4):
        x, y = batch(seed)
        loss_fn(model(x), y).backward()
        loss_fn(ref(x), y).backward()
    for g in mgr.groups():  # gradients of iterations 0, 1, 3 and 4 on both sides
        for sl in g.slots:
            want = dict(ref.named_parameters())[sl.name].grad
            got = g.grad_shard[sl.offset:sl.offset + sl.numel].view(sl.shape)
            assert torch.allclose(got, want, atol=1e-6, rtol=0), sl.name
    mgr.close()
