"""``state_dict`` / ``load_state_dict`` of a stage-3 model and of its submodules.

[Note: module state dict] Outside the forward a partitioned parameter is an empty placeholder, so
``nn.Module.state_dict`` would return shape-``(0,)`` tensors and ``load_state_dict`` would fail on
their shape. :class:`ModuleStateHooks` puts a ``state_dict`` hook and a load pre-hook on every module
holding partitioned parameters (in its subtree), which read and write the partitions:

* ``state_dict``: the module the call was made on (or the highest hooked module below a wrapper)
  fills every value of its subtree that is still a placeholder (or an alias of a gathered
  parameter) with a copy of the full value, gathering each flat group once; a parameter with
  several names (tied) gets one copy under all of them, as its names share storage in plain
  PyTorch. A module with ``state_dict`` hooks of its own (or a class with its own ``state_dict``)
  fills its subtree first, so those hooks see, and may change, full values; the engine's hook
  runs before the module's others. A module made later that takes a partitioned parameter gets
  the hooks too (a process-wide parameter registration hook).
* ``load_state_dict``: the first hooked module of a load (pre-order) writes the values of its
  subtree into the partitions, each group once, and leaves in the dict each parameter's own data
  (so torch's shape check passes and its copy changes nothing). Below a module with load
  pre-hooks of its own, or its own ``_load_from_state_dict``, that module's hook writes instead,
  after its other pre-hooks (the engine's is kept last, :func:`_load_hooks_last`), so the values
  they change are the ones written; a parameter also named below such a module is written by the
  module owning each name, in torch's order, so the last name wins as in plain PyTorch. Values put
  in the dict by a hook above are known by identity and skipped, whatever recursion runs the load.
  A value of the wrong shape is reported as torch reports it, and the others are written: plain
  PyTorch's result.
* A class with its own ``_save_to_state_dict`` or ``_load_from_state_dict`` (it reads or writes
  its parameters itself: a derived entry, a transposed layout) runs it with the module's own
  parameters gathered (:meth:`ModuleStateHooks._gathered_call`); the engine's hooks leave those
  parameters' names to it.

The hooks hold the manager weakly: a closed engine's partitions are freed while the model lives.
"""
from __future__ import annotations

import copy
import sys
import weakref
from typing import Dict, List

import torch

from zeroinf.waits import collective
from .units import FlatGroup, exact_values

__all__ = ["ModuleStateHooks"]

_LIVE: "weakref.WeakSet[ModuleStateHooks]" = weakref.WeakSet()
_REGISTRATION = None  # the process-wide parameter registration hook, installed with the first model


def _on_parameter_registered(module, name, param):
    """``torch.nn.modules.module.register_module_parameter_registration_hook``: a module made
    after ``initialize`` that takes a partitioned parameter (``lin.weight = model.head.weight``)
    gets the engine's hooks, so its ``state_dict`` / ``load_state_dict`` use the partitions too
    (they gave the placeholder and failed on its shape)."""
    for hooks in list(_LIVE):
        m = hooks._manager()
        if m is not None and m.slot_of(param) is not None and module not in hooks._hooked:
            hooks._hook(module)
    return None


def _load_hooks_last(module: torch.nn.Module, key: int):
    """``module._register_load_state_dict_pre_hook`` (the public ``register_load_state_dict_pre_hook``
    calls it) that keeps the engine's pre-hook (key ``key``) last, so the engine writes the values
    the module's own pre-hooks leave, whenever they were registered."""
    register = type(module)._register_load_state_dict_pre_hook
    ref = weakref.ref(module)

    def register_before(hook, with_module=False):
        mod = ref()
        handle = register(mod, hook, with_module)
        hooks = mod._load_state_dict_pre_hooks
        if key in hooks:
            hooks.move_to_end(key)
        return handle
    return register_before


