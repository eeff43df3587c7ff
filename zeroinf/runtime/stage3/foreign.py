"""Torch function modes of a stage-3 manager.

[Note: foreign access] A module may read a parameter that belongs to another, released unit (a
head tied to an embedding it does not own, ``other.weight`` in a forward). While the model's
forward runs, a ``TorchFunctionMode`` looks at the parameters passed to every torch function;
one whose unit is not the running unit is requested like any unit (gathered on demand unless
prefetched or still live; counted as ``foreign_gathers``, recorded in the trace) and kept until
the current unit's forward ends. A released parameter is therefore never seen as an empty
placeholder inside a forward; outside it, compute on one raises an error that names it (see
[Note: released parameters] in ``released.py``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.overrides import TorchFunctionMode

from .released import attribute_of

if TYPE_CHECKING:
    from .manager import Stage3ParameterManager


class _ManagerMode(TorchFunctionMode):
    """A torch function mode of one manager (``self.m``)."""

    def __init__(self, manager: "Stage3ParameterManager"):
        super().__init__()
        self.m = manager

    def _note_data_get(self, func, args) -> None:
        """``func(*args)`` reads a gathered parameter's ``.data``: an in-place op on it moves no
        version counter, so the manager copies what it holds now ([Note: changes in a
        forward])."""
        if (args and getattr(func, "__name__", "") == "__get__" and isinstance(args[0], nn.Parameter)
                and attribute_of(func) == "data"):
            s = self.m.slot_of(args[0])
            if s is not None and not s.data_read:
                self.m._note_data_read(s.group, s)


class _ForeignAccessMode(_ManagerMode):
    """See [Note: foreign access]."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        m = self.m
        if not m._busy:
            for a in _shallow_args(args, kwargs):
                if isinstance(a, nn.Parameter):
                    s = m.slot_of(a)
                    if s is not None and not s.unit.persistent and s.unit not in m._active \
                            and s.unit not in m._foreign:
                        m._gather_foreign(s.unit)
            self._note_data_get(func, args)  # after its gather
        return func(*args, **kwargs)


def _shallow_args(args, kwargs):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a
    yield from kwargs.values()


class _RecomputeMode(_ManagerMode):
    """[Note: recompute in the backward] Activation checkpointing recomputes a unit's forward
    inside the backward, where the saved-tensor hooks of [Note: saved tensors] are not active:
    an op then saves a frozen parameter (``requires_grad=False``) as the parameter object itself
    (torch's checkpoint detaches only tensors that require grad). The unit is released once its
    trainable gradients are in, and a frozen weight still needed later in its backward (a
    LoRA block's frozen LayerNorm before a trainable adapter) was read as the empty
    placeholder: "weight of shape [0]". While a unit's forward runs in the backward, this
    mode passes its frozen parameters to every op detached: a tensor that keeps the gathered
    storage alive for as long as the op's saved tensors need it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        m = self.m
        if not m._busy:
            # a recompute repeats the forward's changes through .data too (a
            # non-idempotent one must get its second application): the release in the
            # backward keeps them, as it keeps those under no_grad
            self._note_data_get(func, args)
            args = tuple(self._swap(a) for a in args)
            kwargs = {k: self._swap(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    def _swap(self, a):
        if isinstance(a, nn.Parameter):
            return a.detach() if not a.requires_grad and self.m.slot_of(a) is not None else a
        if isinstance(a, (list, tuple)) and any(isinstance(x, nn.Parameter) for x in a):
            return type(a)(self._swap(x) for x in a)
        return a
