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

The stage seam. The engine talks to its ZeRO stage (``self.params``) only through
:class:`zeroinf.runtime.stage_api.StageParams`, picked once here by :func:`build_stage`:
:class:`zeroinf.runtime.flat.FlatParamManager` for stages 0-2, the stage-3 manager's
:class:`zeroinf.runtime.stage3.engine_glue.Stage3EngineParams` for stage 3.

The engine is split by job: this module builds it (config wiring, start-up checks,
:func:`initialize`); :mod:`.engine_step` drives forward, backward and step; :mod:`.engine_state`
saves, loads, offloads and closes; :mod:`.engine_info` answers DeepSpeed's accessors and reports;
:mod:`.engine_guards` holds the guards on the model; :mod:`.zero_optimizer` the returned optimizer.
"""
from __future__ import annotations

import os
import shutil
import warnings
import weakref
from pathlib import Path
from typing import Any, Dict, Optional

import psutil
import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from zeroinf import progress
from zeroinf.config import ConfigError, ZeroInfConfig, parse_config

from .engine_guards import StateGuard, note_gloo_used, take_over_guard_hooks, watch
from .engine_info import EngineInfo
from .engine_state import EngineState
from .engine_step import StepDriver
from .host_memory import HostMemory
from .loss_scaler import LossScaler
from .optimizer import SubGroupOptimizer, state_bytes_per_element
from .stage_api import StageParams
from .step_state import StepState
from .zero_optimizer import ZeroOptimizer, hand_over, hyper_from_client

__all__ = ["StateGuard", "ZeroEngine", "ZeroOptimizer", "build_stage", "destroy_process_group", "initialize"]

#: ``offload_optimizer.state_dtype`` -> the Adam moments' element type
_STATE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _bytes_gb(n: int) -> str:
    """``n`` bytes exactly, and in decimal GB to 3 significant digits (0.05 GB rounded two different
    sizes alike)."""
    return f"{n} bytes ({n / 1e9:.3g} GB)"


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


def slow_cpu_compute(dtype: torch.dtype) -> Optional[str]:
    """A one-line warning when this CPU computes in ``dtype`` far slower than in fp32, else None.

    Torch's CPU matmuls take bf16 (fp16) at speed through oneDNN only where the CPU has the
    instructions oneDNN needs (AVX-512 for bf16, AVX-512 FP16 or AMX for fp16); elsewhere
    they fall back to a scalar loop. Measured on a 2-core AVX2 EPYC, torch 2.13: a 256x1728 by
    1728x6912 matmul ran at 64 GFLOP/s in fp32 and 0.73 in bf16.
    """
    checks = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}
    probe = getattr(torch.ops.mkldnn, checks[dtype], None) if dtype in checks else None
    if probe is None or probe():
        return None
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    return (f"zeroinf: this CPU has no fast {name} matmuls (oneDNN needs AVX-512 or AMX for them), so a {name} "
            f"forward and backward on it run up to ~100x slower than in fp32; train in fp32 here (bf16 optimizer "
            f"state, zero_optimization.offload_optimizer.state_dtype, still halves the moments' bytes)")


def build_stage(model: torch.nn.Module, cfg: ZeroInfConfig, groups, *, rank: int, world_size: int,
                check_disk, host: Optional[HostMemory] = None) -> StageParams:
    """The stage implementation for ``cfg.zero_optimization.stage``, built over ``groups`` (the
    trainable parameters of each optimizer param group; ``model`` already in the training dtype).
    ``check_disk(files, freed=None)`` checks the swap files' room before they are written
    (:meth:`ZeroEngine._check_disk`). ``host``: the engine's :class:`HostMemory`, which the stage's
    host buffers come from (None: a new one).

    Raises:
        RuntimeError: at stage 3, the model's parameters are partitioned by another engine.
        ConfigError: a swap folder has too little room (from ``check_disk``).
    """
    zc = cfg.zero_optimization
    off = zc.offload_optimizer
    if zc.stage == 3:
        from zeroinf.runtime.stage3 import engine_manager
        from zeroinf.runtime.stage3.init import swap_bytes_freed_by
        from zeroinf.runtime.stage3.registry import partitioned_by
        from zeroinf.runtime.stage3.swap_plan import swap_file_bytes
        owner = partitioned_by(model.parameters())
        if owner is not None:  # its parameters are placeholders: a second engine would hold nothing
            raise RuntimeError(
                "zeroinf.initialize: this model's parameters are already partitioned by another stage-3 engine "
                f"({'closed' if owner.closed else 'still open'}); build the model again (or under zeroinf.Init) "
                "and give that to zeroinf.initialize, then load the weights (engine.load_checkpoint, "
                "load_safetensors)")
        # before the manager writes its parameter partitions: every swap file stage 3 implies,
        # the optimizer's included
        check_disk(swap_file_bytes(model, cfg, groups, rank=rank, world_size=world_size),
                   freed=swap_bytes_freed_by(model.parameters()))
        return engine_manager(model, cfg, groups, rank=rank, world_size=world_size, host=host)
    from .flat import FlatParamManager
    flat = FlatParamManager(groups, stage=zc.stage, sub_group_size=zc.sub_group_size,
                            reduce_bucket_size=zc.reduce_bucket_size, allgather_bucket_size=zc.allgather_bucket_size,
                            reduce_scatter=zc.reduce_scatter, rank=rank, world_size=world_size, host=host)
    if off.device == "nvme":
        per = state_bytes_per_element(_STATE_DTYPES[off.state_dtype], master=True)
        check_disk([("zero_optimization.offload_optimizer.nvme_path", off.nvme_path,
                     os.path.join(off.nvme_path, "zeroinf_optimizer", f"rank{rank}"),
                     per * sum(s.numel for s in flat.sub_group_specs()), f"optimizer state ({per} bytes per element)")])
    return flat


class ZeroEngine(StepDriver, EngineState, EngineInfo):
    """ZeRO stages 0–3 with CPU/NVMe optimizer offload; the stage is ``params``, a
    :class:`~zeroinf.runtime.stage_api.StageParams`.

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
            note_gloo_used()
        self.gas = cfg.gradient_accumulation_steps
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.optimizer_steps = 0   #: steps actually applied (Adam's step count)
        self._grad_norm: Optional[float] = None
        self._stats: Dict[str, Any] = {}
        self._step_stats = self._new_step_stats()
        self._step = StepState()  # the optimizer update in flight or uncounted, if any (step_state.py)
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
        slow = slow_cpu_compute(dtype) if rank == 0 and not torch.cuda.is_available() else None  # CPU compute
        if slow:
            warnings.warn(slow, stacklevel=4)  # the caller of zeroinf.initialize
        fp32_copies = None
        if dtype != torch.float32:
            fp32_copies = {id(p): p.detach().to("cpu", torch.float32, copy=True) for ps in groups for p in ps}
            model.to(dtype)
        self.dtype = dtype

        #: the one allocator of the engine's host buffers: the stage's and the optimizer's
        #: (stats()["pinned_bytes"] is its count)
        self.host = HostMemory()
        self.params: StageParams = build_stage(model, cfg, groups, rank=rank, world_size=world_size, host=self.host,
                                               check_disk=self._check_disk)
        specs = self.params.sub_group_specs()
        # [Note: master in the partitions] (stage3/engine_glue.py): fp32 stage 3 with the optimizer
        # state on NVMe keeps no second fp32 copy of the parameters
        master_io = self.params.master_io()
        state_dtype = _STATE_DTYPES[off.state_dtype]
        self._check_machine(specs, state_bytes_per_element(state_dtype, master=master_io is None))
        swap_dir = None
        if off.device == "nvme":
            swap_dir = os.path.join(off.nvme_path, "zeroinf_optimizer", f"rank{rank}")
            os.makedirs(swap_dir, exist_ok=True)
        try:
            self.sub_optimizer = SubGroupOptimizer(
                specs, device=off.device, swap_dir=swap_dir, buffer_count=off.buffer_count,
                pipeline_read=off.pipeline_read, pipeline_write=off.pipeline_write, pin_memory=off.pin_memory,
                aio=cfg.aio, master_io=master_io, state_dtype=state_dtype, host=self.host)
        except MemoryError as e:  # zeroinf.io.PinnedMemoryError: over RAM or ulimit -l
            raise ConfigError("zero_optimization.offload_optimizer.buffer_count",
                              f"{e}; lower sub_group_size or buffer_count") from e
        # a step that fails after some sub-groups were stepped leaves weights and state torn between two
        # steps: every entry point and the model's own forward refuse them until a checkpoint loads (the
        # optimizer in backward keeps its own failed-step state, StepFailedError, that refuses every call)
        if not cfg.zeroinf.optimizer_in_backward:
            self.sub_optimizer.on_torn = lambda exc: self.state_guard.failed(exc, during="an optimizer step")
        # fp32 parameters in CPU memory with CPU-resident state: the parameter is the master weight
        alias = dtype == torch.float32 and off.device != "nvme" and self.params.params_may_be_masters
        for i in progress.counting(range(len(specs)), "zeroinf: writing initial optimizer state", unit="sub-group"):
            target = self.params.param_target(i) if alias else None
            if target is not None and (target.device.type != "cpu" or not target.is_contiguous()
                                       or target.dtype != torch.float32):  # a bf16/fp16 model: own fp32 master
                target = None
            values = None if master_io is not None else self.params.master_init(i, fp32_copies)  # None: the partition
            self.sub_optimizer.init_master(i, values, storage=target)
        self.params.track_grad_norm(cfg.zeroinf.grad_norm_type)  # stage 3: no re-read of NVMe gradients
        # [Note: overlapped step] (stage3/overlap.py): the step runs behind the next forward
        self._overlap = cfg.zeroinf.overlap_step and self.params.overlaps_step
        # [Note: optimizer in backward] (stage3/in_backward.py): the config allows it with stage 3 only
        self._in_bwd = cfg.zeroinf.optimizer_in_backward
        self.params.attach_optimizer(self.sub_optimizer)  # stage 3: masters follow gathered_parameters writes
        self._names = {p: n for n, p, _f in self._requires_grad}  # for errors that name a parameter
        # [Note: weights changed between steps] (weight_changes.py): stages 0-2 note them from here on
        weight_hooks = self.params.watch_weights(model, self._names)
        del fp32_copies

        if lr_scheduler is None and cfg.scheduler is not None:
            from .lr_schedules import build_scheduler
            lr_scheduler = build_scheduler(cfg.scheduler, optimizer)
        elif callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            lr_scheduler = lr_scheduler(optimizer)
        self.lr_scheduler = lr_scheduler
        # the model's own forward and state_dict, and gathered_parameters, refuse a half-loaded state too
        # [Note: parameters added after initialize]
        self._known_params = {p for _n, p, _f in self._requires_grad}
        self._module_names: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary(
            (m, f"{n}." if n else "") for n, m in model.named_modules())
        self._added: "WeakIdKeyDictionary[torch.nn.Parameter, str]" = WeakIdKeyDictionary()  # by identity
        watch(self)
        self._guard_hooks = [model.register_forward_pre_hook(self.state_guard.forward_pre_hook, prepend=True),
                             model.register_state_dict_pre_hook(self.state_guard.state_dict_pre_hook)]
        self._guard_hooks += weight_hooks  # stages 0-2: a 16-bit parameter's master takes a loaded fp32 value
        take_over_guard_hooks(model, self._guard_hooks)  # an earlier engine's (one never closed) are removed
        self.params.set_state_guard(self.state_guard)

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
        from zeroinf.runtime.stage3.swap_plan import INIT_MASTERS

        by_dev: Dict[int, Dict[str, Any]] = {}
        for key, path, folder, nbytes, what in files:
            problem = dir_problem(path, create=True)  # a real write: permission bits say nothing for root or a read-only mount
            if problem is not None:
                raise ConfigError(key, f"{path!r} {problem}")
            e = by_dev.setdefault(os.stat(path).st_dev, {"key": key, "path": path, "need": 0, "first": 0,
                                                         "folders": set(), "first_folders": set(), "what": [],
                                                         "freed": 0, "masters": 0, "optimizer": 0})
            # [Note: Init masters on disk] stage 3's fp32 initial values (INIT_MASTERS) are written
            # with the partitions and leave as the optimizer's files come: the engine takes a flat
            # group's values (its file goes) before the first of the group's optimizer files is
            # allocated ([Note: swap files on first write] in optimizer.py), and those files hold
            # at least 8 bytes per element to the values' 4. On a file system holding both, the
            # disk holds at most the larger of the two at once, beside the partitions.
            if what == INIT_MASTERS:
                e["masters"] += nbytes
            else:
                e["need"] += nbytes
            if key == "zero_optimization.offload_optimizer.nvme_path":
                e["optimizer"] += nbytes
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
            e["need"] += max(0, e["masters"] - e["optimizer"])  # [Note: Init masters on disk]
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
        hyper_from_client(optimizer)
    engine = ZeroEngine(model, cfg, optimizer, lr_scheduler=lr_scheduler, rank=rank, world_size=world_size)
    if not isinstance(optimizer, ZeroOptimizer):
        hand_over(optimizer)
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
