"""Engine checkpoints: save, load (resume bit-exact) and consolidate into one fp32 state dict.

Layout of ``<dir>/<tag>/`` (every file loads with ``torch.load(weights_only=True)``)::

    optim_rank{r}_{group}_{sub}.pt   one per sub-group of rank r: key, master, exp_avg, exp_avg_sq (fp32)
    rng_rank{r}.pt                   rank r's RNG states (python, numpy, torch CPU, CUDA)
    model_states.pt                  written by rank 0 *last*: the module's state dict, step counters,
                                     loss scaler, LR scheduler, param-group hyper-parameters, the
                                     flat layout (for consolidate) and the caller's client_state
    <dir>/latest                     the tag of the last complete save

Each rank writes only files carrying its rank in the name, into ``<dir>/<tag>.saving``, which is
renamed onto ``<dir>/<tag>`` once complete: ranks saving at once never collide, and saving the
same tag twice replaces it whole, or (if the second save fails) not at all. The
optimizer state is streamed: one sub-group at a time is read from its tier (NVMe swap files
included) and written, never the whole partition at once. ``model_states.pt`` is written after a
barrier, so a folder without it is an incomplete save and is refused at load.
"""
from __future__ import annotations

import copy
import errno
import logging
import os
import random
import re
import shutil
import traceback
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from zeroinf import progress
from zeroinf.io.atomic import write_text_then_rename, write_then_rename
from zeroinf.io.swapper import tensor_crc32
from zeroinf.runtime.waits import collective

__all__ = ["save", "load", "consolidate", "frozen_names", "CheckpointError"]

_FORMAT = 1
_log = logging.getLogger("zeroinf")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, or does not match the engine loading it (names the file)."""


def save_atomically(obj: Any, path: str) -> None:
    """``torch.save`` (safetensors' ``save_file`` for a ``.safetensors`` path, of a dict of
    contiguous tensors) to a temporary file renamed onto ``path``; on failure the temporary file
    is removed and what was at ``path`` is left as it was. Raises OSError naming ``path`` when the
    write fails: torch's writer reports a full disk or a file-size limit as a RuntimeError about
    stream positions, without the path, and safetensors as a SafetensorError, which is no OSError;
    the error number is the one the writer names (``os error 27``), else ENOSPC
    for a full file system, EFBIG at the file-size limit, EIO otherwise."""
    written, free = 0, None  # how far a failed write got, and the room left then: for the error number

    def write(tmp: str) -> None:
        nonlocal written, free
        try:
            if path.endswith(".safetensors"):
                from safetensors.torch import save_file
                save_file(obj, tmp)
            else:
                torch.save(obj, tmp)
        except BaseException as exc:
            written = os.path.getsize(tmp) if os.path.exists(tmp) else 0
            free = shutil.disk_usage(os.path.dirname(path) or ".").free  # before the file below is closed
            # the writer's frames hold its open file: kept alive by the error (and the OSError
            # chained to it) until a garbage collection, the unlinked file would keep its space
            # and the full disk would stay full; their locals are dropped now
            seen, chain = set(), [exc]
            while chain:  # the error and those it was raised during (torch's writer closing)
                e = chain.pop()
                if e is not None and id(e) not in seen:
                    seen.add(id(e))
                    traceback.clear_frames(e.__traceback__)
                    chain += [e.__context__, e.__cause__]
            raise

    try:
        write_then_rename(path, write)
    except Exception as exc:
        if not isinstance(exc, OSError):  # the writer's own error types
            if free is None:
                free = shutil.disk_usage(os.path.dirname(path) or ".").free
            raise OSError(_write_errno(str(exc), free, written), f"{path}: writing the file failed ({free} bytes free "
                          f"on its file system; {type(exc).__name__}: {str(exc).strip()})") from exc
        raise


def _write_errno(message: str, free: int, written: int) -> int:
    """The error number behind a writer's failure message (see :func:`save_atomically`)."""
    found = re.search(r"os error (\d+)", message)
    if found:
        return int(found.group(1))
    if free == 0:
        return errno.ENOSPC
    import resource  # POSIX only: imported where it is needed
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and written >= limit:
        return errno.EFBIG
    return errno.EIO


