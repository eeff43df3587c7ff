"""Disk use while ``initialize`` sets up a model built under ``zeroinf.Init``: the fp32 initial
values kept for bf16 training ([Note: Init masters]) leave as the optimizer's swap files come,
each optimizer file is allocated by its sub-group's first write ([Note: swap files on first
write]), and the disk check asks for what is on disk at once, not for both."""
import collections
import errno
import os
import shutil
import warnings

import pytest
import torch

import zeroinf
from stage3_engine_helpers import _config, _run, _state
from stage3_models import TinyLM
from zeroinf.io import TensorSwapper
from zeroinf.runtime.optimizer import SubGroupOptimizer, SubGroupSpec

HYPER = [{"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}]


def _allocated(root) -> int:
    """Bytes the file system has allocated to the engine's swap files under ``root``
    (fallocate'd included). ``zeroinf.Init``'s folder (``zeroinf_init_*``) is left out: it goes
    as the partitions are written, before the optimizer's files, and its room is checked apart
    (a manifest of 4 KiB per parameter outweighs this small model's data)."""
    total = 0
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if not x.startswith("zeroinf_init_")]
        total += sum(os.lstat(os.path.join(d, f)).st_blocks * 512 for f in files)
    return total


def _bf16_cfg(opt_tier, nvme):
    cfg = _config("nvme", opt_tier, nvme, stage3_param_persistence_threshold=0, sub_group_size=300)
    cfg["zero_optimization"]["offload_param"]["buffer_count"] = 4  # two partitions per unit
    cfg["bf16"] = {"enabled": True}
    return cfg


def _build(cfg):
    torch.manual_seed(0)
    with zeroinf.Init(config=cfg):
        return TinyLM()


def test_initialize_never_holds_the_init_masters_beside_the_optimizer_files(tmp_path, monkeypatch):
    """fp32 model under Init, parameters and optimizer on NVMe, bf16 training: every optimizer
    file was allocated before any fp32 initial value was taken, so initialize needed 4 bytes per
    parameter more disk than training (6B parameters did not fit an 80 GB disk). Now the disk
    never holds more than after initialize, plus at most one sub-group's initial values; and two
    steps equal the same run with the optimizer state in memory."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    cfg = _bf16_cfg("nvme", nvme)
    model = _build(cfg)
    samples, masters = [_allocated(nvme)], {}
    register = TensorSwapper.register

    def counted(self, key, numel, *args, **kwargs):
        path = register(self, key, numel, *args, **kwargs)
        if "/init_master/" in key:
            masters[key] = 4 * numel
        samples.append(_allocated(nvme))  # disk grows only here: register fallocates the whole file
        return path

    monkeypatch.setattr(TensorSwapper, "register", counted)
    engine, *_ = zeroinf.initialize(model=model, config=cfg)
    monkeypatch.setattr(TensorSwapper, "register", register)
    after = _allocated(nvme)
    opt = engine.sub_optimizer
    largest = 4 * max(s.numel for s in opt.specs)  # one sub-group's fp32 initial values
    block = os.statvfs(nvme).f_frsize  # the file system allocates whole blocks
    allowed = after + -(-largest // block) * block
    # the test sees the fault: the initial values were on disk, more than one sub-group's worth
    assert len(masters) > 1 and sum(masters.values()) > 2 * -(-largest // block) * block, masters
    assert max(samples) <= allowed, (f"peak {max(samples)} bytes during initialize, {after} after it, "
                                     f"{sum(masters.values())} bytes of initial values")
    assert not any("init_master" in f for f in engine.swap_files()) and not engine.params.manager._init_masters
    assert sorted(os.path.getsize(opt._swapper.path_for(opt._file_key(s))) for s in opt.specs) == \
        sorted(12 * s.numel for s in opt.specs)
    _run(engine, 2)
    engine.synchronize()
    got = _state(engine)
    got_masters = []
    for i in range(len(opt.specs)):
        with opt.state(i) as (master, _m, _v):
            got_masters.append(master.clone())
    engine.close()

    (tmp_path / "ref").mkdir()
    ref_cfg = _bf16_cfg("cpu", tmp_path / "ref")
    ref, *_ = zeroinf.initialize(model=_build(ref_cfg), config=ref_cfg)
    _run(ref, 2)
    ref.synchronize()
    want = _state(ref)
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)
    for i, m in enumerate(got_masters):
        with ref.sub_optimizer.state(i) as (master, _m, _v):
            assert torch.equal(m, master), ref.sub_optimizer.specs[i].key
    ref.close()


def test_frozen_groups_keep_no_init_master(tmp_path, monkeypatch):
    """The fp32 initial values exist for the optimizer's masters: a frozen group has none, so
    none are written for it (a bf16 LoRA base built under Init kept 4 bytes per base parameter
    on disk through initialize), and the disk check counts only the trainable ones."""
    from zeroinf.config import parse_config
    from zeroinf.runtime.stage3.swap_plan import INIT_MASTERS, swap_file_bytes

    cfg = _bf16_cfg("nvme", tmp_path)
    model = _build(cfg)
    for b in model.blocks[:3]:
        b.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    model.bfloat16()  # as initialize casts it: Init keeps the fp32 values
    planned = {w: n for *_k, n, w in swap_file_bytes(model, parse_config(cfg), [trainable])}
    masters = {}
    register = TensorSwapper.register

    def counted(self, key, numel, *args, **kwargs):
        if "/init_master/" in key:
            masters[key] = 4 * numel
        return register(self, key, numel, *args, **kwargs)

    monkeypatch.setattr(TensorSwapper, "register", counted)
    engine, *_ = zeroinf.initialize(model=model, config=cfg, model_parameters=trainable)
    groups = {g.key: g for g in engine.params.manager.groups()}
    kept = {k.split("/init_master/")[1] for k in masters}
    assert kept and kept == {k for k, g in groups.items() if g.optimized}
    assert planned[INIT_MASTERS] == sum(masters.values())
    _run(engine, 1)
    engine.close()


def _disk_with(monkeypatch, root, free):
    usage, real = collections.namedtuple("usage", "total used free"), shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda p: usage(10**12, 0, free) if str(p).startswith(str(root)) else real(p))


def test_disk_check_counts_the_init_masters_as_replaced_by_the_optimizer_files(tmp_path, monkeypatch):
    """The check asked room for the fp32 initial values on top of the optimizer's files; they
    are never on disk together, so a disk with room for the partitions and the optimizer's files
    is enough. Without optimizer files on that disk the values still need their own room, and
    they are written with the partitions, before Init's files go."""
    from zeroinf.config import ConfigError
    from zeroinf.runtime.engine import ZeroEngine
    from zeroinf.runtime.stage3.swap_plan import INIT_MASTERS

    key = "zero_optimization.offload_param.nvme_path"
    parts = [(key, str(tmp_path), str(tmp_path / "p"), 2000, "parameter partitions"),
             (key, str(tmp_path), str(tmp_path / "p"), 6000, "gradient partitions"),
             (key, str(tmp_path), str(tmp_path / "p"), 4000, INIT_MASTERS)]
    opt = [("zero_optimization.offload_optimizer.nvme_path", str(tmp_path), str(tmp_path / "o"), 12000,
            "optimizer state (12 bytes per element)")]
    _disk_with(monkeypatch, tmp_path, 20000)  # partitions and optimizer state: no room for the values beside
    ZeroEngine._check_disk_room(None, parts + opt, {})
    _disk_with(monkeypatch, tmp_path, 19999)
    with pytest.raises(ConfigError, match=r"this rank's swap files need 20000 bytes"):
        ZeroEngine._check_disk_room(None, parts + opt, {})
    _disk_with(monkeypatch, tmp_path, 12000)  # the optimizer state in memory: the values stay till the end
    ZeroEngine._check_disk_room(None, parts, {})
    _disk_with(monkeypatch, tmp_path, 11999)
    with pytest.raises(ConfigError, match=r"need 12000 bytes .*the parameter and gradient partitions \(12000 bytes"):
        ZeroEngine._check_disk_room(None, parts, {})
    # Init's files go only after the partitions and the values are written: not free for them
    (tmp_path / "init").mkdir()
    with pytest.raises(ConfigError, match=r"the parameter and gradient partitions \(12000 bytes"):
        ZeroEngine._check_disk_room(None, parts + opt, {str(tmp_path / "init"): 10**9})


SIZES = [1000, 17, 4097]


def _opt(path, **kw):
    specs = [SubGroupSpec(f"g0/s{i}", n) for i, n in enumerate(SIZES)]
    return SubGroupOptimizer(specs, device="nvme", swap_dir=str(path), buffer_count=3, pipeline_read=True,
                             pipeline_write=True, **kw)


def _swap_files(opt):
    return sorted(p.name for p in opt._swapper.directory.iterdir() if p.suffix == ".swp")


def test_each_optimizer_file_is_allocated_by_its_first_write_and_never_read_before(tmp_path):
    """No file before a sub-group's first write; reading a sub-group never written (state,
    prefetch, step) raises and allocates nothing; init_master and load_state allocate theirs."""
    opt = _opt(tmp_path)
    try:
        assert _swap_files(opt) == [] and opt._swapper.files() == []
        for read in (lambda: opt.state(1).__enter__(), opt.prefetch,
                     lambda: opt.step(step=1, hyper=HYPER, grad=lambda i: torch.zeros(SIZES[i]), out=lambda i: None)):
            with pytest.raises(RuntimeError, match="sub-group 'g0/s[01]' was never initialised"):
                read()
        assert _swap_files(opt) == [] and len(opt._free) == len(opt._buffers)
        opt.init_master(1, torch.ones(SIZES[1]))
        path = opt._swapper.path_for(opt._file_key(opt.specs[1]))
        assert _swap_files(opt) == [path.name] and path.stat().st_size == 12 * SIZES[1]
        opt.load_state(0, torch.full((SIZES[0],), 2.0), torch.ones(SIZES[0]), None)
        opt.init_master(2, torch.zeros(SIZES[2]))
        assert len(_swap_files(opt)) == 3
        outs = [torch.empty(n) for n in SIZES]
        opt.step(step=1, hyper=HYPER, grad=lambda i: torch.ones(SIZES[i]), out=lambda i: outs[i])
        opt.prefetch()
        with opt.state(0) as (master, m, v):
            assert torch.equal(master, outs[0]) and (m > 0.9).all() and (v > 0).all()
    finally:
        opt.close()


def test_a_full_disk_at_the_first_write_names_the_file_and_initialises_nothing(tmp_path, monkeypatch):
    """fallocate failing with ENOSPC as a sub-group's file is allocated: init_master raises
    DiskFullError naming that file, the file is gone, every swap buffer is free, the sub-group
    stays uninitialised (reads refuse it), and a later try with room succeeds, warning of
    nothing."""
    from zeroinf.io import DiskFullError

    opt = _opt(tmp_path)
    try:
        path = opt._swapper.path_for(opt._file_key(opt.specs[1]))
        real = os.posix_fallocate

        def full(fd, offset, length):
            if os.readlink(f"/proc/self/fd/{fd}") == str(path):
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, offset, length)

        monkeypatch.setattr(os, "posix_fallocate", full)
        opt.init_master(0, torch.ones(SIZES[0]))
        with pytest.raises(DiskFullError) as ei:
            opt.init_master(1, torch.ones(SIZES[1]))
        assert ei.value.filename == str(path) and ei.value.errno == errno.ENOSPC
        assert not path.exists()  # nothing of it holds disk space
        assert len(opt._free) == len(opt._buffers) and not opt._records[1].initialised
        with pytest.raises(RuntimeError, match="'g0/s1' was never initialised"):
            opt.state(1).__enter__()
        monkeypatch.setattr(os, "posix_fallocate", real)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt.init_master(1, torch.full((SIZES[1],), 3.0))
        with opt.state(1) as (master, m, _v):
            assert torch.equal(master, torch.full((SIZES[1],), 3.0)) and not m.any()
    finally:
        opt.close()


