"""The optimizer object ``zeroinf.initialize`` returns (:class:`ZeroOptimizer`), and the hand-over
of a client optimizer: the engine steps and keeps the state, the object keeps the hyper-parameters.
"""
from __future__ import annotations

import types

import torch

from zeroinf.config import ConfigError

__all__ = ["ZeroOptimizer", "hand_over", "hyper_from_client"]

_STEP_REFUSED = "the zeroinf optimizer steps inside engine.step(); call engine.step() instead"
_STATE_REFUSED = ("the optimizer state (fp32 master weights, Adam moments, step counts) lives in the zeroinf "
                  "engine's partitions, not in this optimizer object, whose {} would carry none of it; save and "
                  "resume with engine.save_checkpoint(dir) and engine.load_checkpoint(dir)")


class ZeroOptimizer(torch.optim.Optimizer):
    """The optimizer object ``initialize`` returns: it holds the param groups and their
    hyper-parameters (``lr``, ``betas``, ``eps``, ``weight_decay``), so LR schedulers work on it,
    but the step and the state belong to the engine: ``step()`` raises (call ``engine.step()``),
    and so do ``state_dict()``, ``load_state_dict()``, copying and pickling (call
    ``engine.save_checkpoint`` / ``engine.load_checkpoint``), which would carry an empty state and
    restart Adam silently. A client optimizer given to ``initialize`` is handed
    over the same way (:func:`hand_over`).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 adamw_mode: bool = True, bias_correction: bool = True):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      adamw_mode=adamw_mode, bias_correction=bias_correction))
        hand_over(self)


def _refuser(message: str):
    """A function that raises RuntimeError(``message``) whatever it is called with."""
    def refuse(*args, **kwargs):
        raise RuntimeError(message)
    return refuse


_refused_step = _refuser(_STEP_REFUSED)
# torch's LR schedulers wrap optimizer.step to see it called, and warn ("overridden after learning
# rate scheduler initialization") when the step they find is not their wrapper: the engine tells
# them of its steps itself (optimizer._opt_called, in engine.step)
_refused_step._wrapped_by_lr_sched = True


def hand_over(opt: torch.optim.Optimizer) -> None:
    """``opt``'s ``step``, ``state_dict``, ``load_state_dict``, copies and pickles raise from now
    on: the engine takes its parameters' gradients, so its own step did nothing and a loop
    calling it never trained, silently; and its state is empty, as a
    copy's or pickle's would be. Its ``param_groups`` stay the engine's
    hyper-parameters. Instance attributes, so a torch.optim class keeps its own methods."""
    opt.step = types.MethodType(_refused_step, opt)
    opt.state_dict = _refuser(_STATE_REFUSED.format("state_dict()"))
    opt.load_state_dict = _refuser(_STATE_REFUSED.format("load_state_dict()"))
    # copy and pickle look these up on the instance
    opt.__reduce_ex__ = opt.__deepcopy__ = _refuser(_STATE_REFUSED.format("copy (pickle, torch.save, copy.deepcopy)"))


def hyper_from_client(opt: torch.optim.Optimizer) -> None:
    """Check a client optimizer is Adam-like and complete its groups' hyper-parameters in place
    (``adamw_mode``: torch's ``decoupled_weight_decay``, true for AdamW; CPUAdam's own key)."""
    name = type(opt).__name__
    if isinstance(opt, ZeroOptimizer):
        return
    if not (isinstance(opt, torch.optim.Adam) or name == "CPUAdam"):  # torch's AdamW subclasses Adam
        raise ConfigError("optimizer", f"a client optimizer of type {name} is not supported yet; pass "
                          "torch.optim.Adam, torch.optim.AdamW or zeroinf.optim.CPUAdam, or set optimizer in the config")
    for i, g in enumerate(opt.param_groups):
        for k in ("amsgrad", "maximize", "capturable", "differentiable"):
            if g.get(k):
                raise ConfigError("optimizer", f"param group {i} sets {k}=True, which is not supported yet")
        if "adamw_mode" not in g:
            g["adamw_mode"] = bool(g.get("decoupled_weight_decay", isinstance(opt, torch.optim.AdamW)))
        g.setdefault("bias_correction", True)
