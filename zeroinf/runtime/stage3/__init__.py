"""ZeRO stage 3: parameters partitioned over ranks and tiers, gathered just in time.

* :class:`Stage3ParameterManager` — units, partitions, gather/release hooks, prefetch, stats.
* :func:`engine_manager` — the manager behind ``ZeroEngine``'s parameter-manager seam.
* :class:`Stage3EngineParams` — the engine's stage interface; the engine's one optimizer-step
  driver (``engine_step.py``) steps the partitions through it.
* :func:`gathered_parameters` — full parameters for inspection and init (``zeroinf.gathered_parameters``).
* :class:`Init` — partition parameters while modules are built (``zeroinf.Init``).
* :func:`load_safetensors` — stream pretrained weights into the partitions.
"""
from .api import gathered_parameters, load_safetensors
from .engine_glue import Stage3EngineParams, engine_manager
from .init import Init
from .manager import Stage3ParameterManager
from .options import Stage3ConfigError, Stage3Options

__all__ = ["Stage3ParameterManager", "Stage3Options", "Stage3ConfigError", "Stage3EngineParams",
           "engine_manager", "gathered_parameters", "Init", "load_safetensors"]
