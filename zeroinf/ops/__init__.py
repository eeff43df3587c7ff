"""Op loading: prebuilt (AOT) or JIT-built C++ extensions, with a declared pure-PyTorch fallback.

DeepSpeed's op entry points are here too: :mod:`.op_builder` (``CPUAdamBuilder``,
``AsyncIOBuilder``), :mod:`.adam` (``DeepSpeedCPUAdam``) and ``__compatible_ops__``.
"""
from .loader import (OpBuildError, OpUnavailableError, cache_dir, load_op, op_status, ops_disabled,
                     try_load_op)
from .op_builder import compatible_ops
from .specs import OPS

#: DeepSpeed's ``deepspeed.ops.__compatible_ops__``: op name -> whether it loads here.
__compatible_ops__ = compatible_ops()

__all__ = ["OPS", "OpBuildError", "OpUnavailableError", "cache_dir", "load_op", "op_status",
           "ops_disabled", "try_load_op"]


def __getattr__(name):
    """``zeroinf.ops.adam`` without its own import (as ``deepspeed.ops.adam``), imported on first
    access so that loading the op machinery does not import the optimizers."""
    if name == "adam":
        import importlib
        return importlib.import_module("zeroinf.ops.adam")
    raise AttributeError(f"module 'zeroinf.ops' has no attribute {name!r}")