def _read(path: str, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU (``mmap``: tensors mapped, read on
    use). Raises CheckpointError naming ``path`` when the file cannot be read or unpickled
    (truncated, not a torch file)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:
        raise CheckpointError(f"{path}: unreadable: truncated, corrupt or not a torch file ({type(exc).__name__}: "
                              f"{str(exc).strip()[:300]}); nothing was loaded") from exc


def _optim_file(ckpt: str, rank: int, key: str) -> str:
    return os.path.join(ckpt, f"optim_rank{rank}_{key.replace('/', '_')}.pt")


def _barrier(engine, what: str) -> None:
    if engine.world_size > 1:
        with collective(what, engine.rank, engine.world_size):
            dist.barrier()


def _same_tag(engine, tag: Optional[str], what: str) -> Optional[str]:
    """The tag every rank uses for this save or load: rank 0's. Collective with more than one
    rank (every rank sends its tag). Ranks passing different tags would write one checkpoint split
    over several folders, none of them loadable, or load a mix of steps; DeepSpeed's
    ``checkpoint.tag_validation`` ("warn" by default) only logs that. Here "fail" raises on every
    rank, "warn" logs the ranks' tags and goes on with rank 0's, "ignore" takes rank 0's silently.

    Raises:
        ValueError: the tags differ and ``checkpoint.tag_validation`` is "fail" (nothing was
            written or loaded).
    """
    if engine.world_size == 1:
        return tag
    tags = [None] * engine.world_size
    with collective(what, engine.rank, engine.world_size):
        dist.all_gather_object(tags, tag)
    if all(t == tags[0] for t in tags):
        return tag
    mode = engine.config.checkpoint.tag_validation
    listing = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
    if mode == "fail":
        raise ValueError(f"{what}: the ranks passed different tags ({listing}) and checkpoint.tag_validation is "
                         f"\"Fail\"; nothing was {'saved' if what == 'save_checkpoint' else 'loaded'}")
    if mode == "warn" and engine.rank == 0:
        _log.warning("%s: the ranks passed different tags (%s); every rank uses rank 0's (checkpoint.tag_validation "
                     "\"Warn\")", what, listing)
    return tags[0]


def _save_id(engine, tag: str) -> str:
    """What every file of one save carries (the same on every rank): the tag and the engine's
    counters. Every file is checked against it, so a file from another save put into the folder
    (a partial restore) is refused, though each file's own checks pass."""
    # optimizer steps only: they are collective, so every rank counts them alike (micro-batches and
    # samples are counted per rank, so a rank that ran fewer would make every load refuse the save)
    return f"{tag}@steps={engine.global_steps},applied={engine.optimizer_steps},skipped={engine.skipped_steps}"


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


def _names_of(module: torch.nn.Module) -> Dict[int, list]:
    names: Dict[int, list] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _layout(engine) -> list:
    """Per param group: padded length, partition count/length, and each param's names/shape/offset."""
    names = _names_of(engine.module)
    out = []
    for g in engine.params.groups:
        # stage 3 groups also give the true shapes (parameters are empty placeholders there) and
        # the keys of their sub-groups (their param_group index is the optimizer's, not the layout's)
        shapes = getattr(g, "shapes", None) or [list(p.shape) for p in g.params]
        out.append({"padded": g.padded, "part_numel": g.part_numel, "nparts": engine.params.nparts,
                    "sub_keys": getattr(g, "sub_keys", None),
                    "params": [{"names": names[id(p)], "shape": list(shape), "offset": off}
                               for p, off, shape in zip(g.params, g.offsets, shapes)]})
    return out


def _replace_dir(work: str, final: str) -> None:
    """Move the finished folder ``work`` onto ``final``: an older ``final`` is renamed aside
    first and removed after, so no reader ever sees a mix of two saves."""
    old = final + ".old"
    if os.path.isdir(old):
        shutil.rmtree(old)
    if os.path.isdir(final):
        os.rename(final, old)
    os.rename(work, final)
    shutil.rmtree(old, ignore_errors=True)


def write_latest(save_dir: str, tag: str) -> None:
    """Point ``save_dir/latest`` at ``tag`` (DeepSpeed's file: the tag as text), through a
    rename, so a reader sees the old tag or the new one.

    Raises:
        OSError: naming ``latest`` and saying that the checkpoint itself is complete.
    """
    latest = os.path.join(save_dir, "latest")
    try:
        write_text_then_rename(latest, tag)
    except OSError as exc:
        raise OSError(exc.errno, f"{latest}: cannot record the tag {tag!r} ({exc.strerror or exc}); the "
                                 f"checkpoint itself is complete in {os.path.join(save_dir, tag)}") from exc


def _module_state(module: torch.nn.Module, skip: Sequence[str] = ()) -> Dict[str, Any]:
    """A detached copy of the module's state dict (extra states, which may be any object,
    deep-copied), without the keys ``skip`` (not copied first: a LoRA base is most of the model)."""
    skip = set(skip)
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in module.state_dict().items() if k not in skip}


