"""CPUAdam as a torch optimizer, against torch.optim.AdamW/Adam (foreach=False) and a textbook Adam:
options, param groups and schedules, state dicts both ways, closures and odd parameter layouts,
torch's arguments, and Adam or AdamW per group."""
import pytest
import torch

import zeroinf.optim as zo
from cpu_adam_helpers import TOL, _run_pair, _save_load, step_with_torch


@pytest.mark.parametrize("shape", [(1,), (7,), (15,), (16,), (17,), (1023,), (2**20 + 3,), (4, 8, 3)],
                         ids=lambda s: "x".join(map(str, s)))
def test_matches_torch_adamw(shape):
    init = torch.randn(shape)
    grads = [torch.randn(shape) for _ in range(20)]
    ours, ref, oa, ob = _run_pair(init, grads, dict(lr=1e-2, weight_decay=0.01))
    assert (ours - ref).abs().max().item() <= TOL
    sa, sb = oa.state_dict()["state"][0], ob.state_dict()["state"][0]
    assert (sa["exp_avg"] - sb["exp_avg"]).abs().max().item() <= TOL
    assert (sa["exp_avg_sq"] - sb["exp_avg_sq"]).abs().max().item() <= TOL
    assert sa["step"].item() == sb["step"].item() == 20
    if shape == (4, 8, 3):
        assert bool((ours != init).all()), "every element must change"


def _textbook_adam(p, grads, lr, b1, b2, eps, wd, adamw, bias_correction):
    """Independent float32 Adam/AdamW, straight from the formula (the paper's operation order)."""
    p = p.clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    for t, g in enumerate(grads, 1):
        if adamw:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        bc1 = 1 - b1 ** t if bias_correction else 1.0
        bc2 = 1 - b2 ** t if bias_correction else 1.0
        p = p - lr / bc1 * m / ((v / bc2).sqrt() + eps)
    return p


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("wd", [0.0, 0.01])
@pytest.mark.parametrize("bias_correction", [True, False], ids=["bc", "nobc"])
def test_options(adamw, wd, bias_correction):
    n = 1031
    init = torch.randn(n)
    grads = [torch.randn(n) for _ in range(20)]
    kw = dict(lr=1e-3, weight_decay=wd, adamw_mode=adamw, bias_correction=bias_correction)
    p = torch.nn.Parameter(init.clone())
    opt = zo.CPUAdam([p], **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    ref = _textbook_adam(init, grads, 1e-3, 0.9, 0.999, 1e-8, wd, adamw, bias_correction)
    assert (p.detach() - ref).abs().max().item() <= TOL
    if bias_correction:  # torch has no switch for it; where it applies, compare with torch too
        kw.pop("bias_correction")
        ours, theirs, _, _ = _run_pair(init, grads, kw, torch.optim.AdamW if adamw else torch.optim.Adam)
        assert (ours - theirs).abs().max().item() <= TOL


def test_param_groups_scheduler_and_betas_change():
    init1, init2 = torch.randn(33), torch.randn(5, 3)
    grads = [(torch.randn(33), torch.randn(5, 3)) for _ in range(12)]

    def run(cls, **extra):
        a, b = torch.nn.Parameter(init1.clone()), torch.nn.Parameter(init2.clone())
        opt = cls([{"params": [a]}, {"params": [b], "lr": 3e-2}], lr=1e-2, weight_decay=0.01, **extra)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        for i, (ga, gb) in enumerate(grads):
            if i == 5:
                for group in opt.param_groups:
                    group["betas"] = (0.8, 0.99)
            opt.zero_grad()
            a.grad, b.grad = ga.clone(), gb.clone()
            opt.step()
            sched.step()
        return a.detach(), b.detach()

    (a1, b1), (a2, b2) = run(zo.CPUAdam), run(torch.optim.AdamW, foreach=False)
    assert (a1 - a2).abs().max().item() <= TOL and (b1 - b2).abs().max().item() <= TOL
    # the betas change and the two lrs matter: without them the result differs
    (a3, _) = run(torch.optim.AdamW, foreach=False, betas=(0.9, 0.999))
    assert torch.equal(a3, a2)
    assert not torch.allclose(a1, init1, atol=1e-3)


@pytest.mark.parametrize("first", ["torch", "zeroinf"])
def test_state_dict_round_trip(first):
    shapes = [(17,), (4, 5)]
    inits = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(10)]
    kw = dict(lr=1e-2, weight_decay=0.01)

    def make(cls, params):
        return cls(params, foreach=False, **kw) if cls is torch.optim.AdamW else cls(params, **kw)

    def steps(opt, params, gs):
        for g in gs:
            for p, gi in zip(params, g):
                p.grad = gi.clone()
            opt.step()

    ref = [torch.nn.Parameter(t.clone()) for t in inits]
    ref_opt = make(torch.optim.AdamW, ref)
    steps(ref_opt, ref, grads)

    cls1, cls2 = (torch.optim.AdamW, zo.CPUAdam) if first == "torch" else (zo.CPUAdam, torch.optim.AdamW)
    params = [torch.nn.Parameter(t.clone()) for t in inits]
    opt1 = make(cls1, params)
    steps(opt1, params, grads[:5])
    opt2 = make(cls2, params)
    opt2.load_state_dict(_save_load(opt1.state_dict()))
    steps(opt2, params, grads[5:])
    for p, r in zip(params, ref):
        assert (p.detach() - r.detach()).abs().max().item() <= TOL
    assert opt2.state_dict()["state"][0]["step"].item() == 10


