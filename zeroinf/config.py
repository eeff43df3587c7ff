"""DeepSpeed-compatible configuration: a JSON dict (or file) → typed, frozen, validated dataclasses.

Key names, meanings and defaults follow DeepSpeed's config (``deepspeed/runtime/config.py``,
``deepspeed/runtime/zero/config.py``, ``offload_config.py``, ``fp16/loss_scaler.py``,
``lr_schedules.py``), so a user's existing config carries over. :mod:`zeroinf.config_keys`
holds the table of every DeepSpeed 0.19.8 key (supported, mapped from a deprecated spelling,
ignored with a warning, or refused as not implemented) and applies it first; the keys left are
parsed into the dataclasses of :mod:`zeroinf.config_schema`, with their type and range checked
(:mod:`zeroinf.config_values` reads each value).

Every error message starts with the key path (``"zero_optimization.offload_optimizer.device: ..."``)
and the exception carries it as ``.key_path``. This module has no side effects: checks that touch
the machine (``nvme_path`` writable, free disk, pinned-memory budget) run in
:func:`zeroinf.initialize`.

Extension: the ``"zeroinf"`` block holds the few settings DeepSpeed has no key for
(``grad_norm_type``: the norm used for ``gradient_clipping`` and the global gradient norm,
2.0 by default as in DeepSpeed, or ``"inf"``; ``overlap_step``: stage 3 runs the optimizer
step in the background, overlapped with the next forward, true by default; ``check_memory``:
``initialize`` compares what the config needs with free memory and disk before allocating,
true by default, see :mod:`zeroinf.memcheck`).
"""
from __future__ import annotations

import json
import math
import os
import sys
import warnings
from typing import Any, Mapping, Optional, Tuple

from zeroinf.config_keys import (TABLE, ConfigDeprecationWarning, ConfigWarning, did_you_mean, normalize,
                                 unknown_key_message)
from zeroinf.config_schema import (AioConfig, BF16Config, CheckpointConfig, FP16Config, OffloadOptimizerConfig,
                                   OffloadParamConfig, OptimizerConfig, SchedulerConfig, ZeroConfig, ZeroInfConfig,
                                   ZeroInfExtraConfig)
from zeroinf.config_values import ConfigError, _block, _bool, _choice, _float, _int

__all__ = [
    "AioConfig", "BF16Config", "CheckpointConfig", "ConfigDeprecationWarning", "ConfigError", "ConfigWarning",
    "FP16Config", "OffloadOptimizerConfig", "OffloadParamConfig", "OptimizerConfig", "SchedulerConfig", "ZeroConfig",
    "ZeroInfConfig", "ZeroInfExtraConfig", "min_optimizer_buffer_count", "parse_config",
]


# ----------------------------------------------------------------------------------------------
# keys: which DeepSpeed keys are supported, mapped, ignored or refused is the table in
# zeroinf/config_keys.py; the dataclass fields (zeroinf/config_schema.py) are accepted in their blocks besides it

_EXTENSIONS = {
    "zero_optimization": tuple(ZeroConfig.__dataclass_fields__),
    "zero_optimization.offload_optimizer": tuple(OffloadOptimizerConfig.__dataclass_fields__),
    "zero_optimization.offload_param": tuple(OffloadParamConfig.__dataclass_fields__),
    "fp16": tuple(FP16Config.__dataclass_fields__), "bf16": tuple(BF16Config.__dataclass_fields__),
    "aio": tuple(AioConfig.__dataclass_fields__), "checkpoint": tuple(CheckpointConfig.__dataclass_fields__),
    "zeroinf": tuple(ZeroInfExtraConfig.__dataclass_fields__),
}
_SCHED_PARAMS = {
    "warmuplr": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "warmupdecaylr": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"),
    "warmupcosinelr": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type"),
}
_SCHED_NAMES = {"warmuplr": "WarmupLR", "warmupdecaylr": "WarmupDecayLR", "warmupcosinelr": "WarmupCosineLR"}
_SCHED_UNSUPPORTED = ("onecycle", "lrrangetest")


