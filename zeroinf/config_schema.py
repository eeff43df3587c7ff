"""The typed, frozen dataclasses a DeepSpeed-format config is parsed into (:func:`zeroinf.config.parse_config`),
one per block, with DeepSpeed's defaults; a field's docstring gives its key and unit."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

__all__ = ["OptimizerConfig", "SchedulerConfig", "FP16Config", "BF16Config", "OffloadOptimizerConfig",
           "OffloadParamConfig", "ZeroConfig", "AioConfig", "CheckpointConfig", "ZeroInfExtraConfig", "ZeroInfConfig"]


@dataclass(frozen=True)
class OptimizerConfig:
    """``optimizer {type, params}``. Only Adam and AdamW.

    As in DeepSpeed, ``type: "Adam"`` means decoupled weight decay (AdamW) unless
    ``params.adam_w_mode`` is false; ``type: "AdamW"`` always decouples.
    """

    type: str = "adamw"          #: "adam" or "adamw" (lower case)
    lr: float = 1e-3
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    adam_w_mode: bool = True     #: decoupled weight decay (AdamW) when true, L2 (Adam) when false
    bias_correction: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    """``scheduler {type, params}``: DeepSpeed's WarmupLR, WarmupDecayLR or WarmupCosineLR.

    Field meanings follow ``deepspeed/runtime/lr_schedules.py``; ``total_num_steps`` is required
    for the two decaying schedules.
    """

    type: str                    #: "WarmupLR" | "WarmupDecayLR" | "WarmupCosineLR"
    warmup_min_lr: float = 0.0
    #: None: WarmupLR takes each param group's lr, WarmupDecayLR 1e-3 (DeepSpeed's defaults)
    warmup_max_lr: Optional[float] = None
    warmup_num_steps: int = 1000
    warmup_type: str = "log"     #: "log" or "linear"
    total_num_steps: Optional[int] = None
    warmup_min_ratio: float = 0.0   #: WarmupCosineLR only
    cos_min_ratio: float = 1e-4     #: WarmupCosineLR only


@dataclass(frozen=True)
class FP16Config:
    """``fp16``: half-precision parameters with fp32 master weights and loss scaling.

    ``loss_scale`` 0 means dynamic scaling: start at ``2**initial_scale_power``; on an inf/nan
    gradient skip the step and, once ``hysteresis`` overflows have been seen, halve the scale (never
    below ``min_loss_scale``); after ``loss_scale_window`` clean steps double it.
    """

    enabled: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0


@dataclass(frozen=True)
class BF16Config:
    """``bf16`` (alias ``bfloat16``): bf16 parameters and gradients, fp32 master weights."""

    enabled: bool = False


@dataclass(frozen=True)
class OffloadOptimizerConfig:
    """``zero_optimization.offload_optimizer``: where master weights and Adam moments live.

    ``buffer_count``: pinned buffers used to swap the optimizer state with NVMe; each holds one
    sub-group's swapped state (fp32 master, exp_avg, exp_avg_sq: ``12 * sub-group numel`` bytes;
    8 in fp32 stage 3, where the parameter partitions are the masters; 4 bytes less per element
    with ``state_dtype`` bf16); at least :func:`min_optimizer_buffer_count` (the sub-groups in flight).
    """

    device: str = "none"         #: "none" | "cpu" | "nvme"
    nvme_path: Optional[str] = None
    buffer_count: int = 4
    pin_memory: bool = False
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    #: "fp32" | "bf16": element type of the Adam moments in memory and swap files (zeroinf
    #: extension); bf16 is written with stochastic rounding, the master weights stay fp32
    state_dtype: str = "fp32"


@dataclass(frozen=True)
class OffloadParamConfig:
    """``zero_optimization.offload_param`` (stage 3 only): where parameter shards live."""

    device: str = "none"         #: "none" | "cpu" | "nvme"
    nvme_path: Optional[str] = None
    buffer_count: int = 5
    buffer_size: int = 100_000_000   #: elements per buffer
    max_in_cpu: int = 1_000_000_000  #: elements
    pin_memory: bool = False
    #: fraction of the parameter elements offloaded to ``device`` (zeroinf extension), in [0, 1]:
    #: stage-3 units in forward order stay on the compute device until about ``1 - ratio`` of the
    #: elements are resident; 1.0 offloads every unit
    ratio: float = 1.0


@dataclass(frozen=True)
class ZeroConfig:
    """``zero_optimization``; sizes are in elements, as in DeepSpeed.

    Stages 0–2 use ``sub_group_size``, ``reduce_bucket_size``, ``allgather_bucket_size`` and
    ``reduce_scatter`` (false: stage 2 all-reduces). ``overlap_comm``, ``contiguous_gradients``,
    ``allgather_partitions`` and ``round_robin_gradients`` are DeepSpeed performance switches
    accepted for compatibility: stages 0–2 here always reduce into contiguous flat buffers after the
    backward and all-gather the partitions, so they change no result. ``offload_optimizer.fast_init``
    likewise: the NVMe state is always initialised one sub-group at a time.
    """

    stage: int = 0
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    sub_group_size: int = 1_000_000_000
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = False
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    allgather_partitions: bool = True
    round_robin_gradients: bool = False
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = False


@dataclass(frozen=True)
class AioConfig:
    """``aio``: the async I/O handle's knobs, with DeepSpeed's names (bytes for sizes)."""

    block_size: int = 1 << 20
    queue_depth: int = 8
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = True
    #: zeroinf's: every swap write records CRC-32Cs and every swap read checks them (parameters,
    #: gradients and optimizer state on NVMe); false skips both
    verify_checksums: bool = True

    def as_dict(self) -> Dict[str, Any]:
        """The block as a dict for :meth:`zeroinf.io.AsyncIOHandle.from_config`."""
        return {"block_size": self.block_size, "queue_depth": self.queue_depth,
                "intra_op_parallelism": self.intra_op_parallelism, "single_submit": self.single_submit,
                "overlap_events": self.overlap_events, "verify_checksums": self.verify_checksums}


@dataclass(frozen=True)
class CheckpointConfig:
    """``checkpoint``: DeepSpeed's checkpoint block. Only ``tag_validation`` acts; the other
    keys are accepted at DeepSpeed's defaults (``load_universal``, ``use_node_local_storage``,
    ``parallel_write.pipeline_stage`` all false)."""

    #: what a save or load does when the ranks pass different tags: "ignore", "warn" (DeepSpeed's
    #: default) or "fail". Unlike DeepSpeed, no mode writes a checkpoint split across tags:
    #: "ignore" and "warn" use rank 0's tag on every rank ("warn" logs the others), "fail"
    #: raises on every rank before anything is written
    tag_validation: str = "warn"


@dataclass(frozen=True)
class ZeroInfExtraConfig:
    """``zeroinf``: settings DeepSpeed has no key for."""

    grad_norm_type: float = 2.0  #: 2.0 (DeepSpeed's) or math.inf ("inf" in JSON)
    #: stage 3: run the optimizer step on a background thread, unit by unit in forward order,
    #: overlapped with the next forward (a unit's gather waits for its own update only)
    overlap_step: bool = True
    #: stage 3: step each flat group's parameters during the backward, as soon as its gradient is
    #: reduced, so gradients are never stored (requires gradient_accumulation_steps 1, no
    #: gradient_clipping, no fp16; see [Note: optimizer in backward] in stage3/in_backward.py)
    optimizer_in_backward: bool = False
    #: initialize refuses a config whose estimated device, host or disk bytes exceed what is free
    #: (:func:`zeroinf.memcheck.check`), before anything is allocated
    check_memory: bool = True


@dataclass(frozen=True)
class ZeroInfConfig:
    """The whole validated config. Batch sizes are resolved so that
    ``train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size``.
    """

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    world_size: int = 1
    optimizer: Optional[OptimizerConfig] = None
    scheduler: Optional[SchedulerConfig] = None
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    gradient_clipping: float = 0.0
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    aio: AioConfig = field(default_factory=AioConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    steps_per_print: "int | float" = 10  #: rank 0 reports step, skipped steps and lr (engine._progress: the ``zeroinf`` logger, or stderr); 0: never
    wall_clock_breakdown: bool = False  #: ... and the last step's seconds per phase
    zeroinf: ZeroInfExtraConfig = field(default_factory=ZeroInfExtraConfig)
    #: the config as given, its deprecated spellings renamed and its "auto" values resolved;
    #: read through ``cfg["key"]`` / ``cfg.get(...)``, as DeepSpeed's ``engine.config`` dict
    source: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __getitem__(self, key: str) -> Any:
        """``cfg["zero_optimization"]``: the top-level ``key`` of :attr:`source` (KeyError if absent)."""
        return self.source[key]

    def get(self, key: str, default: Any = None) -> Any:
        """:attr:`source`'s top-level ``key``, or ``default``."""
        return self.source.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self.source

    def keys(self):
        return self.source.keys()

    def items(self):
        return self.source.items()

    def to_dict(self) -> Dict[str, Any]:
        """A deep copy of :attr:`source` (a plain dict: JSON-serialisable as the config given was)."""
        import copy
        return copy.deepcopy(dict(self.source))

    @property
    def precision(self) -> str:
        """"fp16", "bf16" or "fp32": the dtype of the model's parameters and gradients."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

