"""zeroinf: a ZeRO-Infinity offload engine for PyTorch.

Layers (bottom up): ``zeroinf.ops`` (C++ op loading), ``zeroinf.optim`` (CPUAdam),
``zeroinf.io`` (async NVMe I/O, pinned buffers, tensor swapping), ``zeroinf.runtime``
(ZeRO partitioning, tiering, prefetch, engine), ``zeroinf.config`` (DeepSpeed-compatible config),
``zeroinf.checkpoint``, and the memory model (``zeroinf.estimate``, ``zeroinf.placement``,
``zeroinf.memcheck``). The command-line apps are ``zeroinf.cli``, which the library never imports.
"""
__version__ = "0.1.0"


def initialize(*args, **kwargs):
    """``zeroinf.initialize(model, optimizer=None, model_parameters=None, lr_scheduler=None,
    config=None, training_data=None)`` → ``(engine, optimizer, dataloader_or_None, lr_scheduler)``,
    like ``deepspeed.initialize``; see :func:`zeroinf.runtime.engine.initialize`. Imported lazily so
    ``import zeroinf`` stays light."""
    from zeroinf.runtime.engine import initialize as _initialize
    return _initialize(*args, **kwargs)


#: subpackages and modules reachable as attributes of ``zeroinf`` without their own import
#: (``zeroinf.checkpoint.consolidate(...)`` in a fresh process), imported on first access
_SUBMODULES = ("checkpoint", "config", "io", "ops", "optim", "runtime")


def __getattr__(name):
    """Lazy exports: the stage-3 names ``zeroinf.gathered_parameters`` and ``zeroinf.Init``
    (see :mod:`zeroinf.runtime.stage3`); ``zeroinf.InsufficientMemoryError``, which ``initialize``
    raises for a config that needs more memory or disk than is free (see :mod:`zeroinf.memcheck`);
    and the submodules of :data:`_SUBMODULES`."""
    if name in ("gathered_parameters", "Init"):
        from zeroinf.runtime import stage3
        return getattr(stage3, name)
    if name == "InsufficientMemoryError":
        from zeroinf.memcheck import InsufficientMemoryError
        return InsufficientMemoryError
    if name in _SUBMODULES:
        import importlib
        return importlib.import_module(f"zeroinf.{name}")
    raise AttributeError(f"module 'zeroinf' has no attribute {name!r}")
