"""zeroinf: a ZeRO-Infinity offload engine for PyTorch.

Layers (bottom up): ``zeroinf.ops`` (C++ op loading), ``zeroinf.optim`` (CPUAdam),
``zeroinf.io`` (async NVMe I/O, pinned buffers, tensor swapping), ``zeroinf.runtime``
(ZeRO partitioning, tiering, prefetch, engine), ``zeroinf.config`` (DeepSpeed-compatible config),
``zeroinf.checkpoint``, and the memory model (``zeroinf.estimate``, ``zeroinf.placement``,
``zeroinf.memcheck``). The command-line apps are ``zeroinf.cli``, which the library never imports.
"""
__version__ = "0.1.0"


#: subpackages and modules reachable as attributes of ``zeroinf`` without their own import
#: (``zeroinf.checkpoint.consolidate(...)`` in a fresh process), imported on first access
_SUBMODULES = ("checkpoint", "config", "io", "ops", "optim", "runtime")
#: DeepSpeed's script-level names, so ``import zeroinf as deepspeed`` carries a DeepSpeed script
_DEEPSPEED_NAMES = ("initialize", "add_config_arguments", "init_distributed", "zero")


def __getattr__(name):
    """Lazy exports (so ``import zeroinf`` stays light): ``zeroinf.initialize(model, optimizer=None,
    model_parameters=None, lr_scheduler=None, config=None, training_data=None)`` →
    ``(engine, optimizer, dataloader_or_None, lr_scheduler)``, like ``deepspeed.initialize``, whose
    signature it also takes (:func:`zeroinf.deepspeed_compat.initialize`, over
    :func:`zeroinf.runtime.engine.initialize`); the stage-3 names ``zeroinf.gathered_parameters`` and ``zeroinf.Init``
    (see :mod:`zeroinf.runtime.stage3`); DeepSpeed's ``add_config_arguments``, ``init_distributed``
    and ``zero`` (``zero.Init``, ``zero.GatheredParameters``: :mod:`zeroinf.deepspeed_compat`); ``zeroinf.InsufficientMemoryError``, which ``initialize``
    raises for a config that needs more memory or disk than is free (see :mod:`zeroinf.memcheck`);
    and the submodules of :data:`_SUBMODULES`."""
    if name in ("gathered_parameters", "Init"):
        from zeroinf.runtime import stage3
        return getattr(stage3, name)
    if name in _DEEPSPEED_NAMES:
        from zeroinf import deepspeed_compat
        return getattr(deepspeed_compat, name)
    if name == "InsufficientMemoryError":
        from zeroinf.memcheck import InsufficientMemoryError
        return InsufficientMemoryError
    if name in _SUBMODULES:
        import importlib
        return importlib.import_module(f"zeroinf.{name}")
    raise AttributeError(f"module 'zeroinf' has no attribute {name!r}")