def frozen_names(module: torch.nn.Module) -> List[str]:
    """State-dict names of ``module``'s parameters with ``requires_grad=False`` (a tied one under
    each of its names), sorted."""
    return sorted({n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad})


def _load_module(module: torch.nn.Module, sd: dict, excluded: List[str], strict: bool = True) -> None:
    """``module.load_state_dict(sd, strict)``, where the frozen parameters a save excluded
    (``excluded``) may be missing: they keep the values the module holds.

    Raises:
        RuntimeError: ``strict`` and keys other than those differ (torch's wording)."""
    if not excluded:
        module.load_state_dict(sd, strict=strict)
        return
    res = module.load_state_dict(sd, strict=False)
    missing = sorted(set(res.missing_keys) - set(excluded))
    if strict and (missing or res.unexpected_keys):
        raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}: missing keys {missing[:5]}, "
                           f"unexpected keys {sorted(res.unexpected_keys)[:5]} (the frozen parameters the save "
                           "excluded may be missing)")


def save(engine, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
         save_latest: bool = True, exclude_frozen_parameters: bool = False) -> str:
    """Save ``engine`` to ``save_dir/tag`` (collective: every rank calls it). Returns the folder.
    ``exclude_frozen_parameters``: the module state leaves out parameters with
    ``requires_grad=False`` (DeepSpeed's keyword: a LoRA checkpoint without its frozen base); a
    load then keeps the values the model holds for them.

    The files are written into ``save_dir/tag.saving`` and the folder is renamed onto
    ``save_dir/tag`` once every rank has written its part, so a save that fails leaves an
    earlier save of the same tag whole (never a mix of the two); ``latest`` is written last.

    Raises:
        OSError: a file cannot be written (the message names it; nothing of this save is
            renamed into place).
        ValueError: ``tag`` is not a plain folder name, or the ranks passed different tags
            and ``checkpoint.tag_validation`` is "fail" (see :func:`_same_tag`).
        TypeError: ``client_state`` holds an object that :func:`load` could not read back
            (see :func:`_check_client_state`); nothing is written.
    """
    tag = _same_tag(engine, f"global_step{engine.global_steps}" if tag is None else str(tag), "save_checkpoint")
    if (not tag or "/" in tag or tag in (".", "..") or tag.endswith((".saving", ".old"))
            or tag == "latest" or tag.startswith("latest.")):
        raise ValueError(f"checkpoint tag must be a plain folder name, not 'latest' or 'latest.*', and not ending "
                         f"in .saving or .old; got {tag!r}")
    final = os.path.join(save_dir, tag)
    ckpt = final + ".saving"
    if engine._window_backwards and engine.rank == 0:
        _log.warning("save_checkpoint(%r) with the gradients of %d backward(s) not yet stepped (inside a gradient "
                     "accumulation window, or held by no_sync): they are not saved (as in DeepSpeed), so a run resumed "
                     "from it starts a new window without them; save after the engine.step() that steps the "
                     "optimizer to resume exactly", tag, engine._window_backwards)
    engine.synchronize()  # a background optimizer step (stage 3) finishes before its state is read
    problem = None
    try:
        _check_client_state(client_state)
    except Exception as exc:  # every rank must reach the agreement (a PicklingError left the others waiting)
        problem = exc
    _agree(engine, problem, lambda bad: TypeError(
        f"rank(s) {bad} passed a client_state that load_checkpoint could not read (their errors name the key); "
        "nothing was saved"), "save_checkpoint")
    if engine.rank == 0 and os.path.isdir(ckpt):
        shutil.rmtree(ckpt)  # left by a save that failed
    _barrier(engine, "save_checkpoint")
    opt = engine.sub_optimizer
    save_id = _save_id(engine, tag)
    problem = None
    try:
        os.makedirs(ckpt, exist_ok=True)
        for i, spec in enumerate(progress.counting(opt.specs, "zeroinf: saving optimizer state", unit="file")):
            with opt.state(i) as (master, m, v):
                save_atomically({"key": spec.key, "numel": spec.numel, "master": master.clone(), "exp_avg": m.clone(),
                              "exp_avg_sq": v.clone(), "crc32": [tensor_crc32(t) for t in (master, m, v)],
                              "save_id": save_id}, _optim_file(ckpt, engine.rank, spec.key))
        save_atomically({**_rng_state(), "save_id": save_id}, os.path.join(ckpt, f"rng_rank{engine.rank}.pt"))
    except Exception as exc:
        problem = exc
    _agree_or_drop(engine, problem, ckpt, final)
    # every rank builds the module state dict: under stage 3 it all-gathers each partition (a
    # collective), so rank 0 alone would wait forever for the others
    excluded = frozen_names(engine.module) if exclude_frozen_parameters else []
    module_sd = _module_state(engine.module, skip=excluded)
    if engine.rank != 0:
        module_sd = None
    if engine.rank == 0:
        hyper = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
                 for g in engine.optimizer.param_groups]
        meta = {
            "format": _FORMAT, "save_id": save_id,
            "world_size": engine.world_size, "stage": engine.config.zero_optimization.stage,
            "precision": engine.config.precision,
            "sub_groups": [[s.key, s.numel, s.param_group] for s in opt.specs],
            "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
            "global_samples": engine.global_samples,
            "skipped_steps": engine.skipped_steps, "optimizer_steps": engine.optimizer_steps,
            "loss_scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "param_groups": hyper, "layout": _layout(engine),
            "module": module_sd, "excluded_frozen": excluded,
            "module_crc32": {k: tensor_crc32(v) for k, v in module_sd.items() if isinstance(v, torch.Tensor)},
            "client_state": client_state or {},
        }
        try:
            save_atomically(meta, os.path.join(ckpt, "model_states.pt"))
            _replace_dir(ckpt, final)
        except Exception as exc:
            problem = exc
    _agree_or_drop(engine, problem, ckpt, final)
    if engine.rank != 0 and os.path.isdir(ckpt):  # a folder rank 0 does not see (no shared file system)
        _replace_dir(ckpt, final)
    if engine.rank == 0 and save_latest:
        try:
            write_latest(save_dir, tag)
        except OSError as exc:
            problem = exc
    _agree(engine, problem, lambda bad: OSError(errno.EIO, f"rank 0 could not write {save_dir}/latest (its "
                                                          f"error names why); the checkpoint itself is in {final}"), "save_checkpoint")
    return final


