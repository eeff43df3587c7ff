"""What CPUAdam refuses, and that a refusal changes nothing: decay keys that disagree, options it
cannot do, and a load or a step it cannot take, naming the parameter."""
import pytest
import torch

import zeroinf.optim as zo
from cpu_adam_helpers import TOL


def test_cpuadam_refuses_groups_whose_decay_keys_disagree():
    """CPUAdam exposes torch's ``decoupled_weight_decay`` but stepped by its own ``adamw_mode``:
    setting torch's key to False kept AdamW's decay, 0.021 off torch.optim.Adam after 6 steps
    (helper-43, t15_cpuadam_adam_sd.py). A disagreement is refused, naming both keys; set alike,
    both give torch.optim.Adam's L2 penalty."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16))
    ref = torch.nn.Parameter(w.detach().clone())
    opt = zo.CPUAdam([w], lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.Adam([ref], lr=1e-2, weight_decay=0.1)
    opt.param_groups[0]["decoupled_weight_decay"] = False
    w.grad = torch.randn(16)
    with pytest.raises(ValueError, match=r"param_groups\[0\] has adamw_mode=True but torch's decoupled_weight_decay=False"):
        opt.step()
    opt.param_groups[0]["adamw_mode"] = False
    for _ in range(6):
        g = torch.randn(16)
        w.grad, ref.grad = g, g.clone()
        opt.step()
        ref_opt.step()
    assert (w.detach() - ref.detach()).abs().max().item() <= TOL
    assert opt.state_dict()["param_groups"][0]["decoupled_weight_decay"] is False


def test_cpuadam_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match="amsgrad"):
        zo.CPUAdam([torch.nn.Parameter(torch.zeros(2))], amsgrad=True)
    opt = zo.CPUAdam([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="amsgrad"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "amsgrad": True})
    p = torch.nn.Parameter(torch.zeros(3, device="meta"))
    p.grad = torch.zeros(3, device="meta")
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] is on the meta device .* nothing to step"):
        zo.CPUAdam([p]).step()  # it pointed to AdamW(fused=True) "for accelerator parameters" (tester-44 F6)
    q = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="amsgrad"):  # torch.optim.AdamW's sixth positional argument
        zo.CPUAdam(q, 1e-3, (0.9, 0.999), 1e-8, 0.0, True)
    for kw in ("capturable", "differentiable"):
        with pytest.raises(ValueError, match=f"{kw}=True is not supported"):
            zo.CPUAdam(q, **{kw: True})
    with pytest.raises(ValueError, match=r"invalid lr 1e\+39"):  # torch: "cannot be converted ... without overflow"
        zo.CPUAdam(q, lr=1e39)
    for bad in ("abc", "0.01", torch.tensor([1e-3, 1e-3])):  # Python's and torch's own messages named no option (tester-44 F7)
        with pytest.raises(ValueError, match=r"invalid lr .* \(must be a number or a one-element tensor\)"):
            zo.CPUAdam(q, lr=bad)
    with pytest.raises(ValueError, match="invalid betas"):
        zo.CPUAdam(q, betas=("x", 0.9))


def test_cpuadam_refusals_change_nothing_and_name_the_parameter():
    """A refused load_state_dict (an AdamW amsgrad=True dict) replaced lr, amsgrad and the state
    first, so every later step raised (tester-35 F05); a float64 gradient was named grads[0], the
    op's list index, not the parameter (F06), and was found only after the earlier groups had
    been stepped."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 2)
    src = torch.optim.AdamW(lin.parameters(), lr=0.1, amsgrad=True)
    lin(torch.randn(3, 4)).sum().backward()
    src.step()
    opt = zo.CPUAdam(lin.parameters(), lr=1e-3, weight_decay=0.01)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[lin.weight].items()}
    with pytest.raises(ValueError, match=r"amsgrad=True is not implemented.*param_groups\[0\].*nothing was loaded"):
        opt.load_state_dict(src.state_dict())
    assert opt.param_groups[0]["lr"] == 1e-3 and opt.param_groups[0]["amsgrad"] is False
    assert sorted(opt.state[lin.weight]) == sorted(before)
    assert all(torch.equal(opt.state[lin.weight][k], v) for k, v in before.items())
    good = src.state_dict()
    good["param_groups"][0]["amsgrad"] = False
    for change, what in ((lambda sd: sd["param_groups"][0].update(adamw_mode=True, decoupled_weight_decay=False),
                          r"adamw_mode=True but torch's decoupled_weight_decay=False"),
                         (lambda sd: sd["param_groups"][0].update(capturable=True), r"capturable=True"),
                         (lambda sd: sd["state"][0].update(exp_avg=torch.zeros(5)),
                          r"exp_avg of param_groups\[0\]\['params'\]\[0\] has 5 elements, the parameter 8")):
        sd = {"state": {k: dict(v) for k, v in good["state"].items()},
              "param_groups": [dict(g) for g in good["param_groups"]]}
        change(sd)  # each refused as step() would refuse it, tester-36 F4
        with pytest.raises(ValueError, match=what + r".*nothing was loaded"):
            opt.load_state_dict(sd)
        assert opt.param_groups[0]["lr"] == 1e-3 and all(torch.equal(opt.state[lin.weight][k], v)
                                                        for k, v in before.items())
    opt.step()  # still steps
    assert float(opt.state[lin.weight]["step"]) == 2.0

    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    b.grad_dtype = None  # torch 2.13 allows a gradient of another dtype then
    a.grad, b.grad = torch.ones(3), torch.ones(3, dtype=torch.float64)
    a0 = a.detach().clone()
    opt = zo.CPUAdam([{"params": [a]}, {"params": [torch.nn.Parameter(torch.zeros(1)), b]}])
    with pytest.raises(ValueError, match=r"the gradient of param_groups\[1\]\['params'\]\[1\] has dtype torch.float64"):
        opt.step()
    assert torch.equal(a.detach(), a0) and len(opt.state) == 0  # group 0 was not stepped either
