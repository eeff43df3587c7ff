"""The engine's optimizer-update phases (``zeroinf.runtime.step_state``): every transition from
every phase, and an engine with ``optimizer_in_backward`` going through them."""
from __future__ import annotations

import pytest

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
    torch = pytest.importorskip("torch")
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
