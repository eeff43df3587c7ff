"""What zeroinf.initialize checks and sets up at stages 0-2: the swap folder and the machine's disk
and memory, stale swap files of another run, flat resident memory with NVMe offload, the loader
made from training_data, and a frozen model with or without an optimizer."""
import copy
import warnings

import psutil
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeroinf
from zeroinf.config import ConfigError
from engine_helpers import batches, config, make_mlp, max_diff, reference, train


def test_initialize_checks_the_machine(tmp_path):
    missing = tmp_path / "made" / "by" / "initialize"  # made with its parents, as DeepSpeed's swappers do
    engine, *_ = zeroinf.initialize(make_mlp(), config=config(2, "nvme", missing))
    assert any(missing.rglob("*.swp")), sorted(missing.rglob("*"))
    engine.close()
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ConfigError) as ei:
        zeroinf.initialize(make_mlp(), config=config(2, "nvme", tmp_path / "a-file" / "swap"))
    assert str(ei.value).startswith("zero_optimization.offload_optimizer.nvme_path: ") and \
        f"cannot be created: {tmp_path / 'a-file'} is not a directory" in str(ei.value)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="nvme_path"):
        zeroinf.initialize(make_mlp(), config=config(2, "nvme", f))
    with pytest.raises(ConfigError, match="optimizer: required"):
        cfg = config()
        del cfg["optimizer"]
        zeroinf.initialize(make_mlp(), config=cfg)
    bad = config(2, "nvme", tmp_path)
    bad["zero_optimization"]["offload_optimizer"]["buffer_count"] = 2
    with pytest.raises(ConfigError, match="buffer_count: 2 is too small .* the minimum is 3"):
        zeroinf.initialize(make_mlp(), config=bad)


def test_stale_swap_files_from_another_run_are_not_read(tmp_path):
    X, Y = batches(3)
    ref = make_mlp()
    reference(ref, X, Y, 3)
    first = zeroinf.initialize(make_mlp(seed=7), config=config(2, "nvme", tmp_path))[0]
    train(first, X, Y, 3)
    first.close()
    cfg = config(2, "nvme", tmp_path)
    cfg["zero_optimization"]["sub_group_size"] = 40  # other sizes under the same keys
    model = make_mlp()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        engine, *_ = zeroinf.initialize(model, config=cfg)
    stale = [str(x.message) for x in w if "stale swap file" in str(x.message)]
    assert len(stale) == 1 and "zeroinf_optimizer" in stale[0], stale  # one for the folder, not one per sub-group
    train(engine, X, Y, 3)
    assert max_diff(model, ref) <= 1e-6
    engine.close()


def test_resident_memory_flat_with_nvme_offload(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])  # 263k params, 3 MB of Adam state
    cfg = config(2, "nvme", tmp_path)
    cfg["zero_optimization"]["sub_group_size"] = 300_000  # one sub-group: the fewest swap-file updates
    engine, *_ = zeroinf.initialize(model, config=cfg)
    x = torch.randn(4, 256)
    proc = psutil.Process()
    rss = {}
    for step in range(1, 51):
        engine.backward(engine(x).square().mean())
        engine.step()
        if step in (3, 50):
            rss[step] = proc.memory_info().rss
    grown = rss[50] - rss[3]
    # a leak of the swapped state (3 MB) per step would add 140 MB
    assert grown < 4 << 20, f"RSS grew by {grown / 2**20:.1f} MiB from step 3 to 50"
    engine.close()


def test_training_data_gives_a_loader_of_micro_batches():
    data = torch.utils.data.TensorDataset(torch.arange(10.0).unsqueeze(1))
    _, _, loader, _ = zeroinf.initialize(make_mlp(), config=config(), training_data=data)
    seen = torch.cat([b[0] for b in loader]).reshape(-1)
    assert [len(b[0]) for b in loader] == [4, 4, 2]
    assert sorted(seen.tolist()) == list(range(10))


def test_initialize_rejects_too_little_disk_or_memory_before_allocating(tmp_path, monkeypatch):
    """The engine's own checks, behind the memory check (zeroinf.memcheck, which refuses first)."""
    import collections

    import zeroinf.runtime.engine as eng_mod
    from zeroinf.memcheck import InsufficientMemoryError

    unchecked = dict(zeroinf={"check_memory": False})
    Usage = collections.namedtuple("Usage", "total used free")
    monkeypatch.setattr(eng_mod.shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 100, 100))
    with pytest.raises(InsufficientMemoryError, match="SHORT"):
        zeroinf.initialize(make_mlp(), config=config(2, "nvme", tmp_path))
    with pytest.raises(ConfigError) as ei:
        zeroinf.initialize(make_mlp(), config=config(2, "nvme", tmp_path, **unchecked))
    assert str(ei.value).startswith("zero_optimization.offload_optimizer.nvme_path: ") and "bytes (1e-07 GB) free" in str(ei.value)
    monkeypatch.undo()
    Mem = collections.namedtuple("Mem", "available")
    monkeypatch.setattr(eng_mod.psutil, "virtual_memory", lambda: Mem(1000))
    with pytest.raises(InsufficientMemoryError, match="SHORT"):
        zeroinf.initialize(make_mlp(), config=config(2, "nvme", tmp_path))
    with pytest.raises(ConfigError) as ei:
        zeroinf.initialize(make_mlp(), config=config(2, "nvme", tmp_path, **unchecked))
    assert ei.value.key_path == "zero_optimization.offload_optimizer.buffer_count" and "available memory" in str(ei.value)
    assert not (tmp_path / "zeroinf_optimizer").exists()  # nothing was written


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("with_optimizer", [False, True])
def test_a_frozen_model_runs_at_stages_0_to_2(tmp_path, stage, with_optimizer):
    """TRL's prepare_deepspeed wraps a DPO/PPO reference model at stage 0 with no optimizer,
    which DeepSpeed accepts (tester-46 F4a); stages 0-2 refused a model with no trainable
    parameter, with or without an optimizer entry (stage 3 ran it). Its forward is the plain
    model's, a backward through it says it has nothing to train, and a checkpoint round trip
    keeps its weights."""
    ref = make_mlp().requires_grad_(False)
    cfg = config(stage=stage, device="cpu" if stage else "none")
    if not with_optimizer:
        del cfg["optimizer"]
    engine, *_ = zeroinf.initialize(model=copy.deepcopy(ref), config=cfg)
    x, y = batches(1)
    with torch.no_grad():
        assert torch.equal(engine(x[0]), ref(x[0]))
    with pytest.raises(ValueError, match="requires grad"):
        engine.backward(F.mse_loss(engine(x[0]), y[0]))
    engine.save_checkpoint(str(tmp_path), tag="t")
    with torch.no_grad():
        engine.module[0].weight.zero_()
    engine.load_checkpoint(str(tmp_path), tag="t")
    assert torch.equal(engine.module[0].weight, ref[0].weight)
    engine.close()
