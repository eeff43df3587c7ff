"""zeroinf.initialize / ZeroEngine, one process: stages 0-2 x offload none/cpu/nvme train as plain
PyTorch + torch.optim.AdamW (foreach=False) does, fp32, 1e-6 per parameter unless said: gradient
accumulation and its boundaries, no_sync, tied weights, clipping, bf16, Adam's L2 decay, client
torch optimizers, DeepSpeed's backward/step keywords, parameters left out of the optimizer."""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeroinf
from engine_helpers import LR, WD, batches, config, make_mlp, max_diff, reference, train


@pytest.mark.parametrize("device", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_five_steps_equal_torch_adamw(stage, device, tmp_path):
    X, Y = batches(5)
    ref = make_mlp()
    reference(ref, X, Y, 5)
    model = make_mlp()
    engine, opt, loader, sched = zeroinf.initialize(model, config=config(stage, device, tmp_path))
    assert loader is None and sched is None
    train(engine, X, Y, 5)
    assert engine.global_steps == 5 and engine.optimizer_steps == 5
    assert max_diff(model, ref) <= 1e-6
    # the master weights equal the parameters (fp32), and the moments are those of torch
    flat_ref = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    with engine.sub_optimizer.state(0) as (master, m, v):
        assert torch.allclose(master, flat_ref[:master.numel()], atol=1e-6, rtol=0)
    if device == "nvme":
        assert engine.stats()["nvme_read_bytes"] > 0 and engine.stats()["nvme_write_bytes"] > 0
    engine.close()


def test_gradient_accumulation_is_the_mean_of_the_micro_batches(tmp_path):
    gas, steps = 4, 3
    X, Y = batches(gas * steps)
    ref = make_mlp()
    ref_norms, ref_grads = reference(ref, X, Y, steps, gas=gas)
    model = make_mlp()
    engine, *_ = zeroinf.initialize(model, config=config(2, "nvme", tmp_path, gas=gas))
    ref_mid = make_mlp()
    for s in range(steps):  # global steps 1, 2, 3: check the accumulated gradient before each step
        for k in range(gas):
            loss = F.mse_loss(engine(X[s * gas + k]), Y[s * gas + k])
            assert torch.equal(engine.backward(loss), loss / gas)  # as DeepSpeed returns it
            if k == gas - 1:
                acc = torch.cat([engine.params.grad(i) for i in range(len(engine.sub_optimizer.specs))])
                assert torch.allclose(acc[:ref_grads[s].numel()], ref_grads[s], atol=1e-7, rtol=1e-6), f"step {s + 1}"
                assert not acc[ref_grads[s].numel():].any()  # padding stays zero
            engine.step()
        assert engine.global_steps == s + 1
        assert engine.get_global_grad_norm() == pytest.approx(ref_norms[s], rel=1e-6)
        ref_mid = make_mlp()
        reference(ref_mid, X, Y, s + 1, gas=gas)
        assert max_diff(model, ref_mid) <= 1e-6, f"global step {s + 1}"
    engine.close()


def test_set_gradient_accumulation_boundary_steps_where_the_caller_says(tmp_path):
    # DeepSpeed's recipe: boundary False before the window's backwards, True before its last;
    # the loss is still divided by gradient_accumulation_steps (4), here over windows of 2 and 3
    X, Y = batches(5)
    ref = make_mlp()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, foreach=False)
    for window in ((0, 1), (2, 3, 4)):
        opt.zero_grad()
        for i in window:
            (F.mse_loss(ref(X[i]), Y[i]) / 4).backward()
        opt.step()
    model = make_mlp()
    engine, *_ = zeroinf.initialize(model, config=config(1, "cpu", tmp_path, gas=4))
    for window in ((0, 1), (2, 3, 4)):
        for i in window:
            engine.set_gradient_accumulation_boundary(i == window[-1])
            assert engine.is_gradient_accumulation_boundary() == (i == window[-1])
            engine.backward(F.mse_loss(engine(X[i]), Y[i]))
            engine.step()
    assert engine.global_steps == 2 and engine.micro_steps == 5
    assert max_diff(model, ref) <= 1e-6
    with pytest.raises(TypeError, match="bool or None"):
        engine.set_gradient_accumulation_boundary(1)
    engine.set_gradient_accumulation_boundary(None)  # back to counting (micro_steps 5: boundary after 3 more)
    assert [engine.is_gradient_accumulation_boundary() or engine.step() for _ in range(3)] == [None, None, True]
    engine.close()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_no_sync_on_one_rank_defers_the_reduction_to_the_step(stage, tmp_path):
    X, Y = batches(4)
    ref = make_mlp()
    reference(ref, X, Y, 2, gas=2)
    model = make_mlp()
    engine, *_ = zeroinf.initialize(model, config=config(stage, "cpu", tmp_path, gas=2))
    for s in range(2):
        with engine.no_sync():
            for k in range(2):  # the whole window inside: engine.step() at the boundary reduces it
                engine.backward(F.mse_loss(engine(X[2 * s + k]), Y[2 * s + k]))
                # held in .grad, not reduced (one rank computes the same either way: this tells them apart)
                assert all(p.grad is not None for p in model.parameters())
                engine.step()
    assert max_diff(model, ref) <= 1e-6 and engine.global_steps == 2
    with engine.no_sync(), pytest.raises(RuntimeError, match="already inside"):
        with engine.no_sync():
            pass
    engine.close()


