"""Checks of a checkpoint's files against the engine loading it, made before anything is changed."""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Sequence

import torch

from zeroinf import progress
from zeroinf.io.swapper import tensor_crc32

from .files import CheckpointError, _load_meta, _optim_file, _read
from .module_state import _layout
from .rng import _check_rng_state


def _check_meta(engine, meta: Dict[str, Any], path: str) -> None:
    """Raise CheckpointError naming ``path`` unless the counters, the param groups'
    hyper-parameters (keys this engine's groups have) and the other entries load applies are
    there and of the right kind."""
    for k in ("global_steps", "micro_steps", "skipped_steps", "optimizer_steps", "global_samples"):
        if k == "global_samples" and k not in meta:  # saved before it was counted
            continue
        if not isinstance(meta.get(k), int) or isinstance(meta.get(k), bool) or meta[k] < 0:
            raise CheckpointError(f"{path}: {k} is {meta.get(k)!r}, expected a count")
    for k in ("loss_scaler", "lr_scheduler", "client_state"):
        if k not in meta or (meta[k] is not None and not isinstance(meta[k], dict)):
            raise CheckpointError(f"{path}: entry {k!r} is missing or not a dict")
    groups = meta.get("param_groups")
    mine = engine.optimizer.param_groups
    if not isinstance(groups, list) or len(groups) != len(mine) or not all(isinstance(h, dict) for h in groups):
        raise CheckpointError(f"{path}: param_groups do not match this engine's {len(mine)} groups")
    for i, (g, h) in enumerate(zip(mine, groups)):
        # initial_lr: a torch LR scheduler's bookkeeping in the groups; a run resumed without that
        # scheduler (the config's, or none) takes it as torch's load_state_dict would (it was refused)
        unknown = sorted(set(h) - set(g) - {"initial_lr"})
        if unknown:
            raise CheckpointError(f"{path}: param group {i} has hyper-parameters this optimizer does not: {unknown}")


def _check_module_state(module: torch.nn.Module, sd: Any, path: str, engine_hooks=None,
                        excluded: Sequence[str] = ()) -> None:
    """Raise CheckpointError naming ``path`` unless ``sd`` has exactly ``module``'s state-dict
    keys with its shapes (a stage-3 partitioned parameter's full shape is ``ds_shape``), so that
    ``load_state_dict`` cannot fail half-way. When a module has load pre-hooks of the user's
    (``engine_hooks``: the stage-3 hooks, not counted), which may rename, add or reshape what
    they load (a ``state_dict`` hook adding a key that a pre-hook takes back out was refused),
    or load post-hooks, which may clear missing or unexpected keys, or a class with its own
    ``_save_to_state_dict`` (a layout of its own: a transposed weight, a derived entry),
    only the dict is checked: ``load_state_dict`` reports what does not fit, and the failed load
    leaves the engine refusing to train until a load completes."""
    if not isinstance(sd, dict):
        raise CheckpointError(f"{path}: holds no module state dict")
    if any(len(m._load_state_dict_pre_hooks) > int(engine_hooks is not None and engine_hooks.hooks(m))
           or m._load_state_dict_post_hooks
           or type(m)._save_to_state_dict is not torch.nn.Module._save_to_state_dict for m in module.modules()):
        return
    want = {}  # as Module.state_dict names them: tied parameters and shared modules under every name
    for prefix, m in module.named_modules(remove_duplicate=False):
        pre = f"{prefix}." if prefix else ""
        for name, p in m._parameters.items():
            if p is not None:
                want[pre + name] = tuple(getattr(p, "ds_shape", p.shape))
        for name, b in m._buffers.items():
            if b is not None and name not in m._non_persistent_buffers_set:
                want[pre + name] = tuple(b.shape)
        if type(m).get_extra_state is not torch.nn.Module.get_extra_state:
            want[pre + "_extra_state"] = None  # any object
    missing = sorted(set(want) - set(sd) - set(excluded))  # excluded: frozen ones a save left out
    unexpected = sorted(set(sd) - set(want))
    wrong = sorted(k for k in set(want) & set(sd) if want[k] is not None
                   and (not isinstance(sd[k], torch.Tensor) or tuple(sd[k].shape) != want[k]))
    if missing or unexpected or wrong:
        raise CheckpointError(f"{path}: the module state does not match this model (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}, other shapes {wrong[:3]})")


