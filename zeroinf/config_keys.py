"""The table of DeepSpeed 0.19.8 config keys and what zeroinf does with each.

One :class:`Key` record per key path (dotted, as DeepSpeed nests them). Its :class:`Status`:

* ``SUPPORTED``: parsed by :mod:`zeroinf.config` and acted on (the note says how, where it
  differs from DeepSpeed);
* ``MAPPED``: a deprecated or older spelling, rewritten to ``note`` (the key path it stands
  for) with a :class:`ConfigDeprecationWarning`;
* ``IGNORED``: has no effect here (monitoring, profiling, communication logging, autotuning):
  accepted with one :class:`ConfigWarning` that it is ignored;
* ``NOT_IMPLEMENTED``: a feature zeroinf does not have; refused with :class:`ConfigError` naming
  the feature and what to use instead (``note``).

An ``IGNORED`` or ``NOT_IMPLEMENTED`` key at one of its ``noop`` values (DeepSpeed's default or
another value that asks for nothing), or a block of them with ``"enabled": false``, is accepted
silently. A key DeepSpeed does not know either is refused with a did-you-mean, so a typo never
passes silently; at the top level, which DeepSpeed reads by name only, one close to no known key
(a note, a launcher's setting) is ignored with one warning, as DeepSpeed ignores it. :func:`normalize` applies the table to a raw config; :func:`render_markdown`
writes ``docs/deepspeed-config.md`` from it.
"""
from __future__ import annotations

import difflib
import enum
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

__all__ = ["ConfigDeprecationWarning", "ConfigWarning", "Key", "Status", "TABLE", "normalize", "render_markdown"]


class ConfigWarning(UserWarning):
    """A config key is accepted but has no effect here, or an ``"auto"`` took DeepSpeed's default."""


class ConfigDeprecationWarning(FutureWarning):
    """A deprecated DeepSpeed spelling was read as its current key (shown by default, as the user
    who wrote the config is the one who can change it)."""


class Status(enum.Enum):
    """What zeroinf does with a DeepSpeed key (see the module docstring)."""

    SUPPORTED = "supported"
    MAPPED = "mapped"
    IGNORED = "ignored with a warning"
    NOT_IMPLEMENTED = "not implemented"


@dataclass(frozen=True)
class Key:
    """One DeepSpeed key path (dotted, e.g. ``zero_optimization.offload_param.device``) and its status here."""

    path: str
    status: Status
    #: SUPPORTED: how it acts here; MAPPED: the key path it is read as ("" = dropped, as in
    #: DeepSpeed); IGNORED: what it does in DeepSpeed; NOT_IMPLEMENTED: the feature, then what to use
    note: str = ""
    #: IGNORED / NOT_IMPLEMENTED: values that ask for nothing, accepted silently (compared with
    #: their type: 0 is not false)
    noop: Tuple[Any, ...] = ()
    #: "auto" is a real value of this key (not the Hugging Face placeholder)
    auto_is_value: bool = False
    #: a block whose keys :mod:`zeroinf.config` checks itself (they depend on another key)
    open_block: bool = False


S, M, I, N = Status.SUPPORTED, Status.MAPPED, Status.IGNORED, Status.NOT_IMPLEMENTED
_REMOVED = "removed from DeepSpeed 0.19.8 too (it refuses the key)"
_MONITOR = "monitoring (DeepSpeed writes training metrics); zeroinf logs steps_per_print lines only"
_PROFILE = "profiling"
_AUTOTP = "an option of AutoTP, which is not implemented (tensor_parallel.autotp_size <= 1 only)"
_DEEPCOMPILE = "an option of DeepCompile, which is not implemented (compile.deepcompile false only)"
_PIN = ("default false (DeepSpeed 0.19.8: true): set true for DeepSpeed's page-locked host state; acts only "
        "with CUDA present")

