"""Stage-3 settings: the ``zero_optimization`` keys that drive parameter partitioning.

Names, meanings and defaults follow DeepSpeed's ``zero_optimization`` block
(``stage3_*`` keys and the ``offload_param`` sub-block). Element counts are numbers of
parameters (elements), not bytes, as in DeepSpeed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

from zeroinf.config import ConfigError

__all__ = ["Stage3Options", "Stage3ConfigError"]


class Stage3ConfigError(ConfigError):
    """A stage-3 setting is invalid or does not fit the model (checked at initialize); a
    :class:`zeroinf.config.ConfigError` whose message starts with the key path (``.key_path``)."""


_TIERS = ("none", "cpu", "nvme")


@dataclass(frozen=True)
class Stage3Options:
    """Stage-3 policy, frozen.

    Attributes:
        offload_param_device: home tier of each rank's parameter partitions: ``"none"`` (the
            compute device), ``"cpu"`` (pinned host memory when an accelerator exists) or
            ``"nvme"`` (swap files under ``nvme_path``).
        offload_param_ratio: fraction of the parameter elements whose partitions live on
            ``offload_param_device`` (``offload_param.ratio``, a zeroinf extension), in [0, 1]:
            the units in forward order keep theirs on the compute device until about
            ``1 - ratio`` of the elements are resident (:func:`~.swap_plan.unit_tiers`); 1.0
            offloads every unit, 0.0 none. Ignored with device ``"none"``.
        nvme_path: directory for the parameter swap files (``offload_param.nvme_path``).
        buffer_count: pinned staging buffers for NVMe reads (``offload_param.buffer_count``).
        buffer_size: elements per staging buffer; must hold the largest unit partition.
        max_in_cpu: elements of NVMe partitions kept cached in host memory (``max_in_cpu``).
        pin_memory: pin host buffers (only possible when an accelerator is present).
        param_persistence_threshold: parameters with fewer elements stay gathered on every rank
            (``stage3_param_persistence_threshold``).
        max_live_parameters: upper bound on gathered elements, prefetched ones included
            (``stage3_max_live_parameters``).
        max_reuse_distance: a unit used again within this many gathered elements is not
            released in between (``stage3_max_reuse_distance``).
        prefetch_bucket_size: elements prefetched ahead of use (``stage3_prefetch_bucket_size``);
            0 disables prefetch.
        unit_classes: module class names that form units (like FSDP's
            ``transformer_layer_cls_to_wrap``); ``None`` finds them automatically.
        aio: the DeepSpeed ``aio`` block handed to ``AsyncIOHandle.from_config``.
        grads_on_nvme: keep the accumulated fp32 gradient partitions in swap files next to the
            parameter partitions instead of host memory (needs ``offload_param.device: nvme``);
            the engine turns it on when parameters and optimizer are both on NVMe, so host
            memory does not grow with the model.
    """

    offload_param_device: str = "none"
    offload_param_ratio: float = 1.0
    nvme_path: Optional[str] = None
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000
    pin_memory: bool = False
    param_persistence_threshold: int = 100_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    prefetch_bucket_size: int = 50_000_000
    unit_classes: Optional[Tuple[str, ...]] = None
    aio: Dict[str, Any] = field(default_factory=dict)
    grads_on_nvme: bool = False

    def __post_init__(self):
        if self.offload_param_device not in _TIERS:
            raise Stage3ConfigError("zero_optimization.offload_param.device",
                                    f"{self.offload_param_device!r} is not one of {list(_TIERS)}")
        r = self.offload_param_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0:
            raise Stage3ConfigError("zero_optimization.offload_param.ratio", f"must be a number in [0, 1], got {r!r}")
        if self.grads_on_nvme and self.offload_param_device != "nvme":
            raise Stage3ConfigError("zero_optimization.offload_param.device",
                                    "gradient partitions on NVMe need the parameters on NVMe")
        if self.offload_param_device == "nvme" and not self.nvme_path:
            raise Stage3ConfigError("zero_optimization.offload_param.nvme_path",
                                    "required when offload_param.device is 'nvme'")
        for name, key in (("buffer_count", "offload_param.buffer_count"),
                          ("buffer_size", "offload_param.buffer_size"),
                          ("max_live_parameters", "stage3_max_live_parameters")):
            if int(getattr(self, name)) < 1:
                raise Stage3ConfigError(f"zero_optimization.{key}", f"must be >= 1, got {getattr(self, name)}")
        for name, key in (("max_in_cpu", "offload_param.max_in_cpu"),
                          ("param_persistence_threshold", "stage3_param_persistence_threshold"),
                          ("max_reuse_distance", "stage3_max_reuse_distance"),
                          ("prefetch_bucket_size", "stage3_prefetch_bucket_size")):
            if int(getattr(self, name)) < 0:
                raise Stage3ConfigError(f"zero_optimization.{key}", f"must be >= 0, got {getattr(self, name)}")

    @classmethod
    def from_zero_config(cls, zero: Any, aio: Any = None) -> "Stage3Options":
        """Build from a ``zero_optimization`` mapping (DeepSpeed key names) or an object
        with the same attribute names (part 1's parsed dataclass).

        Raises:
            Stage3ConfigError: a value is out of range; the message names the key path.
        """
        def get(obj, key, default=None):
            if obj is None:
                return default
            if isinstance(obj, Mapping):
                return obj.get(key, default)
            return getattr(obj, key, default)

        off = get(zero, "offload_param")
        dev = get(off, "device", "none") if off is not None else "none"
        dev = "none" if dev is None else str(getattr(dev, "value", dev))
        if isinstance(aio, Mapping):
            aio_d = dict(aio)
        elif aio is not None and dataclasses.is_dataclass(aio):
            aio_d = dataclasses.asdict(aio)
        else:
            aio_d = {}
        d = cls()
        return cls(
            offload_param_device=dev,
            offload_param_ratio=get(off, "ratio", d.offload_param_ratio),
            nvme_path=None if get(off, "nvme_path") is None else str(get(off, "nvme_path")),
            buffer_count=int(get(off, "buffer_count", d.buffer_count)),
            buffer_size=int(get(off, "buffer_size", d.buffer_size)),
            max_in_cpu=int(get(off, "max_in_cpu", d.max_in_cpu)),
            pin_memory=bool(get(off, "pin_memory", d.pin_memory)),
            param_persistence_threshold=int(get(zero, "stage3_param_persistence_threshold", d.param_persistence_threshold)),
            max_live_parameters=int(get(zero, "stage3_max_live_parameters", d.max_live_parameters)),
            max_reuse_distance=int(get(zero, "stage3_max_reuse_distance", d.max_reuse_distance)),
            prefetch_bucket_size=int(get(zero, "stage3_prefetch_bucket_size", d.prefetch_bucket_size)),
            aio=aio_d,
        )
