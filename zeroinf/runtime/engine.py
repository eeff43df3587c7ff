"""The training engine: ``zeroinf.initialize`` and :class:`ZeroEngine`, shaped like DeepSpeed's.

One training step, as the engine runs it::

    for micro_batch in ...:                 # gradient_accumulation_steps of them
        loss = engine(inputs)               # forward on the compute device
        engine.backward(loss)               # loss / gas (* loss scale), backward, reduce grads
        engine.step()                       # acts at the accumulation boundary only

At the boundary: the global gradient norm over all partitions and ranks (``zeroinf.grad_norm_type``,
2 by default, or inf); a non-finite norm skips the step on every rank (the norm is the same on all
of them) and, with fp16, lowers the loss scale; else gradients are clipped (``gradient_clipping``,
torch's ``clip_grad_norm_`` rule ``coef = max_norm / (norm + 1e-6)`` applied when < 1), the
sub-group optimizer steps (CPU Adam; state on CPU or NVMe), updated parameters go back to the
device and are all-gathered, and the LR schedule advances.

The parameter manager seam. The engine talks to its parameter manager through these calls only
(:class:`zeroinf.runtime.flat.FlatParamManager` implements them for stages 0–2; stage 3 plugs in
by providing an object with the same methods from ``zeroinf.runtime.stage3.engine_manager(...)``):

* ``sub_group_specs() -> list[SubGroupSpec]``; ``master_init(i, fp32_params) -> Tensor``;
* ``reduce_gradients() -> int`` after each backward; ``grad(i) -> Tensor`` (fp32, CPU);
* ``param_target(i) -> Tensor`` receiving sub-group i's updated parameters;
* ``gather_params() -> int`` after the step; ``zero_grad_acc()``;
* ``local_grad_norm_parts(norm_type) -> (value, partitioned: bool)``.
"""
from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - registers its exit hook before ours, so ours runs first
import contextlib
import logging
import math
import os
import shutil
import sys
import threading
import time
import types
import warnings
import weakref
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import psutil
import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from zeroinf import progress
from zeroinf.config import ConfigError, ZeroInfConfig, parse_config

from .loss_scaler import LossScaler
from .optimizer import SubGroupOptimizer

__all__ = ["StateGuard", "ZeroEngine", "ZeroOptimizer", "initialize"]

_log = logging.getLogger("zeroinf")


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
_WATCHED: "weakref.WeakSet[ZeroEngine]" = weakref.WeakSet()


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


def _bytes_gb(n: int) -> str:
    """``n`` bytes exactly, and in decimal GB to 3 significant digits (0.05 GB rounded two different
    sizes alike)."""
    return f"{n} bytes ({n / 1e9:.3g} GB)"


def _loaded_values_hook(engine_ref, sixteen):
    """A load pre-hook (``Module.register_load_state_dict_pre_hook``) for a module owning bf16/fp16
    parameters at stages 0-2: note the fp32 (or fp64) value ``load_state_dict`` copies into each
    (same shape, not on the meta device) for :meth:`ZeroEngine._adopt_changed_weights`, which
    gives it to the masters at the next step or checkpoint save. A copy is held until then (4
    bytes per element on the CPU): a reference took the source's later changes (a live fp32
    model's weights, trained on after the load). A parameter changed again after
    the load is compared element by element, so a value the load did not copy, or a later
    change, is never taken for it."""
    def note(module, state_dict, prefix, *_args):
        engine = engine_ref()
        if engine is None:
            return
        for name, p in module._parameters.items():
            v = state_dict.get(prefix + name)
            if (p in sixteen and isinstance(v, torch.Tensor) and v.dtype in (torch.float32, torch.float64)
                    and v.shape == p.shape and not v.is_meta):
                engine._loaded_fp32[p] = v.detach().to("cpu", torch.float32, copy=True)
    return note



_STEP_REFUSED = "the zeroinf optimizer steps inside engine.step(); call engine.step() instead"
_STATE_REFUSED = ("the optimizer state (fp32 master weights, Adam moments, step counts) lives in the zeroinf "
                  "engine's partitions, not in this optimizer object, whose {} would carry none of it; save and "
                  "resume with engine.save_checkpoint(dir) and engine.load_checkpoint(dir)")


class ZeroOptimizer(torch.optim.Optimizer):
    """The optimizer object ``initialize`` returns: it holds the param groups and their
    hyper-parameters (``lr``, ``betas``, ``eps``, ``weight_decay``), so LR schedulers work on it,
    but the step and the state belong to the engine: ``step()`` raises (call ``engine.step()``),
    and so do ``state_dict()``, ``load_state_dict()``, copying and pickling (call
    ``engine.save_checkpoint`` / ``engine.load_checkpoint``), which would carry an empty state and
    restart Adam silently. A client optimizer given to ``initialize`` is handed
    over the same way (:func:`_hand_over`).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 adamw_mode: bool = True, bias_correction: bool = True):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      adamw_mode=adamw_mode, bias_correction=bias_correction))
        _hand_over(self)


def _refuser(message: str):
    """A function that raises RuntimeError(``message``) whatever it is called with."""
    def refuse(*args, **kwargs):
        raise RuntimeError(message)
    return refuse


_refused_step = _refuser(_STEP_REFUSED)
# torch's LR schedulers wrap optimizer.step to see it called, and warn ("overridden after learning
# rate scheduler initialization") when the step they find is not their wrapper: the engine tells
# them of its steps itself (optimizer._opt_called, in engine.step)
_refused_step._wrapped_by_lr_sched = True


def _hand_over(opt: torch.optim.Optimizer) -> None:
    """``opt``'s ``step``, ``state_dict``, ``load_state_dict``, copies and pickles raise from now
    on: the engine takes its parameters' gradients, so its own step did nothing and a loop
    calling it never trained, silently; and its state is empty, as a
    copy's or pickle's would be. Its ``param_groups`` stay the engine's
    hyper-parameters. Instance attributes, so a torch.optim class keeps its own methods."""
    opt.step = types.MethodType(_refused_step, opt)
    opt.state_dict = _refuser(_STATE_REFUSED.format("state_dict()"))
    opt.load_state_dict = _refuser(_STATE_REFUSED.format("load_state_dict()"))
    # copy and pickle look these up on the instance
    opt.__reduce_ex__ = opt.__deepcopy__ = _refuser(_STATE_REFUSED.format("copy (pickle, torch.save, copy.deepcopy)"))


def _world() -> tuple:
    """(rank, world size). Under a launcher (torchrun sets ``WORLD_SIZE`` > 1 and ``RANK``) with no
    process group yet, one is created as ``deepspeed.initialize`` does: NCCL when CUDA is
    available (device ``LOCAL_RANK``), else gloo. One process needs no torch.distributed."""
    if dist.is_available() and not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _compute_device() -> torch.device:
    """The device training computes on: this rank's CUDA device when there is one, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _hyper_from_client(opt: torch.optim.Optimizer) -> None:
    """Check a client optimizer is Adam-like and complete its groups' hyper-parameters in place
    (``adamw_mode``: torch's ``decoupled_weight_decay``, true for AdamW; CPUAdam's own key)."""
    name = type(opt).__name__
    if isinstance(opt, ZeroOptimizer):
        return
    if not (isinstance(opt, torch.optim.Adam) or name == "CPUAdam"):  # torch's AdamW subclasses Adam
        raise ConfigError("optimizer", f"a client optimizer of type {name} is not supported yet; pass "
                          "torch.optim.Adam, torch.optim.AdamW or zeroinf.optim.CPUAdam, or set optimizer in the config")
    for i, g in enumerate(opt.param_groups):
        for k in ("amsgrad", "maximize", "capturable", "differentiable"):
            if g.get(k):
                raise ConfigError("optimizer", f"param group {i} sets {k}=True, which is not supported yet")
        if "adamw_mode" not in g:
            g["adamw_mode"] = bool(g.get("decoupled_weight_decay", isinstance(opt, torch.optim.AdamW)))
        g.setdefault("bias_correction", True)