def min_optimizer_buffer_count(pipeline_read: bool, pipeline_write: bool) -> int:
    """Fewest ``offload_optimizer.buffer_count`` buffers the NVMe optimizer swapper can run with.

    One buffer holds one sub-group's swapped state (fp32 master weights, exp_avg, exp_avg_sq), and
    the sub-groups in flight are the one being stepped, plus the next one being read
    (``pipeline_read``), plus the previous one being written (``pipeline_write``):
    ``1 + pipeline_read + pipeline_write``.
    """
    return 1 + int(pipeline_read) + int(pipeline_write)


# ----------------------------------------------------------------------------------------------
# parsing


def _parse_optimizer(config: Mapping) -> Optional[OptimizerConfig]:
    block = _block(config, "optimizer", "")
    if not block:
        return None
    typ = block.get("type")
    if not isinstance(typ, str):
        raise ConfigError("optimizer.type", f"expected one of Adam, AdamW, got {typ!r}")
    if typ.lower() not in ("adam", "adamw"):
        raise ConfigError("optimizer.type", f"{typ!r} is not supported yet; supported: Adam, AdamW")
    typ = typ.lower()
    p = _block(block, "params", "optimizer")
    pre = "optimizer.params"
    for k in ("torch_adam", "fused"):   # implementation choices of DeepSpeed; ours is always CPU Adam
        if k in p and not isinstance(p[k], bool):
            raise ConfigError(f"{pre}.{k}", f"expected true or false, got {p[k]!r}")
    betas = p.get("betas", (0.9, 0.999))
    if (not isinstance(betas, (list, tuple)) or len(betas) != 2
            or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0 for b in betas)):
        raise ConfigError(f"{pre}.betas", f"expected two numbers in [0, 1), got {betas!r}")
    adam_w_mode = _bool(p, "adam_w_mode", pre, True)
    if typ == "adamw" and not adam_w_mode:
        raise ConfigError(f"{pre}.adam_w_mode", "false contradicts optimizer.type AdamW; use type Adam")
    return OptimizerConfig(type=typ, lr=_float(p, "lr", pre, 1e-3, min_value=0.0),
                           betas=(float(betas[0]), float(betas[1])),
                           eps=_float(p, "eps", pre, 1e-8, min_value=0.0),
                           weight_decay=_float(p, "weight_decay", pre, 0.0, min_value=0.0),
                           adam_w_mode=adam_w_mode, bias_correction=_bool(p, "bias_correction", pre, True))


def _parse_scheduler(config: Mapping) -> Optional[SchedulerConfig]:
    block = _block(config, "scheduler", "")
    if not block:
        return None
    typ = block.get("type")
    if not isinstance(typ, str) or typ.lower() not in _SCHED_PARAMS:
        if isinstance(typ, str) and typ.lower() in _SCHED_UNSUPPORTED:
            raise ConfigError("scheduler.type", f"{typ!r} is not supported yet; supported: {', '.join(_SCHED_NAMES.values())}")
        raise ConfigError("scheduler.type", f"expected one of {', '.join(_SCHED_NAMES.values())}, got {typ!r}")
    key = typ.lower()
    p = _block(block, "params", "scheduler")
    pre = "scheduler.params"
    for k in sorted(p):  # the table checked the keys of every type; these are this type's
        if k not in _SCHED_PARAMS[key]:
            if f"{pre}.{k}" not in TABLE:
                raise ConfigError(f"{pre}.{k}", unknown_key_message(f"{pre}.{k}", _SCHED_PARAMS[key]))
            raise ConfigError(f"{pre}.{k}", f"not a parameter of {_SCHED_NAMES[key]}"
                              f"{did_you_mean(f'{pre}.{k}', _SCHED_PARAMS[key])} {_SCHED_NAMES[key]} takes: "
                              f"{', '.join(_SCHED_PARAMS[key])}")
    total = _int(p, "total_num_steps", pre, None, min_value=1)
    if key != "warmuplr" and total is None:
        raise ConfigError(f"{pre}.total_num_steps", f"required by {_SCHED_NAMES[key]}")
    warmup = _int(p, "warmup_num_steps", pre, 1000, min_value=1)  # DeepSpeed raises for 0 too
    cfg = SchedulerConfig(
        type=_SCHED_NAMES[key], warmup_min_lr=_float(p, "warmup_min_lr", pre, 0.0, min_value=0.0),
        warmup_max_lr=_float(p, "warmup_max_lr", pre, None, min_value=0.0), warmup_num_steps=warmup,
        warmup_type=_choice(p, "warmup_type", pre, "log", ("log", "linear")), total_num_steps=total,
        warmup_min_ratio=_float(p, "warmup_min_ratio", pre, 0.0, min_value=0.0),
        cos_min_ratio=_float(p, "cos_min_ratio", pre, 1e-4, min_value=0.0))
    return cfg


