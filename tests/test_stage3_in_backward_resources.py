"""Stage 3's optimizer step run inside the backward (``"zeroinf": {"optimizer_in_backward": true}``,
[Note: optimizer in backward] in zeroinf/runtime/stage3/in_backward.py): what it reads, writes,
holds and runs on: the next backward's optimizer reads started in the forward, gradients never
stored and the counters equal to the bytes moved, copies of units held from the forward instead
of master reads, at most MAX_WAITING gradients waiting in host memory, Adam on half the threads
beside a CPU backward; the numbers stay torch.optim.AdamW's."""
import copy
import threading
import time

import pytest
import torch

import zeroinf
from stage3_models import TinyLM, batch, loss_fn
from stage3_engine_helpers import _assert_like_reference, _config, _reference, _run
from stage3_in_backward_helpers import _engine, _in_thread


def _spy_masters(monkeypatch, mgr):
    """Lists that fill with the flat-group keys whose optimizer master was read from the tier
    (``read_param_raw``) or handed over as a copy (``partition_copy``)."""
    raw_reads, copies = [], []
    read_param_raw, partition_copy = mgr.read_param_raw, mgr.partition_copy

    def copy_of(g):
        t = partition_copy(g)
        if t is not None:
            copies.append(g.key)
        return t
    monkeypatch.setattr(mgr, "read_param_raw", lambda g, t: (raw_reads.append(g.key), read_param_raw(g, t))[1])
    monkeypatch.setattr(mgr, "partition_copy", copy_of)
    return raw_reads, copies