def _load_meta(load_dir: str, tag: Optional[str]) -> Tuple[str, Dict[str, Any]]:
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            raise CheckpointError(f"{latest}: no 'latest' file; pass the tag explicitly")
        with open(latest) as f:
            tag = f.read().strip()
    ckpt = os.path.join(load_dir, tag)
    path = os.path.join(ckpt, "model_states.pt")
    if not os.path.isfile(path):
        hint = ""
        if os.path.isfile(os.path.join(ckpt + ".old", "model_states.pt")):
            hint = (f"; {ckpt}.old holds the previous complete save of this tag (a re-save was interrupted "
                    f"between its renames): rename it to {ckpt} to load it")
        raise CheckpointError(f"{path}: missing (no checkpoint with tag {tag!r}, or an incomplete save){hint}")
    meta = _read(path)
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        fmt = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{path}: checkpoint format {fmt!r}, this zeroinf reads {_FORMAT}")
    return ckpt, meta


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
    _check_module_state(engine.module, meta.get("module"), meta_file, getattr(engine.params, "state_hooks", None),
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


def _on_every_rank(engine, flag: bool, what: str) -> bool:
    """Collective with more than one rank: whether ``flag`` is true on every rank."""
    if engine.world_size == 1:
        return flag
    t = torch.tensor([float(flag)], device=getattr(engine.params, "device", "cpu"))
    with collective(what, engine.rank, engine.world_size):
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _agree(engine, problem: Optional[BaseException], others, what: str) -> None:
    """Collective (in place of a barrier): raise on every rank if any rank failed: ``problem``
    on the rank that had it, ``others(failed_ranks)`` on the rest. So no rank goes on (loads,
    renames a save into place) while another stopped, and none waits for it forever."""
    failed = problem is not None
    if engine.world_size > 1:
        flags = torch.zeros(engine.world_size, dtype=torch.float32, device=getattr(engine.params, "device", "cpu"))
        flags[engine.rank] = float(failed)
        with collective(what, engine.rank, engine.world_size):
            dist.all_reduce(flags)
        bad = [r for r, f in enumerate(flags.tolist()) if f]
        if bad and not failed:
            raise others(bad)
    if problem is not None:
        raise problem


def _agree_or_drop(engine, problem: Optional[BaseException], work: str, final: str) -> None:
    """:func:`_agree` on a save's writes; when any rank failed, each removes the unfinished
    folder ``work`` first: left on a full disk, it would keep the space that the next save (under
    another tag, global_stepN) needs, so every retry would fail too. Not once the earlier save
    of the tag was moved aside (``final.old``): ``work`` is then the complete new save, and the
    renames failed between the two."""
    try:
        _agree(engine, problem, _write_failed, "save_checkpoint")
    except BaseException:
        if not os.path.isdir(final + ".old"):
            shutil.rmtree(work, ignore_errors=True)
        raise


def _write_failed(bad) -> OSError:
    return OSError(errno.EIO, f"rank(s) {bad} could not write their checkpoint files (their errors name them); "
                              "nothing of this save was put in place")


def _load_stateful(obj, state, what: str, path: str) -> Dict[str, Any]:
    """``obj.load_state_dict(state)``; returns ``obj``'s state from before. When that fails
    part-way, ``obj``'s own state is restored and CheckpointError (naming ``path``) raised."""
    before = obj.state_dict()
    try:
        obj.load_state_dict(state)
    except Exception as exc:
        obj.load_state_dict(before)
        raise CheckpointError(f"{path}: the {what} state does not fit this engine's {type(obj).__name__} "
                              f"({type(exc).__name__}: {exc}); nothing was loaded") from exc
    return before


def _read_on_every_rank(engine, load_dir: str, tag: Optional[str], read: Callable[[Optional[str]], Any]) -> Any:
    """The first half of :func:`load` and :func:`load_weights` (collective): every rank takes
    rank 0's tag; when it is None and no rank finds a ``latest`` file, warn and return None
    (DeepSpeed's answer, which its auto-resume scripts test for: a first run has nothing to
    load); else ``read(tag)`` on every rank, and its result once every rank has read.

    Raises:
        CheckpointError: ``read`` failed on some rank (this rank's own error where it failed);
            nothing was loaded on any rank.
        ValueError: the ranks passed different tags (see :func:`_same_tag`).
    """
    engine.synchronize()
    tag = _same_tag(engine, None if tag is None else str(tag), "load_checkpoint")
    if tag is None and _on_every_rank(engine, not os.path.isfile(os.path.join(load_dir, "latest")), "load_checkpoint"):
        if engine.rank == 0:
            _log.warning("load_checkpoint(%r): no 'latest' file there, so nothing was loaded (returns None, None); "
                         "pass tag= to load a checkpoint by name", load_dir)
        return None
    problem, found = None, None
    try:
        found = read(tag)
    except Exception as exc:  # not only CheckpointError: every rank must reach the agreement
        problem = exc
    _agree(engine, problem, lambda bad: CheckpointError(
        f"rank(s) {bad} could not use their checkpoint files (their errors name them); nothing was loaded on any rank"),
        "load_checkpoint")
    return found


def _restore_counters(engine, meta: Dict[str, Any]) -> None:
    """The saved step and sample counters (not Adam's ``optimizer_steps``, which goes with the
    moments); a new accumulation window starts here (DeepSpeed does not restore micro_steps;
    counted from the restored total, a resume with other gradient_accumulation_steps would step
    mid-window)."""
    engine.global_steps, engine.micro_steps = meta["global_steps"], meta["micro_steps"]
    engine._micro_origin = engine.micro_steps
    # checkpoints from before it was saved: as DeepSpeed, from the steps and this batch size
    engine._global_samples = meta.get("global_samples", meta["global_steps"] * engine.train_batch_size())
    engine.skipped_steps = meta["skipped_steps"]


def load(engine, load_dir: str, tag: Optional[str] = None, load_lr_scheduler_states: bool = True) -> Tuple[str, dict]:
    """Restore ``engine`` from ``load_dir/tag`` (tag None: the ``latest`` file). Collective.
    ``load_lr_scheduler_states`` False: the LR scheduler keeps its state (DeepSpeed's keyword).

    Returns ``(folder, client_state)``; ``(None, None)`` when ``tag`` is None and no rank finds
    a ``latest`` file in ``load_dir`` (DeepSpeed's answer: nothing to resume from yet), after a
    warning on the ``zeroinf`` logger.

    Every file is opened and checked (readable, keys and sizes, the module's state-dict keys and
    shapes, the RNG states) on every rank, and the ranks agree, before anything is changed; the
    LR scheduler and loss scaler states are applied first and undone if they do not fit. So a
    truncated, missing, mismatched or corrupt file on any rank leaves every engine as it was.
    Tensor data is checked against the CRC-32s written at save (corruption inside a file that
    still unpickles, such as a flipped bit; checkpoints saved before checksums are not checked).
    The optimizer files are memory-mapped, so the check reads their data from disk once and
    the load from the page cache.

    Raises:
        CheckpointError: missing, unreadable (truncated) or mismatched files on this or another
            rank, or a checkpoint from another world size, stage or sub-group layout (the message
            names the file or what differs); nothing is loaded then.
        ValueError: the ranks passed different tags and ``checkpoint.tag_validation`` is
            "fail" (see :func:`_same_tag`); nothing is loaded.
        OSError, RuntimeError: applying the checked files failed part-way (a swap-file write, on
            this or another rank): the engine is then a mix of the checkpoint and what it held,
            and its forward, backward, step and save_checkpoint raise until a load completes.
    """
    found = _read_on_every_rank(engine, load_dir, tag, lambda t: _check_files(engine, load_dir, t))
    if found is None:
        return None, None
    ckpt, meta, rng, states = found
    meta_file = os.path.join(ckpt, "model_states.pt")
    undo = []  # (object, its state before) of those already loaded
    try:
        for obj, state, what in ((engine.lr_scheduler if load_lr_scheduler_states else None, meta["lr_scheduler"],
                                  "LR scheduler"), (engine.loss_scaler, meta["loss_scaler"], "loss scaler")):
            if obj is not None and state is not None:
                undo.append((obj, _load_stateful(obj, state, what, meta_file)))
    except CheckpointError:
        for obj, before in undo:
            obj.load_state_dict(before)
        raise
    # from here on the engine changes: a failure (a swap-file write, on any rank) leaves it half
    # loaded, and the engine refuses to train on until a load completes (engine.state_guard)
    problem = None
    try:
        _load_module(engine.module, meta["module"], meta.get("excluded_frozen", []))
        if hasattr(engine.params, "settle_host_copies"):  # CUDA stages 1/2: a copy may still read the masters
            engine.params.settle_host_copies()
        for i, sd in enumerate(progress.counting(states, "zeroinf: loading optimizer state", unit="file")):
            engine.sub_optimizer.load_state(i, sd["master"], sd["exp_avg"], sd["exp_avg_sq"])
        del states
        for g, h in zip(engine.optimizer.param_groups, meta["param_groups"]):
            for k, v in h.items():
                g[k] = tuple(v) if k == "betas" else v
        _restore_counters(engine, meta)
        engine.optimizer_steps = meta["optimizer_steps"]  # Adam's, with the moments loaded above
        engine._forget_gradients()  # accumulated or held by no_sync before the load: not the saved state's
        engine._mark_weights_current()  # weights and masters came from the same checkpoint
        _set_rng_state(rng)
    except Exception as exc:  # every rank must reach the agreement below
        problem = exc
    except BaseException as exc:  # an interrupt: no collective
        engine.state_guard.failed(exc)
        raise
    try:
        _agree(engine, problem, lambda bad: RuntimeError(
            f"rank(s) {bad} failed while applying checkpoint {ckpt} (their errors name the cause); this rank loaded "
            "it, but the ranks' states no longer fit together"), "load_checkpoint")
    except BaseException as exc:
        engine.state_guard.failed(exc)
        raise
    engine.state_guard.completed()
    return ckpt, meta["client_state"]


def load_weights(engine, load_dir: str, tag: Optional[str] = None, strict: bool = True, counters: bool = False,
                 load_lr_scheduler_states: bool = True) -> Tuple[Optional[str], Optional[dict]]:
    """DeepSpeed's partial loads: ``load_checkpoint(..., load_module_only=True)`` (``counters``
    False: the weights alone, for fine-tuning) and ``load_optimizer_states=False`` (``counters``
    True: the weights, the step counters and, with ``load_lr_scheduler_states``, the LR
    scheduler). Collective. The weights are the checkpoint's fp32 masters (:func:`consolidate`,
    so a checkpoint of another world size or stage loads too), given to
    ``engine.module.load_state_dict(sd, strict=strict)``: a bf16/fp16 model's masters take them
    exactly, as from any fp32 state dict. The Adam moments with their step count
    (``optimizer_steps``), the loss scaler and (``counters`` False) the other counters stay the engine's; gradients accumulated before the load are dropped and
    a new accumulation window starts. Every rank builds the whole fp32 state dict in CPU memory
    (model size x 4 bytes).

    Returns ``(folder, client_state)``, or ``(None, None)`` as :func:`load` when there is no
    ``latest`` file.

    Raises:
        CheckpointError: a file is missing or corrupt on this or another rank (nothing loaded);
            the LR scheduler's saved state does not fit (nothing loaded).
        RuntimeError: ``strict`` and the keys differ (torch's message, after it copied the keys
            that match, as ``load_state_dict`` does).
    """
    def read(t: Optional[str]):
        ckpt, meta, sd = _consolidated(load_dir, t)
        if counters:
            _check_meta(engine, meta, os.path.join(ckpt, "model_states.pt"))
        return ckpt, meta, sd

    found = _read_on_every_rank(engine, load_dir, tag, read)
    if found is None:
        return None, None
    ckpt, meta, sd = found
    undo = None  # the scheduler's state before, restored when the weights do not load
    if counters and load_lr_scheduler_states and engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        undo = _load_stateful(engine.lr_scheduler, meta["lr_scheduler"], "LR scheduler",
                              os.path.join(ckpt, "model_states.pt"))
    try:
        _load_module(engine.module, sd, meta.get("excluded_frozen", []), strict=strict)
    except BaseException:
        if undo is not None:
            engine.lr_scheduler.load_state_dict(undo)
        raise
    del sd
    # not optimizer_steps: Adam's step count belongs with the moments, which stay the engine's
    # (restored beside fresh moments, the bias correction would shrink the first updates)
    if counters:
        _restore_counters(engine, meta)
    engine._micro_origin = engine.micro_steps  # a new accumulation window starts here
    engine._forget_gradients()  # computed on the weights the load replaced
    return ckpt, meta["client_state"]


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
