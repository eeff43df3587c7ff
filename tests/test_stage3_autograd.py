"""Stage 3 under any use of autograd: ``torch.autograd.grad`` before ``engine.backward`` (with
respect to an activation or to parameters, with and without ``create_graph``), a gradient
penalty in the loss, ``backward(retain_graph=True)`` then a second backward, gradient
accumulation; each plain and under activation checkpointing (reentrant and not), with every
parameter tier, and with a trainable parameter the forward never reads and a frozen one. Three
steps equal plain PyTorch + torch.optim.AdamW within 1e-6, and so do the gradients
``autograd.grad`` returns; what plain PyTorch refuses is refused alike, before any weight
changes."""
import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zeroinf
from stage3_engine_helpers import BETAS, EPS, LR, WD, _config, _state

D = 8


class Block(nn.Module):
    """``x + tanh(lin(x))``; ``adapter``: a trainable weight the forward never reads (an adapter
    switched off); ``frozen``: a frozen linear added to the residual."""

    def __init__(self, adapter: bool = False, frozen: bool = False):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.adapter = nn.Parameter(0.1 * torch.randn(D, D)) if adapter else None
        self.mix = nn.Linear(D, D).requires_grad_(False) if frozen else None

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if self.mix is not None:
            h = h + self.mix(x)
        return x + h


class Net(nn.Module):
    """Input linear, three blocks (the stage-3 units; the second holds the unused weight, the
    third the frozen one), head. Returns ``(prediction, hidden)``, ``hidden`` the first block's
    output. ``ckpt``: None, "reentrant" or "nonreentrant" torch.utils.checkpoint around each
    block."""

    def __init__(self, ckpt=None):
        super().__init__()
        self.inp = nn.Linear(4, D)
        self.blocks = nn.ModuleList([Block(), Block(adapter=True), Block(frozen=True)])
        self.head = nn.Linear(D, 1)
        self.ckpt = ckpt

    def forward(self, x):
        h = self.inp(x)
        hidden = None
        for b in self.blocks:
            h = b(h) if self.ckpt is None else checkpoint(b, h, use_reentrant=self.ckpt == "reentrant")
            if hidden is None:
                hidden = h
        return self.head(h), hidden


def _data(step, micro):
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(3, 4, generator=g), torch.randn(3, 1, generator=g)


SCENARIOS = ["grad_act", "grad_act_create", "grad_params", "grad_params_create", "penalty", "retain_twice",
             "accumulate"]


def _micro_batch(model, scenario, step, micro, backward):
    """One micro-batch of ``scenario`` on ``model``; ``backward(loss, retain_graph)`` is the
    engine's or plain autograd's. Returns the loss and what ``autograd.grad`` returned (detached)."""
    x, y = _data(step, micro)
    pred, hidden = model(x)
    loss = ((pred - y) ** 2).mean()
    got = []
    if scenario in ("grad_act", "grad_act_create", "accumulate"):
        got = torch.autograd.grad(loss, hidden, retain_graph=True, create_graph=scenario == "grad_act_create")
    elif scenario in ("grad_params", "grad_params_create"):
        params = [p for p in model.parameters() if p.requires_grad]
        got = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True,
                                  create_graph=scenario == "grad_params_create")
    if scenario == "penalty":
        (g,) = torch.autograd.grad(loss, hidden, create_graph=True)
        loss = loss + 0.1 * g.pow(2).sum()
    if scenario == "retain_twice":
        backward(loss, True)
    backward(loss, False)
    return loss.item(), [None if g is None else g.detach().clone() for g in got]


def _gas(scenario):
    return 2 if scenario == "accumulate" else 1


def _reference_steps(ref, scenario, steps):
    """Plain PyTorch + AdamW. A trainable parameter with no gradient is stepped with zeros, as
    the engine steps it (see the README: weight decay and the moments still move it)."""
    trainable = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    gas = _gas(scenario)
    out = []
    for step in range(1, steps + 1):
        for micro in range(gas):
            out.append(_micro_batch(ref, scenario, step, micro,
                                    lambda loss, retain: (loss / gas).backward(retain_graph=retain)))
        for p in trainable:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
    return out


def _engine_steps(engine, scenario, steps):
    out = []
    for step in range(1, steps + 1):
        for micro in range(_gas(scenario)):
            out.append(_micro_batch(engine, scenario, step, micro,
                                    lambda loss, retain: engine.backward(loss, retain_graph=retain)))
            engine.step()
    return out


