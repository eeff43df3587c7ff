"""zeroinf.config_keys: every DeepSpeed 0.19.8 key is supported, mapped, ignored with a warning or
refused as the table says; configs modelled on public ones parse to the values DeepSpeed reads."""
import json
import math
import warnings
from pathlib import Path

import pytest

from zeroinf.config import ConfigDeprecationWarning, ConfigError, ConfigWarning, parse_config
from zeroinf.config_keys import TABLE, Status, render_markdown

INF = math.inf

# Configs written like the public ones of each project (values as those projects write them);
# the companion check that DeepSpeed 0.19.8's DeepSpeedConfig accepts each one is in the commit
# message. "auto" values are left where the project leaves them for its integration to fill.
CORPUS = {
    # DeepSpeed-Chat training/utils/ds_utils.py get_train_ds_config(offload=False, stage=2)
    "ds_chat_step1": {
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
        "zero_optimization": {"stage": 2, "overlap_comm": True, "offload_param": {"device": "none"},
                              "offload_optimizer": {"device": "none"}, "stage3_param_persistence_threshold": 1e4,
                              "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7,
                              "memory_efficient_linear": False},
        "fp16": {"enabled": True, "loss_scale_window": 100}, "gradient_clipping": 1.0,
        "prescale_gradients": False, "wall_clock_breakdown": False,
        "hybrid_engine": {"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                          "release_inference_cache": False, "pin_parameters": True, "tp_gather_partition_size": 8},
        "tensorboard": {"enabled": False, "output_path": "step1_tensorboard/ds_tensorboard_logs/",
                        "job_name": "step1_model_tensorboard"},
    },
    # the same with --offload: offload_param is written at stage 2 too (DeepSpeed reads it at stage 3 only)
    "ds_chat_step1_offload": {
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
        "zero_optimization": {"stage": 2, "overlap_comm": True, "offload_param": {"device": "cpu"},
                              "offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 1e4,
                              "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7,
                              "memory_efficient_linear": False},
        "bf16": {"enabled": True}, "gradient_clipping": 1.0, "prescale_gradients": False,
        "wall_clock_breakdown": False,
    },
    # what Accelerate writes from its DeepSpeed plugin (zero_stage 2, bf16), batch sizes left "auto"
    "accelerate_zero2": {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none", "nvme_path": None},
                              "offload_param": {"device": "none", "nvme_path": None},
                              "stage3_gather_16bit_weights_on_model_save": False},
        "gradient_clipping": 1.0, "steps_per_print": INF, "bf16": {"enabled": True}, "fp16": {"enabled": False},
        "zero_allow_untested_optimizer": True,
    },
    # transformers' docs ds_config_zero3.json
    "transformers_zero3": {
        "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                 "hysteresis": 2, "min_loss_scale": 1},
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                     "warmup_num_steps": "auto"}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                              "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                              "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                              "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                              "stage3_gather_16bit_weights_on_model_save": True},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
    },
    # LLaMA-Factory examples/deepspeed/ds_z3_offload_config.json
    "llamafactory_z3_offload": {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
        "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                 "hysteresis": 2, "min_loss_scale": 1},
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": False,
                              "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                              "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                              "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                              "stage3_gather_16bit_weights_on_model_save": True},
    },
    # OpenRLHF utils/deepspeed/deepspeed_utils.py get_train_ds_config(offload=True, stage=3)
    "openrlhf_z3": {
        "steps_per_print": 100,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "none"},
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}, "sub_group_size": "auto",
                              "stage3_max_live_parameters": "auto", "stage3_max_reuse_distance": "auto",
                              "stage3_param_persistence_threshold": "auto", "stage3_prefetch_bucket_size": "auto",
                              "reduce_bucket_size": "auto", "zero_hpz_partition_size": 1,
                              "zero_quantized_weights": False, "zero_quantized_gradients": False},
        "bf16": {"enabled": True}, "gradient_clipping": 1.0, "prescale_gradients": False,
        "wall_clock_breakdown": False, "data_types": {"grad_accum_dtype": "fp32"},
        "train_micro_batch_size_per_gpu": 1, "train_batch_size": 128,
    },
    # an older DeepSpeedExamples ZeRO-Offload config: the deprecated cpu_offload switch at stage 2
    "cpu_offload_stage2": {
        "train_batch_size": 16, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2, "cpu_offload": True, "contiguous_gradients": True, "overlap_comm": True,
                              "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7},
        "fp16": {"enabled": True, "initial_scale_power": 12},
    },
    # stage-3 knobs with the unprefixed field names DeepSpeed's pydantic model also takes
    "stage3_unprefixed": {
        "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "sub_group_size": 0, "max_live_parameters": 3e8,
                              "max_reuse_distance": 2e8, "prefetch_bucket_size": 4e7,
                              "param_persistence_threshold": 2e4, "gather_16bit_weights_on_model_save": True},
    },
    # Megatron-DeepSpeed style: profiling and communication logging on
    "megatron_profiled": {
        "train_batch_size": 256, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
        "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "prescale_gradients": False,
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1,
                 "initial_scale_power": 11},
        "wall_clock_breakdown": False,
        "flops_profiler": {"enabled": True, "profile_step": 1, "module_depth": -1, "top_modules": 3, "detailed": True},
        "comms_logger": {"enabled": True, "verbose": False, "prof_all": True},
    },
    # DeepSpeedExamples ZeRO-Infinity: NVMe with every aio knob spelled out, plus no-op values
    "zero_infinity_nvme": {
        "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local_nvme",
                                                            "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9,
                                                            "pin_memory": True},
                              "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                                                    "buffer_count": 4, "fast_init": False}},
        "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                "overlap_events": True, "use_gds": False},
        "compile": {"deepcompile": False}, "tensor_parallel": {"autotp_size": 1},
        "data_types": {"grad_accum_dtype": None},
    },
}