_RECORDS: Tuple[Key, ...] = (
    # ---- top level
    Key("train_batch_size", S), Key("train_micro_batch_size_per_gpu", S), Key("gradient_accumulation_steps", S),
    Key("steps_per_print", S, "any number >= 0; inf (what Accelerate writes) and 0 never print"),
    Key("wall_clock_breakdown", S), Key("gradient_clipping", S),
    Key("optimizer", S), Key("scheduler", S), Key("fp16", S), Key("bf16", S),
    Key("bfloat16", M, "bf16"),
    Key("zero_optimization", S, "a bool (DeepSpeed's oldest form) is read as stage 1 (true) or 0 (false)"),
    Key("aio", S), Key("checkpoint", S), Key("data_types", S), Key("compile", S), Key("tensor_parallel", S),
    Key("zero_allow_untested_optimizer", S, "any value: a client torch Adam/AdamW is always taken"),
    Key("zero_force_ds_cpu_optimizer", S, "any value: the step always runs in zeroinf's CPU Adam"),
    Key("zeroinf", S, "zeroinf's own block (not a DeepSpeed key)"),
    Key("tensorboard", I, _MONITOR), Key("wandb", I, _MONITOR), Key("csv_monitor", I, _MONITOR),
    Key("comet", I, _MONITOR), Key("comms_logger", I, "communication logging"),
    Key("flops_profiler", I, _PROFILE), Key("memory_breakdown", I, _PROFILE, (False,)),
    Key("timers", I, "throughput timers (profiling)"), Key("autotuning", I, "autotuning (a launcher feature)"),
    Key("dump_state", I, "prints the engine state at start-up (debugging)", (False,)),
    Key("log_level", I, "the level of DeepSpeed's logger; set the 'zeroinf' logger's level instead", (None,)),
    Key("disable_python_gc", I, "turns Python's cyclic GC off during training", (False,)),
    Key("vocabulary_size", I, "only checked for tensor-core alignment in a DeepSpeed warning"),
    Key("pipeline", I, "options of DeepSpeed's PipelineEngine, used only for a deepspeed.pipe.PipelineModule"),
    Key("activation_checkpointing", N, "activation checkpointing through deepspeed.checkpointing; "
        "use torch.utils.checkpoint in the model (a block of false/null values is accepted)"),
    Key("torch_autocast", N, "torch autocast by the engine; use bf16 / fp16, or torch.autocast in the forward"),
    Key("communication_data_type", N, "a reduction dtype other than the gradients' own", (None,)),
    Key("seq_parallel_communication_data_type", N, "sequence parallelism", (None, "fp32")),
    Key("sequence_parallel_size", N, "sequence parallelism (Ulysses)", (1,)),
    Key("prescale_gradients", N, "gradient prescaling", (False,)),
    Key("gradient_predivide_factor", N, "gradient predivision", (1.0, 1)),
    Key("gradient_allreduce_op", N, "summed (not averaged) gradients; scale the loss instead", ("mean",)),
    Key("disable_allgather", N, "broadcast instead of all-gather", (False,)),
    Key("managed_gradient_accumulation", N, "accumulation boundaries set by the caller", (True,)),
    Key("dataloader_drop_last", N, "drop_last in the engine's loader; build the DataLoader yourself", (False,)),
    Key("hybrid_engine", N, "DeepSpeed-Chat's hybrid (training + generation) engine; generate with the "
        "model itself"),
    Key("data_efficiency", N, "data-efficiency sampling and routing"),
    Key("use_data_before_expert_parallelism", N, "mixture-of-experts parallelism", (False,)),
    Key("expert_parallel", N, "mixture-of-experts parallelism (AutoEP)"),
    Key("weight_quantization", N, "weight quantization"),
    Key("datastates_ckpt", N, "DataStates asynchronous checkpointing", (False,)),
    Key("amp", N, f"NVIDIA Apex AMP, {_REMOVED}; use bf16 or fp16"),
    Key("nebula", N, f"Nebula checkpointing, {_REMOVED}"),
    Key("compression_training", N, f"the compression library, {_REMOVED}"),
    Key("quantize_training", N, f"MoQ quantized training, {_REMOVED}"),
    Key("sparse_gradients", N, f"sparse embedding gradients, {_REMOVED}", (False,)),
    Key("eigenvalue", N, f"eigenvalue MoQ, {_REMOVED}"),
    Key("sparse_attention", N, f"sparse attention, {_REMOVED}"),
    Key("elasticity", N, f"elastic training, {_REMOVED}; set the batch sizes directly"),
    Key("graph_harvesting", N, f"graph harvesting, {_REMOVED}", (False,)),
    Key("curriculum_learning", N, f"legacy curriculum learning, {_REMOVED}"),
    Key("progressive_layer_drop", N, f"progressive layer drop, {_REMOVED}"),
    # ---- optimizer / scheduler
    Key("optimizer.type", S, "Adam and AdamW; others are refused naming the type"),
    Key("optimizer.params", S), Key("optimizer.legacy_fusion", N, "legacy fused optimizers", (False,)),
    Key("optimizer.params.lr", S), Key("optimizer.params.betas", S), Key("optimizer.params.eps", S),
    Key("optimizer.params.weight_decay", S), Key("optimizer.params.adam_w_mode", S),
    Key("optimizer.params.bias_correction", S),
    Key("optimizer.params.torch_adam", S, "any value: the step always runs in zeroinf's CPU Adam"),
    Key("optimizer.params.fused", S, "any value: the step always runs in zeroinf's CPU Adam"),
    Key("optimizer.params.amsgrad", N, "AMSGrad", (False,)),
    Key("optimizer.params.max_grad_norm", I, "DeepSpeed ignores it too and warns; use gradient_clipping", (0, 0.0)),
    Key("scheduler.type", S, "WarmupLR, WarmupDecayLR, WarmupCosineLR; OneCycle and LRRangeTest are refused"),
    Key("scheduler.params", S, "the keys of the chosen type", open_block=True),
    *(Key(f"scheduler.params.{k}", S) for k in (
        "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps",
        "warmup_min_ratio", "cos_min_ratio")),
    Key("scheduler.params.last_batch_iteration", N, "resuming a schedule by step number; load a checkpoint",
        (-1,)),
    # ---- precision
    *(Key(f"fp16.{k}", S) for k in ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window",
                                    "hysteresis", "consecutive_hysteresis", "min_loss_scale")),
    Key("fp16.auto_cast", N, "casting the inputs to fp16", (False,)),
    Key("fp16.fp16_master_weights_and_grads", N, "fp16 master weights (zeroinf keeps them in fp32)", (False,)),
    Key("bf16.enabled", S),
    Key("bf16.immediate_grad_update", N, "immediate gradient updates", (False,)),
    Key("bf16.check_grad_overflow", N, "applying steps whose gradients are inf/nan (zeroinf skips them, as "
        "DeepSpeed's default true does; zeroinf.optimizer_in_backward applies them with a warning)", (True,)),
    Key("bf16.bf16_master_weights_and_grads", N, "bf16 master weights (zeroinf keeps them in fp32)", (False,)),
    Key("bf16.bf16_optimizer_states", N, "bf16 optimizer states (zeroinf keeps them in fp32)", (False,)),
    Key("data_types.grad_accum_dtype", N, "accumulating gradients in bf16/fp16 (zeroinf accumulates in fp32)",
        (None, "fp32")),
    Key("data_types.param_dtype", N, "a parameter dtype set by the config; cast the model", (None,)),
    Key("data_types.buffer_dtype", N, "a buffer dtype set by the config; cast the model", (None,)),
    Key("data_types.keep_in_fp32_modules", N, "modules kept in fp32 by the engine; keep them in the model",
        ("auto",), auto_is_value=True),
    # ---- zero_optimization
    Key("zero_optimization.stage", S),
    Key("zero_optimization.offload_optimizer", S), Key("zero_optimization.offload_param", S,
                                                       "accepted at any stage; acts at stage 3 only"),
    Key("zero_optimization.sub_group_size", S, "0 (one parameter per sub-group in DeepSpeed) takes the "
        "default 1e9: the sub-group size changes no result here, only the optimizer step's tiling"),
    *(Key(f"zero_optimization.{k}", S) for k in (
        "reduce_bucket_size", "allgather_bucket_size", "reduce_scatter",
        "stage3_param_persistence_threshold", "stage3_gather_16bit_weights_on_model_save")),
    Key("zero_optimization.stage3_prefetch_bucket_size", S, "0: nothing is prefetched, as in DeepSpeed"),
    Key("zero_optimization.stage3_max_live_parameters", S, "bounds every unit the engine gathers on its own "
        "(DeepSpeed: prefetching only), so a value below the root plus the largest unit is raised to that sum with "
        "a warning; gathered_parameters blocks go over it, as DeepSpeed's GatheredParameters does; 0, as in "
        "DeepSpeed: no prefetch and no bound"),
    Key("zero_optimization.stage3_max_reuse_distance", S, "0: no unit stays gathered for reuse, as in DeepSpeed"),
    *(Key(f"zero_optimization.{k}", S, "accepted; changes no result (gradients always reduce into contiguous "
          "flat buffers after the backward)") for k in (
        "overlap_comm", "contiguous_gradients", "allgather_partitions", "round_robin_gradients")),
    Key("zero_optimization.memory_efficient_linear", S, "any value: zeroinf never patches "
        "torch.nn.functional.linear, so both train the same"),
    Key("zero_optimization.cpu_offload", M, "zero_optimization.offload_optimizer.device"),
    Key("zero_optimization.cpu_offload_param", M, "zero_optimization.offload_param.device"),
    Key("zero_optimization.cpu_offload_use_pin_memory", M, ""),
    Key("zero_optimization.stage3_gather_fp16_weights_on_model_save", M,
        "zero_optimization.stage3_gather_16bit_weights_on_model_save"),
    *(Key(f"zero_optimization.{k}", M, f"zero_optimization.stage3_{k}") for k in (
        "prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters", "max_reuse_distance",
        "gather_16bit_weights_on_model_save", "model_persistence_threshold", "module_granularity_threshold",
        "use_all_reduce_for_fetch_params", "allgather_sequential")),
    Key("zero_optimization.stage3_model_persistence_threshold", N, "a cap on unpartitioned parameters",
        (sys.maxsize,)),
    Key("zero_optimization.stage3_module_granularity_threshold", N, "fetching fine-grained modules whole", (0,)),
    Key("zero_optimization.stage3_use_all_reduce_for_fetch_params", N, "all-reduce parameter fetches", (False,)),
    Key("zero_optimization.stage3_allgather_sequential", N, "unbucketed parameter all-gathers", (False,)),
    Key("zero_optimization.use_multi_rank_bucket_allreduce", N, "multi-rank bucket all-reduce", (True,)),
    Key("zero_optimization.compute_grad_norm", N, "skipping the gradient norm", (True,)),
    Key("zero_optimization.load_from_fp32_weights", N, "masters from the 16-bit weights of a checkpoint",
        (True,)),
    Key("zero_optimization.elastic_checkpoint", N, "elastic checkpoints", (False,)),
    Key("zero_optimization.ignore_unused_parameters", N, "an error on unused parameters (zeroinf steps them "
        "with a zero gradient)", (True,)),
    Key("zero_optimization.legacy_stage1", N, "the legacy stage-1 optimizer", (False,)),
    Key("zero_optimization.parameter_alignment", N, "16-byte aligned flat buffers", (False,)),
    Key("zero_optimization.zero_hpz_partition_size", N, "ZeRO++ hierarchical partitioning", (1,)),
    Key("zero_optimization.zero_quantized_weights", N, "ZeRO++ quantized weights", (False,)),
    Key("zero_optimization.zero_quantized_nontrainable_weights", N, "ZeRO++ quantized frozen weights", (False,)),
    Key("zero_optimization.zero_quantized_gradients", N, "ZeRO++ quantized gradients", (False,)),
    Key("zero_optimization.pipeline_loading_checkpoint", N, "pipelined checkpoint loading", (False,)),
    Key("zero_optimization.override_module_apply", N, "gathering parameters for module.apply"),
    Key("zero_optimization.log_trace_cache_warnings", I, "logging of stage-3 trace cache events", (False,)),
    Key("zero_optimization.enable_sanity_checks", N, "DeepSpeed's internal sanity checks", (False,)),
    Key("zero_optimization.save_muon_momentum_buffer_in_memory", N, "the Muon optimizer", (False,)),
    Key("zero_optimization.leaf_module", N, "ZeRO-3 leaf modules (zeroinf gathers per module already)", ({},)),
    Key("zero_optimization.zenflow", N, "ZenFlow", (None,)),
    Key("zero_optimization.mics_shard_size", N, f"MiCS, {_REMOVED}", (-1,)),
    Key("zero_optimization.mics_hierarchical_params_gather", N, f"MiCS, {_REMOVED}", (False,)),
    Key("zero_optimization.zeropp_loco_param", N, f"LoCo-Zero++, {_REMOVED}", (None,)),
    *(Key(f"zero_optimization.offload_optimizer.{k}", S) for k in (
        "device", "nvme_path", "buffer_count", "pipeline_read", "pipeline_write")),
    Key("zero_optimization.offload_optimizer.pin_memory", S, _PIN),
    Key("zero_optimization.offload_optimizer.fast_init", S, "accepted; NVMe state is always initialised one "
        "sub-group at a time"),
    Key("zero_optimization.offload_optimizer.state_dtype", S, "zeroinf extension, not a DeepSpeed key: \"fp32\" "
        "(default) or \"bf16\" Adam moments in memory and swap files, written with stochastic rounding; the "
        "master weights stay fp32"),
    Key("zero_optimization.offload_optimizer.ratio", N, "partial optimizer offload (only 1.0)", (1.0, 1)),
    Key("zero_optimization.offload_optimizer.super_offload", N, "SuperOffload", (False,)),
    Key("zero_optimization.offload_optimizer.cpuadam_cores_perc", N, "a CPU-core share for SuperOffload; "
        "set OMP_NUM_THREADS", (0.8,)),
    *(Key(f"zero_optimization.offload_param.{k}", S) for k in (
        "device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu")),
    Key("zero_optimization.offload_param.pin_memory", S, _PIN),
    Key("zero_optimization.offload_param.ratio", S, "zeroinf extension, not a DeepSpeed key: the fraction of "
        "the parameters offloaded to offload_param.device, 0.0 to 1.0 (default 1.0, all); stage-3 units in "
        "forward order stay on the compute device for the rest"),
    # ---- aio / checkpoint
    *(Key(f"aio.{k}", S) for k in ("block_size", "queue_depth", "intra_op_parallelism", "single_submit",
                                   "overlap_events")),
    Key("aio.use_gds", N, "GPUDirect Storage; zeroinf reads NVMe through pinned host buffers", (False,)),
    Key("aio.thread_count", M, "aio.intra_op_parallelism"),  # older DeepSpeed's name (0.19.8 drops it)
    Key("aio.verify_checksums", S, "zeroinf's own: CRC-32C of every swap write, verified at every read "
        "(default true)"),
    Key("checkpoint.tag_validation", S), Key("checkpoint.parallel_write", S),
    Key("checkpoint.load_universal", N, "universal checkpoints", (False,)),
    Key("checkpoint.use_node_local_storage", N, "node-local checkpoint storage", (False,)),
    Key("checkpoint.parallel_write.pipeline_stage", N, "parallel checkpoint writes per pipeline stage", (False,)),
    Key("checkpoint.checkpoint_serialization", N, "the legacy (non-zipfile) serialization", (True,)),
    Key("checkpoint.writer", N, "DeepSpeed's fast checkpoint writer", (None,)),
    # ---- compile / tensor_parallel
    Key("compile.deepcompile", N, "DeepCompile; use torch.compile on the model", (False,)),
    *(Key(f"compile.{k}", I, _DEEPCOMPILE, (v,)) for k, v in (
        ("autoep_non_moe", False), ("free_activation", False), ("free_activation_threshold", 10 * 1024 * 1024),
        ("offload_activation", False), ("offload_activation_pin_memory", True), ("offload_opt_states", False),
        ("double_buffer", True), ("symmetric_memory", False), ("debug_log", False),
        ("offload_parameters", False), ("sync_before_reduce", False), ("sync_after_reduce", False),
        ("sync_before_allgather", False), ("sync_after_allgather", False), ("keep_int_input_tensors", True),
        ("keep_all_input_tensors", False), ("passes", None))),
    Key("tensor_parallel.autotp_size", N, "AutoTP tensor parallelism", (0, 1)),
    *(Key(f"tensor_parallel.{k}", I, _AUTOTP, v) for k, v in (
        ("dtype", ()), ("tp_overlap_comm", (False,)), ("vocab_parallel_lm_head", (None,)),
        ("vocab_parallel_ce_backend", ("torch",)), ("injection_policy_tuple", (None,)),
        ("partition_config", (None,)), ("preset_model", (None,)), ("keep_module_on_host", (False,)),
        ("replace_with_kernel_inject", (False,)), ("kernel_inject", (False,)),
        ("tp", ({}, {"tp_size": 1})), ("tensor_parallel", ({}, {"tp_size": 1})))),
    # ---- zeroinf's own block
    Key("zeroinf.grad_norm_type", S, "the norm of gradient_clipping: 2.0 or \"inf\""),
    Key("zeroinf.overlap_step", S, "stage 3: the optimizer step overlaps the next forward"),
    Key("zeroinf.optimizer_in_backward", S, "stage 3: step each group during the backward"),
    Key("zeroinf.check_memory", S, "initialize compares the memory and disk the config needs with what is "
        "free before it allocates"),
)

