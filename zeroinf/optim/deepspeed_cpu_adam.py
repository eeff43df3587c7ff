"""``DeepSpeedCPUAdam``: DeepSpeed's CPU Adam class (its signature, state dtypes and sub-group
steps) over :class:`~zeroinf.optim.CPUAdam`'s fused kernel.

A sub-group state (``step_subgroup``, ``rollback_subgroup``) is ``optimizer.state[subgroup_id]``
(an ``int`` key, as DeepSpeed's ZeRO-3 offload keeps one flat fp32 partition per sub-group):
``step`` (a Python int), ``exp_avg`` and ``exp_avg_sq`` shaped like the parameter, and for a
bf16/fp16 parameter a flat fp32 ``master_param``.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from .cpu_adam import CPUAdam, _check_group, _check_param
from .functional import adam_step

__all__ = ["DeepSpeedCPUAdam"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


class DeepSpeedCPUAdam(CPUAdam):
    """``deepspeed.ops.adam.DeepSpeedCPUAdam`` with DeepSpeed's positional order and defaults.

    Numerics, state layout and checks are :class:`CPUAdam`'s (fp32 arithmetic; an fp32 master
    copy for bf16/fp16 parameters, where DeepSpeed steps the 16-bit values in place).

    Args:
        model_params: iterable of parameters or of param-group dicts.
        lr, bias_correction, betas, eps, weight_decay: as DeepSpeed (``weight_decay`` default 0).
        amsgrad: must be False (``ValueError``; DeepSpeed raises ``RuntimeError``).
        adamw_mode: decoupled weight decay (AdamW) if True, L2 (Adam) if False.
        fp32_optimizer_states: keep ``exp_avg``/``exp_avg_sq`` in float32 (default). False
            stores them in each parameter's dtype (bf16/fp16) between steps, as DeepSpeed does:
            every step computes in float32 from the stored moments and rounds them back. The fp32
            master of a 16-bit parameter stays.

    Raises:
        ValueError: as :class:`CPUAdam` (a parameter off the CPU raises ``ValueError`` at
            ``step``, where DeepSpeed asserts).
    """

    def __init__(self, model_params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True):
        self.fp32_optimizer_states = bool(fp32_optimizer_states)
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         adamw_mode=adamw_mode, bias_correction=bias_correction)
        self.adam_w_mode = adamw_mode

    # -- moment dtype between steps -----------------------------------------------------------
    def _narrow_states(self) -> List[Tuple[Dict[str, Any], torch.dtype]]:
        """(state, parameter dtype) of every 16-bit parameter whose moments are kept in its dtype."""
        if self.fp32_optimizer_states:
            return []
        return [(self.state[p], p.dtype) for g in self.param_groups for p in g["params"]
                if p.dtype != torch.float32 and self.state.get(p)]

    @staticmethod
    def _cast_moments(pairs, to_param_dtype: bool) -> None:
        """Cast each state's moments to its parameter's dtype, or to float32."""
        for state, dtype in pairs:
            for k in _MOMENTS:
                if k in state:
                    state[k] = state[k].to(dtype if to_param_dtype else torch.float32)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        """:meth:`CPUAdam.step`; with ``fp32_optimizer_states=False`` the moments of 16-bit
        parameters are widened to float32 for the step and stored back in the parameter's dtype."""
        if self.fp32_optimizer_states:
            return super().step(closure)
        self._cast_moments(self._narrow_states(), to_param_dtype=False)
        try:
            return super().step(closure)
        finally:  # the states the step created, too, and all of them also when it raised
            self._cast_moments(self._narrow_states(), to_param_dtype=True)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """:meth:`CPUAdam.load_state_dict`, then moments in the dtype ``fp32_optimizer_states`` says."""
        super().load_state_dict(state_dict)
        self._cast_moments(self._narrow_states(), to_param_dtype=True)

    # -- DeepSpeed's sub-group steps ------------------------------------------------------------
    def _subgroup_param(self, what: str) -> Optional[Tuple[int, int, torch.Tensor]]:
        """The one parameter with a gradient, as (group index, index in group, parameter); None if none.

        Raises:
            ValueError: several parameters have gradients (one set of moments cannot step them;
                DeepSpeed would step each with the same moments), or one cannot be stepped.
        """
        found = [(gi, pi, p) for gi, g in enumerate(self.param_groups) for pi, p in enumerate(g["params"])
                 if p.grad is not None]
        if len(found) > 1:
            where = ", ".join(f"param_groups[{gi}]['params'][{pi}]" for gi, pi, _ in found[:4])
            raise ValueError(f"DeepSpeedCPUAdam.{what}: {len(found)} parameters have gradients ({where}); a "
                             "sub-group is one flat parameter, stepped with its own moments. Set the others' "
                             ".grad to None")
        if found:
            gi, pi, p = found[0]
            _check_group(gi, self.param_groups[gi])
            _check_param(p, f"param_groups[{gi}]['params'][{pi}]")
        return found[0] if found else None

    def _subgroup_buffers(self, sid: int, p: torch.Tensor, gi: int, pi: int):
        """Check sub-group ``sid``'s state against ``p``; return (fp32 flat master, flat 16-bit
        output or None, fp32 moments as flat views or widened copies)."""
        state = self.state[sid]
        if state["exp_avg"].numel() != p.numel():
            raise ValueError(f"DeepSpeedCPUAdam: sub-group {sid} holds moments of {state['exp_avg'].numel()} "
                             f"elements, but param_groups[{gi}]['params'][{pi}] has {p.numel()}")
        if not p.is_contiguous():
            raise ValueError(f"DeepSpeedCPUAdam: param_groups[{gi}]['params'][{pi}] of sub-group {sid} is not "
                             "contiguous; a sub-group steps one flat partition")
        flat = p.detach().view(-1)
        if p.dtype == torch.float32:
            master, out = flat, None
        else:
            master = state.get("master_param")
            if master is None or master.numel() != p.numel():
                master = state["master_param"] = flat.to(torch.float32)
            else:  # elements given a new value since the last step take it (as CPUAdam's masters)
                changed = flat != master.to(p.dtype)
                master[changed] = flat[changed].float()
            out = flat
        moments = [state[k].to(torch.float32).reshape(-1) for k in _MOMENTS]  # views when already fp32
        return master, out, moments

    def _put_moments(self, sid: int, p: torch.Tensor, moments) -> None:
        state = self.state[sid]
        dtype = torch.float32 if self.fp32_optimizer_states else p.dtype
        for k, m in zip(_MOMENTS, moments):
            if m.data_ptr() != state[k].data_ptr():  # a widened copy: store it back
                state[k] = m.view(state[k].shape).to(dtype)

    @torch.no_grad()
    def step_subgroup(self, subgroup_id: int, closure: Optional[Callable[[], Any]] = None):
        """One Adam step of the parameter that has a gradient, with sub-group ``subgroup_id``'s
        state (``self.state[subgroup_id]``, created zero at its first step; ``step`` counts up).

        Returns:
            The closure's loss, or None. Nothing is stepped when no parameter has a gradient.

        Raises:
            ValueError: several parameters have gradients, the state's size differs from the
                parameter's, or the parameter cannot be stepped (see :class:`CPUAdam`).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found = self._subgroup_param(f"step_subgroup({subgroup_id})")
        if found is None:
            return loss
        gi, pi, p = found
        group, state = self.param_groups[gi], self.state[subgroup_id]
        if not state:
            dtype = torch.float32 if self.fp32_optimizer_states else p.dtype
            state.update(step=0, exp_avg=torch.zeros(p.shape, dtype=dtype),
                         exp_avg_sq=torch.zeros(p.shape, dtype=dtype))
        master, out, (m, v) = self._subgroup_buffers(subgroup_id, p, gi, pi)
        grad = p.grad.contiguous().view(-1)
        if group["maximize"]:
            grad = -grad
        beta1, beta2 = (float(b) for b in group["betas"])
        adam_step(master, grad, m, v, step=state["step"] + 1, lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                  eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                  adamw_mode=bool(group["adamw_mode"]), bias_correction=bool(group["bias_correction"]),
                  params_out=out)
        self._put_moments(subgroup_id, p, (m, v))
        state["step"] += 1
        return loss

    @torch.no_grad()
    def rollback_subgroup(self, sub_group_id: int, closure: Optional[Callable[[], Any]] = None):
        """Undo sub-group ``sub_group_id``'s last :meth:`step_subgroup`, given the same gradient.

        The step's formula (:func:`zeroinf.optim.adam_step`) is inverted in float32: the
        parameter, ``exp_avg`` and ``exp_avg_sq`` come back to float32 rounding (not bit for
        bit), for AdamW and L2 (Adam) weight decay alike, with or without bias correction;
        ``step`` counts down by one. A 16-bit parameter is rolled back on its fp32 master.

        Returns:
            The closure's loss, or None.

        Raises:
            RuntimeError: the sub-group has no state, or its step count is 0 (DeepSpeed's errors).
            ValueError: no parameter or several have gradients; a step that cannot be inverted
                (``beta1`` or ``beta2`` 0, or ``lr * weight_decay`` 1 in AdamW mode).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if sub_group_id not in self.state or len(self.state[sub_group_id]) == 0:
            raise RuntimeError(f"Cannot rollback optimizer state for sub_group_id {sub_group_id} "
                               "as it has not been initialized.")
        state = self.state[sub_group_id]
        if state.get("step", 0) <= 0:
            raise RuntimeError(f"Cannot rollback sub_group_id {sub_group_id}: step count is {state.get('step', 0)}")
        found = self._subgroup_param(f"rollback_subgroup({sub_group_id})")
        if found is None:
            raise ValueError(f"DeepSpeedCPUAdam.rollback_subgroup({sub_group_id}): no parameter has a gradient; "
                             "the rollback needs the gradient the step used")
        gi, pi, p = found
        group = self.param_groups[gi]
        lr, eps, wd = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
        beta1, beta2 = (float(b) for b in group["betas"])
        adamw = bool(group["adamw_mode"])
        if beta1 == 0.0 or beta2 == 0.0 or (adamw and lr * wd == 1.0):
            raise ValueError(f"DeepSpeedCPUAdam.rollback_subgroup({sub_group_id}): a step with betas "
                             f"({beta1}, {beta2}), lr {lr} and weight_decay {wd} cannot be inverted")
        master, out, (m, v) = self._subgroup_buffers(sub_group_id, p, gi, pi)
        t = state["step"]
        bc1 = 1.0 - beta1 ** t if group["bias_correction"] else 1.0
        bc2 = 1.0 - beta2 ** t if group["bias_correction"] else 1.0
        g = p.grad.reshape(-1).float()
        if group["maximize"]:
            g = -g
        update = m / (v.sqrt() / bc2 ** 0.5 + eps) * (lr / bc1)
        if adamw:
            master.add_(update).div_(1.0 - lr * wd)
        else:
            master.add_(update)
            g = g + wd * master
        m.sub_((1.0 - beta1) * g).div_(beta1)
        v.sub_((1.0 - beta2) * g * g).div_(beta2).clamp_(min=0.0)  # rounding must not leave v < 0
        if out is not None:
            out.copy_(master)
        self._put_moments(sub_group_id, p, (m, v))
        state["step"] -= 1
        return loss
