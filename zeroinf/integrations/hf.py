"""zeroinf as the ZeRO engine of Hugging Face ``transformers.Trainer`` and Accelerate.

One line before the ``Trainer`` is built::

    import zeroinf.integrations.hf; zeroinf.integrations.hf.enable()
    args = TrainingArguments(..., deepspeed=ds_config)   # a DeepSpeed-format dict or JSON path

The Trainer's DeepSpeed path is unchanged: transformers resolves the config's ``"auto"`` values
from the ``TrainingArguments`` (``HfTrainerDeepSpeedConfig.trainer_config_process`` and
``trainer_config_finalize``), and Accelerate builds the engine with ``deepspeed.initialize``. That
name, inside the two calls that build the engine (``Accelerator._prepare_deepspeed`` and
transformers' ``deepspeed_init``), is :data:`shim`, a module named ``deepspeed`` whose
``initialize`` is zeroinf's; so it is inside ``PreTrainedModel.from_pretrained``, ``_from_config``
and ``resize_token_embeddings``, which at ZeRO-3 build the model under ``deepspeed.zero.Init``
(:class:`zeroinf.Init`) and load weights through ``deepspeed.zero.GatheredParameters`` (streamed
module by module: :mod:`.hf_load`). Everywhere else ``deepspeed`` stays what it is (the real
package when installed). Without DeepSpeed installed, :data:`shim` stands in for it for good, with
package metadata (``importlib.metadata``) so the two libraries' ``is_deepspeed_available`` answer
True; then ``enable()`` must run before transformers is imported (transformers decides at import
whether its DeepSpeed integration exists; a later ``enable()`` raises RuntimeError saying so).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import logging
import sys
import types
from typing import Dict, Iterator

import torch
import torch.distributed as dist

from zeroinf import deepspeed_compat

#: DeepSpeed's scheduler class names (``deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES``), which
#: Accelerate compares a scheduler's class name with
VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]


def _initialize(*args, **kwargs):
    """``deepspeed.initialize`` as DeepSpeed runs it: the process group first (a one-process group
    without a launcher), which the Trainer's loss gathering needs; then :func:`zeroinf.initialize`."""
    deepspeed_compat.init_distributed()
    return deepspeed_compat.initialize(*args, **kwargs)