TABLE: Dict[str, Key] = {k.path: k for k in _RECORDS}
assert len(TABLE) == len(_RECORDS), "a key path is listed twice"

# blocks whose children the walk checks: SUPPORTED keys with child records, and not open
_CHILDREN: Dict[str, List[str]] = {}
for _k in _RECORDS:
    _parent, _, _leaf = _k.path.rpartition(".")
    _CHILDREN.setdefault(_parent, []).append(_leaf)


def _is_noop(value: Any, noop: Iterable[Any]) -> bool:
    return any(type(value) is type(v) and value == v for v in noop) or (
        isinstance(value, float) and any(type(v) is int and value == v for v in noop))


def _asks_nothing(key: Key, value: Any) -> bool:
    """``value`` of an IGNORED / NOT_IMPLEMENTED key asks for nothing zeroinf lacks."""
    if _is_noop(value, key.noop):
        return True
    if isinstance(value, Mapping):
        if not value or value.get("enabled", True) is False:
            return True  # an empty or disabled feature block
        if key.path == "activation_checkpointing":
            return all(v is None or v is False or v == 0 for v in value.values())
    return False


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def did_you_mean(path: str, known: Iterable[str]) -> str:
    """A "; did you mean X?" hint for the unknown ``path`` ("." when nothing is close): the
    closest key of its own block, else the same key name at another place in the table."""
    parent, _, leaf = path.rpartition(".")
    close = difflib.get_close_matches(leaf, list(known), n=1, cutoff=0.7)
    if close:
        return f"; did you mean {_join(parent, close[0])}?"
    elsewhere = [p for p in TABLE if p.rpartition(".")[2] == leaf and TABLE[p].status is not Status.MAPPED]
    if elsewhere:
        return f"; did you mean {elsewhere[0]}? (the key belongs there)"
    return "."


