"""CPUAdam's one-region step over a flat work list of all tensors and param groups, against
torch.optim.AdamW/Adam (foreach=False) and against one adam_step call per tensor."""
import pytest
import torch

import zeroinf.optim as zo
from cpu_adam_helpers import step_with_torch

TOL = 1e-6  # fp32 max abs difference to torch after a few steps (as tests/cpu_adam_helpers.py)
# odd sizes around the op's 16 Ki-element chunk and SIMD widths; empty and tiny tensors are packed
# with others into one work item
SIZES = [0, 1, 7, 16, 17, 3, 0, 16383, 16384, 16385, 5, 40_001, 2, 33, 1023]
GROUPS = [dict(lr=1e-2, weight_decay=0.01), dict(lr=3e-3, weight_decay=0.0), dict(lr=2e-2, weight_decay=0.1)]


def _grouped(params):
    """Split `params` round-robin over the GROUPS settings, as param-group dicts."""
    return [dict(params=params[i::len(GROUPS)], **kw) for i, kw in enumerate(GROUPS)]


def _grads(steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in SIZES] for _ in range(steps)]


def test_many_odd_tensors_in_several_groups_match_torch_adamw():
    torch.manual_seed(0)
    init = [torch.randn(s) for s in SIZES]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    opt = zo.CPUAdam(_grouped(ours))
    ref_opt = torch.optim.AdamW(_grouped(ref), foreach=False)
    for i, gs in enumerate(_grads(5)):
        if i == 3:  # a scheduler-style edit between steps reaches only its group
            opt.param_groups[1]["lr"] = ref_opt.param_groups[1]["lr"] = 5e-2
        for p, q, g in zip(ours, ref, gs):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    for p, q, t in zip(ours, ref, init):
        a, b = opt.state[p], ref_opt.state[q]
        assert a["step"].item() == b["step"].item() == 5
        if p.numel():
            assert (p.detach() - q.detach()).abs().max().item() <= TOL
            assert (a["exp_avg_sq"] - b["exp_avg_sq"]).abs().max().item() <= TOL
            assert not torch.equal(p.detach(), t), "every non-empty tensor is stepped"


def test_adam_and_adamw_groups_and_tensors_without_grads_in_one_step():
    torch.manual_seed(1)
    init = [torch.randn(s) for s in SIZES]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    opt = zo.CPUAdam([{"params": ours[:7], "adamw_mode": False}, {"params": ours[7:]}], lr=1e-2, weight_decay=0.1)
    ref_l2 = torch.optim.Adam(ref[:7], lr=1e-2, weight_decay=0.1, foreach=False)
    ref_w = torch.optim.AdamW(ref[7:], lr=1e-2, weight_decay=0.1, foreach=False)
    for s, gs in enumerate(_grads(4, seed=1)):
        for i, (p, q, g) in enumerate(zip(ours, ref, gs)):
            # tensor 2 and 9 have no gradient at step 1: they keep their values and step counts
            grad = None if (s == 1 and i in (2, 9)) else g
            p.grad = None if grad is None else grad.clone()
            q.grad = None if grad is None else grad.clone()
        opt.step()
        ref_l2.step()
        ref_w.step()
    assert max((p - q).abs().max().item() for p, q in zip(ours, ref) if p.numel()) <= TOL
    assert opt.state[ours[2]]["step"].item() == 3 and opt.state[ours[3]]["step"].item() == 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_params_in_several_groups_keep_fp32_masters_as_torch_steps_fp32(dtype):
    torch.manual_seed(2)
    init = [torch.randn(s).to(dtype) for s in SIZES]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    ref = [torch.nn.Parameter(t.float()) for t in init]
    opt = zo.CPUAdam(_grouped(ours))
    ref_opt = torch.optim.AdamW(_grouped(ref), foreach=False)
    for gs in _grads(4, seed=2):
        for p, q, g in zip(ours, ref, gs):
            p.grad = g.to(dtype)
            q.grad = p.grad.float()
        opt.step()
        ref_opt.step()
    for p, q in zip(ours, ref):
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32
        if p.numel():
            assert (master - q.detach()).abs().max().item() <= TOL
        assert torch.equal(p.detach(), master.to(dtype)), "the parameter is its master rounded"


def test_overlapping_contiguous_params_are_stepped_in_list_order():
    """Two contiguous parameters over overlapping memory of one storage, between others: torch
    steps them one after the other, the later reading the earlier's new values; the op's work
    list puts the later one in a phase after the earlier one's."""
    torch.manual_seed(3)
    base, other = torch.randn(40_000), torch.randn(17)
    b_ref, o_ref = base.clone(), other.clone()

    def params(b, o):
        return [torch.nn.Parameter(o), torch.nn.Parameter(b[:30_000]), torch.nn.Parameter(b[10_000:])]
    step_with_torch(params(base, other), params(b_ref, o_ref), steps=3)
    assert (base - b_ref).abs().max().item() <= TOL and (other - o_ref).abs().max().item() <= TOL


