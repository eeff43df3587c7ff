"""``CPUAdam``: a ``torch.optim.Optimizer`` drop-in for ``torch.optim.AdamW`` on CPU parameters."""
from __future__ import annotations

import functools
import math
import weakref
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch

from .functional import AdamHyper, adam_step_groups, load_adam_op, step_counted

__all__ = ["CPUAdam"]

_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_F32_MAX = torch.finfo(torch.float32).max
#: Moment and master tensors CPUAdam keeps in float32 whatever the parameter's dtype.
_FP32_STATE = ("exp_avg", "exp_avg_sq", "master_param")


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW on CPU parameters with the fused zeroinf kernel (:func:`zeroinf.optim.adam_step`).

    A user swaps it in for ``torch.optim.AdamW`` with no other change: param groups,
    ``add_param_group``, LR schedulers (they edit ``group["lr"]``), ``zero_grad``, closures, and
    betas/lr/weight decay changed between steps are all honoured as torch does.

    Numerics: float32 arithmetic; agrees with ``torch.optim.AdamW(foreach=False)`` to float
    rounding (max abs difference around 1e-7 per step on unit-scale parameters).

    State (``state_dict()``) is torch's AdamW layout: per parameter ``step`` (a float32 scalar
    tensor, counted per tensor), ``exp_avg`` and ``exp_avg_sq``; each param group carries torch's
    keys too (``amsgrad``, ``maximize``, ``decoupled_weight_decay``, ...). Checkpoints therefore
    move between CPUAdam and torch.optim.AdamW both ways and load with
    ``torch.load(weights_only=True)``.

    bf16/fp16 parameters: the optimizer keeps an fp32 master copy (``state["master_param"]``)
    and fp32 moments, steps the master with the parameter's own-dtype gradient and writes the
    rounded result back into the parameter in the same pass (bit-equal to
    ``master.to(param.dtype)``). Loading a state dict keeps these tensors in fp32. A change made
    to such a parameter between steps (``model.load_state_dict``, ``torch.nn.init``, an in-place
    op under ``torch.no_grad()``, ``p.data = t``) is seen through the parameter's version counter
    and pointer: the master's elements that no longer round to the parameter's value take it, as
    ``torch.optim.AdamW`` would step them; the others keep their fp32 bits. A change made
    through another tensor over the parameter's memory bumps no version counter of the parameter
    and is not seen: an in-place op on ``p.data`` (``p.data.clamp_(...)``), a write through a numpy
    view, or ``p.data = buf`` with the very buffer the parameter held at the last step, written
    meanwhile. Make such changes on ``p`` under ``torch.no_grad()``, or on
    ``state["master_param"]`` too.

    Parameters on an accelerator are not supported: ``step`` raises ``ValueError`` naming the
    parameter. Use ``torch.optim.AdamW(fused=True)`` for them, or keep the parameters on CPU
    (e.g. ``zeroinf.initialize`` with ``offload_optimizer``), which is what this class is for.

    Args:
        params: iterable of parameters or of param-group dicts.
        lr: learning rate (float, or a 0-dim tensor read with ``float()`` at every step).
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the denominator, > 0 usually; must be >= 0.
        weight_decay: decoupled (``adamw_mode=True``) or L2 (``False``) weight decay, >= 0;
            default 1e-2, ``torch.optim.AdamW``'s (DeepSpeedCPUAdam's default is 0).
        amsgrad: must be False; AMSGrad is not implemented (raises ``ValueError``).
        maximize: maximize the objective (the gradient is negated), as in torch.
        foreach, fused: accepted for ``torch.optim.AdamW``'s signature and ignored (the step is
            always one fused pass over all parameters).
        capturable, differentiable: must be False (raise ``ValueError``).
        adamw_mode: AdamW (decoupled decay) if True, Adam with L2 penalty if False (keyword only:
            the positional arguments are ``torch.optim.AdamW``'s).
        bias_correction: divide moments by ``1 - beta**step``.

    Raises:
        ValueError: a hyper-parameter out of range, ``amsgrad``, ``capturable`` or
            ``differentiable`` True, a group whose ``adamw_mode`` and ``decoupled_weight_decay``
            disagree (at ``step``), a parameter that is not a
            floating CPU tensor of dtype fp32/bf16/fp16 (at ``step``), or a sparse gradient.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: Optional[bool] = None, capturable: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, adamw_mode: bool = True, bias_correction: bool = True):
        if capturable or differentiable:
            raise ValueError(f"CPUAdam: {'capturable' if capturable else 'differentiable'}=True is not supported "
                             "(CUDA graphs / differentiating through the step); use torch.optim.AdamW for it")
        _check_hyper(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad))
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, adamw_mode=adamw_mode, bias_correction=bias_correction,
                        # torch.optim.Adam's keys, so the state dict loads there with the same meaning:
                        decoupled_weight_decay=adamw_mode, foreach=None, capturable=False,
                        differentiable=False, fused=None)
        super().__init__(params, defaults)
        # 16-bit parameters: id(p) -> (weak reference to p, p._version, p.data_ptr()) right after
        # this optimizer last wrote p. Keyed by id with the reference checked, not by the tensor
        # (torch's Tensor.__hash__ is Python code, and a weak-keyed map pays it twice per
        # parameter and step); the reference holds nothing, and its callback drops the entry
        # when p is freed.
        self._written: Dict[int, Tuple[weakref.ref, int, int]] = {}
        load_adam_op()  # the first-use build happens here, not in the first step

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a param group (see ``torch.optim.Optimizer.add_param_group``); validates its options.
        A group giving ``adamw_mode`` or torch's ``decoupled_weight_decay`` alone gets the other
        from it, so the two never disagree (a step refuses a group where they do).

        Raises:
            ValueError: an option out of range (see the class), a parameter listed twice in
                the group (torch only warns and steps it twice in order; one fused step would
                give both updates one bias correction), or a bf16/fp16 parameter
                over the same memory as another one (each steps its own fp32 master); the group
                is not added.
        """
        _check_hyper(param_group)
        for a, b in (("adamw_mode", "decoupled_weight_decay"), ("decoupled_weight_decay", "adamw_mode")):
            if a in param_group and b not in param_group:
                param_group[b] = bool(param_group[a])
        gi = len(self.param_groups)
        super().add_param_group(param_group)
        seen: Dict[int, int] = {}
        for pi, p in enumerate(self.param_groups[-1]["params"]):
            if id(p) in seen:
                self.param_groups.pop()
                raise ValueError(f"CPUAdam: param_groups[{gi}]['params'] lists one parameter twice (positions "
                                 f"{seen[id(p)]} and {pi}); list each parameter once")
            seen[id(p)] = pi
        clash = _shared_16bit_memory([(f"param_groups[{g}]['params'][{i}]", p)
                                      for g, grp in enumerate(self.param_groups) for i, p in enumerate(grp["params"])])
        if clash is not None:
            self.param_groups.pop()
            a, b, dtype = clash
            raise ValueError(f"CPUAdam: {a} and {b} are {dtype} parameters over the same memory; CPUAdam keeps one fp32 "
                             "master per 16-bit parameter, so each would step from its own master and the one written "
                             "last would drop the other's update. Make them one parameter, or keep them "
                             "in fp32 (aliased fp32 parameters are stepped one after the other, as torch does)")

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_written", {})
        for group in self.param_groups:
            # A state dict from torch.optim.AdamW/Adam has no adamw_mode: take its decoupled flag.
            group.setdefault("adamw_mode", group.get("decoupled_weight_decay", True))
            group.setdefault("bias_correction", True)
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            _check_hyper(group)

    def state_dict(self) -> Dict[str, Any]:
        """torch's optimizer state dict; each group's ``decoupled_weight_decay`` mirrors ``adamw_mode``
        (``step`` refuses groups where the two disagree)."""
        sd = super().state_dict()
        for group in sd["param_groups"]:
            group.setdefault("decoupled_weight_decay", bool(group.get("adamw_mode", True)))
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a CPUAdam or torch.optim.AdamW/Adam state dict.

        torch casts floating state to each parameter's dtype; for bf16/fp16 parameters the moments
        (and master copy) are put back to float32 from the saved values, so nothing is rounded.

        Raises:
            ValueError: a group this optimizer cannot step (``amsgrad=True``, a hyper-parameter out
                of range), naming it; raised before anything is loaded, so the optimizer is as it was.
        """
        # whatever step() would refuse is refused before anything changes
        mine = [p for g in self.param_groups for p in g["params"]]
        where = {}
        for gi, group in enumerate(state_dict["param_groups"]):
            group = dict(group)
            group.setdefault("adamw_mode", group.get("decoupled_weight_decay", True))
            try:
                _check_group(gi, group)
            except ValueError as exc:
                raise ValueError(f"{exc} (param_groups[{gi}] of the state dict given to load_state_dict; "
                                 "nothing was loaded)") from None
            where.update((pid, (gi, pi)) for pi, pid in enumerate(group["params"]))
        for pid, p in zip([pid for g in state_dict["param_groups"] for pid in g["params"]], mine):
            for k, v in state_dict["state"].get(pid, {}).items():
                if k in _FP32_STATE and torch.is_tensor(v) and v.numel() != p.numel():
                    gi, pi = where[pid]
                    raise ValueError(f"CPUAdam: the state dict's {k} of param_groups[{gi}]['params'][{pi}] has "
                                     f"{v.numel()} elements, the parameter {p.numel()} (a state dict of another "
                                     "model?); nothing was loaded")
        saved = {pid: {k: v for k, v in st.items() if k in _FP32_STATE and torch.is_tensor(v)}
                 for pid, st in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for p in params:  # torch before 1.12 saved the step as a Python number; others an int64 tensor
            st = self.state.get(p)
            if st and "step" in st and not (torch.is_tensor(st["step"]) and st["step"].dtype == torch.float32):
                st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)
        for pid, p in zip(ids, params):
            if p.dtype != torch.float32 and saved.get(pid):
                for k, v in saved[pid].items():
                    self.state[p][k] = v.detach().to(device="cpu", dtype=torch.float32, copy=True).contiguous()
            # the loaded master may not be this parameter's value (weights loaded from elsewhere,
            # before or after): the next step compares them
            self._written.pop(id(p), None)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        """One optimizer step over every parameter that has a gradient.

        Args:
            closure: re-evaluates the model and returns the loss (run with grad enabled).

        Returns:
            The closure's loss, or None.

        Raises:
            ValueError: a parameter off the CPU, of an unsupported dtype, or with a sparse gradient.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step_all()
        return loss

    def _step_all(self) -> None:
        """Step every parameter with a gradient, all param groups in one op call where possible."""
        keys = ("params", "grads", "exp_avgs", "exp_avg_sqs", "params_outs")
        bufs = {k: [] for k in keys}
        step_tensors, group_of, groups, low, kept, new = [], [], [], [], [], []
        masters, grads, exp_avgs, exp_avg_sqs, outs = bufs.values()
        states, written, f32 = self.state, self._written, torch.float32
        # One pass checks and gathers: every check comes before anything changes (a parameter
        # whose state needs making or mending is left to _prepare, after the pass).
        for gi, group in enumerate(self.param_groups):
            _check_group(gi, group)
            beta1, beta2 = (float(b) for b in group["betas"])
            groups.append(AdamHyper(float(group["lr"]), beta1, beta2, float(group["eps"]),
                                    float(group["weight_decay"]), bool(group["adamw_mode"]),
                                    bool(group["bias_correction"])))
            maximize = bool(group["maximize"])
            for pi, p in enumerate(group["params"]):
                grad = p.grad
                if grad is None:
                    continue
                if not _steppable(p):
                    _check_param(p, f"param_groups[{gi}]['params'][{pi}]")
                state = states.get(p)
                step = state.get("step") if state else None
                group_of.append(gi)
                # the common cases: an fp32 parameter with torch's state (the parameter is the
                # master), and a 16-bit one left as this optimizer wrote it (its master is whole)
                if not maximize and type(step) is torch.Tensor and step.dtype is f32:
                    if p.dtype is f32:
                        master, out = p, None
                    elif _unchanged(written.get(id(p)), p):
                        master, out = state.get("master_param"), p
                    else:
                        master = None
                    if master is not None:
                        if out is not None:
                            kept.append(p)
                        step_tensors.append(step)
                        masters.append(master)
                        grads.append(grad)
                        exp_avgs.append(state["exp_avg"])
                        exp_avg_sqs.append(state["exp_avg_sq"])
                        outs.append(out)
                        continue
                new.append((len(masters), p, maximize))
                for row in (step_tensors, masters, grads, exp_avgs, exp_avg_sqs, outs):
                    row.append(None)
        for i, p, maximize in new:
            masters[i], outs[i], grads[i], state = self._prepare(p, maximize)
            step_tensors[i], exp_avgs[i], exp_avg_sqs[i] = state["step"], state["exp_avg"], state["exp_avg_sq"]
            if outs[i] is not None:
                low.append(p)
        if not step_tensors:
            return
        try:
            stepped = step_counted(*bufs.values(), step_tensors, group_of, groups)
        except ValueError:
            self._check_counts(step_tensors)  # names the parameter of a bad count
            raise
        if not stepped:
            self._check_counts(step_tensors)
            self._step_strided(keys, bufs, step_tensors, group_of, groups)
        # the op writes through pointers, so the version of a parameter whose record was current
        # stays so; the general step writes with torch ops, which bump it
        for p in low if stepped else low + kept:
            _record(written, p)

    @staticmethod
    def _step_strided(keys, bufs, step_tensors, group_of, groups) -> None:
        """The general step, for lists with buffers that are not contiguous (or without the op).

        One op call steps a run of contiguous tensors (of any groups) as one parallel region;
        the op steps tensors over overlapping memory one after the other, in list order. Buffers
        that are not contiguous (a transposed parameter, a state tensor loaded with another
        layout) are stepped through contiguous copies in a call of their own, copied back right
        after it, so a parameter stepped later over the same storage reads the new values, as
        torch's parameter-by-parameter step does. The op takes any contiguous shape (it checks
        numel), so no flattening views are needed.
        """
        steps = [int(t.item()) + 1 for t in step_tensors]  # checked by _check_counts; stored once all are stepped
        n = len(steps)
        strided = [not all(t is None or t.is_contiguous() for t in row) for row in zip(*bufs.values())]
        lo = 0
        while lo < n:
            hi = lo + 1
            if not strided[lo]:
                while hi < n and not strided[hi]:
                    hi += 1
                adam_step_groups(*(bufs[k][lo:hi] for k in keys[:4]), steps=steps[lo:hi], group_of=group_of[lo:hi],
                                 groups=groups, params_outs=bufs["params_outs"][lo:hi])
                lo = hi
                continue
            seg = {k: None if bufs[k][lo] is None else bufs[k][lo].contiguous() for k in keys}
            adam_step_groups(*([seg[k]] for k in keys[:4]), steps=steps[lo:hi], group_of=group_of[lo:hi],
                             groups=groups, params_outs=[seg["params_outs"]])
            for k in keys:
                dst = bufs[k][lo]
                if k != "grads" and dst is not None and dst is not seg[k]:
                    dst.copy_(seg[k])
            lo = hi
        # as the op stores them: each count becomes its step number (a counter shared by several
        # parameters counts once per step), also into a tensor made under torch.inference_mode
        with torch.inference_mode():
            for t, s in zip(step_tensors, steps):
                t.fill_(float(s))

    def _check_counts(self, step_tensors) -> None:
        """Raise ValueError naming the parameter whose ``state["step"]`` the op refuses (what
        :func:`~zeroinf.optim.functional.step_counted` checks), before anything is stepped."""
        for t in step_tensors:
            if not (isinstance(t, torch.Tensor) and t.is_cpu and t.dtype == torch.float32 and t.numel() == 1):
                why = ("must be a one-element float32 CPU tensor (torch.optim.AdamW's layout), got "
                       + (f"{t.dtype} with {t.numel()} elements on {t.device}" if isinstance(t, torch.Tensor)
                          else type(t).__name__))
            else:
                count = t.item()
                if 0.0 <= count < 2.0 ** 62 and count == math.floor(count):
                    continue
                why = f"is {count}; a step count is a whole number in [0, 2^62)"
            where = next((f"param_groups[{gi}]['params'][{pi}]" for gi, g in enumerate(self.param_groups)
                          for pi, p in enumerate(g["params"]) if self.state.get(p, {}).get("step") is t), "a parameter")
            raise ValueError(f"CPUAdam: state['step'] of {where} {why}")

    def _prepare(self, p: torch.Tensor, maximize: bool):
        """Create one checked parameter's state, return (fp32 master, 16-bit out or None, grad, state)."""
        grad = p.grad
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32)
        elif not (torch.is_tensor(state["step"]) and state["step"].dtype == torch.float32):  # set by hand
            state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
        if p.dtype != torch.float32 and "master_param" not in state:
            state["master_param"] = p.detach().to(torch.float32, copy=True).contiguous()
        elif p.dtype != torch.float32 and not _unchanged(self._written.get(id(p)), p):
            # changed since this optimizer wrote it, or never written by it (a loaded master): step
            # from the parameter's value (the master kept exact when it is only the master rounded,
            # e.g. a checkpoint's weights loaded beside its masters)
            # elementwise: a constraint that changed a few elements (a clamp) leaves the others'
            # fp32 bits, which a whole copy rounded to the parameter's dtype at every step
            new, master = p.detach(), state["master_param"]
            changed = new != master.to(p.dtype)
            if bool(changed.any()):
                master[changed] = new[changed].float()
        if maximize:
            grad = -grad
        if p.dtype == torch.float32:
            return p.detach(), None, grad, state
        return state["master_param"], p.detach(), grad, state


