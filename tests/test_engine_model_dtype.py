"""A bf16 model under an fp32 config (no "bf16" section): the parameters stay bf16 and the
optimizer steps an fp32 master of each, as DeepSpeed's ZeRO optimizers do."""
import pytest
import torch
from torch import nn

import zeroinf


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)).to(torch.bfloat16)


@pytest.mark.parametrize("stage,offload", [(0, "none"), (1, "none"), (1, "cpu"), (2, "none"), (2, "cpu")])
def test_bf16_model_fp32_config_steps_an_fp32_master(stage, offload):
    model, ref = _model(), _model()
    master = [p.detach().float().clone().requires_grad_(True) for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.01)
    cfg = {"train_micro_batch_size_per_gpu": 4,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage, "offload_optimizer": {"device": offload}}}
    eng, _, _, _ = zeroinf.initialize(model=model, config=cfg)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).bfloat16()
        loss = eng(x).float().pow(2).mean()
        eng.backward(loss)
        eng.step()
        ref_loss = ref(x).float().pow(2).mean()
        ref.zero_grad()
        ref_loss.backward()
        for m, p in zip(master, ref.parameters()):
            m.grad = p.grad.float()
        ref_opt.step()
        with torch.no_grad():
            for m, p in zip(master, ref.parameters()):
                p.copy_(m)
        assert loss.item() == ref_loss.item()
    for p, r in zip(eng.module.parameters(), ref.parameters()):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(p, r, rtol=0, atol=0)
