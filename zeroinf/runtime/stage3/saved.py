"""Stage 3 saved-tensor hooks.

[Note: saved tensors] Autograd saves parameters (and views such as ``weight.t()``) for the
backward. Left alone, those references would keep every released flat buffer alive until the
backward. A ``saved_tensors_hooks`` pair replaces any saved tensor that lies in a gathered flat
buffer with a (group, offset, size, stride) reference and rebuilds the view at unpack time,
gathering the unit again if it was released. So memory follows the live-parameter count, and a
weight used by another module's forward is still correct in the backward.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .units import FlatGroup, ParamSlot, UnitState


class _SavedRef:
    """A saved tensor that lies in a flat buffer: rebuilt from the group at unpack time
    (``offset`` in elements from the start of ``group.full``, which may be a view). ``slot``:
    the parameter its offset lies in, whose ``_version`` was ``version`` and ``replaced`` count
    ``replaced`` when saved (None: in the padding)."""

    __slots__ = ("group", "offset", "size", "stride", "slot", "version", "epoch", "replaced")

    def __init__(self, group: FlatGroup, offset: int, size, stride, slot: Optional[ParamSlot] = None,
                 version: int = 0, epoch: int = 0, replaced: int = 0):
        self.group, self.offset, self.size, self.stride = group, offset, size, stride
        self.slot, self.version, self.epoch, self.replaced = slot, version, epoch, replaced


class _SavedTensor:
    """Any other saved tensor, detached (autograd restores its grad_fn at unpack), with its
    ``_version`` when saved: with saved-tensor hooks autograd no longer checks it, so
    :meth:`Stage3ParameterManager._unpack` does."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor, version: int):
        self.tensor, self.version = tensor, version


class SavedMixin:
    """The saved-tensor hooks' pack and unpack ([Note: saved tensors])."""

    # ------------------------------------------------------------------------ saved tensors
    def _pack(self, t: torch.Tensor):
        if self._storage_of and t.layout is torch.strided and t.device == self.device:
            try:
                g = self._storage_of.get(t.untyped_storage().data_ptr())
            except RuntimeError:
                g = None
            if g is not None and g.full is not None and t.untyped_storage().data_ptr() == g.full.untyped_storage().data_ptr():
                # the parameter it lies in: the parameter itself, a view (weight.t()) or a detached
                # copy (weight.detach()) shares its version counter, so an in-place edit before the
                # backward is caught as autograd catches it for any saved tensor (the rebuilt view
                # would otherwise carry the edit silently)
                off = t.storage_offset() - g.full.storage_offset()
                slot = self._slot_at(g, t, off)
                return _SavedRef(g, off, tuple(t.shape), tuple(t.stride()), slot,
                                 0 if slot is None else slot.param._version, self._param_epoch,
                                 0 if slot is None else slot.replaced)
        # detached: autograd puts the grad_fn back on unpack. Kept as is, an op's saved output
        # would hold its own grad_fn through this hook, a cycle through C++ the collector cannot
        # see: every graph not run backward (a grad-enabled eval, a backward that raised) would
        # stay in memory, with the engine its unpack hook refers to. The detached tensor shares
        # the version counter, so an in-place change before the backward is still caught
        return _SavedTensor(t.detach(), t._version)

    def _slot_at(self, g: FlatGroup, t: torch.Tensor, off: int) -> Optional[ParamSlot]:
        """The slot of the parameter that ``t`` (saved, lying at element ``off`` of ``g.full``)
        lies in: by dictionary for the parameter itself or a view of it (every forward saves
        these), by scanning ``g.slots`` otherwise (``weight.detach()``); None in the padding."""
        s = self.slot_of(t if isinstance(t, nn.Parameter) else t._base)
        if s is not None and s.group is g:
            return s
        return next((s for s in g.slots if s.offset <= off < s.offset + s.numel), None)

    def _unpack(self, x):
        if isinstance(x, _SavedRef):
            if x.slot is not None and x.slot.param._version != x.version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: parameter {x.slot.name} (shape {tuple(x.slot.shape)}) is at version "
                    f"{x.slot.param._version}; expected version {x.version} instead (zeroinf stage 3: an "
                    "in-place change of a gathered weight between its forward and its backward)")
            if x.slot is not None and x.slot.replaced != x.replaced:
                raise RuntimeError(
                    f"zeroinf stage 3: parameter {x.slot.name} (shape {tuple(x.slot.shape)}) was given new data "
                    "(p.data = t) in a forward after this backward's forward had used the weight; plain PyTorch's "
                    "backward computes with the old tensor, which stage 3 no longer holds (the new data went into "
                    "its partition). Change the weight before a forward uses it, or after the backward")
            if x.epoch != self._param_epoch:
                # the optimizer stepped the partitions since this forward: the backward would use the
                # new weights, silently (plain PyTorch raises here)
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: {'parameter ' + x.slot.name if x.slot is not None else 'a parameter of ' + x.group.key} "
                    "was updated by an optimizer step (engine.step) after the forward that saved it (zeroinf stage "
                    "3; plain PyTorch raises the same). Run each forward's backward before the step")
            g = x.group
            unit = g.unit
            # g.full exists from issue() on, but holds the values only once GATHERED: a unit
            # prefetched for its backward may still be FETCHING (read in flight) here
            if unit.state is not UnitState.GATHERED:
                with self.busy():
                    self._request(unit, "bwd", record=False)
            return g.full.as_strided(x.size, x.stride, g.full.storage_offset() + x.offset)
        t = x.tensor
        if t._version != x.version:  # autograd's own check, which saved-tensor hooks turn off
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{t.dtype} {list(t.shape)}] is at version {t._version}; expected version {x.version} instead "
                "(zeroinf stage 3: a tensor the forward saved was changed in place before the backward)")
        return t