def _rank() -> int:
    """``deepspeed.comm.get_rank``: this process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    """``deepspeed.comm.get_world_size``: the number of ranks (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class _Accelerator:
    """``deepspeed.accelerator.get_accelerator()``, as far as transformers' ZeRO-3 loading reads
    it: the device tensors are put on (CUDA's current device with CUDA, else the CPU)."""

    def device_name(self, device_index=None) -> str:
        if not torch.cuda.is_available():
            return "cpu"
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"


def _zero_init(*args, **kwargs):
    """``deepspeed.zero.Init`` as DeepSpeed runs it: the process group first (transformers'
    ZeRO-3 loading reads ``torch.distributed.get_rank()``), then :meth:`zeroinf.zero.Init`."""
    deepspeed_compat.init_distributed()
    return deepspeed_compat.zero.Init(*args, **kwargs)


def _cpu_adam(model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
              amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
    """``deepspeed.ops.adam.DeepSpeedCPUAdam(...)``, DeepSpeed's signature: a
    :class:`zeroinf.optim.CPUAdam` (Accelerate puts a torch Adam/AdamW's groups in one when the
    optimizer is offloaded). ``fp32_optimizer_states`` is accepted: CPUAdam keeps fp32 states.

    Raises:
        ValueError: as :class:`zeroinf.optim.CPUAdam` (``amsgrad`` True among them).
    """
    from zeroinf.optim import CPUAdam
    return CPUAdam(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                   adamw_mode=adamw_mode, bias_correction=bias_correction)


def _build_shim() -> Dict[str, types.ModuleType]:
    """The ``deepspeed`` module and its submodules the two libraries import, by name."""
    ds = types.ModuleType("deepspeed", "zeroinf standing in for DeepSpeed (zeroinf.integrations.hf)")
    ds.__version__ = "0.19.8"  # the DeepSpeed release whose API this follows
    ds.__zeroinf_shim__ = True  # how hf_load tells the shim from the real package
    ds.__spec__ = importlib.util.spec_from_loader("deepspeed", loader=None)
    ds.initialize = _initialize
    ds.init_distributed = deepspeed_compat.init_distributed
    ds.add_config_arguments = deepspeed_compat.add_config_arguments
    ds.zero = zero = types.ModuleType("deepspeed.zero")
    zero.Init = _zero_init
    zero.GatheredParameters = deepspeed_compat.zero.GatheredParameters
    from zeroinf.runtime.engine import ZeroEngine
    ds.DeepSpeedEngine = ZeroEngine  # Accelerate unwraps instances of it through .module
    comm = types.ModuleType("deepspeed.comm")
    comm.init_distributed = deepspeed_compat.init_distributed
    comm.get_rank = _rank
    comm.get_world_size = _world_size
    utils = types.ModuleType("deepspeed.utils")
    utils.logger = logging.getLogger("zeroinf")
    accel = types.ModuleType("deepspeed.accelerator")
    accel.get_accelerator = _Accelerator
    ops = types.ModuleType("deepspeed.ops")
    adam = types.ModuleType("deepspeed.ops.adam")
    adam.DeepSpeedCPUAdam = _cpu_adam
    ops.adam = adam
    runtime = types.ModuleType("deepspeed.runtime")
    lr = types.ModuleType("deepspeed.runtime.lr_schedules")
    lr.VALID_LR_SCHEDULES = list(VALID_LR_SCHEDULES)
    rzero = types.ModuleType("deepspeed.runtime.zero")
    rzero.GatheredParameters = zero.GatheredParameters
    rzero.Init = zero.Init
    pp = types.ModuleType("deepspeed.runtime.zero.partition_parameters")
    # transformers' prevent_arange_dtype_change swaps DeepSpeed's constructor wrapper for one that
    # leaves torch.arange's dtype alone; zeroinf.Init wraps no tensor constructor, so these two
    # names only have to exist
    pp._orig_torch_arange = torch.arange
    pp.zero_wrapper_for_fp_tensor_constructor = lambda fn, *args, **kwargs: fn
    ds.comm, ds.utils, ds.accelerator, ds.ops, ds.runtime, runtime.lr_schedules = comm, utils, accel, ops, runtime, lr
    runtime.zero, rzero.partition_parameters = rzero, pp
    return {"deepspeed": ds, "deepspeed.comm": comm, "deepspeed.utils": utils, "deepspeed.accelerator": accel,
            "deepspeed.ops": ops, "deepspeed.ops.adam": adam,
            "deepspeed.runtime": runtime, "deepspeed.runtime.lr_schedules": lr, "deepspeed.runtime.zero": rzero,
            "deepspeed.runtime.zero.partition_parameters": pp}


class _ShimDistribution(importlib.metadata.Distribution):
    """The package metadata of :data:`shim` (name ``deepspeed``, its ``__version__``), which both
    libraries' ``is_deepspeed_available`` and version checks read."""

    def read_text(self, filename):
        if filename == "METADATA":
            return (f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {shim.__version__}\n"
                    "Summary: zeroinf standing in for DeepSpeed\n")
        return None

    def locate_file(self, path):
        return path


class _ShimFinder(importlib.abc.MetaPathFinder):
    """Answers ``importlib.metadata`` for ``deepspeed`` with :class:`_ShimDistribution`; finds
    no modules (the shim's are in ``sys.modules``)."""

    def find_spec(self, fullname, path, target=None):
        return None

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        if context.name is not None and context.name.replace("-", "_").lower() == "deepspeed":
            yield _ShimDistribution()


_SHIM = _build_shim()
#: the stand-in ``deepspeed`` module
shim = _SHIM["deepspeed"]
_enabled = False


@contextlib.contextmanager
def _shim_in_place() -> Iterator[None]:
    """``import deepspeed`` (and its submodules above) give :data:`shim` inside the block."""
    old = {k: sys.modules.get(k) for k in _SHIM}
    sys.modules.update(_SHIM)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def _with_shim(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with _shim_in_place():
            return fn(*args, **kwargs)
    wrapped.__zeroinf_wrapped__ = fn
    return wrapped


def _unwrapping_engine(fn):
    """``Accelerator.unwrap_model`` that unwraps a zeroinf engine to its model (DeepSpeed's engine
    is a ``torch.nn.Module`` Accelerate unwraps through ``.module``; zeroinf's is not a module)."""
    from zeroinf.runtime.engine import ZeroEngine

    @functools.wraps(fn)
    def unwrap_model(self, model, *args, **kwargs):
        if isinstance(model, ZeroEngine):
            model = model.module
        return fn(self, model, *args, **kwargs)
    return unwrap_model


def _state_dict_of_engine(fn):
    """``Accelerator.get_state_dict`` that answers for a zeroinf engine with its full state dict
    (:meth:`ZeroEngine.module_state_dict`: at stage 3 gathered, collective), as copies."""
    from zeroinf.runtime.engine import ZeroEngine

    @functools.wraps(fn)
    def get_state_dict(self, model, *args, **kwargs):
        if isinstance(model, ZeroEngine):
            return {k: v.detach().clone() for k, v in model.module_state_dict().items()}
        return fn(self, model, *args, **kwargs)
    return get_state_dict


def _deepspeed_installed() -> bool:
    mod = sys.modules.get("deepspeed")
    if mod is shim:
        return False
    try:
        return importlib.util.find_spec("deepspeed") is not None
    except (ImportError, ValueError):
        return False


def enable() -> None:
    """Make ``transformers.Trainer`` (``TrainingArguments(deepspeed=...)``) and Accelerate's
    DeepSpeed plugin build a zeroinf engine. Idempotent; call it before the Trainer or
    Accelerator is built.

    Raises:
        ImportError: transformers or accelerate is not installed.
    """
    global _enabled
    if _enabled:
        return
    if not _deepspeed_installed():
        hf_ds = sys.modules.get("transformers.integrations.deepspeed")
        if hf_ds is not None and hf_ds.DeepSpeedConfig is object:
            raise RuntimeError("zeroinf.integrations.hf.enable(): transformers' DeepSpeed integration was imported "
                               "before enable() while DeepSpeed is not installed, and has disabled itself; call "
                               "enable() before importing transformers (or anything that imports it)")
        sys.modules.update(_SHIM)
        sys.meta_path.insert(0, _ShimFinder())
    import accelerate.accelerator
    import transformers.integrations.deepspeed as hf_ds
    import transformers.trainer
    accelerate.accelerator.Accelerator._prepare_deepspeed = _with_shim(
        accelerate.accelerator.Accelerator._prepare_deepspeed)
    for mod in (transformers.trainer, hf_ds):
        mod.deepspeed_init = _with_shim(hf_ds.deepspeed_init.__dict__.get("__zeroinf_wrapped__", hf_ds.deepspeed_init))
    import transformers.modeling_utils as mu
    from zeroinf.integrations import hf_load
    model_cls = mu.PreTrainedModel  # builds models under deepspeed.zero.Init at ZeRO-3
    for name in ("from_pretrained", "_from_config", "resize_token_embeddings"):
        attr = model_cls.__dict__[name]
        if isinstance(attr, classmethod):
            if not hasattr(attr.__func__, "__zeroinf_wrapped__"):
                setattr(model_cls, name, classmethod(_with_shim(attr.__func__)))
        elif not hasattr(attr, "__zeroinf_wrapped__"):
            setattr(model_cls, name, _with_shim(attr))
    hf_load.install()
    acc = accelerate.accelerator.Accelerator
    acc.unwrap_model = _unwrapping_engine(acc.unwrap_model)
    acc.get_state_dict = _state_dict_of_engine(acc.get_state_dict)
    _enabled = True