def _refused_by_torch(scenario, ckpt):
    """Reentrant checkpointing refuses ``autograd.grad`` through a checkpointed block."""
    return ckpt == "reentrant" and scenario not in ("retain_twice",)


def _assert_close(got, want, what):
    for (gl, gg), (wl, wg) in zip(got, want):
        assert abs(gl - wl) <= 1e-6 * max(1.0, abs(wl)), (what, gl, wl)
        assert len(gg) == len(wg), what
        for a, b in zip(gg, wg):
            assert (a is None) == (b is None), what
            if a is not None:
                # relative to the gradient's size, as the losses are (a head gradient of 4.7 is 1.4e-6 from
                # the reference when the weights it was computed with differ by 1 fp32 ulp)
                tol = 1e-6 * max(1.0, b.abs().max().item())
                assert a.shape == b.shape and (a - b).abs().max().item() <= tol, (what, (a - b).abs().max())


# every use x checkpointing with the partitions on the device and on NVMe; a subset with them in host memory
CASES = ([(t, s, c) for t in ("none", "nvme") for s in SCENARIOS for c in (None, "reentrant", "nonreentrant")]
         + [("cpu", s, c) for s, c in [("grad_act", None), ("grad_params", "nonreentrant"), ("penalty", None),
                                        ("retain_twice", "reentrant"), ("accumulate", "nonreentrant"),
                                        ("grad_act_create", "reentrant")]])


@pytest.mark.parametrize("tier,scenario,ckpt", CASES)
def test_autograd_use_equals_plain_pytorch(tmp_path, tier, scenario, ckpt):
    """Three steps of ``scenario`` equal plain PyTorch: losses, what ``autograd.grad`` returned,
    and every weight (the unused one stepped with zeros). An ``autograd.grad`` pass before the
    engine's backward reduced nothing and ended the iteration, so that backward queued no end:
    the unit holding the unused weight never had its gradient reduced (1e-2 off after 3 steps),
    and under checkpointing a released weight was read empty. Where plain PyTorch refuses the
    use (``autograd.grad`` through reentrant checkpointing) the engine raises the same error,
    with no weight changed."""
    ref = Net(ckpt)
    model = copy.deepcopy(ref)
    cfg = _config(tier, "cpu", tmp_path)
    cfg["gradient_accumulation_steps"] = _gas(scenario)
    engine, *_ = zeroinf.initialize(model=model, config=cfg)
    if _refused_by_torch(scenario, ckpt):
        with pytest.raises(RuntimeError) as want:
            _reference_steps(copy.deepcopy(ref), scenario, 1)
        before = _state(engine)
        with pytest.raises(RuntimeError) as got:
            _engine_steps(engine, scenario, 1)
        assert str(got.value) == str(want.value)
        after = _state(engine)
        assert all(torch.equal(before[k], after[k]) for k in before)
        engine.close()
        return
    want = _reference_steps(ref, scenario, 3)
    got = _engine_steps(engine, scenario, 3)
    _assert_close(got, want, scenario)
    sd = _state(engine)
    for name, p in ref.named_parameters():
        err = (sd[name] - p.detach()).abs().max().item()
        assert err <= 1e-6, f"{name}: {err}"
    assert engine.params.manager.live_numel == 0
    engine.close()


@pytest.mark.parametrize("tier", ["none", "nvme"])
def test_a_refused_autograd_grad_then_the_backward_equals_plain_pytorch(tmp_path, tier):
    """Reentrant checkpointing refuses ``autograd.grad`` part-way through its backward, as in
    plain PyTorch, with no weight changed; the script then runs the backward of the same
    (retained) graph: that pass, not one nested in the refused one, reduces every gradient."""
    ref = Net("reentrant")
    engine, *_ = zeroinf.initialize(model=copy.deepcopy(ref), config=_config(tier, "cpu", tmp_path))
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WD, foreach=False)
    for step in range(1, 4):
        x, y = _data(step, 0)
        losses = []
        for model in (ref, engine):
            pred, hidden = model(x)
            loss = ((pred - y) ** 2).mean()
            before = _state(engine)
            with pytest.raises(RuntimeError, match="use_reentrant=True, torch.utils.checkpoint is incompatible"):
                torch.autograd.grad(loss, hidden, retain_graph=True)
            assert all(torch.equal(before[k], v) for k, v in _state(engine).items())
            losses.append(loss)
        losses[0].backward()
        for p in ref.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
        engine.backward(losses[1])
        engine.step()
    sd = _state(engine)
    for name, p in ref.named_parameters():
        assert (sd[name] - p.detach()).abs().max().item() <= 1e-6, name
    engine.close()