def _parse_fp16(config: Mapping) -> FP16Config:
    p = _block(config, "fp16", "")
    return FP16Config(enabled=_bool(p, "enabled", "fp16", False),
                      loss_scale=_float(p, "loss_scale", "fp16", 0.0, min_value=0.0),
                      initial_scale_power=_int(p, "initial_scale_power", "fp16", 16, min_value=0,
                                               max_value=127),  # 2**128 is inf in fp32
                      loss_scale_window=_int(p, "loss_scale_window", "fp16", 1000, min_value=1),
                      hysteresis=_int(p, "hysteresis", "fp16", 2, min_value=1),
                      consecutive_hysteresis=_bool(p, "consecutive_hysteresis", "fp16", False),
                      min_loss_scale=_float(p, "min_loss_scale", "fp16", 1.0, min_value=0.0))


def _parse_bf16(config: Mapping) -> BF16Config:
    return BF16Config(enabled=_bool(_block(config, "bf16", ""), "enabled", "bf16", False))


def _parse_zero(config: Mapping) -> ZeroConfig:
    z = _block(config, "zero_optimization", "")
    pre = "zero_optimization"
    stage = _int(z, "stage", pre, 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"{pre}.stage", f"expected one of 0, 1, 2, 3, got {stage}")

    oo = _block(z, "offload_optimizer", pre)
    opre = f"{pre}.offload_optimizer"
    oo_cfg = OffloadOptimizerConfig(
        device=_choice(oo, "device", opre, "none", ("none", "cpu", "nvme")),
        nvme_path=_nvme_path(oo, opre), buffer_count=_int(oo, "buffer_count", opre, 4, min_value=1),
        pin_memory=_bool(oo, "pin_memory", opre, False), pipeline_read=_bool(oo, "pipeline_read", opre, False),
        pipeline_write=_bool(oo, "pipeline_write", opre, False), fast_init=_bool(oo, "fast_init", opre, False),
        state_dtype=_choice(oo, "state_dtype", opre, "fp32", ("fp32", "bf16")))
    if oo_cfg.device == "nvme":
        if not oo_cfg.nvme_path:
            raise ConfigError(f"{opre}.nvme_path", "required when device is nvme")
        need = min_optimizer_buffer_count(oo_cfg.pipeline_read, oo_cfg.pipeline_write)
        if oo_cfg.buffer_count < need:
            what = " and ".join(k for k in ("pipeline_read", "pipeline_write") if getattr(oo_cfg, k)) or "no pipelining"
            raise ConfigError(f"{opre}.buffer_count",
                              f"{oo_cfg.buffer_count} is too small for {what}; the minimum is {need} "
                              "(one buffer per sub-group in flight)")

    op = _block(z, "offload_param", pre)
    ppre = f"{pre}.offload_param"
    op_cfg = OffloadParamConfig(
        device=_choice(op, "device", ppre, "none", ("none", "cpu", "nvme")), nvme_path=_nvme_path(op, ppre),
        buffer_count=_int(op, "buffer_count", ppre, 5, min_value=1),
        buffer_size=_int(op, "buffer_size", ppre, 100_000_000, min_value=1),
        max_in_cpu=_int(op, "max_in_cpu", ppre, 1_000_000_000, min_value=0),
        pin_memory=_bool(op, "pin_memory", ppre, False),
        ratio=_float(op, "ratio", ppre, 1.0, min_value=0.0, max_value=1.0))
    if op_cfg.device == "none" and op.get("ratio") is not None:
        raise ConfigError(f"{ppre}.ratio", "needs offload_param.device cpu or nvme (with device none nothing is offloaded)")
    if op_cfg.device != "none" and stage != 3:
        # DeepSpeed reads offload_param at stage 3 only (DeepSpeed-Chat writes it at every stage)
        warnings.warn(f"zeroinf config: {ppre}.device {op_cfg.device!r} has no effect at zero_optimization.stage "
                      f"{stage} (parameters are offloaded at stage 3 only, as in DeepSpeed); ignored",
                      ConfigWarning, stacklevel=3)
        op_cfg = OffloadParamConfig()
    if op_cfg.device == "nvme" and not op_cfg.nvme_path:
        raise ConfigError(f"{ppre}.nvme_path", "required when device is nvme")
    # DeepSpeed reads stage3_max_live_parameters only to bound prefetching: at 0 nothing is
    # prefetched and gathers on demand are not bounded. zeroinf's bound also covers gathers on
    # demand, so 0 maps to no prefetch and no bound.
    max_live = _int(z, "stage3_max_live_parameters", pre, 1_000_000_000, min_value=0)
    return ZeroConfig(
        stage=stage, offload_optimizer=oo_cfg, offload_param=op_cfg,
        # 0 (DeepSpeed: one parameter per sub-group) takes the default: the sub-group size tiles
        # the optimizer step and changes no result
        sub_group_size=_int(z, "sub_group_size", pre, 1_000_000_000, min_value=0) or 1_000_000_000,
        reduce_bucket_size=_int(z, "reduce_bucket_size", pre, 500_000_000, min_value=1),
        allgather_bucket_size=_int(z, "allgather_bucket_size", pre, 500_000_000, min_value=1),
        overlap_comm=_bool(z, "overlap_comm", pre, stage == 3),
        contiguous_gradients=_bool(z, "contiguous_gradients", pre, True),
        reduce_scatter=_bool(z, "reduce_scatter", pre, True),
        allgather_partitions=_bool(z, "allgather_partitions", pre, True),
        round_robin_gradients=_bool(z, "round_robin_gradients", pre, False),
        stage3_prefetch_bucket_size=_int(z, "stage3_prefetch_bucket_size", pre, 50_000_000, min_value=0) if max_live else 0,
        stage3_param_persistence_threshold=_int(z, "stage3_param_persistence_threshold", pre, 100_000, min_value=0),
        stage3_max_live_parameters=max_live or sys.maxsize,
        stage3_max_reuse_distance=_int(z, "stage3_max_reuse_distance", pre, 1_000_000_000, min_value=0),
        stage3_gather_16bit_weights_on_model_save=_bool(z, "stage3_gather_16bit_weights_on_model_save", pre, False))


