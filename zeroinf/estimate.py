"""Memory per accelerator, per host and on NVMe for DDP, ZeRO-1/2/3 and ZeRO-Offload/Infinity.

The memory model behind ``zeroinf estimate`` and ``zeroinf plan`` (their command lines are
:mod:`zeroinf.cli.estimate` and :mod:`zeroinf.cli.plan`). Units: bytes everywhere in the API; the command
prints decimal GB (10**9 bytes) by default, or GiB (2**30 bytes) with ``--unit GiB``, and says
which in the table header.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", Sec. 3.1 and Fig. 1): with P parameters, N data-parallel ranks,
``Ψp``/``Ψg`` bytes per parameter and per gradient and ``K`` bytes of optimizer state per parameter
(for mixed-precision Adam: Ψp = Ψg = 2, K = 12 = fp32 master 4 + exp_avg 4 + exp_avg_sq 4)::

    stage 0 (DDP)  (Ψp + Ψg + K) P            mixed-precision Adam: 16P
    stage 1        (Ψp + Ψg) P + K P/N                               4P + 12P/N
    stage 2        Ψp P + (Ψg + K) P/N                               2P + 14P/N
    stage 3        (Ψp + Ψg + K) P/N                                 16P/N

P/N is rounded up (``ceil(P/N)``): every rank holds an equal, padded partition.

Offload moves named terms off the accelerator (ZeRO-Offload, Ren et al. 2021; ZeRO-Infinity,
Rajbhandari et al. 2021), much as DeepSpeed's estimators count them
(``estimate_zero2_model_states_mem_needs``, ``estimate_zero3_model_states_mem_needs``, which also
add a 1.5x safety factor and the host copy made while the model is built):

* ``offload_optimizer`` cpu|nvme: the K-byte optimizer state goes to host memory or NVMe
  (with an fp32 master copy even in fp32 training, so K = 4 + the optimizer's own state there,
  except at stage 3 in fp32 with the optimizer on NVMe and the parameters on cpu or NVMe, where
  the parameter partitions are the masters);
  the rank's gradient partition goes to host memory in fp32 (4 bytes per parameter; the CPU
  optimizer reads it there) — except with both params and optimizer on NVMe at stage 3, where the
  engine swaps the fp32 gradient partition to NVMe too. With partitioned gradients (stage 2, 3) the accelerator then keeps none
  (only a reduce bucket, not counted); with stages 0 and 1 it still computes the full gradient.
* ``offload_param`` cpu|nvme (stage 3 only): the Ψp-byte parameter partition goes to host
  memory or NVMe. The accelerator holds only the units gathered for compute: every stage-3 row
  counts ``(Ψp + Ψg) x`` the parameters held gathered at once, the working set of
  :func:`zeroinf.working_set.working_set` (the largest block with those prefetched or kept for
  reuse beside it, bounded by ``stage3_max_live_parameters``) with a model, and with a bare
  parameter count ``min(P, stage3_max_live_parameters)``, the most the engine gathers.
  With ``offload_param.ratio`` r < 1 (:attr:`Placement.param_ratio`) only the offloaded part of
  the partition goes there; the leading units' partitions stay on the accelerator
  (:func:`zeroinf.model_sizes.resident_units`, about ``(1 - r) x ceil(P/N)`` elements), and
  the NVMe staging buffers and ``max_in_cpu`` cache exist only for an offloaded part.
* NVMe rows add the pinned host memory the swapping needs (buffers and the ``max_in_cpu`` parameter
  cache; defaults of :mod:`zeroinf.config` unless a config gives them; see :class:`SwapBuffers`).
  Buffer bytes come from :func:`zeroinf.io.pinned_pool_bytes`, the bytes the pool will lock. At
  stage 3 they are sized by the model's units (:attr:`ModelInfo.unit_sizes`: the engine cuts the
  optimizer's sub-groups per unit partition); with a bare parameter count, by upper bounds.

Pinned host memory: each host term says whether it is page-locked (:attr:`Term.pinned`): the swap
buffer pools are locked on any host (``mlock`` without CUDA); the gradient partition of stages
0-2, and with ``pin_memory`` the CPU-resident optimizer state, parameter partitions and
``max_in_cpu`` cache, are pinned by torch, which pins only with CUDA: on a CPU-only host they are
ordinary memory. :meth:`Estimate.pinned_bytes` adds them up for a host with or without CUDA; on
the host at hand it is what ``engine.stats()["pinned_bytes"]`` reports for a single param group
(each param group's partition is padded to a multiple of N). With CUDA the engine pins besides,
not counted here: stage 1/2's host copy of the parameter partition (Ψp bytes per parameter,
shared with the fp32 master in fp32 training), two fp32 staging buffers of at most 16 MiB with
gradient accumulation, and stage 3's gradient shards while they land from the device.

"Per host" and "NVMe" are per node: the sum over the node's ``gpus_per_node`` ranks.

Not counted: the CUDA context and allocator fragmentation, reduce/all-gather buckets, temporary
buffers of the optimizer step, the host copy of the model while it is built (use ``zeroinf.Init``),
and activations unless their flags are given (:func:`activation_bytes`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

# the model's sizes and the parsers and formatters, importable from here as the memory model's API
from zeroinf.estimate_format import GB, GiB, format_count, format_size, parse_bytes, parse_count  # noqa: F401
from zeroinf.model_sizes import (PERSISTENCE_THRESHOLD, PRESETS, ModelInfo, count_params,  # noqa: F401
                                 load_model_config, model_info, stage3_unit_sizes, stage3_units)

__all__ = [
    "GB", "GiB", "PRESETS", "PRECISIONS", "OPTIMIZERS", "PLACEMENTS", "Precision", "Placement",
    "ModelInfo", "SwapBuffers", "Term", "Estimate", "parse_count", "parse_bytes", "load_model_config",
    "model_info", "count_params", "stage3_unit_sizes", "stage3_units", "PERSISTENCE_THRESHOLD", "activation_bytes", "estimate", "estimate_all", "swap_buffers_from_config",
    "placement_from_config", "PLAN_SWAP", "swap_for", "format_count", "format_size", "format_table",
]


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model-state kind for one training precision.

    Attributes:
        name: ``"fp16"``, ``"bf16"`` (16-bit params and grads with fp32 master weights) or ``"fp32"``.
        param_bytes: Ψp, bytes per parameter of the compute copy.
        grad_bytes: Ψg, bytes per gradient element.
        master_bytes: bytes per parameter of the fp32 master copy held with the optimizer (0 in fp32:
            the parameters are the master weights).
    """

    name: str
    param_bytes: int
    grad_bytes: int
    master_bytes: int