def test_adam_step_groups_equals_one_adam_step_per_tensor():
    torch.manual_seed(4)
    groups = [zo.AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01),
              zo.AdamHyper(lr=3e-2, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1, adamw_mode=False),
              zo.AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, bias_correction=False)]
    k = len(SIZES)
    group_of = [i % 3 for i in range(k)]
    steps = [1 + i % 4 for i in range(k)]
    grads = [torch.randn(s).to(torch.bfloat16) for s in SIZES]

    def fresh():
        torch.manual_seed(5)
        ps = [torch.randn(s) for s in SIZES]
        outs = [torch.zeros(s, dtype=torch.bfloat16) if i % 2 else None for i, s in enumerate(SIZES)]
        return ps, [torch.rand(s) for s in SIZES], [torch.rand(s) for s in SIZES], outs
    mine, ref = fresh(), fresh()
    zo.adam_step_groups(mine[0], grads, mine[1], mine[2], steps=steps, group_of=group_of, groups=groups,
                        grad_scale=2.0, params_outs=mine[3])
    for i in range(k):
        zo.adam_step(ref[0][i], grads[i], ref[1][i], ref[2][i], step=steps[i], grad_scale=2.0, params_out=ref[3][i],
                     **groups[group_of[i]]._asdict())
    for a, b in zip(mine, ref):
        assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))
    before = [t.clone() for t in mine[0]]
    with pytest.raises(ValueError, match=r"group_of\[4\] is 3; there are 3 groups"):
        zo.adam_step_groups(mine[0], grads, mine[1], mine[2], steps=steps, groups=groups,
                            group_of=group_of[:4] + [3] + group_of[5:])
    assert all(torch.equal(t, b) for t, b in zip(mine[0], before)), "nothing written before the check failed"


def _counted_case(seed):
    """Buffers for step_counted over SIZES: fp32 params, bf16 grads, half with a bf16 output."""
    torch.manual_seed(seed)
    ps = [torch.randn(s) for s in SIZES]
    outs = [torch.zeros(s, dtype=torch.bfloat16) if i % 2 else None for i, s in enumerate(SIZES)]
    return ps, [torch.rand(s) for s in SIZES], [torch.rand(s) for s in SIZES], outs


def test_step_counted_steps_with_each_count_plus_one_then_counts():
    """step_counted reads each tensor's torch-style step count, steps with count + 1 and stores
    the new counts: the same bits as adam_step_groups given those step numbers."""
    from zeroinf.optim.functional import step_counted
    groups = [zo.AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01),
              zo.AdamHyper(lr=3e-2, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.1, adamw_mode=False)]
    k = len(SIZES)
    group_of = [i % 2 for i in range(k)]
    counts = [torch.tensor(float(i % 5)) for i in range(k)]
    grads = [torch.randn(s).to(torch.bfloat16) for s in SIZES]
    mine, ref = _counted_case(6), _counted_case(6)
    assert step_counted(mine[0], grads, mine[1], mine[2], mine[3], counts, group_of, groups)
    zo.adam_step_groups(ref[0], grads, ref[1], ref[2], steps=[1 + i % 5 for i in range(k)], group_of=group_of,
                        groups=groups, params_outs=ref[3])
    for a, b in zip(mine, ref):
        assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))
    assert [c.item() for c in counts] == [float(1 + i % 5) for i in range(k)]


@pytest.mark.parametrize("bad, match", [
    (lambda c: c.__setitem__(3, torch.tensor(2.5)), r"step_counts\[3\] is 2.5; a step count is a whole number"),
    (lambda c: c.__setitem__(4, torch.tensor(-1.0)), r"step_counts\[4\] is -1"),
    (lambda c: c.__setitem__(2, torch.tensor(float("inf"))), r"step_counts\[2\] is inf"),
    (lambda c: c.__setitem__(5, torch.tensor(2, dtype=torch.int64)), r"step_counts\[5\] must be a one-element float32"),
    (lambda c: c.__setitem__(6, torch.zeros(2)), r"step_counts\[6\] must be a one-element float32"),
])
def test_step_counted_refuses_a_bad_count_before_writing_anything(bad, match):
    from zeroinf.optim.functional import step_counted
    k = len(SIZES)
    counts = [torch.tensor(1.0) for _ in range(k)]
    bad(counts)
    ps, ms, vs, outs = _counted_case(7)
    before = [t.clone() for t in ps + ms + vs]
    kept = [c.clone() for c in counts]
    with pytest.raises(ValueError, match=match):
        step_counted(ps, [torch.randn(s) for s in SIZES], ms, vs, outs, counts, [0] * k,
                     [zo.AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.0)])
    assert all(torch.equal(a, b) for a, b in zip(ps + ms + vs, before))
    assert all(torch.equal(a, b) for a, b in zip(counts, kept))