def _nvme_path(block: Mapping, prefix: str) -> Optional[str]:
    v = block.get("nvme_path")
    if v is None:
        return None
    if not isinstance(v, (str, os.PathLike)) or not str(v):
        raise ConfigError(f"{prefix}.nvme_path", f"expected a directory path string, got {v!r}")
    # "~" is the user's home, as a shell would read it (DeepSpeed makes a folder named "~" in the
    # working directory); absolute from the working directory at parse time, so a process that
    # changes directory between steps still finds its swap files
    return os.path.abspath(os.path.expanduser(os.fspath(v)))


def _parse_aio(config: Mapping) -> AioConfig:
    a = _block(config, "aio", "")
    par = _int(a, "intra_op_parallelism", "aio", 1, min_value=1)
    block_size = _int(a, "block_size", "aio", 1 << 20, min_value=512)
    if block_size % 512:
        raise ConfigError("aio.block_size", f"must be a multiple of 512 bytes (O_DIRECT), got {block_size}")
    return AioConfig(block_size=block_size, queue_depth=_int(a, "queue_depth", "aio", 8, min_value=1),
                     intra_op_parallelism=par, single_submit=_bool(a, "single_submit", "aio", False),
                     overlap_events=_bool(a, "overlap_events", "aio", True),
                     verify_checksums=_bool(a, "verify_checksums", "aio", True))