def test_the_next_backwards_first_optimizer_reads_start_halfway_through_the_forward(tmp_path, monkeypatch):
    """[Note: optimizer reads in the forward] from the second step on, the first groups'
    moments for the next backward are read once half the units' forwards ran, without waiting
    for the last step's swap-out, and the step uses them; a checkpoint load between steps drops
    such reads (their state is replaced). The numbers stay torch.optim.AdamW's."""
    ref = TinyLM(tied=True)
    swaps = {"device": "nvme", "nvme_path": str(tmp_path / "nv"), "buffer_count": 4, "pipeline_read": True,
             "pipeline_write": True}
    engine = _engine(tmp_path / "nv", copy.deepcopy(ref), True, zero={"offload_optimizer": swaps})
    opt, mgr = engine.sub_optimizer, engine.params.manager
    seen, prefetch = [], opt.prefetch

    def spy(indices=None, *, block=True):
        prefetch(indices, block=block)
        if not block:
            seen.append((mgr._fwd_units_done, list(opt._ahead), opt._tail))
    monkeypatch.setattr(opt, "prefetch", spy)
    got = _run(engine, 2)
    assert [(n, bool(ahead)) for n, ahead, _ in seen] == [(len(mgr.units) // 2, True)]
    assert all(tail not in ahead for _, ahead, tail in seen)  # the file being written is not read
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="t")
    x, y = batch(9)
    engine(x)  # under grad, no backward: it reads ahead again
    assert len(seen) == 2 and opt._ahead
    engine.load_checkpoint(str(tmp_path / "ckpt"), tag="t")
    assert not opt._ahead  # dropped: the load rewrote the state they were read from
    with pytest.warns(RuntimeWarning, match="differs from the recorded trace"):  # that forward had no backward
        got += _run(engine, 2, start=3)
    _assert_like_reference(engine, ref, got, _reference(ref, 4))
    engine.close()


@pytest.mark.parametrize("in_backward,loop_cap", [(True, None), (True, 2), (False, None)])
def test_the_worker_beside_a_cpu_backward_runs_adam_on_half_its_threads(tmp_path, monkeypatch, in_backward, loop_cap):
    """[Note: worker threads] the optimizer in backward caps its OpenMP threads at half the
    count of the thread running the backward (the process's, or the loop thread's own cap:
    helper-47 t03); the overlapped step, whose update is longer than the forward it hides
    behind, keeps them all, and so does the compute thread. Bit-equality with the synchronous
    step, which runs Adam on every thread, is test_equals_the_synchronous_step_and_adamw's."""
    import zeroinf.optim as zo

    seen, adam_step = set(), zo.adam_step

    def spy(*a, **k):
        seen.add((threading.current_thread().name, torch.get_num_threads()))
        return adam_step(*a, **k)

    def train():
        if loop_cap is not None:
            assert zo.limit_thread_parallelism(loop_cap) == loop_cap
        cfg = _config("nvme", "nvme", tmp_path, sub_group_size=700)
        cfg["zeroinf"] = {"optimizer_in_backward": in_backward, "overlap_step": True}
        engine, *_ = zeroinf.initialize(model=TinyLM(), config=cfg)
        for step in range(2):
            x, y = batch(step)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        engine.synchronize()
        engine.close()

    monkeypatch.setattr(zo, "adam_step", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        _in_thread(train)
        if in_backward:
            assert seen == {("zeroinf-optimizer-in-backward", 2 if loop_cap is None else 1)}
        else:
            assert seen == {("zeroinf-optimizer-step", 4)}
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)


def test_gradients_never_reach_nvme_and_the_counters_equal_the_bytes_moved(tmp_path, monkeypatch):
    """Parameters and optimizer state on NVMe (where gradients would go to swap files too): no
    gradient partition is stored, in a swap file or in memory, and the engine's counters over
    the run equal what the swappers were handed."""
    from zeroinf.io import TensorSwapper

    moved = {"read": 0, "write": 0, "grad": 0}
    swap_in, swap_out = TensorSwapper.swap_in, TensorSwapper.swap_out

    def spy(kind, fn):
        def wrapped(self, items, *a, **k):
            items = list(items)
            moved[kind] += sum(t.numel() * t.element_size() for _key, t in items)
            moved["grad"] += sum(1 for key, _t in items if key.startswith("grad/"))
            return fn(self, items, *a, **k)
        return wrapped

    monkeypatch.setattr(TensorSwapper, "swap_in", spy("read", swap_in))
    monkeypatch.setattr(TensorSwapper, "swap_out", spy("write", swap_out))
    engine = _engine(tmp_path, copy.deepcopy(TinyLM()), True)
    mgr = engine.params.manager
    raw_reads, copies = _spy_masters(monkeypatch, mgr)
    assert not mgr.options.grads_on_nvme
    assert not [f for *_, f in zeroinf.runtime.stage3.engine_glue.swap_file_bytes(
        engine.module, engine.config, [list(engine.module.parameters())]) if "gradient" in f]
    base = dict(moved)
    opt_bytes = [0, 0]
    for step in range(4):
        x, y = batch(step)
        engine.backward(loss_fn(engine(x), y))
        assert all(g.grad_shard is None and not g.grad_on_nvme for g in mgr.groups())
        engine.step()
        engine.synchronize()
        st = engine.stats()
        opt_bytes[0] += st["nvme_read_bytes"]
        opt_bytes[1] += st["nvme_write_bytes"]
    opt_bytes[0] += engine._step_stats["nvme_read_bytes"]  # the last step's, added by its synchronize()
    opt_bytes[1] += engine._step_stats["nvme_write_bytes"]
    totals = mgr.stats.totals
    assert moved["grad"] == 0
    assert totals["bytes_nvme_read"] + opt_bytes[0] == moved["read"] - base["read"] > 0
    assert totals["bytes_nvme_written"] + opt_bytes[1] == moved["write"] - base["write"] > 0
    # every step read and wrote each trainable partition's Adam moments (8 bytes/element) once;
    # the fp32 partition is the master ([Note: master in the partitions]), copied at the
    # hand-over from units gathered for the backward, read for those a forward requested since their gather
    trainable = {g.key: g for g, *_ in engine.params._subs}
    part = sum(g.shard_numel for g in trainable.values())
    assert opt_bytes[1] == 4 * 8 * part
    assert opt_bytes[0] == 4 * 8 * part
    # (here from the second step on every unit stays gathered from its forward: the default
    # prefetch bucket spans TinyLM, so only the first step copies)
    assert sorted(copies + raw_reads) == sorted(4 * list(trainable)) and copies, (copies, raw_reads)
    engine.close()


def test_units_held_from_the_forward_hand_over_a_copy_and_a_write_before_the_backward_drops_it(tmp_path, monkeypatch):
    """[Note: snapshots of held units] A unit the forward gathered and the backward found still
    gathered had its master read from NVMe at the hand-over, when the disk is busiest. From the
    second step on, such units keep a copy from their forward read: no master is read, and the
    steps equal AdamW's. A value written into the partition between the forward and the
    backward (``gathered_parameters`` with ``modifier_rank``) makes that copy stale: it is
    dropped (through ``gathered_parameters`` that backward then raises, as plain PyTorch does for
    a saved weight changed in place: test_gathered_parameters_between_a_forward_and_its_backward)."""
    ref = TinyLM()
    model = copy.deepcopy(ref)
    engine = _engine(tmp_path, model, True)
    mgr = engine.params.manager
    raw_reads, copies = _spy_masters(monkeypatch, mgr)
    persistent = sorted(g.key for u in mgr.units if u.persistent for g in u.groups)  # small: always read
    trainable = sorted({g.key for g, *_ in engine.params._subs} - set(persistent))
    got = []
    for step in (1, 2, 3):
        raw_reads.clear()
        copies.clear()
        got += _run(engine, 1, start=step)
        engine.synchronize()
        # step 1 records the trace and reads every unit again for the backward; from step 2 on
        # every unit stays gathered from its forward (the default bucket spans TinyLM), which
        # step 3's forward reads know
        assert sorted(raw_reads) == (persistent if step != 2 else sorted(persistent + trainable)), raw_reads
        assert sorted(copies) == (trainable if step != 2 else []), copies
    _assert_like_reference(engine, ref, got, _reference(ref, 3))
    loss = loss_fn(engine(batch(4)[0]), batch(4)[1])
    u = mgr.units[-1]
    g = u.groups[0]
    assert not u.persistent and g.partition_snapshot is not None  # held, with its copy
    mgr.write_group_values(g, [(s, g.full[s.offset:s.offset + s.numel] + 1.0) for s in g.slots])
    assert g.partition_snapshot is None and mgr.partition_copy(g) is None
    del loss
    engine.close()


def test_backpressure_bounds_the_gradients_waiting_in_host_memory(tmp_path):
    """With the update slower than the backward (NVMe-bound Adam, here a slowed store), at
    most MAX_WAITING reduced partitions wait for the worker; the backward waits beyond that.
    (Unbounded, 13 of 14 waited at once: host memory held nearly the whole gradient.)"""
    from zeroinf.runtime.stage3 import in_backward

    model = TinyLM(n=8)
    engine = _engine(tmp_path, model, True)
    store, peak = engine.params.store_stepped, []

    def slow_store(g, target):
        time.sleep(0.02)
        store(g, target)
    engine.params.store_stepped = slow_store
    hand_over = in_backward.BackwardStep.__call__

    def spy(self, *a, **k):
        hand_over(self, *a, **k)
        peak.append(self._waiting)
    in_backward.BackwardStep.__call__ = spy
    try:
        _run(engine, 3)
    finally:
        in_backward.BackwardStep.__call__ = hand_over
    assert len(engine.params._bwd_order) > in_backward.MAX_WAITING + 3
    assert max(peak) == in_backward.MAX_WAITING
    engine.close()
