"""Stages 0-2: weights the user changed between optimizer steps reach the fp32 masters.

[Note: weights changed between steps] At stages 0-2 the optimizer steps masters that are not
the model's parameters (bf16/fp16, or fp32 with the optimizer state on NVMe or the parameters on
CUDA) and writes the result into the parameters, so a weight the user changed between steps
(``model.load_state_dict``, ``torch.nn.init``, an in-place op under ``torch.no_grad``) would be
put back by the next step, silently. :class:`WeightWatch` keeps each parameter's version counter
(and its place in the flat buffer) as the step left it; at the next step a parameter whose
counter moved is compared with its masters rounded to its dtype, and the elements that differ
are taken into the masters, as ``torch.optim.AdamW`` would step them. The engine's own writes
(through the kernel's pointers, the all-gather into the flat buffer) move no parameter's counter;
an in-place op on ``p.data`` moves none either and is not seen. fp32 with its masters in CPU
memory aliases them: a change lands in the master itself, and the comparison finds nothing.
"""
from __future__ import annotations

import weakref
from typing import Dict, List

import torch

__all__ = ["WeightWatch"]


def _loaded_values_hook(watch_ref, sixteen):
    """A load pre-hook (``Module.register_load_state_dict_pre_hook``) for a module owning bf16/fp16
    parameters: note the fp32 (or fp64) value ``load_state_dict`` copies into each (same shape,
    not on the meta device) for :meth:`WeightWatch.adopt_changed_weights`, which gives it to the
    masters at the next step or checkpoint save. A copy is held until then (4 bytes per element
    on the CPU): a reference took the source's later changes (a live fp32 model's weights,
    trained on after the load). A parameter changed again after the load is compared element by
    element, so a value the load did not copy, or a later change, is never taken for it."""
    def note(module, state_dict, prefix, *_args):
        watch = watch_ref()
        if watch is None:
            return
        for name, p in module._parameters.items():
            v = state_dict.get(prefix + name)
            if (p in sixteen and isinstance(v, torch.Tensor) and v.dtype in (torch.float32, torch.float64)
                    and v.shape == p.shape and not v.is_meta):
                watch.loaded_fp32[p] = v.detach().to("cpu", torch.float32, copy=True)
    return note