def _check_param_positions(ckpt: str, saved: Optional[list], mine: list) -> None:
    """Raise CheckpointError unless each parameter sits where the checkpoint's flat layout put
    it (same names, shape and offset in the same param group). The masters and Adam moments are
    restored by position in the flat buffers; the module's weights by name. A model whose layers
    are registered in another order, or ``model_parameters`` in another order (param groups
    built from a ``set``), passes every other check and would restore each moment onto the wrong
    weight. Checkpoints from before the layout
    was recorded are not checked."""
    if saved is None:
        return
    for gi, (a, b) in enumerate(zip(saved, mine)):
        pa = [(tuple(p["names"]), tuple(p["shape"]), p["offset"]) for p in a["params"]]
        pb = [(tuple(p["names"]), tuple(p["shape"]), p["offset"]) for p in b["params"]]
        if pa == pb:
            continue
        i = next((i for i, (x, y) in enumerate(zip(pa, pb)) if x != y), min(len(pa), len(pb)))
        what = lambda lst: (f"'{lst[i][0][0]}' {list(lst[i][1])} at element {lst[i][2]}"  # noqa: E731
                            if i < len(lst) else "nothing")
        raise CheckpointError(
            f"{ckpt}: parameter group {gi} is laid out differently: position {i} holds {what(pa)} in the checkpoint, "
            f"{what(pb)} here. The fp32 masters and Adam moments are restored by position, so they would land on "
            "other parameters. Pass model_parameters (and param groups) in the saved order and register the "
            "layers in the same order, or consolidate() the checkpoint and load its fp32 weights")


