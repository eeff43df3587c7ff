"""The interface between :class:`zeroinf.runtime.engine.ZeroEngine` and a ZeRO stage.

The engine picks one implementation at construction (:func:`zeroinf.runtime.engine.build_stage`)
and from then on calls only what :class:`StageParams` lists: stages 0-2 are
:class:`zeroinf.runtime.flat.FlatParamManager`, stage 3 is
:class:`zeroinf.runtime.stage3.engine_glue.Stage3EngineParams`. Both derive from
:class:`StageParamsBase`, whose methods are the defaults of a stage that keeps whole parameters
on the compute device and reduces gradients after the backward (stages 0-2): no-ops, ``False``,
``0``, or ``NotImplementedError`` for what only stage 3 can do (the config refuses those
settings below stage 3, so the engine never calls them there).

Sub-group ``i`` indexes :meth:`StageParams.sub_group_specs`; gradients and masters are fp32 CPU
tensors of that sub-group's ``numel`` elements.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol, Tuple, runtime_checkable

import torch

__all__ = ["StageParams", "StageParamsBase"]


@runtime_checkable
class StageParams(Protocol):
    """What a ZeRO stage provides to the engine (docs/architecture.md lists it too)."""

    #: the device the stage's collectives run on (a CUDA device with NCCL, else the CPU)
    device: torch.device
    #: whether fp32 parameters in CPU memory may serve as the optimizer's master weights (aliasing)
    params_may_be_masters: bool
    #: whether gradients are reduced unit by unit during the backward (not after it)
    reduces_during_backward: bool
    #: whether the optimizer step may run on a background thread behind the next forward
    overlaps_step: bool
    #: whether ``save_16bit_model`` writes the full weights (stage 3 only when the config says so)
    saves_16bit_model: bool
    #: the stage's own load pre-hooks on the model (stage 3's ``ModuleStateHooks``), which a
    #: checkpoint's key check does not count as the user's; None when the stage installs none
    state_hooks: Any

    # --- layout and the optimizer's sub-groups ---------------------------------------------
    def sub_group_specs(self) -> list: ...
    def master_init(self, i: int, fp32_params: Optional[Dict[int, torch.Tensor]] = None) -> torch.Tensor: ...
    def master_io(self) -> Any: ...
    def attach_optimizer(self, sub_optimizer) -> None: ...
    def set_state_guard(self, guard) -> None: ...
    def settle_host_copies(self) -> None: ...

    # --- gradients and the synchronous step ---------------------------------------------------
    def reduce_gradients(self) -> int: ...
    def grad(self, i: int) -> torch.Tensor: ...
    def param_target(self, i: int) -> torch.Tensor: ...
    def gather_params(self) -> int: ...
    def zero_grad_acc(self) -> None: ...
    def track_grad_norm(self, norm_type: float) -> None: ...
    def local_grad_norm_parts(self, norm_type: float) -> Tuple[float, bool]: ...

    # --- weights the user changed between steps -----------------------------------------------
    def watch_weights(self, model: torch.nn.Module, names: Dict[torch.nn.Parameter, str]) -> list: ...
    def adopt_replaced_data(self) -> None: ...
    def adopt_changed_weights(self, sub_optimizer) -> None: ...
    def mark_weights_current(self) -> None: ...

    # --- one iteration's forward and backward ----------------------------------------------
    def abort_iteration(self, keep_changes: bool = False) -> None: ...
    def forget_raised_pass(self) -> None: ...
    def held_parameter_names(self) -> List[str]: ...
    def check_dropped_data(self) -> None: ...
    def reduced_since_check(self) -> bool: ...
    def clear_reduced_since_check(self) -> None: ...

    # --- background steps -----------------------------------------------------------------
    def start_step(self, sub_optimizer, *, step: int, hyper, grad_scale: float) -> None: ...
    def finish_step(self) -> None: ...
    def take_step_wait_s(self) -> float: ...
    def start_backward_step(self, sub_optimizer, *, step: int, hyper, norm_type: float) -> None: ...
    def end_backward_step(self) -> None: ...
    def abort_backward_step(self, exc: BaseException) -> bool: ...
    def in_backward_step(self) -> bool: ...
    def backward_step_norm(self, norm_type: float) -> float: ...
    def backward_step_done(self) -> None: ...

    # --- memory, files, reports, end ----------------------------------------------------------
    def empty_cache(self) -> int: ...
    def swap_files(self) -> List[str]: ...
    def stats(self) -> Optional[Dict[str, Any]]: ...
    def trace(self, path) -> int: ...
    def close(self) -> None: ...


def _stage3_only(what: str) -> NotImplementedError:
    return NotImplementedError(f"{what} runs at ZeRO stage 3 only (zero_optimization.stage is not 3)")


class StageParamsBase:
    """The defaults of :class:`StageParams` for a stage without partitioned parameters
    (stages 0-2); stage 3 overrides each of them. Subclasses provide the layout and gradient
    methods (``sub_group_specs`` to ``local_grad_norm_parts``) and ``device``."""

    params_may_be_masters = True
    reduces_during_backward = False
    overlaps_step = False
    saves_16bit_model = True
    state_hooks = None

    def settle_host_copies(self) -> None:
        """No-op: no device copy reads or writes the host buffers outside the step (CUDA stages 1-2
        override it: a checkpoint load waits for their copies before writing the masters)."""

    def master_io(self) -> Any:
        """None: the optimizer keeps its own fp32 masters (``SubGroupOptimizer(master_io=None)``)."""
        return None

    def attach_optimizer(self, sub_optimizer) -> None:
        """No-op: no partition is written outside the optimizer step."""

    def set_state_guard(self, guard) -> None:
        """No-op: nothing of the stage reads the weights outside the engine's entry points."""

    def track_grad_norm(self, norm_type: float) -> None:
        """No-op: the gradient norm is computed from the accumulation buffers at the step."""

    def watch_weights(self, model: torch.nn.Module, names: Dict[torch.nn.Parameter, str]) -> list:
        """Start noting weights changed outside the step; returns hook handles (none here)."""
        return []

    def adopt_replaced_data(self) -> None:
        """No-op: no parameter data is watched."""

    def adopt_changed_weights(self, sub_optimizer) -> None:
        """No-op: no parameter data is watched."""

    def mark_weights_current(self) -> None:
        """No-op: no parameter data is watched."""

    def abort_iteration(self, keep_changes: bool = False) -> None:
        """No-op: an interrupted forward or backward leaves nothing gathered."""

    def forget_raised_pass(self) -> None:
        """No-op: no pass state is kept between backwards."""

    def held_parameter_names(self) -> List[str]:
        """Names of parameters a ``gathered_parameters`` block holds: none below stage 3."""
        return []

    def check_dropped_data(self) -> None:
        """No-op: parameters are whole, so a forward's ``p.data = t`` is seen at the step."""

    def reduced_since_check(self) -> bool:
        """Whether gradients were reduced since :meth:`clear_reduced_since_check`: never during a
        backward below stage 3 (``.grad`` is the evidence there)."""
        return False

    def clear_reduced_since_check(self) -> None:
        """No-op (see :meth:`reduced_since_check`)."""

    def start_step(self, sub_optimizer, *, step: int, hyper, grad_scale: float) -> None:
        """Raises NotImplementedError: :attr:`overlaps_step` is False."""
        raise _stage3_only("the overlapped optimizer step")

    def finish_step(self) -> None:
        """No-op: no step runs in the background."""

    def take_step_wait_s(self) -> float:
        """Seconds the forward waited on a background step since the last call: 0.0."""
        return 0.0

    def start_backward_step(self, sub_optimizer, *, step: int, hyper, norm_type: float) -> None:
        """Raises NotImplementedError (``zeroinf.optimizer_in_backward`` needs stage 3)."""
        raise _stage3_only("zeroinf.optimizer_in_backward")

    def end_backward_step(self) -> None:
        """Raises NotImplementedError (``zeroinf.optimizer_in_backward`` needs stage 3)."""
        raise _stage3_only("zeroinf.optimizer_in_backward")

    def abort_backward_step(self, exc: BaseException) -> bool:
        """Raises NotImplementedError (``zeroinf.optimizer_in_backward`` needs stage 3)."""
        raise _stage3_only("zeroinf.optimizer_in_backward")

    def in_backward_step(self) -> bool:
        """False: no step runs inside a backward."""
        return False

    def backward_step_norm(self, norm_type: float) -> float:
        """Raises NotImplementedError (``zeroinf.optimizer_in_backward`` needs stage 3)."""
        raise _stage3_only("zeroinf.optimizer_in_backward")

    def backward_step_done(self) -> None:
        """Raises NotImplementedError (``zeroinf.optimizer_in_backward`` needs stage 3)."""
        raise _stage3_only("zeroinf.optimizer_in_backward")

    def empty_cache(self) -> int:
        """Host scratch bytes freed: 0, no cache is kept between steps."""
        return 0

    def swap_files(self) -> List[str]:
        """Paths of the stage's own swap files: none (the optimizer's are its own)."""
        return []

    def stats(self) -> Optional[Dict[str, Any]]:
        """Stage counters of the last optimizer step: None, the engine's own say everything."""
        return None

    def trace(self, path) -> int:
        """Raises NotImplementedError: transfers are recorded at stage 3 only."""
        raise NotImplementedError("engine.trace() records stage-3 transfers; zero_optimization.stage is not 3")

    def close(self) -> None:
        """No-op: the flat buffers are plain tensors, freed with the engine."""

