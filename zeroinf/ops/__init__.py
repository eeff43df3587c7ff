"""Op loading: prebuilt (AOT) or JIT-built C++ extensions, with a declared pure-PyTorch fallback."""
from .loader import (OpBuildError, OpUnavailableError, cache_dir, load_op, op_status, ops_disabled,
                     try_load_op)
from .specs import OPS

__all__ = ["OPS", "OpBuildError", "OpUnavailableError", "cache_dir", "load_op", "op_status",
           "ops_disabled", "try_load_op"]
