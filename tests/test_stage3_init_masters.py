"""bf16 stage 3's fp32 master weights: built under ``zeroinf.Init`` they are the values as
constructed (waiting in swap files, not host memory, with parameters on NVMe), loaded by
``load_safetensors`` from an fp32 file they are the file's, and ``load_state_dict`` of fp32
weights sets them."""
import copy
import math

import pytest
import torch

import zeroinf
from stage3_models import TinyLM, batch, loss_fn
from stage3_init_helpers import _cfg


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_bf16_masters_are_the_values_as_constructed(tmp_path, tier):
    """Built under Init then trained in bf16: the fp32 master weights equal the fp32 values of a
    normal build (not their bf16 rounding); the partitions hold the bf16 rounding."""
    torch.manual_seed(0)
    ref = TinyLM(tied=True)
    torch.manual_seed(0)
    cfg = {**_cfg(tier, tmp_path), "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "bf16": {"enabled": True}}
    cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, sub_group_size=300)
    with zeroinf.Init(config=cfg):
        model = TinyLM(tied=True)
    names = {p: n for n, p in model.named_parameters()}
    engine, *_ = zeroinf.initialize(model=model, config=cfg)
    want = {}  # sub-group key -> fp32 values from the reference, laid out as the partition
    for lay in engine.params.groups:
        flat = torch.zeros(lay.padded)
        for p, off, shape in zip(lay.params, lay.offsets, lay.shapes):
            flat[off:off + math.prod(shape)] = ref.get_parameter(names[p]).detach().reshape(-1)
        pos = 0
        for k in lay.sub_keys:
            n = next(s.numel for s in engine.sub_optimizer.specs if s.key == k)
            want[k] = flat[pos:pos + n]
            pos += n
    rounded = 0
    for i, spec in enumerate(engine.sub_optimizer.specs):
        with engine.sub_optimizer.state(i) as (master, _m, _v):
            assert torch.equal(master, want[spec.key]), spec.key
            rounded += int((master != master.bfloat16().float()).sum())
    assert rounded > 0  # the reference is not bf16-exact, so the test could see rounding
    sd = engine.module.state_dict()
    for name, p in ref.named_parameters():
        assert sd[name].dtype == torch.bfloat16 and torch.equal(sd[name], p.detach().bfloat16()), name
    assert not engine.params.manager._init_masters  # the fp32 copies were released
    engine.close()


def test_bf16_masters_wait_on_nvme_not_in_host_memory(tmp_path, monkeypatch):
    """With parameters on NVMe, the fp32 values of partitions cast to bf16 since Init wait for the
    optimizer in swap files (4 bytes per partition element, counted by initialize's disk check),
    not in host memory, and each file is gone once its master is taken."""
    from zeroinf.config import parse_config
    from zeroinf.runtime.stage3.layout import LayoutMixin
    from zeroinf.runtime.stage3.swap_plan import swap_file_bytes

    cfg = {**_cfg("nvme", tmp_path), "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "bf16": {"enabled": True}}
    cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, sub_group_size=300)
    seen = []
    take = LayoutMixin.take_init_master

    def spy(self, g, lo, hi):
        if not seen:  # the first master asked for: every partition is still waiting
            seen.append({k: v for k, v in self._init_masters.items()})
            seen.append({f: f.stat().st_size for f in self._swapper.files()
                         if f.suffix == ".swp" and "init_master" in f.name})
        return take(self, g, lo, hi)

    monkeypatch.setattr(LayoutMixin, "take_init_master", spy)
    with zeroinf.Init(config=cfg):
        model = TinyLM(tied=True)
    model.bfloat16()  # as initialize casts it: Init keeps the fp32 values
    planned = {what: n for _k, _p, _f, n, what in swap_file_bytes(model, parse_config(cfg), [list(model.parameters())])}
    engine, *_ = zeroinf.initialize(model=model, config=cfg)
    waiting, files = seen
    groups = {g.key: g for g in engine.params.manager.groups()}
    assert waiting and all(isinstance(v, str) for v in waiting.values())  # swap keys, no tensors
    assert sorted(files.values()) == sorted(4 * groups[k].shard_numel for k in waiting)
    assert planned["fp32 initial values (until the optimizer takes them)"] == sum(files.values())
    assert not any(f.exists() for f in files) and not engine.params.manager._init_masters
    engine.close()


@pytest.mark.parametrize("opt_tier", ["cpu", "nvme"])
def test_load_safetensors_gives_a_bf16_model_the_files_fp32_masters(tmp_path, opt_tier):
    """A bf16 model's fp32 master weights loaded from an fp32 file are the file's values, as
    ``initialize`` takes a model's fp32 weights: they were the bf16 partition's rounding, so the
    two paths trained apart (tester-40 F3: masters 2.4e-4 off, 5.7e-3 after 4 steps)."""
    from safetensors.torch import save_model

    from zeroinf.runtime.stage3 import load_safetensors

    torch.manual_seed(3)
    pretrained = TinyLM()
    save_model(pretrained, str(tmp_path / "model.safetensors"))
    cfg = {**_cfg("cpu", tmp_path), "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    cfg["zero_optimization"]["offload_optimizer"] = {"device": opt_tier, "nvme_path": str(tmp_path)}
    runs = []
    for how in ("initialize", "load_safetensors"):
        torch.manual_seed(4)
        model = copy.deepcopy(pretrained) if how == "initialize" else TinyLM()
        engine, *_ = zeroinf.initialize(model=model, config=cfg)
        if how == "load_safetensors":
            assert load_safetensors(model, tmp_path) == []
        for step in range(2):
            x, y = batch(step)
            engine.backward(loss_fn(engine(x).float(), y))
            engine.step()
        runs.append({k: v.float() for k, v in engine.module.state_dict().items()})
        engine.close()
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_load_state_dict_of_fp32_weights_sets_a_bf16_models_masters_to_them(tmp_path):
    """``model.load_state_dict(fp32 weights)`` on a bf16 stage-3 model after training ("reset to
    init", restoring the best weights) sets the fp32 masters to those values: elements whose
    bf16 rounding had not moved kept their trained fp32 master (tester-39: 31% of a weight,
    8.5e-4 off). A bf16 state dict still leaves the masters' extra bits alone."""
    import zeroinf.checkpoint

    torch.manual_seed(5)
    model = TinyLM()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = {**_cfg("cpu", tmp_path), "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engine, *_ = zeroinf.initialize(model=model, config=cfg)
    for step in range(3):
        x, y = batch(step)
        engine.backward(loss_fn(engine(x).float(), y))
        engine.step()

    def masters(tag):
        engine.save_checkpoint(str(tmp_path / "ck"), tag=tag)
        return zeroinf.checkpoint.consolidate(str(tmp_path / "ck"), tag, str(tmp_path / f"{tag}.pt"))

    trained = masters("trained")
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})  # its own bf16 values
    same = masters("same")
    assert all(torch.equal(same[k], trained[k]) for k in trained)
    model.load_state_dict(init)
    reset = masters("reset")
    assert all(torch.equal(reset[k], init[k]) for k in init if k in reset)
    engine.close()
