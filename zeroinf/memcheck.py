"""Memory checked before anything is allocated: what a configuration needs against what is free.

:func:`check` compares the estimator's model of a configuration (:func:`zeroinf.estimate.estimate`,
stage 3's working set included: :mod:`zeroinf.working_set`) with the memory free now, per tier:

* device: free accelerator memory (``torch.cuda.mem_get_info``); on a CPU-only host the device is
  the host's memory, so device and host bytes are one need against host RAM;
* host: available RAM (``psutil.virtual_memory().available``), per node (all local ranks);
* disk: free bytes of the file system of each ``nvme_path`` (``shutil.disk_usage`` of the path or,
  before it is created, its nearest existing parent), plus the bytes of an earlier run's swap files
  this run overwrites and of ``zeroinf.Init`` swap files ``initialize`` removes.

Memory tiers keep :data:`MARGIN` of what is free in reserve (the CUDA context, allocator
fragmentation, the OS); swap files have exact sizes, so disk keeps none. Parameters the model
already holds in memory count as allocated. When a tier falls short, :class:`InsufficientMemoryError`
lists every figure and the placement ``zeroinf plan`` would choose for the same free memory
(:func:`zeroinf.placement.choose`), as the config keys to set.

What the estimator leaves out (activations, temporary buffers) is not checked; every parameter
counts as trainable. ``"zeroinf": {"check_memory": false}`` skips the check.

For tests, :data:`FREE_ENV` replaces measured free bytes: ``host=8GB,device=1GB,disk=100GB``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

from zeroinf.estimate import (Estimate, ModelInfo, estimate, format_size, placement_from_config,
                              swap_buffers_from_config)
from zeroinf.sizes import parse_bytes
from zeroinf.working_set import GatherLimits, working_set

__all__ = ["MARGIN", "FREE_ENV", "InsufficientMemoryError", "TierCheck", "MemoryReport", "model_info_of",
           "free_bytes", "assess", "check", "check_hf_config"]

#: fraction of free device and host memory held back
MARGIN = 0.05
#: environment variable read by :func:`free_bytes`, for tests: ``host=8GB,device=1GB,disk=100GB``
FREE_ENV = "ZEROINF_MEMCHECK_FREE"


class InsufficientMemoryError(ValueError):
    """A configuration needs more memory than is free; raised before anything is allocated.

    The message has a headline, then one line per tier (needed and free GB, 1e9 bytes) and the
    placement that would fit. ``.report`` is the :class:`MemoryReport`."""

    def __init__(self, report: "MemoryReport"):
        super().__init__(report.message())
        self.report = report


@dataclass(frozen=True)
class TierCheck:
    """One tier's figures, bytes.

    Attributes:
        tier: ``"device"``, ``"host"`` or ``"disk"``.
        where: what it is (``"cuda:0"``, ``"host RAM"``, a path).
        need: bytes the configuration needs there (per rank for a device, per node otherwise).
        free: bytes free there now (disk: with the swap files this run replaces).
        usable: ``free`` less the margin.
        held: bytes of ``need`` already allocated (the model's own parameters).
    """

    tier: str
    where: str
    need: int
    free: int
    usable: int
    held: int = 0

    @property
    def fits(self) -> bool:
        """Whether the bytes still to allocate (``need - held``) fit the usable bytes."""
        return self.need - self.held <= self.usable

    def line(self) -> str:
        """One line of the refusal: needed, free and usable GB (1e9 bytes) of this tier, and the verdict."""
        held = f" ({format_size(self.held)} GB of it allocated already: the model)" if self.held else ""
        margin = f" ({format_size(self.usable)} GB usable)" if self.usable != self.free else ""
        verdict = "ok" if self.fits else f"SHORT by {format_size(self.need - self.held - self.usable)} GB"
        return (f"  {self.tier:<6} {self.where}: needs {format_size(self.need)} GB{held}, "
                f"{format_size(self.free)} GB free{margin}: {verdict}")


@dataclass(frozen=True)
class MemoryReport:
    """What :func:`assess` found.

    Attributes:
        info: the model as the estimator sees it (full shapes).
        estimate: the configuration's estimate.
        tiers: the figures per tier.
        suggestion: the ``zero_optimization`` block :func:`zeroinf.placement.make_config` writes for the
            first placement that fits the same free memory; None when it fits already or nothing fits.
        suggested: that placement's estimate.
    """

    info: ModelInfo
    estimate: Estimate
    tiers: Tuple[TierCheck, ...]
    suggestion: Optional[dict] = None
    suggested: Optional[Estimate] = None

    @property
    def fits(self) -> bool:
        """Whether every tier fits."""
        return all(t.fits for t in self.tiers)

    def message(self) -> str:
        """The refusal: a headline naming each short tier, one line per tier, and the suggested placement."""
        e, short = self.estimate, [t for t in self.tiers if not t.fits]
        lines = [f"not enough memory for {e.placement.label()} with {self.info.params:,} parameters on {e.world_size} "
                 f"rank(s): {', '.join(f'{t.where} needs {format_size(t.need - t.held)} GB more, has {format_size(t.usable)} GB' for t in short)}"
                 f"; nothing was allocated (GB = 1e9 bytes)"]
        lines += [t.line() for t in self.tiers]
        if self.suggestion is not None:
            s = self.suggested
            lines.append(f"a placement that fits (what `zeroinf plan` writes; device {format_size(s.per_device_bytes)}, "
                         f"host {format_size(s.per_host_bytes)}, disk {format_size(s.nvme_bytes)} GB), the config keys to set:")
            lines += [f"  zero_optimization.{k} = {json.dumps(v)}" for k, v in self.suggestion.items()]
        else:
            lines.append("no placement fits this free memory (zeroinf plan tried them all): use more devices or "
                         "nodes, free memory or disk, or a smaller model")
        lines.append('("zeroinf": {"check_memory": false} in the config skips this check)')
        return "\n".join(lines)


def model_info_of(module, zero, world_size: int = 1) -> ModelInfo:
    """The estimator's view of ``module``: unique parameters by their full shapes (those
    ``zeroinf.Init`` partitioned away included, and on the meta device), and the stage-3 units
    and working set the engine forms under ``zero`` (the parsed ``zero_optimization`` block).
    Allocates nothing.
    """
    from zeroinf.runtime.stage3.init import init_shapes
    from zeroinf.runtime.stage3.units import build_units, find_unit_modules

    shapes = init_shapes(module)
    unique = {id(p): p for p in module.parameters()}.values()
    params = sum(math.prod(shapes.get(p, p.shape)) for p in unique)
    units = build_units(module, find_unit_modules(module), zero.stage3_param_persistence_threshold, world_size, shapes)
    persistent, root, blocks = units[0].numel, units[1].numel, [u.numel for u in units[2:]]
    live, formula = working_set(persistent, root, blocks, GatherLimits.from_zero_config(zero))
    sizes = tuple(n for n in (persistent, root, *blocks) if n)
    return ModelInfo(name=type(module).__name__, params=max(params, 1), largest_unit=max(sizes, default=None),
                     live_params=live, live_formula=formula, unit_sizes=sizes or None)


def _existing(path: str) -> Path:
    """``path`` or its nearest existing parent (``nvme_path`` is created by the engine)."""
    p = Path(path).absolute()
    return next(q for q in (p, *p.parents) if q.exists())


def free_bytes(device, paths: List[str] = (), given: Optional[Mapping[str, int]] = None) -> Dict[str, int]:
    """Free bytes now: ``"device"`` (CUDA only), ``"host"`` and ``"disk:<path>"`` per path.

    ``given`` (``{"host": n, "device": n, "disk": n}``, any of them; default :data:`FREE_ENV`'s
    ``host=8GB,...``) replaces the measured figures, ``"disk"`` for every path.

    Raises:
        ValueError: :data:`FREE_ENV` is malformed (names it).
    """
    import psutil
    import torch

    if given is None:
        given = {}
        for item in filter(None, (x.strip() for x in os.environ.get(FREE_ENV, "").split(","))):
            key, _, value = item.partition("=")
            if key not in ("host", "device", "disk") or not value:
                raise ValueError(f"{FREE_ENV}: {item!r} is not host=SIZE, device=SIZE or disk=SIZE")
            given[key] = parse_bytes(value)
    device = torch.device(device)
    out = {"host": given["host"] if "host" in given else psutil.virtual_memory().available}
    if device.type == "cuda":
        out["device"] = given["device"] if "device" in given else torch.cuda.mem_get_info(device)[0]
    for path in paths:
        out[f"disk:{path}"] = given["disk"] if "disk" in given else shutil.disk_usage(_existing(path)).free
    return out


def _disk_needs(est: Estimate, zero, rank: int) -> Dict[str, Tuple[int, List[str]]]:
    """Swap bytes per rank by ``nvme_path``, with the folders the engine writes there."""
    needs: Dict[str, Tuple[int, List[str]]] = {}
    for t in est.terms:
        if t.tier != "nvme":
            continue
        if t.name.startswith("optimizer state"):
            path = zero.offload_optimizer.nvme_path
            folder = os.path.join(path, "zeroinf_optimizer", f"rank{rank}")
        else:
            path = zero.offload_param.nvme_path
            folder = os.path.join(path, f"zeroinf_params_rank{rank}")
        nbytes, folders = needs.get(path, (0, []))
        needs[path] = (nbytes + t.bytes, folders + [folder] * (folder not in folders))
    return needs


def _held_bytes(module, device_type: str) -> int:
    """Bytes of ``module``'s parameters already in memory on ``device_type`` (not partitioned away)."""
    from zeroinf.runtime.stage3.init import init_shapes

    shapes = init_shapes(module)
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in module.parameters()}.values()
               if p not in shapes and p.device.type == device_type)


