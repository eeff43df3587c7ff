"""``import zeroinf as deepspeed`` carries a DeepSpeed training script (written as DeepSpeed's
tutorials write it), checked against plain PyTorch + torch.optim.AdamW; and
``engine.offload_states()`` / ``reload_states()`` bring every byte back."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import zeroinf
from stage3_models import TinyLM, batch, loss_fn

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.01
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SCRIPT = textwrap.dedent('''
    import argparse, json, sys
    import torch
    import zeroinf as deepspeed
    sys.path.insert(0, {here!r})
    from stage3_models import TinyLM, batch, loss_fn

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    deepspeed.init_distributed()
    deepspeed.init_distributed()  # a second call is a no-op

    torch.manual_seed(1)
    source = TinyLM()
    with deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config):
        torch.manual_seed(0)
        model = TinyLM()
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        with torch.no_grad():
            for p, q in zip(model.parameters(), source.parameters()):
                p.copy_(q)
    model_engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model,
                                                         model_parameters=model.parameters())
    out = dict(losses=[], lrs=[], norms=[], applied=[], module_is_model=model_engine.module is model,
               stage=model_engine.config["zero_optimization"]["stage"], loss_scale=model_engine.loss_scale,
               world=torch.distributed.get_world_size())

    def train(step):
        x, y = batch(step)
        loss = loss_fn(model_engine(x), y)
        model_engine.backward(loss)
        model_engine.step()
        model_engine.zero_grad()
        out["losses"].append(loss.item())
        out["lrs"].append(model_engine.get_lr()[0])
        out["norms"].append(model_engine.get_global_grad_norm())
        out["applied"].append(model_engine.was_step_applied())

    for step in range(1, 4):
        train(step)
    model_engine.save_checkpoint(args.ckpt, tag="step3", client_state={{"epoch": 7}})
    for step in range(4, 6):
        train(step)
    path, client = model_engine.load_checkpoint(args.ckpt, tag="step3")
    out["load_path"], out["client_state"] = path, client
    for step in range(4, 6):
        train(step)
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        out["head"] = model.head.weight.detach().flatten()[:8].tolist()
    json.dump(out, open(args.out, "w"))
''')


def _reference(steps, seed=1):
    torch.manual_seed(seed)
    ref = TinyLM()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    losses, norms = [], []
    for step in range(1, steps + 1):
        x, y = batch(step)
        loss = loss_fn(ref(x), y)
        loss.backward()
        norms.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()])).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, ref


def _config(stage=3, **zero):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}},
            "zero_optimization": {"stage": stage, **zero}}


def test_a_deepspeed_tutorial_script_runs_with_import_zeroinf_as_deepspeed(tmp_path):
    cfg = tmp_path / "ds_config.json"
    cfg.write_text(json.dumps(_config(3, stage3_param_persistence_threshold=20, offload_optimizer={"device": "cpu"})))
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(here=HERE))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    res = subprocess.run([sys.executable, str(script), "--deepspeed", "--deepspeed_config", str(cfg),
                          "--out", str(tmp_path / "out.json"), "--ckpt", str(tmp_path / "ckpt")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    losses, norms, ref = _reference(5)
    assert out["world"] == 1 and out["stage"] == 3 and out["module_is_model"] and out["loss_scale"] == 1.0
    # the GatheredParameters(modifier_rank=0) copy of seed 1's weights was kept: the reference is seed 1
    assert out["losses"][:5] == pytest.approx(losses, abs=1e-5)
    assert out["norms"][:5] == pytest.approx(norms, rel=1e-4)
    assert out["lrs"] == [LR] * 7 and out["applied"] == [True] * 7
    # load_checkpoint(tag) returns (path, client_state) and steps 4-5 repeat exactly
    assert out["load_path"].endswith("step3") and out["client_state"]["epoch"] == 7
    assert out["losses"][5:] == out["losses"][3:5]
    assert out["head"] == pytest.approx(ref.head.weight.detach().flatten()[:8].tolist(), abs=1e-5)


def test_initialize_takes_config_params_and_refuses_two_configs(tmp_path):
    torch.manual_seed(1)
    engine, *_ = zeroinf.initialize(model=TinyLM(), config_params=_config(2))
    try:
        assert engine.config["zero_optimization"] == {"stage": 2}
        assert engine.config.get("train_micro_batch_size_per_gpu") == 2 and "optimizer" in engine.config
        assert engine.config.to_dict()["optimizer"]["params"]["lr"] == LR
    finally:
        engine.close()
    path = tmp_path / "c.json"
    path.write_text(json.dumps(_config(2)))

    class Args:
        deepspeed_config = str(path)
    with pytest.raises(ValueError, match="both in args.deepspeed_config"):
        zeroinf.initialize(args=Args(), model=TinyLM(), config=_config(2))
    with pytest.raises(ValueError, match="no config"):
        zeroinf.initialize(model=TinyLM())


def test_init_distributed_makes_a_one_process_group_and_is_a_no_op_after(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert not dist.is_initialized()
    zeroinf.init_distributed(dist_backend="gloo")
    try:
        group = dist.group.WORLD
        zeroinf.init_distributed()
        assert dist.group.WORLD is group and dist.get_world_size() == 1 and dist.get_rank() == 0
    finally:
        dist.destroy_process_group()
    with pytest.raises(RuntimeError, match="dist_init_required=False"):
        zeroinf.init_distributed(dist_init_required=False)


def _engine(cfg):
    torch.manual_seed(1)
    engine, *_ = zeroinf.initialize(model=TinyLM(), config=cfg)
    return engine


def _state(engine):
    """Every weight and every fp32 master / Adam moment, as copies."""
    out = [t.detach().clone() for t in engine.module_state_dict().values()]
    for i in range(len(engine.sub_optimizer.specs)):
        with engine.sub_optimizer.state(i) as ts:
            out += [t.clone() for t in ts]
    return out


@pytest.mark.parametrize("case", ["stage2-cpu", "stage3-cpu-nvme"])
def test_offload_states_and_reload_states_bring_every_byte_back(tmp_path, case):
    if case == "stage2-cpu":
        cfg = _config(2, offload_optimizer={"device": "cpu"})
    else:
        cfg = _config(3, stage3_param_persistence_threshold=20, sub_group_size=1500,
                      offload_param={"device": "cpu"},
                      offload_optimizer={"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 4})
    a, b = _engine(cfg), _engine(cfg)
    try:
        def step(e, i):
            x, y = batch(i)
            loss = loss_fn(e(x), y)
            e.backward(loss)
            e.step()
            return loss.item()
        for i in range(1, 4):
            assert step(a, i) == step(b, i)
        before = _state(a)
        moved = a.offload_states()
        n_params = sum(p.numel() for p in b.module_state_dict().values())
        # at least the fp32 parameters (stage 2: the flat buffers the masters alias; stage 3: the
        # host partitions) and, at stage 2, both Adam moments
        assert moved >= 4 * n_params * (3 if case == "stage2-cpu" else 1)
        if case == "stage2-cpu":
            assert all(p.untyped_storage().nbytes() == 0 for p in a.module.parameters())
        else:  # the optimizer state is on NVMe: the file is written beside it
            assert [f for f in os.listdir(tmp_path) if f.startswith("zeroinf-offloaded-states-")]
        with pytest.raises(RuntimeError, match="offloaded"):
            a(batch(4)[0])
        with pytest.raises(RuntimeError, match="states are offloaded"):
            a.offload_states()
        for call in (lambda: a.save_checkpoint(str(tmp_path / "ck")), lambda: a.step(),
                     lambda: a.load_checkpoint(str(tmp_path / "ck")), lambda: a.module.state_dict()):
            with pytest.raises(RuntimeError, match="offloaded"):
                call()
        a.reload_states()
        after = _state(a)
        assert len(after) == len(before) and all(torch.equal(x, y) for x, y in zip(before, after))
        assert all(torch.equal(x, y) for x, y in zip(after, _state(b)))
        for i in range(4, 7):  # later steps are those of the engine that never offloaded, bit for bit
            assert step(a, i) == step(b, i)
        with pytest.raises(RuntimeError, match="nothing is offloaded"):
            a.reload_states()
    finally:
        a.close()
        b.close()
