"""One fp32 state dict from a checkpoint's files, in one process without torch.distributed."""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

import torch

from zeroinf import progress

from .files import CheckpointError, _load_meta, _optim_file, _read, save_atomically
from .verify import _check_crc, _check_module_crcs


def consolidate(load_dir: str, tag: Optional[str], out: str) -> Dict[str, torch.Tensor]:
    """Write one fp32 state dict (all of the module's keys, tied names included, but the frozen
    parameters a save with ``exclude_frozen_parameters`` left out; trainable parameters from the
    fp32 master weights of every rank) to ``out`` (``.safetensors`` → safetensors,
    else ``torch.save``). Runs in one process, no torch.distributed needed. Returns the dict.

    Raises:
        CheckpointError: a rank's optimizer file is missing, or a tensor it reads does not match
            the CRC-32 written at save (as :func:`load` checks; corrupt data gave wrong weights).
    """
    _ckpt, _meta, sd = _consolidated(load_dir, tag)
    save_atomically({k: v.contiguous() for k, v in sd.items()} if out.endswith(".safetensors") else sd, out)
    return sd


def _consolidated(load_dir: str, tag: Optional[str]) -> Tuple[str, Dict[str, Any], Dict[str, torch.Tensor]]:
    """:func:`consolidate`'s fp32 state dict, in memory; returns (folder, meta, state dict)."""
    ckpt, meta = _load_meta(load_dir, tag)
    _check_module_crcs(meta, os.path.join(ckpt, "model_states.pt"))
    sd = {k: (v.float() if v.is_floating_point() else v).clone() for k, v in meta["module"].items()}
    subs: Dict[int, list] = {}
    for key, numel, gi in meta["sub_groups"]:
        subs.setdefault(gi, []).append((key, numel))
    shown = progress.bar("zeroinf: consolidating", unit="part", total=sum(lay["nparts"] for lay in meta["layout"]))
    try:
        for gi, lay in enumerate(meta["layout"]):
            flat = torch.zeros(lay["padded"], dtype=torch.float32)
            for r in range(lay["nparts"]):
                _read_part(ckpt, meta, subs, gi, lay, r, flat)
                shown.update(1)
            for p in lay["params"]:
                n = 1
                for s in p["shape"]:
                    n *= s
                t = flat[p["offset"]:p["offset"] + n].view(p["shape"])
                for name in p["names"]:
                    sd[name] = t.clone()
    finally:
        shown.close()
    return ckpt, meta, sd


def _read_part(ckpt: str, meta: Dict[str, Any], subs: Dict[int, list], gi: int, lay: Dict[str, Any], r: int,
               flat: torch.Tensor) -> None:
    """Copy rank ``r``'s fp32 master weights of layout group ``gi`` into its part of ``flat``
    (the group's padded fp32 buffer), checking each file's save id and CRC-32."""
    pos = r * lay["part_numel"]
    keys = subs.get(gi, []) if lay.get("sub_keys") is None else [
        (k, n) for ks in subs.values() for k, n in ks if k in set(lay["sub_keys"])]
    for key, numel in keys:
        f = _optim_file(ckpt, r, key)
        if not os.path.isfile(f):
            raise CheckpointError(f"{f}: missing; consolidate needs every rank's optimizer files")
        opt = _read(f, mmap=True)
        want = meta.get("save_id")  # checkpoints from before save ids have none
        if want is not None and isinstance(opt, dict) and opt.get("save_id") != want:
            raise CheckpointError(f"{f}: written by another save ({opt.get('save_id')!r}) than model_states.pt "
                                  f"({want!r}); the folder mixes the files of two saves")
        _check_crc(opt, 0, f)
        flat[pos:pos + numel].copy_(opt["master"])
        pos += numel
