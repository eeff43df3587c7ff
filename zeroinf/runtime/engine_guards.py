"""What guards a model and its engine beyond the engine's own calls: :class:`StateGuard` (a
load or step that failed part-way), the hooks that note parameters added to a model after
``zeroinf.initialize``, and the process-exit hooks that let background steps and gloo threads
finish first.
"""
from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - registers its exit hook before ours, so ours runs first
import threading
import time
import weakref
from typing import Optional

import torch

__all__ = ["StateGuard", "note_gloo_used", "watch", "unwatch", "take_over_guard_hooks", "release_guard_hooks"]


class StateGuard:
    """Whether a ``load_checkpoint`` or an optimizer step failed part-way, leaving the weights and
    optimizer state a mix of two states (the checkpoint's and the engine's, or two steps').

    The engine checks it at its entry points; hooks on the model check it at the model's own
    forward and ``state_dict`` (which the engine does not see). It keeps the failure's type and
    message only, not the exception (whose traceback holds the engine and the checkpoint's
    tensors), so the hooks keep neither the engine nor the model alive. A copy (``deepcopy`` or
    pickling of the model) is a clear guard: the copy has no engine that could clear it.
    """

    #: what a failure part-way leaves the state a mix of, by what failed
    _MIXES = {"a load_checkpoint": "the checkpoint and what the engine held",
              "an optimizer step": "the step's update (the sub-groups stepped before the error) and the state "
                                   "before it"}

    def __init__(self) -> None:
        self.failure: Optional[str] = None  #: "Type: message" of the error that stopped the load; None: whole
        self.during = "a load_checkpoint"   #: what failed part-way: a key of _MIXES

    def failed(self, exc: BaseException, during: str = "a load_checkpoint") -> None:
        """Record that a load (or, ``during="an optimizer step"``, a step) stopped part-way with ``exc``."""
        self.failure = f"{type(exc).__name__}: {exc}"
        self.during = during

    def completed(self) -> None:
        """Record that a load applied every part."""
        self.failure = None

    def check(self, what: str = "zeroinf") -> None:
        """Raise RuntimeError, naming ``what`` and the load's error, while a failed load is recorded."""
        if self.failure is not None:
            raise RuntimeError(f"{what}: {self.during} failed part-way ({self.failure}); the weights and "
                               f"optimizer state are a mix of {self._MIXES[self.during]}. Load a "
                               "checkpoint again (a load that completes clears this) or build a new engine (at stage 3, on "
                               "a newly built model).")

    def forward_pre_hook(self, module, args) -> None:
        """``register_forward_pre_hook`` hook: :meth:`check` before the model's forward."""
        self.check("the model's forward")

    def state_dict_pre_hook(self, module, prefix, keep_vars) -> None:
        """``register_state_dict_pre_hook`` hook: :meth:`check` before the model's ``state_dict``."""
        self.check("state_dict")

    def __reduce__(self):
        return StateGuard, ()

    def __deepcopy__(self, memo) -> "StateGuard":
        return StateGuard()


#: model -> the hook handles of the engine that guards it now (a new engine on the model takes over)
_GUARD_HOOKS: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()

# [Note: parameters added after initialize] The flat buffers, partitions and optimizer state are
# laid out at initialize for the parameters the model had then. A trainable parameter put into
# the model later (Hugging Face's resize_token_embeddings swapping in a new embedding, a LoRA
# adapter added to a wrapped model, ``model.head.weight = nn.Parameter(...)``) would get
# gradients and never be stepped: silently frozen. torch's process-wide registration hooks note
# such a parameter (cost: nothing in the step), and the engine's forward and backward raise
# naming it while it is still in the model and trainable.
_WATCHED: "weakref.WeakSet" = weakref.WeakSet()  # of ZeroEngine


def _finish_background_steps() -> None:
    """At interpreter exit, before concurrent.futures stops its workers (threading's exit hooks
    run newest first, and this one is registered after theirs): wait for every engine's
    background optimizer step, which still needs the stage-3 I/O thread. It failed with "cannot
    schedule new futures after shutdown" otherwise, and a save_checkpoint from an ``atexit``
    hook with it. A step that failed is raised
    by the engine's next call, as always."""
    for eng in list(_WATCHED):
        try:
            eng.synchronize()
        except Exception:  # noqa: BLE001 - kept by the engine and raised at its next call
            pass


if hasattr(threading, "_register_atexit"):  # CPython 3.9+
    threading._register_atexit(_finish_background_steps)

#: an engine ran collectives over gloo in this process (_let_gloo_workers_finish)
_GLOO_USED = False


def note_gloo_used() -> None:
    """Record that an engine of this process runs collectives over gloo (see :func:`_let_gloo_workers_finish`)."""
    global _GLOO_USED
    _GLOO_USED = True


def _let_gloo_workers_finish() -> None:
    """At interpreter exit, before Python finalizes: release the GIL for a moment when an engine
    used gloo. A gloo worker thread drops its hold on a finished collective's tensors a little
    after ``wait()`` returned; when Python owns one of them by then (a temporary view the
    engine already let go of), the drop takes the GIL, and a thread that takes the GIL while
    Python finalizes is made to exit, which C++ turns into std::terminate: "terminate called
    without an active exception", SIGABRT, after the script had finished (in a few two-rank runs
    in a hundred; the core shows ~AsyncAllgatherWork in ProcessGroupGloo::runLoop)."""
    if _GLOO_USED:
        time.sleep(0.05)


atexit.register(_let_gloo_workers_finish)
_ADDED_HOOKS: list = []


def _note_added(module: torch.nn.Module, name: str, params) -> None:
    for eng in list(_WATCHED):
        where = eng._module_names.get(module)
        if where is None:
            continue
        for pname, p in params:
            if p not in eng._known_params:
                eng._added[p] = f"{where}{name}{pname}"


def _on_module_registered(module, name, sub):
    if sub is None:
        return None
    for eng in list(_WATCHED):
        where = eng._module_names.get(module)
        if where is not None:
            for n, m in sub.named_modules(prefix=f"{where}{name}"):
                eng._module_names.setdefault(m, n + ".")
    _note_added(module, name, [("." + n, p) for n, p in sub.named_parameters()])
    return None


def _on_parameter_registered(module, name, param):
    if param is not None:
        _note_added(module, name, [("", param)])
    return None


def watch(engine) -> None:
    """Note ``engine`` for the exit hook and for parameters added to its model later (it needs
    ``engine._module_names``, ``engine._known_params`` and ``engine._added``)."""
    _WATCHED.add(engine)
    if not _ADDED_HOOKS:
        from torch.nn.modules import module as _m
        _ADDED_HOOKS.extend([_m.register_module_module_registration_hook(_on_module_registered),
                             _m.register_module_parameter_registration_hook(_on_parameter_registered)])


def unwatch(engine) -> None:
    """Forget ``engine`` (at its close)."""
    _WATCHED.discard(engine)


def take_over_guard_hooks(model: torch.nn.Module, hooks: list) -> None:
    """Make ``hooks`` the guard hooks of ``model``, removing an earlier engine's (one never closed)."""
    for h in _GUARD_HOOKS.pop(model, ()):
        h.remove()
    _GUARD_HOOKS[model] = hooks


def release_guard_hooks(model: torch.nn.Module, hooks: list) -> None:
    """Remove ``hooks`` from ``model``, and forget them as its guard hooks when they still are."""
    for h in hooks:
        h.remove()
    if _GUARD_HOOKS.get(model) is hooks:
        del _GUARD_HOOKS[model]
