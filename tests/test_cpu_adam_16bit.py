"""CPUAdam over 16-bit (bf16/fp16) parameters: each keeps an fp32 master, weights changed between
steps (whole or a few elements, before or after a state-dict load) are stepped from, and two over
the same memory are refused."""
import pytest
import torch

import zeroinf.optim as zo
from cpu_adam_helpers import TOL, _save_load


@pytest.fixture
def prepared(monkeypatch):
    """The parameters CPUAdam._prepare is called with, in call order (the Python preparation a
    first step or a changed 16-bit parameter goes through); the test clears it between steps."""
    calls = []
    real = zo.CPUAdam._prepare
    monkeypatch.setattr(zo.CPUAdam, "_prepare", lambda self, p, maximize: calls.append(p) or real(self, p, maximize))
    return calls

def test_cpuadam_bf16_params_keep_fp32_master():
    n = 513
    init = torch.randn(n)
    p = torch.nn.Parameter(init.to(torch.bfloat16))
    opt = zo.CPUAdam([p], lr=1e-3)
    q = torch.nn.Parameter(init.to(torch.bfloat16).float())
    ref = torch.optim.AdamW([q], lr=1e-3, foreach=False)  # both at their default weight decay
    for _ in range(20):
        g = torch.randn(n).to(torch.bfloat16)
        p.grad, q.grad = g.clone(), g.float()
        opt.step()
        ref.step()
    master = opt.state[p]["master_param"]
    assert master.dtype == torch.float32 and opt.state[p]["exp_avg"].dtype == torch.float32
    assert torch.equal(p.detach().view(torch.int16), master.to(torch.bfloat16).view(torch.int16))
    assert (master - q.detach()).abs().max().item() <= TOL
    # lr 1e-3 steps are below bf16 resolution for many elements: the master still moves
    assert (master - init.to(torch.bfloat16).float()).abs().min().item() > 0
    # a reload keeps the moments and master in fp32
    opt2 = zo.CPUAdam([p], lr=1e-3)
    opt2.load_state_dict(_save_load(opt.state_dict()))
    assert opt2.state[p]["exp_avg"].dtype == torch.float32
    assert torch.equal(opt2.state[p]["master_param"], master)



