"""The RNG states a checkpoint carries per rank (Python, numpy, torch CPU and CUDA), with a CRC-32."""
from __future__ import annotations

import random
import zlib
from typing import Any, Dict

import numpy as np
import torch

from zeroinf.io.swapper import tensor_crc32

from .files import CheckpointError


def _rng_state() -> Dict[str, Any]:
    np_state = np.random.get_state()
    out = {"python": random.getstate(), "torch": torch.get_rng_state(),
           "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                     "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])}}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    out["crc32"] = _rng_crc32(out)
    return out


def _rng_crc32(s: Dict[str, Any]) -> int:
    """CRC-32 over the RNG states of :func:`_rng_state` (tensors' bytes, the Python and numpy
    scalars' text), so a corrupt value that still unpickles is caught at load."""
    n = s["numpy"]
    crc = zlib.crc32(repr((_tuplify(s["python"]), n["name"], n["pos"], n["has_gauss"], n["cached_gaussian"])).encode())
    for t in [s["torch"], n["keys"]] + list(s.get("cuda", [])):
        crc = tensor_crc32(t, crc)
    return crc


def _check_rng_state(s: Any, path: str) -> None:
    """Raise CheckpointError naming ``path`` unless ``s`` is a set of RNG states that
    :func:`_set_rng_state` can apply (each is tried on a fresh generator, not the process's)."""
    try:
        if "crc32" in s and _rng_crc32(s) != s["crc32"]:  # files saved before checksums have none
            raise ValueError("the states do not match their CRC-32 (the file is corrupt)")
        random.Random().setstate(_tuplify(s["python"]))
        torch.Generator().set_state(s["torch"])
        n = s["numpy"]
        np.random.RandomState().set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                                           n["cached_gaussian"]))
    except Exception as exc:
        raise CheckpointError(f"{path}: holds no usable RNG states ({type(exc).__name__}: {exc}); "
                              "nothing was loaded") from exc


def _set_rng_state(s: Dict[str, Any]) -> None:
    random.setstate(_tuplify(s["python"]))
    torch.set_rng_state(s["torch"])
    n = s["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x