class ZeroEngine:
    """ZeRO stages 0–2 (stage 3 through its parameter manager) with CPU/NVMe optimizer offload.

    Built by :func:`initialize`; attributes of note: ``module``, ``optimizer`` (the
    :class:`ZeroOptimizer` or the client's), ``lr_scheduler``, ``config`` (:class:`ZeroInfConfig`),
    ``global_steps`` (optimizer-step boundaries, skipped ones included), ``skipped_steps``,
    ``micro_steps``.
    """

    def __init__(self, model: torch.nn.Module, cfg: ZeroInfConfig, optimizer: torch.optim.Optimizer,
                 lr_scheduler=None, rank: int = 0, world_size: int = 1):
        self.module, self.config, self.optimizer = model, cfg, optimizer
        self.rank, self.world_size = rank, world_size
        if world_size > 1 and dist.get_backend() == "gloo":
            global _GLOO_USED
            _GLOO_USED = True
        self.gas = cfg.gradient_accumulation_steps
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.optimizer_steps = 0   #: steps actually applied (Adam's step count)
        self._grad_norm: Optional[float] = None
        self._stats: Dict[str, Any] = {}
        self._step_stats = self._new_step_stats()
        self._step_running = False  # a background optimizer step is in flight (stage 3)
        self._global_samples = 0  # global_samples
        self._backwards = 0  # engine.backward calls since the last engine.step (_check_backward_ran)
        self._window_backwards = 0  # engine.backward calls since the last optimizer step (a save warns)
        # micro_steps at the last checkpoint load: windows are counted from there, as DeepSpeed counts
        # them from its fresh engine's 0 (it does not restore micro_steps; counting from the restored
        # total, a resume with other gradient_accumulation_steps put the boundary mid-window)
        self._micro_origin = 0
        self._boundary: Optional[bool] = None  # set_gradient_accumulation_boundary's value, if called
        self._in_no_sync = False  # inside no_sync(): backward leaves the gradients in .grad, unreduced
        self._unreduced = False  # .grad holds gradients no_sync() kept from the reduction
        self._step_applied = False  # was_step_applied()
        #: why the last step() raised after counting its micro-batch (a retry would step again)
        self._counted_and_raised: Optional[str] = None
        self._closed = False  # close() ran: every entry point raises (_check_open)
        #: a load_checkpoint or a step that failed part-way (checked by _check_open and by hooks on the model)
        self.state_guard = StateGuard()
        self._guard_hooks = []
        self.loss_scaler = LossScaler.from_config(cfg.fp16) if cfg.fp16.enabled else None
        zc = cfg.zero_optimization
        off = zc.offload_optimizer

        # trainable params per group, and fp32 copies before any cast (master weights start exact)
        groups = [[p for p in g["params"] if p.requires_grad] for g in optimizer.param_groups]
        # the layout below (flat buffers, sub-groups, optimizer state) is made for these flags
        self._requires_grad = [(n, p, p.requires_grad) for n, p in model.named_parameters()]
        # trainable but left out of the optimizer (model_parameters a subset: DeepSpeed scripts'
        # way to freeze a layer): never stepped; their .grad is dropped after each backward, at
        # every stage (it grew by every micro-batch's gradient at stages 0-2, stayed None at 3)
        stepped = {p for ps in groups for p in ps}
        outside = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p not in stepped]
        self._outside = [p for _, p in outside]
        if outside and rank == 0:
            names = ", ".join(n for n, _ in outside[:3]) + (", ..." if len(outside) > 3 else "")
            warnings.warn(f"zeroinf: {len(outside)} trainable parameter(s) ({names}) are not in the optimizer: they "
                          "get gradients but are never updated; set requires_grad=False on them to freeze them "
                          "without computing those gradients", stacklevel=4)  # the caller of zeroinf.initialize
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[cfg.precision]
        fp32_copies = None
        if dtype != torch.float32:
            fp32_copies = {id(p): p.detach().to("cpu", torch.float32, copy=True) for ps in groups for p in ps}
            model.to(dtype)
        self.dtype = dtype

        if zc.stage == 3:
            try:
                from zeroinf.runtime.stage3 import engine_manager
                from zeroinf.runtime.stage3.engine_glue import swap_file_bytes
            except ImportError:
                raise NotImplementedError("zero_optimization.stage 3 is not wired into the engine yet "
                                          "(zeroinf.runtime.stage3.engine_manager is missing)") from None
            from zeroinf.runtime.stage3.manager import partitioned_by
            owner = partitioned_by(model.parameters())
            if owner is not None:  # its parameters are placeholders: a second engine would hold nothing
                raise RuntimeError(
                    "zeroinf.initialize: this model's parameters are already partitioned by another stage-3 engine "
                    f"({'closed' if owner.closed else 'still open'}); build the model again (or under zeroinf.Init) "
                    "and give that to zeroinf.initialize, then load the weights (engine.load_checkpoint, "
                    "load_safetensors)")
            # before the manager writes its parameter partitions: every swap file stage 3 implies
            from zeroinf.runtime.stage3.init import swap_bytes_freed_by
            self._check_disk(swap_file_bytes(model, cfg, groups, rank=rank, world_size=world_size),
                             freed=swap_bytes_freed_by(model.parameters()))
            self.params = engine_manager(model, cfg, groups, rank=rank, world_size=world_size)
        else:
            from .flat import FlatParamManager
            self.params = FlatParamManager(groups, stage=zc.stage, sub_group_size=zc.sub_group_size,
                                           reduce_bucket_size=zc.reduce_bucket_size,
                                           allgather_bucket_size=zc.allgather_bucket_size,
                                           reduce_scatter=zc.reduce_scatter, rank=rank, world_size=world_size)
        specs = self.params.sub_group_specs()
        # [Note: master in the partitions] (stage3/engine_glue.py): fp32 stage 3 with the optimizer
        # state on NVMe keeps no second fp32 copy of the parameters
        master_io = self.params.master_io() if zc.stage == 3 else None
        if zc.stage != 3 and off.device == "nvme":
            self._check_disk([("zero_optimization.offload_optimizer.nvme_path", off.nvme_path,
                               os.path.join(off.nvme_path, "zeroinf_optimizer", f"rank{rank}"),
                               12 * sum(s.numel for s in specs), "optimizer state (12 bytes per element)")])
        self._check_machine(specs, 8 if master_io is not None else 12)
        swap_dir = None
        if off.device == "nvme":
            swap_dir = os.path.join(off.nvme_path, "zeroinf_optimizer", f"rank{rank}")
            os.makedirs(swap_dir, exist_ok=True)
        try:
            self.sub_optimizer = SubGroupOptimizer(
                specs, device=off.device, swap_dir=swap_dir, buffer_count=off.buffer_count,
                pipeline_read=off.pipeline_read, pipeline_write=off.pipeline_write, pin_memory=off.pin_memory,
                aio=cfg.aio, master_io=master_io)
        except MemoryError as e:  # zeroinf.io.PinnedMemoryError: over RAM or ulimit -l
            raise ConfigError("zero_optimization.offload_optimizer.buffer_count",
                              f"{e}; lower sub_group_size or buffer_count") from e
        # a step that fails after some sub-groups were stepped leaves weights and state torn between two
        # steps: every entry point and the model's own forward refuse them until a checkpoint loads (the
        # optimizer in backward keeps its own failed-step state, StepFailedError, that refuses every call)
        if not cfg.zeroinf.optimizer_in_backward:
            self.sub_optimizer.on_torn = lambda exc: self.state_guard.failed(exc, during="an optimizer step")
        # fp32 parameters in CPU memory with CPU-resident state: the parameter is the master weight
        alias = dtype == torch.float32 and off.device != "nvme" and zc.stage != 3
        for i in progress.counting(range(len(specs)), "zeroinf: writing initial optimizer state", unit="sub-group"):
            target = self.params.param_target(i) if alias else None
            if target is not None and (target.device.type != "cpu" or not target.is_contiguous()
                                       or target.dtype != torch.float32):  # a bf16/fp16 model: own fp32 master
                target = None
            values = None if master_io is not None else self.params.master_init(i, fp32_copies)  # None: the partition
            self.sub_optimizer.init_master(i, values, storage=target)
        if hasattr(self.params, "track_grad_norm"):  # stage 3, gradients on NVMe: no re-read for the norm
            self.params.track_grad_norm(cfg.zeroinf.grad_norm_type)
        # [Note: overlapped step] (stage3/overlap.py): the step runs behind the next forward
        self._overlap = zc.stage == 3 and cfg.zeroinf.overlap_step and hasattr(self.params, "start_step")
        # [Note: optimizer in backward] (stage3/in_backward.py): the config allows it with stage 3 only
        self._in_bwd = cfg.zeroinf.optimizer_in_backward
        self._bwd_pending = False  # a backward started the update; engine.step() closes it
        if hasattr(self.params, "attach_optimizer"):  # stage 3: masters follow gathered_parameters writes
            self.params.attach_optimizer(self.sub_optimizer)
        # [Note: weights changed between steps] stages 0-2 (fp32 with its masters in CPU memory
        # aliases them: a change lands in the master itself, and the comparison finds nothing)
        self._versions = [[p._version for p in g.params] for g in self.params.groups] if zc.stage != 3 else None
        # each parameter's shape and strides as a view of its flat buffer (contiguous), taken now
        self._shapes = [[p.shape for p in g.params] for g in self.params.groups] if zc.stage != 3 else None
        self._strides = [[p.stride() for p in g.params] for g in self.params.groups] if zc.stage != 3 else None
        self._homes = self._home_list() if zc.stage != 3 else []  # _adopt_replaced_data
        # fp32 values a load_state_dict gave 16-bit parameters, for their masters (_loaded_values_hook)
        self._loaded_fp32: Dict[torch.nn.Parameter, torch.Tensor] = {}
        self._names = {p: n for n, p, _f in self._requires_grad}  # for errors that name a parameter
        del fp32_copies

        if lr_scheduler is None and cfg.scheduler is not None:
            from .lr_schedules import build_scheduler
            lr_scheduler = build_scheduler(cfg.scheduler, optimizer)
        elif callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            lr_scheduler = lr_scheduler(optimizer)
        self.lr_scheduler = lr_scheduler
        # the model's own forward and state_dict, and gathered_parameters, refuse a half-loaded state too
        for h in _GUARD_HOOKS.pop(model, ()):  # an earlier engine's, left by one never closed
            h.remove()
        # [Note: parameters added after initialize]
        self._known_params = {p for _n, p, _f in self._requires_grad}
        self._module_names: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary(
            (m, f"{n}." if n else "") for n, m in model.named_modules())
        self._added: "WeakIdKeyDictionary[torch.nn.Parameter, str]" = WeakIdKeyDictionary()  # by identity
        _WATCHED.add(self)
        if not _ADDED_HOOKS:
            from torch.nn.modules import module as _m
            _ADDED_HOOKS.extend([_m.register_module_module_registration_hook(_on_module_registered),
                                 _m.register_module_parameter_registration_hook(_on_parameter_registered)])
        self._guard_hooks = [model.register_forward_pre_hook(self.state_guard.forward_pre_hook, prepend=True),
                             model.register_state_dict_pre_hook(self.state_guard.state_dict_pre_hook)]
        if self._versions is not None:  # stages 0-2: a 16-bit parameter's master takes a loaded fp32 value
            sixteen = {p for g in self.params.groups for p in g.params if p.dtype in (torch.bfloat16, torch.float16)}
            note = _loaded_values_hook(weakref.ref(self), sixteen)
            self._guard_hooks += [m.register_load_state_dict_pre_hook(note) for m in model.modules()
                                  if any(p in sixteen for p in m._parameters.values() if p is not None)]
        _GUARD_HOOKS[model] = self._guard_hooks
        if getattr(self.params, "manager", None) is not None:
            self.params.manager.state_guard = self.state_guard

    # ------------------------------------------------------------------------------------------
    # checks at start-up: fail now, not mid-step

    def _check_disk(self, files, freed: Optional[Dict[str, int]] = None) -> None:
        """Raise :class:`ConfigError` unless each swap folder's file system has room for every swap
        file this rank will write there. ``files``: ``(config key, nvme_path, swap folder, bytes,
        what)``; bytes already in the swap folder this engine will take (a rerun overwrites them)
        count as free, those of a folder another live engine holds do not
        (:func:`zeroinf.io.swapper.reusable_bytes`). ``freed``: bytes of ``zeroinf.Init`` swap
        files by folder, removed once the parameter partitions are written and before the
        optimizer's files are made: free for those, not for the parameter and gradient
        partitions written beside them. A missing ``nvme_path`` is created, and removed again
        (the empty folders made) when a check fails."""
        files = list(files)
        made = []  # the topmost folder each missing nvme_path creates
        for _key, path, *_ in files:
            top = None
            for p in (Path(path).absolute(), *Path(path).absolute().parents):
                if os.path.lexists(p):
                    break
                top = p
            if top is not None:
                made.append(top)
        try:
            self._check_disk_room(files, freed or {})
        except ConfigError:  # a refused run leaves no folder behind
            for top in made:
                for d, _dirs, _files in sorted(os.walk(top), key=lambda w: -len(w[0])):
                    try:
                        os.rmdir(d)  # empty ones only: nothing else was written there yet
                    except OSError:
                        pass
            raise

    def _check_disk_room(self, files, freed: Dict[str, int]) -> None:
        from zeroinf.io.probe import dir_problem
        from zeroinf.io.swapper import reusable_bytes

        by_dev: Dict[int, Dict[str, Any]] = {}
        for key, path, folder, nbytes, what in files:
            problem = dir_problem(path, create=True)  # a real write: permission bits say nothing for root or a read-only mount
            if problem is not None:
                raise ConfigError(key, f"{path!r} {problem}")
            e = by_dev.setdefault(os.stat(path).st_dev, {"key": key, "path": path, "need": 0, "first": 0,
                                                         "folders": set(), "first_folders": set(), "what": [],
                                                         "freed": 0})
            e["need"] += nbytes
            # the partitions are written first: while Init's files are still there, and before an
            # earlier run's optimizer files are overwritten (counted free for them, initialize then
            # ran out of space half-way)
            if key == "zero_optimization.offload_param.nvme_path":
                e["first"] += nbytes
                e["first_folders"].add(folder)
            e["folders"].add(folder)
            e["what"].append(f"{what} {nbytes} bytes")
        for folder, nbytes in freed.items():
            e = by_dev.get(os.stat(folder).st_dev) if os.path.isdir(folder) else None
            if e is not None:
                e["freed"] += nbytes
        for e in by_dev.values():
            free = shutil.disk_usage(e["path"]).free
            have = free + sum(reusable_bytes(f) for f in e["folders"])
            have_first = free + sum(reusable_bytes(f) for f in e["first_folders"])
            if have_first < e["first"] or have + e["freed"] < e["need"]:
                init = (f", and the {_bytes_gb(e['freed'])} of zeroinf.Init's swap files that initialize frees "
                        "once it has taken the parameters" if e["freed"] else "")
                first = (f"; the parameter and gradient partitions ({_bytes_gb(e['first'])}) are written first, "
                         f"with {_bytes_gb(have_first)} free for them (zeroinf.Init's swap files and an earlier run's "
                         "optimizer files are still there)" if have_first < e["first"] else "")
                raise ConfigError(e["key"], f"{e['path']!r} has {_bytes_gb(have)} free{init}; this rank's swap files "
                                  f"need {_bytes_gb(e['need'])}, for {', '.join(e['what'])}{first}")

    def _check_machine(self, specs, bytes_per_element: int = 12) -> None:
        """Raise :class:`ConfigError` when the optimizer's pinned NVMe swap buffers
        (``bytes_per_element`` per element of the largest sub-group, each) exceed available memory."""
        off = self.config.zero_optimization.offload_optimizer
        if off.device != "nvme" or not specs:  # none: a frozen model (max() of nothing)
            return
        from zeroinf.io import pinned_pool_bytes

        from .optimizer import optimizer_buffer_count
        count = optimizer_buffer_count(off.buffer_count, off.pipeline_read, off.pipeline_write, len(specs))
        nbytes = bytes_per_element * max(s.numel for s in specs)
        pinned = pinned_pool_bytes(count, nbytes)
        avail = psutil.virtual_memory().available
        if pinned > avail:
            raise ConfigError("zero_optimization.offload_optimizer.buffer_count",
                              f"{count} swap buffers of {nbytes} bytes pin {pinned} bytes, "
                              f"more than the {avail} bytes of available memory; lower sub_group_size or buffer_count")
        # the memlock limit (ulimit -l) is checked by PinnedBufferPool before it allocates; its
        # error is re-raised under the buffer_count key where the optimizer is built

    # ------------------------------------------------------------------------------------------
    # DeepSpeed-shaped API

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def __getattr__(self, name: str):
        """A public name the engine does not define is the wrapped model's (``engine.generate``,
        ``engine.lm_head``, ``engine.get_submodule``), as ``DeepSpeedEngine.__getattr__`` answers
        it. Names with a leading underscore are not forwarded (the engine's own
        state, looked up before it is set, and Python's protocols: ``hasattr(engine, "__len__")``
        must not answer for a ``Sequential``).

        Raises:
            AttributeError: neither the engine nor its model has ``name`` (both named); or one
                of the engine's own properties raised it (that error, not the model's).
        """
        for klass in type(self).__mro__:
            if name in klass.__dict__:
                # Python lands here when an engine property raised AttributeError inside: run the
                # property again so its own error surfaces, not "nor has its model"
                return klass.__dict__[name].__get__(self, type(self))
        module = self.__dict__.get("module")  # absent while __init__ runs
        if name.startswith("_") or module is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        try:
            return getattr(module, name)
        except AttributeError as exc:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}', nor has its model "
                                 f"(engine.module, a {type(module).__name__}): {exc}") from None

    def forward(self, *args, **kwargs):
        """Run the wrapped module.

        Raises:
            RuntimeError: a parameter's ``requires_grad`` changed since :func:`initialize`, or
                a trainable parameter was put into the model after it (both checked with grad
                enabled; a forward under ``torch.no_grad`` is not checked); or, at stage 3, the
                forward gave a parameter data of another shape, dtype or device
                (``p.data = t``), which stage 3 cannot keep (raised at the end of any forward
                of the model, through the engine or not).
        """
        self._check_open()
        if torch.is_grad_enabled():
            self._check_requires_grad()
            self._check_added()
        try:
            return self.module(*args, **kwargs)  # stage 3 checks dropped data at the forward's end
        except Exception:
            raise  # the forward hooks ran (always_call)
        except BaseException:  # KeyboardInterrupt, SystemExit: torch skips always_call hooks
            manager = getattr(self.params, "manager", None)
            if manager is not None:
                manager.abort_iteration(keep_changes=True)  # [Note: interrupted forward]
            raise

    def _check_no_held_units(self, what: str = "engine.step()") -> None:
        """Raise RuntimeError, before anything is stepped, when a ``gathered_parameters`` block
        holds stage-3 units: the step (``what``: ``engine.step()``, or ``engine.backward()``
        with the optimizer in backward) updates their partitions but not the block's gathered
        copy, which the block's exit then wrote back over the update (``modifier_rank``) or the
        forwards left in the block computed with (a whole unit's
        step lost)."""
        manager = getattr(self.params, "manager", None)
        held = [u for u in getattr(manager, "units", ()) if u.user_holds]
        if held:
            names = [s.name for u in held for g in u.groups for s in g.slots]
            raise RuntimeError(
                f"zeroinf stage 3: {what} inside `with zeroinf.gathered_parameters(...)`, which holds "
                f"{', '.join(repr(n) for n in names[:5])}{', ...' if len(names) > 5 else ''} gathered: the step would "
                "update their partitions but not the block's copy, which the block's end writes back (modifier_rank) "
                "or later forwards in the block compute with. Nothing was stepped; step after the block ends")

    def _check_dropped_data(self) -> None:
        """At the step: raise RuntimeError naming the stage-3 parameters of units held on into
        the backward that a forward gave data which cannot go into their partitions
        (``p.data = t`` of another shape, dtype or device; :meth:`Stage3ParameterManager.check_dropped_data`,
        which raises for released units at the end of the forward itself)."""
        manager = getattr(self.params, "manager", None)
        if manager is not None:
            manager.check_dropped_data()

    def train(self, mode: bool = True) -> "ZeroEngine":
        self.module.train(mode)
        return self

    def eval(self) -> "ZeroEngine":
        self.module.eval()
        return self

    # what scripts written for DeepSpeedEngine (an nn.Module around the model) ask of it
    @property
    def training(self) -> bool:
        """The module's ``training`` flag."""
        return self.module.training

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        """The module's parameters (at stage 3 released ones are placeholders: see ``ds_shape``)."""
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[Tuple[str, torch.nn.Parameter]]:
        """The module's named parameters, as :meth:`parameters`."""
        return self.module.named_parameters(prefix, recurse)

    def module_state_dict(self, exclude_frozen_parameters: bool = False) -> Dict[str, torch.Tensor]:
        """DeepSpeed's name: the module's ``state_dict()`` (full tensors; at stage 3 gathered, so
        collective), without parameters that have ``requires_grad=False`` if asked."""
        sd = self.module.state_dict()
        if exclude_frozen_parameters:
            from zeroinf.checkpoint import frozen_names
            frozen = set(frozen_names(self.module))  # a tied one under each of its names
            sd = {k: v for k, v in sd.items() if k not in frozen}
        return sd

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """True: a model save gathers the full weights at every stage (DeepSpeed's question, asked
        by Accelerate and transformers before :meth:`_zero3_consolidated_16bit_state_dict`)."""
        return True

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> Dict[str, torch.Tensor]:
        """DeepSpeed's name for the full state dict at stage 3: :meth:`module_state_dict`
        (the model's dtype; collective with several ranks)."""
        return self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next :meth:`step` is an optimizer step: every ``gradient_accumulation_steps``-th
        micro-batch, or what :meth:`set_gradient_accumulation_boundary` set last."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps - self._micro_origin + 1) % self.gas == 0

    def set_gradient_accumulation_boundary(self, is_boundary: Optional[bool]) -> None:
        """Decide by hand whether the next :meth:`step` is an optimizer step, instead of counting
        micro-batches (DeepSpeed's method of the same name; the value holds until set again,
        and None goes back to counting). The loss is still divided by
        ``gradient_accumulation_steps`` in :meth:`backward`, as in DeepSpeed.

        Raises:
            TypeError: ``is_boundary`` is neither a bool nor None.
            ValueError: False with ``zeroinf.optimizer_in_backward``, which steps in every backward.
        """
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise TypeError(f"set_gradient_accumulation_boundary(is_boundary): expected a bool or None, got {is_boundary!r}")
        if is_boundary is False and self._in_bwd:
            raise ValueError("set_gradient_accumulation_boundary(False): zeroinf.optimizer_in_backward steps the "
                             "weights during every backward, so there is no accumulation to extend")
        self._boundary = is_boundary

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside the block keep their gradients on this rank, in the parameters'
        ``.grad`` (summed there by autograd), instead of reducing them over ranks; the first
        :meth:`backward` after the block, or else the next :meth:`step`, reduces the sum (as
        ``torch.nn.parallel.DistributedDataParallel.no_sync``). The result equals reducing every
        micro-batch; with bf16/fp16 the local sum is in the parameters' dtype, not fp32.

        Raises:
            RuntimeError: at ZeRO stage 3, whose gradients are reduced unit by unit during the
                backward (DeepSpeed refuses ``no_sync`` at stages 2 and 3), or entered again
                inside itself.
        """
        if self.zero_optimization_stage() == 3:
            raise RuntimeError("engine.no_sync(): ZeRO stage 3 reduces each unit's gradients during the backward and "
                               "frees the full gradient; accumulate with gradient_accumulation_steps instead")
        if self._in_no_sync:
            raise RuntimeError("engine.no_sync(): already inside no_sync")
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    def zero_grad(self) -> None:
        """Drop the module's ``.grad`` (the engine already does after each backward)."""
        for p in self.module.parameters():
            p.grad = None

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss / gradient_accumulation_steps`` (times the loss scale with fp16),
        then reduce this micro-batch's gradients into the fp32 accumulation buffers. Returns
        ``loss / gradient_accumulation_steps`` (``loss`` itself with ``scale_wrt_gas=False``),
        as DeepSpeed does. DeepSpeed's keywords: ``retain_graph`` is passed to autograd (a second
        backward through the same graph adds its gradients, as in plain PyTorch);
        ``scale_wrt_gas=False`` leaves out the division by ``gradient_accumulation_steps``.

        Raises:
            ValueError: ``loss`` is not a scalar tensor requiring grad.
            RuntimeError: a trainable parameter was put into the model after :func:`initialize`
                ([Note: parameters added after initialize]); or, at stage 3 with
                ``zeroinf.optimizer_in_backward``, called inside a ``zeroinf.gathered_parameters``
                block that holds parameters (:meth:`_check_no_held_units`; nothing ran).
            Exception: whatever the autograd backward raised part-way; none of its gradients
                stays (see :meth:`_drop_partial_gradients`).
        """
        self._check_open()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError("engine.backward(loss): loss must be a scalar tensor that requires grad")
        self._check_added()
        if self._in_bwd:  # it steps the partitions: not under a gathered_parameters block's copy
            self._check_no_held_units("engine.backward() with zeroinf.optimizer_in_backward")
        self._backwards += 1  # also when it raises: its gradients went through the engine
        self._counted_and_raised = None
        self._window_backwards += 1
        t0 = time.perf_counter()
        self.synchronize()  # a background step has finished by now (the forward needed its updates)
        if self._in_bwd:
            self._check_backward_step()
        elif self.is_gradient_accumulation_boundary():
            self.sub_optimizer.prefetch()  # the first sub-group's NVMe read hides behind this backward
        try:
            if self._in_bwd:
                self._start_backward_step()
            manager = getattr(self.params, "manager", None)
            if manager is not None:
                manager.forget_raised_pass()
            scaled = loss.float()
            if self.gas > 1 and scale_wrt_gas:
                scaled = scaled / self.gas
            if self.loss_scaler is not None:
                scaled = scaled * self.loss_scaler.scale
            scaled.backward(retain_graph=retain_graph)
            if self._in_bwd:
                self.params.end_backward_step()
        except BaseException as exc:
            # optimizer in backward: with no gradient handed over yet nothing was updated and the
            # engine goes on (an OOM skipped by the caller); else some groups may be stepped
            # already and the step fails (StepFailedError from every later wait)
            if self._bwd_pending:
                self._bwd_pending = False
                self.params.abort_backward_step(exc)
            elif not self._in_bwd:
                self._drop_partial_gradients(exc)
            raise
        t1 = time.perf_counter()
        self._step_stats["backward_s"] += t1 - t0
        for p in self._outside:
            p.grad = None
        if self._in_no_sync:
            self._unreduced = True
        else:
            self._reduce()
        return loss / self.gas if scale_wrt_gas and self.gas > 1 else loss

    def _drop_partial_gradients(self, exc: BaseException) -> None:
        """A backward that raised part-way left some of its gradients and not others. At stages
        0-2 they are in ``.grad`` only (the window's earlier micro-batches are reduced already):
        they are dropped, and the backward counts for nothing. At stage 3 each unit's gradient
        was reduced into the accumulation buffers as its backward finished, where it cannot be
        told from the window's others, and ``zero_grad()`` could not reach it: the next step
        would add part of the failed batch. So
        the whole window's gradients are dropped there, with a warning (with ``no_sync`` too,
        whose ``.grad`` sums the window's backwards)."""
        if self._closed:  # close() ran meanwhile (a signal handler): nothing is left to drop
            return
        manager = getattr(self.params, "manager", None)
        if manager is None and not self._unreduced:
            for _n, p, flag in self._requires_grad:
                if flag:
                    p.grad = None
            self._backwards -= 1
            self._window_backwards -= 1
            return
        n = self._window_backwards
        self.synchronize()
        if manager is not None:
            manager.abort_iteration()  # the failed backward's unreduced flat gradients and gathered units go too
        self._forget_gradients()
        warnings.warn(f"zeroinf: engine.backward raised part-way ({type(exc).__name__}); the gradients of this "
                      f"accumulation window ({n} backward(s)) were dropped, since the ones it had reduced cannot be "
                      "told from the window's others. The next step() without a new backward steps on none.",
                      RuntimeWarning, stacklevel=3)

    def _reduce(self) -> None:
        """Reduce the gradients in ``.grad`` into the accumulation buffers (stages 0-2; stage 3
        has reduced them during the backward)."""
        t1 = time.perf_counter()
        self._unreduced = False
        self._step_stats["comm_elements"] += self.params.reduce_gradients()
        self._step_stats["reduce_s"] += time.perf_counter() - t1

    def _check_backward_step(self) -> None:
        """``zeroinf.optimizer_in_backward``: raise RuntimeError if the previous backward's
        update was never closed by :meth:`step`. (``requires_grad`` flips were checked by the
        grad-enabled forward that made the loss.)"""
        if self._bwd_pending:
            raise RuntimeError("zeroinf.optimizer_in_backward: engine.backward() was called twice without "
                               "engine.step() between; the first backward already updated the weights, so call "
                               "engine.step() after every engine.backward()")

    def _start_backward_step(self) -> None:
        """``zeroinf.optimizer_in_backward``: start this step's optimizer update, which runs
        while the backward reduces each group's gradient ([Note: optimizer in backward])."""
        # the step number and hyper-parameters engine.step() would use (the LR schedule moves in step())
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        # set first: an interrupt anywhere below reaches backward()'s abort, which stops the worker
        self._step_running = self._bwd_pending = True
        self.params.start_backward_step(self.sub_optimizer, step=self.optimizer_steps + 1, hyper=hyper,
                                        norm_type=self.config.zeroinf.grad_norm_type)

    def _check_requires_grad(self) -> None:
        """Raise if a parameter was frozen or unfrozen after :func:`initialize`.

        Raises:
            RuntimeError: naming the first such parameter. The flat buffers, sub-groups and
                optimizer state were laid out for the old flag: a weight frozen later would keep
                moving (momentum, weight decay), one unfrozen later would never train.
        """
        for name, p, flag in self._requires_grad:
            if p.requires_grad != flag:
                raise RuntimeError(
                    f"zeroinf: parameter '{name}' had requires_grad={flag} at zeroinf.initialize and now has "
                    f"{p.requires_grad}; the engine's partitions and optimizer state are laid out for the first "
                    "setting and would train it wrongly. Set requires_grad before zeroinf.initialize "
                    "(or build a new engine; at stage 3 on a newly built model).")

    def _check_added(self) -> None:
        """Raise if a trainable parameter was put into the model after :func:`initialize`
        ([Note: parameters added after initialize]).

        Raises:
            RuntimeError: naming the first such parameter still in the model and trainable.
        """
        if not self._added:
            return
        present = {p for p in self.module.parameters()}
        for p, name in list(self._added.items()):
            if p not in present:
                del self._added[p]  # taken out again (a module swapped back)
            elif p.requires_grad:
                raise RuntimeError(
                    f"zeroinf: parameter '{name}' ({tuple(p.shape)}) was put into the model after zeroinf.initialize "
                    "(a module or parameter assigned later: resize_token_embeddings, an adapter added to the wrapped "
                    "model); the engine's optimizer does not hold it, so it would never train. Make the change "
                    "before zeroinf.initialize (for a stage-3 model built under zeroinf.Init: inside "
                    "zeroinf.gathered_parameters(..., modifier_rank=0)), or freeze it (requires_grad=False).")

    def _check_backward_ran(self) -> None:
        """Raise if this micro-batch's gradients came from a backward outside :meth:`backward`
        (``loss.backward()``): the engine never took them, so stages 0-2 stepped without them
        (weights moved by momentum and decay alone, ``.grad`` left on every parameter) and
        stage 3 lost them from the second step on, silently. Evidence: ``.grad`` on a trainable
        parameter (the engine's backward leaves none), or stage-3 gradients reduced with no
        engine backward since the last :meth:`step`. A step with no backward at all stays valid.
        The refused gradients (and the window's others) are dropped, so they leak into no later
        step.

        Raises:
            RuntimeError: naming a parameter, or the stage-3 reduction.
        """
        manager = getattr(self.params, "manager", None)
        reduced = manager is not None and manager.reduced_since_check
        if self._backwards:
            return
        stray = next((n for n, p, flag in self._requires_grad if flag and p.grad is not None), None)
        if stray is not None or reduced:
            what = f"parameter '{stray}' has a .grad" if stray is not None else "stage 3 reduced gradients"
            # drop them, and this accumulation window's others: the next step would add them in
            self.synchronize()  # a background step may still read the gradient partitions
            self._forget_gradients()
            raise RuntimeError(f"zeroinf: engine.step() after a backward that did not run through engine.backward(loss) "
                               f"({what}); call engine.backward(loss) instead of loss.backward(): it scales the loss, "
                               "hands the gradients to the engine and waits for a step still running. The gradients "
                               "of this accumulation window were dropped, and no step was taken")

    def step(self, lr_kwargs: Optional[Dict[str, Any]] = None) -> None:
        """Count a micro-batch; at the accumulation boundary run the optimizer step, then the LR
        scheduler's ``step(**lr_kwargs)`` (DeepSpeed's keyword: ``lr_kwargs={"metrics": val_loss}``
        for ``ReduceLROnPlateau``; not after a skipped fp16 step).

        Raises:
            RuntimeError: a parameter's ``requires_grad`` changed since :func:`initialize`, or
                the micro-batch's backward ran outside :meth:`backward` (``loss.backward()``).
            FloatingPointError: fp16 gradients overflowed at ``min_loss_scale`` (see
                :class:`zeroinf.runtime.loss_scaler.LossScaler`).
            Exception: whatever the LR scheduler's ``step`` raised. The optimizer step was
                applied and counted by then (the exception says so): do not call step() again
                for this micro-batch.
            RuntimeError: step() called again, with no backward in between, after it raised
                one of the two above: the micro-batch was counted, and the retry would take
                another optimizer step (on zero gradients).
            RuntimeError: at stage 3, called inside a ``zeroinf.gathered_parameters`` block
                that holds parameters (nothing is stepped; :meth:`_check_no_held_units`).
        """
        self._check_open()
        if self._counted_and_raised is not None and not self._backwards:
            raise RuntimeError(f"zeroinf: engine.step() again after it raised ({self._counted_and_raised}) with no "
                               "engine.backward since: that micro-batch was counted already, and stepping again would "
                               f"take another optimizer step on zero gradients (step {self.global_steps}). Go on with "
                               "the next micro-batch's forward and backward.")
        self._check_requires_grad()
        self._check_backward_ran()
        self._check_dropped_data()
        sched_error = None
        if self.is_gradient_accumulation_boundary():
            self._check_no_held_units()
            self._adopt_replaced_data()
            if self._unreduced:  # no_sync() kept them to the end of the window
                self._reduce()
            try:
                self._optimizer_step()
            except FloatingPointError as exc:  # at min_loss_scale: the window was skipped and dropped, and counts
                self._count_samples()
                self._window_backwards = 0
                self._count_micro_batch()
                self._counted_and_raised = f"FloatingPointError: {exc}"[:200]
                raise
            self._count_samples()
            self._window_backwards = 0
            if self._step_applied:
                # the engine stepped on the optimizer's behalf: tell torch schedulers so (they warn otherwise),
                # also one the engine does not hold (built on the returned optimizer later)
                self.optimizer._opt_called = True
            if self._step_applied and self.lr_scheduler is not None:
                try:
                    self.lr_scheduler.step(**(lr_kwargs or {}))
                except Exception as exc:  # raised below, once this step is counted
                    sched_error = exc
            self._stats = dict(self._step_stats)
            self._step_stats = self._new_step_stats()
            self._log_step()
        self._count_micro_batch()
        if sched_error is not None:
            self._counted_and_raised = f"the LR scheduler's step raised {type(sched_error).__name__}"
            if hasattr(sched_error, "add_note"):  # Python 3.11+
                sched_error.add_note(f"zeroinf: raised by the LR scheduler's step(**{lr_kwargs or {}!r}) after optimizer step "
                                     f"{self.global_steps}, which was applied and counted; a scheduler whose step() "
                                     "needs arguments (ReduceLROnPlateau) takes them from engine.step(lr_kwargs={...})")
            raise sched_error

    def _count_samples(self) -> None:
        """An optimizer step (applied or skipped) consumed a window: ``train_batch_size()``
        samples, or, once the caller sets the boundaries (:meth:`set_gradient_accumulation_boundary`),
        one micro-batch per rank for each backward of the window, as DeepSpeed counts them."""
        if self._boundary is None:
            self._global_samples += self.train_batch_size()
        else:
            self._global_samples += self.train_micro_batch_size_per_gpu() * self.world_size * self._window_backwards

    def _count_micro_batch(self) -> None:
        """The end of :meth:`step` (a step that raised otherwise keeps its backwards: the retry
        is not refused)."""
        self.micro_steps += 1
        self._backwards = 0
        if getattr(self.params, "manager", None) is not None:
            self.params.manager.reduced_since_check = False

    def _forget_gradients(self) -> None:
        """Drop every gradient not yet stepped: the accumulation buffers, ``.grad`` that
        :meth:`no_sync` kept, and the counts of backwards that made them (a checkpoint load
        does this, so a load rolls back to the saved state and nothing from before it is
        added to the next step)."""
        for _n, p, flag in self._requires_grad:
            if flag:
                p.grad = None
        self.params.zero_grad_acc()
        self._unreduced = False
        self._backwards = self._window_backwards = 0
        if getattr(self.params, "manager", None) is not None:
            self.params.manager.reduced_since_check = False

    def _log_step(self) -> None:
        """Every ``steps_per_print`` optimizer steps, rank 0 reports the step count, skipped
        steps and learning rates, as DeepSpeed prints them; with ``wall_clock_breakdown`` also
        the last step's seconds per phase (see :func:`_progress` for where they go)."""
        n = self.config.steps_per_print
        if self.rank != 0 or not n or self.global_steps % n:
            return
        _progress("step=%d, skipped=%d, lr=%s", self.global_steps, self.skipped_steps, self.get_lr())
        if self.config.wall_clock_breakdown:
            st = self._stats
            _progress("step=%d time (s): backward %.4f, reduce %.4f, optimizer %.4f (adam %.4f, I/O wait %.4f)",
                      self.global_steps, st.get("backward_s", 0.0), st.get("reduce_s", 0.0), st.get("optimizer_s", 0.0),
                      st.get("adam_s", 0.0), st.get("io_wait_s", 0.0))

    def _new_step_stats(self) -> Dict[str, Any]:
        return {"backward_s": 0.0, "reduce_s": 0.0, "comm_elements": 0, "optimizer_s": 0.0, "adam_s": 0.0,
                "io_wait_s": 0.0, "nvme_read_bytes": 0, "nvme_write_bytes": 0, "gather_s": 0.0}

    def _global_norm(self, norm_type: float, local: Optional[float] = None) -> float:
        """The global gradient norm from this rank's ``local`` part (``sum |g|^p`` or ``max |g|``
        of its partitions; default: asked of the parameter manager), summed over ranks."""
        if local is None:
            value, partitioned = self.params.local_grad_norm_parts(norm_type)
        else:
            value, partitioned = local, True
        if self.world_size > 1 and partitioned:
            # on the compute device: NCCL reduces only CUDA tensors (gloo takes either)
            t = torch.tensor([value], dtype=torch.float64, device=getattr(self.params, "device", "cpu"))
            dist.all_reduce(t, op=dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM)
            value = float(t[0])
        norm = value if norm_type == math.inf else value ** (1.0 / norm_type)
        if self.loss_scaler is not None:
            norm = norm / self.loss_scaler.scale
        return norm

    def synchronize(self) -> None:
        """Wait for the optimizer step running in the background (stage 3 with
        ``zeroinf.overlap_step`` or ``zeroinf.optimizer_in_backward``); a no-op otherwise. Its Adam
        time and NVMe bytes are counted in the current step's :meth:`stats`, the time waited in
        ``io_wait_s``.

        Raises:
            StepFailedError: the background step failed (``__cause__`` is the original error);
                raised again by every later wait until :meth:`close`.
            RuntimeError: called inside the backward that feeds a step run in the backward
                (``zeroinf.optimizer_in_backward``: a hook or signal handler).
        """
        if not self._step_running:
            return
        t0 = time.perf_counter()
        # raises a failed step's error, again at every later call; and RuntimeError inside the
        # backward that feeds a step run in the backward (waiting there would never end)
        self.params.finish_step()
        self._step_running = False
        st = self.sub_optimizer.stats
        s = self._step_stats
        s["io_wait_s"] += time.perf_counter() - t0
        s["adam_s"] += st.adam_s
        s["nvme_read_bytes"] += st.bytes_read
        s["nvme_write_bytes"] += st.bytes_written

    @torch.no_grad()
    def _optimizer_step(self) -> None:
        if self._in_bwd:
            self._close_backward_step()
            return
        self.synchronize()
        t0 = time.perf_counter()
        cfg = self.config
        norm = self._global_norm(cfg.zeroinf.grad_norm_type)
        self._grad_norm = norm
        overflow = not math.isfinite(norm)
        at_min = None
        if self.loss_scaler is not None:
            try:
                self.loss_scaler.update(overflow)
            except FloatingPointError as exc:  # at min_loss_scale: skipped like any overflow, then raised
                at_min = exc
        self.global_steps += 1
        self._step_applied = not overflow
        if overflow:
            self.skipped_steps += 1
            self.params.zero_grad_acc()
            self._step_stats["optimizer_s"] += time.perf_counter() - t0
            if at_min is not None:
                raise at_min
            return
        grad_scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        if cfg.gradient_clipping > 0:
            # torch.nn.utils.clip_grad_norm_: coef = max_norm / (total_norm + 1e-6), clamped to 1.
            # Folded into the step's divisor rather than a pass over the gradients (which, on
            # NVMe, would read and rewrite every gradient partition): g / (scale / coef).
            coef = torch.tensor(cfg.gradient_clipping, dtype=torch.float32) / (torch.tensor(norm, dtype=torch.float32) + 1e-6)
            if float(coef) < 1.0:
                grad_scale = grad_scale / float(coef)
        self.optimizer_steps += 1
        if self._versions is not None:
            self._adopt_changed_weights()
        # a snapshot: the LR schedule below moves on while a background step still reads it
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        s = self._step_stats
        if self._overlap:
            self.params.start_step(self.sub_optimizer, step=self.optimizer_steps, hyper=hyper, grad_scale=grad_scale)
            self._step_running = True
            s["io_wait_s"] += self.params.manager.step_gate.take_wait_s()  # forward waits on the last update
        else:
            self.sub_optimizer.step(step=self.optimizer_steps, hyper=hyper, grad=self.params.grad,
                                    out=self.params.param_target, grad_scale=grad_scale)
            st = self.sub_optimizer.stats
            t1 = time.perf_counter()
            self.params.gather_params()
            s["gather_s"] += time.perf_counter() - t1
            self.params.zero_grad_acc()
            s["adam_s"] += st.adam_s
            s["io_wait_s"] += st.io_wait_s
            s["nvme_read_bytes"] += st.bytes_read
            s["nvme_write_bytes"] += st.bytes_written
        s["optimizer_s"] += time.perf_counter() - t0

    def _adopt_replaced_data(self) -> None:
        """[Note: weights changed between steps] ``p.data = t`` (and ``model.half()`` then
        ``model.float()``, which do that) leaves a stage 0-2 parameter outside its flat buffer:
        the step wrote the updates into the old storage and the parameter never trained again,
        silently. A replacement of the same shape, dtype and device is copied into
        the flat buffer, the parameter views the buffer again, and the next step takes its values
        into the masters ([Note: weights changed between steps]).

        A re-view of the parameter's own data (``p.data = p.data.t()``: the same address, other
        strides) is adopted the same way.

        Raises:
            RuntimeError: a replacement of another shape, dtype or device (``model.half()`` not
                undone), or one that views another parameter's data (torch would keep the two
                tied), naming the parameter; nothing was changed.
        """
        # one pointer comparison per parameter, at the accumulation boundary (slicing the flat
        # buffer per parameter at every micro-step costs 1.4 us per parameter)
        # (strides too: p.data = p.data.t() keeps the address)
        moved = [(gi, j, p) for gi, j, p, home, st in self._homes if p.data_ptr() != home or p.stride() != st]
        if moved:  # the flat buffers themselves may have moved (model.share_memory())
            self._homes = self._home_list()
            moved = [(gi, j, p) for gi, j, p, home, st in self._homes if p.data_ptr() != home or p.stride() != st]
        if not moved:
            return
        flats = {g.flat.untyped_storage().data_ptr() for g in self.params.groups}
        for k, (gi, j, p) in enumerate(moved):
            g = self.params.groups[gi]
            off = g.offsets[j]
            view = g.flat[off:off + p.numel()]
            name = self._names.get(p, "?")
            if p.shape != self._shapes[gi][j] or p.dtype != view.dtype or p.device != view.device:
                raise RuntimeError(
                    f"zeroinf: parameter '{name}' was given data of shape {tuple(p.shape)}, "
                    f"{p.dtype} on {p.device} after zeroinf.initialize (p.data = t, model.half(), model.to(...)); "
                    f"the engine trains it as {tuple(self._shapes[gi][j])}, {view.dtype} on {view.device}. Undo "
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
            p.data = view.view(self._shapes[gi][j])
            self._versions[gi][j] = None  # compared with the masters at the next step

    def _home_list(self) -> list:
        """(group, index, parameter, address where its data starts in the flat buffer, its strides there) of every
        non-empty parameter at stages 0-2 (an empty tensor's ``data_ptr()`` is 0: nothing to adopt)."""
        return [(gi, j, p, g.flat.data_ptr() + off * g.flat.element_size(), self._strides[gi][j])
                for gi, g in enumerate(self.params.groups) for j, (p, off) in enumerate(zip(g.params, g.offsets))
                if p.numel()]

    def _adopt_changed_weights(self) -> None:
        """[Note: weights changed between steps] At stages 0-2 the optimizer steps masters that
        are not the model's parameters (bf16/fp16, or fp32 with the optimizer state on NVMe or the
        parameters on CUDA) and writes the result into the parameters; a weight the user changed
        between steps (``model.load_state_dict``, ``torch.nn.init`` or an in-place op under
        ``torch.no_grad``) was put back by the next step, silently (fp32 with NVMe too). A parameter whose
        version counter moved since (or whose data was replaced: :meth:`_adopt_replaced_data`) is
        compared with its masters rounded to its dtype, and the elements that differ are taken
        into the masters, as ``torch.optim.AdamW`` would step them. The engine's own writes
        (through the kernel's pointers, the all-gather into the flat buffer) move no parameter's
        counter; an in-place op on ``p.data`` moves none either and is not seen.

        A bf16/fp16 parameter loaded from fp32 (or fp64) values by ``load_state_dict``
        (:func:`_loaded_values_hook`) gives its masters those values, not their rounding, where it
        still holds that rounding: the elements whose rounding had not moved kept their trained
        master (as at stage 3: ``units.exact_values``)."""
        index = self.params._sub_index()
        loaded, self._loaded_fp32 = self._loaded_fp32, {}
        todo: Dict[int, list] = {}  # sub-group -> [(start, end, values, loaded fp32 or None)] in sub-group coordinates
        for gi, g in enumerate(self.params.groups):
            seen = self._versions[gi]
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
        nvme = self.sub_optimizer.device == "nvme"
        for i, pieces in todo.items():  # each sub-group's state read once, however many parameters changed
            with self.sub_optimizer.state(i) as (master, m, v):
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
                self.sub_optimizer.load_state(i, master, m, v)

    def _mark_weights_current(self) -> None:
        """Take the parameters as they are now for the fp32 masters' rounded values (after a
        checkpoint load wrote both), so the next step does not compare them again
        ([Note: weights changed between steps]); a no-op at stage 3."""
        if self._versions is not None:
            self._versions = [[p._version for p in g.params] for g in self.params.groups]
            self._loaded_fp32 = {}

    def _close_backward_step(self) -> None:
        """engine.step() with ``zeroinf.optimizer_in_backward``: the update already runs (since
        engine.backward); count the step, record the global norm, move the LR schedule.

        Raises:
            RuntimeError: no engine.backward() since the last step, or called inside the backward
                (a hook or signal handler).
            StepFailedError: the background update failed.
        """
        if not self._bwd_pending:
            self.synchronize()  # a failed update: its StepFailedError says more than the line below
            raise RuntimeError("zeroinf.optimizer_in_backward: engine.step() needs an engine.backward() first "
                               "(the update runs inside the backward)")
        t0 = time.perf_counter()
        norm_type = self.config.zeroinf.grad_norm_type
        # may raise (inside the backward, or the update failed): the step stays open until then
        self._grad_norm = norm = self._global_norm(norm_type, self.params.backward_step_norm(norm_type))
        self._bwd_pending = False
        if not math.isfinite(norm):
            warnings.warn(f"zeroinf.optimizer_in_backward: step {self.optimizer_steps + 1} applied gradients whose "
                          f"global norm is {norm} (the update runs during the backward, before the norm is known, "
                          "so it cannot be skipped); the weights may now hold inf/nan", RuntimeWarning,
                          stacklevel=5)  # the caller of engine.step(), through torch.no_grad's wrapper
        self.global_steps += 1
        self.optimizer_steps += 1
        self._step_applied = True
        self.params.backward_step_done()
        s = self._step_stats
        s["io_wait_s"] += self.params.manager.step_gate.take_wait_s()
        if not self.config.zeroinf.overlap_step:
            self.synchronize()
        s["optimizer_s"] += time.perf_counter() - t0

    def empty_partition_cache(self) -> int:
        """Free the memory stage 3 keeps between steps for speed (DeepSpeed's method of the same
        name, called e.g. before generation): NVMe partitions read ahead for the next step (their
        pinned staging buffers return to the engine's pool, which stays allocated), the recycled
        unit-sized host scratch buffers (at most 512 MiB), and on CUDA the caching allocator's
        unused blocks (``torch.cuda.empty_cache``). No parameter stays gathered between
        iterations here, so none is released. The next step reads and allocates these again.

        Returns:
            Host scratch bytes freed (0 below stage 3, which keeps no such cache).

        Raises:
            RuntimeError: the engine is closed, or (stage 3) it is called inside a forward or
                backward, or while a training forward's graph waits for its backward. Below stage 3
                there is nothing to free and it may be called anywhere.
            OSError: a read-ahead had failed; its data was never used, and nothing else changed.
        """
        self._check_open()
        manager = getattr(self.params, "manager", None)
        freed = manager.empty_cache() if manager is not None else 0
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return freed

    def offload_states(self, include=None, device=None, pin_memory: bool = True, non_blocking: bool = False,
                       *, path: Optional[str] = None) -> int:
        """Move the whole state out of memory into one file under ``path`` (default: the config's
        ``nvme_path``, else the temp folder), as DeepSpeed's method of the same name (RLHF phases):
        see :mod:`zeroinf.runtime.offload_states`. Until :meth:`reload_states` the model's forward
        and ``state_dict`` raise. ``include`` must be None (all states); ``device``,
        ``pin_memory`` and ``non_blocking`` are accepted and not read.

        Returns:
            Bytes moved out of memory.

        Raises:
            NotImplementedError: ``include`` names a subset of the states.
            RuntimeError: the engine is closed or already offloaded.
            OSError: the file cannot be written (nothing was freed).
        """
        from .offload_states import Residency, offload
        if include is not None:
            raise NotImplementedError("engine.offload_states(include=...): zeroinf offloads all states together; "
                                      "pass include=None")
        self._check_open()  # also refuses a second offload
        self.synchronize()
        self.empty_partition_cache()
        self._offloaded = offload(self, path)
        self._residency = Residency.OFFLOADED
        return self._offloaded.nbytes

    def reload_states(self, non_blocking: bool = False) -> None:
        """Read back what :meth:`offload_states` moved, bit for bit, and remove its file
        (``non_blocking`` is not read). Raises RuntimeError when nothing is offloaded, OSError
        when the file cannot be read back (see :func:`zeroinf.runtime.offload_states.reload`)."""
        from .offload_states import Residency, reload
        if getattr(self, "_residency", Residency.RESIDENT) is not Residency.OFFLOADED:
            raise RuntimeError("engine.reload_states(): nothing is offloaded (call engine.offload_states() first)")
        reload(self._offloaded)
        self._offloaded, self._residency = None, Residency.RESIDENT

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's ``save_16bit_model``: the model's state dict in its training dtype (bf16 or
        fp16 parameters; fp32 when training in fp32), full tensors, written by rank 0 to
        ``save_dir/save_filename`` (``torch.save``; a ``.safetensors`` name writes safetensors).
        Collective: every rank calls it (stage 3 gathers the partitions). At stage 3 only with
        ``zero_optimization.stage3_gather_16bit_weights_on_model_save`` true, as in DeepSpeed:
        otherwise nothing is written, a warning says why, and it returns False.

        Args:
            exclude_frozen_parameters: leave out parameters with ``requires_grad=False``.

        Returns:
            True when the file was written (on rank 0; the other ranks return True too).

        Raises:
            OSError: the file cannot be written (rank 0; named).
        """
        from zeroinf.checkpoint import save_atomically
        self._check_open()
        if self.config.zero_optimization.stage == 3 and not self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save:
            warnings.warn("save_16bit_model: nothing saved; at stage 3 set zero_optimization."
                          "stage3_gather_16bit_weights_on_model_save to true (or use zeroinf.checkpoint.consolidate "
                          "on a checkpoint for fp32 weights)", RuntimeWarning, stacklevel=2)
            return False
        self.synchronize()  # a background step's updates are in the partitions
        sd = self.module_state_dict(exclude_frozen_parameters)
        if self.rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(save_dir, save_filename)
            if save_filename.endswith(".safetensors"):
                save_atomically({k: v.detach().to("cpu").contiguous().clone() for k, v in sd.items()}, path)
            else:
                save_atomically({k: v.detach().to("cpu") for k, v in sd.items()}, path)
        return True

    # DeepSpeed's accessors
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (``gradient_accumulation_steps``)."""
        return self.gas

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per micro-batch per rank, from the config."""
        return self.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all ranks (micro-batch x accumulation x ranks)."""
        return self.config.train_micro_batch_size_per_gpu * self.gas * self.world_size

    def zero_optimization_stage(self) -> int:
        """The ZeRO stage, 0-3."""
        return self.config.zero_optimization.stage

    def was_step_applied(self) -> bool:
        """Whether the last optimizer step changed the weights (False when an fp16 overflow
        skipped it, or before any step)."""
        return self._step_applied

    @property
    def global_samples(self) -> int:
        """Samples consumed by optimizer steps so far, counted at each step as DeepSpeed counts
        them (see :meth:`_count_samples`) and restored by ``load_checkpoint``: it stays right
        across a change of batch size on resume (it was ``global_steps x train_batch_size()``,
        which rewrote the past)."""
        return self._global_samples

    @property
    def device(self) -> torch.device:
        """The compute device of the model's parameters."""
        return torch.device(getattr(self.params, "device", "cpu"))

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (``LOCAL_RANK`` from torchrun; 0 without it)."""
        return int(os.environ.get("LOCAL_RANK", 0))

    def get_global_grad_norm(self) -> Optional[float]:
        """The (unscaled) global gradient norm of the last boundary, before clipping; None before
        the first step; inf/nan when that step was skipped."""
        return self._grad_norm

    def get_lr(self) -> List[float]:
        """The lr of each param group."""
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_mom(self) -> List[Tuple[float, float]]:
        """Adam's ``betas`` of each param group, as DeepSpeed's ``get_mom`` gives them."""
        return [tuple(g["betas"]) for g in self.optimizer.param_groups]

    # what DeepSpeed's example scripts read of the engine
    @property
    def global_rank(self) -> int:
        """This process's rank in the data-parallel world (``torch.distributed`` rank)."""
        return self.rank

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks (all ranks: zeroinf has no model or pipeline parallelism)."""
        return self.world_size

    def get_data_parallel_world_size(self) -> int:
        """Same as :attr:`dp_world_size`."""
        return self.world_size

    def get_data_parallel_rank(self) -> int:
        """Same as :attr:`global_rank`."""
        return self.rank

    def fp16_enabled(self) -> bool:
        """Whether the config trains in fp16 (``fp16.enabled``)."""
        return self.config.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        """Whether the config trains in bf16 (``bf16.enabled``)."""
        return self.config.precision == "bf16"

    def gradient_clipping(self) -> float:
        """The config's ``gradient_clipping`` (max global gradient norm; 0: no clipping)."""
        return self.config.gradient_clipping

    def zero_optimization(self) -> bool:
        """Whether ZeRO partitions anything (stage 1-3), as DeepSpeed answers it."""
        return self.config.zero_optimization.stage > 0

    def zero_cpu_offload(self) -> bool:
        """Whether the optimizer state is offloaded to CPU memory (``offload_optimizer.device`` cpu)."""
        return self.config.zero_optimization.offload_optimizer.device == "cpu"

    def zero_offload_optimizer(self):
        """The config's ``zero_optimization.offload_optimizer`` block (device, nvme_path, buffers),
        or None without optimizer offload (device none), as DeepSpeed answers it."""
        off = self.config.zero_optimization.offload_optimizer
        return None if off.device == "none" else off

    def zero_offload_param(self):
        """The config's ``zero_optimization.offload_param`` block (device, nvme_path, buffers),
        or None without parameter offload (device none), as DeepSpeed answers it."""
        off = self.config.zero_optimization.offload_param
        return None if off.device == "none" else off

    def steps_per_print(self) -> int:
        """The config's ``steps_per_print`` (0: never)."""
        return self.config.steps_per_print

    def dynamic_loss_scale(self) -> bool:
        """Whether fp16 training scales the loss dynamically (``fp16.loss_scale`` 0)."""
        return self.config.precision == "fp16" and self.config.fp16.loss_scale == 0

    def get_batch_info(self) -> Tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``."""
        return self.train_batch_size(), self.config.train_micro_batch_size_per_gpu, self.gas

    @property
    def mp_world_size(self) -> int:
        """Model-parallel ranks: 1 (zeroinf has no tensor or pipeline parallelism)."""
        return 1

    @property
    def loss_scale(self) -> float:
        """Current loss scale (1.0 without fp16); a property: ``engine.loss_scale``, not
        ``engine.loss_scale()``."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def swap_files(self) -> List[str]:
        """Paths of this engine's NVMe swap and manifest files on this rank: the optimizer's
        and (stage 3) the parameter manager's swappers' registered keys. Other files in the
        ``nvme_path`` folders (an earlier run's, left there: swap files outlive ``close``) are not
        included. Empty without NVMe offload or after ``close``."""
        swappers = [getattr(self.sub_optimizer, "_swapper", None),
                    getattr(getattr(self.params, "manager", None), "_swapper", None)]
        return sorted({str(p) for sw in swappers if sw is not None for p in sw.files()})

    def stats(self) -> Dict[str, Any]:
        """Counters of the last optimizer step: seconds in backward, gradient reduction, optimizer
        (of which Adam compute and waiting on NVMe I/O) and all-gather; elements communicated;
        NVMe bytes read/written; ``pinned_bytes``, the page-locked host memory held now (the
        optimizer's swap buffers and stage 3's parameter staging pool, locked on any host; with
        CUDA also the gradient accumulation, parameter copies, staging buffers and CPU-resident
        optimizer state torch pins: :mod:`zeroinf.runtime.pinned`); plus step counters and the
        loss scale.

        With a background step (stage 3, ``zeroinf.overlap_step`` or
        ``zeroinf.optimizer_in_backward``) a step's Adam time and optimizer NVMe bytes land in the
        counters of the next step (they are added when the next backward joins the step), and
        ``io_wait_s`` counts the time the forward waited for its updates."""
        out = dict(self._stats)
        out.update(global_steps=self.global_steps, skipped_steps=self.skipped_steps, loss_scale=self.loss_scale,
                   pinned_bytes=self.sub_optimizer.pinned_bytes() + self.params.pinned_bytes(),
                   grad_norm=self._grad_norm)
        if hasattr(self.params, "stats"):  # stage 3: transfer counters of the last optimizer step
            out["stage3"] = self.params.stats()
        return out

    def trace(self, path) -> int:
        """Stage 3: write the last iteration's transfers and unit executions as Chrome/Perfetto
        JSON to ``path``; returns the number of events. Raises NotImplementedError below stage 3."""
        if not hasattr(self.params, "trace"):
            raise NotImplementedError("engine.trace() records stage-3 transfers; zero_optimization.stage is not 3")
        return self.params.trace(path)

    # ------------------------------------------------------------------------------------------

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> str:
        """Save to ``save_dir/tag`` (tag default ``global_step{N}``); see :mod:`zeroinf.checkpoint`.
        ``save_latest``: point ``save_dir/latest`` at it; ``exclude_frozen_parameters``: leave the
        ``requires_grad=False`` parameters out (a LoRA checkpoint without its base; a load keeps
        the model's values for them). DeepSpeed's keywords. Returns the checkpoint folder.

        Raises:
            RuntimeError: between engine.backward and engine.step with
                ``zeroinf.optimizer_in_backward`` (see :meth:`_check_step_closed`).
        """
        from zeroinf import checkpoint
        self._check_open()
        self._check_step_closed("save_checkpoint")
        if self._versions is not None:  # stages 0-2: the weights the module holds now are the ones to save
            self._adopt_replaced_data()
            with torch.no_grad():
                self._adopt_changed_weights()
        return checkpoint.save(self, save_dir, tag, client_state, save_latest=save_latest,
                               exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False):
        """Load from ``load_dir/tag`` (tag default: the ``latest`` file). Returns
        ``(path, client_state)`` like DeepSpeed, and ``(None, None)`` with a warning when tag is
        None and there is no ``latest`` file (a first run). By default the whole state, bit-exactly
        (:func:`zeroinf.checkpoint.load`); ``load_lr_scheduler_states=False`` keeps the scheduler's.
        DeepSpeed's partial loads (:func:`zeroinf.checkpoint.load_weights`):
        ``load_module_only=True`` takes the weights alone (fine-tuning from a checkpoint: the
        Adam moments, steps and schedule stay this engine's; another world size or stage loads
        too), ``load_optimizer_states=False`` the weights, step counters and (unless
        ``load_lr_scheduler_states=False``) the schedule; ``load_module_strict=False`` lets their
        keys differ from the model's.

        Raises:
            CheckpointError: see :func:`zeroinf.checkpoint.load`.
            RuntimeError: between engine.backward and engine.step with ``zeroinf.optimizer_in_backward``.
        """
        from zeroinf import checkpoint
        partial = bool(load_module_only) or not load_optimizer_states
        self._check_open(loading=not partial)  # a partial load does not mend a state left half-loaded
        self._check_step_closed("load_checkpoint")
        if partial:
            return checkpoint.load_weights(self, load_dir, tag, strict=bool(load_module_strict),
                                           counters=not load_module_only,
                                           load_lr_scheduler_states=bool(load_lr_scheduler_states))
        return checkpoint.load(self, load_dir, tag, load_lr_scheduler_states=bool(load_lr_scheduler_states))

    def _check_step_closed(self, what: str) -> None:
        """Raise RuntimeError between engine.backward and engine.step with
        ``zeroinf.optimizer_in_backward``: the weights and Adam moments are already those of the
        next step while the step counter is not, so a checkpoint would be neither step."""
        if self._bwd_pending:
            raise RuntimeError(f"zeroinf.optimizer_in_backward: {what} between engine.backward() and engine.step(): "
                               "the backward already applied the update but the step is not counted yet; call "
                               "engine.step() first")

    def close(self) -> None:
        """Wait for a background step, then release swap buffers, pinned memory, I/O threads and
        file handles, the optimizer's and (stage 3) the parameter manager's (idempotent). A stage-3
        model cannot run a forward afterwards (RuntimeError). Raises the background step's
        failure after releasing them."""
        self._closed = True
        _WATCHED.discard(self)
        for h in self._guard_hooks:
            h.remove()
        if _GUARD_HOOKS.get(self.module) is self._guard_hooks:
            del _GUARD_HOOKS[self.module]
        if self._in_bwd and self.params.in_backward_step():  # inside engine.backward (a signal handler)
            self.params.abort_backward_step(RuntimeError("engine.close() was called inside engine.backward"))
        try:
            self.synchronize()
        finally:
            try:
                self.sub_optimizer.close()
            finally:
                manager = getattr(self.params, "manager", None)
                if manager is not None:
                    manager.close()

    def _check_open(self, loading: bool = False) -> None:
        """Raise RuntimeError once :meth:`close` ran, while :meth:`offload_states` holds the state
        in its file, or (unless ``loading``) while a :meth:`load_checkpoint` that failed part-way
        left the state a mix of two."""
        if self._closed:
            raise RuntimeError("zeroinf: this engine was closed (engine.close()); its optimizer state and swap "
                               "buffers are released. Build a new engine with zeroinf.initialize (at stage 3 on a newly "
                               "built model), and save a checkpoint before closing to carry the state over.")
        if not loading:
            self.state_guard.check()
        from .offload_states import Residency
        if getattr(self, "_residency", Residency.RESIDENT) is Residency.OFFLOADED:
            raise RuntimeError("zeroinf: the engine's states are offloaded (engine.offload_states()); call "
                               "engine.reload_states() first")

    def destroy(self) -> None:
        """Alias of :meth:`close` (DeepSpeed's name)."""
        self.close()


def _progress(msg: str, *args) -> None:
    """A ``steps_per_print`` line: to the ``zeroinf`` logger at INFO once logging is configured
    (a handler on that logger or above it; its level decides), else to stderr as
    ``[zeroinf] ...`` through ``tqdm.write``, so a progress bar stays whole. DeepSpeed's logger
    prints these by default; through logging alone they stayed invisible until the user set
    logging up, and the config key looked ignored."""
    if _log.hasHandlers():
        _log.info(msg, *args)
    else:
        from tqdm import tqdm
        tqdm.write("[zeroinf] " + msg % args, file=sys.stderr)


def destroy_process_group(barrier: bool = True) -> None:
    """``torch.distributed.destroy_process_group()``, after a barrier when ``barrier`` (only
    when every rank is known to reach it: not on an error path, where it would hang).

    Why the barrier: gloo finishes a collective and frees its work object (and with it the last
    references to the Python tensors it gathered) on its own thread, after the caller's wait has
    returned. A process that exits right after its last all-gather can reach interpreter
    shutdown while that thread still needs the GIL to drop them, and aborts ("terminate called
    without an active exception", SIGABRT; seen in 6 of 16 two-rank runs). The gloo thread runs
    works in order, so once a barrier completes the earlier works are gone; the barrier's own
    tensor has no Python object. No-op when no process group is initialised.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if barrier and dist.get_world_size() > 1:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def initialize(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, model_parameters=None,
               lr_scheduler=None, config=None, training_data=None, collate_fn=None):
    """Wrap ``model`` for ZeRO training, like ``deepspeed.initialize``.

    Args:
        model: the module (its parameters on the compute device; CPU here, CUDA when present).
        optimizer: a client torch.optim.Adam/AdamW/zeroinf.optim.CPUAdam whose param groups and
            hyper-parameters are used (it is returned, and its ``step``, ``state_dict`` and
            ``load_state_dict`` raise from then on, pointing to ``engine.step`` and
            ``engine.save_checkpoint``), or None to build one from ``config["optimizer"]``.
        model_parameters: parameters or param-group dicts for the config optimizer (default:
            ``model.parameters()``).
        lr_scheduler: a scheduler object bound to ``optimizer``, or a callable
            ``f(optimizer) -> scheduler``; or None to use ``config["scheduler"]``.
        config: DeepSpeed-format dict or JSON path (see :func:`zeroinf.config.parse_config`).
        training_data: a ``torch.utils.data.Dataset``; if given, a shuffled DataLoader of
            ``train_micro_batch_size_per_gpu`` samples (a DistributedSampler over ranks) is returned.
        collate_fn: passed to that DataLoader.

    Returns:
        ``(engine, optimizer, dataloader_or_None, lr_scheduler)``.

    Raises:
        ValueError: a parameter or buffer of ``model`` is on the meta device (named).
        zeroinf.memcheck.InsufficientMemoryError: the estimated device, host or disk bytes of the
            config exceed what is free (unless ``"zeroinf": {"check_memory": false}``); the
            message lists each figure and a placement that fits. Nothing is allocated.
        ConfigError: invalid config, or a machine check failed (``nvme_path`` not writable, or
            missing and impossible to create, as DeepSpeed creates it; not enough free disk, pinned budget over RAM or ``ulimit -l``); the message
            starts with the key path.
    """
    if config is None:
        raise ConfigError("", "initialize() needs config (a DeepSpeed-format dict or JSON path)")
    rank, world_size = _world()
    cfg = parse_config(config, world_size=world_size)
    meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if meta:  # torch's "Cannot copy out of meta tensor" named nothing
        raise ValueError(f"zeroinf.initialize: {len(meta)} parameter(s)/buffer(s) of the model are on the meta device, "
                         f"with no values ({', '.join(meta[:5])}{', ...' if len(meta) > 5 else ''}): a model built "
                         "under torch.device('meta'), or a loader that did not fill them. Give them values first "
                         "(model.to_empty(device=...) and load the weights), or build a model too large for memory "
                         "under zeroinf.Init")
    if cfg.zeroinf.check_memory:  # before the first allocation: casts, partitions, pinned buffers, swap files
        from zeroinf.memcheck import check
        from zeroinf.runtime.stage3.init import swap_bytes_freed_by
        check(model, cfg, world_size=world_size, rank=rank, device=_compute_device(),
              freed=swap_bytes_freed_by(model.parameters()))
    if optimizer is not None and cfg.optimizer is not None:
        raise ConfigError("optimizer", "given both in the config and to initialize(); use one")
    if lr_scheduler is not None and cfg.scheduler is not None:
        raise ConfigError("scheduler", "given both in the config and to initialize(); use one")
    if optimizer is None:
        params = list(model_parameters) if model_parameters is not None else list(model.parameters())
        if cfg.optimizer is not None:
            o = cfg.optimizer
            optimizer = ZeroOptimizer(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                                      adamw_mode=o.adam_w_mode, bias_correction=o.bias_correction)
        elif not any(p.requires_grad for p in params):
            # a frozen model (an RLHF reference, a distillation teacher) needs none, as in DeepSpeed
            optimizer = ZeroOptimizer(params)
        else:
            raise ConfigError("optimizer", "required: set optimizer {type, params} or pass optimizer= (a model with "
                              "no trainable parameter, such as a frozen reference or teacher, needs none)")
    else:
        _hyper_from_client(optimizer)
    engine = ZeroEngine(model, cfg, optimizer, lr_scheduler=lr_scheduler, rank=rank, world_size=world_size)
    if not isinstance(optimizer, ZeroOptimizer):
        _hand_over(optimizer)
    loader = None
    if training_data is not None:
        # as DeepSpeed's loader: shuffled, each rank its own share (call loader.sampler.set_epoch(e)
        # with several ranks to reshuffle per epoch)
        if world_size > 1:
            sampler = torch.utils.data.distributed.DistributedSampler(training_data, num_replicas=world_size, rank=rank)
        else:
            sampler = torch.utils.data.RandomSampler(training_data)
        loader = torch.utils.data.DataLoader(training_data, batch_size=cfg.train_micro_batch_size_per_gpu,
                                             sampler=sampler, collate_fn=collate_fn)
    return engine, optimizer, loader, engine.lr_scheduler
