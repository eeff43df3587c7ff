"""Shared by the checkpoint tests (test_checkpoint_*.py): a small stage-1 engine, a stage-3 engine
with parameters and optimizer on NVMe, a few steps of it, and everything a load changes."""
import torch

import zeroinf


def _small_engine(nvme=None, **zero):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 1, "sub_group_size": 50, **zero}}
    return zeroinf.initialize(model, config=cfg)[0], model


def _stage3_nvme_engine(nvme):
    import copy

    from stage3_models import TinyLM
    from stage3_engine_helpers import _config
    engine, *_ = zeroinf.initialize(model=copy.deepcopy(TinyLM()), config=_config("nvme", "nvme", nvme))
    return engine


def _train(engine, steps, seed=0):
    from stage3_models import batch, loss_fn
    for k in range(steps):
        x, y = batch(seed + k)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    engine.synchronize()


def _engine_state(engine):
    """Everything a load changes: module state (gathered), every sub-group's optimizer state, counters."""
    opt = engine.sub_optimizer
    module = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    optim = []
    for i in range(len(opt.specs)):
        with opt.state(i) as tensors:
            optim.append([t.clone() for t in tensors])
    return module, optim, (engine.global_steps, engine.optimizer_steps)