def assess(module, cfg, *, world_size: int = 1, rank: int = 0, gpus_per_node: Optional[int] = None,
           device="cpu", freed: Optional[Mapping[str, int]] = None,
           free: Optional[Mapping[str, int]] = None) -> MemoryReport:
    """Figures of ``cfg`` (a parsed config, :func:`zeroinf.config.parse_config`) for ``module`` on
    ``device`` (``"cpu"`` or a CUDA device); no allocation. ``gpus_per_node``: ranks per node
    (default ``LOCAL_WORLD_SIZE``, else ``world_size``). ``freed``: bytes of ``zeroinf.Init``
    swap files initialize removes, by folder. ``free``: ``{"host": bytes, "device": bytes,
    "disk": bytes}`` in place of measured figures (any of them; see :func:`free_bytes`). The
    suggestion, when ``cfg`` does not fit, is
    :func:`zeroinf.placement.choose`'s first placement that fits the same free memory."""
    import torch

    from zeroinf.io.swapper import reusable_bytes
    from zeroinf.placement import Limits, choose, make_config, swap_for

    device = torch.device(device)
    gpn = gpus_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    gpn = gpn if gpn >= 1 and world_size % gpn == 0 else world_size
    zero = cfg.zero_optimization
    info = model_info_of(module, zero, world_size)
    placement = placement_from_config(cfg)
    common = dict(world_size=world_size, gpus_per_node=gpn, precision=cfg.precision, optimizer="adam",
                  state_dtype=zero.offload_optimizer.state_dtype)
    est = estimate(info.params, placement, live_params=info.live_params, live_params_formula=info.live_formula,
                   swap=swap_buffers_from_config(cfg), optimizer_pin_memory=zero.offload_optimizer.pin_memory,
                   param_pin_memory=zero.offload_param.pin_memory, unit_sizes=info.unit_sizes,
                   optimizer_in_backward=cfg.zeroinf.optimizer_in_backward, **common)
    disk = _disk_needs(est, zero, rank)
    # the suggestion's swap files go to the config's nvme_path, else under the working directory
    spare = zero.offload_param.nvme_path or zero.offload_optimizer.nvme_path or os.getcwd()
    paths = list(dict.fromkeys([*disk, spare]))
    free = free_bytes(device, paths, free)
    freed = freed or {}

    def keep(n: int) -> int:
        return int(n * (1 - MARGIN))

    on_cpu = device.type != "cuda"
    held = _held_bytes(module, "cpu" if on_cpu else device.type) * (gpn if on_cpu else 1)
    tiers = []
    if on_cpu:  # the device is the host's memory
        need = est.per_device_bytes * gpn + est.per_host_bytes
        tiers.append(TierCheck("host", "host RAM (the device is the CPU)", need, free["host"], keep(free["host"]),
                               min(held, need)))
    else:
        tiers.append(TierCheck("device", str(device), est.per_device_bytes, free["device"], keep(free["device"]),
                               min(held, est.per_device_bytes)))
        tiers.append(TierCheck("host", "host RAM", est.per_host_bytes, free["host"], keep(free["host"])))
    for path in paths:
        if shutil.disk_usage(_existing(path)).total == 0:
            continue  # procfs, sysfs: no disk; the engine's path check names the path it cannot write
        nbytes, folders = disk.get(path, (0, []))
        have = free[f"disk:{path}"] + sum(reusable_bytes(f) for f in folders)
        have += sum(n for f, n in freed.items() if Path(f).absolute().is_relative_to(Path(path).absolute()))
        tiers.append(TierCheck("disk", str(Path(path).absolute()), nbytes * gpn, have, have))
    report = MemoryReport(info, est, tuple(tiers))
    if report.fits:
        return report
    host_free = keep(free["host"]) + (held if on_cpu else 0)
    spare_free = next((t.free for t in tiers if t.tier == "disk" and t.where == str(Path(spare).absolute())), 0)
    limits = Limits(gpu_mem=host_free if on_cpu else keep(free["device"]) + held, cpu_mem=host_free,
                    nvme=spare_free, reserve=0.0, device_is_host=on_cpu)
    plan = choose(info, limits, **common)
    if plan.chosen is None:
        return report
    block = make_config(plan.chosen.placement, precision=cfg.precision, nvme_path=str(Path(spare).absolute()),
                        max_live_parameters=plan.live_params, swap=swap_for(info, world_size),
                        state_dtype=zero.offload_optimizer.state_dtype)["zero_optimization"]
    for key in ("offload_param", "offload_optimizer"):  # a tier left as the config has it would not fit
        block.setdefault(key, {"device": "none"})
    return dataclasses.replace(report, suggestion=block, suggested=plan.chosen)


def check(module, cfg, **kwargs) -> MemoryReport:
    """:func:`assess`, raising when a tier falls short.

    Raises:
        InsufficientMemoryError: a tier needs more than it has usable; the message lists every
            tier's figures and the placement that would fit.
    """
    report = assess(module, cfg, **kwargs)
    if not report.fits:
        raise InsufficientMemoryError(report)
    return report


def check_hf_config(hf_config, cfg, **kwargs) -> MemoryReport:
    """:func:`check` for a Hugging Face causal-LM config, built on the meta device (nothing
    allocated), so a model too large for memory is refused before it is built."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(hf_config)
    return check(module, cfg, **kwargs)
