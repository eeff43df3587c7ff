"""LR schedules of the stage 0-2 engine: a config scheduler and a client torch scheduler against
plain PyTorch, and DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR against the lrs DeepSpeed's
own engine gives."""
import pytest
import torch

import zeroinf
from engine_helpers import LR, WD, batches, config, make_mlp, max_diff, reference, train


def test_config_scheduler_and_client_optimizer_with_torch_scheduler():
    X, Y = batches(5)
    lrs = [0.0, 0.0, 0.0025, 0.005, 0.0075]  # WarmupLR, linear, 0 -> 1e-2 over 4 steps (as DeepSpeed)
    ref = make_mlp()
    reference(ref, X, Y, 5, lrs=lrs)
    model = make_mlp()
    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4,
                                            "warmup_type": "linear"}}
    engine, _, _, s = zeroinf.initialize(model, config=config(1, "cpu", scheduler=sched))
    seen = []
    for k in range(5):
        seen.append(engine.get_lr()[0])
        train(engine, X[k:k + 1], Y[k:k + 1], 1)
    assert seen == pytest.approx(lrs, abs=1e-12)
    assert max_diff(model, ref) <= 1e-6

    model = make_mlp()
    client = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    cfg = config(2, "cpu")
    del cfg["optimizer"]
    engine, opt, _, sched2 = zeroinf.initialize(model, optimizer=client, config=cfg,
                                                lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(
                                                    o, lambda t: lrs[min(t, 4)] / LR))
    assert opt is client
    train(engine, X, Y, 5)
    assert max_diff(model, ref) <= 1e-6
    with pytest.raises(RuntimeError, match="engine.step"):
        zeroinf.initialize(make_mlp(), config=config())[1].step()


# The lr before each of 12 optimizer steps, recorded from DeepSpeed 0.19.8's own engine (stage 0,
# CPU accelerator, AdamW at lr 1e-2; 6 steps at lr 3e-4 for the "no max" cases) on these configs.
_DS_SCHEDULES = {
    "WarmupLR log": ({"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2, "warmup_num_steps": 5}, 1e-2,
                     [0.0001, 0.0001, 0.004363697924926592, 0.006857801325411256, 0.008627395849853182] + [0.01] * 7),
    "WarmupLR linear": ({"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2, "warmup_num_steps": 5, "warmup_type": "linear"},
                        1e-2, [0.0001, 0.0001, 0.00208, 0.00406, 0.00604, 0.00802] + [0.01] * 6),
    "WarmupDecayLR": ({"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 3, "total_num_steps": 8,
                       "warmup_type": "linear"}, 1e-2,
                      [0.0, 0.0, 0.003333333333333333, 0.006666666666666666, 0.01, 0.008, 0.006, 0.004, 0.002, 0.0,
                       0.0, 0.0]),
    # past total_num_steps the cosine stays at cos_min_ratio
    "WarmupCosineLR": ({"warmup_min_ratio": 0.1, "warmup_num_steps": 3, "total_num_steps": 8, "cos_min_ratio": 0.01,
                        "warmup_type": "linear"}, 1e-2,
                       [0.0, 0.001, 0.004, 0.006999999999999999, 0.00905463412215599, 0.006579634122155989,
                        0.0035203658778440107, 0.0010453658778440105] + [0.0001] * 4),
    # no warmup_max_lr: WarmupLR warms up to the optimizer's lr, WarmupDecayLR to 1e-3
    "WarmupLR no max": ({"warmup_num_steps": 3, "warmup_type": "linear"}, 3e-4,
                        [0.0, 0.0, 9.999999999999999e-05, 0.00019999999999999998, 0.0003, 0.0003]),
    "WarmupDecayLR no max": ({"warmup_num_steps": 3, "total_num_steps": 10, "warmup_type": "linear"}, 3e-4,
                             [0.0, 0.0, 0.0003333333333333333, 0.0006666666666666666, 0.001, 0.0008571428571428571]),
}


@pytest.mark.parametrize("case", list(_DS_SCHEDULES))
def test_config_lr_schedules_equal_deepspeeds(case):
    params, lr, want = _DS_SCHEDULES[case]
    cfg = config(0, "none", optimizer={"type": "AdamW", "params": {"lr": lr}},
                 scheduler={"type": case.split()[0], "params": params})
    engine, opt, _, sched = zeroinf.initialize(make_mlp(), config=cfg)
    X, Y = batches(1)
    seen = []
    for _ in want:
        seen.append(opt.param_groups[0]["lr"])
        train(engine, X, Y, 1)
    assert seen == pytest.approx(want, rel=1e-12, abs=1e-15)
    # a resumed schedule goes on from its state
    again = zeroinf.initialize(make_mlp(), config=cfg)[3]
    again.load_state_dict(sched.state_dict())
    assert again.get_last_lr() == sched.get_last_lr()
    engine.close()