def test_a_load_drops_gradients_held_by_no_sync(tmp_path):
    """Rolling back to a checkpoint after a backward inside no_sync(): the held .grad was added
    into the next step, 0.016 off (helper-38, /tmp/tester22/t03_nosync_load.py)."""
    X, Y = batches(4)
    model = make_mlp()
    engine, *_ = zeroinf.initialize(model, config=config(1, "cpu", tmp_path))
    train(engine, X, Y, 2)
    engine.save_checkpoint(str(tmp_path / "ck"), "A")
    with engine.no_sync():
        engine.backward(F.mse_loss(engine(X[3]), Y[3]))
    engine.load_checkpoint(str(tmp_path / "ck"), "A")
    assert all(p.grad is None for p in model.parameters())
    train(engine, X[2:], Y[2:], 1)
    ref = make_mlp()
    reference(ref, X, Y, 3)
    assert max_diff(model, ref) <= 1e-6
    engine.close()


class TiedTwice(nn.Module):
    """An output layer tied to the embedding, and a block called twice in one forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.emb = nn.Embedding(11, 6)
        self.block = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        h = torch.tanh(self.block(self.emb(idx)))
        return self.head(torch.tanh(self.block(h)))


@pytest.mark.parametrize("stage", [1, 2])
def test_tied_weights_and_a_module_called_twice(stage):
    idx = torch.randint(0, 11, (4, 5, 3), generator=torch.Generator().manual_seed(0))
    ref = TiedTwice()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, foreach=False)
    model = TiedTwice()
    engine, *_ = zeroinf.initialize(model, config=config(stage, "cpu"))
    for s in range(4):
        opt.zero_grad()
        F.cross_entropy(ref(idx[s]).reshape(-1, 11), idx[s].reshape(-1)).backward()
        ref_grad = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
        opt.step()
        engine.backward(F.cross_entropy(model(idx[s]).reshape(-1, 11), idx[s].reshape(-1)))
        acc = torch.cat([engine.params.grad(i) for i in range(len(engine.sub_optimizer.specs))])
        # reduced exactly once: a doubled gradient would survive Adam's scale invariance, not this
        assert torch.allclose(acc[:ref_grad.numel()], ref_grad, atol=1e-7, rtol=1e-6)
        engine.step()
    assert model.head.weight is model.emb.weight
    assert max_diff(model, ref) <= 1e-6


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clipping_and_global_norm_match_torch(norm_type, tmp_path):
    X, Y = batches(4)
    ref = make_mlp()
    ref_norms, _ = reference(ref, X, Y, 4, clip=0.05, norm_type=norm_type)
    model = make_mlp()
    cfg = config(2, "cpu", gradient_clipping=0.05, zeroinf={"grad_norm_type": "inf" if norm_type == math.inf else 2.0})
    engine, *_ = zeroinf.initialize(model, config=cfg)
    norms = []
    for s in range(4):
        train(engine, X[s:s + 1], Y[s:s + 1], 1)
        norms.append(engine.get_global_grad_norm())
    assert min(ref_norms) > 0.05  # clipping was active every step
    assert norms == pytest.approx(ref_norms, rel=1e-6)
    assert max_diff(model, ref) <= 1e-6


@pytest.mark.parametrize("stage,device", [(0, "none"), (1, "cpu"), (2, "nvme")])
def test_bf16_follows_fp32_reference_within_bf16_tolerance(stage, device, tmp_path):
    X, Y = batches(5)
    ref = make_mlp()
    ref_losses = []
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, foreach=False)
    for s in range(5):
        opt.zero_grad()
        loss = F.mse_loss(ref(X[s]), Y[s])
        loss.backward()
        opt.step()
        ref_losses.append(float(loss.detach()))
    model = make_mlp()
    engine, *_ = zeroinf.initialize(model, config=config(stage, device, tmp_path, bf16={"enabled": True}))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    losses = train(engine, X.bfloat16(), Y.bfloat16(), 5)
    assert losses == pytest.approx(ref_losses, rel=0.01)
    # a bf16 parameter near 1 rounds by 4e-3, and Adam moves a weight with a near-zero gradient by up
    # to lr per step whichever the sign: allow 3 lr over 5 steps for the worst, little for the median
    diffs = torch.cat([(p.float() - q).abs().reshape(-1) for p, q in zip(model.parameters(), ref.parameters())])
    assert diffs.max() <= 3 * LR and diffs.median() <= 4e-3
    # the fp32 master weights are closer to the reference than bf16 rounding allows
    flat_ref = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    n = 0
    for i in range(len(engine.sub_optimizer.specs)):
        with engine.sub_optimizer.state(i) as (master, _, _):
            k = min(master.numel(), flat_ref.numel() - n)
            assert (master[:k] - flat_ref[n:n + k]).abs().median() < 2e-3
            n += k
    engine.close()


def test_adam_with_l2_weight_decay_matches_torch_adam():
    """DeepSpeed's "Adam" with adam_w_mode false adds weight_decay * param to the gradient."""
    X, Y = batches(4)
    ref = make_mlp()
    opt = torch.optim.Adam(ref.parameters(), lr=LR, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, foreach=False)
    for s in range(4):
        opt.zero_grad()
        F.mse_loss(ref(X[s]), Y[s]).backward()
        opt.step()
    model = make_mlp()
    cfg = config(1, "cpu")
    cfg["optimizer"] = {"type": "Adam", "params": {"lr": LR, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.1,
                                                   "adam_w_mode": False}}
    engine, *_ = zeroinf.initialize(model, config=cfg)
    train(engine, X, Y, 4)
    assert max_diff(model, ref) <= 1e-6


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.Adam(ps, lr=LR, weight_decay=0.1),
    lambda ps: torch.optim.Adam(ps, lr=LR, weight_decay=0.1, decoupled_weight_decay=True),
    lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.1),
], ids=["Adam", "Adam-decoupled", "AdamW"])
def test_client_torch_optimizers_keep_their_weight_decay_rule(make):
    X, Y = batches(3)
    ref = make_mlp()
    ref_opt = make(list(ref.parameters()))
    for s in range(3):
        ref_opt.zero_grad()
        F.mse_loss(ref(X[s]), Y[s]).backward()
        ref_opt.step()
    model = make_mlp()
    cfg = config(2, "cpu")
    del cfg["optimizer"]
    engine, *_ = zeroinf.initialize(model, optimizer=make(list(model.parameters())), config=cfg)
    train(engine, X, Y, 3)
    assert max_diff(model, ref) <= 1e-6