def _unchanged(record: Optional[Tuple[weakref.ref, int, int]], p: torch.Tensor) -> bool:
    """Whether ``record`` (an entry of ``CPUAdam._written``) is ``p``'s and ``p`` has the version
    and data pointer it had when the optimizer last wrote it."""
    return record is not None and record[1] == p._version and record[2] == p.data_ptr() and record[0]() is p


def _record(written: Dict[int, Tuple[weakref.ref, int, int]], p: torch.Tensor) -> None:
    """Note in ``written`` that the optimizer has just written ``p``."""
    key = id(p)
    old = written.get(key)
    ref = old[0] if old is not None and old[0]() is p else weakref.ref(p, functools.partial(_forget, written, key))
    written[key] = (ref, p._version, p.data_ptr())


def _forget(written: Dict[int, Tuple[weakref.ref, int, int]], key: int, ref: weakref.ref) -> None:
    """Weak-reference callback: drop a freed parameter's entry (unless its id has a new one)."""
    entry = written.get(key)
    if entry is not None and entry[0] is ref:
        del written[key]


def _shared_16bit_memory(named) -> Optional[Tuple[str, str, torch.dtype]]:
    """The first two bf16/fp16 parameters of ``named`` (``(where, tensor)`` pairs) whose
    elements share memory, as ``(where_a, where_b, dtype)``; None when none do. Views that only
    interleave (columns of one matrix) do not count."""
    spans: Dict[int, list] = {}
    for where, p in named:
        if p.dtype in (torch.bfloat16, torch.float16) and p.numel() and p.device.type == "cpu":
            lo = p.storage_offset()
            hi = lo + sum((n - 1) * st for n, st in zip(p.shape, p.stride())) + 1
            spans.setdefault(p.untyped_storage().data_ptr(), []).append((lo, hi, where, p))
    for group in spans.values():
        # a sweep in offset order: parameters that are views of one flat buffer (disjoint, one
        # after the other) compare with none, where all pairs were N^2 extents
        group.sort(key=lambda span: span[0])
        open_spans: list = []  # those started before the current one and not ended by its start
        for lo, hi, where, p in group:
            open_spans = [span for span in open_spans if span[1] > lo]
            for lo2, hi2, where2, q in open_spans:
                if q is not p:  # extents overlap: compare the elements
                    top = torch.arange(max(hi, hi2))
                    mine = torch.as_strided(top, p.shape, p.stride(), lo).reshape(-1)
                    theirs = torch.as_strided(top, q.shape, q.stride(), lo2).reshape(-1)
                    if bool(torch.isin(mine, theirs).any()):
                        return where2, where, p.dtype
            open_spans.append((lo, hi, where, p))
    return None


