"""Released stage-3 parameters: empty placeholders that refuse compute.

[Note: released parameters] A released parameter's ``.data`` is an empty placeholder (shape
``[0]``): the manager's hooks and autograd rely on that, and it is what frees the memory. Used
in compute outside the model's forward (where the foreign-access mode in ``foreign.py`` gathers
it first) such a placeholder would silently give wrong answers: ``model.head.weight.sum()`` is
0. So while a parameter is released its Python class is switched to a subclass of its own class
(``released_class``) whose ``__torch_function__`` lets metadata and bookkeeping through (shape,
dtype, ``.grad``, ``.data``, hooks, ``detach``, ``numel``) and raises a ``RuntimeError`` naming
the parameter for anything else. When the unit is gathered the original class comes back, so
the forward and backward compute on plain parameters and pay nothing for this. ``isinstance(p,
nn.Parameter)`` holds in both states. :func:`mark_released` and :func:`mark_gathered` are the
one place that switches the class; the manager's record of the parameter (``ParamSlot.status``)
says which state it is in.

``p.data`` and ``p.detach()`` of such a parameter are its empty placeholder too, and plain
tensors would compute on nothing again (``model.head.weight.detach().norm()`` gave 0, and
``nn.init.normal_(p.data)`` on a parameter ``zeroinf.Init`` holds changed nothing). So they
come back as a ``ReleasedTensor`` (``HeldTensor``): a plain-tensor twin with the same rules,
which names the parameter it came from. Only empty results are wrapped: a ``.data`` the user
replaced with whole values on a parameter ``zeroinf.Init`` holds computes as given
(``initialize`` then checks it). On a released parameter of an engine ``p.data = t`` raises,
naming it: the next gather would drop it (inside ``gathered_parameters`` it is kept).

Every managed parameter also carries DeepSpeed's ``ds_shape`` (``torch.Size``, the full shape)
and ``ds_numel`` (int, the full element count), gathered or not.
"""
from __future__ import annotations

import math
import weakref
from typing import Callable, Dict, Iterable, Optional, Tuple

import torch
from torch import nn

from .registry import managers

__all__ = ["mark_released", "mark_gathered", "hide_from_dynamo", "released_class", "gathered_class", "is_released", "PASS_THROUGH"]

#: torch functions allowed on a released parameter: attribute access (``__get__``/``__set__``:
#: ``.shape``, ``.grad``, ``.data``, ...), metadata, hooks, ``detach`` (``state_dict``
#: detaches before the engine's hook puts the full values in), and ``torch.autograd.grad`` /
#: ``torch.autograd.backward`` with the parameter among their inputs (autograd reads only its
#: gradient edge; the backward's hooks gather the weights it computes with). Copies and pickles are refused
#: (they went through ``.data`` and held an empty tensor).
PASS_THROUGH = frozenset({
    "__get__", "__set__", "__hash__", "__format__", "__setstate__",
    "detach", "requires_grad_", "numel", "nelement", "dim", "ndimension", "size", "stride",
    "element_size", "is_contiguous", "is_floating_point", "is_complex", "get_device", "data_ptr",
    "untyped_storage", "storage_offset", "register_hook", "register_post_accumulate_grad_hook", "_is_view",
    "grad", "backward",  # torch.autograd.grad / backward with respect to it: the hooks gather what they compute on
})

#: what a parameter ``zeroinf.Init`` holds also lets through: the conversions of ``Module._apply``
#: (``model.half()``, ``model.to(device)`` between the ``Init`` block and ``initialize``), which
#: make a placeholder of the new dtype or device that ``initialize`` then casts the values to.
HELD_PASS_THROUGH = PASS_THROUGH | frozenset({"to", "half", "float", "double", "bfloat16", "cpu", "cuda", "type",
                                              "_has_compatible_shallow_copy_type"})

_CLASSES: Dict[Tuple[type, bool], type] = {}

#: What ``zeroinf.Init`` (held.py) knows of the parameters it holds: ``shapes_of(params)``, the
#: true shapes of those it holds, and ``note_cast(param, dtype)``, a cast of one's placeholder.
#: held.py installs them when imported (:func:`set_held_hooks`); until then no parameter is held.
#: This module does not import held.py or init.py, which import it: dependencies point one way.
_held_hooks: Tuple[Callable[[Iterable[nn.Parameter]], Dict[nn.Parameter, torch.Size]],
                   Callable[[nn.Parameter, torch.dtype], None]] = (lambda params: {}, lambda param, dtype: None)


def set_held_hooks(shapes_of: Callable[[Iterable[nn.Parameter]], Dict[nn.Parameter, torch.Size]],
                   note_cast: Callable[[nn.Parameter, torch.dtype], None]) -> None:
    """Install ``zeroinf.Init``'s ``shapes_of`` and ``note_cast`` (see ``_held_hooks``)."""
    global _held_hooks
    _held_hooks = (shapes_of, note_cast)


