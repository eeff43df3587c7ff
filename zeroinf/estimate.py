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
import json
import math
import os
import re
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

from zeroinf.sizes import parse_bytes as _parse_bytes
from zeroinf.working_set import GatherLimits, working_set

__all__ = [
    "GB", "GiB", "PRESETS", "PRECISIONS", "OPTIMIZERS", "PLACEMENTS", "Precision", "Placement",
    "ModelInfo", "SwapBuffers", "Term", "Estimate", "parse_count", "parse_bytes", "load_model_config",
    "model_info", "count_params", "stage3_unit_sizes", "stage3_units", "PERSISTENCE_THRESHOLD", "activation_bytes", "estimate", "estimate_all", "swap_buffers_from_config",
    "placement_from_config", "PLAN_SWAP", "swap_for", "format_count", "format_size", "format_table",
]

GB = 10**9
GiB = 2**30

#: Model presets: explicit Hugging Face config dicts (no download). Sizes as published by their
#: authors (LLaMA: Touvron et al. 2023, Table 2; Llama 2: Touvron et al. 2023b; GPT-2 small).
PRESETS: Dict[str, dict] = {
    "llama-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                     num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=2048,
                     rms_norm_eps=1e-6, tie_word_embeddings=False),
    "llama-13b": dict(model_type="llama", vocab_size=32000, hidden_size=5120, intermediate_size=13824,
                      num_hidden_layers=40, num_attention_heads=40, max_position_embeddings=2048,
                      rms_norm_eps=1e-6, tie_word_embeddings=False),
    "llama-33b": dict(model_type="llama", vocab_size=32000, hidden_size=6656, intermediate_size=17920,
                      num_hidden_layers=60, num_attention_heads=52, max_position_embeddings=2048,
                      rms_norm_eps=1e-6, tie_word_embeddings=False),
    "llama-65b": dict(model_type="llama", vocab_size=32000, hidden_size=8192, intermediate_size=22016,
                      num_hidden_layers=80, num_attention_heads=64, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, tie_word_embeddings=False),
    "llama2-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, tie_word_embeddings=False),
    "llama2-70b": dict(model_type="llama", vocab_size=32000, hidden_size=8192, intermediate_size=28672,
                       num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "gpt2": dict(model_type="gpt2", vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024),
}


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

    Raises:
        ValueError: unknown stage or device, or ``offload_param`` other than none below stage 3.
    """

    stage: int
    offload_param: str = "none"
    offload_optimizer: str = "none"

    def __post_init__(self):
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_optimization.stage: {self.stage!r} is not one of 0, 1, 2, 3")
        for key, dev in (("offload_param", self.offload_param), ("offload_optimizer", self.offload_optimizer)):
            if dev not in OFFLOAD_DEVICES:
                raise ValueError(f"zero_optimization.{key}.device: {dev!r} is not one of none, cpu, nvme")
        if self.offload_param != "none" and self.stage != 3:
            raise ValueError(f"zero_optimization.offload_param.device: {self.offload_param!r} needs stage 3 "
                             f"(parameters are partitioned only at stage 3), got stage {self.stage}")

    def label(self) -> str:
        return f"stage {self.stage}, offload_param={self.offload_param}, offload_optimizer={self.offload_optimizer}"


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
    """

    placement: Placement
    params: int
    world_size: int
    gpus_per_node: int
    terms: Tuple[Term, ...]

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
                "offload_optimizer": self.placement.offload_optimizer,
                "per_device_bytes": self.per_device_bytes, "per_host_bytes": self.per_host_bytes,
                "nvme_bytes": self.nvme_bytes, "pinned_bytes_per_rank": self.pinned_bytes(cuda=False),
                "pinned_bytes_per_rank_cuda": self.pinned_bytes(cuda=True)}


# ---------------------------------------------------------------------------------------------
# Parsing of sizes and counts

