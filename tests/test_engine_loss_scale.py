"""The stage 0-2 engine's fp16 dynamic loss scale: an inf gradient skips the step and lowers the
scale, the scale follows DeepSpeed's DynamicLossScaler, and an overflow at the minimum scale raises
in step() without losing the gradients or the accumulation windows."""
import math

import pytest
import torch
import torch.nn.functional as F

import zeroinf
from engine_helpers import batches, config, make_mlp, train


def test_fp16_inf_gradient_skips_step_and_lowers_scale(tmp_path):
    X, Y = batches(3)
    model = make_mlp()
    cfg = config(2, "nvme", tmp_path, fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})
    engine, *_ = zeroinf.initialize(model, config=cfg)
    train(engine, X.half(), Y.half(), 1)
    assert engine.loss_scale == 256.0 and engine.optimizer_steps == 1
    before = [p.detach().clone() for p in model.parameters()]
    with engine.sub_optimizer.state(0) as (master, m, v):
        state_before = (master.clone(), m.clone(), v.clone())
    bad = X[1].half().clone()
    bad[0, 0] = float("inf")
    engine.backward(F.mse_loss(engine(bad), Y[1].half()))
    engine.step()
    assert engine.skipped_steps == 1 and engine.optimizer_steps == 1 and engine.global_steps == 2
    assert engine.loss_scale == 128.0
    assert not math.isfinite(engine.get_global_grad_norm())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with engine.sub_optimizer.state(0) as state_after:
        assert all(torch.equal(a, b) for a, b in zip(state_before, state_after))
    train(engine, X[2:].half(), Y[2:].half(), 1)  # the next clean step runs, from a clean buffer
    assert engine.optimizer_steps == 2 and math.isfinite(engine.get_global_grad_norm())
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    engine.close()


# The loss scale after each boundary of an overflow pattern (1 = overflow), recorded from
# DeepSpeed 0.19.8's DynamicLossScaler.update_scale (fp16, these arguments).
_DS_SCALES = [
    (dict(initial_scale_power=4, loss_scale_window=3, min_loss_scale=1, hysteresis=1), [0] * 8,
     [16, 16, 16, 32, 32, 32, 64, 64]),
    (dict(initial_scale_power=4, loss_scale_window=3, min_loss_scale=1, hysteresis=1), [1] + [0] * 7,
     [8, 8, 8, 8, 16, 16, 16, 32]),
    (dict(initial_scale_power=4, loss_scale_window=2, min_loss_scale=1, hysteresis=2), [1, 1, 0, 0, 0, 0, 0],
     [16, 8, 8, 8, 16, 16, 32]),
    # DeepSpeed raises at the third overflow: "Current loss scale already at minimum"
    (dict(initial_scale_power=4, loss_scale_window=100, min_loss_scale=4, hysteresis=1), [1] * 6, [8, 4, "raise"]),
]


@pytest.mark.parametrize("case", range(len(_DS_SCALES)))
def test_dynamic_loss_scale_follows_deepspeed(case):
    from zeroinf.runtime.loss_scaler import LossScaler
    kw, pattern, want = _DS_SCALES[case]
    s = LossScaler(**kw)
    got = []
    for overflow in pattern:
        try:
            s.update(bool(overflow))
        except FloatingPointError as e:
            assert "min_loss_scale (4)" in str(e)
            got.append("raise")
            break
        got.append(s.scale)
    assert got == want


def test_overflow_at_the_minimum_loss_scale_raises_in_step_and_drops_the_gradients():
    model = make_mlp()
    fp16 = {"enabled": True, "initial_scale_power": 1, "min_loss_scale": 1, "hysteresis": 1}
    engine, *_ = zeroinf.initialize(model.half(), config=config(0, "none", fp16=fp16))
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.full((4, 7), float("inf"), dtype=torch.half)
    engine.backward(engine(x).float().sum())
    engine.step()  # 2 -> 1
    assert engine.loss_scale == 1.0 and engine.skipped_steps == 1
    engine.backward(engine(x).float().sum())
    with pytest.raises(FloatingPointError, match="min_loss_scale"):
        engine.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # a retry of the same micro-batch's step is refused: it took an Adam step on zero gradients
    with pytest.raises(RuntimeError, match="again after it raised .FloatingPointError"):
        engine.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and engine.optimizer_steps == 0
    X, Y = batches(1)
    engine.backward(F.mse_loss(engine(X[0].half()).float(), Y[0]))  # the inf gradients are gone
    engine.step()
    assert engine.was_step_applied() and engine.optimizer_steps == 1
    engine.close()


def test_going_on_after_the_minimum_loss_scale_error_keeps_the_accumulation_windows():
    """The window that raised is skipped and counted: the next window is whole (it was shifted
    by one micro-batch, 0.03 off: helper-38, /tmp/tester22/t07_fp16_min_scale.py)."""
    X, Y = batches(2)
    inf = torch.full((4, 7), float("inf"), dtype=torch.half)
    fp16 = {"enabled": True, "initial_scale_power": 1, "min_loss_scale": 1, "hysteresis": 1}
    ran = []
    for windows in (["inf", "inf", "clean"], ["inf", "clean"]):
        model = make_mlp().half()
        engine, *_ = zeroinf.initialize(model, config=config(2, "cpu", gas=2, fp16=fp16))
        for w in windows:
            for k in range(2):
                x = inf if w == "inf" else X[k].half()
                engine.backward(F.mse_loss(engine(x).float(), Y[k]))
                try:
                    engine.step()
                except FloatingPointError:
                    assert w == "inf" and k == 1
        ran.append((engine.global_steps, engine.skipped_steps, engine.micro_steps, engine.optimizer_steps))
        ran.append([p.detach().clone() for p in model.parameters()])
        engine.close()
    assert ran[0] == (3, 2, 6, 1) and ran[2] == (2, 1, 4, 1)
    assert all(torch.equal(a, b) for a, b in zip(ran[1], ran[3]))