def unknown_key_message(path: str, known: Iterable[str], acted_on: Optional[Iterable[str]] = None) -> str:
    """The message for a key DeepSpeed 0.19.8 does not know either: a did-you-mean over ``known``
    (its block's keys), then the keys zeroinf acts on there (``acted_on``, default ``known``)."""
    where = f" in {path.rpartition('.')[0]}" if "." in path else ""
    listed = sorted(set(known if acted_on is None else acted_on))
    return (f"unknown key (DeepSpeed 0.19.8 has no such key either){did_you_mean(path, known)} "
            f"Keys zeroinf acts on{where}: {', '.join(listed)} (all keys: docs/deepspeed-config.md)")


# ----------------------------------------------------------------------------------------------
# normalize: raw DeepSpeed dict -> dict holding SUPPORTED keys only


class _Walk:
    def __init__(self, error, extensions: Mapping[str, Iterable[str]], auto_values: Mapping[str, Any]):
        self.error = error                  # (key_path, message) -> exception
        self.extensions = {k: set(v) for k, v in extensions.items()}
        self.auto_values = dict(auto_values)
        self.ignored: List[str] = []
        self.unread: List[str] = []         # top-level keys DeepSpeed does not know and never reads
        self.auto_defaults: List[str] = []
        self.deprecated: List[Tuple[str, str]] = []

    def known(self, prefix: str, status: Optional[Status] = None) -> List[str]:
        return sorted({k for k in _CHILDREN.get(prefix, ()) if status in (None, TABLE[_join(prefix, k)].status)}
                      | self.extensions.get(prefix, set()))

    def block(self, block: Mapping, prefix: str) -> Dict[str, Any]:
        block = self.map_deprecated(dict(block), prefix)
        out: Dict[str, Any] = {}
        for key in sorted(block, key=str):
            path, value = _join(prefix, str(key)), block[key]
            rec = TABLE.get(path)
            if rec is None and str(key) in self.extensions.get(prefix, ()):
                rec = Key(path, Status.SUPPORTED)
            if rec is None:
                if not prefix and did_you_mean(path, self.known(prefix)) == ".":
                    # DeepSpeed reads the top level by name and never looks at other keys (public
                    # configs carry notes and launcher settings there): ignored, as there. A key
                    # close to a known one is taken for a typo and refused below.
                    self.unread.append(path)
                    continue
                raise self.error(path, unknown_key_message(path, self.known(prefix),
                                                           self.known(prefix, Status.SUPPORTED)))
            if rec.status in (Status.IGNORED, Status.NOT_IMPLEMENTED):
                if _asks_nothing(rec, value):
                    continue
                if rec.status is Status.IGNORED:
                    self.ignored.append(path)
                    continue
                raise self.error(path, f"not supported yet: {rec.note} (got {value!r})")
            value = self.value(rec, value)
            if value is _DROP:
                continue
            out[key] = value
        return out

    def value(self, rec: Key, value: Any) -> Any:
        path = rec.path
        if isinstance(value, str) and value.strip().lower() == "auto" and not rec.auto_is_value:
            return self.auto(path)
        if isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                if isinstance(v, str) and v.strip().lower() == "auto":
                    if path in self.auto_values:
                        return self.auto_values[path]
                    raise self.error(f"{path}[{i}]", _AUTO_MESSAGE)
        if isinstance(value, Mapping) and rec.open_block:
            return self.open_block(value, path)
        if isinstance(value, Mapping) and path in _CHILDREN:
            return self.block(value, path)
        return value

    def open_block(self, block: Mapping, prefix: str) -> Dict[str, Any]:
        """A block whose keys the typed parser checks: table keys get their treatment, the rest
        pass through (with their "auto" values resolved)."""
        known = {k: v for k, v in block.items() if _join(prefix, str(k)) in TABLE}
        out = self.block(known, prefix)
        for k, v in block.items():
            if k not in known:
                v = self.value(Key(_join(prefix, str(k)), Status.SUPPORTED), v)
                if v is not _DROP:
                    out[k] = v
        return out

    def auto(self, path: str) -> Any:
        if path in self.auto_values:
            return self.auto_values[path]
        if path.startswith("zero_optimization."):
            self.auto_defaults.append(path)  # DeepSpeed's pydantic models drop "auto": the default
            return _DROP
        if path in _BATCH_KEYS:
            return _BATCH_AUTO
        raise self.error(path, _AUTO_MESSAGE)

    def map_deprecated(self, block: Dict[str, Any], prefix: str) -> Dict[str, Any]:
        for key in sorted(k for k in block if TABLE.get(_join(prefix, str(k)), _NONE).status is Status.MAPPED):
            path, value = _join(prefix, key), block.pop(key)
            target = TABLE[path].note
            self.deprecated.append((path, target))
            leaf = target.rpartition(".")[2]
            if path == "zero_optimization.cpu_offload_use_pin_memory":
                continue  # DeepSpeed drops it too ("use offload_param or offload_optimizer")
            if path in ("zero_optimization.cpu_offload", "zero_optimization.cpu_offload_param"):
                # DeepSpeed: true -> {device: cpu}; false or null -> nothing
                sub = target.split(".")[1]
                if value is not None and not isinstance(value, bool):
                    raise self.error(path, f"expected true or false, got {value!r}")
                if value:
                    if sub in block:
                        raise self.error(path, f"given together with {prefix}.{sub}; use only {sub}")
                    block[sub] = {"device": "cpu"}
                continue
            if leaf in block:
                raise self.error(path, f"given together with {target} (its current name); use only {leaf}")
            block[leaf] = value
        return block