_SUFFIX_COUNT = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: Union[str, int, float]) -> int:
    """A parameter count from ``7e9``, ``7B``, ``6.7b``, ``350M``, ``1.2T`` or an int.

    Suffixes are decimal: K = 1e3, M = 1e6, B (or G) = 1e9, T = 1e12. The number is read exactly
    (as a decimal, so ``1.1B`` is 1,100,000,000) and must be whole: a fraction of a parameter means
    nothing (``1.5`` was rounded to 2).

    Raises:
        ValueError: not a positive whole number with an optional suffix.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if not math.isfinite(text):
            raise ValueError(f"parameter count {text!r}: must be at least 1")
        value = Decimal(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", str(text))
        if not m:
            raise ValueError(f"parameter count {text!r}: expected a number such as 7e9, 7B or 350M")
        value = Decimal(m.group(1)) * _SUFFIX_COUNT[m.group(2).lower()]
    if value < 1:
        raise ValueError(f"parameter count {text!r}: must be at least 1")
    if value != value.to_integral_value():
        raise ValueError(f"parameter count {text!r}: {value.normalize():f} is not a whole number of parameters")
    return int(value)


def parse_bytes(text: Union[str, int]) -> int:
    """Bytes from ``80GB`` or ``80G`` (decimal, 1e9), ``80GiB`` (binary, 2**30), ``1TB``,
    ``512MiB`` or a plain number of bytes: :func:`zeroinf.sizes.parse_bytes`, the parser of every
    tool.

    Raises:
        ValueError: not a non-negative number with one of those units.
    """
    return _parse_bytes(text)


# ---------------------------------------------------------------------------------------------
# Models


@dataclass(frozen=True)
class ModelInfo:
    """What the estimates need to know about a model.

    Attributes:
        name: preset name, config path, or ``"P=<count>"``.
        params: P, unique parameters (tied weights once, embeddings included).
        largest_unit: elements of the largest stage-3 unit (see :func:`stage3_units`); an
            ``offload_param.buffer_size`` must hold its partition. None when unknown.
        live_params: parameters a stage-3 rank holds gathered at once, its working set (see
            :func:`stage3_units`); None when unknown.
        live_formula: how ``live_params`` was computed, with its numbers; None when unknown.
        unit_sizes: elements of each stage-3 unit that has parameters (persistent, root, then the
            blocks, as :func:`stage3_unit_sizes` groups them); the engine cuts the optimizer's
            sub-groups per unit, so they size its NVMe swap buffers. None when unknown.
        hidden, layers, heads, vocab: shape, for activation memory; None when unknown.
    """

    name: str
    params: int
    largest_unit: Optional[int] = None
    live_params: Optional[int] = None
    live_formula: Optional[str] = None
    unit_sizes: Optional[Tuple[int, ...]] = None
    hidden: Optional[int] = None
    layers: Optional[int] = None
    heads: Optional[int] = None
    vocab: Optional[int] = None


def load_model_config(model: Union[str, os.PathLike, Mapping]) -> dict:
    """A Hugging Face config dict from a preset name, a config.json path (or its folder), or a dict.

    Raises:
        ValueError: unknown preset name, unreadable or invalid JSON, or no ``model_type`` key.
    """
    if isinstance(model, Mapping):
        cfg = dict(model)
        where = "config dict"
    elif str(model) in PRESETS:
        return dict(PRESETS[str(model)])
    else:
        path = Path(model)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"model {str(model)!r}: neither a preset ({', '.join(sorted(PRESETS))}) "
                             f"nor an existing config.json")
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"model config {str(path)!r}: cannot read JSON: {exc}") from exc
        where = str(path)
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise ValueError(f"model config {where}: no 'model_type' key (a Hugging Face config.json has one)")
    return cfg


def _build_meta(cfg: dict):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    rest = {k: v for k, v in cfg.items() if k != "model_type"}
    try:
        hf_config = AutoConfig.for_model(cfg["model_type"], **rest)
    except (ValueError, KeyError) as exc:
        raise ValueError(f"model config: model_type {cfg['model_type']!r} is not known to transformers: {exc}") from exc
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except ValueError as exc:  # e.g. an encoder-only model_type with no causal-LM class
        raise ValueError(f"model config: transformers cannot build a causal LM for model_type "
                         f"{cfg['model_type']!r}: {exc}") from exc
    return hf_config, model


#: ``zero_optimization.stage3_param_persistence_threshold`` default: smaller parameters stay gathered.
PERSISTENCE_THRESHOLD = 100_000


def stage3_unit_sizes(model, persistence_threshold: int = PERSISTENCE_THRESHOLD
                      ) -> Optional[Tuple[int, int, Tuple[int, ...]]]:
    """``(persistent, root, blocks)``: elements of each stage-3 unit, as
    ``zeroinf.runtime.stage3.units.build_units`` groups them (``blocks`` in module order).

    Units: one per outermost transformer block (classes of the model's ``_no_split_modules``); the
    root unit holds every parameter outside the blocks (or shared by two), gathered for the whole
    forward and backward; the persistent unit holds every parameter with fewer than
    ``persistence_threshold`` elements, gathered once and kept. Returns None when the model names
    no block classes.
    """
    classes = set(getattr(model, "_no_split_modules", None) or ())
    if not classes:
        return None
    blocks, taken = [], []
    for name, m in model.named_modules():
        if m is model or type(m).__name__ not in classes or any(name.startswith(t + ".") for t in taken):
            continue
        taken.append(name)
        blocks.append(m)
    owner: Dict[int, List[int]] = {}
    for i, b in enumerate(blocks):
        for p in b.parameters():
            owner.setdefault(id(p), []).append(i)
    persistent = root = 0
    sizes = [0] * len(blocks)
    for p in model.parameters():
        n = p.numel()
        if n < persistence_threshold:
            persistent += n
        elif len(owner.get(id(p), ())) == 1:
            sizes[owner[id(p)][0]] += n
        else:
            root += n
    return persistent, root, tuple(sizes)


def stage3_units(model, persistence_threshold: int = PERSISTENCE_THRESHOLD,
                 limits: GatherLimits = GatherLimits()) -> Optional[Tuple[int, int]]:
    """``(largest unit, live parameters)`` in elements, from :func:`stage3_unit_sizes`: the live
    parameters are the working set under ``limits`` (:func:`zeroinf.working_set.working_set`), at
    least ``persistent + root + the largest block``. Returns None when the model names no block
    classes.
    """
    units = stage3_unit_sizes(model, persistence_threshold)
    return None if units is None else _largest_and_live(*units, limits)[:2]


def _largest_and_live(persistent: int, root: int, blocks: Tuple[int, ...],
                      limits: GatherLimits) -> Tuple[int, int, str]:
    live, formula = working_set(persistent, root, blocks, limits)
    return max(persistent, root, max(blocks, default=0)), live, formula


def model_info(model: Union[str, os.PathLike, Mapping], *,
               persistence_threshold: int = PERSISTENCE_THRESHOLD, limits: GatherLimits = GatherLimits()) -> ModelInfo:
    """Count a model's parameters by building it on the meta device (no memory, no download).

    Args:
        model: a preset name (:data:`PRESETS`), a Hugging Face config.json path or folder, or a dict.

    Returns:
        :class:`ModelInfo` with P = unique parameters of ``AutoModelForCausalLM.from_config`` (tied
        input/output embeddings counted once) and the stage-3 unit sizes and working set of
        :func:`stage3_units` under ``limits``.

    Raises:
        ValueError: see :func:`load_model_config`, or a config transformers cannot build.
    """
    cfg = load_model_config(model)
    hf_config, built = _build_meta(cfg)
    params = sum(p.numel() for p in built.parameters())  # parameters() yields a tied tensor once
    name = str(model) if not isinstance(model, Mapping) else cfg["model_type"]

    def attr(key):
        try:
            value = getattr(hf_config, key)
        except AttributeError:
            return None
        return value if isinstance(value, int) else None

    units = stage3_unit_sizes(built, persistence_threshold)
    largest, live, formula = _largest_and_live(*units, limits) if units else (None, None, None)
    return ModelInfo(name=name, params=params, largest_unit=largest, live_params=live, live_formula=formula,
                     unit_sizes=tuple(n for n in (units[0], units[1], *units[2]) if n) if units else None,
                     hidden=attr("hidden_size"), layers=attr("num_hidden_layers"),
                     heads=attr("num_attention_heads"), vocab=attr("vocab_size"))


def count_params(model: Union[str, os.PathLike, Mapping]) -> int:
    """Unique parameters of a model built on the meta device; see :func:`model_info`."""
    return model_info(model).params


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


def format_count(n: int) -> str:
    """``n`` with thousands separators (``7,000,000,000``)."""
    return f"{n:,}"


def estimate(params: int, placement: Placement, *, world_size: int = 1, gpus_per_node: Optional[int] = None,
             precision: str = "bf16", optimizer: str = "adam", live_params: Optional[int] = None,
             activations: int = 0, activations_formula: str = "Korthikanti et al. 2022, Sec. 4",
             swap: SwapBuffers = SwapBuffers(), optimizer_pin_memory: bool = False,
             param_pin_memory: bool = False, unit_sizes: Optional[Sequence[int]] = None,
             live_params_formula: Optional[str] = None) -> Estimate:
    """Bytes per accelerator, per host and on NVMe for one placement (formulas: module docstring).

    Args:
        params: P, number of parameters.
        placement: stage and offload devices.
        world_size: N, data-parallel ranks (GPUs per node x nodes).
        gpus_per_node: ranks per host (default ``world_size``: one node); host and NVMe bytes are per node.
        precision: ``"bf16"``/``"fp16"`` (fp32 master weights) or ``"fp32"``.
        optimizer: a key of :data:`OPTIMIZERS`.
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

    Raises:
        ValueError: non-positive counts, ``gpus_per_node`` not dividing ``world_size``, unknown
            precision or optimizer.
    """
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
    k = master + OPTIMIZERS[optimizer]
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
    terms.append(Term(f"{prec.name} parameters", tier, prec.param_bytes * numel,
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
    parts = f"master {master} + {optimizer} {OPTIMIZERS[optimizer]}" if master else f"{optimizer}"
    tier = {"none": "device", "cpu": "host", "nvme": "nvme"}[placement.offload_optimizer]
    terms.append(Term("optimizer state (fp32)", tier, k * numel, f"K = {k} B ({parts}) x {what}",
                      "cuda" if optimizer_pin_memory and tier == "host" else "never"))
    if st == 3 and placement.offload_param == "nvme" and placement.offload_optimizer == "nvme":
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
    if placement.offload_param == "nvme":
        size = min(swap.param_buffer_size, part)
        need = 1 + swap.param_prefetch  # read on demand, and one unit read ahead
        count = max(swap.param_buffer_count, need)
        terms.append(Term("parameter swap buffers", "host",
                          _pool_bytes(count, prec.param_bytes * size, swap.alignment),
                          f"max(buffer_count {swap.param_buffer_count}, {need} "
                          f"{'with' if swap.param_prefetch else 'without'} prefetch) x {prec.param_bytes} B x "
                          f"min(buffer_size {format_count(swap.param_buffer_size)}, {part_what}), rounded up to pages",
                          "always"))
        cached = min(swap.param_max_in_cpu, shard)
        if cached:
            terms.append(Term("parameter cache (max_in_cpu)", "host", prec.param_bytes * cached,
                              f"{prec.param_bytes} B x min(max_in_cpu, ceil(P/N)) = {format_count(cached)}",
                              "cuda" if param_pin_memory else "never"))
    if activations:
        terms.append(Term("activations", "device", int(activations), activations_formula))
    return Estimate(placement=placement, params=params, world_size=n, gpus_per_node=gpn, terms=tuple(terms))


def estimate_all(params: int, **kwargs) -> List[Estimate]:
    """:func:`estimate` for every placement of :data:`PLACEMENTS`, in that order."""
    return [estimate(params, pl, **kwargs) for pl in PLACEMENTS]


# ---------------------------------------------------------------------------------------------
# DeepSpeed config


def placement_from_config(cfg) -> Placement:
    """The :class:`Placement` of a parsed config (:func:`zeroinf.config.parse_config`)."""
    z = cfg.zero_optimization
    return Placement(z.stage, z.offload_param.device, z.offload_optimizer.device)


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


def format_size(nbytes: int, unit: str = "GB") -> str:
    """``nbytes`` in ``unit`` (``"GB"`` = 1e9 or ``"GiB"`` = 2**30 bytes), without the unit: two
    decimals from 1 up, three significant digits below (so small models do not print 0.00),
    always positional (2000 bytes: ``0.000002``, not ``2e-06``)."""
    v = nbytes / (GB if unit == "GB" else GiB)
    if v >= 1 or v == 0:
        return f"{v:,.2f}"
    return f"{v:.{2 - math.floor(math.log10(v))}f}".rstrip("0").rstrip(".")


_PINNED_TAGS = {"always": " [pinned]", "cuda": " [pinned with CUDA]", "never": ""}


def format_table(rows: Sequence[Estimate], unit: str = "GB", terms: bool = False) -> str:
    """The human-readable table of ``zeroinf estimate``; sizes in ``unit`` (``"GB"`` or ``"GiB"``).
    With ``terms``, every term (tagged when pinned) and each row's pinned bytes per rank with and
    without CUDA."""
    head = ("stage", "offload_param", "offload_optimizer", "per device", "per host", "NVMe")
    lines = [f"{head[0]:>5}  {head[1]:<13}  {head[2]:<17}  {head[3]:>12}  {head[4]:>12}  {head[5]:>12}"]
    for e in rows:
        p = e.placement
        lines.append(f"{p.stage:>5}  {p.offload_param:<13}  {p.offload_optimizer:<17}  "
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