def _describe(p: torch.Tensor) -> Tuple[str, Optional[torch.Size]]:
    """(qualified name, full shape) of a released parameter, or of the parameter a placeholder
    view came from, from the manager that owns it (or ``zeroinf.Init``, which knows no names)."""
    source = getattr(p, "_zeroinf_source", None)
    if source is not None:
        p = source()
        if p is None:
            return "a freed parameter", None
    for m in managers(include_closed=True):
        s = m.slot_of(p)
        if s is not None:
            return s.name, s.shape
    held = _held_hooks[0]([p])
    if held:
        return "a parameter", held[p]
    return "<unmanaged>", getattr(p, "ds_shape", None)


class _ReleasedMixin:
    """See [Note: released parameters]."""

    _zeroinf_gathered_class: type = nn.Parameter
    _zeroinf_pass: frozenset = PASS_THROUGH

    def __new__(cls, *args, **kwargs):
        # type(p)(tensor) on a released or held parameter (accelerate's set_module_tensor_to_device
        # does that) builds a new, whole parameter: of the plain class, which computes (it refused,
        # as "<unmanaged> ... is held"). Class swaps do not come here.
        return cls._zeroinf_gathered_class(*args, **kwargs)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name not in cls._zeroinf_pass and not (name == "copy_" and _empty_copy(args)):
            p = _first_released(list(args) + list(kwargs.values()))
            _refuse(p, f"'{name or func}' on it would compute on nothing")
        if (name == "__set__" and cls._zeroinf_pass is PASS_THROUGH and attribute_of(func) == "data"
                and len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].numel() != 0):
            # the manager gives a released parameter only placeholders; the next gather drops this
            _refuse(args[0], "a new .data given to it (p.data = t) would be dropped by its next gather")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if name in ("detach", "__get__", "__set__") and args and isinstance(args[0], _ReleasedMixin):
            data = name != "detach" and attribute_of(func) == "data"
            if name == "detach" or (name == "__get__" and data):
                out = _placeholder_view(out, args[0])
            elif name == "__set__" and data and cls._zeroinf_pass is HELD_PASS_THROUGH:
                # model.half() etc. set .data to a placeholder of the new dtype
                _held_hooks[1](args[0], args[1].dtype)
        return out

    def __deepcopy__(self, memo):
        _refuse(self, "a copy would hold nothing (copy.deepcopy)")

    def __reduce_ex__(self, protocol):
        _refuse(self, "a copy would hold nothing (copy.copy, pickle, torch.save)")

    def __repr__(self, *args, **kwargs) -> str:
        pname, shape = _describe(self)
        shape_s = tuple(shape) if shape is not None else "?"
        if type(self)._zeroinf_pass is HELD_PASS_THROUGH:  # Init knows no names (it said "released ... a parameter")
            state = "a parameter held by zeroinf.Init until zeroinf.initialize"
        else:
            state = f"released stage-3 parameter {pname}"
        what = (f"Tensor(the empty placeholder of {state}" if getattr(self, "_zeroinf_source", None) is not None
                else f"Parameter({state}")
        return f"{what}, shape {shape_s}, dtype {self.dtype}; read it inside zeroinf.gathered_parameters(...))"


def attribute_of(func) -> str:
    """The attribute a ``__get__`` / ``__set__`` that ``__torch_function__`` receives reads or
    writes (``"data"``, ``"shape"``, ...); ``""`` for anything else."""
    return getattr(getattr(func, "__self__", None), "__name__", "")


def _placeholder_view(out, src: torch.Tensor):
    """``out`` (``.data`` or ``.detach()`` of ``src``, a released or held parameter or a view
    made here) as the refusing tensor twin when it is the empty placeholder; else ``out``."""
    source = getattr(src, "_zeroinf_source", None)
    p = source() if source is not None else src
    if not isinstance(out, torch.Tensor) or out.numel() != 0 or p is None:
        return out
    shape = getattr(p, "ds_shape", None)
    if shape is None:
        shape = _describe(p)[1]
    if shape is None or math.prod(shape) == 0:
        return out  # an empty parameter: its placeholder is its whole value
    view = out.as_subclass(released_class(torch.Tensor, held=type(src)._zeroinf_pass is HELD_PASS_THROUGH))
    view._zeroinf_source = weakref.ref(p)
    return view


def _first_released(values) -> Optional[torch.Tensor]:
    """The first released parameter among ``values``, also inside lists and tuples (the
    ``torch._foreach_*`` ops take lists: a bare ``next()`` raised StopIteration there, which
    ends a ``map`` or generator silently)."""
    for v in values:
        if isinstance(v, _ReleasedMixin):
            return v
        if isinstance(v, (list, tuple)):
            found = _first_released(v)
            if found is not None:
                return found
    return None


