"""Partial parameter offload, ``zero_optimization.offload_param.ratio`` (a zeroinf extension):
the units in forward order keep about ``1 - ratio`` of the partition elements on the compute
device and the rest on ``offload_param.device``. Training equals plain PyTorch + AdamW at every
ratio, the stores and the NVMe traffic follow the ratio, checkpoints move between ratios, and the
estimator and planner count it. Sizes: fp32 TinyLM, units [224, 592, 2080 x 4] elements."""
import copy

import pytest
import torch

import zeroinf
from zeroinf.config import ConfigError, parse_config
from zeroinf.estimate import GB, ModelInfo, Placement, estimate
from zeroinf.placement import PARAM_RATIOS, Limits, choose, make_config
from zeroinf.runtime.stage3.options import Stage3ConfigError, Stage3Options
from zeroinf.runtime.stage3.tiers import DeviceStore, HostStore, NvmeStore
from stage3_models import TinyLM
from stage3_engine_helpers import _assert_like_reference, _config, _reference, _resume_beside_straight, _run

OFFLOADED = {"cpu": HostStore, "nvme": NvmeStore}


def _ratio_config(param_tier, opt_tier, nvme, ratio):
    cfg = _config(param_tier, opt_tier, nvme)
    cfg["zero_optimization"]["offload_param"]["ratio"] = ratio
    return cfg


def _split(engine):
    """(resident elements, offloaded elements, bytes of the offloaded partitions) of the engine's
    rank, counted from the store of every flat group."""
    resident = offloaded = nbytes = 0
    for g in engine.params.manager.groups():
        if type(g.store) is DeviceStore:
            resident += g.shard_numel
        else:
            offloaded += g.shard_numel
            nbytes += g.shard_numel * g.dtype.itemsize
    return resident, offloaded, nbytes


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("param_tier,opt_tier", [("nvme", "nvme"), ("nvme", "cpu"), ("cpu", "nvme"), ("cpu", "cpu")])
def test_training_equals_adamw_and_the_stores_follow_the_ratio(tmp_path, param_tier, opt_tier, ratio):
    ref = TinyLM(tied=True)
    engine, *_ = zeroinf.initialize(model=copy.deepcopy(ref), config=_ratio_config(param_tier, opt_tier, tmp_path,
                                                                                   ratio))
    m = engine.params.manager
    sizes = [sum(g.shard_numel for g in u.groups) for u in m.units]
    # resident units are a prefix in forward order, each unit on one tier
    tiers = m.unit_tiers
    assert tiers == sorted(tiers, key=lambda t: t != "none")
    for u, tier in zip(m.units, tiers):
        assert all(type(g.store) is (DeviceStore if tier == "none" else OFFLOADED[param_tier]) for g in u.groups)
    resident, offloaded, _ = _split(engine)
    total = sum(sizes)
    assert resident + offloaded == total
    # about 1 - ratio resident, within half of the largest unit
    assert abs(resident - (1 - ratio) * total) <= max(sizes) / 2, (resident, total)
    assert (resident == 0) == (ratio == 1.0) and (offloaded == 0) == (ratio == 0.0)
    _assert_like_reference(engine, ref, _run(engine, 3), _reference(ref, 3))
    engine.close()


def test_nvme_traffic_per_step_falls_with_the_ratio(tmp_path):
    """Parameters on NVMe, optimizer on the CPU: every NVMe byte a step moves is a parameter
    partition's, and each unit is read and written as often at any ratio, so the bytes per step
    scale with the offloaded partition bytes exactly."""
    per_step, offloaded = {}, {}
    for ratio in (1.0, 0.5, 0.0):
        d = tmp_path / str(ratio)
        d.mkdir()
        torch.manual_seed(0)
        engine, *_ = zeroinf.initialize(model=TinyLM(), config=_ratio_config("nvme", "cpu", d, ratio))
        _run(engine, 3)
        st = engine.params.stats()
        per_step[ratio] = (st["bytes_nvme_read"], st["bytes_nvme_written"])
        offloaded[ratio] = _split(engine)[2]
        engine.close()
    full_read, full_written = per_step[1.0]
    assert full_read > 0 and full_written > 0
    assert per_step[0.0] == (0, 0)
    half_read, half_written = per_step[0.5]
    assert 0 < offloaded[0.5] < offloaded[1.0]
    assert half_read * offloaded[1.0] == full_read * offloaded[0.5], (per_step, offloaded)
    assert half_written * offloaded[1.0] == full_written * offloaded[0.5], (per_step, offloaded)


