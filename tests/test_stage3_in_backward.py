"""Stage 3's optimizer step run inside the backward (``"zeroinf": {"optimizer_in_backward": true}``,
[Note: optimizer in backward] in zeroinf/runtime/stage3/in_backward.py): the same numbers as the
synchronous step and as torch.optim.AdamW, gradients never stored, and the cases it cannot follow
refused with errors that say why."""
import copy
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch

import zeroinf
from stage3_models import TinyLM, batch, loss_fn
from stage3_engine_helpers import _assert_like_reference, _config, _reference, _run, _state
from zeroinf.config import ConfigError, parse_config
from zeroinf.runtime.stage3.in_backward import OptimizerInBackwardError
from zeroinf.runtime.stage3.overlap import StepFailedError


def _engine(path, model, in_backward, tiers=("nvme", "nvme"), zero=None, **extra):
    path.mkdir(exist_ok=True)
    cfg = _config(*tiers, path, sub_group_size=700, **(zero or {}))  # several sub-groups per flat group
    cfg["zeroinf"] = {"optimizer_in_backward": in_backward, "overlap_step": in_backward}
    cfg.update(extra)
    engine, *_ = zeroinf.initialize(model=model, config=cfg)
    return engine


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


def _in_thread(fn, timeout=120):
    """Run ``fn`` on a thread of its own; re-raise its error, fail if it has not returned in
    ``timeout`` seconds (a hang)."""
    out = {}

    def run():
        try:
            fn()
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn.__name__} still running after {timeout} s"
    if "error" in out:
        raise out["error"]


def test_a_worker_failing_before_its_first_update_fails_the_step_instead_of_hanging(tmp_path, monkeypatch):
    """The worker's first call (its thread cap) raised outside the code that reports a failure
    to the step gate: the thread died and the backward waited for it forever (helper-47 t04)."""
    import zeroinf.runtime.stage3.in_backward as ib

    def fail(n):
        raise RuntimeError("injected cap failure")

    monkeypatch.setattr(ib, "limit_thread_parallelism", fail)
    engine = _engine(tmp_path, TinyLM(), True, ("none", "none"))
    x, y = batch(0)

    def train():
        with pytest.raises(StepFailedError) as info:
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        assert "injected cap failure" in repr(info.value.__cause__) + str(info.value)

    _in_thread(train)
    with pytest.raises(StepFailedError):
        engine.close()


@pytest.mark.parametrize("key,value,says", [
    ("stage", 2, "needs zero_optimization.stage 3, got 2"),
    ("gradient_accumulation_steps", 2, "needs gradient_accumulation_steps 1, got 2"),
    ("gradient_clipping", 1.0, "cannot clip"),
    ("fp16", {"enabled": True}, "fp16 is enabled"),
])
def test_config_refuses_what_needs_every_gradient_first(key, value, says):
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
           "zeroinf": {"optimizer_in_backward": True}}
    if key == "stage":
        cfg["zero_optimization"]["stage"] = value
    else:
        cfg[key] = value
    with pytest.raises(ConfigError) as info:
        parse_config(cfg)
    assert info.value.key_path == "zeroinf.optimizer_in_backward" and says in str(info.value)
    cfg["zeroinf"]["optimizer_in_backward"] = False
    parse_config(cfg)  # the same config is fine without it
    assert parse_config({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                         "zeroinf": {"optimizer_in_backward": True}}).zeroinf.optimizer_in_backward


@pytest.mark.parametrize("tiers", [("nvme", "nvme"), ("cpu", "nvme"), ("nvme", "cpu"), ("none", "none")])
def test_equals_the_synchronous_step_and_adamw(tmp_path, tiers):
    """Four steps with a warm-up LR schedule (the step number and LR are read when the backward
    starts) and a head tied to the embedding, against the synchronous step (bit for bit: the
    same Adam on the same gradients) and torch.optim.AdamW (1e-6). Each partition write of the
    background step sleeps, so the next forward reaches groups whose update is not stored yet
    and must wait for them."""
    sched = {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                          "warmup_num_steps": 3, "warmup_type": "linear"}}}
    ref = TinyLM(tied=True)
    sync = _engine(tmp_path / "a", copy.deepcopy(ref), False, tiers, **sched)
    ib = _engine(tmp_path / "b", copy.deepcopy(ref), True, tiers, **sched)
    m = ib.params.manager
    write, stepped_during_backward = ib.params.store_stepped, []

    def slow_store(g, target):
        stepped_during_backward.append(m._in_backward)
        time.sleep(0.01)
        write(g, target)
    ib.params.store_stepped = slow_store
    a, b = _run(sync, 4), _run(ib, 4)
    assert a == b, (a, b)
    assert sync.get_global_grad_norm() == ib.get_global_grad_norm() > 0
    assert sync.get_lr() == ib.get_lr()
    sa, sb = _state(sync), _state(ib)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(stepped_during_backward)  # groups were updated while the backward still ran
    # the reference with the same schedule, linear warm-up: step k (from 1) runs at iteration k - 2
    # (DeepSpeed's convention: iteration -1, the warm-up's start, for the first step)
    plain = copy.deepcopy(ref)
    want = _reference(plain, 4, lr_at=lambda step: 1e-2 * min(1.0, max(0, step - 2) / 3))
    _assert_like_reference(ib, plain, b, want)
    sync.close()
    ib.close()


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