def test_cpuadam_closure_zero_grad_and_noncontiguous_param():
    w = torch.nn.Parameter(torch.randn(6, 4).t())  # a transposed, non-contiguous parameter
    w_ref = torch.nn.Parameter(w.detach().clone())
    x = torch.randn(5, 6)
    opt = zo.CPUAdam([w], lr=1e-2)
    ref = torch.optim.AdamW([w_ref], lr=1e-2, foreach=False)  # both at their default weight decay
    for _ in range(3):
        for o, param in ((opt, w), (ref, w_ref)):
            def closure(param=param, o=o):
                o.zero_grad()
                loss = (x @ param.t()).square().sum()
                loss.backward()
                return loss
            loss = o.step(closure)
            assert torch.is_tensor(loss)
    assert (w.detach() - w_ref.detach()).abs().max().item() <= TOL
    opt.zero_grad()
    assert w.grad is None


@pytest.mark.parametrize("order", ["view first", "view last"])
def test_cpuadam_parameters_over_one_storage_one_transposed(order):
    """Two parameters over one storage, one a transposed view, in one group, beside contiguous
    ones: torch steps them one after the other, the later reading the earlier's new values.
    CPUAdam stepped the view's contiguous copy made before the group's op call and copied it
    back after it (tester-44 F3: 0.0355 off after 4 steps)."""
    torch.manual_seed(0)
    base, other = torch.randn(4, 4), torch.randn(3)

    def params(b, o):
        pair = [torch.nn.Parameter(b.t()), torch.nn.Parameter(b)]
        return [torch.nn.Parameter(o)] + (pair if order == "view first" else pair[::-1])
    b_ref, o_ref, start = base.clone(), other.clone(), base.clone()
    step_with_torch(params(base, other), params(b_ref, o_ref), steps=4)
    assert (base - b_ref).abs().max().item() <= TOL and (other - o_ref).abs().max().item() <= TOL
    assert (base - start).abs().max().item() > 1e-2  # the shared storage was stepped


def test_cpuadam_takes_torch_adamws_arguments_positional_and_keyword():
    """CPUAdam's sixth positional argument was adamw_mode (torch's is amsgrad): AdamW's positional
    call with weight decay became L2 Adam silently (8e-3 apart after 20 steps; helper-33,
    /tmp/tester17/t11_positional.py); foreach/fused raised TypeError. A state dict with the step
    as a Python number (torch before 1.12) failed at the next step."""
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(100))
    b = torch.nn.Parameter(a.detach().clone())
    opt = zo.CPUAdam([a], 1e-2, (0.9, 0.999), 1e-8, 0.1, False, foreach=False, fused=None, maximize=False)
    ref = torch.optim.AdamW([b], 1e-2, (0.9, 0.999), 1e-8, 0.1, False, foreach=False)
    for _ in range(20):
        g = torch.randn(100)
        a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    assert (a.detach() - b.detach()).abs().max().item() <= TOL
    sd = opt.state_dict()
    sd["state"][0]["step"] = 20  # the old format
    opt.load_state_dict(sd)
    ref.load_state_dict(dict(ref.state_dict(), state={0: dict(ref.state_dict()["state"][0], step=20)}))
    a.grad, b.grad = torch.ones(100), torch.ones(100)
    opt.step()
    ref.step()
    assert opt.state[a]["step"].item() == 21 and (a.detach() - b.detach()).abs().max().item() <= TOL


