"""A missing ``nvme_path`` is made, as DeepSpeed's swappers make theirs. One that cannot hold swap
files fails at set-up with the config key (or the CLI flag) and the real reason, from every entry
point: ``zeroinf.initialize``, ``zeroinf.Init``, the stage-3 manager built directly, and
``zeroinf train``. ``/proc/sys`` exists, but creating a file there fails with ENOENT ("No such
file or directory"), which misleads."""
import os

import pytest

import zeroinf
from zeroinf.config import ConfigError
from zeroinf.io.probe import dir_problem, fs_type
from zeroinf.runtime.stage3 import Stage3ConfigError, Stage3Options, Stage3ParameterManager
from stage3_models import TinyLM

PROC = "/proc/sys"
needs_proc = pytest.mark.skipif(not os.path.isdir(PROC) or fs_type(PROC) != "proc", reason="no procfs at /proc/sys")
KEY = "zero_optimization.offload_param.nvme_path"


def _cfg(path, opt="cpu"):
    z = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(path)}, "offload_optimizer": {"device": opt}}
    if opt == "nvme":
        z["offload_optimizer"]["nvme_path"] = str(path)
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": z}


def _assert_real_reason(msg):
    assert "'proc' file system" in msg and "No such file" not in msg, msg


def test_dir_problem_reasons(tmp_path):
    assert dir_problem(str(tmp_path)) is None
    assert dir_problem(str(tmp_path / "missing")) == "does not exist"
    (tmp_path / "f").write_text("x")
    assert dir_problem(str(tmp_path / "f")) == "is not a directory"
    assert not list(tmp_path.glob(".zeroinf-probe-*"))  # the probe file is gone
    assert dir_problem(str(tmp_path / "made" / "here"), create=True) is None  # with its parents
    assert (tmp_path / "made" / "here").is_dir()
    assert dir_problem(str(tmp_path / "f" / "sub"), create=True) == f"cannot be created: {tmp_path / 'f'} is not a directory"
    os.symlink(tmp_path / "gone", tmp_path / "dangling")  # a dangling link is not followed into a new folder
    assert dir_problem(str(tmp_path / "dangling"), create=True) == \
        f"is a symbolic link to {tmp_path / 'gone'}, which does not exist"
    assert not (tmp_path / "gone").exists()


@needs_proc
@pytest.mark.parametrize("opt", ["cpu", "nvme"])
@pytest.mark.parametrize("path", [PROC, PROC + "/zeroinf/swap"])
def test_initialize_raises_config_error_naming_the_key(opt, path):
    with pytest.raises(ConfigError) as ei:
        zeroinf.initialize(model=TinyLM(), config=_cfg(path, opt))
    assert str(ei.value).startswith(f"{KEY}: '{path}' ")
    _assert_real_reason(str(ei.value))


@needs_proc
def test_init_raises_config_error_and_leaves_no_context_behind(tmp_path):
    with pytest.raises(ConfigError) as ei:
        with zeroinf.Init(config=_cfg(PROC)):
            TinyLM()
    assert str(ei.value).startswith(f"{KEY}: ")
    _assert_real_reason(str(ei.value))
    with zeroinf.Init(config=_cfg(tmp_path / "new")) as init:  # a failed enter does not block the next one,
        model = TinyLM()                                        # and a missing nvme_path is made
    assert any((tmp_path / "new").rglob("*.swp"))
    assert init.held_bytes_nvme > 0
    del model  # Init holds values while their parameters live
    assert init.held_bytes_nvme == 0


@needs_proc
@pytest.mark.parametrize("path", [PROC, PROC + "/zeroinf/swap"])
def test_manager_built_directly_raises_stage3_config_error(path):
    with pytest.raises(Stage3ConfigError) as ei:
        Stage3ParameterManager(TinyLM(), Stage3Options(offload_param_device="nvme", nvme_path=path))
    assert str(ei.value).startswith(f"{KEY}: ")
    _assert_real_reason(str(ei.value))


@needs_proc
@pytest.mark.parametrize("path", [PROC, PROC + "/zeroinf/swap"])
def test_train_cli_exits_with_one_line_naming_flag_and_reason(path, tmp_path, capsys, monkeypatch):
    from zeroinf.cli import main
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--offload", "infinity", "--nvme-path", path, "--steps", "1", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1, err
    assert f"--nvme-path {path}" in err[0]
    _assert_real_reason(err[0])