_NONE = Key("", Status.SUPPORTED)
_DROP = object()
_BATCH_AUTO = object()
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_AUTO_MESSAGE = ("\"auto\" needs a value: the Hugging Face Trainer and Accelerate fill it in before the engine reads "
                 "the config, and this caller did not; put a number (or leave the key out for its default), or "
                 "pass it in parse_config(auto_values={...})")


def normalize(config: Mapping[str, Any], error, *, extensions: Mapping[str, Iterable[str]] = {},
              auto_values: Mapping[str, Any] = {}) -> Dict[str, Any]:
    """Apply the table to a raw DeepSpeed config.

    Args:
        config: the raw top-level dict.
        error: ``(key_path, message) -> Exception`` to raise (``ConfigError``).
        extensions: block path -> zeroinf's own keys accepted there besides the table's.
        auto_values: key path -> value for keys whose value is ``"auto"`` (what an integration knows).

    Returns:
        A new dict holding only SUPPORTED keys: deprecated spellings rewritten, keys at no-op
        values and ignored keys dropped, ``"auto"`` replaced (from ``auto_values``; inside
        ``zero_optimization`` dropped, so DeepSpeed's default applies; a batch size derived from
        the other two, which must then be numbers).

    Warns:
        ConfigDeprecationWarning: once per deprecated spelling.
        ConfigWarning: once listing the ignored keys; once listing the ``"auto"`` keys given defaults.

    Raises:
        what ``error`` returns: an unknown key (with a did-you-mean), a feature not implemented, an
        ``"auto"`` nobody resolved, a deprecated spelling given with its current name.
    """
    walk = _Walk(error, extensions, auto_values)
    top = dict(config)
    zero = top.get("zero_optimization")
    if isinstance(zero, bool):
        walk.deprecated.append(("zero_optimization", "zero_optimization.stage"))
        top["zero_optimization"] = {"stage": 1 if zero else 0}
        if zero and "allgather_size" in top:
            top["zero_optimization"]["allgather_bucket_size"] = top.pop("allgather_size")
    out = walk.block(top, "")
    autos = [k for k in _BATCH_KEYS if out.get(k) is _BATCH_AUTO]
    for k in autos:
        others = [o for o in _BATCH_KEYS if o != k]
        if len(autos) > 1 or any(o not in out for o in others):
            raise error(k, _AUTO_MESSAGE + f" (it is derived only when {' and '.join(others)} are numbers)")
        del out[k]  # the batch resolution derives it from the other two
    for path, target in walk.deprecated:
        how = f"read as {target}" if target else "dropped (it has no effect in DeepSpeed either)"
        warnings.warn(f"zeroinf config: {path} is a deprecated spelling; {how}", ConfigDeprecationWarning,
                      stacklevel=3)
    if walk.ignored:
        warnings.warn(f"zeroinf config: {', '.join(walk.ignored)}: no effect in zeroinf, ignored "
                      f"({'; '.join(sorted({TABLE[p].note for p in walk.ignored}))})", ConfigWarning, stacklevel=3)
    if walk.unread:
        warnings.warn(f"zeroinf config: {', '.join(walk.unread)}: not a DeepSpeed config key; ignored, as "
                      "DeepSpeed ignores it (a typo of a known key is refused)", ConfigWarning, stacklevel=3)
    if walk.auto_defaults:
        warnings.warn(f"zeroinf config: {', '.join(walk.auto_defaults)}: \"auto\" takes DeepSpeed's default, "
                      "as DeepSpeed does", ConfigWarning, stacklevel=3)
    return out