def test_swap_files_hold_only_the_offloaded_partitions(tmp_path):
    """fp32, both offloads on NVMe: parameter files for the offloaded units (4 B per element; they
    are the optimizer's masters), fp32 gradient files (4 B) and Adam moments (8 B) for every
    trainable element."""
    from zeroinf.runtime.stage3.swap_plan import swap_file_bytes

    torch.manual_seed(0)
    cfg = _ratio_config("nvme", "nvme", tmp_path, 0.5)
    engine, *_ = zeroinf.initialize(model=TinyLM(), config=cfg)
    resident, offloaded, _ = _split(engine)
    assert resident > 0 and offloaded > 0
    engine.close()
    need = 4 * offloaded + (4 + 8) * (resident + offloaded)
    on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file() and not f.name.endswith(".json"))
    assert on_disk == need, (on_disk, need)
    model = TinyLM()
    planned = swap_file_bytes(model, parse_config(cfg), [list(model.parameters())])
    assert sum(row[3] for row in planned) == need
    assert [row[3] for row in planned if row[4] == "parameter partitions"] == [4 * offloaded]


@pytest.mark.parametrize("load_ratio", [0.5, 1.0, 0.0])
def test_checkpoint_resumes_bit_exact_at_any_ratio(tmp_path, load_ratio):
    """A ratio-0.5 checkpoint loads into an engine of any ratio (partitions are stored without
    their tier) and the resumed run equals the straight one bit for bit."""
    torch.manual_seed(0)
    base = TinyLM()
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    resumed, _want = _resume_beside_straight(base, _ratio_config("nvme", "nvme", tmp_path / "a", 0.5),
                                             _ratio_config("nvme", "nvme", tmp_path / "b", load_ratio),
                                             tmp_path / "ckpt")
    resumed.close()


@pytest.mark.parametrize("op,says", [
    ({"device": "cpu", "ratio": 1.5}, "must be <= 1.0, got 1.5"),
    ({"device": "nvme", "nvme_path": "/tmp", "ratio": -0.1}, "must be >= 0.0, got -0.1"),
    ({"device": "cpu", "ratio": "half"}, "expected a number, got 'half'"),
    ({"device": "cpu", "ratio": True}, "expected a number, got True"),
    ({"ratio": 0.5}, "needs offload_param.device cpu or nvme"),
    ({"device": "none", "ratio": 1.0}, "needs offload_param.device cpu or nvme"),
])
def test_bad_ratios_are_one_line_errors_naming_the_key(op, says):
    with pytest.raises(ConfigError) as ei:
        parse_config({"train_batch_size": 1, "zero_optimization": {"stage": 3, "offload_param": op}})
    msg = str(ei.value)
    assert msg.startswith("zero_optimization.offload_param.ratio: ") and says in msg and "\n" not in msg, msg
    assert ei.value.key_path == "zero_optimization.offload_param.ratio"
    with pytest.raises(Stage3ConfigError, match=r"^zero_optimization\.offload_param\.ratio: must be a number in"):
        Stage3Options(offload_param_device="cpu", offload_param_ratio=1.01)