@pytest.mark.parametrize("bucket", [0, 10**6])
@pytest.mark.parametrize("hook", ["forward", "backward"])
@pytest.mark.parametrize("edit", ["in_place", "data"])
def test_edits_of_gathered_weights_in_hooks_agree_with_the_synchronous_step(tmp_path, edit, hook, bucket):
    """A forward or backward pre-hook that scales a weight in place (under no_grad, or through
    ``.data``): a forward's edit is kept in both step modes ([Note: changes in a forward]); a
    backward pre-hook's ``.data`` edit is not seen in either. The optimizer in backward takes
    NVMe masters from copies of the partitions ([Note: master in the partitions]); it took them
    from the gathered buffers once, and the edits stuck in that mode alone (head weight mean 0.03 instead of 0.12 after 3 steps with a forward hook, 0.125
    off after one step with a backward hook: both found by testers). The head, the last block and
    the first block are touched, with and without prefetch; the runs must be bit-equal. An
    in-place edit in a backward pre-hook changes a weight its backward saved: plain PyTorch
    raises there, and so does stage 3 in both step modes."""
    ref = TinyLM()
    states = {}

    def halve(module, *args):
        with torch.no_grad():
            (module.weight if edit == "in_place" else module.weight.data).mul_(0.5)

    def add_hooks(model):
        for mod in (model.head, model.blocks[-1].ff[0], model.blocks[0].ff[0]):
            if hook == "forward":
                mod.register_forward_pre_hook(halve)
            else:
                mod.register_full_backward_pre_hook(halve)
    raises = hook == "backward" and edit == "in_place"
    if raises:  # the reference
        plain = copy.deepcopy(ref)
        add_hooks(plain)
        x, y = batch(0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss_fn(plain(x), y).backward()
    for ib in (False, True):
        model = copy.deepcopy(ref)
        add_hooks(model)
        engine = _engine(tmp_path / str(ib), model, ib, zero={"stage3_prefetch_bucket_size": bucket})
        if raises:
            with pytest.raises(RuntimeError, match="modified by an inplace operation: parameter head.weight"):
                _run(engine, 1)
            engine.close()
            continue
        _run(engine, 3)
        engine.synchronize()
        states[ib] = _state(engine)
        engine.close()
    if raises:
        return
    assert all(torch.equal(states[False][k], states[True][k]) for k in states[False]), \
        max((states[False][k] - states[True][k]).abs().max().item() for k in states[False])


def test_an_unused_block_is_stepped_with_zeros_as_in_the_synchronous_step(tmp_path):
    """Block 1 runs in no forward of steps 2 and 3: its groups get no gradient and are
    stepped with zeros (weight decay and the moments move them), as the synchronous step does."""
    ref = TinyLM()
    engines = [_engine(tmp_path / n, copy.deepcopy(ref), ib) for n, ib in (("a", False), ("b", True))]
    after_one = []
    for e in engines:
        _run(e, 1)
        after_one.append(_state(e)["blocks.1.ff.0.weight"])
        e.module.order = [0, 2, 3]
        with pytest.warns(RuntimeWarning, match="differs from the recorded trace"):
            _run(e, 2, start=2)
    sa, sb = (_state(e) for e in engines)
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sb["blocks.1.ff.0.weight"], _state_of(ref)["blocks.1.ff.0.weight"])
    # and it was stepped in steps 2-3, though it ran in neither (zeros: decay and moments move it)
    assert not torch.equal(sb["blocks.1.ff.0.weight"], after_one[1])
    for e in engines:
        e.close()