def test_deepspeed_keywords_of_backward_and_step():
    X, Y = batches(2)
    # retain_graph: a second backward through the same graph adds its gradients, as in plain PyTorch;
    # scale_wrt_gas=False: no division by gradient_accumulation_steps (2 here)
    ref = make_mlp()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, foreach=False)
    loss = F.mse_loss(ref(X[0]), Y[0])
    loss.backward(retain_graph=True)
    (2 * loss).backward()
    F.mse_loss(ref(X[1]), Y[1]).backward()
    opt.step()
    model = make_mlp()
    engine, *_ = zeroinf.initialize(model, config=config(1, "cpu", gas=2))
    loss = F.mse_loss(engine(X[0]), Y[0])
    assert engine.backward(loss, retain_graph=True, scale_wrt_gas=False) is loss
    assert torch.equal(engine.backward(2 * loss, scale_wrt_gas=False), 2 * loss)
    engine.step()
    engine.backward(F.mse_loss(engine(X[1]), Y[1]), scale_wrt_gas=False)
    engine.step()
    assert max_diff(model, ref) <= 1e-6
    engine.close()

    # lr_kwargs reach the scheduler: ReduceLROnPlateau halves the lr after a metric that does not improve
    model = make_mlp()
    engine, opt, *_ = zeroinf.initialize(model, config=config(2, "cpu"), lr_scheduler=lambda o:
                                         torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0))
    for metric in (1.0, 2.0):
        loss = F.mse_loss(engine(X[0]), Y[0])
        assert engine.backward(loss) is loss  # gradient_accumulation_steps 1: nothing to divide
        engine.step(lr_kwargs={"metrics": metric})
    assert opt.param_groups[0]["lr"] == LR / 2
    # without them the scheduler raises, once the step is applied and counted: a retry is not
    # another Adam step
    engine.backward(F.mse_loss(engine(X[0]), Y[0]))
    with pytest.raises(TypeError, match="metrics") as ei:
        engine.step()
    assert engine.optimizer_steps == 3 and engine.micro_steps == 3
    assert any("applied and counted" in n for n in getattr(ei.value, "__notes__", []))
    with pytest.raises(RuntimeError, match="again after it raised"):
        engine.step(lr_kwargs={"metrics": 1.0})
    assert engine.optimizer_steps == 3 and engine.micro_steps == 3
    engine.backward(F.mse_loss(engine(X[0]), Y[0]))  # the next micro-batch steps as usual
    engine.step(lr_kwargs={"metrics": 1.0})
    assert engine.optimizer_steps == 4
    engine.close()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_trainable_parameters_left_out_of_the_optimizer_warn_and_stay(stage):
    X, Y = batches(3)
    ref = make_mlp()
    opt = torch.optim.AdamW(list(ref[0].parameters()), lr=LR, weight_decay=WD, foreach=False)
    for i in range(3):
        opt.zero_grad()
        F.mse_loss(ref(X[i]), Y[i]).backward()
        opt.step()
    model = make_mlp()
    with pytest.warns(UserWarning, match=r"2 trainable parameter\(s\) \(2.weight, 2.bias\) are not in the optimizer") as rec:
        engine, *_ = zeroinf.initialize(model, model_parameters=model[0].parameters(), config=config(stage, "cpu"))
    assert rec[0].filename == __file__  # points at the initialize call
    train(engine, X, Y, 3)
    got = {k: v.clone() for k, v in model.state_dict().items()}
    for k, v in ref.state_dict().items():
        assert (got[k] - v).abs().max().item() <= 1e-6, k
    # their gradients did not pile up over the micro-batches (stages 0-2 kept summing them in .grad)
    assert model[2].weight.grad is None and model[2].bias.grad is None
    engine.close()


@pytest.mark.parametrize("fast", [True, False])
def test_bf16_on_a_cpu_without_fast_bf16_matmuls_warns_once_naming_fp32(fast, monkeypatch, tmp_path):
    """On a CPU without oneDNN's bf16 (an AVX2-only x86), torch's bf16 matmuls fall back to a
    scalar loop (88x slower than fp32 measured there): initialize says so and names fp32; on a CPU
    with them, and in fp32, it says nothing."""
    import zeroinf.runtime.engine as engine_mod
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: fast, raising=False)
    assert engine_mod.slow_cpu_compute(torch.float32) is None
    cfg = {**config(2, "none", tmp_path), "bf16": {"enabled": True}}
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        engine, *_ = zeroinf.initialize(make_mlp(), config=cfg)
    engine.close()
    slow = [w for w in rec if "no fast bf16 matmuls" in str(w.message)]
    assert len(slow) == (0 if fast else 1)
    if not fast:  # pointed at the caller's line
        assert "train in fp32 here" in str(slow[0].message) and slow[0].filename == __file__
