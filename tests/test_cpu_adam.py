"""The fused CPU Adam op and CPUAdam against torch.optim.AdamW/Adam (foreach=False) and each other."""
import io
import os
import subprocess
import sys
import threading

import pytest
import torch

import zeroinf.optim as zo
from zeroinf.ops import load_op

TOL = 1e-6  # fp32 max abs difference to torch after 20 steps
ISAS = ("avx512", "avx2", "scalar")



def step_with_torch(ours, ref, steps: int) -> None:
    """``steps`` steps of CPUAdam over ``ours`` and torch AdamW (foreach off) over ``ref``, the
    same random gradient given to both lists' matching parameters each step (lr 1e-2, wd 0.01)."""
    opt = zo.CPUAdam(ours, lr=1e-2, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.01, foreach=False)
    for _ in range(steps):
        for p, q in zip(ours, ref):
            q.grad = torch.randn(q.shape)
            p.grad = q.grad.clone()
        opt.step()
        ref_opt.step()

def _supported_isas():
    info = load_op("adam").isa_info()
    return [isa for isa in ISAS if info["unsupported"][isa] == ""]


def _run_pair(init, grads, opt_kwargs, torch_cls=torch.optim.AdamW, hook=None):
    """Step CPUAdam and torch_cls(foreach=False) on copies of `init` with the same grads.

    Returns (ours, theirs, our_opt, their_opt). `hook(step_index, opt)` runs before each step
    on both optimizers (to change betas, etc.).
    """
    a = torch.nn.Parameter(init.clone())
    b = torch.nn.Parameter(init.clone())
    oa = zo.CPUAdam([a], **opt_kwargs)
    tk = dict(opt_kwargs)
    tk.pop("adamw_mode", None)
    ob = torch_cls([b], foreach=False, **tk)
    for i, g in enumerate(grads):
        if hook is not None:
            hook(i, oa)
            hook(i, ob)
        a.grad = g.clone()
        b.grad = g.clone()
        oa.step()
        ob.step()
    return a.detach(), b.detach(), oa, ob


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


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_low_precision_grads(grad_dtype):
    """bf16/fp16 grads are widened exactly: same result as torch stepping with grad.float()."""
    n = 1027
    init = torch.randn(n)
    grads = [torch.randn(n).to(grad_dtype) for _ in range(20)]
    p, m, v = init.clone(), torch.zeros(n), torch.zeros(n)
    for step, g in enumerate(grads, 1):
        zo.adam_step(p, g, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    _, ref, _, _ = _run_pair(init, [g.float() for g in grads], dict(lr=1e-2, weight_decay=0.01))
    assert (p - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 1_000_003])
def test_fused_output_bit_equal(n, out_dtype, monkeypatch):
    for isa in _supported_isas():
        monkeypatch.setenv(zo.ISA_ENV, isa)
        p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
        out = torch.full((n,), 7.0, dtype=out_dtype)
        for step in (1, 2):
            zo.adam_step(p, torch.randn(n), m, v, step=step, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8,
                         weight_decay=0.0, params_out=out)
        assert torch.equal(out.view(torch.int16), p.to(out_dtype).view(torch.int16)), isa


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fused_output_special_values(out_dtype, monkeypatch):
    """NaN, inf, signed zeros, subnormals, overflow and exact ties cast exactly as torch casts them."""
    bits = [0x7FC00000, 0xFFC00000, 0x7FC12345, 0x7F800000, 0xFF800000, 0x00000000, 0x80000000,
            0x00000001, 0x80400000, 0x3F808000, 0x3F818000, 0x3F800FFF, 0x477FF000, 0x477FEFFF,
            0x33000000, 0x33000001, 0x387FE000, 0x387FF000, 0x38800000, 0x7F7FFFFF]
    master = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    master = torch.cat([master, torch.randn(37) * 1e4, torch.randn(37) * 1e-6])
    n = master.numel()
    for isa in _supported_isas():
        monkeypatch.setenv(zo.ISA_ENV, isa)
        p = master.clone()
        out = torch.zeros(n, dtype=out_dtype)
        # lr = 0, zero grads: the master keeps its bits and only the cast is exercised.
        zo.adam_step(p, torch.zeros(n), torch.zeros(n), torch.zeros(n), step=1, lr=0.0, beta1=0.9,
                     beta2=0.999, eps=1e-8, weight_decay=0.0, params_out=out)
        assert torch.equal(p.view(torch.int32), master.view(torch.int32)), isa
        assert torch.equal(out.view(torch.int16), master.to(out_dtype).view(torch.int16)), isa


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