def _check_client_state(client_state: Optional[dict]) -> None:
    """Raise TypeError unless ``client_state`` survives the ``torch.load(weights_only=True)`` that
    :func:`load` reads checkpoints with (tensors, numbers, strings, lists, dicts, and classes
    registered with ``torch.serialization.add_safe_globals``), so that an ``argparse.Namespace``
    or a numpy scalar is refused at save time rather than saved into a checkpoint that can never
    be loaded, nor consolidated. The error names the first top-level key whose value fails."""
    import io

    if not client_state:
        return

    def fails(obj) -> Optional[str]:
        buf = io.BytesIO()
        try:
            torch.save(obj, buf)
            buf.seek(0)
            torch.load(buf, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - UnpicklingError, PicklingError (a lambda), TypeError, ...
            return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
        return None
    if fails(client_state) is None:
        return
    items = client_state.items() if isinstance(client_state, dict) else [("client_state", client_state)]
    for key, value in items:
        why = fails(value)
        if why is not None:
            break
    else:
        key, value, why = "client_state", client_state, fails(client_state)
    raise TypeError(f"save_checkpoint: client_state[{key!r}] ({type(value).__module__}.{type(value).__qualname__}) "
                    "could not be read back by load_checkpoint, which loads with torch.load(weights_only=True); "
                    "nothing was saved. Store plain values (vars(args), float(x), array.tolist(), tensors), or "
                    f"allow the class with torch.serialization.add_safe_globals([...]). ({why})")


def _check_files(engine, load_dir: str, tag: Optional[str]):
    """Open and check everything :func:`load` will apply on this rank; returns (folder, meta,
    rng state, memory-mapped optimizer states). Raises CheckpointError naming the file."""
    ckpt, meta = _load_meta(load_dir, tag)
    mine = [[s.key, s.numel, s.param_group] for s in engine.sub_optimizer.specs]
    if meta["world_size"] != engine.world_size:
        raise CheckpointError(f"{ckpt}: saved with world size {meta['world_size']}, this engine has "
                              f"{engine.world_size}; consolidate() it and load the fp32 weights instead")
    if meta["stage"] != engine.config.zero_optimization.stage:
        raise CheckpointError(f"{ckpt}: saved with zero stage {meta['stage']}, this engine has "
                              f"{engine.config.zero_optimization.stage}; consolidate() it and load the fp32 weights "
                              "instead")
    saved = [list(x) for x in meta["sub_groups"]]
    if saved != mine and meta.get("precision") not in (None, engine.config.precision):
        raise CheckpointError(f"{ckpt}: saved training in {meta['precision']}, this engine trains in "
                              f"{engine.config.precision}; at stage 3 the partitions are laid out per dtype, so "
                              "load it with the same precision, or consolidate() it and load the fp32 weights")
    if saved != mine:
        i = next((i for i, (a, b) in enumerate(zip(saved, mine)) if a != b), min(len(saved), len(mine)))
        at = lambda lay: f"{lay[i]}" if i < len(lay) else "none"  # noqa: E731
        layout = ("the model, which of its parameters are trainable, its param groups, sub_group_size, or at "
                  "stage 3 the units (stage3_param_persistence_threshold, the unit classes)")
        count = (f"saved with {len(saved)} optimizer sub-groups, this engine has {len(mine)}" if len(saved) != len(mine)
                 else f"the optimizer's {len(mine)} sub-groups differ from the saved ones")
        raise CheckpointError(f"{ckpt}: {count}; "
                              f"the first that differs, [key, elements, param group]: saved {at(saved)}, here {at(mine)}. "
                              f"The layout follows {layout}: use the same settings, or consolidate() the "
                              "checkpoint and load its fp32 weights")
    _check_param_positions(ckpt, meta.get("layout"), _layout(engine))
    files = [_optim_file(ckpt, engine.rank, s.key) for s in engine.sub_optimizer.specs]
    rng_file = os.path.join(ckpt, f"rng_rank{engine.rank}.pt")
    for f in files + [rng_file]:
        if not os.path.isfile(f):
            raise CheckpointError(f"{f}: missing from the checkpoint")
    rng = _read(rng_file)
    _check_rng_state(rng, rng_file)
    want_id = meta.get("save_id")  # checkpoints from before save ids have none

    def check_id(sd, path):
        if want_id is not None and isinstance(sd, dict) and sd.get("save_id") != want_id:
            raise CheckpointError(f"{path}: written by another save ({sd.get('save_id')!r}) than model_states.pt "
                                  f"({want_id!r}); the folder mixes the files of two saves (a partial copy or "
                                  "restore?)")
    check_id(rng, rng_file)
    states = []  # memory-mapped: checked now, read when loaded
    for spec, f in progress.counting(list(zip(engine.sub_optimizer.specs, files)), "zeroinf: checking checkpoint files",
                                     unit="file"):
        sd = _read(f, mmap=True)
        if not isinstance(sd, dict) or sd.get("key") != spec.key or sd.get("numel") != spec.numel:
            got = (sd.get("key"), sd.get("numel")) if isinstance(sd, dict) else type(sd).__name__
            raise CheckpointError(f"{f}: holds {got}, expected {spec.key!r} ({spec.numel} elements)")
        check_id(sd, f)
        for k, name in enumerate(("master", "exp_avg", "exp_avg_sq")):
            t = sd.get(name)
            if not isinstance(t, torch.Tensor) or t.numel() != spec.numel:
                raise CheckpointError(f"{f}: {name} is {getattr(t, 'shape', type(t).__name__)}, expected "
                                      f"{spec.numel} elements")
            _check_crc(sd, k, f)
        states.append(sd)
    meta_file = os.path.join(ckpt, "model_states.pt")
    _check_meta(engine, meta, meta_file)
    _check_module_state(engine.module, meta.get("module"), meta_file, engine.params.state_hooks,
                        meta.get("excluded_frozen", ()))
    _check_module_crcs(meta, meta_file)
    return ckpt, meta, rng, states


def _check_crc(sd: Dict[str, Any], k: int, path: str) -> None:
    """Raise CheckpointError naming ``path`` unless tensor ``k`` (0 master, 1 exp_avg,
    2 exp_avg_sq) of an optimizer file matches the CRC-32 written at save (files saved before
    checksums have none: not checked)."""
    name = ("master", "exp_avg", "exp_avg_sq")[k]
    crcs = sd.get("crc32")
    if crcs is not None and (not isinstance(crcs, list) or len(crcs) != 3 or tensor_crc32(sd[name]) != crcs[k]):
        raise CheckpointError(f"{path}: {name} does not match its CRC-32 (the file is corrupt)")


def _check_module_crcs(meta: Dict[str, Any], path: str) -> None:
    """Raise CheckpointError naming ``path`` and the key unless every module tensor matches
    the CRC-32 written at save."""
    for k, crc in (meta.get("module_crc32") or {}).items():
        if tensor_crc32(meta["module"][k]) != crc:
            raise CheckpointError(f"{path}: module state {k!r} does not match its CRC-32 (the file is corrupt)")