def _refuse_copy(kind: str):
    """A ``__deepcopy__`` / ``__reduce_ex__`` for a module holding partitioned parameters: its
    copy (or pickle, ``torch.save(module)``) would hold the empty placeholders and, through the
    engine's hooks, fail on a lock ("cannot pickle '_thread.lock' object"); raise ``TypeError``
    saying how to copy the values instead. ``copy.copy`` (which calls ``__reduce_ex__``) still
    makes its shallow copy, sharing the parameters."""
    def refuse(*args):
        caller = sys._getframe(1)
        if caller.f_code is copy.copy.__code__ and "x" in caller.f_locals:  # copy.copy(x)'s object
            x = caller.f_locals["x"]
            return type(x).__reduce_ex__(x, *args)
        raise TypeError(f"zeroinf stage 3: a {kind} holding partitioned parameters cannot be deep-copied or "
                        f"pickled: it holds empty placeholders, the values live in the engine's partitions. Copy "
                        f"the values: build a new module and load `module.state_dict()` into it (full values, "
                        f"gathered one group at a time), or copy the model before zeroinf.initialize")
    return refuse


class ModuleStateHooks:
    """The ``state_dict`` and load hooks of one stage-3 model; see [Note: module state dict].

    Args:
        model: the partitioned model (``nn.Module``).
        manager: its :class:`~zeroinf.runtime.stage3.manager.Stage3ParameterManager` (held weakly).
    """

    def __init__(self, model: torch.nn.Module, manager) -> None:
        self._manager = weakref.ref(manager)
        self._hooked: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        self._load_key: "weakref.WeakKeyDictionary[torch.nn.Module, int]" = weakref.WeakKeyDictionary()
        self._placed: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
        for sub in model.modules():
            if any(manager.slot_of(p) is not None for p in sub.parameters()):
                self._hook(sub)
        global _REGISTRATION
        _LIVE.add(self)
        if _REGISTRATION is None:
            _REGISTRATION = torch.nn.modules.module.register_module_parameter_registration_hook(
                _on_parameter_registered)

    def _hook(self, sub: torch.nn.Module) -> None:
        """Put the engine's ``state_dict`` hook (first) and load pre-hook (last) on ``sub``, and
        refuse its copies."""
        self._hooked.add(sub)
        sd = sub._register_state_dict_hook(self._state_dict_hook)
        sub._state_dict_hooks.move_to_end(sd.id, last=False)
        ld = sub.register_load_state_dict_pre_hook(self._load_pre_hook)
        self._load_key[sub] = ld.id
        object.__setattr__(sub, "_register_load_state_dict_pre_hook", _load_hooks_last(sub, ld.id))
        refuse = _refuse_copy(type(sub).__name__)
        object.__setattr__(sub, "__deepcopy__", refuse)  # copy and pickle look both up on the instance
        object.__setattr__(sub, "__reduce_ex__", refuse)
        for name in ("_save_to_state_dict", "_load_from_state_dict"):
            if getattr(type(sub), name) is not getattr(torch.nn.Module, name):  # the class reads its parameters
                object.__setattr__(sub, name, self._gathered_call(sub, name))

    def _gathered_call(self, sub: torch.nn.Module, name: str):
        """``sub``'s own ``_save_to_state_dict`` / ``_load_from_state_dict`` (a class overriding
        it reads or writes its parameters itself: a derived entry, a transposed layout, a buffer
        computed from the loaded weight), called with ``sub``'s own partitioned parameters
        gathered. Saved values that view the gathered buffers are copied before the release;
        loaded values are written back into the partitions (rank 0's, with several ranks)."""
        orig = getattr(type(sub), name)
        ref = weakref.ref(sub)
        saving = name == "_save_to_state_dict"

        def call(destination, prefix, *args, **kwargs):
            from .api import _gathered
            mod, m = ref(), self._manager()
            own = [p for p in mod._parameters.values() if p is not None and m is not None and m.slot_of(p) is not None]
            if not own:
                return orig(mod, destination, prefix, *args, **kwargs)
            with _gathered(own, modifier_rank=None if saving else 0, loading=not saving):
                out = orig(mod, destination, prefix, *args, **kwargs)
                if saving:
                    live = {p.untyped_storage().data_ptr() for p in own}
                    for k, v in list(destination.items()):
                        if (k.startswith(prefix) and isinstance(v, torch.Tensor)
                                and v.untyped_storage().data_ptr() in live):
                            destination[k] = v.detach().clone()
            return out
        return call

    def hooks(self, module) -> bool:
        """Whether ``module`` carries the engine's hooks."""
        return module in self._hooked

    def _live_manager(self, module):
        """The manager; RuntimeError once its engine was closed and freed."""
        m = self._manager()
        if m is None:
            raise RuntimeError(f"zeroinf stage 3: the engine that partitioned this {type(module).__name__} was closed "
                               "and freed: its parameters hold only empty placeholders. Build a new model (and a new "
                               "engine) and load a checkpoint into it")
        return m

    # --- which module serves which values ----------------------------------------------------
    def _own_hooks(self, module, load: bool) -> bool:
        """Whether ``module`` has ``state_dict`` hooks or its own ``state_dict`` (``load``: load
        pre-hooks, or its own ``_load_from_state_dict``) besides the engine's."""
        ours = 1 if module in self._hooked else 0
        if not load:  # a class's own state_dict may rename or drop what its hooks left
            return (len(module._state_dict_hooks) > ours
                    or type(module).state_dict is not torch.nn.Module.state_dict)
        return (len(module._load_state_dict_pre_hooks) > ours
                or type(module)._load_from_state_dict is not torch.nn.Module._load_from_state_dict)

    def _names_below(self, module, prefix: str, load: bool, children: bool = True):
        """``{param: [state-dict names]}`` of ``module``'s own parameters and, with ``children``,
        of every module below it (pre-order, as torch visits them), and, for ``load``, the
        parameters below modules with load hooks of their own (those modules write them)."""
        names: Dict[torch.nn.Parameter, List[str]] = {}
        deferred = set()
        stack = [(module, prefix)]
        while stack:
            mod, pre = stack.pop()
            for n, p in mod._parameters.items():
                if p is not None:
                    names.setdefault(p, []).append(pre + n)
            if not children:
                break
            below = []
            for cn, c in mod._modules.items():
                if c is None:
                    continue
                if load and self._own_hooks(c, load=True):
                    deferred.update(c.parameters())
                else:
                    below.append((c, pre + cn + "."))
            stack.extend(reversed(below))
        if deferred:  # also named below a module that loads it itself: each name's module writes it, in order
            own = {prefix + n for n, p in module._parameters.items() if p is not None}
            names = {p: [n for n in ns if n in own] if p in deferred else ns for p, ns in names.items()}
            names = {p: ns for p, ns in names.items() if ns}
        return names

    def _by_group(self, m, names):
        """``[(group, [(slot, names)])]`` in the manager's group order (the same on every rank:
        gathers are collective)."""
        by_group: Dict[FlatGroup, list] = {}
        for p, ns in names.items():
            s = m.slot_of(p)
            if s is not None:
                by_group.setdefault(s.group, []).append((s, ns))
        return [(g, by_group[g]) for g in m.groups() if g in by_group]

    # --- state_dict ------------------------------------------------------------------------------
    def _serves(self, module, state_dict) -> bool:
        """Whether the hook of ``module`` fills ``state_dict`` (the destination dict of the
        ``nn.Module.state_dict`` call it fires in): the module has hooks of its own, or no module
        above it in that call holds the engine's hooks (the module the call was made on, or the
        highest hooked one below an unhooked wrapper). ``state_dict`` recurses through
        ``state_dict`` calls: the frames up this thread's stack with the same destination are the
        modules above."""
        if self._own_hooks(module, load=False):
            return True
        code = torch.nn.Module.state_dict.__code__
        f = sys._getframe(2)
        while f is not None:
            if f.f_code is code and f.f_locals.get("destination") is state_dict:
                owner = f.f_locals.get("self")
                if owner is not module and owner in self._hooked:
                    return False
            f = f.f_back
        return True

    def _state_dict_hook(self, module, state_dict, prefix, local_metadata):
        """Replace the placeholders (and aliases of gathered parameters) of ``module``'s subtree
        by copies of the full values, one flat group at a time."""
        if not self._serves(module, state_dict):
            return state_dict
        m = self._live_manager(module)
        if m.state_guard is not None:  # a submodule's call too: the root's hook checks only the root's
            m.state_guard.check("state_dict")
        with collective(f"{type(module).__name__}.state_dict() of a stage-3 model (it all-gathers the partitions)",
                        m.rank, m.world_size):
            for g, slots in self._by_group(m, self._names_below(module, prefix, load=False)):
                todo = [(s, [n for n in names if self._untouched(state_dict.get(n), s)]) for s, names in slots]
                todo = [(s, ns) for s, ns in todo if ns]
                if not todo:
                    continue  # filled below, or changed by a hook
                full = m.gather_group_copy(g)
                for s, ns in todo:
                    value = full[s.offset:s.offset + s.numel].view(s.shape).clone()
                    for n in ns:  # tied names share one tensor, as their storage is shared in plain PyTorch
                        state_dict[n] = value
        return state_dict

    @staticmethod
    def _untouched(v, s) -> bool:
        """Whether ``v`` is what ``_save_to_state_dict`` put for slot ``s``'s parameter: its
        placeholder, or (gathered) its live data; not a value a hook put there."""
        if not isinstance(v, torch.Tensor):
            return False
        if v.numel() == 0:
            return s.numel > 0
        p = s.param
        return v.data_ptr() == p.data_ptr() and v.shape == p.shape and v.stride() == p.stride()

    # --- load_state_dict -------------------------------------------------------------------------
    def _load_pre_hook(self, module, state_dict, prefix, local_metadata, strict, missing_keys,
                       unexpected_keys, error_msgs):
        """Write the loaded values of the parameters this hook serves into the partitions, one
        write per flat group; see [Note: module state dict].

        Raises:
            RuntimeError: the engine was closed, or ``assign=True`` (it would put plain tensors in
                place of the partitioned parameters). A value of the wrong shape, or on the meta
                device, goes into ``error_msgs`` with torch's message (``load_state_dict`` raises
                it after loading the rest, as in plain PyTorch).
        """
        m = self._live_manager(module)
        m._check_open()  # a closed engine's partitions are gone: raise, not load nothing
        if local_metadata.get("assign_to_params_buffers"):
            raise RuntimeError("zeroinf stage 3: load_state_dict(..., assign=True) would replace the partitioned "
                               "parameters by plain tensors (the model then holds empty placeholders); load with "
                               "assign=False (the default): the values are written into the partitions")
        hooks = module._load_state_dict_pre_hooks
        last = next(reversed(hooks)) == self._load_key.get(module)  # none of the module's own runs after it
        names = self._names_below(module, prefix, load=True, children=last)
        if "_load_from_state_dict" in module.__dict__:  # its class loads its own parameters, gathered (_gathered_call)
            own = {prefix + n for n in module._parameters}
            names = {p: [n for n in ns if n not in own] for p, ns in names.items()}
        for g, slots in self._by_group(m, names):
            updates = {}
            for s, ns in slots:
                for n in ns:
                    v = state_dict.get(n)
                    if self._placed.get(id(v)) is v or v is s.param or not isinstance(v, torch.Tensor):
                        continue  # put there by the hook of a module above; the parameter itself
                        # (a no-op); absent, or not a tensor (torch's own copy reports it)
                    if tuple(v.shape) != tuple(s.shape):
                        error_msgs.append(f"size mismatch for {n}: copying a param with shape {v.shape} from "
                                          f"checkpoint, the shape in current model is {torch.Size(s.shape)}.")
                    elif v.is_meta:
                        error_msgs.append(f'While copying the parameter named "{n}", whose dimensions in the model '
                                          f"are {torch.Size(s.shape)} and whose dimensions in the checkpoint are "
                                          f"{v.shape}, an exception occurred : ('Cannot copy out of meta tensor; "
                                          "no data!',).")
                    else:
                        updates[s.offset] = (s, v, ns)  # of a tied parameter's names the last wins
                        continue
                    self._place(state_dict, n, s)
            if updates:
                values = [(s, v) for s, v, _ns in updates.values()]
                m.write_group_values(g, values, exact=exact_values(g, values))
                for s, _v, ns in updates.values():
                    for n in ns:
                        if n in state_dict:
                            self._place(state_dict, n, s)

    def _place(self, state_dict, name: str, s) -> None:
        """Put the parameter's own data under ``name``: torch's shape check passes and its copy
        changes nothing; the hooks below know it by identity."""
        state_dict[name] = placed = s.param.data
        self._placed[id(placed)] = placed
