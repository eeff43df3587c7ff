"""A NaN gradient in any flat group, not only the first, is caught by the inf norm: the engine's
norm is NaN, as ``torch.nn.utils.clip_grad_norm_(..., norm_type=inf)`` gives, and the step is
skipped (fp16) or not applied with NaN (fp32), at stages 0, 2 and 3."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zeroinf

D, V = 16, 23


class NanGrad(torch.autograd.Function):
    """x + 0*s forward; NaN gradient for s only."""
    @staticmethod
    def forward(ctx, x, s):
        return x + 0 * s

    @staticmethod
    def backward(ctx, g):
        return g, torch.full_like(g[0, 0], float("nan"))


class Block(nn.Module):
    def __init__(self, bad):
        super().__init__()
        self.a, self.b, self.s, self.bad = nn.Linear(D, 2 * D), nn.Linear(2 * D, D), nn.Parameter(torch.zeros(D)), bad

    def forward(self, x):
        x = x + self.b(torch.tanh(self.a(x)))
        return NanGrad.apply(x, self.s) if self.bad else x + 0 * self.s


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block(i == 2) for i in range(3))
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def run(stage, precision):
    torch.manual_seed(0)
    model = Model()
    ref = Model()
    ref.load_state_dict(model.state_dict())
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}},
           "zeroinf": {"grad_norm_type": "inf"}}
    if stage == 3:
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, offload_param={"device": "cpu"})
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 4}
    params = None
    if stage < 3:  # two param groups: two flat groups, the NaN in the second
        params = [{"params": [p for n, p in model.named_parameters() if "blocks.2" not in n]},
                  {"params": [p for n, p in model.named_parameters() if "blocks.2" in n], "weight_decay": 0.0}]
    engine, *_ = zeroinf.initialize(model=model, model_parameters=params, config=cfg)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, V, (4, 6), generator=g), torch.randint(0, V, (4, 6), generator=g)
    engine.backward(F.cross_entropy(engine(x).flatten(0, 1), y.flatten()))
    engine.step()
    F.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
    torch_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0, norm_type="inf"))
    nan_params = [k for k, v in engine.module.state_dict().items() if torch.isnan(v.float()).any()]
    out = (engine.get_global_grad_norm(), torch_norm, engine.was_step_applied(), nan_params)
    engine.close()
    return out


@pytest.mark.parametrize("stage,precision", [(3, "fp32"), (3, "fp16"), (2, "fp16"), (0, "fp32")])
def test_nan_gradient_in_a_later_group_is_not_applied_with_the_inf_norm(stage, precision):
    norm, torch_norm, applied, nan_params = run(stage, precision)
    assert math.isnan(torch_norm)
    assert not math.isfinite(norm), f"engine inf-norm {norm}, torch's {torch_norm}"
    assert not applied and not nan_params, f"step applied={applied}, NaN weights: {nan_params}"