class WeightWatch:
    """The version counters, shapes, strides and flat-buffer addresses of a
    :class:`~zeroinf.runtime.flat.FlatParamManager`'s parameters, taken when it is built
    (after the masters were made), and the fp32 values a ``load_state_dict`` gave its 16-bit
    parameters. ``names``: parameter -> its name in the model, for errors."""

    def __init__(self, flat, names: Dict[torch.nn.Parameter, str]):
        self.flat = flat
        self.names = names
        self.versions = [[p._version for p in g.params] for g in flat.groups]
        # each parameter's shape and strides as a view of its flat buffer (contiguous), taken now
        self.shapes = [[p.shape for p in g.params] for g in flat.groups]
        self.strides = [[p.stride() for p in g.params] for g in flat.groups]
        self.homes = self._home_list()
        #: fp32 values a load_state_dict gave 16-bit parameters, for their masters (_loaded_values_hook)
        self.loaded_fp32: Dict[torch.nn.Parameter, torch.Tensor] = {}

    def load_hooks(self, model: torch.nn.Module) -> list:
        """Register :func:`_loaded_values_hook` on every module of ``model`` owning a bf16/fp16
        parameter of the flat buffers; returns the hook handles."""
        sixteen = {p for g in self.flat.groups for p in g.params if p.dtype in (torch.bfloat16, torch.float16)}
        note = _loaded_values_hook(weakref.ref(self), sixteen)
        return [m.register_load_state_dict_pre_hook(note) for m in model.modules()
                if any(p in sixteen for p in m._parameters.values() if p is not None)]

    def adopt_replaced_data(self) -> None:
        """``p.data = t`` (and ``model.half()`` then ``model.float()``, which do that) leaves a
        parameter outside its flat buffer: the step wrote the updates into the old storage and
        the parameter never trained again, silently. A replacement of the same shape, dtype and
        device is copied into the flat buffer, the parameter views the buffer again, and the next
        step takes its values into the masters. A re-view of the parameter's own data
        (``p.data = p.data.t()``: the same address, other strides) is adopted the same way.

        Raises:
            RuntimeError: a replacement of another shape, dtype or device (``model.half()`` not
                undone), or one that views another parameter's data (torch would keep the two
                tied), naming the parameter; nothing was changed.
        """
        # one pointer comparison per parameter, at the accumulation boundary (slicing the flat
        # buffer per parameter at every micro-step costs 1.4 us per parameter)
        # (strides too: p.data = p.data.t() keeps the address)
        moved = [(gi, j, p) for gi, j, p, home, st in self.homes if p.data_ptr() != home or p.stride() != st]
        if moved:  # the flat buffers themselves may have moved (model.share_memory())
            self.homes = self._home_list()
            moved = [(gi, j, p) for gi, j, p, home, st in self.homes if p.data_ptr() != home or p.stride() != st]
        if not moved:
            return
        groups = self.flat.groups
        flats = {g.flat.untyped_storage().data_ptr() for g in groups}
        for k, (gi, j, p) in enumerate(moved):
            g = groups[gi]
            off = g.offsets[j]
            view = g.flat[off:off + p.numel()]
            name = self.names.get(p, "?")
            if p.shape != self.shapes[gi][j] or p.dtype != view.dtype or p.device != view.device:
                raise RuntimeError(
                    f"zeroinf: parameter '{name}' was given data of shape {tuple(p.shape)}, "
                    f"{p.dtype} on {p.device} after zeroinf.initialize (p.data = t, model.half(), model.to(...)); "
                    f"the engine trains it as {tuple(self.shapes[gi][j])}, {view.dtype} on {view.device}. Undo "
                    "the change (model.float(), model.to(device)) and call it again, or build the "
                    "model as wanted before zeroinf.initialize")
            own = view.data_ptr() <= p.data_ptr() < view.data_ptr() + view.numel() * view.element_size()
            if p.untyped_storage().data_ptr() in flats and not own:  # torch would keep the two tied; the engine cannot
                raise RuntimeError(
                    f"zeroinf: parameter '{name}' was given data that views another trainable parameter's "
                    "(p.data = other.data[...]) after zeroinf.initialize; the engine keeps every parameter in its "
                    "own place and would untie them silently. Tie parameters before "
                    "zeroinf.initialize, by module attribute (head.weight = emb.weight)")
            moved[k] = (gi, j, p, view)
        for gi, j, p, view in moved:
            with torch.no_grad():
                view.copy_(p.detach().reshape(-1).clone())  # a clone: it may be a re-view of this very slot
            p.data = view.view(self.shapes[gi][j])
            self.versions[gi][j] = None  # compared with the masters at the next step

    def _home_list(self) -> list:
        """(group, index, parameter, address where its data starts in the flat buffer, its strides there) of every
        non-empty parameter (an empty tensor's ``data_ptr()`` is 0: nothing to adopt)."""
        return [(gi, j, p, g.flat.data_ptr() + off * g.flat.element_size(), self.strides[gi][j])
                for gi, g in enumerate(self.flat.groups) for j, (p, off) in enumerate(zip(g.params, g.offsets))
                if p.numel()]

    def adopt_changed_weights(self, sub_optimizer) -> None:
        """Take every parameter whose version counter moved since the last step (or whose data
        was replaced: :meth:`adopt_replaced_data`) into ``sub_optimizer``'s masters, element by
        element where they differ from the masters rounded to the parameter's dtype.

        A bf16/fp16 parameter loaded from fp32 (or fp64) values by ``load_state_dict``
        (:func:`_loaded_values_hook`) gives its masters those values, not their rounding, where it
        still holds that rounding: the elements whose rounding had not moved kept their trained
        master (as at stage 3: ``units.exact_values``)."""
        index = self.flat.sub_index()
        loaded, self.loaded_fp32 = self.loaded_fp32, {}
        todo: Dict[int, List] = {}  # sub-group -> [(start, end, values, loaded fp32 or None)] in sub-group coordinates
        for gi, g in enumerate(self.flat.groups):
            seen = self.versions[gi]
            for j, p in enumerate(g.params):
                if p._version == seen[j]:
                    continue
                seen[j] = p._version
                values, off = p.detach().reshape(-1), g.offsets[j]
                exact = loaded.get(p)  # a CPU fp32 copy already (_loaded_values_hook)
                if exact is not None:
                    exact = exact.reshape(-1)
                for i, (sg, s, n) in enumerate(index):
                    lo = g.part_start + s
                    a, b = max(off, lo), min(off + values.numel(), lo + n)
                    if sg is g and a < b:
                        todo.setdefault(i, []).append((a - lo, b - lo, values[a - off:b - off].to("cpu"),
                                                       None if exact is None else exact[a - off:b - off]))
        nvme = sub_optimizer.device == "nvme"
        for i, pieces in todo.items():  # each sub-group's state read once, however many parameters changed
            with sub_optimizer.state(i) as (master, m, v):
                if nvme:  # the swap buffer is gone after the block: keep copies to write back
                    master, m, v = master.clone(), m.clone(), v.clone()
                changed_any = False
                for a, b, new, exact in pieces:
                    old = master[a:b]
                    changed = new != old.to(new.dtype)
                    src = new
                    if exact is not None:  # the loaded fp32 value where the parameter still holds its rounding
                        took = exact.to(new.dtype) == new
                        src = torch.where(took, exact, new.float())
                        changed |= took & (exact != old)
                    if bool(changed.any()):
                        old[changed] = src[changed].float()
                        changed_any = True
            if nvme and changed_any:
                sub_optimizer.load_state(i, master, m, v)

    def mark_current(self) -> None:
        """Take the parameters as they are now for the fp32 masters' rounded values (after a
        checkpoint load wrote both), so the next step does not compare them again."""
        self.versions = [[p._version for p in g.params] for g in self.flat.groups]
        self.loaded_fp32 = {}
