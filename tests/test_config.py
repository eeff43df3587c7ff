"""zeroinf.config: DeepSpeed key names, defaults, batch resolution and key-path errors."""
import dataclasses
import json
import math

import pytest

from zeroinf.config import ConfigDeprecationWarning, ConfigError, min_optimizer_buffer_count, parse_config

BASE = {"train_micro_batch_size_per_gpu": 2}


def err(cfg, world_size=1) -> ConfigError:
    with pytest.raises(ConfigError) as ei:
        parse_config(cfg, world_size=world_size)
    return ei.value


def test_defaults_follow_deepspeed():
    c = parse_config(dict(BASE))
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == (2, 2, 1)
    z = c.zero_optimization
    assert (z.stage, z.sub_group_size, z.reduce_bucket_size, z.contiguous_gradients, z.overlap_comm) == (
        0, 1_000_000_000, 500_000_000, True, False)
    assert (z.offload_optimizer.device, z.offload_optimizer.buffer_count) == ("none", 4)
    assert (z.offload_param.buffer_count, z.offload_param.buffer_size, z.offload_param.max_in_cpu) == (
        5, 100_000_000, 1_000_000_000)
    assert (c.fp16.initial_scale_power, c.fp16.loss_scale_window, c.fp16.hysteresis, c.fp16.min_loss_scale) == (
        16, 1000, 2, 1.0)
    assert (c.aio.block_size, c.aio.queue_depth, c.aio.overlap_events) == (1 << 20, 8, True)
    assert c.precision == "fp32" and c.gradient_clipping == 0.0 and c.zeroinf.grad_norm_type == 2.0
    assert parse_config({**BASE, "zero_optimization": {"stage": 3}}).zero_optimization.overlap_comm is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.gradient_clipping = 1.0


@pytest.mark.parametrize("given,ws,want", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 2, (32, 8, 2)),
    ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 2, (30, 3, 5)),
    ({"train_batch_size": 12}, 3, (12, 4, 1)),
    ({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 4}, 2, (24, 3, 4)),
])
def test_batch_sizes_resolved_against_world_size(given, ws, want):
    c = parse_config(given, world_size=ws)
    assert (c.train_batch_size, c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps) == want


def test_batch_sizes_take_integral_floats_and_name_a_fraction():
    """JSON writers emit 1e11 for 100000000000: an integral float is that integer (DeepSpeed passes
    it on); zeroinf train bounds it by its corpus, zeroinf.initialize takes it as is."""
    c = parse_config({"train_micro_batch_size_per_gpu": 1e11, "gradient_accumulation_steps": 2.0})
    assert (c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps, c.train_batch_size) == (10**11, 2, 2 * 10**11)
    assert type(c.train_micro_batch_size_per_gpu) is int
    assert str(err({"train_micro_batch_size_per_gpu": 1.5})) == "train_micro_batch_size_per_gpu: expected an integer, got 1.5"


