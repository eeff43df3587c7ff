"""Shared by the stage 0-2 engine tests (test_engine_*.py, and test_engine_dist.py, test_flat_cuda.py,
test_swap_faults.py, test_async_comm.py): a small MLP, its batches, a config per stage and offload
device, the plain-PyTorch + torch.optim.AdamW (foreach=False) reference, a few engine steps, and
the largest parameter difference."""
import torch
import torch.nn.functional as F
from torch import nn


LR, WD = 1e-2, 0.01


def make_mlp(seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))


def batches(n: int, bs: int = 4, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, bs, 7, generator=g), torch.randn(n, bs, 5, generator=g)


def config(stage: int = 0, device: str = "none", nvme=None, gas: int = 1, **extra) -> dict:
    off = {"device": device}
    if device == "nvme":
        off.update(nvme_path=str(nvme), pipeline_read=True, pipeline_write=True, buffer_count=3)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
           # small sub-groups and buckets so every path splits (33 and 30 divide none of the sizes)
           "zero_optimization": {"stage": stage, "sub_group_size": 33, "reduce_bucket_size": 30, "allgather_bucket_size": 22,
                                 "offload_optimizer": off}}
    cfg.update(extra)
    return cfg


def reference(model, X, Y, steps, gas=1, clip=0.0, norm_type=2.0, lrs=None):
    """Plain PyTorch: mean of the micro-batch gradients, optional clip, torch AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=False)
    norms, grads = [], []
    for s in range(steps):
        if lrs is not None:
            opt.param_groups[0]["lr"] = lrs[s]
        opt.zero_grad()
        for k in range(gas):
            (F.mse_loss(model(X[s * gas + k]), Y[s * gas + k]) / gas).backward()
        grads.append(torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()]))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else 1e30, norm_type)))
        opt.step()
    return norms, grads


def train(engine, X, Y, steps, gas=1):
    losses = []
    for s in range(steps):
        for k in range(gas):
            loss = F.mse_loss(engine(X[s * gas + k]), Y[s * gas + k])
            engine.backward(loss)
            engine.step()
        losses.append(float(loss.detach()))
    return losses


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p.float() - q.float()).abs().max().item() for p, q in zip(a.parameters(), b.parameters()) if p.numel())
