"""The cheapest placement that fits, and the DeepSpeed-format config for it (the library half of
``zeroinf plan``, whose command line is :mod:`zeroinf.cli.plan`).

Placements are tried cheapest first (:data:`LADDER`): no offload (ZeRO stage 0, 1, 2, 3: more
communication, less memory), then the optimizer state on the CPU, then the parameters on the CPU as
well, then NVMe (optimizer first, parameters last). The first whose accelerator, host and NVMe bytes
(:mod:`zeroinf.estimate`) fit the usable memory wins; every rejected one keeps the tier that
overflowed. A winner that offloads parameters then keeps as many of them on the device as still
fits: the smallest ``offload_param.ratio`` of :data:`PARAM_RATIOS` whose estimate fits (the
parameters stay resident unit by unit, in forward order, and are neither read from nor written to
their tier). :func:`make_config` writes a config that :func:`zeroinf.config.parse_config` accepts.

With bandwidths, :func:`step_time_bounds` gives lower bounds on the step time, per node:

* optimizer: ``params stepped on the node's CPU / Adam rate`` (params/s for the whole host), when the
  optimizer is offloaded;
* NVMe: ``bytes read / read bandwidth + bytes written / write bandwidth`` of the node's swap traffic
  (reads and writes share the device): optimizer on NVMe reads and writes ``K x ceil(P/N)`` per rank;
  parameters on NVMe are read in forward and in backward and written after the step,
  ``Ψp x`` the offloaded part of ``ceil(P/N)`` each time (:attr:`Estimate.offloaded_params`:
  all of it, less the units ``offload_param.ratio`` keeps on the device).

Units: bytes in the API; GB = 1e9 bytes and GB/s = 1e9 bytes/s.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from zeroinf.config import ZeroConfig
from zeroinf.estimate import (GB, OPTIMIZERS, PLAN_SWAP, PRECISIONS, Estimate, ModelInfo, Placement, SwapBuffers,
                              estimate, format_size, swap_for)

__all__ = ["LADDER", "PARAM_RATIOS", "ADAM_BYTES_PER_PARAM", "MAX_LIVE_PARAMETERS", "MAX_UNITS", "Limits", "Attempt", "Plan",
           "check_fit", "choose", "make_config", "swap_for", "step_time_bounds"]

#: Placements from cheapest to most offloaded.
LADDER: Tuple[Placement, ...] = (
    Placement(0), Placement(1), Placement(2), Placement(3),
    Placement(2, "none", "cpu"), Placement(3, "none", "cpu"),
    Placement(3, "cpu", "cpu"),
    Placement(2, "none", "nvme"), Placement(3, "none", "nvme"), Placement(3, "cpu", "nvme"),
    Placement(3, "nvme", "nvme"),
)

#: ``offload_param.ratio`` values the plan tries, most resident first, once a placement that
#: offloads every parameter fits
PARAM_RATIOS: Tuple[float, ...] = tuple(k / 10 for k in range(10))

#: Bytes one Adam step reads and writes per parameter, as bench/cpu_adam.py counts its GB/s: fp32
#: grads read p, g, m, v (16 B) and write p, m, v (12 B); the offload step reads fp32 master, m, v
#: and a 16-bit grad (14 B) and writes them back with a 16-bit param (14 B). 28 B either way.
ADAM_BYTES_PER_PARAM = 28
#: the engine's default stage3_max_live_parameters (DeepSpeed's too)
MAX_LIVE_PARAMETERS = ZeroConfig.stage3_max_live_parameters
#: without the model's units plan assumes a unit holds at least P / MAX_UNITS parameters, as in a
#: model of 100 equal blocks; real ones gather more at once (the embedding, the persistent unit)
MAX_UNITS = 100


@dataclass(frozen=True)
class Limits:
    """Memory available to training.

    Attributes:
        gpu_mem: bytes per accelerator.
        cpu_mem: bytes of host memory per node.
        nvme: bytes of NVMe swap space per node (0: no NVMe).
        reserve: fraction of each held back (CUDA context, fragmentation, the OS), 0 <= reserve < 1.
        device_is_host: the compute device is the CPU (no accelerator): device and host bytes
            share ``cpu_mem``, and a placement fits only when their sum over the node's ranks does.
    """

    gpu_mem: int
    cpu_mem: int
    nvme: int = 0
    reserve: float = 0.1
    device_is_host: bool = False

    def usable(self, tier: str) -> int:
        total = {"device": self.gpu_mem, "host": self.cpu_mem, "nvme": self.nvme}[tier]
        return int(total * (1.0 - self.reserve))


@dataclass(frozen=True)
class Attempt:
    """One placement tried: its estimate and why it does not fit (empty when it fits)."""

    estimate: Estimate
    reasons: Tuple[str, ...]

    @property
    def fits(self) -> bool:
        return not self.reasons


@dataclass(frozen=True)
class Plan:
    """The outcome: every attempt in ladder order up to the first that fits (``chosen``, or None)."""

    attempts: Tuple[Attempt, ...]
    chosen: Optional[Estimate]
    #: stage 3 without the model's own live-parameter figure: the most parameters the chosen
    #: placement gathers on a device at once, which its config must then cap
    #: (``stage3_max_live_parameters``); None otherwise
    live_params: Optional[int] = None


def check_fit(est: Estimate, limits: Limits) -> Tuple[str, ...]:
    """Reasons ``est`` does not fit ``limits`` (GB = 1e9 bytes in the messages); empty if it fits."""
    reasons = []
    for tier, used, what in (("device", est.per_device_bytes, "per device"),
                             ("host", est.per_host_bytes, "per host"),
                             ("nvme", est.nvme_bytes, "NVMe per node")):
        cap = limits.usable(tier)
        if used > cap:
            if tier == "nvme" and limits.nvme == 0:
                reasons.append(f"needs {format_size(used)} GB of NVMe and --nvme gives none")
            else:
                reasons.append(f"{what} {format_size(used)} GB > {format_size(cap)} GB usable")
    both = est.per_device_bytes * est.gpus_per_node + est.per_host_bytes  # per node
    if limits.device_is_host and not reasons and both > limits.usable("host"):
        reasons.append(f"device + host (one memory: the device is the CPU) {format_size(both)} GB > "
                       f"{format_size(limits.usable('host'))} GB usable")
    return tuple(reasons)


def choose(info: ModelInfo, limits: Limits, *, world_size: int, gpus_per_node: int, precision: str = "bf16",
           optimizer: str = "adam", activations: int = 0, activations_formula: str = "",
           swap: Optional[SwapBuffers] = None, state_dtype: str = "fp32") -> Plan:
    """Try :data:`LADDER` in order; stop at the first placement that fits.

    Args:
        info: the model (P, the largest stage-3 unit and the unit sizes, which size the NVMe swap buffers).
        limits: memory per accelerator, per host and NVMe per node.
        world_size, gpus_per_node, precision, optimizer, activations, activations_formula,
            state_dtype: as :func:`zeroinf.estimate.estimate`.
        swap: pinned swap settings (default :func:`swap_for`).

    Returns:
        :class:`Plan`; ``chosen`` is None when nothing fits.

    Without ``info.live_params`` (``--params`` alone: the units are unknown) a stage-3 placement
    counts the parameters it may gather on a device at once as the device memory left over
    allows, at most ``min(P, stage3_max_live_parameters default)`` and at least ``ceil(P /
    MAX_UNITS)`` (a device with less room does not fit); :attr:`Plan.live_params` then says what
    the config must cap. Counting none, parameters on the CPU "fit" in 1 byte of device memory;
    with no floor, in 72 bytes.

    A fitting placement that offloads parameters is followed by one more attempt, the first of
    :data:`PARAM_RATIOS` whose estimate fits with the same live parameters (when none does, the
    placement with ratio 1.0 is chosen, and no attempt is added).
    """
    swap = swap or swap_for(info, world_size)
    attempts = []

    def est_with(pl, live):
        return estimate(info.params, pl, world_size=world_size, gpus_per_node=gpus_per_node, precision=precision,
                        optimizer=optimizer, live_params=live, activations=activations,
                        activations_formula=activations_formula, swap=swap, unit_sizes=info.unit_sizes,
                        state_dtype=state_dtype)
    for pl in LADDER:
        live = info.live_params
        if live is None and pl.stage == 3:
            prec = PRECISIONS[precision]
            room = (limits.usable("device") - est_with(pl, None).per_device_bytes) // (prec.param_bytes + prec.grad_bytes)
            live = max(-(-info.params // MAX_UNITS), min(info.params, MAX_LIVE_PARAMETERS, room))
        est = est_with(pl, live)
        attempt = Attempt(est, check_fit(est, limits))
        attempts.append(attempt)
        if attempt.fits:
            if pl.offload_param != "none":  # keep what still fits of the parameters on the device
                for ratio in PARAM_RATIOS:
                    partial = est_with(dataclasses.replace(pl, param_ratio=ratio), live)
                    if not check_fit(partial, limits):
                        attempts.append(Attempt(partial, ()))
                        est = partial
                        break
            return Plan(tuple(attempts), est, live if info.live_params is None and pl.stage == 3 else None)
    return Plan(tuple(attempts), None)


def make_config(placement: Placement, *, precision: str = "bf16", micro_batch: int = 1, nvme_path: str = "/local_nvme",
                swap: SwapBuffers = PLAN_SWAP, lr: float = 1e-4, optimizer: str = "adamw",
                max_live_parameters: Optional[int] = None, state_dtype: str = "fp32") -> dict:
    """A DeepSpeed-format config dict for ``placement``.

    Holds ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps`` 1, the precision block,
    an ``optimizer`` block (Adam/AdamW), and ``zero_optimization`` with the stage, the offload blocks
    (pinned; NVMe with ``nvme_path``, the swap buffers of ``swap``, and pipelined reads and writes)
    and ``sub_group_size``; at stage 3 with ``max_live_parameters``, ``stage3_max_live_parameters``
    (a model whose root and largest unit together need more runs at that sum: the engine raises
    the limit with a warning); ``offload_param.ratio`` when the placement's ``param_ratio`` is
    below 1; with
    ``state_dtype`` "bf16" and the optimizer offloaded, ``offload_optimizer.state_dtype``.

    Raises:
        ValueError: an optimizer other than adam/adamw (the engine steps only those).
    """
    if optimizer not in ("adam", "adamw"):
        raise ValueError(f"optimizer: {optimizer!r}: the engine supports only adam and adamw")
    cfg: Dict = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1}
    if precision in ("bf16", "fp16"):
        cfg[precision] = {"enabled": True}
    cfg["optimizer"] = {"type": "AdamW" if optimizer == "adamw" else "Adam",
                        "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}}
    zero: Dict = {"stage": placement.stage, "sub_group_size": swap.sub_group_size}
    if placement.stage == 3 and max_live_parameters is not None:
        zero["stage3_max_live_parameters"] = int(max_live_parameters)
    if placement.offload_optimizer != "none":
        block = {"device": placement.offload_optimizer, "pin_memory": True}
        if state_dtype != "fp32":
            block["state_dtype"] = state_dtype
        if placement.offload_optimizer == "nvme":
            block.update(nvme_path=nvme_path, buffer_count=swap.optimizer_buffer_count,
                         pipeline_read=swap.optimizer_pipeline_read, pipeline_write=swap.optimizer_pipeline_write)
        zero["offload_optimizer"] = block
    if placement.offload_param != "none":
        block = {"device": placement.offload_param, "pin_memory": True}
        if placement.offload_param == "nvme":
            block.update(nvme_path=nvme_path, buffer_count=swap.param_buffer_count,
                         buffer_size=swap.param_buffer_size, max_in_cpu=swap.param_max_in_cpu)
        if placement.param_ratio < 1.0:
            block["ratio"] = placement.param_ratio
        zero["offload_param"] = block
    cfg["zero_optimization"] = zero
    return cfg


def step_time_bounds(est: Estimate, *, adam_params_per_s: Optional[float] = None,
                     nvme_read_gbps: Optional[float] = None, nvme_write_gbps: Optional[float] = None,
                     precision: str = "bf16", optimizer: str = "adam",
                     state_dtype: str = "fp32") -> Dict[str, Tuple[float, str]]:
    """Lower bounds on one optimizer step's time, seconds, per node, with their formulas.

    Args:
        est: the placement's estimate (P, N, gpus per node).
        adam_params_per_s: CPU Adam rate of the whole host, parameters per second.
        nvme_read_gbps, nvme_write_gbps: NVMe bandwidth of the node, GB/s (1e9 bytes/s).
        state_dtype: ``offload_optimizer.state_dtype``; "bf16" moves the moments at 2 bytes each.

    Returns:
        ``{"optimizer": (seconds, formula), "nvme": (seconds, formula)}``, each present only when it
        applies to the placement and its rate is known.
    """
    out: Dict[str, Tuple[float, str]] = {}
    pl = est.placement
    n, gpn = est.world_size, est.gpus_per_node
    shard = -(-est.params // n)
    part = shard if pl.stage >= 1 else est.params
    if pl.offload_optimizer != "none" and adam_params_per_s:
        stepped = part * gpn
        out["optimizer"] = (stepped / adam_params_per_s,
                            f"{gpn} ranks x {part:,} params / {adam_params_per_s:.3g} params/s")
    read = write = 0
    k = 4 + OPTIMIZERS[optimizer] // (2 if state_dtype == "bf16" else 1)
    psize = PRECISIONS[precision].param_bytes
    if pl.offload_optimizer == "nvme":
        read += k * part
        write += k * part
    if pl.offload_param == "nvme":  # the partition less the units offload_param.ratio keeps resident
        read += 2 * psize * est.offloaded_params
        write += psize * est.offloaded_params
    if (read or write) and nvme_read_gbps and nvme_write_gbps:
        read, write = read * gpn, write * gpn
        secs = read / (nvme_read_gbps * GB) + write / (nvme_write_gbps * GB)
        out["nvme"] = (secs, f"read {format_size(read)} GB / {nvme_read_gbps:.3g} GB/s + "
                             f"write {format_size(write)} GB / {nvme_write_gbps:.3g} GB/s")
    return out
