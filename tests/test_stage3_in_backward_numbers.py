"""Stage 3's optimizer step run inside the backward (``"zeroinf": {"optimizer_in_backward": true}``,
[Note: optimizer in backward] in zeroinf/runtime/stage3/in_backward.py): the same numbers as the
synchronous step and as torch.optim.AdamW: a warm-up LR schedule and a tied head, weights edited
in hooks, a block left out of a forward, the global norm with two param groups, and the warning
for a non-finite gradient."""
import copy
import time
import warnings

import pytest
import torch

import zeroinf
from stage3_models import TinyLM, batch, loss_fn
from stage3_engine_helpers import _assert_like_reference, _config, _reference, _run, _state
from stage3_in_backward_helpers import _engine


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
