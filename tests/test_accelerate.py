"""Accelerate alone (no Trainer) with zeroinf as its DeepSpeed engine
(``zeroinf.integrations.hf.enable()``): ``Accelerator(deepspeed_plugin=DeepSpeedPlugin(
hf_ds_config=config))`` prepares a tiny Llama, its optimizer and dataloader; ``accelerator.
backward`` and ``optimizer.step()`` train it as plain PyTorch with torch.optim.AdamW does; and
``accelerator.save_state`` / ``load_state`` (routed to the engine's ``save_checkpoint`` /
``load_checkpoint``) resume exactly. A torch.optim.AdamW given to ``prepare`` works too."""
import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

STEPS = 5
ADAMW = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}


def _model():
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _loader():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (4 * STEPS, 16), generator=g)
    rows = [{"input_ids": r, "labels": r.clone()} for r in ids]
    return torch.utils.data.DataLoader(rows, batch_size=4, shuffle=False)


def _ds_config(case, nvme):
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    if case == "zero3-nvme":
        zero = {"stage": 3, "stage3_param_persistence_threshold": 0,
                "offload_param": {"device": "nvme", "nvme_path": str(nvme)},
                "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)}}
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1, "steps_per_print": 0,
            "optimizer": {"type": "AdamW", "params": dict(ADAMW)}, "zero_optimization": zero}


def plain_losses():
    """The reference: the same model, batches and AdamW in plain PyTorch."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=ADAMW["lr"], betas=tuple(ADAMW["betas"]), eps=ADAMW["eps"],
                            weight_decay=ADAMW["weight_decay"])
    out = []
    for batch in _loader():
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def accelerate_run(case, tmp, save_at=None, resume=None, client_optimizer=False):
    """Train STEPS steps through Accelerate on zeroinf; with ``save_at``, ``save_state`` after
    that many steps; with ``resume=(folder, steps)``, ``load_state(folder)`` first and skip the
    ``steps`` batches it was saved after. ``client_optimizer``: a torch.optim.AdamW given to
    ``prepare`` and none in the config (Accelerate turns it into ``DeepSpeedCPUAdam`` when the
    optimizer is offloaded).
    Returns ``(engine type name, {step: loss})``."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim
    cfg = _ds_config(case, tmp)
    if client_optimizer:
        del cfg["optimizer"]
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
    model = _model()
    if client_optimizer:
        opt = torch.optim.AdamW(model.parameters(), lr=ADAMW["lr"], betas=tuple(ADAMW["betas"]), eps=ADAMW["eps"],
                                weight_decay=ADAMW["weight_decay"])
    else:
        opt = DummyOptim(model.parameters())
    model, opt, loader = acc.prepare(model, opt, _loader())
    done = 0
    if resume is not None:
        acc.load_state(resume[0])
        done = resume[1]
    losses = {}
    for step, batch in enumerate(loader, start=1):
        if step <= done:
            continue
        loss = model(**batch).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses[step] = loss.item()
        if step == save_at:
            acc.save_state(os.path.join(tmp, "state"))
    acc.end_training()
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(True)  # a second Accelerator in this process may take a plugin (as accelerate's tests do)
    return type(model).__name__, losses


CASE = '''
import json, sys
import zeroinf.integrations.hf
zeroinf.integrations.hf.enable()   # before transformers and accelerate are imported
sys.path.insert(0, {tests!r})
import test_accelerate as t
engine, first = t.accelerate_run({case!r}, {tmp!r}, save_at=3)
_, resumed = t.accelerate_run({case!r}, {tmp!r}, resume=({tmp!r} + "/state", 3))
_, client = t.accelerate_run({case!r}, {tmp!r} + "/client", client_optimizer=True)
json.dump(dict(engine=engine, first=first, resumed=resumed, client=client), open({tmp!r} + "/out.json", "w"))
'''


@pytest.mark.parametrize("case", ["zero2-cpu", "zero3-nvme"])
def test_accelerate_on_zeroinf_matches_plain_adamw_and_resumes(tmp_path, case):
    """In a process of its own: ``enable()`` must come before transformers is imported when
    DeepSpeed is not installed."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(here) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", CASE.format(tests=here, case=case, tmp=str(tmp_path))], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["engine"] == "ZeroEngine"
    first = {int(k): v for k, v in out["first"].items()}
    assert list(first) == list(range(1, STEPS + 1))
    plain = plain_losses()
    assert list(first.values()) == pytest.approx(plain, abs=2e-5)
    # a torch.optim.AdamW given to prepare (no optimizer in the config) trains the same
    assert list(out["client"].values()) == pytest.approx(plain, abs=2e-5)
    # the run resumed from the step-3 state continues as the uninterrupted one did
    resumed = {int(k): v for k, v in out["resumed"].items()}
    assert list(resumed) == [4, 5]
    assert [resumed[s] for s in (4, 5)] == [first[s] for s in (4, 5)]
