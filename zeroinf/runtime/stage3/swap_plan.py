"""What stage 3 will put on disk, decided from the config and the unit layout before anything is
written: whether the fp32 partitions are the optimizer's masters, whether gradient partitions
go to swap files, and the bytes of every swap file of a rank (for ``zeroinf.initialize``'s disk
check and ``zeroinf.memcheck``).
"""
from __future__ import annotations

import os
from typing import Dict, List, Sequence, Tuple

import torch

from zeroinf.model_sizes import resident_units

from .options import Stage3Options

__all__ = ["INIT_MASTERS", "all_fp32", "grads_on_nvme", "group_index", "master_in_partitions", "swap_file_bytes",
           "unit_tiers"]

#: what :func:`swap_file_bytes` calls the fp32 initial values kept until the optimizer takes them
INIT_MASTERS = "fp32 initial values (until the optimizer takes them)"


def group_index(groups: Sequence[Sequence[torch.nn.Parameter]]) -> Dict[torch.nn.Parameter, int]:
    """Parameter -> index of its optimizer param group."""
    return {p: gi for gi, ps in enumerate(groups) for p in ps}


def unit_tiers(units: Sequence, options: Stage3Options) -> List[str]:
    """Home tier of each unit's partitions (``"none"``, ``"cpu"`` or ``"nvme"``), by unit index.

    With ``offload_param.ratio`` r below 1, the units in index order (persistent, root, then the
    blocks in forward order) stay on the compute device (``"none"``) for the shortest prefix
    whose partition elements come closest to ``(1 - r)`` of all of them
    (:func:`zeroinf.model_sizes.resident_units`); the rest go to ``offload_param.device``. A unit
    is the granularity: all its flat groups share one tier, so a gather reads from one tier. Every rank gets the same answer (partition sizes are padded to
    the same ``shard_numel`` on every rank). ``units``: ``Unit`` objects with ``groups``.
    """
    tier = options.offload_param_device
    if tier == "none":
        return [tier] * len(units)
    k = resident_units([sum(g.shard_numel for g in u.groups) for u in units], options.offload_param_ratio)
    return ["none"] * k + [tier] * (len(units) - k)


def master_in_partitions(cfg) -> bool:
    """Whether the optimizer's fp32 master weights are the parameter partitions themselves
    ([Note: master in the partitions]): fp32 training, optimizer state on NVMe, partitions in
    host memory or on NVMe."""
    zc = cfg.zero_optimization
    return (cfg.precision == "fp32" and zc.offload_optimizer.device == "nvme"
            and zc.offload_param.device in ("cpu", "nvme"))


def grads_on_nvme(cfg) -> bool:
    """Gradient partitions go to swap files with both offloads on NVMe (ZeRO-Infinity), unless
    the optimizer runs in the backward and consumes them as they are reduced."""
    zc = cfg.zero_optimization
    return (zc.offload_param.device == "nvme" and zc.offload_optimizer.device == "nvme"
            and not cfg.zeroinf.optimizer_in_backward)


def swap_file_bytes(model: torch.nn.Module, cfg, groups: Sequence[Sequence[torch.nn.Parameter]], *,
                    rank: int = 0, world_size: int = 1) -> List[Tuple[str, str, str, int, str]]:
    """NVMe swap files that :func:`engine_manager` and the engine's optimizer will create on
    this rank, computed from the unit layout before anything is written.

    Returns ``(config key, nvme_path, swap folder, bytes, what)`` per kind of file: parameter
    partitions in the training dtype of the units :func:`unit_tiers` puts on NVMe
    (``offload_param.device: nvme``, ``offload_param.ratio``), trainable gradient
    partitions in fp32 and in the training dtype (both offloads on NVMe, ZeRO-Infinity, unless
    ``zeroinf.optimizer_in_backward``; [Note: gradients on NVMe]), optimizer state at 12 bytes per trainable partition
    element (fp32 master, exp_avg, exp_avg_sq; ``offload_optimizer.device: nvme``), 8 when the
    partitions are the masters (:func:`master_in_partitions`), 4 bytes less with bf16 moments
    (``offload_optimizer.state_dtype``); and the fp32 values that ``zeroinf.Init`` made of
    trainable partitions cast to bf16/fp16 since, until the optimizer takes them ([Note: Init
    masters]; ``what`` is :data:`INIT_MASTERS`: the disk check counts them as replaced by the
    optimizer's files, [Note: Init masters on disk] in ``zeroinf/runtime/engine.py``).
    """
    from .held import init_dtype, init_shapes
    from .units import build_units, find_unit_modules

    opts = Stage3Options.from_zero_config(cfg.zero_optimization, cfg.aio.as_dict())
    zc = cfg.zero_optimization
    units = build_units(model, find_unit_modules(model, opts.unit_classes), opts.param_persistence_threshold,
                        world_size, init_shapes(model), group_index(groups))
    parts = [g for u in units for g in u.groups]
    trainable = {p for ps in groups for p in ps}
    out = []
    if zc.offload_param.device == "nvme":
        key, path = "zero_optimization.offload_param.nvme_path", opts.nvme_path
        folder = os.path.join(path, f"zeroinf_params_rank{rank}")
        on_nvme = [g for u, tier in zip(units, unit_tiers(units, opts)) if tier == "nvme" for g in u.groups]
        out.append((key, path, folder, sum(g.shard_numel * g.dtype.itemsize for g in on_nvme),
                    "parameter partitions"))
        # [Note: Init masters]: fp32 values of trainable partitions cast since zeroinf.Init, kept
        # in swap files until the optimizer's initial state takes them (each removed as it is
        # taken, before the optimizer's files of its flat group are made)
        wide = [g for g in parts if g.dtype != torch.float32 and g.dtype.is_floating_point
                and any(s.param in trainable for s in g.slots)
                and any(init_dtype(s.param) == torch.float32 for s in g.slots)]
        if wide:
            out.append((key, path, folder, 4 * sum(g.shard_numel for g in wide), INIT_MASTERS))
        if grads_on_nvme(cfg):
            # fp32 (accumulated) and, for bf16/fp16 training, one micro-batch's in the training
            # dtype; none for groups the optimizer does not step (the manager makes no file for them)
            out.append((key, path, folder, sum((4 + (0 if g.dtype == torch.float32 else g.dtype.itemsize))
                                               * g.shard_numel for g in parts
                                               if any(s.param in trainable for s in g.slots)),
                        "gradient partitions"))
    if zc.offload_optimizer.device == "nvme":
        path = zc.offload_optimizer.nvme_path
        masters = master_in_partitions(cfg) and all_fp32(  # as Stage3EngineParams decides
            g for g in parts if any(s.param in trainable for s in g.slots))
        from ..optimizer import state_bytes_per_element
        per = state_bytes_per_element({"fp32": torch.float32, "bf16": torch.bfloat16}[zc.offload_optimizer.state_dtype],
                                      master=not masters)
        out.append(("zero_optimization.offload_optimizer.nvme_path", path,
                    os.path.join(path, "zeroinf_optimizer", f"rank{rank}"),
                    per * sum(g.shard_numel for g in parts if any(s.param in trainable for s in g.slots)),
                    f"optimizer state ({per} bytes per element)"))
    return out


def all_fp32(groups) -> bool:
    """Whether every given (trainable) flat group is fp32: only then are the partitions the
    masters ([Note: master in the partitions]); a model left in bf16 under ``"precision":
    "fp32"`` keeps the optimizer's own fp32 copy."""
    return all(g.dtype == torch.float32 for g in groups)