def test_a_rerun_adopts_nothing_unwritten_and_warns_once_for_stale_files(tmp_path):
    """A second optimizer on the folder of a first (a rerun): files of other sizes under its
    keys are stale, removed at construction with one warning; files of the same keys and sizes
    are overwritten by the first write, never read before it."""
    first = _opt(tmp_path)
    for i, n in enumerate(SIZES):
        first.init_master(i, torch.full((n,), float(i)))
    first.close()
    specs = [SubGroupSpec("g0/s0", SIZES[0]), SubGroupSpec("g0/s1", 2 * SIZES[1]), SubGroupSpec("g0/s2", SIZES[2])]
    with pytest.warns(RuntimeWarning, match=r"^1 stale swap file\(s\) in "):
        again = SubGroupOptimizer(specs, device="nvme", swap_dir=str(tmp_path), buffer_count=2, pipeline_read=True)
    try:
        assert not again._swapper.path_for(again._file_key(specs[1])).exists()
        with pytest.raises(RuntimeError, match="never initialised"):
            again.state(0).__enter__()
        again.init_master(0, torch.full((SIZES[0],), 7.0))
        with again.state(0) as (master, _m, _v):
            assert torch.equal(master, torch.full((SIZES[0],), 7.0))
    finally:
        again.close()