PRECISIONS: Dict[str, Precision] = {
    "fp16": Precision("fp16", 2, 2, 4),
    "bf16": Precision("bf16", 2, 2, 4),
    "fp32": Precision("fp32", 4, 4, 0),
}

#: fp32 optimizer state per parameter, bytes, without the master copy: Adam/AdamW exp_avg and
#: exp_avg_sq; SGD with momentum its momentum buffer; Adagrad its sum of squares; plain SGD none.
OPTIMIZERS: Dict[str, int] = {"adam": 8, "adamw": 8, "sgd-momentum": 4, "adagrad": 4, "sgd": 0}

OFFLOAD_DEVICES = ("none", "cpu", "nvme")


@dataclass(frozen=True)
class Placement:
    """Where the model states live: ZeRO stage and the two DeepSpeed offload devices.

    Attributes:
        stage: ZeRO stage 0 (plain data parallel), 1, 2 or 3.
        offload_param: ``zero_optimization.offload_param.device``: none|cpu|nvme (stage 3 only).
        offload_optimizer: ``zero_optimization.offload_optimizer.device``: none|cpu|nvme.
        param_ratio: ``zero_optimization.offload_param.ratio`` (zeroinf extension), the fraction
            of the parameters offloaded to ``offload_param``, 0 to 1 (default 1.0); the rest stay
            on the device.

    Raises:
        ValueError: unknown stage or device, ``offload_param`` other than none below stage 3, or a
            ``param_ratio`` outside [0, 1] or below 1 with ``offload_param`` none.
    """

    stage: int
    offload_param: str = "none"
    offload_optimizer: str = "none"
    param_ratio: float = 1.0

    def __post_init__(self):
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_optimization.stage: {self.stage!r} is not one of 0, 1, 2, 3")
        for key, dev in (("offload_param", self.offload_param), ("offload_optimizer", self.offload_optimizer)):
            if dev not in OFFLOAD_DEVICES:
                raise ValueError(f"zero_optimization.{key}.device: {dev!r} is not one of none, cpu, nvme")
        if self.offload_param != "none" and self.stage != 3:
            raise ValueError(f"zero_optimization.offload_param.device: {self.offload_param!r} needs stage 3 "
                             f"(parameters are partitioned only at stage 3), got stage {self.stage}")
        if not 0.0 <= self.param_ratio <= 1.0 or (self.param_ratio < 1.0 and self.offload_param == "none"):
            raise ValueError(f"zero_optimization.offload_param.ratio: {self.param_ratio!r} must be in [0, 1], and "
                             "below 1 only with offload_param cpu or nvme")

    def param_label(self) -> str:
        """``offload_param``, with ``r=<ratio>`` when only part of the parameters is offloaded."""
        return self.offload_param + (f" r={self.param_ratio:g}" if self.param_ratio < 1.0 else "")

    def label(self) -> str:
        return f"stage {self.stage}, offload_param={self.param_label()}, offload_optimizer={self.offload_optimizer}"


