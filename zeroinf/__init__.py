"""zeroinf: a ZeRO-Infinity offload engine for PyTorch.

Layers (bottom up): ``zeroinf.ops`` (C++ op loading), ``zeroinf.optim`` (CPUAdam),
``zeroinf.io`` (async NVMe I/O, pinned buffers, tensor swapping), ``zeroinf.runtime``
(ZeRO partitioning, tiering, prefetch, engine), ``zeroinf.config`` (DeepSpeed-compatible config).
"""
__version__ = "0.1.0"
