"""The engine's optimizer-update phases (``zeroinf.runtime.step_state``): every transition from
every phase, and an engine with ``optimizer_in_backward`` going through them."""
from __future__ import annotations

import pytest
import torch

from zeroinf.runtime.step_state import StepPhase, StepState

P = StepPhase
# transition -> {from: to}; a phase not listed raises
MOVES = {
    "start_in_background": {P.IDLE: P.RUNNING},
    "start_in_backward": {P.IDLE: P.IN_BACKWARD},
    "joined": {P.RUNNING: P.IDLE, P.IN_BACKWARD: P.JOINED_UNCOUNTED},
    "counted": {P.IN_BACKWARD: P.RUNNING, P.JOINED_UNCOUNTED: P.IDLE},
    "abandoned": {P.IN_BACKWARD: P.RUNNING, P.JOINED_UNCOUNTED: P.IDLE},
}


@pytest.mark.parametrize("move", sorted(MOVES))
@pytest.mark.parametrize("start", list(StepPhase))
def test_every_transition_from_every_phase(move, start):
    s = StepState()
    s.phase = start
    if start in MOVES[move]:
        getattr(s, move)()
        assert s.phase is MOVES[move][start]
    else:
        with pytest.raises(RuntimeError, match=start.value):
            getattr(s, move)()
        assert s.phase is start  # a refused move changes nothing


def test_questions_the_engine_asks():
    expect = {P.IDLE: (False, False), P.RUNNING: (True, False), P.IN_BACKWARD: (True, True),
              P.JOINED_UNCOUNTED: (False, True)}
    for phase, (in_flight, uncounted) in expect.items():
        s = StepState()
        s.phase = phase
        assert (s.in_flight, s.uncounted) == (in_flight, uncounted), phase


def test_an_engine_stepping_in_the_backward_walks_the_phases(tmp_path):
    import zeroinf

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "zeroinf": {"optimizer_in_backward": True}}
    engine, *_ = zeroinf.initialize(model=model, config=cfg)
    try:
        assert engine._step.phase is P.IDLE
        engine.backward(engine(torch.randn(2, 8)).sum())
        assert engine._step.uncounted
        with pytest.raises(RuntimeError, match="between engine.backward"):
            engine.save_checkpoint(str(tmp_path))
        engine.step()
        assert not engine._step.uncounted
        engine.synchronize()
        assert engine._step.phase is P.IDLE
        assert engine.optimizer_steps == 1
    finally:
        engine.close()


def _tiny_stage3(tmp_path, in_backward: bool):
    """A TinyLM engine at stage 3, parameters and optimizer on the CPU."""
    import zeroinf
    from stage3_engine_helpers import _config
    from stage3_models import TinyLM

    torch.manual_seed(0)
    cfg = _config("cpu", "cpu", tmp_path)
    cfg["zeroinf"] = {"optimizer_in_backward": in_backward}
    return zeroinf.initialize(model=TinyLM(), config=cfg)[0]


def _loss(engine, seed):
    from stage3_models import batch, loss_fn

    x, y = batch(seed)
    return loss_fn(engine(x), y)


@pytest.mark.parametrize("in_backward", [False, True])
@pytest.mark.parametrize("block", [0, 3])  # the first block (the backward's last unit) and the last
def test_close_inside_a_backward_hook_is_named_in_the_error(tmp_path, block, in_backward):
    engine = _tiny_stage3(tmp_path, in_backward)
    try:
        def hook(mod, grad_in, grad_out):
            try:
                engine.close()
            except Exception:  # with the optimizer in backward, close may report the aborted update
                pass

        engine.module.blocks[block].register_full_backward_hook(hook)
        with pytest.raises(RuntimeError, match=r"engine.close\(\) was called during this engine.backward"):
            engine.backward(_loss(engine, 1))
    finally:
        try:
            engine.close()
        except Exception:
            pass


@pytest.mark.parametrize("in_backward", [False, True])
def test_a_failed_update_is_named_by_every_later_call(tmp_path, in_backward):
    from zeroinf.runtime.stage3.overlap import StepFailedError

    engine = _tiny_stage3(tmp_path, in_backward)
    step, calls = engine.sub_optimizer.step, [0]

    def failing(*a, **k):
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(5, "injected EIO")
        return step(*a, **k)

    engine.sub_optimizer.step = failing
    messages = []
    for s in range(3):
        try:
            engine.backward(_loss(engine, s))
            engine.step()
        except Exception as exc:
            messages.append(exc)
    try:
        engine.close()
    except Exception as exc:
        messages.append(exc)
    assert len(messages) >= 2, messages
    for exc in messages:
        assert isinstance(exc, StepFailedError), repr(exc)
        assert "OSError: [Errno 5] injected EIO" in str(exc), str(exc)
