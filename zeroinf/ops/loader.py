"""Load the C++ ops: an AOT-built module if installed, else a JIT build cached on disk.

Flag hierarchy (highest first):

* ``ZEROINF_DISABLE_OPS=1`` — never load or build a C++ op; callers use their pure-PyTorch
  implementation (same numbers, slower) after one warning.
* ``ZEROINF_FORCE_JIT=1`` — ignore an AOT-built module and JIT-build instead.
* ``ZEROINF_BUILD_OPS=1`` (install time only, read by ``setup.py``) — compile every op into the
  wheel as ``zeroinf._ops_<name>``.
* ``ZEROINF_CACHE`` — JIT cache directory (default ``~/.cache/zeroinf``). Each build lives in
  ``<cache>/<op>/<key>/`` where ``key`` hashes the sources, flags, torch version, Python version
  and compiler version, so a change in any of them rebuilds instead of loading a stale binary.
* ``ZEROINF_EXTRA_CFLAGS`` — extra compiler flags (part of the key); ``CXX`` picks the compiler.

A JIT build takes an exclusive ``fcntl`` lock on ``<cache>/<op>/<key>.lock`` so that several
ranks starting at once compile once and the others load the result.

A build that fails raises :class:`OpBuildError` at the moment the op is first needed — naming
the op, the compiler command and the first compiler error line — never a later
``AttributeError``.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Dict, Optional

from ..progress import ticking
from .specs import OPS, OpSpec, csrc_root, cuda_blockers

__all__ = [
    "OpBuildError",
    "OpUnavailableError",
    "load_op",
    "try_load_op",
    "op_status",
    "ops_disabled",
    "cache_dir",
]


class OpUnavailableError(RuntimeError):
    """The op cannot be used here at all (ops disabled, no C++ compiler, an op cache that cannot be
    written); a fallback may run."""


class OpBuildError(RuntimeError):
    """Compiling or importing a C++ op failed.

    Attributes:
        op: op name (``"adam"``, ``"aio"``).
        command: the compiler command line ninja ran (or ``""`` if unknown).
        first_error: the first line of the compiler output that reports an error.
        log: the full build output.
    """

    def __init__(self, op: str, command: str, first_error: str, log: str):
        self.op, self.command, self.first_error, self.log = op, command, first_error, log
        super().__init__(
            f"zeroinf op '{op}' failed to build.\n"
            f"  first error: {first_error}\n"
            f"  compiler command: {command or '(unknown)'}\n"
            f"Set ZEROINF_DISABLE_OPS=1 to use the slower pure-PyTorch implementation instead."
        )


def ops_disabled() -> bool:
    """True when ``ZEROINF_DISABLE_OPS`` is set to a true value (1/true/yes)."""
    return os.environ.get("ZEROINF_DISABLE_OPS", "").strip().lower() in ("1", "true", "yes", "on")


def cache_dir() -> Path:
    """JIT cache root: ``$ZEROINF_CACHE`` or ``~/.cache/zeroinf``."""
    env = os.environ.get("ZEROINF_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "zeroinf"


def _compiler() -> Optional[str]:
    return shutil.which(os.environ.get("CXX", "c++"))


@functools.lru_cache(maxsize=None)
def _compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"
    return out.splitlines()[0] if out else "unknown"


def _build_key(spec: OpSpec, cflags, ldflags, cxx: str) -> str:
    import torch

    h = hashlib.sha256()
    op_dir = csrc_root() / spec.name
    files = set(spec.source_paths())
    for pattern in ("*.h", "*.hpp"):
        files.update(op_dir.glob(pattern))
    inc = csrc_root() / "includes"
    if inc.is_dir():
        files.update(inc.glob("*.h"))
    for f in sorted(files):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    # torch's build.ninja names the sources and include folders by absolute path: two checkouts
    # (or installs) of the same sources sharing one cache would rebuild each other's op on every
    # process start if they shared a build folder
    h.update(str(csrc_root().resolve()).encode())
    for part in (cflags, ldflags, [torch.__version__, sys.version, _compiler_version(cxx)]):
        h.update(json.dumps(list(part)).encode())
    if spec.cuda:
        cuda_part = [list(spec.cuda_cflags), torch.version.cuda, os.environ.get("TORCH_CUDA_ARCH_LIST", "")]
        h.update(json.dumps(cuda_part).encode())
    return h.hexdigest()[:16]


def _prebuilt(name: str) -> Optional[ModuleType]:
    """Import ``zeroinf._ops_<name>`` built by ``ZEROINF_BUILD_OPS=1 pip install``, if present."""
    if os.environ.get("ZEROINF_FORCE_JIT", "") in ("1", "true"):
        return None
    info_path = Path(__file__).resolve().parent.parent / "_build_info.json"
    if importlib.util.find_spec(f"zeroinf._ops_{name}") is None:
        return None
    import torch

    if info_path.exists():
        built_for = json.loads(info_path.read_text()).get("torch")
        if built_for and built_for != torch.__version__:
            raise OpBuildError(
                name, "", f"the installed ops were built for torch {built_for}, you have "
                f"torch {torch.__version__}; reinstall zeroinf or set ZEROINF_FORCE_JIT=1", "")
    return importlib.import_module(f"zeroinf._ops_{name}")


def _has_prebuilt(name: str) -> bool:
    """True when an AOT-built ``zeroinf._ops_<name>`` is installed and ``ZEROINF_FORCE_JIT`` is unset."""
    forced = os.environ.get("ZEROINF_FORCE_JIT", "") in ("1", "true")
    return not forced and importlib.util.find_spec(f"zeroinf._ops_{name}") is not None


def _first_error_line(log: str) -> str:
    for line in log.splitlines():
        if re.search(r"\b(fatal )?error\b", line, re.IGNORECASE) and "ninja: build stopped" not in line:
            return line.strip()
    lines = [l for l in log.splitlines() if l.strip()]
    return lines[-1].strip() if lines else "(no compiler output)"


def _compile_command(build_dir: Path) -> str:
    ninja = build_dir / "build.ninja"
    if not ninja.exists():
        return ""
    text = ninja.read_text()
    m = re.search(r"^rule compile\n\s+command = (.*)$", text, re.MULTILINE)
    if not m:
        return ""
    cmd = m.group(1)
    for var in ("cxx", "cflags", "post_cflags"):
        vm = re.search(rf"^{var} = (.*)$", text, re.MULTILINE)
        cmd = cmd.replace(f"${var}", vm.group(1) if vm else "")
    return re.sub(r"\s+", " ", cmd).strip()


_lock = threading.Lock()
_loaded: Dict[str, ModuleType] = {}
_warned: set = set()
_failed: Dict[str, "OpBuildError"] = {}  # build folder -> its build's error in this process


def _jit_build(spec: OpSpec) -> ModuleType:
    cxx = _compiler()
    if cxx is None:
        raise OpUnavailableError(f"no C++ compiler found (looked for {os.environ.get('CXX', 'c++')!r})")
    from torch.utils import cpp_extension

    cflags, ldflags, _notes = spec.flags()
    key = _build_key(spec, cflags, ldflags, cxx)
    build_dir = cache_dir() / spec.name / key
    lock_path = cache_dir() / spec.name / f"{key}.lock"
    if str(build_dir) in _failed:  # this process tried and failed already (see below)
        raise _failed[str(build_dir)]
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        lock_file = open(lock_path, "w")
    except OSError as exc:  # a read-only or full home: as with no compiler, the op cannot be built here
        built = build_dir / f"zeroinf_{spec.name}_{key}.so"
        if built.is_file():  # but a cache built before (an image's, a shared one) is loaded as it is
            return _import_built(spec.name, built)
        raise OpUnavailableError(f"cannot write the op cache {cache_dir()} ({exc.strerror or exc}); set "
                                 "ZEROINF_CACHE to a writable folder") from exc
    with lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        # torch's own build baton: a file it deletes when its build ends. A build killed midway
        # (Ctrl-C in a spawned rank, a test timeout) leaves it behind and every later build would
        # wait on it forever. Holding our lock, no other zeroinf build can be using it.
        (build_dir / "lock").unlink(missing_ok=True)
        first_build = not any(build_dir.glob("*.so"))
        if first_build:
            # A first-use build takes 30-60 s on 2 cores: say so on stderr rather than stall silently
            # (the time also lands in whatever the caller is timing, e.g. the first optimizer step).
            print(f"zeroinf: compiling op '{spec.name}' on first use (cached in {build_dir})",
                  file=sys.stderr, flush=True)
        # cpp_extension reads MAX_JOBS from the environment: set it for this build only.
        set_jobs = "MAX_JOBS" not in os.environ
        if set_jobs:
            os.environ["MAX_JOBS"] = str(_max_jobs())
        try:
            with ticking(f"zeroinf: compiling op '{spec.name}'", expected_s=60) if first_build else contextlib.nullcontext():
                return cpp_extension.load(
                    name=f"zeroinf_{spec.name}_{key}",
                    sources=[str(p) for p in spec.source_paths()],
                    extra_cflags=cflags,
                    extra_ldflags=ldflags,
                    extra_cuda_cflags=list(spec.cuda_cflags) if spec.cuda else None,
                    extra_include_paths=[str(csrc_root() / "includes"), str(csrc_root() / spec.name)],
                    build_directory=str(build_dir),
                    verbose=False,
                )
        except (RuntimeError, ImportError, OSError, subprocess.SubprocessError) as exc:
            # SubprocessError: torch's own compiler check (``CXX --version`` failing: a broken
            # wrapper) raises CalledProcessError
            log = str(exc)
            err = OpBuildError(spec.name, _compile_command(build_dir), _first_error_line(log), log)
            # a retry in this process would be told of a missing .so (torch's half-done
            # build), not of the compiler: it gets this error again
            _failed[str(build_dir)] = err
            raise err from exc
        finally:
            if set_jobs:
                os.environ.pop("MAX_JOBS", None)
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _import_built(op: str, path: Path) -> ModuleType:
    """Import op ``op``'s JIT-built extension module from ``path`` without building (its cache
    cannot be written, so cpp_extension.load, which rewrites build.ninja, cannot run).

    Raises:
        OpBuildError: the import failed (names ``op``).
    """
    import importlib.util

    try:
        spec = importlib.util.spec_from_file_location(path.stem, str(path))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except (ImportError, OSError) as exc:
        raise OpBuildError(op, f"(none: importing {path} from a read-only cache)", str(exc), str(exc)) from exc
    return mod


def _max_jobs() -> int:
    """Parallel compile jobs from cores and free RAM (about 1.5 GB per C++ job with torch headers)."""
    try:
        import psutil

        by_mem = int(psutil.virtual_memory().available // int(1.5e9))
    except ImportError:
        by_mem = 4
    return max(1, min(os.cpu_count() or 1, by_mem))


def load_op(name: str) -> ModuleType:
    """Return the compiled module for op ``name``, building it on first use if needed.

    Args:
        name: a key of :data:`zeroinf.ops.specs.OPS` (``"adam"``, ``"aio"``).

    Returns:
        The extension module (prebuilt ``zeroinf._ops_<name>`` or the JIT build).

    Raises:
        KeyError: unknown op name.
        OpUnavailableError: ops disabled by ``ZEROINF_DISABLE_OPS``, no compiler found, or an op
            cache folder that cannot be written (``ZEROINF_CACHE``).
        OpBuildError: the build or the import failed (compiler command and first error inside).
    """
    if name not in OPS:
        raise KeyError(f"unknown zeroinf op {name!r}; known ops: {sorted(OPS)}")
    with _lock:
        if name in _loaded:
            return _loaded[name]
        if ops_disabled():
            raise OpUnavailableError("C++ ops disabled by ZEROINF_DISABLE_OPS=1")
        blockers = cuda_blockers(need_nvcc=not _has_prebuilt(name)) if OPS[name].cuda else []
        if blockers:
            raise OpUnavailableError(f"CUDA op '{name}' not built: " + "; ".join(blockers))
        mod = _prebuilt(name)
        if mod is None:
            mod = _jit_build(OPS[name])
        _loaded[name] = mod
        return mod


def try_load_op(name: str, fallback: str) -> Optional[ModuleType]:
    """Like :func:`load_op`, but return ``None`` (warning once per op) when the op is unavailable.

    Only :class:`OpUnavailableError` (ops disabled, no compiler, an op cache that cannot be
    written) leads to the fallback; a build
    that was attempted and failed still raises :class:`OpBuildError`.

    Args:
        name: op name.
        fallback: what runs instead, for the warning (e.g. "the pure-PyTorch Adam").
    """
    try:
        return load_op(name)
    except OpUnavailableError as exc:
        if name not in _warned:
            _warned.add(name)
            warnings.warn(f"zeroinf op '{name}' unavailable ({exc}); using {fallback} (slower)",
                          RuntimeWarning, stacklevel=2)
        return None


def op_status(name: str) -> dict:
    """Describe op ``name`` without building it, for ``zeroinf report``.

    Returns:
        ``{"op", "state", "why", "notes"}`` where state is one of ``loaded``, ``prebuilt``,
        ``cached``, ``would JIT``, ``fallback``.
    """
    spec = OPS[name]
    _c, _l, notes = spec.flags()
    if name in _loaded:
        return {"op": name, "state": "loaded", "why": getattr(_loaded[name], "__file__", ""), "notes": notes}
    if ops_disabled():
        return {"op": name, "state": "fallback", "why": "ZEROINF_DISABLE_OPS=1", "notes": notes}
    blockers = cuda_blockers(need_nvcc=not _has_prebuilt(name)) if spec.cuda else []
    if blockers:
        return {"op": name, "state": "fallback", "why": "; ".join(blockers), "notes": notes}
    if _has_prebuilt(name):  # the same test load_op applies, so report and loading agree
        return {"op": name, "state": "prebuilt", "why": "installed with ZEROINF_BUILD_OPS=1", "notes": notes}
    cxx = _compiler()
    if cxx is None:
        return {"op": name, "state": "fallback", "why": "no C++ compiler", "notes": notes}
    key = _build_key(spec, _c, _l, cxx)
    build_dir = cache_dir() / name / key
    if any(build_dir.glob("*.so")):
        return {"op": name, "state": "cached", "why": str(build_dir), "notes": notes}
    return {"op": name, "state": "would JIT", "why": f"{_compiler_version(cxx)} -> {build_dir}", "notes": notes}