# ----------------------------------------------------------------------------------------------
# the docs page


def render_markdown() -> str:
    """``docs/deepspeed-config.md``: every key of :data:`TABLE`, by block."""
    lines = ["# DeepSpeed config keys in zeroinf", "",
             "Generated from `zeroinf/config_keys.py` (`python -m zeroinf.config_keys > docs/deepspeed-config.md`);",
             "a test checks the two agree. One row per key path of DeepSpeed 0.19.8's config.", "",
             "- **supported**: parsed and acted on; **mapped**: a deprecated spelling, read as the key named",
             "  (with a `ConfigDeprecationWarning`); **ignored with a warning**: no effect here, accepted with one",
             "  `ConfigWarning`; **not implemented**: refused, naming the feature.",
             "- Ignored and not-implemented keys are accepted silently at the values listed (DeepSpeed's",
             "  defaults), and so is a block of them with `\"enabled\": false`.",
             "- `\"auto\"`: inside `zero_optimization` it takes DeepSpeed's default, as DeepSpeed does; a batch",
             "  size is derived from the other two; any other `\"auto\"` is refused naming the key unless the",
             "  caller passes `parse_config(auto_values={path: value})`.",
             "- A key DeepSpeed does not know either is refused with a did-you-mean; at the top level, one "
             "close to no known key is ignored with a warning, as DeepSpeed ignores it.", "",
             "| key | status | accepted silently at | note |", "| --- | --- | --- | --- |"]
    for k in _RECORDS:
        noop = ", ".join(f"`{_json(v)}`" for v in k.noop)
        note = f"read as `{k.note}`" if k.status is Status.MAPPED and k.note else (
            "dropped (no effect in DeepSpeed either)" if k.status is Status.MAPPED else k.note)
        lines.append(f"| `{k.path}` | {k.status.value} | {noop} | {note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def _json(v: Any) -> str:
    import json
    return json.dumps(v)


if __name__ == "__main__":
    sys.stdout.write(render_markdown())
