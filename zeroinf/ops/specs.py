"""Declarations of the C++ ops: sources and flags, with no import of torch.

This module is read by ``setup.py`` (AOT build, ``ZEROINF_BUILD_OPS=1``) and by
``zeroinf.ops.loader`` (JIT build), so both paths compile the same sources with the same
flags. It must stay importable without torch and without the ``zeroinf`` package.

Flags policy: no ``-march=native``. Wide SIMD paths are compiled with per-function
``__attribute__((target(...)))`` in the kernel sources and chosen at run time by cpuid, so a
binary built on one x86-64 machine runs on any other.
"""
from __future__ import annotations

import ctypes.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Tuple

#: Root of the C++ sources: ``<repo>/csrc`` in a checkout, ``zeroinf/csrc`` in an installed
#: wheel (setup.py copies them there as package data so a wheel can still JIT-build).
_PKG_DIR = Path(__file__).resolve().parent.parent


def csrc_root() -> Path:
    """Directory holding the op folders (``adam/``, ``aio/``, ...).

    Raises:
        FileNotFoundError: neither the checkout's ``csrc/`` nor the packaged copy exists.
    """
    for cand in (_PKG_DIR.parent / "csrc", _PKG_DIR / "csrc"):
        if cand.is_dir():
            return cand
    raise FileNotFoundError(f"zeroinf C++ sources not found next to {_PKG_DIR}")


@dataclass(frozen=True)
class OpSpec:
    """One C++ op: its sources (relative to ``csrc/``) and its compiler/linker flags.

    ``configure`` is an optional probe run at build time; it returns extra
    ``(cflags, ldflags, notes)`` — e.g. the aio op adds ``-laio`` only when libaio is found and
    otherwise ``-DZEROINF_NO_LIBAIO`` plus a note saying why.
    """

    name: str
    sources: Tuple[str, ...]
    cflags: Tuple[str, ...] = ("-O3", "-std=c++17", "-fopenmp")
    ldflags: Tuple[str, ...] = ("-fopenmp",)
    configure: Callable[[], Tuple[List[str], List[str], List[str]]] | None = field(default=None, compare=False)
    #: True for an op with ``.cu`` sources: built (JIT or AOT) only where :func:`cuda_blockers`
    #: is empty, with ``cuda_cflags`` passed to nvcc and ``TORCH_CUDA_ARCH_LIST`` honoured by torch.
    cuda: bool = False
    cuda_cflags: Tuple[str, ...] = ()

    def flags(self) -> Tuple[List[str], List[str], List[str]]:
        """Return ``(cflags, ldflags, notes)`` including the probe's and ``ZEROINF_EXTRA_CFLAGS``."""
        cflags, ldflags, notes = list(self.cflags), list(self.ldflags), []
        if self.configure is not None:
            c, l, n = self.configure()
            cflags += c
            ldflags += l
            notes += n
        extra = os.environ.get("ZEROINF_EXTRA_CFLAGS", "").split()
        cflags += extra
        return cflags, ldflags, notes

    def source_paths(self) -> List[Path]:
        root = csrc_root()
        return [root / s for s in self.sources]


def _libaio_probe() -> Tuple[List[str], List[str], List[str]]:
    """Link against libaio when both its header and library are present."""
    header = any(Path(d, "libaio.h").exists() for d in ("/usr/include", "/usr/local/include"))
    lib = ctypes.util.find_library("aio")
    if header and lib:
        return [], ["-laio"], []
    why = []
    if not header:
        why.append("libaio.h not found (install libaio-dev)")
    if not lib:
        why.append("libaio.so not found (install libaio1/libaio-dev)")
    return ["-DZEROINF_NO_LIBAIO"], [], ["libaio backend not built: " + "; ".join(why)]


def cuda_blockers(aot: bool = False, need_nvcc: bool = True) -> List[str]:
    """Reasons a CUDA op cannot be built (or, with ``need_nvcc=False``, used) here; empty if none.

    JIT (``aot=False``, at first use): torch must be a CUDA build (``torch.version.cuda`` set), a
    CUDA device must be visible and nvcc must be found (not needed to load an AOT-built op:
    ``need_nvcc=False``). AOT (``aot=True``, ``ZEROINF_BUILD_OPS=1``): a CUDA build of torch and
    nvcc, plus either a visible device or an explicit ``TORCH_CUDA_ARCH_LIST`` (an image build has
    no GPU, so it must name its targets).

    Imports torch lazily, so this module stays importable without it.
    """
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:
        return ["torch is not installed"]
    why = []
    if torch.version.cuda is None:
        why.append(f"torch {torch.__version__} is not a CUDA build (torch.version.cuda is None)")
    elif need_nvcc and CUDA_HOME is None:
        why.append("the CUDA toolkit (nvcc) was not found; set CUDA_HOME")
    has_device = torch.version.cuda is not None and torch.cuda.is_available()
    if not has_device and not (aot and os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()):
        why.append("no CUDA device is visible" + (" and TORCH_CUDA_ARCH_LIST is not set" if aot else ""))
    return why


# The registry: one entry per folder under csrc/. Kernels and bindings are separate files.
OPS = {
    "adam": OpSpec(
        name="adam",
        sources=("adam/cpu_adam.cpp", "adam/bindings.cpp"),
        # -ffp-contract=off: no fused multiply-add contraction, so the AVX-512, AVX2 and scalar
        # paths round identically (tests compare them bit for bit).
        cflags=("-O3", "-std=c++17", "-fopenmp", "-ffp-contract=off"),
        ldflags=("-fopenmp", "-ldl"),  # -ldl: limit_thread_parallelism looks up torch's MKL
    ),
    "aio": OpSpec(
        name="aio",
        sources=("aio/aio_handle.cpp", "aio/crc32c.cpp", "aio/bindings.cpp"),
        cflags=("-O3", "-std=c++17"),
        ldflags=("-lpthread",),
        configure=_libaio_probe,
    ),
    # GPU kernels (the fused gradient-bucket pass); zeroinf/ops/cuda_grad.py is their Python face
    # and torch fallback. Never compiled where cuda_blockers() has reasons (e.g. CPU-only torch).
    "cuda": OpSpec(
        name="cuda",
        sources=("cuda/grad_bucket.cu", "cuda/bindings.cpp"),
        cflags=("-O3", "-std=c++17"),
        ldflags=(),
        cuda=True,
        cuda_cflags=("-O3", "-std=c++17"),
    ),
}