def test_a_loaded_integer_step_steps_as_torch_adamw():
    """A state dict whose ``step`` is an int64 tensor (``torch.tensor(n)``, which torch.optim.AdamW
    steps): CPUAdam moved the parameters and then raised a raw "Float can't be cast to Long" before
    counting the step, so a retry moved them again with the same bias correction (tester-44 F1)."""
    runs = []
    for cls in (torch.optim.AdamW, zo.CPUAdam):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(4))
        opt = cls([p], lr=0.1, weight_decay=0.01)
        p.grad = torch.ones(4)
        opt.step()
        sd = opt.state_dict()
        sd["state"][0]["step"] = torch.tensor(1)
        opt.load_state_dict(sd)
        for _ in range(2):
            opt.step()
        runs.append((p.detach().clone(), float(opt.state[p]["step"])))
    assert runs[1][1] == runs[0][1] == 3.0
    assert torch.allclose(runs[1][0], runs[0][0], atol=1e-6, rtol=0)


def test_per_group_adam_or_adamw_and_duplicate_parameters():
    """A group setting ``adamw_mode`` (or torch's ``decoupled_weight_decay``) alone got the other
    key from the defaults, and every step refused the disagreement (tester-44 F2): the group's
    one key now sets both, and the group steps as torch.optim.Adam (L2) beside an AdamW group. A
    parameter listed twice stepped twice with one bias correction (F4, 0.0486 off torch's order):
    refused, naming it."""
    torch.manual_seed(0)
    w = [torch.nn.Parameter(torch.randn(5)) for _ in range(4)]
    ref = [torch.nn.Parameter(t.detach().clone()) for t in w]
    opt = zo.CPUAdam([{"params": w[:2], "adamw_mode": False}, {"params": [w[2]], "decoupled_weight_decay": False},
                      {"params": [w[3]]}], lr=0.1, weight_decay=0.1)
    torch_l2 = torch.optim.Adam(ref[:3], lr=0.1, weight_decay=0.1, foreach=False)
    torch_w = torch.optim.AdamW(ref[3:], lr=0.1, weight_decay=0.1, foreach=False)
    for s in range(3):
        for a, b in zip(w, ref):
            a.grad = torch.full_like(a, 0.5 + s)
            b.grad = a.grad.clone()
        opt.step()
        torch_l2.step()
        torch_w.step()
    assert max((a - b).abs().max().item() for a, b in zip(w, ref)) <= 1e-6
    assert [(g["adamw_mode"], g["decoupled_weight_decay"]) for g in opt.param_groups] == [(False, False)] * 2 + [(True, True)]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\] lists one parameter twice \(positions 0 and 2\)"):
        zo.CPUAdam([w[0], w[1], w[0]])
    with pytest.raises(ValueError, match="more than one parameter group"):  # torch's own check
        zo.CPUAdam([{"params": [w[0]]}, {"params": [w[0]]}])


def test_cpuadam_defaults_are_torch_adamw_s():
    """A drop-in for torch.optim.AdamW with no other change: the same defaults (weight decay
    1e-2, not DeepSpeedCPUAdam's 0), so `CPUAdam(params, lr=...)` steps as `AdamW(params, lr=...)`."""
    import inspect
    ours, torch_s = (inspect.signature(c).parameters for c in (zo.CPUAdam, torch.optim.AdamW))
    for name in ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"):
        assert ours[name].default == torch_s[name].default, name
    a = torch.nn.Parameter(torch.randn(33) * 3)
    b = torch.nn.Parameter(a.detach().clone())
    opt, ref = zo.CPUAdam([a], lr=1e-2), torch.optim.AdamW([b], lr=1e-2, foreach=False)
    for _ in range(5):
        g = torch.randn(33)
        a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    assert (a - b).abs().max().item() <= 1e-6
