"""zeroinf.memcheck: a config is checked against free device, host and disk bytes before
initialize (or ``zeroinf train``) allocates anything. Free memory is injected small; needs are
compared with bytes counted by hand and with the swap files an engine really writes."""
import os
import resource
import subprocess
import sys

import pytest
import torch
from torch import nn

import zeroinf
from zeroinf.config import parse_config
from zeroinf.estimate import format_size
from zeroinf.memcheck import FREE_ENV, InsufficientMemoryError, assess, check, model_info_of

from stage3_models import TinyLM, batch, loss_fn

BIG = 10**13


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 8))


P = 64 * 128 + 128 + 128 * 8 + 8  # the MLP's parameters


def config(stage=0, param="none", opt="none", nvme=None, **extra) -> dict:
    zero = {"stage": stage, "offload_param": {"device": param}, "offload_optimizer": {"device": opt}}
    for key, dev in (("offload_param", param), ("offload_optimizer", opt)):
        if dev == "nvme":
            zero[key]["nvme_path"] = str(nvme)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": zero}
    cfg.update(extra)
    return cfg


def test_cpu_run_needs_its_model_states_less_what_the_model_holds():
    report = assess(mlp(), parse_config(config(0)), free={"host": BIG, "disk": BIG})
    (host,) = [t for t in report.tiers if t.tier == "host"]
    # fp32 stage 0 on the CPU (device memory is host memory): 4 B params + 4 B grads + 8 B Adam
    # moments, of which the model's own 4 B/param are allocated already
    assert (host.need, host.held) == (16 * P, 4 * P) and report.fits
    assert [t.tier for t in report.tiers] == ["host", "disk"]
    assert not assess(mlp(), parse_config(config(0)), free={"host": 12 * P, "disk": BIG}).fits  # 0.95 x 12P usable


def test_a_refusal_names_each_figure_and_a_placement_that_fits():
    # 64 linear layers of 1024 x 1024 built on the meta device (nothing allocated): each is a
    # stage-3 unit; with no prefetch and no reuse a rank gathers one at a time
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(64)])
    n = 64 * (1024 * 1024 + 1024)
    cfg = config(0)
    cfg["zero_optimization"].update(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0)
    free = {"host": 5 * 10**8, "disk": BIG}
    with pytest.raises(InsufficientMemoryError) as ei:
        check(model, parse_config(cfg), free=free)
    lines = str(ei.value).splitlines()
    assert lines[0].startswith("not enough memory for stage 0, offload_param=none, offload_optimizer=none "
                               f"with {n:,} parameters on 1 rank(s): host RAM")
    assert lines[1] == (f"  host   host RAM (the device is the CPU): needs {format_size(16 * n)} GB, 0.5 GB free "
                        f"(0.475 GB usable): SHORT by {format_size(16 * n - 475_000_000)} GB")
    assert lines[2].startswith(f"  disk   {os.getcwd()}: needs 0.00 GB")
    # device and host are one memory here: anything that keeps the fp32 parameters (4 B) and
    # gradients (4 B) in it exceeds 0.475 GB (8 x 67M = 0.54 GB), so both go to NVMe with the
    # optimizer state: stage 3 with everything on NVMe, a few MB of swap buffers and one layer gathered
    suggestion = ei.value.report.suggestion
    assert (suggestion["stage"], suggestion["offload_param"]["device"], suggestion["offload_optimizer"]["device"]) \
        == (3, "nvme", "nvme")
    assert "  zero_optimization.stage = 3" in lines and f'"nvme_path": "{os.getcwd()}"' in lines[-2]
    # the keys it names make a config the engine accepts and that passes the same check
    cfg["zero_optimization"].update(suggestion)
    assert check(model, parse_config(cfg), free=free).fits


