"""Shared by the stage-3 engine tests: configs per tier, a plain-PyTorch AdamW reference, a few
steps and the comparison, a resume beside a straight run."""
import copy

import torch

import zeroinf
from stage3_models import batch, loss_fn

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.01


def _config(param_tier, opt_tier, nvme, **zero):
    z = {"stage": 3, "stage3_param_persistence_threshold": 20, "sub_group_size": 1500,
         "offload_param": {"device": param_tier}, "offload_optimizer": {"device": opt_tier}}
    if param_tier == "nvme":
        z["offload_param"].update(nvme_path=str(nvme), buffer_count=2, buffer_size=4096, max_in_cpu=0)
    if opt_tier == "nvme":
        z["offload_optimizer"].update(nvme_path=str(nvme), buffer_count=4)
    z.update(zero)
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}},
            "zero_optimization": z}


def _config_at(stage, param_tier, nvme):
    """``_config(param_tier, "cpu", nvme)`` at stage 3; stages 0-2 with the optimizer on the CPU."""
    if stage == 3:
        return _config(param_tier, "cpu", nvme)
    cfg = _config("none", "cpu", nvme)
    cfg["zero_optimization"] = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    return cfg

def _reference(ref, steps, params=None, lr_at=None):
    """Losses of ``steps`` steps of plain PyTorch + AdamW on ``ref`` (``params``: its param
    groups, default all parameters in one; ``lr_at(step)``: the lr of each 1-based step, default
    LR)."""
    params = ref.parameters() if params is None else params
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    losses = []
    for step in range(1, steps + 1):
        if lr_at is not None:
            for grp in opt.param_groups:
                grp["lr"] = lr_at(step)
        x, y = batch(step)
        loss = loss_fn(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _run(engine, steps, start=1):
    losses = []
    for step in range(start, start + steps):
        x, y = batch(step)
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _state(engine):
    return {k: v.clone() for k, v in engine.module.state_dict().items()}


def _assert_like_reference(engine, ref, got, want):
    """Losses ``got`` within 1e-6 of ``want`` relative to the loss (a loss of 10.8 is 1 fp32 ulp
    from 1e-6 absolute: an AVX-512 host's matmuls differed by 2 ulp there), and every parameter
    of the engine's model within 1e-6 of ``ref``'s; returns the engine's state dict."""
    assert max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(got, want)) <= 1e-6, (got, want)
    sd = _state(engine)
    for name, p in ref.named_parameters():
        err = (sd[name] - p.detach()).abs().max().item()
        assert err <= 1e-6, f"{name}: {err}"
    return sd


TIERS = ["none", "cpu", "nvme"]


def _train_beside_adamw(engine, ref, loss_of, steps=3):
    """``steps`` steps of ``engine`` and of plain ``ref`` + torch AdamW on ``loss_of(model,
    step)``: no parameter live after each step, every parameter within 1e-6 at the end."""
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    for step in range(steps):
        engine.backward(loss_of(engine, step))
        engine.step()
        loss_of(ref, step).backward()
        opt.step()
        opt.zero_grad()
        assert engine.params.manager._live == 0
    sd = _state(engine)
    for name, p in ref.named_parameters():
        assert (sd[name] - p.detach()).abs().max().item() <= 1e-6, name


def _resume_beside_straight(base, cfg, cfg_resumed, ckpt):
    """Train a copy of ``base`` 5 steps under ``cfg``; train another 3, save to ``ckpt`` (tag
    "s3"), load that into a fresh engine under ``cfg_resumed`` and train it 2 more: assert it
    resumed at step 3 and ends bit for bit where the straight run did. Returns the resumed
    engine (open) and the straight run's final state."""
    straight, *_ = zeroinf.initialize(model=copy.deepcopy(base), config=cfg)
    _run(straight, 5)
    want = _state(straight)
    straight.close()
    first, *_ = zeroinf.initialize(model=copy.deepcopy(base), config=cfg)
    _run(first, 3)
    first.save_checkpoint(str(ckpt), tag="s3")
    first.close()
    torch.manual_seed(123)
    resumed, *_ = zeroinf.initialize(model=type(base)(), config=cfg_resumed)
    resumed.load_checkpoint(str(ckpt), tag="s3")
    assert resumed.optimizer_steps == 3
    _run(resumed, 2, start=4)
    got = _state(resumed)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    return resumed, want