def test_cpuadam_steady_16bit_steps_skip_the_per_parameter_preparation(prepared):
    """A 16-bit parameter left as the optimizer wrote it is stepped straight from its kept master,
    as an fp32 one is from itself: only a first step or a changed parameter is prepared (in
    Python, per parameter). The updates still equal torch.optim.AdamW's on fp32 copies."""
    torch.manual_seed(0)
    inits = [torch.randn(n) for n in (7, 64, 300)]
    ps = [torch.nn.Parameter(x.to(torch.bfloat16)) for x in inits]
    qs = [torch.nn.Parameter(x.to(torch.bfloat16).float()) for x in inits]
    opt = zo.CPUAdam(ps, lr=1e-3, weight_decay=0.01)
    ref = torch.optim.AdamW(qs, lr=1e-3, weight_decay=0.01, foreach=False)
    counts = []
    for i in range(4):
        if i == 2:
            with torch.no_grad():
                ps[1].mul_(0.5)
                qs[1].copy_(ps[1].float())
        for p, q in zip(ps, qs):
            g = torch.randn(p.shape).to(torch.bfloat16)
            p.grad, q.grad = g, g.float()
        opt.step()
        ref.step()
        counts.append(len(prepared))
        prepared.clear()
    assert counts == [3, 0, 1, 0]
    for p, q in zip(ps, qs):
        master = opt.state[p]["master_param"]
        assert (master - q.detach()).abs().max().item() <= TOL
        assert torch.equal(p.detach().view(torch.int16), master.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("change", ["load_state_dict", "init", "no_grad", "replace_data"])
def test_cpuadam_16bit_params_changed_between_steps_are_stepped_from_the_new_value(change):
    """The fp32 master was never re-read, so the next step undid a change made to a bf16 parameter
    between steps (a model.load_state_dict of other weights: back to the old values, silently;
    helper-33, /tmp/tester17/t07_master_stale.py). The step now starts from the new value, like a
    run whose master was set to it; a checkpoint's weights loaded beside its optimizer state keep
    the exact fp32 master."""
    def run(edit):
        torch.manual_seed(0)
        lin = torch.nn.Linear(8, 8).to(torch.bfloat16)
        opt = zo.CPUAdam(lin.parameters(), lr=1e-2)
        x = torch.randn(4, 8).to(torch.bfloat16)
        for i in range(3):
            if i == 2:
                edit(lin, opt)
            lin(x).float().square().sum().backward()
            opt.step()
            opt.zero_grad()
        return lin, opt

    new = {"weight": torch.full((8, 8), 0.75), "bias": torch.full((8,), -0.5)}

    def edit(lin, opt):
        if change == "load_state_dict":
            lin.load_state_dict({k: v.to(torch.bfloat16) for k, v in new.items()})
        for name, p in lin.named_parameters():
            if change == "init":
                torch.nn.init.constant_(p, new[name].flatten()[0].item())
            elif change == "no_grad":
                with torch.no_grad():
                    p.mul_(0).add_(new[name].to(torch.bfloat16))
            elif change == "replace_data":
                p.data = new[name].to(torch.bfloat16)

    def by_hand(lin, opt):  # what the change means: the master takes the new values too
        for name, p in lin.named_parameters():
            with torch.no_grad():
                p.copy_(new[name])
            opt.state[p]["master_param"].copy_(new[name])

    got, want = run(edit)[0], run(by_hand)[0]
    for (name, a), b in zip(got.named_parameters(), want.parameters()):
        assert torch.equal(a, b), name
        assert (a.float() - new[name]).abs().max().item() < 0.1  # moved from the new value, not the old

    lin, opt = run(lambda lin, opt: None)  # a resume: weights, then the optimizer state, loaded back
    weights, state = {k: v.clone() for k, v in lin.state_dict().items()}, _save_load(opt.state_dict())
    x = torch.randn(4, 8).to(torch.bfloat16)

    def step():
        lin(x).float().square().sum().backward()
        opt.step()
        opt.zero_grad()
        return [opt.state[p]["master_param"].clone() for p in lin.parameters()]
    once = step()
    lin.load_state_dict(weights)
    opt.load_state_dict(state)
    again = step()  # the masters from the state, exact: not the loaded weights' rounded values
    assert all(torch.equal(a, b) for a, b in zip(once, again))

def test_cpuadam_a_16bit_change_to_a_few_elements_leaves_the_others_masters():
    """A constraint that changes a few elements of a bf16 parameter between steps (a clamp under
    no_grad) is taken into their masters; the other elements keep their fp32 bits: the master
    was overwritten whole with the rounded parameter, so such a constraint at every step
    trained in bf16, updates below its resolution lost."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64).to(torch.bfloat16))
    opt = zo.CPUAdam([p], lr=1e-3)
    p.grad = torch.randn(64).to(torch.bfloat16)
    opt.step()
    master = opt.state[p]["master_param"]
    fine = master.clone()
    assert not torch.equal(fine, fine.to(torch.bfloat16).float())  # bits below bf16's resolution
    with torch.no_grad():
        p.clamp_(-1.0, 1.0)
    clamped = fine.abs() > 1.0
    assert 0 < int(clamped.sum()) < 64
    opt.param_groups[0]["lr"] = 0.0  # the next step moves nothing but what the clamp changed
    opt.step()
    assert torch.equal(master[~clamped], fine[~clamped])
    assert torch.equal(master[clamped], fine[clamped].clamp(-1.0, 1.0).to(torch.bfloat16).float())
    assert torch.equal(p.detach(), master.to(torch.bfloat16))


@pytest.mark.parametrize("order", ["optimizer_first", "weights_first"])
def test_cpuadam_16bit_weights_other_than_the_loaded_masters_are_stepped_from(order):
    """A fresh CPUAdam that loaded a state dict took its masters over the bf16 weights loaded
    beside it when they differed (other weights, before or after the optimizer state): the weights
    went from 3.0 to -0.017 in one step, silently (helper-43, t12_bf16_master_after_load.py).
    torch.optim.AdamW steps from the weights; so does CPUAdam now."""
    torch.manual_seed(0)
    src = torch.nn.Linear(8, 8).to(torch.bfloat16)
    opt = zo.CPUAdam(src.parameters(), lr=1e-2)
    x = torch.randn(4, 8).to(torch.bfloat16)
    src(x).float().square().sum().backward()
    opt.step()
    state = opt.state_dict()  # each load below reads its own copy (torch's load shares the step tensors)
    new = {"weight": torch.full((8, 8), 3.0, dtype=torch.bfloat16), "bias": torch.full((8,), -1.0, dtype=torch.bfloat16)}

    def fresh(cls):
        lin = torch.nn.Linear(8, 8).to(torch.bfloat16)
        o = cls(lin.parameters(), lr=1e-2)
        if order == "weights_first":
            lin.load_state_dict(new)
        o.load_state_dict(_save_load(state))
        if order == "optimizer_first":
            lin.load_state_dict(new)
        lin(x).float().square().sum().backward()
        o.step()
        return lin
    got = fresh(zo.CPUAdam)
    # the reference: torch's AdamW on fp32 copies of the weights, rounded to bf16 after the step
    ref = torch.nn.Linear(8, 8)
    ref.load_state_dict({k: v.float() for k, v in new.items()})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_opt.load_state_dict(_save_load(state))
    for p, q in zip(ref.parameters(), got.parameters()):
        p.grad = q.grad.float()
    ref_opt.step()
    for (name, a), b in zip(got.named_parameters(), ref.parameters()):
        assert torch.equal(a, b.detach().to(torch.bfloat16)), name
        assert (a.float() - new[name].float()).abs().max().item() < 0.05, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpuadam_refuses_16bit_parameters_over_the_same_memory(dtype):
    """Each 16-bit parameter steps its own fp32 master, so of two over the same memory the one
    written last dropped the other's update (tester-47 F3: 0.046 off, ~35 fp16 ulp). Refused,
    naming both; views that only interleave (the columns of one matrix) are fine."""
    w = torch.randn(6, 4).to(dtype)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] and param_groups\[1\]\['params'\]\[0\] "
                                         r"are torch.(bfloat16|float16) parameters over the same memory"):
        zo.CPUAdam([{"params": [torch.nn.Parameter(w)]}, {"params": [torch.nn.Parameter(w.t())]}])
    wide = torch.randn(6, 8).to(dtype)
    opt = zo.CPUAdam([torch.nn.Parameter(wide[:, ::2]), torch.nn.Parameter(wide[:, 1::2].t())])
    with pytest.raises(ValueError, match="same memory"):
        opt.add_param_group({"params": [torch.nn.Parameter(wide[2:4])]})
    assert len(opt.param_groups) == 1  # the refused group is not kept


def test_cpuadam_a_strided_16bit_parameter_stays_on_the_steady_path(prepared):
    """A transposed bf16 parameter is stepped by the general (torch-op) path, whose write bumps
    its version: the record of the write is refreshed, so the next steps are not prepared again."""
    torch.manual_seed(1)
    init = torch.randn(12, 20)
    p = torch.nn.Parameter(init.to(torch.bfloat16).t())
    q = torch.nn.Parameter(init.to(torch.bfloat16).float().t())
    assert not p.is_contiguous()
    opt = zo.CPUAdam([p], lr=1e-3, weight_decay=0.0)
    ref = torch.optim.AdamW([q], lr=1e-3, weight_decay=0.0, foreach=False)
    counts = []
    for _ in range(4):
        g = torch.randn(p.shape).to(torch.bfloat16)
        p.grad, q.grad = g, g.float()
        opt.step()
        ref.step()
        counts.append(len(prepared))
        prepared.clear()
    assert counts == [1, 0, 0, 0]
    master = opt.state[p]["master_param"]
    assert (master - q.detach()).abs().max().item() <= TOL
    assert torch.equal(p.detach().contiguous().view(torch.int16), master.to(torch.bfloat16).view(torch.int16))


def test_cpuadam_keeps_no_removed_16bit_parameter_alive():
    """The optimizer's record of its 16-bit writes holds no parameter: once a parameter leaves
    the param groups and the state, it is freed, and its entry with it."""
    import gc
    import weakref
    model = torch.nn.ModuleList([torch.nn.Linear(50, 50).to(torch.bfloat16) for _ in range(3)])
    opt = zo.CPUAdam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    refs = [weakref.ref(p) for p in model.parameters()]
    assert len(opt._written) == 6
    opt.param_groups.clear()
    opt.state.clear()
    opt.add_param_group({"params": list(torch.nn.Linear(4, 4).to(torch.bfloat16).parameters())})
    del model, p
    gc.collect()
    assert [r() for r in refs] == [None] * 6
    assert len(opt._written) == 0