def _parse_checkpoint(config: Mapping) -> CheckpointConfig:
    c = _block(config, "checkpoint", "")
    _block(c, "parallel_write", "checkpoint")  # its one key, pipeline_stage, is accepted only at false
    return CheckpointConfig(tag_validation=_choice(c, "tag_validation", "checkpoint", "warn", ("ignore", "warn", "fail")))


def _parse_batch(config: Mapping, world_size: int) -> Tuple[int, int, int]:
    """Resolve the three batch keys the way DeepSpeed does (``_set_batch_related_parameters``)."""
    tbs = _int(config, "train_batch_size", "", None, min_value=1)
    mbs = _int(config, "train_micro_batch_size_per_gpu", "", None, min_value=1)
    gas = _int(config, "gradient_accumulation_steps", "", None, min_value=1)
    ws = world_size
    if tbs is not None and mbs is not None and gas is not None:
        if tbs != mbs * gas * ws:
            raise ConfigError("train_batch_size", f"{tbs} != train_micro_batch_size_per_gpu ({mbs}) * "
                              f"gradient_accumulation_steps ({gas}) * world size ({ws}) = {mbs * gas * ws}")
    elif tbs is not None and mbs is not None:
        if tbs % (mbs * ws):
            raise ConfigError("train_batch_size", f"{tbs} is not divisible by train_micro_batch_size_per_gpu "
                              f"({mbs}) * world size ({ws})")
        gas = tbs // (mbs * ws)
    elif tbs is not None and gas is not None:
        if tbs % (gas * ws):
            raise ConfigError("train_batch_size", f"{tbs} is not divisible by gradient_accumulation_steps "
                              f"({gas}) * world size ({ws})")
        mbs = tbs // (gas * ws)
    elif mbs is not None and gas is not None:
        tbs = mbs * gas * ws
    elif tbs is not None:
        if tbs % ws:
            raise ConfigError("train_batch_size", f"{tbs} is not divisible by world size ({ws})")
        gas, mbs = 1, tbs // ws
    elif mbs is not None:
        gas, tbs = 1, mbs * ws
    else:
        raise ConfigError("train_batch_size", "either train_batch_size or train_micro_batch_size_per_gpu is required")
    return tbs, mbs, gas


def _load(path: "str | os.PathLike") -> Any:
    """A config file as DeepSpeed reads it: JSON, or hjson (a superset of JSON with comments
    and unquoted keys) when that package is installed; a key given twice in one object is an
    error, as in DeepSpeed."""
    def no_duplicates(pairs):
        seen = {}
        for k, v in pairs:
            if k in seen:
                raise ConfigError(k, f"given twice in {os.fspath(path)}")
            seen[k] = v
        return seen
    try:
        import hjson
    except ImportError:
        hjson = None
    with open(path, "r", encoding="utf-8") as f:
        text = f.read()
    try:
        # JSON first: Python's json writes and reads Infinity (Accelerate's steps_per_print), hjson does not
        return json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as e:
        if hjson is None:
            raise ConfigError("", f"{os.fspath(path)} is not valid JSON: {e}") from None
    try:
        return hjson.loads(text, object_pairs_hook=no_duplicates)
    except ValueError as e:  # hjson.HjsonDecodeError
        raise ConfigError("", f"{os.fspath(path)} is not valid JSON or hjson: {e}") from None


def _steps_per_print(config: Mapping) -> "int | float":
    """``steps_per_print``: any number >= 0; inf (Accelerate writes it) and 0 mean never (0)."""
    v = _float(config, "steps_per_print", "", 10, min_value=0.0, allow_inf=True)
    if v != v:
        raise ConfigError("steps_per_print", "expected a number >= 0 or inf, got nan")
    if math.isinf(v):
        return 0
    return int(v) if v == int(v) else v