def test_step_counts_from_2_24_stay_as_torch_adamw_keeps_them():
    """A float32 count of 2^24 cannot grow by one: it stays (torch.optim.AdamW's state["step"]
    does the same), and the step is taken, not refused."""
    torch.manual_seed(10)
    mine = torch.nn.Parameter(torch.randn(40))
    ref = torch.nn.Parameter(mine.detach().clone())
    opt = zo.CPUAdam([mine], lr=1e-2, weight_decay=0.01)
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.01, foreach=False)
    for o, p in ((opt, mine), (ref_opt, ref)):
        p.grad = torch.ones(40)
        o.step()
        o.state[p]["step"].fill_(2.0 ** 24)
    for _ in range(2):
        mine.grad, ref.grad = torch.full((40,), 0.5), torch.full((40,), 0.5)
        opt.step()
        ref_opt.step()
    assert opt.state[mine]["step"].item() == ref_opt.state[ref]["step"].item() == 2.0 ** 24
    assert (mine - ref).abs().max().item() <= TOL


def test_step_counted_leaves_a_list_with_a_strided_buffer_to_the_caller():
    """A non-contiguous buffer anywhere in the list: nothing stepped, no count moved, False."""
    from zeroinf.optim.functional import step_counted
    k = len(SIZES)
    ps, ms, vs, outs = _counted_case(8)
    ps[-1] = torch.randn(SIZES[-1] * 2)[::2]
    counts = [torch.tensor(3.0) for _ in range(k)]
    before = [t.clone() for t in ps + ms + vs]
    assert not step_counted(ps, [torch.randn(s) for s in SIZES], ms, vs, outs, counts, [0] * k,
                            [zo.AdamHyper(1e-2, 0.9, 0.999, 1e-8, 0.0)])
    assert all(torch.equal(a, b) for a, b in zip(ps + ms + vs, before))
    assert all(c.item() == 3.0 for c in counts)


def test_cpu_adam_with_one_transposed_parameter_matches_torch_and_counts_every_step():
    """One strided parameter sends the whole step down the general path: the same result as
    torch.optim.AdamW, and every parameter's step count still advances once per step."""
    torch.manual_seed(9)
    mine = [torch.nn.Parameter(torch.randn(6, 4).t()), torch.nn.Parameter(torch.randn(300)),
            torch.nn.Parameter(torch.randn(17))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in mine]
    assert not mine[0].is_contiguous()
    opt = zo.CPUAdam(mine, lr=1e-2, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.01, foreach=False)
    for _ in range(3):
        for p, q in zip(mine, ref):
            q.grad = torch.randn(q.shape)
            p.grad = q.grad.clone()
        opt.step()
        ref_opt.step()
    assert max((a - b).abs().max().item() for a, b in zip(mine, ref)) <= TOL
    assert [opt.state[p]["step"].item() for p in mine] == [3.0, 3.0, 3.0]


def _two_params(strided: bool):
    """Two 3x4 fp32 parameters; the second a transposed 4x3 one (not contiguous) if ``strided``."""
    torch.manual_seed(11)
    second = torch.randn(4, 3).t() if strided else torch.randn(3, 4)
    return [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(second)]


@pytest.mark.parametrize("strided", [False, True])
def test_a_bad_step_count_is_refused_naming_its_parameter_before_anything_is_stepped(strided):
    """Both paths (one op call; contiguous copies when a buffer is strided) check every count
    first and name the parameter; a half-applied step would step the others twice on a retry."""
    ps = _two_params(strided)
    opt = zo.CPUAdam(ps, lr=1e-2, weight_decay=0.0)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    for bad, match in ((torch.tensor(-1.0), r"is -1.0; a step count is a whole number"),
                       (torch.tensor(2.5), r"is 2.5"), (torch.tensor(float("nan")), r"is nan"),
                       (torch.zeros(2), r"must be a one-element float32 CPU tensor")):
        opt.state[ps[1]]["step"] = bad
        before = [p.detach().clone() for p in ps]
        with pytest.raises(ValueError, match=r"CPUAdam: state\['step'\] of param_groups\[0\]\['params'\]\[1\] " + match):
            opt.step()
        assert all(torch.equal(p, b) for p, b in zip(ps, before)) and opt.state[ps[0]]["step"].item() == 1.0


@pytest.mark.parametrize("strided", [False, True])
def test_shared_and_inference_mode_step_counters_count_once_per_step_on_both_paths(strided):
    """A counter shared by two parameters advances once per step, whichever path steps, and a
    counter made under torch.inference_mode advances too (both were once the general path's
    _foreach_add_: twice per step, and a raise after the parameters were stepped)."""
    ps = _two_params(strided)
    opt = zo.CPUAdam(ps, lr=1e-2, weight_decay=0.0)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    shared = torch.tensor(1.0)
    for p in ps:
        opt.state[p]["step"] = shared
    opt.step()
    assert shared.item() == 2.0
    with torch.inference_mode():
        counts = [torch.tensor(2.0), torch.tensor(2.0)]
    for p, c in zip(ps, counts):
        opt.state[p]["step"] = c
    opt.step()
    assert [c.item() for c in counts] == [3.0, 3.0]
