"""Save an engine, and load it back whole (:func:`load`) or its weights alone (:func:`load_weights`)."""
from __future__ import annotations

import errno
import logging
import os
import shutil
from typing import Any, Dict, Optional, Tuple

import torch

from zeroinf import progress
from zeroinf.io.swapper import tensor_crc32

from .consolidation import _consolidated
from .files import _FORMAT, CheckpointError, _optim_file, _replace_dir, save_atomically, write_latest
from .module_state import _layout, _load_module, _module_state, frozen_names
from .ranks import _agree, _agree_or_drop, _barrier, _read_on_every_rank, _same_tag
from .rng import _rng_state, _set_rng_state
from .verify import _check_client_state, _check_files, _check_meta

_log = logging.getLogger("zeroinf")


def _save_id(engine, tag: str) -> str:
    """What every file of one save carries (the same on every rank): the tag and the engine's
    counters. Every file is checked against it, so a file from another save put into the folder
    (a partial restore) is refused, though each file's own checks pass."""
    # optimizer steps only: they are collective, so every rank counts them alike (micro-batches and
    # samples are counted per rank, so a rank that ran fewer would make every load refuse the save)
    return f"{tag}@steps={engine.global_steps},applied={engine.optimizer_steps},skipped={engine.skipped_steps}"


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
        engine.params.settle_host_copies()  # CUDA stages 1/2: a copy may still read the masters
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
