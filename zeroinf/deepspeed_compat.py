"""The script-level names of DeepSpeed's API that ``import zeroinf as deepspeed`` needs.

A DeepSpeed training script calls ``deepspeed.add_config_arguments(parser)``,
``deepspeed.init_distributed()``, ``deepspeed.initialize(args=..., model=..., config=...)`` and
``deepspeed.zero.Init`` / ``deepspeed.zero.GatheredParameters``; these are those functions over
zeroinf's own (:func:`zeroinf.runtime.engine.initialize`, :class:`zeroinf.Init`,
:func:`zeroinf.gathered_parameters`). ``docs/migrating-from-deepspeed.md`` lists what is the
same, what differs and what is missing.
"""
from __future__ import annotations

import argparse
import os
import types
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

#: DeepSpeed's default rendezvous port (``deepspeed.constants.TORCH_DISTRIBUTED_DEFAULT_PORT``)
DEFAULT_PORT = 29500


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's argument group to ``parser``: ``--deepspeed`` (a flag for the script's own
    use), ``--deepspeed_config PATH`` (read by :func:`initialize` from ``args``) and their
    deprecated spellings ``--deepscale`` / ``--deepscale_config``. Returns ``parser``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (a flag for user code; the engine does not read it)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help="Deprecated: --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated: --deepspeed_config")
    return parser


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = DEFAULT_PORT, verbose: bool = True,
                     timeout: timedelta = timedelta(minutes=30), init_method: Optional[str] = None,
                     dist_init_required: Optional[bool] = None, config: Any = None,
                     rank: int = -1, world_size: int = -1) -> None:
    """Create the default torch.distributed process group, as ``deepspeed.init_distributed``.

    A no-op when one exists. Under a launcher (``torchrun`` sets ``RANK`` and ``WORLD_SIZE``) its
    environment is used; with neither set nor ``rank``/``world_size`` given, a one-process group
    (rank 0 of 1, on an in-memory store: no port is opened). ``dist_backend`` defaults to NCCL
    with CUDA, else gloo. ``auto_mpi_discovery``, ``verbose`` and ``config`` are accepted and
    not read (there is no MPI discovery).

    Raises:
        RuntimeError: ``dist_init_required=False`` while no process group exists (DeepSpeed's
            assertion), or torch.distributed is not available.
    """
    if not dist.is_available():
        raise RuntimeError("zeroinf.init_distributed: torch.distributed is not available in this PyTorch build")
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise RuntimeError("zeroinf.init_distributed: dist_init_required=False but no process group is initialized; "
                           "call torch.distributed.init_process_group first or pass dist_init_required=True")
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    env_world = int(os.environ.get("WORLD_SIZE", "-1"))
    world = world_size if world_size > 0 else env_world
    if world <= 1 and rank <= 0 and init_method is None:  # one process: nothing to rendezvous with
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if init_method is None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
    kwargs = {} if rank < 0 else {"rank": rank}
    if world_size > 0:
        kwargs["world_size"] = world_size
    dist.init_process_group(backend, init_method=init_method, timeout=timeout, **kwargs)


def initialize(args: Any = None, model: Optional[nn.Module] = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port: int = DEFAULT_PORT, mpu: Any = None,
               dist_init_required: Optional[bool] = None, collate_fn=None, config: Any = None,
               mesh_param: Any = None, config_params: Any = None):
    """``deepspeed.initialize``'s signature over :func:`zeroinf.runtime.engine.initialize`.

    The config comes from ``config``, else ``config_params`` (DeepSpeed's older name), else
    ``args.deepspeed_config`` (``args.deepscale_config``, deprecated); a positional module as the
    first argument is taken as ``model`` (zeroinf's own ``initialize(model, ...)``). When
    ``dist_init_required`` is True a process group is created (:func:`init_distributed`); when
    None, one is created under a launcher only (``WORLD_SIZE`` > 1), as zeroinf does without it.

    Returns:
        ``(engine, optimizer, dataloader_or_None, lr_scheduler)``.

    Raises:
        ValueError: no model, no config, or a config both in ``args`` and in ``config`` (named).
        NotImplementedError: ``mpu`` or ``mesh_param`` given (no model or sequence parallelism).
        zeroinf.config.ConfigError and the errors of :func:`zeroinf.runtime.engine.initialize`.
    """
    if isinstance(args, nn.Module) and model is None:
        args, model = None, args
    if model is None:
        raise ValueError("zeroinf.initialize: model is required")
    if mpu is not None or mesh_param is not None:
        raise NotImplementedError("zeroinf.initialize: mpu / mesh_param (model or sequence parallelism) are not "
                                  "supported; zeroinf is data parallel only")
    if config is None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None:
        if config is not None:
            raise ValueError("zeroinf.initialize: a config was given both in args.deepspeed_config "
                             f"({from_args!r}) and as config=/config_params=; give one")
        config = from_args
    if config is None:
        raise ValueError("zeroinf.initialize: no config: pass config= (a dict or JSON path) or "
                         "args with --deepspeed_config (deepspeed.add_config_arguments)")
    if dist_init_required:
        init_distributed(distributed_port=distributed_port)
    from zeroinf.runtime.engine import initialize as _initialize
    return _initialize(model, optimizer=optimizer, model_parameters=model_parameters, lr_scheduler=lr_scheduler,
                       config=config, training_data=training_data, collate_fn=collate_fn)


class _ZeroNamespace(types.ModuleType):
    """``deepspeed.zero``: :meth:`Init` and :meth:`GatheredParameters`."""

    @staticmethod
    def Init(module: Optional[nn.Module] = None, data_parallel_group: Any = None,
             mem_efficient_linear: bool = True, remote_device: Optional[str] = None, pin_memory: bool = False,
             config_dict_or_path: Any = None, config: Any = None, enabled: bool = True, dtype=None,
             mpu: Any = None, **kwargs):
        """``deepspeed.zero.Init``: :class:`zeroinf.Init` with the config from
        ``config_dict_or_path`` or ``config``. Parameters wait where the config's
        ``offload_param`` says (host memory without one); ``remote_device``, ``pin_memory``,
        ``mem_efficient_linear`` and ``data_parallel_group`` (the default group) are not read.

        Raises:
            NotImplementedError: ``module`` (partitioning a built model), ``mpu``, ``dtype``
                or another DeepSpeed keyword is given.
        """
        from zeroinf.runtime.stage3 import Init as _Init
        if module is not None:
            raise NotImplementedError("zero.Init(module=...): partitioning an already built model is not supported; "
                                      "build it inside `with zero.Init(...)` or give it to initialize() as it is")
        if mpu is not None or dtype is not None or kwargs:
            named = ["mpu"] * (mpu is not None) + ["dtype"] * (dtype is not None) + sorted(kwargs)
            raise NotImplementedError(f"zero.Init: {', '.join(named)} not supported")
        return _Init(config_dict_or_path if config_dict_or_path is not None else config, enabled=enabled)

    @staticmethod
    def GatheredParameters(params, modifier_rank: Optional[int] = None, fwd_module: Any = None,
                           enabled: bool = True):
        """``deepspeed.zero.GatheredParameters``: :func:`zeroinf.gathered_parameters`;
        ``enabled=False`` is a no-op block, ``fwd_module`` is not read (no forward hooks are
        registered on it)."""
        import contextlib
        from zeroinf.runtime.stage3 import gathered_parameters
        if not enabled:
            return contextlib.nullcontext()
        return gathered_parameters(params, modifier_rank=modifier_rank)


zero = _ZeroNamespace("zeroinf.zero", _ZeroNamespace.__doc__)