def test_device_tier_on_cuda_suggests_the_optimizer_on_the_cpu():
    # stage 0 on one GPU keeps 16 B/param there; with 5P bytes free (4.75P usable) only the
    # fp32 parameters (4P) fit: stages 1-3 without offload keep 16P (stage 3 plus its working set),
    # so the first placement of zeroinf plan's ladder that fits is stage 2 with the optimizer on the CPU
    cfg = parse_config(config(0))
    with pytest.raises(InsufficientMemoryError) as ei:
        check(mlp(), cfg, device="cuda:0", free={"device": 5 * P, "host": BIG, "disk": BIG})
    text, report = str(ei.value), ei.value.report
    assert [(t.tier, t.need, t.fits) for t in report.tiers[:2]] == [("device", 16 * P, False), ("host", 0, True)]
    assert "  device cuda:0: needs" in text and "host   host RAM: needs 0.00 GB" in text
    assert report.suggestion["stage"] == 2 and report.suggestion["offload_optimizer"]["device"] == "cpu"
    assert 'zero_optimization.offload_optimizer = {"device": "cpu", "pin_memory": true}' in text


def test_disk_need_is_the_swap_files_initialize_writes_and_less_disk_is_refused_first(tmp_path, monkeypatch):
    written = tmp_path / "a"
    cfg = config(3, "nvme", "nvme", written)
    report = assess(TinyLM(), parse_config(cfg), free={"host": BIG})
    (disk,) = [t for t in report.tiers if t.tier == "disk" and t.where == str(written)]
    engine, *_ = zeroinf.initialize(model=TinyLM(), config=cfg)
    engine.close()
    # the swap files (each has a .json sidecar of a few hundred bytes, not counted)
    on_disk = sum(f.stat().st_size for f in written.rglob("*.swp"))
    assert disk.need == on_disk > 0
    fresh = tmp_path / "b" / "swap"  # not there yet: the check makes nothing
    model = TinyLM()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setenv(FREE_ENV, f"disk={on_disk - 1}")
    with pytest.raises(InsufficientMemoryError) as ei:
        zeroinf.initialize(model=model, config=config(3, "nvme", "nvme", fresh))
    assert f"  disk   {fresh}: needs {format_size(on_disk)} GB, {format_size(on_disk - 1)} GB free: SHORT" in str(ei.value)
    assert not (tmp_path / "b").exists()
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
    # an earlier run's swap files in the folder are overwritten: they count as free
    assert check(TinyLM(), parse_config(cfg), free={"host": BIG, "disk": 0}).fits


def test_initialize_refuses_before_casting_and_the_config_key_skips_the_check(tmp_path, monkeypatch):
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setenv(FREE_ENV, "host=1000")
    cfg = config(2, "none", "cpu", bf16={"enabled": True})
    with pytest.raises(zeroinf.InsufficientMemoryError, match="host RAM"):
        zeroinf.initialize(model=model, config=cfg)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # not cast to bf16
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    engine, *_ = zeroinf.initialize(model=model, config=cfg | {"zeroinf": {"check_memory": False}})
    engine.close()
    monkeypatch.setenv(FREE_ENV, "ram=1GB")
    with pytest.raises(ValueError, match=FREE_ENV):
        zeroinf.initialize(model=mlp(), config=cfg)


@pytest.mark.parametrize("limits", [dict(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0),
                                    dict(stage3_prefetch_bucket_size=3000, stage3_max_reuse_distance=0),
                                    dict(stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=6000), {}])
def test_the_working_set_is_what_the_engine_gathers_at_once(limits):
    """TinyLM at stage 3 (4 blocks of 2,080 elements, root 1,184, persistent 224 with threshold
    20): the estimated working set less the persistent unit equals the engine's own high-water
    mark of gathered elements over three steps (the first records the trace prefetch follows)."""
    cfg = config(3, "cpu", "cpu")
    cfg["zero_optimization"].update(stage3_param_persistence_threshold=20, **limits)
    model = TinyLM()
    info = model_info_of(model, parse_config(cfg).zero_optimization)
    engine, *_ = zeroinf.initialize(model=model, config=cfg)
    manager = engine.params.manager
    for step in range(3):
        x, y = batch(step)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    persistent = manager.units[0].numel
    assert info.live_params - persistent == manager.stats.live_high_water_all
    engine.close()