def _steppable(p: torch.Tensor) -> bool:
    """Whether CPUAdam can step ``p`` and its gradient (CPU, dense, a supported dtype): the
    per-step test, which builds no message; :func:`_check_param` says what is wrong when not."""
    grad = p.grad
    return (p.is_cpu and grad.is_cpu and grad.layout is torch.strided and p.dtype in _PARAM_DTYPES
            and grad.dtype in _PARAM_DTYPES)


def _check_param(p: torch.Tensor, where: str) -> None:
    """Raise ValueError naming ``where`` (``param_groups[g]['params'][i]``) for a parameter with a
    gradient that CPUAdam cannot step."""
    grad = p.grad
    if p.device.type == "meta":
        raise ValueError(f"CPUAdam: {where} is on the meta device (a shape without data: a model built under "
                         "torch.device('meta') and not materialized with to_empty()); there is nothing to step")
    if p.device.type != "cpu":
        raise ValueError(f"CPUAdam: {where} is on {p.device}; CPUAdam steps CPU parameters only. "
                         f"Use torch.optim.AdamW(fused=True) for accelerator parameters, or offload "
                         f"the optimizer with zeroinf.initialize")
    if p.dtype not in _PARAM_DTYPES:
        raise ValueError(f"CPUAdam: {where} has dtype {p.dtype}; expected float32, bfloat16 or float16")
    if grad.is_sparse:
        raise ValueError(f"CPUAdam: {where} has a sparse gradient; CPUAdam supports dense gradients only")
    if grad.device.type != "cpu":
        raise ValueError(f"CPUAdam: the gradient of {where} is on {grad.device}; expected CPU")
    if grad.dtype not in _PARAM_DTYPES:  # checked here to name the parameter, not the op's list index
        raise ValueError(f"CPUAdam: the gradient of {where} has dtype {grad.dtype}; expected float32, bfloat16 "
                         "or float16")