def _refuse(p: Optional[torch.Tensor], why: str) -> None:
    """Raise the RuntimeError naming released parameter ``p``: ``why`` says what would go wrong."""
    pname, shape = _describe(p) if p is not None else ("a released parameter", None)
    shape_s = tuple(shape) if shape is not None else "?"
    state = ("is held by zeroinf.Init: until zeroinf.initialize takes its values it holds only" if
             p is not None and type(p)._zeroinf_pass is HELD_PASS_THROUGH else
             "is released: outside the model's forward it holds only")
    if torch.compiler.is_compiling():
        # dynamo reads every parameter of the module it compiles at entry, before any hook
        # gathers them (an InternalTorchDynamoError then wraps this message)
        raise RuntimeError(
            f"zeroinf stage 3: torch.compile of a module with partitioned parameters is not supported: dynamo "
            f"reads {pname} (shape {shape_s}) before the stage-3 hooks gather it, and it holds only an empty "
            f"placeholder then. Train without torch.compile at stage 3, or compile at stages 0-2, which keep "
            f"whole parameters")
    raise RuntimeError(
        f"zeroinf stage 3: {pname} (shape {shape_s}) {state} an empty placeholder, so {why}. Gather it first: "
        f"`with zeroinf.gathered_parameters([param]):` (add modifier_rank=0 to keep changes); "
        f"`param.ds_shape` / `param.ds_numel` give its full shape and size without gathering")


def _empty_copy(args) -> bool:
    """``dst.copy_(src)`` with both empty: a no-op (``load_state_dict`` after the engine's
    pre-hook wrote the values into the partitions and left empty tensors in the dict)."""
    return len(args) >= 2 and all(isinstance(a, torch.Tensor) and a.numel() == 0 for a in args[:2])


def released_class(cls: type, held: bool = False) -> type:
    """The released twin of parameter class ``cls`` (made once per class); ``held``: the twin
    for a parameter ``zeroinf.Init`` holds, which also lets ``HELD_PASS_THROUGH`` through."""
    cls = gathered_class(cls)
    twin = _CLASSES.get((cls, held))
    if twin is None:
        twin = _CLASSES[(cls, held)] = type(f"{'Held' if held else 'Released'}{cls.__name__}", (_ReleasedMixin, cls),
                                            {"_zeroinf_gathered_class": cls, "__module__": __name__,
                                             "_zeroinf_pass": HELD_PASS_THROUGH if held else PASS_THROUGH})
    return twin


def gathered_class(cls: type) -> type:
    """The original class of a (possibly released) parameter class."""
    return cls._zeroinf_gathered_class if issubclass(cls, _ReleasedMixin) else cls


def mark_released(p: nn.Parameter, held: bool = False) -> None:
    """Switch ``p`` to the released twin of its class: from now on it refuses compute, naming
    itself ([Note: released parameters]). The class is what enforces the state (the manager's
    record, ``ParamSlot.status``, says it): a record cannot make ``p.sum()`` raise, a class
    can. Set ``p.data`` to its empty placeholder before: the twin of an engine's parameter
    refuses a ``.data`` with values, and ``.data =`` on the plain class skips
    ``__torch_function__``. ``held``: ``p`` is held by ``zeroinf.Init`` ([Note: held
    placeholders refuse compute]), whose twin also lets ``HELD_PASS_THROUGH`` through.
    ``p``'s identity, hooks and ``.grad`` stay."""
    p.__class__ = released_class(type(p), held)


def mark_gathered(p: nn.Parameter) -> None:
    """Give ``p`` its own class back: it computes as a plain parameter, at no cost per op.
    A gather calls it before pointing ``p.data`` at the gathered values: ``.data =`` on the
    plain class skips ``__torch_function__``. A no-op on a parameter that is not released."""
    p.__class__ = gathered_class(type(p))


_hidden_from_dynamo = False


def hide_from_dynamo() -> None:
    """Have ``torch.compile`` (dynamo) run :func:`mark_released` and :func:`mark_gathered` as
    plain Python, never tracing their frames. Traced, they read their argument, a released
    parameter, as a tensor, and it refuses inside the hooks' gather; skipped, ``torch.compile``
    of a module with partitioned parameters is refused where the compiled forward first reads
    one, naming it. The manager calls this when it installs its hooks; the first call imports
    ``torch._dynamo`` (about a second). A torch without ``skip_code`` leaves them traced: the
    compile is refused either way."""
    global _hidden_from_dynamo
    if _hidden_from_dynamo:
        return
    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError:
        return
    for fn in (mark_released, mark_gathered):
        skip_code(fn.__code__)
    _hidden_from_dynamo = True


def is_released(p: torch.Tensor) -> bool:
    """True while ``p`` is a released stage-3 parameter."""
    return isinstance(p, _ReleasedMixin)