def _state_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_backward_and_step_must_alternate(tmp_path):
    engine = _engine(tmp_path, TinyLM(), True, ("none", "cpu"))
    with pytest.raises(RuntimeError, match="needs an engine.backward"):
        engine.step()
    x, y = batch(1)
    engine.backward(loss_fn(engine(x), y))
    with pytest.raises(RuntimeError, match="called twice without"):
        engine.backward(loss_fn(engine(x), y))
    engine.step()  # the first backward's step is whole
    _run(engine, 1, start=2)
    assert engine.global_steps == 2
    engine.close()


class _FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ValueError("injected backward failure")


def test_a_failed_backward_fails_the_step_and_every_later_call(tmp_path):
    """The backward raises after the later blocks' groups were handed over (some may be
    stepped): the error reaches the caller, and the engine refuses to go on from weights that
    are part old, part new."""
    model = TinyLM()
    model.blocks[0].register_forward_hook(lambda mod, args, out: _FailBackward.apply(out))
    engine = _engine(tmp_path, model, True)
    x, y = batch(1)
    with pytest.raises(ValueError, match="injected backward failure"):
        engine.backward(loss_fn(engine(x), y))
    with pytest.raises(StepFailedError) as info:
        engine.backward(loss_fn(engine(x), y))
    assert "the backward failed" in str(info.value.__cause__)
    for _ in range(2):  # every later wait raises it again, the step that would close it too
        with pytest.raises(StepFailedError):
            engine.synchronize()
    with pytest.raises(StepFailedError):
        engine.step()
    with pytest.raises(StepFailedError):
        engine.close()  # releases everything, then reports the failure
    assert engine._closed and engine.sub_optimizer._swapper is None