def test_batch_size_inconsistency_names_the_key():
    e = err({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, 2)
    assert e.key_path == "train_batch_size" and str(e).startswith("train_batch_size: 10 != ") and "= 8" in str(e)
    assert err({"gradient_accumulation_steps": 2}).key_path == "train_batch_size"


def test_unknown_keys_list_the_allowed_ones():
    e = err({**BASE, "zero_optimization": {"stage": 2, "offload_optimiser": {}}})
    assert e.key_path == "zero_optimization.offload_optimiser"
    assert "unknown key" in str(e) and "offload_optimizer" in str(e) and "sub_group_size" in str(e)
    e = err({**BASE, "zero_optimization": {"offload_optimizer": {"device": "cpu", "pinned": True}}})
    assert str(e).startswith("zero_optimization.offload_optimizer.pinned: unknown key") and "pin_memory" in str(e)
    assert err({**BASE, "trian_batch_size": 1}).key_path == "trian_batch_size"


@pytest.mark.parametrize("cfg,path", [
    ({"amp": {"enabled": True}}, "amp"),
    ({"hybrid_engine": {"enabled": True}}, "hybrid_engine"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
     "zero_optimization.offload_optimizer.ratio"),
    ({"optimizer": {"type": "Lamb"}}, "optimizer.type"),
    ({"optimizer": {"type": "AdamW", "params": {"amsgrad": True}}}, "optimizer.params.amsgrad"),
    ({"scheduler": {"type": "OneCycle"}}, "scheduler.type"),
    ({"fp16": {"enabled": True, "auto_cast": True}}, "fp16.auto_cast"),
    ({"aio": {"use_gds": True}}, "aio.use_gds"),
    ({"activation_checkpointing": {"partition_activations": True}}, "activation_checkpointing"),
])
def test_deepspeed_keys_not_implemented_say_so(cfg, path):
    e = err({**BASE, **cfg})
    assert e.key_path == path and str(e).startswith(f"{path}: ") and "not supported yet" in str(e)


def test_unimplemented_keys_at_their_noop_value_are_accepted_and_others_still_refused():
    # stock DeepSpeed configs spell these out at their defaults; they ask for nothing we lack
    parse_config({**BASE, "prescale_gradients": False, "memory_breakdown": False,
                  "zero_allow_untested_optimizer": True,
                  "zero_optimization": {"stage": 2, "ignore_unused_parameters": True,
                                        "load_from_fp32_weights": True}})
    # DeepSpeed's precision defaults, spelled out (helper-43, t06_config_matrix.py)
    parse_config({**BASE, "fp16": {"enabled": False, "loss_scale": 0, "fp16_master_weights_and_grads": False},
                  "bf16": {"enabled": False, "immediate_grad_update": False, "bf16_master_weights_and_grads": False,
                           "bf16_optimizer_states": False}})
    for cfg, path in [({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
                       "fp16.fp16_master_weights_and_grads"),
                      ({"bf16": {"enabled": True, "immediate_grad_update": True}}, "bf16.immediate_grad_update"),
                      ({"prescale_gradients": True}, "prescale_gradients"),
                      ({"zero_optimization": {"ignore_unused_parameters": False}},
                       "zero_optimization.ignore_unused_parameters"),
                      ({"zero_optimization": {"zero_hpz_partition_size": 8}}, "zero_optimization.zero_hpz_partition_size"),
                      ({"prescale_gradients": 0}, "prescale_gradients")]:  # 0 is not the bool False
        e = err({**BASE, **cfg})
        assert e.key_path == path and "not supported yet" in str(e)


def test_auto_values_name_their_key_and_say_who_fills_them():
    # an HF Trainer / Accelerate config, passed as it is: the first "auto" (sorted key order) is named
    e = err({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
             "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}})
    assert e.key_path == "train_batch_size" and "Hugging Face Trainer" in str(e)
    e = err({**BASE, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": ["auto", 0.999]}}})
    assert e.key_path == "optimizer.params.betas[0]"


def test_checkpoint_block():
    assert parse_config(BASE).checkpoint.tag_validation == "warn"  # DeepSpeed's default
    for given, want in (("Ignore", "ignore"), ("WARN", "warn"), ("Fail", "fail")):
        cfg = parse_config({**BASE, "checkpoint": {"tag_validation": given, "load_universal": False,
                                                    "use_node_local_storage": False,
                                                    "parallel_write": {"pipeline_stage": False}}})
        assert cfg.checkpoint.tag_validation == want
    for block, path in (({"tag_validation": "Strict"}, "checkpoint.tag_validation"),
                        ({"load_universal": True}, "checkpoint.load_universal"),
                        ({"use_node_local_storage": True}, "checkpoint.use_node_local_storage"),
                        ({"parallel_write": {"pipeline_stage": True}}, "checkpoint.parallel_write.pipeline_stage"),
                        ({"tag_validaton": "Warn"}, "checkpoint.tag_validaton")):
        assert err({**BASE, "checkpoint": block}).key_path == path


def test_disabled_feature_block_is_accepted():
    parse_config({**BASE, "tensorboard": {"enabled": False}, "amp": {"enabled": False}})


@pytest.mark.parametrize("cfg,path,text", [
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage", "0, 1, 2, 3"),
    ({"zero_optimization": {"stage": "2"}}, "zero_optimization.stage", "integer"),
    ({"zero_optimization": {"overlap_comm": "yes"}}, "zero_optimization.overlap_comm", "true or false"),
    ({"zero_optimization": {"offload_optimizer": {"device": "disk"}}}, "zero_optimization.offload_optimizer.device",
     "none, cpu, nvme"),
    ({"zero_optimization": {"sub_group_size": 1.5}}, "zero_optimization.sub_group_size", "integer"),
    ({"gradient_clipping": "1.0"}, "gradient_clipping", "number"),
    ({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}, "optimizer.params.betas", "two numbers"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled", "cannot both"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}, "zero_optimization.offload_optimizer.nvme_path",
     "required"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     "zero_optimization.offload_param.nvme_path", "required"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, "scheduler.params.total_num_steps", "required"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}, "scheduler.params.warmup_num_steps",
     ">= 1"),  # DeepSpeed raises too
    ({"aio": {"block_size": 1000}}, "aio.block_size", "multiple of 512"),
    ({"zeroinf": {"grad_norm_type": 0.5}}, "zeroinf.grad_norm_type", ">= 1"),
    ({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}}, "optimizer.params.adam_w_mode", "AdamW"),
    ({"fp16": {"enabled": True, "initial_scale_power": 2000}}, "fp16.initial_scale_power", "<= 127"),  # was OverflowError
])
def test_wrong_values_name_their_key_path(cfg, path, text):
    e = err({**BASE, **cfg})
    assert e.key_path == path and str(e).startswith(f"{path}: ") and text in str(e)


@pytest.mark.parametrize("pr,pw", [(True, False), (False, True), (True, True)])
def test_buffer_count_too_small_for_pipelining_names_the_minimum(pr, pw):
    need = min_optimizer_buffer_count(pr, pw)
    assert need == 1 + pr + pw
    off = {"device": "nvme", "nvme_path": "/x", "pipeline_read": pr, "pipeline_write": pw, "buffer_count": need - 1}
    e = err({**BASE, "zero_optimization": {"stage": 2, "offload_optimizer": off}})
    assert e.key_path == "zero_optimization.offload_optimizer.buffer_count" and f"the minimum is {need}" in str(e)
    off["buffer_count"] = need
    parse_config({**BASE, "zero_optimization": {"stage": 2, "offload_optimizer": off}})


def test_full_deepspeed_style_config_from_a_json_file(tmp_path):
    cfg = {
        "train_batch_size": 16, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0, "steps_per_print": 5,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.8, 0.95], "eps": 1e-6, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e7,
                              "stage3_param_persistence_threshold": 1e5, "stage3_gather_fp16_weights_on_model_save": True,
                              "offload_param": {"device": "nvme", "nvme_path": "/nvme", "buffer_size": 1e8},
                              "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "pipeline_read": True,
                                                    "pipeline_write": True, "pin_memory": True}},
        "aio": {"block_size": 262144, "thread_count": 2},
        "zeroinf": {"grad_norm_type": "inf"},
    }
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(cfg))
    with pytest.warns(ConfigDeprecationWarning, match="aio.thread_count|stage3_gather_fp16"):  # old spellings
        c = parse_config(str(p), world_size=4)
    assert (c.train_micro_batch_size_per_gpu, c.precision) == (2, "bf16")
    assert c.optimizer.type == "adam" and c.optimizer.adam_w_mode and c.optimizer.betas == (0.8, 0.95)
    assert c.scheduler.type == "WarmupCosineLR" and c.scheduler.total_num_steps == 100
    z = c.zero_optimization
    assert z.reduce_bucket_size == 500_000_000 and z.offload_param.buffer_size == 100_000_000
    assert z.stage3_gather_16bit_weights_on_model_save is True
    assert c.aio.intra_op_parallelism == 2 and c.aio.block_size == 262144
    assert math.isinf(c.zeroinf.grad_norm_type)
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_config(str(bad))