def test_a_rerun_with_fewer_sub_groups_removes_the_files_it_has_no_key_for(tmp_path):
    """The disk check counts every file in the optimizer's folder as free for a rerun
    (reusable_bytes): the files of sub-groups the rerun does not have go at construction, with
    the stale ones in the one warning, so the folder ends with the rerun's files alone."""
    first = _opt(tmp_path)
    for i, n in enumerate(SIZES):
        first.init_master(i, torch.full((n,), float(i)))
    folder = first._swapper.directory
    first.close()
    assert len(list(folder.glob("*.swp"))) == len(SIZES)
    specs = [SubGroupSpec("g0/s0", SIZES[0])]
    with pytest.warns(RuntimeWarning, match=rf"^{len(SIZES) - 1} stale swap file\(s\) in .*a key this run does not use"):
        again = SubGroupOptimizer(specs, device="nvme", swap_dir=str(tmp_path), buffer_count=2, pipeline_read=True)
    try:
        assert again._swapper.directory == folder
        assert sorted(f.name for f in folder.glob("*.swp")) == [again._swapper.path_for(again._file_key(specs[0])).name]
        assert sorted(f.suffix for f in folder.iterdir() if f.suffix in (".swp", ".json")) == [".json", ".swp"]
        again.init_master(0, torch.full((SIZES[0],), 5.0))
        with again.state(0) as (master, _m, _v):
            assert torch.equal(master, torch.full((SIZES[0],), 5.0))
    finally:
        again.close()