def parse_config(config: "Mapping[str, Any] | str | os.PathLike", world_size: int = 1, *,
                 auto_values: Optional[Mapping[str, Any]] = None) -> ZeroInfConfig:
    """Validate a DeepSpeed-format config and return it as frozen dataclasses.

    Which DeepSpeed keys are supported, mapped, ignored or refused is the table in
    :mod:`zeroinf.config_keys` (``docs/deepspeed-config.md``).

    Args:
        config: the config dict, or the path of a JSON file (hjson when that package is installed).
        world_size: data-parallel degree the batch sizes are checked against.
        auto_values: key path (``"optimizer.params.lr"``) -> value, for keys whose value is
            ``"auto"``: what an integration (a trainer) knows. An ``"auto"`` not given here takes
            DeepSpeed's default inside ``zero_optimization``, is derived for a batch size whose two
            partners are numbers, and raises elsewhere.

    Returns:
        :class:`ZeroInfConfig` with every default filled in and the batch sizes resolved.

    Warns:
        zeroinf.config_keys.ConfigDeprecationWarning: a deprecated spelling was read as its new key.
        zeroinf.config_keys.ConfigWarning: keys with no effect here were ignored, or an ``"auto"``
            took DeepSpeed's default.

    Raises:
        ConfigError: an unknown key (with a did-you-mean), a DeepSpeed feature not implemented
            (named), an ``"auto"`` with no value, a wrong type, or an impossible combination; the
            message starts with the key path and ``.key_path`` holds it.
        FileNotFoundError: ``config`` is a path that does not exist.
    """
    if isinstance(config, (str, os.PathLike)):
        config = _load(config)
    if not isinstance(config, Mapping):
        raise ConfigError("", f"expected a dict or a JSON file path, got {type(config).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    config = normalize(config, ConfigError, extensions=_EXTENSIONS, auto_values=auto_values or {})
    tbs, mbs, gas = _parse_batch(config, world_size)
    fp16, bf16 = _parse_fp16(config), _parse_bf16(config)
    if fp16.enabled and bf16.enabled:
        raise ConfigError("fp16.enabled", "fp16 and bf16 cannot both be enabled")
    extra = _block(config, "zeroinf", "")
    norm_type = _float(extra, "grad_norm_type", "zeroinf", 2.0, allow_inf=True)
    if not (norm_type == math.inf or norm_type >= 1.0):
        raise ConfigError("zeroinf.grad_norm_type", f"expected a number >= 1 or \"inf\", got {norm_type!r}")
    zero = _parse_zero(config)
    clipping = _float(config, "gradient_clipping", "", 0.0, min_value=0.0)
    in_bwd = _bool(extra, "optimizer_in_backward", "zeroinf", False)
    if in_bwd:
        # the step of a flat group runs before the other gradients exist: nothing that needs all
        # of them (accumulation, the clipping norm, an overflow check) can come first
        for bad, why in ((zero.stage != 3, f"needs zero_optimization.stage 3, got {zero.stage}"),
                         (gas != 1, f"needs gradient_accumulation_steps 1, got {gas}"),
                         (clipping > 0, f"cannot clip: gradient_clipping is {clipping} (the global norm "
                                        "is known only after every group was stepped); set it to 0"),
                         (fp16.enabled, "cannot skip overflowed steps: fp16 is enabled; use bf16 or fp32")):
            if bad:
                raise ConfigError("zeroinf.optimizer_in_backward", why)
    return ZeroInfConfig(
        train_batch_size=tbs, train_micro_batch_size_per_gpu=mbs, gradient_accumulation_steps=gas,
        world_size=world_size, optimizer=_parse_optimizer(config), scheduler=_parse_scheduler(config),
        fp16=fp16, bf16=bf16, gradient_clipping=clipping,
        zero_optimization=zero, aio=_parse_aio(config), checkpoint=_parse_checkpoint(config),
        steps_per_print=_steps_per_print(config),
        wall_clock_breakdown=_bool(config, "wall_clock_breakdown", "", False),
        zeroinf=ZeroInfExtraConfig(grad_norm_type=norm_type,
                                   overlap_step=_bool(extra, "overlap_step", "zeroinf", True),
                                   optimizer_in_backward=in_bwd,
                                   check_memory=_bool(extra, "check_memory", "zeroinf", True)),
        source=config)