def test_grad_scale_divides():
    n = 999
    init, g = torch.randn(n), torch.randn(n)
    p1, m1, v1 = init.clone(), torch.zeros(n), torch.zeros(n)
    p2, m2, v2 = init.clone(), torch.zeros(n), torch.zeros(n)
    kw = dict(step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    zo.adam_step(p1, g * 1024.0, m1, v1, grad_scale=1024.0, **kw)  # power of two: exact
    zo.adam_step(p2, g, m2, v2, **kw)
    assert torch.equal(p1, p2) and torch.equal(m1, m2) and torch.equal(v1, v2)


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


def test_sub_range_calls_equal_single_call():
    n = 3001
    init = torch.randn(n)
    grads = [torch.randn(n) for _ in range(5)]
    p = torch.nn.Parameter(init.clone())
    opt = zo.CPUAdam([p], lr=1e-2, weight_decay=0.01)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    assert opt.state[p]["step"].item() == 5
    q, m, v = init.clone(), torch.zeros(n), torch.zeros(n)
    cuts = [0, 1000, 2017, n]
    step = 0
    for g in grads:
        step += 1
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            zo.adam_step(q[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], step=step, lr=1e-2, beta1=0.9, beta2=0.999,
                         eps=1e-8, weight_decay=0.01)
    assert step == 5
    assert torch.equal(q, p.detach()) and torch.equal(m, opt.state[p]["exp_avg"])


def _save_load(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


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


def test_isa_paths_bit_identical_and_fallback_close(monkeypatch):
    isas = _supported_isas()
    assert "scalar" in isas
    n = 4099
    init = torch.randn(n)
    grads = {dt: [torch.randn(n).to(dt) for _ in range(4)] for dt in (torch.float32, torch.bfloat16, torch.float16)}
    for gdt, gl in grads.items():
        for odt in (None, torch.bfloat16, torch.float16):
            results = {}
            for isa in isas + ["reference"]:
                monkeypatch.setenv(zo.ISA_ENV, "auto" if isa == "reference" else isa)
                p, m, v = init.clone(), torch.zeros(n), torch.zeros(n)
                out = torch.zeros(n, dtype=odt) if odt is not None else None
                fn = zo.adam_step_reference if isa == "reference" else zo.adam_step
                for step, g in enumerate(gl, 1):
                    fn(p, g, m, v, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01,
                       adamw_mode=(step % 2 == 0), grad_scale=2.0 if gdt == torch.float16 else 1.0,
                       params_out=out)
                results[isa] = (p, m, v, out)
            base = results[isas[0]]
            for isa in isas[1:]:
                for x, y in zip(base, results[isa]):
                    if x is not None:
                        assert torch.equal(x.view(torch.int16 if x.dtype != torch.float32 else torch.int32),
                                           y.view(torch.int16 if y.dtype != torch.float32 else torch.int32)), (isa, gdt, odt)
            ref = results["reference"]
            assert (base[0] - ref[0]).abs().max().item() <= TOL
            assert (base[1] - ref[1]).abs().max().item() <= TOL


def test_forced_isa_errors(monkeypatch):
    p, m, v = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    monkeypatch.setenv(zo.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="ZEROINF_ADAM_ISA"):
        zo.adam_step(p, p.clone(), m, v, **kw)


@pytest.mark.parametrize("which", ["params", "grads", "exp_avg", "exp_avg_sq", "params_out"])
@pytest.mark.parametrize("fault", ["noncontig", "device", "dtype", "numel"])
def test_bad_buffers_raise_value_error_naming_them(which, fault):
    n = 12
    bufs = dict(params=torch.randn(n), grads=torch.randn(n), exp_avg=torch.zeros(n), exp_avg_sq=torch.zeros(n),
                params_out=torch.zeros(n, dtype=torch.bfloat16))
    good = bufs[which]
    if fault == "noncontig":
        bad = torch.zeros(2 * n, dtype=good.dtype)[::2]
    elif fault == "device":
        bad = torch.zeros(n, dtype=good.dtype, device="meta")
    elif fault == "dtype":
        bad = torch.zeros(n, dtype=torch.float64)
    else:
        bad = torch.zeros(n + 1, dtype=good.dtype)
    if which == "params" and fault == "numel":
        bad = torch.zeros(n + 1)  # then every other buffer mismatches; the first named is grads
    bufs[which] = bad
    before = {k: t.clone() for k, t in bufs.items() if t.device.type == "cpu"}
    name = "grads" if (which, fault) == ("params", "numel") else which
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match=name):
        zo.adam_step(bufs["params"], bufs["grads"], bufs["exp_avg"], bufs["exp_avg_sq"], step=1,
                     params_out=bufs["params_out"], **kw)
    # the C++ op checks on its own too (a caller that bypasses the Python wrapper)
    with pytest.raises(ValueError, match=name):
        load_op("adam").adam_step(bufs["params"], bufs["grads"], bufs["exp_avg"], bufs["exp_avg_sq"],
                                  bufs["params_out"], 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, True, 1.0, "auto")
    for k, t in before.items():  # nothing was written
        assert torch.equal(bufs[k], t), k


def test_cpuadam_bf16_params_keep_fp32_master():
    n = 513
    init = torch.randn(n)
    p = torch.nn.Parameter(init.to(torch.bfloat16))
    opt = zo.CPUAdam([p], lr=1e-3)
    q = torch.nn.Parameter(init.to(torch.bfloat16).float())
    ref = torch.optim.AdamW([q], lr=1e-3, weight_decay=0.0, foreach=False)
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


def test_cpuadam_closure_zero_grad_and_noncontiguous_param():
    w = torch.nn.Parameter(torch.randn(6, 4).t())  # a transposed, non-contiguous parameter
    w_ref = torch.nn.Parameter(w.detach().clone())
    x = torch.randn(5, 6)
    opt = zo.CPUAdam([w], lr=1e-2)
    ref = torch.optim.AdamW([w_ref], lr=1e-2, weight_decay=0.0, foreach=False)
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


def test_disabled_ops_fall_back_with_one_warning():
    code = (
        "import warnings, torch, zeroinf.optim as zo\n"
        "torch.manual_seed(0)\n"
        "p=torch.nn.Parameter(torch.randn(50)); q=torch.nn.Parameter(p.detach().clone())\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    o=zo.CPUAdam([p], lr=1e-2, weight_decay=0.01); r=torch.optim.AdamW([q], lr=1e-2, foreach=False)\n"
        "    for _ in range(20):\n"
        "        g=torch.randn(50); p.grad=g.clone(); q.grad=g.clone(); o.step(); r.step()\n"
        "msgs=[str(x.message) for x in w if 'unavailable' in str(x.message)]\n"
        "assert len(msgs)==1 and 'ZEROINF_DISABLE_OPS' in msgs[0], msgs\n"
        "print((p-q).abs().max().item())\n"
    )
    env = dict(os.environ, ZEROINF_DISABLE_OPS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.strip()) <= TOL


def test_list_form_equals_single_calls_and_checks_all_first():
    sizes = [5, 16, 33]
    kw = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    ps = [torch.randn(s) for s in sizes]
    gs = [torch.randn(s).to(torch.bfloat16) for s in sizes]
    ref = [(p.clone(), torch.zeros_like(p), torch.zeros_like(p)) for p in ps]
    outs = [None, torch.zeros(16, dtype=torch.float16), None]
    ref_outs = [None, torch.zeros(16, dtype=torch.float16), None]
    mine = [(p.clone(), torch.zeros_like(p), torch.zeros_like(p)) for p in ps]
    for i, ((p, m, v), g) in enumerate(zip(ref, gs)):
        zo.adam_step(p, g, m, v, step=i + 1, params_out=ref_outs[i], **kw)
    zo.adam_step_list([t[0] for t in mine], gs, [t[1] for t in mine], [t[2] for t in mine], steps=[1, 2, 3],
                      params_outs=outs, **kw)
    for a, b in zip(mine, ref):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(outs[1], ref_outs[1])
    before = [t[0].clone() for t in mine]
    bad_v = [mine[0][2], mine[1][2], torch.zeros(34)]
    with pytest.raises(ValueError, match=r"exp_avg_sq\[2\]"):
        zo.adam_step_list([t[0] for t in mine], gs, [t[1] for t in mine], bad_v, steps=[1, 2, 3], **kw)
    assert all(torch.equal(t[0], b) for t, b in zip(mine, before)), "nothing written before the check failed"


def test_limit_thread_parallelism_caps_the_calling_thread_only():
    """A background thread capped at one thread steps the same bits as the main thread on four;
    the main thread and threads started afterwards keep the process's count (torch.set_num_threads
    called from the background thread would have changed theirs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        n = 2**20 + 3
        init, grad = torch.randn(n), torch.randn(n)
        kw = dict(step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
        main = [init.clone(), torch.zeros(n), torch.zeros(n)]
        zo.adam_step(main[0], grad, main[1], main[2], **kw)
        seen, capped = {}, [init.clone(), torch.zeros(n), torch.zeros(n)]

        def work():
            seen["returned"] = zo.limit_thread_parallelism(1)
            seen["threads"] = torch.get_num_threads()
            zo.adam_step(capped[0], grad, capped[1], capped[2], **kw)
            seen["after_step"] = torch.get_num_threads()

        t = threading.Thread(target=work)
        t.start()
        t.join()
        assert seen == {"returned": 1, "threads": 1, "after_step": 1}
        assert torch.get_num_threads() == 4
        later = threading.Thread(target=lambda: seen.update(later=torch.get_num_threads()))
        later.start()
        later.join()
        assert seen["later"] == 4
        for a, b in zip(main, capped):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        with pytest.raises(ValueError, match="n must be >= 1, got 0"):
            zo.limit_thread_parallelism(0)
        for bad in (2.5, True, "3"):
            with pytest.raises(TypeError, match="n must be an int"):
                zo.limit_thread_parallelism(bad)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc/self/task")
def test_a_capped_thread_starts_no_wider_team_for_matmuls_or_element_wise_ops():
    """A fresh thread's first parallel op starts its team's threads (OpenMP's for element-wise
    ops, MKL's for matmuls where torch has MKL): capped at one, it starts none, and a cap above
    the thread's count leaves the count as it was (helper-47 t01, t02)."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        a, b, big = torch.randn(512, 512), torch.randn(512, 512), torch.randn(1 << 22)
        seen = {}

        def started(fn):
            n0 = len(os.listdir("/proc/self/task"))
            fn()
            return len(os.listdir("/proc/self/task")) - n0

        def capped():
            seen["cap"] = zo.limit_thread_parallelism(1)
            seen["matmul"] = started(lambda: torch.mm(a, b))
            seen["add"] = started(lambda: big.add_(1.0))

        def uncapped():
            seen["above"] = zo.limit_thread_parallelism(64)
            seen["matmul_uncapped"] = started(lambda: torch.mm(a, b))

        for fn in (capped, uncapped):
            t = threading.Thread(target=fn)
            t.start()
            t.join()
        assert seen["above"] == 4 and seen["matmul_uncapped"] > 0, seen  # the count test can see teams start
        assert (seen["cap"], seen["matmul"], seen["add"]) == (1, 0, 0), seen
    finally:
        torch.set_num_threads(before)


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
