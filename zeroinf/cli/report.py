"""``zeroinf report``: what this machine and install can run, and why not the rest.

Sections: versions (torch, Python, compiler), the CPU and its Adam instruction-set paths (which
are available, which one runs, what ``ZEROINF_ADAM_ISA`` forces), each C++ op's state
(loaded / prebuilt / cached / would JIT / fallback, with the reason), libaio, and the async-I/O
backends (from ``zeroinf.io.backend_report()``, each probed by a real round trip).

By default nothing is compiled: an op that would need a JIT build is reported as such and its
ISA line comes from /proc/cpuinfo. ``--build`` builds (or loads) the ops first, so the report
shows the path the compiled op really chose, or the build error.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Dict, List

__all__ = ["collect", "add_arguments", "main"]

#: CPU features each Adam path needs (mirrors csrc/adam/cpu_adam.cpp's probe).
ISA_FEATURES = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "f16c"),
    "avx2": ("avx2", "f16c"),
    "scalar": (),
}


def _cpu() -> Dict[str, object]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("", platform.machine()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                if flags and not model.startswith(platform.machine()):
                    break
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count(), "flags": flags}


def _isa_paths(flags: set) -> Dict[str, str]:
    """Path -> "" when /proc/cpuinfo lists its features, else the missing ones."""
    out = {}
    for isa, need in ISA_FEATURES.items():
        missing = [f for f in need if f not in flags]
        out[isa] = "" if not missing else "CPU lacks " + ", ".join(missing)
    return out


def collect(build: bool = False) -> Dict[str, object]:
    """Gather the report as a dict (what ``--json`` prints).

    Args:
        build: load (JIT-building if needed) every op first, so the Adam path reported is the
            compiled op's own choice and build errors show up here.

    Returns:
        ``{"torch", "python", "compiler", "cpu": {"model", "cores"}, "adam_isa": {"available":
        {path: reason or ""}, "chosen", "forced", "source"}, "ops": [op_status dicts, plus
        "error" when a --build failed], "libaio": str, "io_backends": [dicts] or {"error": str}}``.
    """
    import torch

    from zeroinf.ops import OPS, load_op, loader, op_status

    cpu = _cpu()
    rep: Dict[str, object] = {
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "compiler": (loader._compiler_version(loader._compiler()) if loader._compiler() else "none found"),
        "cpu": {"model": cpu["model"], "cores": cpu["cores"]},
    }
    ops: List[dict] = []
    for name in OPS:
        err = None
        if build:
            try:
                load_op(name)
            except Exception as exc:  # shown in the report, not swallowed: this is a diagnostic tool
                err = f"{type(exc).__name__}: {exc}"
        st = op_status(name)
        if err:
            st["error"] = err
        ops.append(st)
    rep["ops"] = ops
    from zeroinf.ops.specs import _libaio_probe

    _c, ldflags, why = _libaio_probe()
    rep["libaio"] = "found (-laio)" if "-laio" in ldflags else "; ".join(why)

    forced = os.environ.get("ZEROINF_ADAM_ISA") or None
    isa = {"available": _isa_paths(cpu["flags"]), "forced": forced, "chosen": None, "source": "/proc/cpuinfo"}
    adam_state = next(o["state"] for o in ops if o["op"] == "adam")
    if adam_state in ("loaded", "prebuilt", "cached"):
        from zeroinf.optim import isa_info

        try:
            info = isa_info()
            isa.update(available=info["unsupported"], chosen=info["chosen"], source="the compiled op")
        except Exception as exc:  # e.g. a prebuilt op for another torch: show it
            isa["error"] = f"{type(exc).__name__}: {exc}"
    elif adam_state == "fallback":
        isa["chosen"] = "torch (pure-PyTorch fallback)"
    if isa["chosen"] is None:
        best = next((p for p in ("avx512", "avx2", "scalar") if not isa["available"][p]), "scalar")
        isa["chosen"] = forced if forced and forced != "auto" else best
    rep["adam_isa"] = isa

    try:
        from zeroinf.io import backend_report

        rep["io_backends"] = backend_report(build=build)
    except (ImportError, AttributeError) as exc:
        rep["io_backends"] = {"error": f"zeroinf.io.backend_report unavailable ({exc})"}
    except Exception as exc:  # a backend probe that failed: show why
        rep["io_backends"] = {"error": f"{type(exc).__name__}: {exc}"}
    return rep


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``zeroinf report``."""
    parser.add_argument("--build", action="store_true", help="build/load the C++ ops first (may JIT-compile)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def main(args: argparse.Namespace) -> int:
    """Print the report; exit code 1 when a ``--build`` failed, else 0."""
    rep = collect(build=args.build)
    failed = any("error" in o for o in rep["ops"])
    if args.json:
        print(json.dumps(rep, indent=2, default=str))
        return 1 if failed else 0
    w = sys.stdout.write
    w(f"torch            {rep['torch']} ({rep['torch_threads']} threads), Python {rep['python']}\n")
    w(f"compiler         {rep['compiler']}\n")
    w(f"CPU              {rep['cpu']['model']}, {rep['cpu']['cores']} cores\n")
    isa = rep["adam_isa"]
    w(f"Adam ISA         chosen: {isa['chosen']}"
      f"{' (forced by ZEROINF_ADAM_ISA=' + isa['forced'] + ')' if isa['forced'] else ''}; from {isa['source']}\n")
    for path, why in isa["available"].items():
        w(f"  {path:<14} {'available' if not why else 'unavailable: ' + why}\n")
    if "error" in isa:
        w(f"  error: {isa['error']}\n")
    w("ops\n")
    for o in rep["ops"]:
        w(f"  {o['op']:<14} {o['state']:<10} {o['why']}\n")
        for note in o.get("notes", []):
            w(f"  {'':<14} note: {note}\n")
        if "error" in o:
            w(f"  {'':<14} error: {o['error']}\n")
    w(f"libaio           {rep['libaio']}\n")
    w("I/O backends\n")
    io_rep = rep["io_backends"]
    if isinstance(io_rep, dict):
        w(f"  {io_rep['error']}\n")
    else:
        for b in io_rep:
            state = {True: "available", False: "unavailable", None: "unknown"}[b["available"]]
            w(f"  {b['name']:<14} {state}: {b['why']}\n")
    return 1 if failed else 0