def test_a_model_built_under_init_counts_its_full_shapes(tmp_path):
    cfg = config(3, "nvme", "none", tmp_path)
    with zeroinf.Init(config=cfg):
        model = TinyLM()
    full = sum(p.numel() for p in TinyLM().parameters())
    info = model_info_of(model, parse_config(cfg).zero_optimization)
    assert info.params == full and sum(p.numel() for p in model.parameters()) < full
    (host,) = [t for t in assess(model, parse_config(cfg), free={"host": BIG, "disk": BIG}).tiers if t.tier == "host"]
    assert host.held == 0  # its parameters are in swap files, not in memory
    engine, *_ = zeroinf.initialize(model=model, config=cfg)
    engine.close()


def _limit_address_space():
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # a 3B model in fp32 is 13 GB: never built


def test_train_3b_without_offload_is_refused_in_one_message_before_the_model_is_built(tmp_path):
    (tmp_path / "d.txt").write_text("".join(f"line {i} of a small corpus\n" for i in range(4000)))
    env = dict(os.environ, OMP_NUM_THREADS="1", **{FREE_ENV: "host=12GB,disk=100GB"})
    proc = subprocess.run([sys.executable, "-m", "zeroinf", "train", "--size", "3b", "--offload", "none",
                           "--steps", "1", "--data", str(tmp_path / "d.txt"), "--out", str(tmp_path / "o")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                          preexec_fn=_limit_address_space)
    err = proc.stderr
    assert proc.returncode == 2, err
    assert "Traceback" not in err and proc.stdout == ""
    # a loaded machine can take over LOADING_NOTICE_S to import torch: the notice may come first
    lines = [line for line in err.strip().splitlines() if line != "zeroinf train: loading torch ..."]
    # fp32 stage 0 on the CPU: 16 B per parameter of Llama 3b with byte tokens: 42 layers of
    # q, k, v, o (4 h^2), gate/up/down (3 h i) and two norms (2h), embedding and head (2 x 256 h), final norm
    h, i = 2560, 6912
    assert 42 * (4 * h * h + 3 * h * i + 2 * h) + 2 * 256 * h + h == 3_332_067_840
    assert lines[0].startswith("zeroinf train: error: not enough memory for stage 0, offload_param=none, "
                               "offload_optimizer=none with 3,332,067,840 parameters on 1 rank(s): host RAM")
    assert lines[1] == (f"  host   host RAM (the device is the CPU): needs {format_size(16 * 3_332_067_840)} GB, "
                        f"12.00 GB free (11.40 GB usable): SHORT by {format_size(16 * 3_332_067_840 - 11_400_000_000)} GB")
    # what fits in 11.4 GB: stage 3 with everything on NVMe (the parameters alone are 13.3 GB)
    assert "  zero_optimization.stage = 3" in lines
    assert not (tmp_path / "o").exists()


def test_optimizer_in_backward_needs_no_gradient_swap_files(tmp_path):
    """Stage 3 with both offloads on NVMe keeps fp32 gradient partitions in swap files, unless the
    optimizer steps each partition as it is reduced: then the disk need is the parameter and
    optimizer files alone, equal to what initialize writes."""
    needs = {}
    for in_bwd in (False, True):
        written = tmp_path / f"oib{int(in_bwd)}"
        cfg = config(3, "nvme", "nvme", written) | {"zeroinf": {"optimizer_in_backward": in_bwd}}
        report = assess(TinyLM(), parse_config(cfg), free={"host": BIG})
        (disk,) = [t for t in report.tiers if t.tier == "disk" and t.where == str(written)]
        engine, *_ = zeroinf.initialize(model=TinyLM(), config=cfg)
        engine.close()
        assert disk.need == sum(f.stat().st_size for f in written.rglob("*.swp")) > 0
        needs[in_bwd] = disk.need
    n = sum(p.numel() for p in TinyLM().parameters())
    assert needs[False] - needs[True] >= 4 * n  # the fp32 gradient partitions (padded to the partition)