@pytest.mark.parametrize("mode", ["overlap", "in_backward"])
@pytest.mark.parametrize("scenario,ckpt", [("grad_act", "nonreentrant"), ("grad_params", None), ("penalty", None),
                                           ("penalty", "nonreentrant")])
def test_autograd_use_with_the_step_overlapped_or_in_the_backward(tmp_path, mode, scenario, ckpt):
    """The same under ``zeroinf.overlap_step`` and ``zeroinf.optimizer_in_backward``: a pass of
    ``autograd.grad`` hands no gradient to the step; the engine's backward hands each once."""
    ref = Net(ckpt)
    cfg = _config("nvme", "nvme", tmp_path)
    cfg["zeroinf"] = {"overlap_step": True, "optimizer_in_backward": mode == "in_backward"}
    engine, *_ = zeroinf.initialize(model=copy.deepcopy(ref), config=cfg)
    want = _reference_steps(ref, scenario, 3)
    _assert_close(_engine_steps(engine, scenario, 3), want, scenario)
    engine.synchronize()
    sd = _state(engine)
    for name, p in ref.named_parameters():
        assert (sd[name] - p.detach()).abs().max().item() <= 1e-6, name
    engine.close()


def test_a_gradient_penalty_beyond_the_live_parameter_limit_is_refused_with_no_weight_changed(tmp_path):
    """A ``create_graph`` pass keeps every unit it used gathered until the backward through its
    graph ends; at the smallest ``stage3_max_live_parameters`` the engine runs (a config of 1 raised to it) they do
    not fit: one line says so, before anything is stepped, and plain training goes on."""
    ref = Net()
    cfg = _config("cpu", "cpu", tmp_path, stage3_max_live_parameters=1, stage3_prefetch_bucket_size=0)
    with pytest.warns(UserWarning, match="using the minimum"):
        engine, *_ = zeroinf.initialize(model=copy.deepcopy(ref), config=cfg)
    before = _state(engine)
    with pytest.raises(RuntimeError) as err:
        _engine_steps(engine, "penalty", 1)
    msg = str(err.value)
    assert "\n" not in msg and "stage3_max_live_parameters" in msg and "create_graph=True keeps every unit" in msg, msg
    after = _state(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)
    _assert_close(_engine_steps(engine, "grad_act", 2), _reference_steps(ref, "grad_act", 2), "grad_act")
    engine.close()


def test_a_unit_with_a_weight_the_forward_never_reads_is_reduced_and_released_in_the_backward(tmp_path):
    """An adapter switched off in every block: each unit gets one gradient fewer than it has
    trainable weights. Its gradient is final once the weights the backward's graph holds have
    theirs, so it is reduced and released then, not at the end of the backward with every other
    unit still gathered (the whole model was live then: 1056 elements instead of 288)."""

    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(4, D)
            self.blocks = nn.ModuleList([Block(adapter=True) for _ in range(8)])
            self.head = nn.Linear(D, 1)

        def forward(self, x):
            h = self.inp(x)
            for b in self.blocks:
                h = b(h)
            return self.head(h), h

    ref = Deep()
    engine, *_ = zeroinf.initialize(model=copy.deepcopy(ref), config=_config(
        "cpu", "cpu", tmp_path, stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0))
    mgr = engine.params.manager
    _assert_close(_engine_steps(engine, "grad_act", 3), _reference_steps(ref, "grad_act", 3), "grad_act")
    sd = _state(engine)
    for name, p in ref.named_parameters():
        assert (sd[name] - p.detach()).abs().max().item() <= 1e-6, name
    assert set(mgr.last_reduce_counts.values()) == {1}, mgr.last_reduce_counts
    root, block = mgr.units[1].numel, mgr.units[2].numel
    assert engine.stats()["stage3"]["live_high_water"] <= root + 2 * block, engine.stats()["stage3"]
    engine.close()
