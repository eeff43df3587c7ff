"""Shared by the CPU Adam tests (test_cpu_adam_*.py, test_cpu_adam_work_list.py): the tolerance against
torch, the op's ISAs this host runs, CPUAdam stepped beside a torch optimizer on the same
gradients, and a state dict sent through torch.save and torch.load."""
import io

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


def _save_load(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)
