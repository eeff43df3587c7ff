"""Weights changed between steps at stages 0-2 (load_state_dict, in-place ops under no_grad,
replaced ``p.data``, a checkpoint save and load) are stepped from, in fp32 and bf16, as
torch.optim.AdamW steps them."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeroinf
import zeroinf.checkpoint
from engine_helpers import LR, WD, batches, config, make_mlp, max_diff, train


@pytest.mark.parametrize("stage,device", [(0, "cpu"), (1, "cpu"), (2, "cpu"), (2, "nvme")])
def test_bf16_weights_changed_between_steps_are_stepped_from(tmp_path, stage, device):
    """In bf16 at stages 0-2 the next step put a weight changed between steps (load_state_dict,
    torch.nn.init under no_grad) back to the stale fp32 master (helper-35,
    /tmp/tester19/t20_engine_bf16_load.py: 0.0138 where 0.5 was loaded, lr 0). The changed
    elements are taken into the masters; the others keep their fp32 values."""
    model = make_mlp()
    cfg = config(stage=stage, device=device, nvme=tmp_path, bf16={"enabled": True})
    cfg["optimizer"]["params"].update(lr=0.0, weight_decay=0.0)  # a step leaves every weight as it is
    engine, *_ = zeroinf.initialize(model=model, config=cfg)
    X, Y = (t.to(torch.bfloat16) for t in batches(3))
    train(engine, X, Y, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict({**before, "0.weight": torch.full_like(before["0.weight"], 0.5)})
    with torch.no_grad():
        torch.nn.init.constant_(model[2].bias, -0.25)
    train(engine, X[1:], Y[1:], 2)
    after = model.state_dict()
    assert torch.equal(after["0.weight"], torch.full_like(after["0.weight"], 0.5))
    assert torch.equal(after["2.bias"], torch.full_like(after["2.bias"], -0.25))
    assert torch.equal(after["2.weight"], before["2.weight"]) and torch.equal(after["0.bias"], before["0.bias"])
    # every weight changed: each sub-group's state is read once (once per parameter in it before),
    # and none after a checkpoint load, which writes weights and masters alike
    opened, state = [], engine.sub_optimizer.state
    engine.sub_optimizer.state = lambda i: (opened.append(i), state(i))[1]
    model.load_state_dict({k: v + 0.125 for k, v in after.items()})
    train(engine, X[2:], Y[2:], 1)
    assert sorted(opened) == sorted(set(opened)) and len(opened) == len(engine.sub_optimizer.specs)
    engine.save_checkpoint(str(tmp_path / "ck"), tag="t")
    engine.load_checkpoint(str(tmp_path / "ck"), tag="t")
    opened.clear()
    train(engine, X[2:], Y[2:], 1)
    assert opened == []
    engine.close()


@pytest.mark.parametrize("stage,device", [(0, "nvme"), (1, "nvme"), (2, "nvme"), (2, "cpu")])
def test_fp32_weights_changed_between_steps_are_stepped_from(tmp_path, stage, device):
    """fp32 with the optimizer state on NVMe: the next step wrote the old NVMe master over a
    weight changed between steps (tester-35 F01: 0.34 off torch.optim.AdamW; cpu offload, whose
    masters are the parameters, was right). Changes by an in-place op under no_grad, by
    load_state_dict, and one made before a checkpoint save, against the same changes to a model
    that torch.optim.AdamW trains."""
    X, Y = batches(5)
    ref, model = make_mlp(), make_mlp()
    for m in (ref, model):  # an empty one too: its data_ptr() is 0, and it was taken for a replaced one
        m.register_parameter("empty", nn.Parameter(torch.zeros(0)))
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, foreach=False)
    engine, *_ = zeroinf.initialize(model=model, config=config(stage, device, tmp_path / "nv"))

    def both(change):
        for m in (ref, model):
            with torch.no_grad():
                change(m)

    for s in range(5):
        opt.zero_grad()
        F.mse_loss(ref(X[s]), Y[s]).backward()
        opt.step()
        train(engine, X[s:s + 1], Y[s:s + 1], 1)
        if s == 0:
            both(lambda m: m[2].weight.zero_())
        elif s == 1:
            sd = {k: v + 0.25 for k, v in ref.state_dict().items()}
            both(lambda m: m.load_state_dict(sd))
        elif s == 2:
            both(lambda m: m[0].bias.fill_(0.5))
            engine.save_checkpoint(str(tmp_path / "ck"), tag="t")
            engine.load_checkpoint(str(tmp_path / "ck"), tag="t")
    assert max_diff(model, ref) <= 1e-6
    engine.close()


@pytest.mark.parametrize("stage,device,precision", [(0, "none", "fp32"), (1, "cpu", "fp32"), (2, "nvme", "fp32"),
                                                    (2, "cpu", "bf16")])
def test_replaced_parameter_data_keeps_training(tmp_path, stage, device, precision):
    """``p.data = t`` (and model.half() then model.float(), which do that) left a stage 0-2
    parameter outside its flat buffer: the optimizer wrote into the old storage and the
    parameter never changed again (tester-35 F02). It trains on from the new values, as with
    torch.optim.AdamW; data of another dtype at the step raises, naming the parameter."""
    dt = torch.bfloat16 if precision == "bf16" else torch.float32
    X, Y = (t.to(dt) for t in batches(5))
    ref, model = make_mlp(), make_mlp()
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    engine, *_ = zeroinf.initialize(model=model, config=config(stage, device, tmp_path, **extra))
    if precision == "bf16":  # the reference: fp32 masters, rounded into bf16 parameters
        ref.to(dt)
        masters = [p.detach().float() for p in make_mlp().parameters()]
        opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WD, foreach=False)
    else:
        masters, opt = list(ref.parameters()), torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD,
                                                                   foreach=False)

    def ref_step(x, y):
        for p in ref.parameters():
            p.grad = None
        F.mse_loss(ref(x), y).backward()
        for m, p in zip(masters, ref.parameters()):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, ref.parameters()):
                p.copy_(m)

    for s in range(4):
        ref_step(X[s], Y[s])
        train(engine, X[s:s + 1], Y[s:s + 1], 1)
        if s == 0:
            for m in (ref, model):
                m[2].weight.data = torch.zeros(5, 13, dtype=dt)
            with torch.no_grad():
                masters[2].zero_()
        elif s == 1 and precision == "fp32":
            for m in (ref, model):
                m.half().float()
            with torch.no_grad():
                for m, p in zip(masters, ref.parameters()):
                    m.copy_(p)
        elif s == 2 and precision == "fp32":  # (the reference's masters are its parameters)
            for m in (ref, model):
                m.share_memory()  # moves the flat buffers, not the parameters in them: was a replacement (tester-37 F1)
                # a re-view of its own data: the same address and shape, other strides (missed: tester-37 F2)
                m[0].weight.data = m[0].weight.data.reshape(7, 13).t()
    assert float(model[2].weight.detach().abs().sum()) > 0.1  # it trained on after the zeros
    assert max_diff(model, ref) <= (1e-6 if precision == "fp32" else 0.0)
    if precision == "fp32":
        model[2].bias.data = model[0].bias.data[:5]  # torch keeps the two tied; the engine cannot (tester-36 F5)
        with pytest.raises(RuntimeError, match=r"parameter '2\.bias' was given data that views another"):
            engine.step()
        model[2].bias.data = model[2].bias.data.clone()
        before = [p.detach().clone() for p in model.parameters()]
        model.half()
        engine.backward(F.mse_loss(engine(X[4].half()), Y[4].half()))
        with pytest.raises(RuntimeError, match=r"parameter '0\.weight' was given data of shape \(13, 7\), "
                                               r"torch.float16 .*model.float\(\)"):
            engine.step()
        model.float()
        engine.step()  # the micro-batch's gradients were kept: the step runs now
        assert engine.optimizer_steps == 5
        assert all(not torch.equal(a, b.float()) for a, b in zip(before, model.parameters()))
    engine.close()


@pytest.mark.parametrize("stage,device", [(0, "cpu"), (1, "cpu"), (2, "cpu"), (2, "nvme")])
def test_load_state_dict_of_fp32_weights_sets_a_bf16_models_masters_to_them(tmp_path, stage, device):
    """``model.load_state_dict(fp32 weights)`` on a bf16 model at stages 0-2 after training
    ("reset to init", restoring the best weights) sets the fp32 masters to those values, as at
    stage 3: elements whose bf16 rounding had not moved kept their trained fp32 master. A bf16
    state dict of the model itself, and a value changed after the load, keep the old rule
    (only elements whose rounded value changed are taken)."""
    model = make_mlp()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = config(stage=stage, device=device, nvme=tmp_path, bf16={"enabled": True})
    cfg["optimizer"]["params"].update(lr=1e-3)
    engine, *_ = zeroinf.initialize(model=model, config=cfg)
    X, Y = (t.to(torch.bfloat16) for t in batches(3))
    train(engine, X, Y, 3)

    def masters(tag):
        engine.save_checkpoint(str(tmp_path / "ck"), tag=tag)
        return zeroinf.checkpoint.consolidate(str(tmp_path / "ck"), tag, str(tmp_path / f"{tag}.pt"))

    trained = masters("trained")
    assert not torch.equal(trained["0.weight"], init["0.weight"])
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})  # its own bf16 values
    same = masters("same")
    assert all(torch.equal(same[k], trained[k]) for k in trained)
    source = {k: v.clone() for k, v in init.items()}
    model.load_state_dict(source)
    for v in source.values():  # the source changes on (a live fp32 model trained on): its later values are not taken
        v.add_(1e-4)
    with torch.no_grad():  # changed after the load: that element is the bf16 value, not the loaded fp32 one
        model[2].bias[0] = 0.5
    reset = masters("reset")
    assert torch.equal(reset["2.bias"][0], torch.tensor(0.5))
    reset["2.bias"][0] = init["2.bias"][0]
    assert all(torch.equal(reset[k], init[k]) for k in init)
    engine.close()