#: Every placement the table shows: stages 0-2 with the optimizer on each tier, and stage 3 with
#: all nine pairs of parameter and optimizer tiers.
PLACEMENTS: Tuple[Placement, ...] = tuple(
    [Placement(s, "none", o) for s in (0, 1, 2) for o in OFFLOAD_DEVICES]
    + [Placement(3, p, o) for p in OFFLOAD_DEVICES for o in OFFLOAD_DEVICES])


@dataclass(frozen=True)
class SwapBuffers:
    """Pinned host memory that NVMe swapping keeps, sized as ``zeroinf.config`` defines the keys.

    Attributes:
        param_buffer_count: ``offload_param.buffer_count`` (default 5).
        param_buffer_size: ``offload_param.buffer_size``, parameter elements per buffer (default 1e8).
        param_max_in_cpu: ``offload_param.max_in_cpu``, parameter elements of this rank's partition
            cached in pinned memory (default 1e9).
        param_prefetch: ``stage3_prefetch_bucket_size`` > 0 (default 5e7): the engine reads one
            unit ahead, so it pins at least 2 parameter buffers, one partition each (one param
            group), raising a ``buffer_count`` of 1 (:meth:`Stage3ParameterManager.min_buffer_count`
            in zeroinf/runtime/stage3/layout.py; it refuses a config whose ``buffer_count x
            buffer_size`` elements cannot hold them).
        optimizer_buffer_count: ``offload_optimizer.buffer_count`` (default 4); each buffer holds one
            sub-group's fp32 master weights and optimizer moments: ``K x sub-group elements`` bytes
            (see :class:`zeroinf.config.OffloadOptimizerConfig`). The engine pins
            ``zeroinf.runtime.optimizer.optimizer_buffer_count``: ``buffer_count`` capped at the
            number of sub-groups with ``pipeline_read`` (all are prefetched during the last
            backward), else at the ``1 + pipeline_write`` in flight.
        optimizer_pipeline_read, optimizer_pipeline_write: ``offload_optimizer.pipeline_read`` /
            ``pipeline_write`` (default false).
        sub_group_size: ``zero_optimization.sub_group_size``, elements (default 1e9); the rank's
            partition is split into ``ceil(partition / sub_group_size)`` sub-groups of at most that
            (at stage 3 each unit's partition is split on its own).
        alignment: byte alignment of each buffer (O_DIRECT: 4096); :func:`zeroinf.io.pinned_pool_bytes`
            rounds every buffer up to ``max(alignment, page size)``.
    """

    param_buffer_count: int = 5
    param_buffer_size: int = 100_000_000
    param_max_in_cpu: int = 1_000_000_000
    param_prefetch: bool = True
    optimizer_buffer_count: int = 4
    optimizer_pipeline_read: bool = False
    optimizer_pipeline_write: bool = False
    sub_group_size: int = 1_000_000_000
    alignment: int = 4096


#: The swap settings ``zeroinf plan`` writes, and the table assumes without ``--config``: sub-groups
#: of 1e8 elements (the 1e9 default would pin 4 x 12 GB per rank for optimizer buffers) and no
#: ``max_in_cpu`` parameter cache (parameters go to NVMe when the host cannot hold them), and 3
#: optimizer buffers (the fewest that pipelined reads and writes need; every one is used).
PLAN_SWAP = SwapBuffers(sub_group_size=100_000_000, param_max_in_cpu=0, optimizer_buffer_count=3,
                        optimizer_pipeline_read=True, optimizer_pipeline_write=True)