def parse_quietly(cfg, **kw):
    """parse_config, failing on any warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return parse_config(cfg, **kw)


def err(cfg, **kw) -> ConfigError:
    with pytest.raises(ConfigError) as ei:
        parse_config(cfg, **kw)
    return ei.value


# ---- the corpus


def test_deepspeed_chat_config_parses_with_no_warning():
    c = parse_quietly(CORPUS["ds_chat_step1"], world_size=8)
    z = c.zero_optimization
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (32, 4, 1)
    assert (z.stage, z.overlap_comm, z.stage3_max_live_parameters, z.stage3_prefetch_bucket_size) == (
        2, True, 30_000_000, 30_000_000)
    assert z.stage3_param_persistence_threshold == 10_000
    assert c.precision == "fp16" and c.fp16.loss_scale_window == 100 and c.gradient_clipping == 1.0


def test_offload_param_below_stage_3_is_ignored_with_a_warning():
    with pytest.warns(ConfigWarning, match=r"offload_param.device 'cpu' has no effect at zero_optimization.stage 2"):
        c = parse_config(CORPUS["ds_chat_step1_offload"], world_size=8)
    z = c.zero_optimization
    assert z.offload_optimizer.device == "cpu" and z.offload_param.device == "none" and c.precision == "bf16"


def test_accelerate_config_takes_inf_steps_per_print_and_the_batch_it_resolves():
    cfg = CORPUS["accelerate_zero2"]
    e = err(cfg)  # Accelerate fills the batch sizes in; left as they are, the first is named
    assert e.key_path == "train_batch_size" and '"auto" needs a value' in str(e)
    c = parse_quietly(cfg, world_size=2, auto_values={"train_micro_batch_size_per_gpu": 4})
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (8, 4, 1)
    assert c.steps_per_print == 0  # inf: never, as DeepSpeed's `step % inf` never hits 0
    assert c.precision == "bf16" and c.zero_optimization.offload_param.device == "none"


def test_transformers_zero3_with_the_trainer_values_and_zero_autos_left_to_defaults():
    cfg = CORPUS["transformers_zero3"]
    trainer = {"fp16.enabled": False, "bf16.enabled": True, "optimizer.params.lr": 3e-5,
               "optimizer.params.betas": [0.9, 0.98], "optimizer.params.eps": 1e-6,
               "optimizer.params.weight_decay": 0.01, "scheduler.params.warmup_min_lr": 0.0,
               "scheduler.params.warmup_max_lr": 3e-5, "scheduler.params.warmup_num_steps": 50,
               "gradient_accumulation_steps": 2, "gradient_clipping": 0.5, "train_micro_batch_size_per_gpu": 3,
               "train_batch_size": 12}
    # hidden size 64: the Trainer's own zero values (h*h, 0.9*h*h, 10*h)
    h = 64
    zero = {"zero_optimization.reduce_bucket_size": h * h, "zero_optimization.stage3_prefetch_bucket_size": 3686,
            "zero_optimization.stage3_param_persistence_threshold": 10 * h}
    c = parse_quietly(cfg, world_size=2, auto_values={**trainer, **zero})
    o, s, z = c.optimizer, c.scheduler, c.zero_optimization
    assert (o.type, o.lr, o.betas, o.eps, o.weight_decay) == ("adamw", 3e-5, (0.9, 0.98), 1e-6, 0.01)
    assert (s.type, s.warmup_max_lr, s.warmup_num_steps) == ("WarmupLR", 3e-5, 50)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (12, 3, 2)
    assert (c.precision, c.gradient_clipping, c.steps_per_print) == ("bf16", 0.5, 2000)
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (
        4096, 3686, 640)
    assert (z.offload_optimizer.device, z.offload_param.device, z.stage3_gather_16bit_weights_on_model_save) == (
        "cpu", "cpu", True)
    # zero_optimization "auto" the integration did not fill: DeepSpeed's defaults, with one warning
    with pytest.warns(ConfigWarning, match='reduce_bucket_size, .*"auto" takes DeepSpeed\'s default'):
        z = parse_config(cfg, world_size=2, auto_values=trainer).zero_optimization
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (
        500_000_000, 50_000_000, 100_000)
    # any other "auto" left unfilled names its key
    e = err(cfg, world_size=2, auto_values={k: v for k, v in trainer.items() if k != "optimizer.params.lr"})
    assert e.key_path == "optimizer.params.lr" and str(e).startswith('optimizer.params.lr: "auto" needs a value')


def test_llamafactory_z3_offload():
    cfg = CORPUS["llamafactory_z3_offload"]
    given = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
             "fp16.enabled": False, "bf16.enabled": True}
    with pytest.warns(ConfigWarning, match='"auto" takes DeepSpeed\'s default'):
        c = parse_config(cfg, world_size=4, auto_values=given)
    z = c.zero_optimization
    assert (c.train_batch_size, c.gradient_accumulation_steps) == (32, 4)  # train_batch_size derived
    assert (z.stage, z.offload_optimizer.device, z.offload_optimizer.pin_memory, z.offload_param.device) == (
        3, "cpu", True, "cpu")
    assert (z.overlap_comm, z.sub_group_size, z.stage3_max_live_parameters, z.reduce_bucket_size) == (
        False, 1_000_000_000, 1_000_000_000, 500_000_000)
    # two of the three batch sizes "auto": nothing to derive them from
    e = err(cfg, world_size=4, auto_values={k: v for k, v in given.items() if k != "gradient_accumulation_steps"})
    assert e.key_path == "train_batch_size" and "derived only when" in str(e)


def test_openrlhf_zero_autos_take_deepspeeds_defaults():
    with pytest.warns(ConfigWarning) as rec:
        c = parse_config(CORPUS["openrlhf_z3"], world_size=8)
    assert len(rec) == 1 and "zero_optimization.sub_group_size" in str(rec[0].message)
    z = c.zero_optimization
    assert (c.gradient_accumulation_steps, z.stage, z.offload_optimizer.device) == (16, 3, "cpu")
    assert (z.sub_group_size, z.stage3_max_live_parameters, z.stage3_max_reuse_distance,
            z.stage3_param_persistence_threshold, z.stage3_prefetch_bucket_size, z.reduce_bucket_size) == (
        10**9, 10**9, 10**9, 100_000, 50_000_000, 500_000_000)


def test_cpu_offload_true_maps_to_the_optimizer_on_cpu():
    with pytest.warns(ConfigDeprecationWarning, match="zero_optimization.cpu_offload is a deprecated spelling"):
        c = parse_config(CORPUS["cpu_offload_stage2"])
    z = c.zero_optimization
    assert (z.stage, z.offload_optimizer.device, z.reduce_bucket_size, z.allgather_bucket_size) == (
        2, "cpu", 50_000_000, 50_000_000)
    assert c.fp16.initial_scale_power == 12
    with pytest.warns(ConfigDeprecationWarning):
        z = parse_config({"train_batch_size": 2,
                          "zero_optimization": {"stage": 2, "cpu_offload": False}}).zero_optimization
    assert z.offload_optimizer.device == "none"
    with pytest.warns(ConfigDeprecationWarning):
        z = parse_config({"train_batch_size": 2, "zero_optimization": {
            "stage": 3, "cpu_offload_param": True, "cpu_offload_use_pin_memory": True}}).zero_optimization
    assert (z.offload_param.device, z.offload_optimizer.device) == ("cpu", "none")
    e = err({"train_batch_size": 2,
             "zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "nvme"}}})
    assert e.key_path == "zero_optimization.cpu_offload" and "given together" in str(e)


def test_unprefixed_stage3_knobs_map_to_their_stage3_names():
    with pytest.warns(ConfigDeprecationWarning) as rec:
        c = parse_config(CORPUS["stage3_unprefixed"])
    assert len(rec) == 5 and all("read as zero_optimization.stage3_" in str(r.message) for r in rec)
    z = c.zero_optimization
    assert (z.stage3_max_live_parameters, z.stage3_max_reuse_distance, z.stage3_prefetch_bucket_size,
            z.stage3_param_persistence_threshold, z.stage3_gather_16bit_weights_on_model_save) == (
        300_000_000, 200_000_000, 40_000_000, 20_000, True)
    assert z.sub_group_size == 10**9  # 0 takes the default tiling
    e = err({"train_batch_size": 2, "zero_optimization": {"max_live_parameters": 1, "stage3_max_live_parameters": 2}})
    assert e.key_path == "zero_optimization.max_live_parameters" and "given together" in str(e)


def test_monitoring_and_profiling_are_ignored_with_one_warning():
    with pytest.warns(ConfigWarning) as rec:
        c = parse_config(CORPUS["megatron_profiled"], world_size=8)
    assert len(rec) == 1
    assert str(rec[0].message).startswith("zeroinf config: comms_logger, flops_profiler: no effect in zeroinf, ignored")
    assert (c.gradient_accumulation_steps, c.fp16.initial_scale_power, c.fp16.loss_scale_window) == (8, 11, 500)


def test_noop_values_of_unimplemented_features_are_accepted_silently():
    c = parse_quietly(CORPUS["zero_infinity_nvme"])
    z = c.zero_optimization
    assert (z.offload_param.device, z.offload_param.buffer_size, z.offload_optimizer.device) == ("nvme", 10**8, "nvme")
    assert z.offload_param.nvme_path == "/local_nvme" and c.aio.block_size == 1 << 20


# ---- refusals


@pytest.mark.parametrize("cfg,path,hint", [
    ({"zero_optimization": {"stage3_max_live_parameter": 1}}, "zero_optimization.stage3_max_live_parameter",
     "did you mean zero_optimization.stage3_max_live_parameters?"),
    ({"gradient_cliping": 1.0}, "gradient_cliping", "did you mean gradient_clipping?"),
    ({"offload_optimizer": {"device": "cpu"}}, "offload_optimizer",
     "did you mean zero_optimization.offload_optimizer? (the key belongs there)"),
    ({"fp16": {"enabled": True, "loss_scale_windows": 10}}, "fp16.loss_scale_windows",
     "did you mean fp16.loss_scale_window?"),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}}, "optimizer.params.weight_decy",
     "did you mean optimizer.params.weight_decay?"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_step": 5}}}, "scheduler.params.warmup_num_step",
     "did you mean scheduler.params.warmup_num_steps?"),
    ({"aio": {"queue_dpth": 4}}, "aio.queue_dpth", "did you mean aio.queue_depth?"),
])
def test_typos_are_refused_with_did_you_mean(cfg, path, hint):
    e = err({"train_batch_size": 2, **cfg})
    assert e.key_path == path and "unknown key" in str(e) and hint in str(e), str(e)


@pytest.mark.parametrize("cfg,path,feature", [
    ({"hybrid_engine": {"enabled": True, "max_out_tokens": 512}}, "hybrid_engine", "hybrid (training + generation)"),
    ({"compile": {"deepcompile": True}}, "compile.deepcompile", "DeepCompile; use torch.compile"),
    ({"tensor_parallel": {"autotp_size": 2}}, "tensor_parallel.autotp_size", "AutoTP tensor parallelism"),
    ({"aio": {"use_gds": True}}, "aio.use_gds", "GPUDirect Storage"),
    ({"data_types": {"grad_accum_dtype": "bf16"}}, "data_types.grad_accum_dtype", "accumulates in fp32"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "zero_optimization.zero_quantized_weights",
     "ZeRO++"),
    ({"activation_checkpointing": {"partition_activations": True}}, "activation_checkpointing",
     "use torch.utils.checkpoint"),
    ({"sequence_parallel_size": 4}, "sequence_parallel_size", "sequence parallelism"),
])
def test_unimplemented_features_are_refused_naming_them(cfg, path, feature):
    e = err({"train_batch_size": 2, **cfg})
    assert e.key_path == path and "not supported yet" in str(e) and feature in str(e), str(e)


def test_disabled_or_all_false_blocks_ask_for_nothing():
    parse_quietly({"train_batch_size": 2, "activation_checkpointing": {
        "partition_activations": False, "contiguous_memory_optimization": False, "cpu_checkpointing": False,
        "number_checkpoints": None, "synchronize_checkpoint_boundary": False, "profile": False},
        "flops_profiler": {"enabled": False, "profile_step": 1}, "wandb": {"enabled": False},
        "data_efficiency": {"enabled": False}, "compile": {}, "zero_optimization": {"leaf_module": {}}})


# ---- steps_per_print, files, auto


@pytest.mark.parametrize("given,want", [(INF, 0), ("inf", 0), (0, 0), (2000, 2000), (5.0, 5), (2.5, 2.5)])
def test_steps_per_print_takes_any_number(given, want):
    c = parse_quietly({"train_batch_size": 2, "steps_per_print": given})
    assert c.steps_per_print == want and type(c.steps_per_print) is type(want)
    assert err({"train_batch_size": 2, "steps_per_print": -1}).key_path == "steps_per_print"


def test_json_file_with_infinity_and_duplicate_keys(tmp_path):
    p = tmp_path / "accelerate.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "steps_per_print": INF}))  # writes Infinity
    assert "Infinity" in p.read_text() and parse_quietly(str(p)).steps_per_print == 0
    p.write_text('{"train_batch_size": 2, "gradient_clipping": 1.0, "gradient_clipping": 0.5}')
    e = err(str(p))
    assert e.key_path == "gradient_clipping" and "given twice" in str(e)


def test_hjson_file_is_read_when_hjson_is_installed(tmp_path):
    pytest.importorskip("hjson")
    p = tmp_path / "ds.hjson"
    p.write_text("{\n  # a comment, as hjson allows\n  train_micro_batch_size_per_gpu: 3\n"
                 "  zero_optimization: {stage: 2, reduce_bucket_size: 1000}\n}\n")
    c = parse_quietly(str(p))
    assert c.train_micro_batch_size_per_gpu == 3 and c.zero_optimization.reduce_bucket_size == 1000


def test_auto_batch_size_is_derived_from_the_other_two():
    c = parse_quietly({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3,
                       "gradient_accumulation_steps": "auto"}, world_size=2)
    assert c.gradient_accumulation_steps == 4
    assert parse_quietly({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 3,
                          "gradient_accumulation_steps": 2}, world_size=2).train_batch_size == 12


# ---- the table


def _nest(path: str, value):
    cfg = value
    for part in reversed(path.split(".")):
        cfg = {part: cfg}
    return cfg


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


BASE = {"train_micro_batch_size_per_gpu": 2}
# a config that sets each SUPPORTED key to a value other than its default, and the parsed value read
# back (None: a block, or a key accepted at any value with no effect; checked only to parse)
SUPPORTED = {
    "train_batch_size": ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": None},
                         lambda c: c.train_batch_size, 8),
    "train_micro_batch_size_per_gpu": ({}, lambda c: c.train_micro_batch_size_per_gpu, 2),
    "gradient_accumulation_steps": ({"gradient_accumulation_steps": 3}, lambda c: c.train_batch_size, 6),
    "steps_per_print": ({"steps_per_print": 7}, lambda c: c.steps_per_print, 7),
    "wall_clock_breakdown": ({"wall_clock_breakdown": True}, lambda c: c.wall_clock_breakdown, True),
    "gradient_clipping": ({"gradient_clipping": 0.25}, lambda c: c.gradient_clipping, 0.25),
    "optimizer": ({"optimizer": {"type": "Adam"}}, lambda c: c.optimizer.type, "adam"),
    "optimizer.type": ({"optimizer": {"type": "AdamW"}}, lambda c: c.optimizer.type, "adamw"),
    "optimizer.params": ({"optimizer": {"type": "AdamW", "params": {}}}, lambda c: c.optimizer.lr, 1e-3),
    "scheduler": ({"scheduler": {"type": "WarmupLR"}}, lambda c: c.scheduler.type, "WarmupLR"),
    "scheduler.type": ({"scheduler": {"type": "warmupcosinelr", "params": {"total_num_steps": 9}}},
                       lambda c: c.scheduler.type, "WarmupCosineLR"),
    "scheduler.params": ({"scheduler": {"type": "WarmupLR", "params": {}}},
                         lambda c: c.scheduler.warmup_num_steps, 1000),
    "fp16": ({"fp16": {"enabled": True}}, lambda c: c.precision, "fp16"),
    "bf16": ({"bf16": {"enabled": True}}, lambda c: c.precision, "bf16"),
    "bf16.enabled": ({"bf16": {"enabled": True}}, lambda c: c.bf16.enabled, True),
    "zero_optimization": ({"zero_optimization": {"stage": 1}}, lambda c: c.zero_optimization.stage, 1),
    "aio": ({"aio": {}}, None, None), "checkpoint": ({"checkpoint": {}}, None, None),
    "data_types": ({"data_types": {}}, None, None), "compile": ({"compile": {}}, None, None),
    "tensor_parallel": ({"tensor_parallel": {}}, None, None),
    "checkpoint.parallel_write": ({"checkpoint": {"parallel_write": {}}}, None, None),
    "zero_allow_untested_optimizer": ({"zero_allow_untested_optimizer": False}, None, None),
    "zero_force_ds_cpu_optimizer": ({"zero_force_ds_cpu_optimizer": False}, None, None),
    "zero_optimization.memory_efficient_linear": ({"zero_optimization": {"memory_efficient_linear": False}}, None, None),
    "zeroinf": ({"zeroinf": {}}, lambda c: c.zeroinf.overlap_step, True),
    "zeroinf.grad_norm_type": ({"zeroinf": {"grad_norm_type": "inf"}}, lambda c: c.zeroinf.grad_norm_type, INF),
    "zeroinf.overlap_step": ({"zeroinf": {"overlap_step": False}}, lambda c: c.zeroinf.overlap_step, False),
    "aio.verify_checksums": ({"aio": {"verify_checksums": False}}, lambda c: c.aio.verify_checksums, False),
    "zeroinf.check_memory": ({"zeroinf": {"check_memory": False}}, lambda c: c.zeroinf.check_memory, False),
    "zeroinf.optimizer_in_backward": ({"zeroinf": {"optimizer_in_backward": True}, "zero_optimization": {"stage": 3}},
                                      lambda c: c.zeroinf.optimizer_in_backward, True),
    "optimizer.params.torch_adam": ({"optimizer": {"type": "Adam", "params": {"torch_adam": True}}}, None, None),
    "optimizer.params.fused": ({"optimizer": {"type": "Adam", "params": {"fused": True}}}, None, None),
    "checkpoint.tag_validation": ({"checkpoint": {"tag_validation": "Fail"}}, lambda c: c.checkpoint.tag_validation,
                                  "fail"),
    "zero_optimization.offload_optimizer": ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
                                            lambda c: c.zero_optimization.offload_optimizer.device, "cpu"),
    "zero_optimization.offload_param": ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
                                        lambda c: c.zero_optimization.offload_param.device, "cpu"),
}
_LEAF_VALUES = {  # SUPPORTED leaves read back from the dataclass attribute of the same name
    "optimizer.params": {"lr": 0.5, "betas": [0.5, 0.6], "eps": 1e-3, "weight_decay": 0.2, "adam_w_mode": True,
                         "bias_correction": False},
    "scheduler.params": {"warmup_min_lr": 0.1, "warmup_max_lr": 0.2, "warmup_num_steps": 7, "warmup_type": "linear",
                         "total_num_steps": 70, "warmup_min_ratio": 0.3, "cos_min_ratio": 0.4},
    "fp16": {"enabled": True, "loss_scale": 8.0, "initial_scale_power": 5, "loss_scale_window": 9, "hysteresis": 3,
             "consecutive_hysteresis": True, "min_loss_scale": 2.0},
    "zero_optimization": {"stage": 3, "sub_group_size": 77, "reduce_bucket_size": 78, "allgather_bucket_size": 79,
                          "reduce_scatter": False, "stage3_prefetch_bucket_size": 80,
                          "stage3_param_persistence_threshold": 81, "stage3_max_live_parameters": 82,
                          "stage3_max_reuse_distance": 83, "stage3_gather_16bit_weights_on_model_save": True,
                          "overlap_comm": False, "contiguous_gradients": False, "allgather_partitions": False,
                          "round_robin_gradients": True},
    "zero_optimization.offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 9,
                                            "pin_memory": True, "pipeline_read": True, "pipeline_write": True,
                                            "fast_init": True, "state_dtype": "bf16"},
    "zero_optimization.offload_param": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 9, "buffer_size": 10,
                                        "max_in_cpu": 11, "pin_memory": True, "ratio": 0.25},
    "aio": {"block_size": 4096, "queue_depth": 3, "intra_op_parallelism": 2, "single_submit": True,
            "overlap_events": False},
}
_CONTEXT = {  # what a key needs beside it (WarmupDecayLR has every scheduler key but the two ratios)
    "scheduler.params": {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 70}}},
    "zero_optimization.offload_param": {"zero_optimization": {"stage": 3, "offload_param": {"nvme_path": "/nvme"}}},
    "zero_optimization.offload_optimizer": {"zero_optimization": {"offload_optimizer": {"nvme_path": "/nvme"}}},
    "optimizer.params": {"optimizer": {"type": "Adam"}}}
_ATTR = {"optimizer.params": lambda c: c.optimizer, "scheduler.params": lambda c: c.scheduler, "fp16": lambda c: c.fp16,
         "zero_optimization": lambda c: c.zero_optimization,
         "zero_optimization.offload_optimizer": lambda c: c.zero_optimization.offload_optimizer,
         "zero_optimization.offload_param": lambda c: c.zero_optimization.offload_param, "aio": lambda c: c.aio}
for _block, _vals in _LEAF_VALUES.items():
    for _k, _v in _vals.items():
        _frag = _merge(_CONTEXT.get(_block, {}), _nest(f"{_block}.{_k}", _v))
        if _block == "optimizer.params":
            _frag["optimizer"]["type"] = "Adam"
        if _k in ("warmup_min_ratio", "cos_min_ratio"):
            _frag["scheduler"]["type"] = "WarmupCosineLR"
        _want = tuple(_v) if isinstance(_v, list) else _v
        if _k == "nvme_path":
            _want = "/nvme"
        if _k == "ratio":  # read only with parameters offloaded
            _frag["zero_optimization"]["offload_param"]["device"] = "cpu"
        SUPPORTED[f"{_block}.{_k}"] = (_frag, (lambda b, k: lambda c: getattr(_ATTR[b](c), k))(_block, _k), _want)
MAPPED = {  # a value for each mapped key, and the parsed value it lands on
    "bfloat16": ({"enabled": True}, lambda c: c.precision, "bf16"),
    "zero_optimization.cpu_offload": (True, lambda c: c.zero_optimization.offload_optimizer.device, "cpu"),
    "zero_optimization.cpu_offload_param": (True, lambda c: c.zero_optimization.offload_param.device, "cpu"),
    "zero_optimization.cpu_offload_use_pin_memory": (True, lambda c: c.zero_optimization.offload_optimizer.pin_memory,
                                                     False),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": (
        True, lambda c: c.zero_optimization.stage3_gather_16bit_weights_on_model_save, True),
    "zero_optimization.prefetch_bucket_size": (5, lambda c: c.zero_optimization.stage3_prefetch_bucket_size, 5),
    "zero_optimization.param_persistence_threshold": (
        6, lambda c: c.zero_optimization.stage3_param_persistence_threshold, 6),
    "zero_optimization.max_live_parameters": (7, lambda c: c.zero_optimization.stage3_max_live_parameters, 7),
    "zero_optimization.max_reuse_distance": (8, lambda c: c.zero_optimization.stage3_max_reuse_distance, 8),
    "zero_optimization.gather_16bit_weights_on_model_save": (
        True, lambda c: c.zero_optimization.stage3_gather_16bit_weights_on_model_save, True),
    "zero_optimization.model_persistence_threshold": (2**63 - 1, None, None),
    "zero_optimization.module_granularity_threshold": (0, None, None),
    "zero_optimization.use_all_reduce_for_fetch_params": (False, None, None),
    "zero_optimization.allgather_sequential": (False, None, None),
    "aio.thread_count": (3, lambda c: c.aio.intra_op_parallelism, 3),
}
_NOT_A_NOOP = "not-a-noop-value"


def _outcome(path: str):
    """Exercise one table key as its record says; returns None or raises AssertionError."""
    rec = TABLE[path]
    stage3 = {"zero_optimization": {"stage": 3}} if path.startswith("zero_optimization.") else {}
    stage3 = _merge(stage3, next((v for k, v in _CONTEXT.items() if path.startswith(k + ".")), {}))
    if rec.status is Status.SUPPORTED:
        frag, read, want = SUPPORTED[path]
        cfg = {k: v for k, v in _merge(_merge(BASE, stage3), frag).items() if v is not None}
        c = parse_quietly(cfg)
        assert read is None or read(c) == want, (path, read(c), want)
    elif rec.status is Status.MAPPED:
        value, read, want = MAPPED[path]
        with pytest.warns(ConfigDeprecationWarning, match=path.replace(".", r"\.")):
            c = parse_config(_merge(_merge(BASE, stage3), _nest(path, value)))
        assert read is None or read(c) == want, (path, read(c), want)
    else:
        for value in rec.noop:  # what asks for nothing passes with no warning
            parse_quietly(_merge(_merge(BASE, stage3), _nest(path, value)))
        cfg = _merge(_merge(BASE, stage3), _nest(path, _NOT_A_NOOP))
        if rec.status is Status.IGNORED:
            with pytest.warns(ConfigWarning, match=f"{path}: no effect in zeroinf, ignored"):
                parse_config(cfg)
        else:
            e = err(cfg)
            assert e.key_path == path and str(e).startswith(f"{path}: not supported yet: {rec.note}"), str(e)


@pytest.mark.parametrize("path", sorted(TABLE))
def test_every_table_key_behaves_as_the_table_says(path):
    _outcome(path)


def test_the_docs_table_is_generated_from_the_code_table():
    doc = Path(__file__).resolve().parents[1] / "docs" / "deepspeed-config.md"
    assert doc.read_text() == render_markdown(), "regenerate: python -m zeroinf.config_keys > docs/deepspeed-config.md"
    assert sum(line.startswith("| `") for line in doc.read_text().splitlines()) == len(TABLE)


def test_zero_optimization_as_a_bool_is_deepspeeds_oldest_form():
    with pytest.warns(ConfigDeprecationWarning, match="zero_optimization is a deprecated spelling"):
        z = parse_config({"train_batch_size": 2, "zero_optimization": True, "allgather_size": 1000}).zero_optimization
    assert (z.stage, z.allgather_bucket_size) == (1, 1000)
    with pytest.warns(ConfigDeprecationWarning):
        assert parse_config({"train_batch_size": 2, "zero_optimization": False}).zero_optimization.stage == 0


def test_top_level_keys_deepspeed_never_reads_are_ignored_with_a_warning():
    """DeepSpeed reads its top level by name and never looks at other keys; public configs carry
    notes there. Such a key is ignored with one warning; one close to a known key is a typo."""
    with pytest.warns(ConfigWarning, match=r"description, wandb_project: not a DeepSpeed config key; ignored"):
        cfg = parse_config({"train_batch_size": 2, "description": "z3 offload", "wandb_project": "x"})
    assert cfg.train_batch_size == 2
    e = err({"train_batch_size": 2, "gradient_cliping": 1.0})
    assert e.key_path == "gradient_cliping" and "did you mean gradient_clipping?" in str(e)


@pytest.mark.parametrize("knobs, prefetch, live, reuse", [
    ({"stage3_max_live_parameters": 0}, 0, "unbounded", 10**9),
    ({"stage3_prefetch_bucket_size": 0}, 0, 10**9, 10**9),
    ({"stage3_max_reuse_distance": 0}, 50_000_000, 10**9, 0),
    ({"stage3_max_live_parameters": 0, "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0},
     0, "unbounded", 0)])
def test_stage3_knobs_at_zero_are_read_as_deepspeed_reads_them(tmp_path, knobs, prefetch, live, reuse):
    """DeepSpeed accepts 0 for the three: a prefetch bucket of 0 prefetches nothing, a reuse
    distance of 0 keeps no module gathered after use, and max_live_parameters bounds only
    prefetching (0: none; gathers on demand unbounded). A stage-3 engine with them trains as
    torch.optim.AdamW does."""
    import sys
    import torch
    import zeroinf
    from stage3_models import TinyLM, batch, loss_fn
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}, **knobs}}
    z = parse_quietly(cfg).zero_optimization
    assert (z.stage3_prefetch_bucket_size, z.stage3_max_reuse_distance) == (prefetch, reuse)
    assert z.stage3_max_live_parameters == (sys.maxsize if live == "unbounded" else live)
    torch.manual_seed(0)
    model = TinyLM()
    ref = TinyLM()
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    engine, *_ = zeroinf.initialize(model=model, config=cfg)
    for step in (1, 2):
        x, y = batch(step)
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-6)
    engine.close()