def test_a_config_ratio_reaches_the_stage3_options():
    cfg = parse_config({"train_batch_size": 1, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu", "ratio": 0.25}}})
    assert cfg.zero_optimization.offload_param.ratio == 0.25
    assert Stage3Options.from_zero_config(cfg.zero_optimization).offload_param_ratio == 0.25
    assert parse_config({"train_batch_size": 1}).zero_optimization.offload_param.ratio == 1.0


# ------------------------------------------------------------------------------ estimate / plan
UNITS = (1000, 3000, 2000, 2000, 2000)  # persistent, root, three blocks: P = 10,000


@pytest.mark.parametrize("ratio,resident", [(1.0, 0), (0.7, 4000), (0.5, 4000), (0.45, 6000), (0.2, 8000),
                                            (0.0, 10_000)])
def test_estimate_counts_the_resident_units_on_the_device(ratio, resident):
    """bf16 on one rank: the leading units nearest (1 - ratio) x P stay on the device at 2 B per
    element (0.7 -> 3000: units 1000 + 3000 = 4000 are the closest prefix; 0.5 -> 5000 is as far
    from 4000 as from 6000, and the shorter prefix is taken), the rest on NVMe."""
    pl = Placement(3, "nvme", "nvme", ratio)
    e = estimate(10_000, pl, unit_sizes=UNITS)
    terms = {(t.tier, t.name): t.bytes for t in e.terms}
    assert terms.get(("device", "bf16 parameters (resident)"), 0) == 2 * resident
    assert terms[("nvme", "bf16 parameters")] == 2 * (10_000 - resident)
    # the NVMe staging pool exists only for an offloaded part
    assert (("host", "parameter swap buffers") in terms) == (resident < 10_000)
    full = estimate(10_000, Placement(3, "nvme", "nvme"), unit_sizes=UNITS)
    assert e.per_device_bytes - full.per_device_bytes == 2 * resident
    assert e.row()["offload_param_ratio"] == ratio


def test_estimate_without_units_takes_the_fraction():
    e = estimate(10**9, Placement(3, "cpu", "cpu", 0.25))
    terms = {(t.tier, t.name): t.bytes for t in e.terms}
    assert terms[("device", "bf16 parameters (resident)")] == 2 * 750_000_000
    assert terms[("host", "bf16 parameters")] == 2 * 250_000_000
    with pytest.raises(ValueError, match="offload_param.ratio"):
        Placement(3, "none", "cpu", 0.5)
    with pytest.raises(ValueError, match="offload_param.ratio"):
        Placement(3, "cpu", "cpu", 1.5)


def test_plan_keeps_what_fits_of_the_parameters_on_the_device(tmp_path):
    """1e9 bf16 parameters in ten 1e8-parameter units, 2e8 gathered at once (0.8 GB of device
    memory): a 9 GB host cannot hold the parameters beside the gradients (3, cpu, nvme: 9.6 GB),
    so they go to NVMe; a device with 1.1 GB more keeps 5 units resident (1.0 GB; 6 would be 1.2
    GB): ratio 0.5, written into the config."""
    info = ModelInfo(name="1B", params=10**9, largest_unit=10**8, live_params=2 * 10**8,
                     unit_sizes=tuple([10**8] * 10))
    limits = Limits(gpu_mem=int(1.9 * GB), cpu_mem=9 * GB, nvme=1000 * GB, reserve=0)
    plan = choose(info, limits, world_size=1, gpus_per_node=1)
    assert plan.chosen.placement == Placement(3, "nvme", "nvme", 0.5)
    assert plan.attempts[-2].estimate.placement == Placement(3, "nvme", "nvme") and plan.attempts[-2].fits
    assert plan.chosen.per_device_bytes == int(0.8 * GB) + 2 * 5 * 10**8
    cfg = make_config(plan.chosen.placement, nvme_path=str(tmp_path))
    assert cfg["zero_optimization"]["offload_param"]["ratio"] == 0.5
    assert parse_config(cfg).zero_optimization.offload_param.ratio == 0.5
    # no room on the device: every parameter stays offloaded, and the config has no ratio
    tight = choose(info, Limits(gpu_mem=int(0.85 * GB), cpu_mem=9 * GB, nvme=1000 * GB, reserve=0),
                   world_size=1, gpus_per_node=1)
    assert tight.chosen.placement == Placement(3, "nvme", "nvme")
    assert "ratio" not in make_config(tight.chosen.placement)["zero_optimization"]["offload_param"]
    assert PARAM_RATIOS == tuple(k / 10 for k in range(10))