def swap_for(info: ModelInfo, world_size: int) -> SwapBuffers:
    """The swap settings the plan writes: :data:`PLAN_SWAP`, with
    ``offload_param.buffer_size`` set to what one buffer must hold: the largest unit's partition
    ``ceil(largest_unit / N)`` when the model is known (:func:`stage3_units`) (the engine rejects less, and a buffer never
    holds more), else ``min(1e8, ceil(P/N))``."""
    if info.largest_unit:
        size = -(-info.largest_unit // world_size)
    else:
        size = min(PLAN_SWAP.param_buffer_size, -(-info.params // world_size))
    return dataclasses.replace(PLAN_SWAP, param_buffer_size=size)


def _pool_bytes(count: int, size: int, alignment: int) -> int:
    from zeroinf.io import pinned_pool_bytes  # contract B: the bytes PinnedBufferPool will lock

    return pinned_pool_bytes(count, size, alignment)


@dataclass(frozen=True)
class Term:
    """One addend of an estimate.

    Attributes:
        name: what it is (``"parameters"``, ``"optimizer state"``, ...).
        tier: ``"device"``, ``"host"`` or ``"nvme"``.
        bytes: bytes per rank.
        formula: how ``bytes`` was computed, with the numbers filled in.
        pinned: whether the bytes are page-locked host memory: ``"always"`` (a swap buffer pool,
            locked on any host), ``"cuda"`` (pinned by torch, which pins only where CUDA is
            available; ordinary memory elsewhere) or ``"never"``.
    """

    name: str
    tier: str
    bytes: int
    formula: str
    pinned: str = "never"


@dataclass(frozen=True)
class Estimate:
    """Memory of one placement.

    Attributes:
        placement: the stage and offload devices.
        params: P, the number of parameters.
        world_size: N, data-parallel ranks.
        gpus_per_node: ranks per host; host and NVMe totals are per node.
        terms: the addends, bytes per rank.
        offloaded_params: elements of a rank's stage-3 parameter partition on
            ``offload_param``'s tier: ``ceil(P/N)`` less those ``offload_param.ratio`` keeps on
            the device (0 when ``offload_param`` is none).
    """

    placement: Placement
    params: int
    world_size: int
    gpus_per_node: int
    terms: Tuple[Term, ...]
    offloaded_params: int = 0

    def _tier(self, tier: str) -> int:
        return sum(t.bytes for t in self.terms if t.tier == tier)

    @property
    def per_device_bytes(self) -> int:
        """Bytes on each accelerator."""
        return self._tier("device")

    @property
    def per_host_bytes(self) -> int:
        """Bytes of host memory per node, pinned or not: per-rank host terms x gpus_per_node."""
        return self._tier("host") * self.gpus_per_node

    def pinned_bytes(self, cuda: bool) -> int:
        """Bytes of page-locked host memory per rank on a host with CUDA (``cuda=True``) or without:
        the terms pinned ``"always"``, plus those pinned ``"cuda"`` when ``cuda``."""
        return sum(t.bytes for t in self.terms if t.pinned == "always" or (cuda and t.pinned == "cuda"))

    @property
    def nvme_bytes(self) -> int:
        """Bytes of NVMe swap space per node: per-rank NVMe terms x gpus_per_node."""
        return self._tier("nvme") * self.gpus_per_node

    def row(self) -> dict:
        """The JSON row of ``zeroinf estimate --json``; ``pinned_bytes_per_rank`` is
        :meth:`pinned_bytes` without CUDA, ``pinned_bytes_per_rank_cuda`` with."""
        return {"stage": self.placement.stage, "offload_param": self.placement.offload_param,
                "offload_param_ratio": self.placement.param_ratio,
                "offload_optimizer": self.placement.offload_optimizer,
                "per_device_bytes": self.per_device_bytes, "per_host_bytes": self.per_host_bytes,
                "nvme_bytes": self.nvme_bytes, "pinned_bytes_per_rank": self.pinned_bytes(cuda=False),
                "pinned_bytes_per_rank_cuda": self.pinned_bytes(cuda=True)}


# ---------------------------------------------------------------------------------------------
# Formulas


def activation_bytes(seq_len: int, micro_batch: int, hidden: int, layers: int, heads: int, *,
                     checkpointing: str = "none", attention_scores: bool = True) -> int:
    """Activation memory of a GPT-style transformer per accelerator, bytes (16-bit activations).

    Source: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
    Models" (arXiv:2205.05198), Sec. 4.1 (Eq. 1, no tensor or sequence parallelism) and Sec. 5
    (selective and full recomputation): one layer stores
    ``s b h (34 + 5 a s / h)`` bytes, of which ``5 a s^2 b`` are the attention scores, softmax and
    its dropout mask. With s = ``seq_len``, b = ``micro_batch``, h = ``hidden``, a = ``heads``,
    L = ``layers``:

    * ``checkpointing="none"``: ``L s b h (34 + 5 a s / h)``;
    * ``"selective"`` (recompute attention scores only, Sec. 5): ``34 L s b h``;
    * ``"full"`` (store each layer's 16-bit input, recompute the layer in backward): ``2 L s b h``
      plus, our addition, the one layer rematerialised during its backward, ``s b h (34 + 5 a s / h)``.

    ``attention_scores=False`` drops the ``5 a s / h`` part, for fused attention (SDPA, flash) that
    never stores the s x s matrices. Not counted: the embedding and the output logits (Sec. 4.3),
    and MLPs whose width differs from 4h (Llama's SwiGLU): the formula is an estimate for those.

    Raises:
        ValueError: a non-positive size or an unknown ``checkpointing``.
    """
    for key, v in (("seq_len", seq_len), ("micro_batch", micro_batch), ("hidden", hidden),
                   ("layers", layers), ("heads", heads)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"activation memory: {key} must be a positive integer, got {v!r}")
    sbh = seq_len * micro_batch * hidden
    scores = 5 * heads * seq_len * seq_len * micro_batch if attention_scores else 0  # = sbh * 5as/h
    one_layer = 34 * sbh + scores
    if checkpointing == "none":
        return layers * one_layer
    if checkpointing == "selective":
        return layers * 34 * sbh
    if checkpointing == "full":
        return 2 * layers * sbh + one_layer
    raise ValueError(f"activation memory: checkpointing {checkpointing!r} is not one of none, selective, full")


def estimate(params: int, placement: Placement, *, world_size: int = 1, gpus_per_node: Optional[int] = None,
             precision: str = "bf16", optimizer: str = "adam", live_params: Optional[int] = None,
             activations: int = 0, activations_formula: str = "Korthikanti et al. 2022, Sec. 4",
             swap: SwapBuffers = SwapBuffers(), optimizer_pin_memory: bool = False,
             param_pin_memory: bool = False, unit_sizes: Optional[Sequence[int]] = None,
             live_params_formula: Optional[str] = None, state_dtype: str = "fp32",
             optimizer_in_backward: bool = False) -> Estimate:
    """Bytes per accelerator, per host and on NVMe for one placement (formulas: module docstring).

    Args:
        params: P, number of parameters.
        placement: stage and offload devices.
        world_size: N, data-parallel ranks (GPUs per node x nodes).
        gpus_per_node: ranks per host (default ``world_size``: one node); host and NVMe bytes are per node.
        precision: ``"bf16"``/``"fp16"`` (fp32 master weights) or ``"fp32"``.
        optimizer: a key of :data:`OPTIMIZERS`.
        state_dtype: ``offload_optimizer.state_dtype``, ``"fp32"`` or ``"bf16"``: with the optimizer
            offloaded, bf16 halves the optimizer's own state (Adam: exp_avg and exp_avg_sq at 2 bytes
            each); the fp32 master stays 4 bytes.
        live_params: parameters a stage-3 rank holds gathered at once (None: not counted).
        live_params_formula: where ``live_params`` comes from, shown with its term.
        activations: activation bytes per accelerator (see :func:`activation_bytes`), added as a term.
        activations_formula: how ``activations`` was computed, shown with the term.
        swap: pinned buffer sizes for NVMe rows.
        optimizer_pin_memory, param_pin_memory: ``offload_optimizer.pin_memory`` and
            ``offload_param.pin_memory`` (default false, as :mod:`zeroinf.config`): the
            CPU-resident optimizer state, and the host parameter partitions and cache, are then
            pinned with CUDA (:attr:`Term.pinned` ``"cuda"``).
        unit_sizes: elements of each stage-3 unit with parameters (:attr:`ModelInfo.unit_sizes`).
            Stage 3 sizes its NVMe swap buffers from the units: a parameter buffer holds the largest
            unit partition ``ceil(U/N)`` (U: the largest unit) at most, and the optimizer's
            sub-groups are cut per unit partition, ``ceil(ceil(u/N) / sub_group_size)`` of them
            per unit u, the largest ``min(sub_group_size, ceil(U/N))`` elements. None (units
            unknown): both terms are upper bounds, with ``ceil(P/N)`` for the largest partition
            and, with ``pipeline_read``, ``buffer_count`` for the number of sub-groups.
        optimizer_in_backward: ``zeroinf.optimizer_in_backward`` (stage 3): each gradient
            partition is stepped as it is reduced, so no accumulated partition is kept (no
            gradient term in host memory or NVMe).

    Raises:
        ValueError: non-positive counts, ``gpus_per_node`` not dividing ``world_size``, unknown
            precision, optimizer or state dtype.
    """
    if state_dtype not in ("fp32", "bf16"):
        raise ValueError(f"state_dtype: {state_dtype!r} is not one of fp32, bf16")
    if not isinstance(params, int) or params < 1:
        raise ValueError(f"params: must be a positive integer, got {params!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: must be a positive integer, got {world_size!r}")
    gpn = world_size if gpus_per_node is None else gpus_per_node
    if not isinstance(gpn, int) or gpn < 1 or world_size % gpn:
        raise ValueError(f"gpus_per_node: {gpn!r} must be a positive divisor of world_size {world_size}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer: {optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    prec = PRECISIONS[precision]
    # An offloaded optimizer steps an fp32 master copy of its own, even in fp32 training, except
    # where fp32 stage-3 partitions off the device are the masters (optimizer state on NVMe:
    # [Note: master in the partitions] in zeroinf/runtime/stage3/engine_glue.py)
    partitions_are_masters = (prec.name == "fp32" and placement.stage == 3 and placement.offload_optimizer == "nvme"
                              and placement.offload_param in ("cpu", "nvme"))
    master = prec.master_bytes if placement.offload_optimizer == "none" or partitions_are_masters else 4
    # zeroinf.runtime.optimizer.state_bytes_per_element: the offloaded moments in bf16 take half
    own = OPTIMIZERS[optimizer] // (2 if state_dtype == "bf16" and placement.offload_optimizer != "none" else 1)
    k = master + own
    n = world_size
    shard = -(-params // n)
    st = placement.stage
    terms: List[Term] = []

    def count(partitioned: bool) -> Tuple[int, str]:
        if partitioned:
            return shard, f"ceil(P/N) = ceil({format_count(params)}/{n}) = {format_count(shard)}"
        return params, f"P = {format_count(params)}"

    # parameters
    numel, what = count(st == 3)
    tier = {"none": "device", "cpu": "host", "nvme": "nvme"}[placement.offload_param]
    param_pin = "cuda" if param_pin_memory and tier == "host" else "never"
    offloaded = numel
    if placement.param_ratio < 1.0:
        resident, resident_what = _resident(numel, placement.param_ratio, n, unit_sizes)
        offloaded = numel - resident
        terms.append(Term(f"{prec.name} parameters (resident)", "device", prec.param_bytes * resident,
                          f"{prec.param_bytes} B x {resident_what}"))
        what = f"{what} - resident {format_count(resident)} = {format_count(offloaded)}"
    terms.append(Term(f"{prec.name} parameters", tier, prec.param_bytes * offloaded,
                      f"{prec.param_bytes} B x {what}", param_pin))
    if st == 3 and live_params:
        terms.append(Term("gathered units (params + grads)", "device",
                          (prec.param_bytes + prec.grad_bytes) * live_params,
                          f"({prec.param_bytes} + {prec.grad_bytes}) B x live params {format_count(live_params)}"
                          + (f": {live_params_formula}" if live_params_formula else "")))
    # gradients
    numel, what = count(st >= 2)
    if placement.offload_optimizer == "none" or st < 2:
        terms.append(Term(f"{prec.name} gradients", "device", prec.grad_bytes * numel, f"{prec.grad_bytes} B x {what}"))
    # optimizer state
    numel, what = count(st >= 1)
    moments = f"{optimizer} {own}" + (" in bf16" if own != OPTIMIZERS[optimizer] else "")
    parts = f"master {master} + {moments}" if master else moments
    tier = {"none": "device", "cpu": "host", "nvme": "nvme"}[placement.offload_optimizer]
    name = "optimizer state (fp32)" if own == OPTIMIZERS[optimizer] else "optimizer state (fp32 master, bf16 moments)"
    terms.append(Term(name, tier, k * numel, f"K = {k} B ({parts}) x {what}",
                      "cuda" if optimizer_pin_memory and tier == "host" else "never"))
    if st == 3 and optimizer_in_backward:
        pass  # each unit's gradient partition is stepped as it is reduced: none is kept
    elif st == 3 and placement.offload_param == "nvme" and placement.offload_optimizer == "nvme":
        # ZeRO-Infinity: the engine swaps the fp32 gradient partitions to NVMe as well
        # (zeroinf/runtime/stage3/engine_glue.py, grads_on_nvme), so host memory stays flat in P.
        terms.append(Term("gradient partition (fp32, swapped)", "nvme", 4 * numel, f"4 B x {what}"))
        if prec.grad_bytes != 4:  # one micro-batch's partition is kept in the training dtype
            terms.append(Term(f"gradient partition ({prec.name}, swapped)", "nvme", prec.grad_bytes * numel,
                              f"{prec.grad_bytes} B x {what}"))
    elif placement.offload_optimizer != "none":
        # stages 0-2 accumulate it in FlatParamManager.grad_acc, which torch pins with CUDA; stage 3
        # in ordinary memory
        terms.append(Term("gradient partition (fp32)", "host", 4 * numel, f"4 B x {what}",
                          "cuda" if st < 3 else "never"))
    # stage 3: the largest unit partition; ceil(P/N) bounds it when the units are unknown
    part, part_what = shard, f"ceil(P/N) {format_count(shard)} (units unknown: an upper bound)"
    if st == 3 and unit_sizes:
        part = -(-max(unit_sizes) // n)
        part_what = f"largest unit partition ceil({format_count(max(unit_sizes))}/{n}) = {format_count(part)}"
    if placement.offload_optimizer == "nvme":
        from zeroinf.runtime.optimizer import optimizer_buffer_count
        sgs = swap.sub_group_size
        if st < 3:  # the rank's partition, cut into sub-groups
            groups, elems = -(-numel // sgs), min(sgs, numel)
            groups_what, elems_what = f"{groups}", f"{format_count(elems)}"
        elif unit_sizes:  # cut per unit partition (zeroinf/runtime/stage3/engine_glue.py, Stage3EngineParams)
            groups, elems = sum(-(-p // sgs) for p in (-(-u // n) for u in unit_sizes)), min(sgs, part)
            groups_what = f"{groups} (ceil(ceil(u/N)/sub_group_size) over {len(unit_sizes)} units)"
            elems_what = f"min(sub_group_size {format_count(sgs)}, {part_what}) = {format_count(elems)}"
        else:  # at least as many sub-groups as buffers, none larger than the partition
            groups, elems = swap.optimizer_buffer_count, min(sgs, part)
            groups_what = "unknown, taken as >= buffer_count: an upper bound"
            elems_what = f"min(sub_group_size {format_count(sgs)}, {part_what}) = {format_count(elems)}"
        in_flight = optimizer_buffer_count(swap.optimizer_buffer_count, swap.optimizer_pipeline_read,
                                           swap.optimizer_pipeline_write, groups)
        cap = f"sub-groups {groups_what}" if swap.optimizer_pipeline_read else \
            f"in flight {1 + swap.optimizer_pipeline_write}"
        terms.append(Term("optimizer swap buffers", "host", _pool_bytes(in_flight, k * elems, swap.alignment),
                          f"min(buffer_count {swap.optimizer_buffer_count}, {cap}) = {in_flight}"
                          f" x K {k} B x {elems_what} elements, rounded up to pages", "always"))
    if placement.offload_param == "nvme" and offloaded:  # no NVMe partition: no staging pool
        size = min(swap.param_buffer_size, part)
        need = 1 + swap.param_prefetch  # read on demand, and one unit read ahead
        count = max(swap.param_buffer_count, need)
        terms.append(Term("parameter swap buffers", "host",
                          _pool_bytes(count, prec.param_bytes * size, swap.alignment),
                          f"max(buffer_count {swap.param_buffer_count}, {need} "
                          f"{'with' if swap.param_prefetch else 'without'} prefetch) x {prec.param_bytes} B x "
                          f"min(buffer_size {format_count(swap.param_buffer_size)}, {part_what}), rounded up to pages",
                          "always"))
        cached = min(swap.param_max_in_cpu, offloaded)
        if cached:
            terms.append(Term("parameter cache (max_in_cpu)", "host", prec.param_bytes * cached,
                              f"{prec.param_bytes} B x min(max_in_cpu, offloaded partition) = {format_count(cached)}",
                              "cuda" if param_pin_memory else "never"))
    if activations:
        terms.append(Term("activations", "device", int(activations), activations_formula))
    return Estimate(placement=placement, params=params, world_size=n, gpus_per_node=gpn, terms=tuple(terms),
                    offloaded_params=offloaded if placement.offload_param != "none" else 0)


def _resident(shard: int, ratio: float, n: int, unit_sizes: Optional[Sequence[int]]) -> Tuple[int, str]:
    """Partition elements a stage-3 rank keeps on the device under ``offload_param.ratio``, with
    the formula: the engine's leading units (:func:`zeroinf.model_sizes.resident_units` over the
    unit partitions ``ceil(u/N)``) when the units are known, else ``round((1 - ratio) x shard)``
    (``shard`` = ``ceil(P/N)``), at most ``shard``."""
    if unit_sizes:
        from zeroinf.model_sizes import resident_units
        parts = [-(-u // n) for u in unit_sizes]
        k = resident_units(parts, ratio)
        got = min(shard, sum(parts[:k]))
        return got, (f"the first {k} of {len(parts)} unit partitions ceil(u/N) (offload_param.ratio {ratio:g}) "
                     f"= {format_count(got)}")
    got = min(shard, round((1.0 - ratio) * shard))
    return got, f"(1 - offload_param.ratio {ratio:g}) x ceil(P/N) = {format_count(got)} (units unknown)"


def estimate_all(params: int, **kwargs) -> List[Estimate]:
    """:func:`estimate` for every placement of :data:`PLACEMENTS`, in that order."""
    return [estimate(params, pl, **kwargs) for pl in PLACEMENTS]


# ---------------------------------------------------------------------------------------------
# DeepSpeed config


def placement_from_config(cfg) -> Placement:
    """The :class:`Placement` of a parsed config (:func:`zeroinf.config.parse_config`)."""
    z = cfg.zero_optimization
    ratio = z.offload_param.ratio if z.offload_param.device != "none" else 1.0
    return Placement(z.stage, z.offload_param.device, z.offload_optimizer.device, ratio)


def swap_buffers_from_config(cfg) -> SwapBuffers:
    """The pinned swap buffers of a parsed config (:func:`zeroinf.config.parse_config`)."""
    z = cfg.zero_optimization
    return SwapBuffers(param_buffer_count=z.offload_param.buffer_count,
                       param_buffer_size=z.offload_param.buffer_size,
                       param_max_in_cpu=z.offload_param.max_in_cpu,
                       param_prefetch=z.stage3_prefetch_bucket_size > 0,
                       optimizer_buffer_count=z.offload_optimizer.buffer_count,
                       optimizer_pipeline_read=z.offload_optimizer.pipeline_read,
                       optimizer_pipeline_write=z.offload_optimizer.pipeline_write,
                       sub_group_size=z.sub_group_size)


# ---------------------------------------------------------------------------------------------
# Tables


_PINNED_TAGS = {"always": " [pinned]", "cuda": " [pinned with CUDA]", "never": ""}


def format_table(rows: Sequence[Estimate], unit: str = "GB", terms: bool = False) -> str:
    """The human-readable table of ``zeroinf estimate``; sizes in ``unit`` (``"GB"`` or ``"GiB"``).
    With ``terms``, every term (tagged when pinned) and each row's pinned bytes per rank with and
    without CUDA."""
    head = ("stage", "offload_param", "offload_optimizer", "per device", "per host", "NVMe")
    lines = [f"{head[0]:>5}  {head[1]:<13}  {head[2]:<17}  {head[3]:>12}  {head[4]:>12}  {head[5]:>12}"]
    for e in rows:
        p = e.placement
        lines.append(f"{p.stage:>5}  {p.param_label():<13}  {p.offload_optimizer:<17}  "
                     f"{format_size(e.per_device_bytes, unit):>12}  {format_size(e.per_host_bytes, unit):>12}  "
                     f"{format_size(e.nvme_bytes, unit):>12}")
        if terms:
            for t in e.terms:
                lines.append(f"{'':>7}{t.tier:<6} {format_size(t.bytes, unit):>12} {unit}/rank  "
                             f"{t.name}{_PINNED_TAGS[t.pinned]}: {t.formula}")
            lines.append(f"{'':>7}pinned {format_size(e.pinned_bytes(cuda=True), unit):>12} {unit}/rank  on a CUDA "
                         f"host; {format_size(e.pinned_bytes(cuda=False), unit)} without CUDA (torch pins only "
                         f"with CUDA; the swap pools are locked on any host)")
    return "\n".join(lines)