def _check_group(gi: int, group: Dict[str, Any]) -> None:
    """Raise ValueError for param group ``gi`` if :meth:`CPUAdam.step` cannot step it."""
    _check_hyper(group)
    for k in ("capturable", "differentiable"):  # the constructor refuses them; a loaded group may set them
        if group.get(k):
            raise ValueError(f"CPUAdam: param_groups[{gi}] sets {k}=True, which is not supported")
    if "decoupled_weight_decay" in group and bool(group["decoupled_weight_decay"]) != bool(group["adamw_mode"]):
        # torch.optim.Adam honours its key; this optimizer steps by adamw_mode, so the two must agree
        raise ValueError(f"CPUAdam: param_groups[{gi}] has adamw_mode={group['adamw_mode']!r} but torch's "
                         f"decoupled_weight_decay={group['decoupled_weight_decay']!r}; set both to the same "
                         "value (True: AdamW's decoupled decay, False: Adam's L2 penalty)")


def _number(name: str, v: Any) -> float:
    """``float(v)``; ValueError naming the option for a string or a tensor of several elements
    (float()'s and torch's own messages name neither)."""
    try:
        if isinstance(v, (str, bytes)):  # float("0.01") would take it; torch.optim refuses a string
            raise TypeError("a string")
        return float(v)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"CPUAdam: invalid {name} {v!r} (must be a number or a one-element tensor)") from exc


def _check_hyper(group: Dict[str, Any]) -> None:
    if group.get("amsgrad", False):
        raise ValueError("CPUAdam: amsgrad=True is not implemented; use torch.optim.AdamW(amsgrad=True)")
    if "lr" in group and not 0.0 <= _number("lr", group["lr"]) <= _F32_MAX:
        raise ValueError(f"CPUAdam: invalid lr {group['lr']} (must be >= 0 and a finite float32)")
    if "eps" in group and not _number("eps", group["eps"]) >= 0.0:
        raise ValueError(f"CPUAdam: invalid eps {group['eps']} (must be >= 0)")
    if "weight_decay" in group and not _number("weight_decay", group["weight_decay"]) >= 0.0:
        raise ValueError(f"CPUAdam: invalid weight_decay {group['weight_decay']} (must be >= 0)")
    if "betas" in group:
        betas = tuple(group["betas"])
        if len(betas) != 2 or not all(0.0 <= _number("betas", b) < 1.0 for b in betas):
            raise ValueError(f"CPUAdam: invalid betas {group['betas']} (need two values in [0, 1))")
