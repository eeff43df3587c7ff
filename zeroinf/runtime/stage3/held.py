"""The parameters ``zeroinf.Init`` holds: one :class:`Held` record per parameter moved out at
construction (keyed by the parameter itself), the queries the stage-3 manager and the engine ask
of it (true shapes, dtypes, taking the values), and the hooks that let a module with held
parameters answer ``state_dict``, ``load_state_dict`` and ``forward`` before
``zeroinf.initialize`` takes them. :class:`zeroinf.runtime.stage3.init.Init` moves parameters in
and out; a record's ``owner`` is that ``Init``, reached through its ``_peek``, ``_rewrite`` and
``_take``.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .released import mark_gathered, set_held_hooks

if TYPE_CHECKING:  # annotations only: init.py imports this module
    from .init import Init

__all__ = ["Held", "HELD", "LOCK", "pop_held", "init_shapes", "init_shapes_of", "note_cast", "init_dtype",
           "take_init_values", "check_placeholders", "rounded", "refuse_copy", "refuse_copies", "allow_copies",
           "held_state_dict_hook", "held_load_pre_hook", "held_forward_pre_hook"]


@dataclass
class Held:
    """One parameter moved out at construction: its shape/dtype and where its values are."""

    key: str
    seq: int
    shape: torch.Size
    dtype: torch.dtype
    owner: "Init"
    host: Optional[torch.Tensor] = None  # values kept in host memory (tiers none/cpu)
    finalizer: Any = None  # drops the values when the parameter is freed unread
    casts: List[torch.dtype] = field(default_factory=list)  # dtypes its placeholder took since (note_cast)

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * torch.empty((), dtype=self.dtype).element_size()


# Keyed by the Parameter object itself (a dict matches tensors by identity), never by id(), and
# weakly: an entry leaves when the manager takes its values, or when its parameter is freed (a
# module replaced before initialize: a resized embedding), and the values go with it.
HELD: "WeakIdKeyDictionary[nn.Parameter, Held]" = WeakIdKeyDictionary()


LOCK = threading.Lock()


def pop_held(p: nn.Parameter) -> Held:
    """Take ``p``'s entry out of ``HELD`` (call with ``LOCK`` held); ``p`` gets its own class
    back ([Note: held placeholders refuse compute])."""
    held = HELD.pop(p)
    held.finalizer.detach()
    mark_gathered(p)
    for name in ("ds_shape", "ds_numel"):  # whole again (a stage-3 manager sets its own)
        p.__dict__.pop(name, None)
    return held


def init_shapes(module: nn.Module) -> Dict[nn.Parameter, torch.Size]:
    """True shapes of ``module``'s parameters that ``Init`` moved out."""
    return init_shapes_of(module.parameters())


def init_shapes_of(params) -> Dict[nn.Parameter, torch.Size]:
    """True shapes of those of ``params`` that ``Init`` moved out."""
    with LOCK:
        return {p: HELD[p].shape for p in params if p in HELD}


def note_cast(param: nn.Parameter, dtype: torch.dtype) -> None:
    """Record that held ``param``'s placeholder became ``dtype`` (``model.half()``, ``.to()``
    between the ``Init`` block and ``initialize``). [Note: casts of held parameters] The held
    values then pass through every dtype but the last, as a plain parameter's would:
    ``model.half().float()`` rounds them to fp16, as it does a plain parameter's. The last
    cast is the caller's: the engine keeps fp32 values of a model cast to bf16/fp16 as its
    masters ([Note: Init masters]). A no-op for a parameter ``Init`` does not hold."""
    with LOCK:
        held = HELD.get(param)
        if held is not None and dtype != (held.casts[-1] if held.casts else held.dtype):
            held.casts.append(dtype)


def init_dtype(param: nn.Parameter) -> Optional[torch.dtype]:
    """The dtype ``Init`` holds ``param``'s values in (as constructed, before any later cast of
    the module); None when ``Init`` does not hold it."""
    with LOCK:
        held = HELD.get(param)
    return held.dtype if held is not None else None


def take_init_values(param: nn.Parameter) -> torch.Tensor:
    """Return the values ``Init`` holds for ``param`` (a new CPU tensor) and forget them.

    Raises:
        KeyError: ``param`` was not created under ``Init`` (or was taken already).
        RuntimeError: ``param.data`` was replaced after the ``Init`` block (``p.data = t``): the
            held values would silently win over the new ones.
    """
    check_placeholders([param])
    with LOCK:
        held = pop_held(param)
    allow_copies(param)
    return held.owner._take(held)


def check_placeholders(params) -> None:
    """Raise RuntimeError naming the first parameter ``Init`` holds whose ``.data`` is no longer
    its empty placeholder (``p.data = t`` after the block): the held values would silently win
    over the new ones. ``zeroinf.initialize``
    checks every parameter before it takes any value, so a refusal loses nothing."""
    for p in params:
        if p.data.numel() != 0:
            with LOCK:
                held = HELD.get(p)
            if held is not None:
                raise RuntimeError(f"zeroinf.Init: a held parameter (shape {tuple(held.shape)}) was given new data "
                                   f"(p.data = a tensor of shape {tuple(p.data.shape)}) after the Init block; Init "
                                   "still holds its old values, which initialize would take. Change weights inside "
                                   "zeroinf.gathered_parameters([p], modifier_rank=0), or load them after initialize; "
                                   "nothing was taken")


