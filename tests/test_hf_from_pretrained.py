"""transformers' ``from_pretrained`` under a ZeRO-3 config with zeroinf as the engine
(``zeroinf.integrations.hf.enable()``): the model is built under zeroinf.Init and its weights
land in what zeroinf holds, equal bit for bit to the saved ones; and the stage-3 ``Init`` fix it
needed, on its own (a held parameter loaded inside ``gathered_parameters(modifier_rank=0)``)."""
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import zeroinf


def test_load_state_dict_inside_gathered_block_keeps_the_loaded_values(tmp_path):
    """A held parameter whose construction values hold NaN (``torch.empty`` under transformers'
    no_init_weights) takes the values ``load_state_dict`` copies in a ``modifier_rank=0`` block;
    a -0.0 over a 0.0 is kept too (torch.equal calls them equal)."""
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    with zeroinf.Init(config=cfg):
        lin = nn.Linear(4, 3)
        with torch.no_grad():
            lin.weight.fill_(float("nan"))
            lin.bias.zero_()
    want = {"weight": torch.arange(12.0).reshape(3, 4), "bias": torch.tensor([-0.0, 1.0, -0.0])}
    with zeroinf.gathered_parameters(list(lin.parameters()), modifier_rank=0):
        lin.load_state_dict(want)
    got = lin.state_dict()
    assert torch.equal(got["weight"], want["weight"])
    assert torch.equal(got["bias"].view(torch.int32), want["bias"].view(torch.int32))


CASE = '''
import json, sys, tempfile, torch
import zeroinf.integrations.hf
zeroinf.integrations.hf.enable()   # before transformers is imported
import transformers
from transformers.integrations import HfDeepSpeedConfig
import zeroinf
from zeroinf.runtime.stage3.init import init_shapes
out = {{}}
cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
torch.manual_seed(0)
saved = transformers.LlamaForCausalLM(cfg)
saved.save_pretrained({tmp!r} + "/model")
ref = {{k: v.clone() for k, v in saved.state_dict().items()}}
ds = {{"train_micro_batch_size_per_gpu": 1, "steps_per_print": 0,
       "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
       "zero_optimization": {{"stage": 3, "stage3_param_persistence_threshold": 0,
                             "offload_param": {{"device": "nvme", "nvme_path": {tmp!r}}},
                             "offload_optimizer": {{"device": "cpu"}}}}}}
keep = HfDeepSpeedConfig(ds)   # transformers' ZeRO-3 switch, as TrainingArguments(deepspeed=...) sets it
model = transformers.AutoModelForCausalLM.from_pretrained({tmp!r} + "/model")
out["held"] = sorted(n for n, p in model.named_parameters() if p in init_shapes(model))
out["placeholders"] = sorted(n for n, p in model.named_parameters() if p.data.numel() == 0)
with zeroinf.gathered_parameters(list(model.parameters())):
    out["before_initialize_bad"] = [n for n, p in model.named_parameters() if not torch.equal(p.data, ref[n])]
engine, *_ = zeroinf.initialize(model=model, config=ds)
got = engine.module_state_dict()
out["names"] = sorted(set(ref) ^ set(got))
out["after_initialize_bad"] = [k for k in ref if not torch.equal(got[k], ref[k])]
out["params"] = sorted(n for n, _ in saved.named_parameters())
json.dump(out, open({tmp!r} + "/out.json", "w"))
'''


def test_from_pretrained_under_zero3_loads_into_zeroinf_partitions(tmp_path):
    """In a process of its own: ``enable()`` must come before transformers is imported."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(here) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", CASE.format(tmp=str(tmp_path))], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    # built under zeroinf.Init: every parameter is an empty placeholder whose values zeroinf holds
    assert out["held"] == out["params"] and out["placeholders"] == out["params"]
    assert out["before_initialize_bad"] == []
    assert out["names"] == [] and out["after_initialize_bad"] == []