@needs_proc
def test_train_cli_in_a_working_directory_without_room_for_its_private_swap_folder(tmp_path, capsys, monkeypatch):
    """Without --nvme-path the swap folder goes under the working directory (a traceback there)."""
    from zeroinf.cli import main
    monkeypatch.chdir(PROC)
    code = main(["train", "--offload", "infinity", "--steps", "1", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"the working directory {PROC} " in err[0] and err[0].endswith("give --nvme-path DIR")
    _assert_real_reason(err[0])
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_relative_nvme_path_survives_a_change_of_directory(tmp_path, monkeypatch, stage):
    """A relative nvme_path (made by initialize, or written so by zeroinf plan --nvme-path rel)
    was kept relative: after os.chdir between steps the swap files were looked up in the new
    directory ("swap file ... has -1 bytes": tester-33 M5). It is taken from the directory at
    initialize, and the steps equal torch.optim.AdamW."""
    import copy

    import torch
    monkeypatch.chdir(tmp_path)
    (tmp_path / "other").mkdir()
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
    model = copy.deepcopy(ref)
    z = {"stage": stage, "offload_optimizer": {"device": "nvme", "nvme_path": "rel/x"}}
    if stage == 3:
        z.update(offload_param={"device": "nvme", "nvme_path": "rel/x"}, stage3_param_persistence_threshold=0)
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": z}
    engine, *_ = zeroinf.initialize(model=model, config=cfg)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, foreach=False)
    for step in range(3):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        ref(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        os.chdir(tmp_path / "other" if step % 2 == 0 else tmp_path)
    engine.synchronize()
    got = {k: v.clone() for k, v in model.state_dict().items()}
    engine.close()
    for k, v in ref.state_dict().items():
        assert (got[k] - v).abs().max().item() <= 1e-6, k
    assert list((tmp_path / "rel" / "x").iterdir()) and not (tmp_path / "other" / "rel").exists()


def test_train_cli_on_a_full_disk_exits_with_one_line(tmp_path, capsys, monkeypatch):
    """zeroinf.Init writes swap files while the model is built, before the engine's free-space
    check: a full file system ended in DiskFullError's traceback, exit 1 (tester-33 M6, a 600 KB
    tmpfs as the working directory). Here the swapper's preallocation fails as it did there."""
    import errno

    from zeroinf.cli import main
    from zeroinf.io import swapper
    from zeroinf.io.errors import make_error

    def full(self, *args, **kwargs):
        raise make_error(errno.ENOSPC, "cannot preallocate swap file (No space left on device)", "x.swp", 0, 65536, 0)
    monkeypatch.setattr(swapper.TensorSwapper, "register", full)
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--offload", "infinity", "--steps", "1", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0] == ("zeroinf train: error: cannot preallocate swap file (No space left on device) (No space left on "
                      "device; offset 0, 0 of 65536 bytes done); free space there or give --nvme-path on a larger disk")
    assert err[0].count("x.swp") == 0  # the path once, from the message itself (here it names none)
    assert not list(tmp_path.glob(".zeroinf-*"))  # the private swap folder went too


@needs_proc
def test_a_refused_initialize_removes_the_nvme_path_it_created(tmp_path):
    """offload_param.nvme_path creatable, offload_optimizer.nvme_path not: the run was refused and
    the first folder stayed created (tester-33, p_ok/1)."""
    cfg = _cfg(tmp_path / "p_ok" / "1", "nvme")
    cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = PROC + "/zz"
    with pytest.raises(ConfigError, match=r"offload_optimizer.nvme_path: '/proc/sys/zz' cannot be created"):
        zeroinf.initialize(model=TinyLM(), config=cfg)
    assert list(tmp_path.iterdir()) == []


def test_a_tilde_nvme_path_is_the_users_home(tmp_path, monkeypatch):
    """"nvme_path": "~/x" made a folder literally named "~" in the working directory (as
    DeepSpeed's swappers do); it is the home folder, as a shell reads it, in a config and in
    zeroinf train's --nvme-path=~/x (which no shell expands)."""
    from zeroinf.config import parse_config
    from zeroinf.cli.train import _Run, add_arguments
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    cfg = parse_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "~/swap"},
        "offload_optimizer": {"device": "nvme", "nvme_path": "~"}}})
    assert cfg.zero_optimization.offload_param.nvme_path == str(home / "swap")
    assert cfg.zero_optimization.offload_optimizer.nvme_path == str(home)
    import argparse
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = _Run(p.parse_args(["--nvme-path=~/swap2", "--steps", "1"]))._resolve_args()
    assert args.nvme_path == str(home / "swap2")
    assert not (cwd / "~").exists()
