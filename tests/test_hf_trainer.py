"""transformers.Trainer with ``TrainingArguments(deepspeed=config)`` on a zeroinf engine
(``zeroinf.integrations.hf.enable()``), against the plain Trainer (no DeepSpeed): a tiny Llama
built from LlamaConfig, 10 steps, fp32 on the CPU."""
import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import zeroinf.integrations.hf  # noqa: E402
from zeroinf.runtime.engine import ZeroEngine  # noqa: E402

STEPS = 10


def _model():
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _data(n=40, t=16):
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, 128, (t,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def _ds_config(case, nvme):
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    if case == "zero3-nvme":
        zero = {"stage": 3, "stage3_param_persistence_threshold": 0,
                "offload_param": {"device": "nvme", "nvme_path": str(nvme), "buffer_count": 4, "buffer_size": 1 << 16},
                "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)},
                "stage3_gather_16bit_weights_on_model_save": True}
    # the "auto" values transformers fills from TrainingArguments, as for DeepSpeed
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "steps_per_print": 0,
            "optimizer": {"type": "AdamW",
                          "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
            "zero_optimization": zero}


def _train(out, ds=None, steps=STEPS, save_steps=None, resume=None):
    args = transformers.TrainingArguments(
        str(out), per_device_train_batch_size=4, max_steps=steps, learning_rate=1e-3, weight_decay=0.01,
        max_grad_norm=1.0, logging_steps=1, report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, deepspeed=ds,
        disable_tqdm=True)
    trainer = transformers.Trainer(model=_model(), args=args, train_dataset=_data())
    trainer.train(resume_from_checkpoint=resume)
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    return trainer, losses


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The plain Trainer's losses (no DeepSpeed config)."""
    return _train(tmp_path_factory.mktemp("plain"))[1]


def check_case(case, tmp_path, plain):
    """Trainer on zeroinf for ``case`` against the plain Trainer's losses ``plain`` ({step: loss}):
    the losses, save_model then from_pretrained, and a resume from the step-5 checkpoint. Runs in a
    process where ``enable()`` came before transformers was imported."""
    trainer, losses = _train(tmp_path / "z", ds=_ds_config(case, tmp_path))
    assert isinstance(trainer.model_wrapped, ZeroEngine)
    assert list(losses) == list(range(1, STEPS + 1))
    assert list(losses.values()) == pytest.approx(list(plain.values()), abs=2e-5)

    # save_model writes weights that from_pretrained loads back equal to the engine's
    trainer.save_model(str(tmp_path / "saved"))
    expected = {k: v.clone() for k, v in trainer.model_wrapped.module_state_dict().items()}
    # a plain load (from_pretrained while the Trainer's ZeRO-3 config is active builds the model
    # under zero.Init: tests/test_hf_from_pretrained.py)
    transformers.integrations.deepspeed.unset_hf_deepspeed_config()
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "saved")).state_dict()
    assert set(loaded) >= set(expected) - {"lm_head.weight"}
    for k, v in expected.items():
        assert torch.equal(loaded[k], v), k

    # a run checkpointed at step 5 and resumed there continues as the uninterrupted run did
    _, first = _train(tmp_path / "r", ds=_ds_config(case, tmp_path), save_steps=5)
    _, resumed = _train(tmp_path / "r", ds=_ds_config(case, tmp_path), resume=str(tmp_path / "r" / "checkpoint-5"))
    # the resumed run's log starts with the checkpoint's steps 1-5; a step 6 not from the
    # checkpoint's weights and Adam moments (a fresh model) would differ
    after = [s for s in resumed if s > 5]
    assert after == list(range(6, STEPS + 1))
    assert [resumed[s] for s in after] == [first[s] for s in after]


CASE = '''
import json, pathlib, sys
import zeroinf.integrations.hf
zeroinf.integrations.hf.enable()   # before transformers is imported, as the docs say
sys.path.insert(0, {tests!r})
import test_hf_trainer as t
plain = {{int(k): v for k, v in json.load(open({plain!r})).items()}}
t.check_case({case!r}, pathlib.Path({tmp!r}), plain)
'''


@pytest.mark.parametrize("case", ["zero2-cpu", "zero3-nvme"])
def test_trainer_on_zeroinf_matches_the_plain_trainer_saves_and_resumes(tmp_path, case, plain):
    """In a process of its own: the one line must come before transformers is imported when
    DeepSpeed is not installed (this process imported transformers already)."""
    import json
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    (tmp_path / "plain.json").write_text(json.dumps(plain))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(here) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = CASE.format(tests=here, plain=str(tmp_path / "plain.json"), case=case, tmp=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]


HIDDEN = '''
import importlib.abc, json, sys
class Hide(importlib.abc.MetaPathFinder):  # DeepSpeed is not installed, as far as imports can tell
    def find_spec(self, name, path, target=None):
        if name == "deepspeed" or name.startswith("deepspeed."):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Hide())
import zeroinf.integrations.hf
zeroinf.integrations.hf.enable()
sys.path.insert(0, {tests!r})
import test_hf_trainer as t
trainer, losses = t._train({out!r}, ds=t._ds_config("zero2-cpu", None))
shim = sys.modules["deepspeed"] is zeroinf.integrations.hf.shim
json.dump(dict(engine=type(trainer.model_wrapped).__name__, shim=shim, losses=list(losses.values())),
          open({out!r} + ".json", "w"))
'''


def test_trainer_on_zeroinf_without_deepspeed_installed(tmp_path, plain):
    import json
    import os
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    out = str(tmp_path / "run")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(here) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", HIDDEN.format(tests=here, out=out)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(open(out + ".json").read())
    assert got["engine"] == "ZeroEngine" and got["shim"]
    assert got["losses"] == pytest.approx(list(plain.values()), abs=2e-5)