def rounded(held: Held, values: torch.Tensor) -> torch.Tensor:
    """``values`` (held dtype) passed through every cast of the placeholder but the last."""
    if len(held.casts) < 2:
        return values
    out = values
    for dtype in held.casts[:-1]:
        out = out.to(dtype)
    return out.to(held.dtype)


def refuse_copy(*_args):
    """``__deepcopy__`` / ``__reduce_ex__`` of a parameter ``Init`` moved out: its copy would
    hold the empty placeholder, with nothing to take its values from (``zeroinf.initialize`` on a
    deep-copied model failed on "'weight' must be 2-D"); raise ``TypeError`` saying what to do."""
    raise TypeError("zeroinf.Init: this parameter holds an empty placeholder until zeroinf.initialize takes its "
                    "values (Init keeps them in host memory or a swap file), so it cannot be deep-copied or pickled; "
                    "build a second model inside zeroinf.Init, or after zeroinf.initialize load the model's "
                    "state_dict() into a new one")


def refuse_copies(p: nn.Parameter) -> None:
    """Make ``copy.deepcopy(p)`` and pickling ``p`` raise :func:`refuse_copy`'s ``TypeError``
    while ``Init`` holds ``p``'s values. Instance attributes, not the held class: inside
    ``gathered_parameters`` a held parameter computes on its plain class and still refuses
    copies (copy and pickle look both up on the instance first)."""
    for name in ("__deepcopy__", "__reduce_ex__"):
        setattr(p, name, refuse_copy)


def allow_copies(p: nn.Parameter) -> None:
    """Undo :func:`refuse_copies` once ``p``'s values are no longer held."""
    for name in ("__deepcopy__", "__reduce_ex__"):
        p.__dict__.pop(name, None)


def held_state_dict_hook(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata) -> None:
    """[Note: state_dict before initialize] Between the ``Init`` block and
    ``zeroinf.initialize`` a moved-out parameter is an empty placeholder, so
    ``model.state_dict()`` (``torch.save``, ``save_pretrained``) held empty tensors, silently.
    This hook, on every module whose parameters ``Init`` moved out, puts a copy of the held
    values in their place (read from the swap file on NVMe). Once the manager took a
    parameter's values it is no longer held and the hook leaves it to the engine's own."""
    if not HELD:  # nothing held any more (after initialize): the hooks stay, at the cost of this test
        return
    for name, p in module._parameters.items():
        key = prefix + name
        if p is None or state_dict.get(key) is p:  # keep_vars=True: the parameter object stays
            continue
        with LOCK:
            held = HELD.get(p)
        if held is not None and key in state_dict:
            # in the placeholder's dtype, as a plain model's state_dict after model.half() (it gave
            # the fp32 values)
            state_dict[key] = held.owner._peek(held).to(p.dtype)


def held_load_pre_hook(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata, strict,
                        missing_keys, unexpected_keys, error_msgs) -> None:
    """``model.load_state_dict(pretrained)`` between the ``Init`` block and ``zeroinf.initialize``
    failed on torch's shape check against the empty placeholders ("size mismatch ... the shape in
    current model is torch.Size([0])"), which blamed the checkpoint. Each held
    parameter's value is written into what ``Init`` holds for it, and torch is left an empty
    tensor to copy into the placeholder; a value of another shape is reported against the held
    shape, as torch reports it for a plain model. ``state_dict`` is torch's own shallow copy."""
    if not HELD:
        return
    for name, p in module._parameters.items():
        key = prefix + name
        with LOCK:
            held = HELD.get(p) if p is not None else None
        if held is None or key not in state_dict or p.data.numel() != 0:
            # not held, or its values are out in a gathered_parameters block: torch's copy writes
            # them and the block's end keeps them (written here, the block's end would write its
            # stale copy back over them)
            continue
        if local_metadata.get("assign_to_params_buffers"):  # it put the placeholder in as the value: all lost
            raise RuntimeError(f"zeroinf.Init: load_state_dict(..., assign=True) between the Init block and "
                               f"zeroinf.initialize would replace the held parameter '{key}' (shape "
                               f"{tuple(held.shape)}) by a plain tensor that Init does not hold; load with "
                               "assign=False (the default): the values are written into what Init holds")
        value = state_dict[key]
        if not isinstance(value, torch.Tensor):
            continue  # torch reports it
        if tuple(value.shape) != tuple(held.shape):
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {value.shape} from checkpoint, "
                              f"the shape in current model is {held.shape}.")
        else:
            held.owner._rewrite(held, value)
        state_dict[key] = p.detach()  # the placeholder itself: torch's shape check and copy pass


def held_forward_pre_hook(module: nn.Module, args) -> None:
    """A forward of a module whose parameter ``Init`` still holds (before ``zeroinf.initialize``)
    computed on the empty placeholder: "mat2 must be a matrix, got 1-D tensor". Raise saying so.
    On every forward of such a module for good: after initialize ``HELD`` is empty and the
    first test returns."""
    if not HELD:
        return
    for name, p in module._parameters.items():
        with LOCK:
            held = HELD.get(p) if p is not None else None
        if held is not None:
            raise RuntimeError(
                f"zeroinf.Init: parameter '{name}' (shape {tuple(held.shape)}) of this {type(module).__name__} is held by "
                "zeroinf.Init until zeroinf.initialize takes it, and is an empty placeholder until then, so this "
                "forward would compute on nothing: call zeroinf.initialize(model=...) first, or read the weights "
                "inside zeroinf.gathered_parameters(...)")


set_held_hooks(init_shapes_of, note_cast)  # released.py describes and casts held parameters through them