class _DetachedRead(torch.nn.Module):
    """Reads block 3's first linear weight without a gradient, before block 3 runs: its
    backward needs that weight after block 3's backward completed the weight's gradient."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx):
        x = self.model.emb(idx)
        w = self.model.blocks[3].ff[0].weight
        x = x + 0.1 * torch.nn.functional.linear(x, w.detach())[..., :x.shape[-1]]
        for b in self.model.blocks:
            x = b(x)
        return self.model.head(self.model.norm(x))


def test_a_unit_needed_after_its_update_began_is_an_error(tmp_path):
    engine = _engine(tmp_path, _DetachedRead(TinyLM()), True, ("none", "cpu"))
    x, y = batch(1)
    with pytest.raises(OptimizerInBackwardError, match="needed again in the backward"):
        engine.backward(loss_fn(engine(x), y))
    with pytest.raises(StepFailedError):
        engine.close()


def test_a_checkpoint_between_backward_and_step_is_refused(tmp_path):
    """The backward has already applied the update while the step counter has not moved: such a
    checkpoint resumed to a run that applied that step twice (1.8e-2 off after one more step)."""
    engine = _engine(tmp_path / "swap", TinyLM(), True)
    _run(engine, 2)
    engine.save_checkpoint(str(tmp_path / "ck"), tag="two")
    x, y = batch(3)
    engine.backward(loss_fn(engine(x), y))
    for call in (lambda: engine.save_checkpoint(str(tmp_path / "ck"), tag="mid"),
                 lambda: engine.load_checkpoint(str(tmp_path / "ck"), tag="two")):
        with pytest.raises(RuntimeError, match="between engine.backward.. and engine.step"):
            call()
    assert not (tmp_path / "ck" / "mid").exists()
    engine.step()
    engine.save_checkpoint(str(tmp_path / "ck"), tag="three")
    assert engine.global_steps == 3
    engine.close()


def _script(tmp_path, body: str, timeout: int = 240) -> str:
    """Run ``body`` (after the imports every script here needs) in a fresh interpreter with a
    time limit, so that a hang fails the test instead of stopping the suite; returns stdout."""
    head = f"""
        import copy, sys, torch
        sys.path.insert(0, {str(__import__("pathlib").Path(__file__).parent)!r})
        import zeroinf
        from stage3_models import TinyLM, batch, loss_fn
        from stage3_engine_helpers import _config, _run, _state
        from zeroinf.runtime.stage3.overlap import StepFailedError
        def engine(path, model, in_backward=True):
            import os
            os.makedirs(path, exist_ok=True)
            cfg = _config("nvme", "nvme", path, sub_group_size=700)
            cfg["zeroinf"] = {{"optimizer_in_backward": in_backward}}
            return zeroinf.initialize(model=model, config=cfg)[0]
    """
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(head) + textwrap.dedent(body))
    try:
        proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=timeout,
                              cwd=str(tmp_path))
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the script hung ({timeout} s): {(e.stdout or '')[-2000:]}") from None
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


def test_waiting_for_the_update_inside_the_backward_raises_instead_of_hanging(tmp_path):
    """A signal handler or hook on the backward's thread that waits for the update (a save on
    preemption, engine.close()) waited forever: the update needs the rest of that backward."""
    out = _script(tmp_path, f"""
        e = engine({str(tmp_path / "a")!r}, TinyLM())
        _run(e, 1)
        seen = []
        def wait_inside(grad):
            for call in (e.synchronize, e.module.state_dict, e.step):
                try:
                    call()
                    seen.append("waited")
                except RuntimeError as err:
                    seen.append("inside engine.backward" in str(err))
            return grad
        x, y = batch(2)
        logits = e(x)
        logits.register_hook(wait_inside)
        e.backward(loss_fn(logits, y))
        e.step()
        _run(e, 1, start=3)  # the step went on
        print("SYNC", seen, e.global_steps)
        e2 = engine({str(tmp_path / "b")!r}, TinyLM())
        _run(e2, 1)
        def close_inside(grad):
            try:
                e2.close()
            except StepFailedError:
                seen.append("close reported the failed step")
            return grad
        logits = e2(x)
        logits.register_hook(close_inside)
        try:
            e2.backward(loss_fn(logits, y))
        except Exception as err:  # the backward goes on after the hook with everything released
            seen.append(type(err).__name__)
        print("CLOSE", seen[3:], e2._closed, e2.sub_optimizer._swapper is None)
    """)
    assert "SYNC [True, True, True] 3" in out, out
    # close released everything (nothing had been handed over yet: no failed step to report), and
    # the rest of the backward then met the closed engine
    assert "CLOSE ['RuntimeError'] True True" in out, out


@pytest.mark.parametrize("where,in_backward", [("loss.float", True), ("first backward node", True),
                                               ("inside block 3", True), ("inside block 3", False)])
def test_a_failure_before_any_gradient_leaves_the_engine_usable(tmp_path, where, in_backward):
    """The common skip-the-batch-on-OOM loop: a backward that fails before any gradient was
    reduced updated nothing, so the engine goes on, equal to a run that never saw that batch.
    (It used to fail every later call; failing between the update's start and autograd, it hung.
    Inside block 3 the head's and final norm's gradients exist but nothing was reduced: they were
    left in the flat gradient buffers and added into the next backward's, in both engines: all
    36 weights off by up to 6e-2 five steps later.)"""
    out = _script(tmp_path, f"""
        class BadFloat(torch.Tensor):
            def float(self):
                raise KeyboardInterrupt("interrupted before autograd")
        def oom(grad):
            raise RuntimeError("out of memory (injected)")
        ref = TinyLM()
        a = engine({str(tmp_path / "a")!r}, copy.deepcopy(ref), {in_backward!r})
        b = engine({str(tmp_path / "b")!r}, copy.deepcopy(ref), {in_backward!r})
        _run(a, 2); _run(b, 2)
        x, y = batch(99)
        try:
            if {where!r} == "loss.float":
                b.backward(loss_fn(b(x), y).as_subclass(BadFloat))
            elif {where!r} == "first backward node":
                logits = b(x)
                logits.register_hook(oom)
                b.backward(loss_fn(logits, y))
            else:
                h = b.module.blocks[3].register_forward_hook(lambda m, a, out: out.register_hook(oom) and None)
                logits = b(x)
                h.remove()
                b.backward(loss_fn(logits, y))
        except BaseException as err:
            print("FAILED", type(err).__name__)
        la, lb = _run(a, 5, start=3), _run(b, 5, start=3)
        sa, sb = _state(a), _state(b)
        print("EQUAL", la == lb, all(torch.equal(sa[k], sb[k]) for k in sa), a.global_steps, b.global_steps)
        a.close(); b.close()
    """)
    assert "FAILED" in out and "EQUAL True True 7 7" in out, out


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


def test_global_norm_with_param_groups_equals_the_synchronous_step(tmp_path):
    """The norm parts are summed in the synchronous step's order (they were summed in arrival
    order: with two param groups the last bit differed at steps 3 and 8; the tester's case)."""
    torch.manual_seed(0)
    ref = TinyLM()
    norms = []
    for name, ib in (("a", False), ("b", True)):
        model = copy.deepcopy(ref)
        groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1, "lr": 3e-3},
                  {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0, "lr": 2e-2}]
        path = tmp_path / name
        path.mkdir()
        cfg = _config("none", "cpu", path)
        cfg["zeroinf"] = {"optimizer_in_backward": ib}
        engine, *_ = zeroinf.initialize(model=model, model_parameters=groups, config=cfg)
        got = []
        for step in range(1, 9):
            _run(engine, 1, start=step)
            got.append(engine.get_global_grad_norm())
        norms.append((got, _state(engine)))
        engine.close()
    (na, sa), (nb, sb) = norms
    assert na == nb
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_non_finite_gradient_warns_at_the_callers_line(tmp_path):
    engine = _engine(tmp_path, TinyLM(), True, ("none", "cpu"))
    x, y = batch(1)
    engine.backward(loss_fn(engine(x), y) * float("nan"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.step()
    hits = [w for w in caught if "non" in str(w.message) or "nan" in str(w.message)]
    assert hits and hits[0].filename == __file__, [(w.filename, str(w.message)) for w in caught]
    assert engine.get_global_grad_norm() != engine.get_global_grad_norm()  # nan
    engine.close()


def test_an_interrupt_at_any_line_of_the_updates_start_neither_hangs_nor_corrupts(tmp_path):
    """Ctrl-C (KeyboardInterrupt, injected with sys.settrace) at each line of the path that
    starts the update: engine.backward, _start_backward_step, start_backward_step and
    BackwardStep.start. After each, training goes on (or every call reports the failed step)
    and close() returns: no worker is left waiting for gradients that never come (the
    tester's t45/t64: the process never exited). An interrupt after the backward was whole
    leaves the update applied and uncounted: the next backward says to call step() first."""
    out = _script(tmp_path, f"""
        import threading
        import zeroinf.runtime.engine as eng
        import zeroinf.runtime.stage3.engine_glue as glue
        import zeroinf.runtime.stage3.in_backward as ib
        funcs = [eng.ZeroEngine.backward, eng.ZeroEngine._start_backward_step,
                 glue.Stage3EngineParams.start_backward_step, ib.BackwardStep.start]
        results = []
        n = 0
        for fn in funcs:
            code = fn.__code__
            lines = sorted({{ln for _s, _e, ln in code.co_lines() if ln is not None and ln > code.co_firstlineno}})
            for line in lines:
                e = engine({str(tmp_path)!r} + f"/s{{n}}", TinyLM(), True)
                n += 1
                _run(e, 1)
                armed = [True]
                def local(frame, event, arg):
                    if event == "line" and frame.f_lineno == line and armed[0]:
                        armed[0] = False
                        raise KeyboardInterrupt
                    return local
                def tracer(frame, event, arg):
                    return local if frame.f_code is code else None
                sys.settrace(tracer)
                try:
                    x, y = batch(2)
                    e.backward(loss_fn(e(x), y))
                    e.step()
                except KeyboardInterrupt:
                    pass
                finally:
                    sys.settrace(None)
                try:
                    _run(e, 1, start=3)
                    res = "continues"
                except StepFailedError:
                    res = "failed"
                except RuntimeError as err:  # interrupted after the backward was whole: step() closes it
                    if "called twice" not in str(err):
                        raise
                    e.step()
                    _run(e, 1, start=3)
                    res = "stepped, continues"
                try:
                    e.close()
                except StepFailedError:
                    pass
                alive = [t.name for t in threading.enumerate() if t.name.startswith("zeroinf-optimizer")]
                results.append((fn.__name__, line, armed[0], res, alive))
        print("CASES", len(results))
        print("BAD", [r for r in results if r[4]])
        print("HIT", sum(not r[2] for r in results))
    """, timeout=400)
    assert "BAD []" in out, out
    cases = int(out.split("CASES ")[1].split()[0])
    hit = int(out.split("HIT ")[1].split()[0])
    assert cases > 30 and hit > 25, out


def test_an_interrupt_right_after_autograd_fails_the_step(tmp_path):
    """Every gradient was handed over and the worker may finish, but the step was not counted
    and the persistent unit not refreshed: it used to go on silently with stale persistent
    weights (and a checkpoint mixing steps); now every later call reports the failed step."""
    engine = _engine(tmp_path, TinyLM(), True)
    _run(engine, 2)
    end = engine.params.end_backward_step

    def interrupted():
        engine.params._worker.join(timeout=60)  # the worker got every group and finished them
        raise KeyboardInterrupt
    engine.params.end_backward_step = interrupted
    x, y = batch(3)
    with pytest.raises(KeyboardInterrupt):
        engine.backward(loss_fn(engine(x), y))
    engine.params.end_backward_step = end
    with pytest.raises(StepFailedError):
        engine.step()
    with pytest.raises(StepFailedError):
        engine.save_checkpoint(str(tmp_path / "ck"))
    with pytest.raises(StepFailedError):
        engine.close()
