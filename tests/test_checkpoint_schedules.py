"""The LR scheduler state in a checkpoint: one that does not fit is refused before anything loads;
a run resumes without its torch scheduler, and into another DeepSpeed schedule."""
import math

import pytest
import torch

import zeroinf
from zeroinf.checkpoint import CheckpointError


def _build_with_scheduler(scheduler, lr_scheduler=None):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 1, "sub_group_size": 50}}
    if scheduler is not None:
        cfg["scheduler"] = scheduler
    return zeroinf.initialize(model, config=cfg, lr_scheduler=lr_scheduler)[0]


def _saved_after_3_steps(path, tag, scheduler, lr_scheduler=None):
    """An engine of :func:`_build_with_scheduler` after 3 steps on one batch, saved as ``tag``
    in ``path``; returns (engine, the batch)."""
    x = torch.randn(4, 7)
    a = _build_with_scheduler(scheduler, lr_scheduler)
    for _ in range(3):
        a.backward(a(x).square().mean())
        a.step()
    a.save_checkpoint(str(path), tag)
    return a, x


def test_a_scheduler_state_that_does_not_fit_is_refused_before_anything_loads(tmp_path):
    """A scheduler state the engine's schedule cannot read (a WarmupLR state in a WarmupCosineLR
    engine raised KeyError 'org_lrs' after the weights had changed, found by a tester; here a
    state without the position) is a CheckpointError, and nothing changed."""
    _a, x = _saved_after_3_steps(tmp_path, "w", {"type": "WarmupLR", "params": {"warmup_num_steps": 5}})
    meta_file = tmp_path / "w" / "model_states.pt"
    meta = torch.load(meta_file, weights_only=True)
    meta["lr_scheduler"] = {"position": 2}
    torch.save(meta, meta_file)
    b = _build_with_scheduler({"type": "WarmupCosineLR", "params": {"total_num_steps": 20, "warmup_num_steps": 5}})
    b.backward(b(x).square().mean())
    b.step()
    weights = [p.detach().clone() for p in b.module.parameters()]
    sched, lrs = b.lr_scheduler.state_dict(), [g["lr"] for g in b.optimizer.param_groups]
    with pytest.raises(CheckpointError, match="model_states.pt: the LR scheduler state does not fit"):
        b.load_checkpoint(str(tmp_path))
    assert all(torch.equal(p, w) for p, w in zip(b.module.parameters(), weights))
    assert b.lr_scheduler.state_dict() == sched and [g["lr"] for g in b.optimizer.param_groups] == lrs
    assert b.global_steps == 1


def test_a_run_resumed_without_its_torch_scheduler(tmp_path):
    """A torch LR scheduler (given to initialize) writes ``initial_lr`` into the param groups; a
    run resumed without it (a constant lr, or a scheduler made after the load) was refused
    ("hyper-parameters this optimizer does not: ['initial_lr']"). It loads."""
    a, _x = _saved_after_3_steps(tmp_path, "t", None, lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5))
    weights = [p.detach().clone() for p in a.module.parameters()]
    b = _build_with_scheduler(None)
    b.load_checkpoint(str(tmp_path))
    assert b.global_steps == 3 and all(torch.equal(p, w) for p, w in zip(b.module.parameters(), weights))
    assert b.optimizer.param_groups[0]["initial_lr"] == 1e-2


def test_a_run_resumed_with_another_deepspeed_schedule(tmp_path):
    """Saved under WarmupLR, loaded into a WarmupCosineLR engine: refused (no 'org_lrs' in the
    state, tester-43 F5), while DeepSpeed's cosine schedule reads only the position. It now
    takes the position and keeps its own base lr (the optimizer's at initialize): 1e-2 x the
    cosine ratio at step 3 of 5 warm-up steps."""
    a, x = _saved_after_3_steps(tmp_path, "w", {"type": "WarmupLR", "params": {"warmup_num_steps": 5}})
    b = _build_with_scheduler({"type": "WarmupCosineLR", "params": {"total_num_steps": 20, "warmup_num_steps": 5,
                                                                   "warmup_min_ratio": 0.0}})
    b.load_checkpoint(str(tmp_path))
    assert b.lr_scheduler.last_batch_iteration == a.lr_scheduler.last_batch_iteration == 2
    assert b.lr_scheduler.org_lrs == [1e-2]
    b.backward(b(x).square().mean())
    b.step()  # position 3 of 5 warm-up steps, log warm-up as DeepSpeed's: log(4) / log(5)
    assert b.get_lr() == pytest.approx([1e-2 * math.log(4) / math.log(5)], rel=1e-12)
