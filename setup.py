"""Build script. One get_extensions(), driven by these flags (highest first):

  ZEROINF_BUILD_OPS=1   compile every op in zeroinf/ops/specs.py into the package as
                        zeroinf._ops_<name> (needs torch already installed, so install with
                        `pip install --no-build-isolation .`). Unset: no C++ is compiled at
                        install time; ops are JIT-built on first use (see zeroinf/ops/loader.py).
                        CUDA ops (spec.cuda) are skipped, with a note, unless torch is a CUDA
                        build, nvcc is found, and a GPU is visible or TORCH_CUDA_ARCH_LIST is set
                        (specs.cuda_blockers(aot=True)); TORCH_CUDA_ARCH_LIST picks the targets.
  DEBUG=1               with ZEROINF_BUILD_OPS, compile with -O0 -g instead of -O3.
  MAX_JOBS              parallel compile jobs (default: from cores and free RAM).
"""
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def _truthy(name):
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _load_specs():
    # zeroinf/ops/specs.py imports nothing from torch or zeroinf, so it can be read here.
    spec = importlib.util.spec_from_file_location("_zeroinf_specs", ROOT / "zeroinf" / "ops" / "specs.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolves string annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def get_extensions():
    """C++ extensions to build: all ops under ZEROINF_BUILD_OPS=1, else none."""
    if not _truthy("ZEROINF_BUILD_OPS"):
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
    except ImportError as exc:
        raise SystemExit(
            "ZEROINF_BUILD_OPS=1 needs torch installed before the build: "
            "pip install torch && ZEROINF_BUILD_OPS=1 pip install --no-build-isolation .") from exc
    specs = _load_specs()
    exts = []
    for name, op in specs.OPS.items():
        blockers = specs.cuda_blockers(aot=True) if op.cuda else []
        if blockers:
            print(f"zeroinf: CUDA op {name} not built: " + "; ".join(blockers))
            continue
        cflags, ldflags, notes = op.flags()
        for note in notes:
            print(f"zeroinf: {note}")
        if _truthy("DEBUG"):
            cflags = [f for f in cflags if not f.startswith("-O")] + ["-O0", "-g"]
        ext_class = CUDAExtension if op.cuda else CppExtension
        exts.append(ext_class(
            name=f"zeroinf._ops_{name}",
            sources=[str(p.relative_to(ROOT)) for p in op.source_paths()],
            include_dirs=[str(ROOT / "csrc" / "includes"), str(ROOT / "csrc" / name)],
            extra_compile_args={"cxx": cflags, "nvcc": list(op.cuda_cflags)} if op.cuda else cflags,
            extra_link_args=ldflags,
        ))
    (ROOT / "zeroinf" / "_build_info.json").write_text(json.dumps({"torch": torch.__version__}))
    if "MAX_JOBS" not in os.environ:
        os.environ["MAX_JOBS"] = str(max(1, os.cpu_count() or 1))
    return exts, {"build_ext": BuildExtension.with_options(use_ninja=True)}


def _package_csrc():
    """Copy csrc/ into the package so a wheel without AOT ops can still JIT-build them."""
    dst = ROOT / "zeroinf" / "csrc"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(ROOT / "csrc", dst)


ext_modules, cmdclass = get_extensions()
_package_csrc()

setup(
    name="zeroinf",
    version="0.1.0",
    description="ZeRO-Infinity offload engine for PyTorch: CPU Adam, async NVMe I/O, ZeRO stages 1-3",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["zeroinf", "zeroinf.*"]),
    # An explicit root makes an editable install a plain path entry, not an import hook: a folder
    # named zeroinf/ in the working directory (the clone, seen from its parent) is then only a
    # namespace candidate, and the regular package behind the path entry wins over it.
    package_dir={"": "."},
    package_data={"zeroinf": ["csrc/**/*", "presets/*.json", "_build_info.json"]},
    install_requires=["torch>=2.4", "numpy", "psutil", "ninja", "pybind11", "tqdm"],
    extras_require={
        "train": ["transformers>=4.40", "safetensors", "matplotlib"],
        "test": ["pytest", "py-cpuinfo", "transformers>=4.40", "accelerate>=1.0", "safetensors", "matplotlib", "hjson"],
    },
    entry_points={"console_scripts": ["zeroinf=zeroinf.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
