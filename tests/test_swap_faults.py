"""Fault injection on real swap files between training steps: flipped bytes, a truncated file,
a removed file or swap folder, a full disk and an I/O error each raise one AIOError line that
names the file, and nothing is updated (the files read back byte for byte as before the step).
``aio.verify_checksums: false`` turns the checksums off."""
import contextlib
import errno
import os
import shutil
from pathlib import Path

import pytest
import torch

import zeroinf
from zeroinf.io import AsyncIOHandle, TensorSwapper
from zeroinf.io.checksum import CHUNK_BYTES
from zeroinf.io.errors import (AIOError, ChecksumMismatchError, DeviceIOError, DiskFullError, StaleSwapFileError)
from stage3_models import TinyLM, batch, loss_fn
from engine_helpers import batches, config as config_012, train


def _stage3_config(nvme: Path, **aio) -> dict:
    z = {"stage": 3, "stage3_param_persistence_threshold": 20, "sub_group_size": 1500,
         "offload_param": {"device": "nvme", "nvme_path": str(nvme), "buffer_count": 2, "buffer_size": 4096,
                           "max_in_cpu": 0},
         "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme), "buffer_count": 4}}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": z}
    if aio:
        cfg["aio"] = aio
    return cfg


def _step(engine, step: int) -> float:
    x, y = batch(step)
    loss = loss_fn(engine(x), y)
    engine.backward(loss)
    engine.step()
    engine.synchronize()
    return loss.item()


def _settle(engine) -> None:
    """Finish the writes a step leaves in flight, so the files on disk are the step's."""
    engine.synchronize()
    engine.sub_optimizer._settle()


def _swapped_files(engine):
    """{path: bytes} of every parameter partition and optimizer state swap file (gradient
    files are rewritten by every backward)."""
    swappers = [engine.sub_optimizer._swapper, engine.params.manager._swapper]
    return {p: p.read_bytes() for s in swappers for p in s.files() if p.suffix == ".swp"
            and not p.name.startswith("grad_")}


def _aio_error(exc):
    """The AIOError in ``exc``'s chain (a background step's failure wraps it)."""
    while exc is not None:
        if isinstance(exc, AIOError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x5A]))


def _param_file(engine) -> Path:
    """The largest parameter partition's file (the gradient files there are rewritten by each
    backward before they are read)."""
    sw = engine.params.manager._swapper
    key = max((k for k in sw.manifest() if "/param/" in k), key=lambda k: sw.manifest()[k]["nbytes"])
    return sw.path_for(key)


def _optimizer_file(engine) -> Path:
    opt = engine.sub_optimizer
    return opt._swapper.path_for(opt._file_key(opt.specs[0]))  # the step's first sub-group


@pytest.mark.parametrize("fault", ["flip_param", "flip_optimizer", "truncate_optimizer", "delete_param",
                                   "delete_dir"])
def test_stage3_nvme_fault_between_steps_raises_before_any_update(tmp_path, fault):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    torch.manual_seed(0)
    engine, *_ = zeroinf.initialize(model=TinyLM(), config=_stage3_config(nvme))
    _step(engine, 1)
    _settle(engine)
    before = _swapped_files(engine)
    target = _param_file(engine) if fault.endswith("param") else _optimizer_file(engine)
    size = target.stat().st_size
    if fault.startswith("flip"):
        _flip(target, size // 2)
    elif fault.startswith("truncate"):
        os.truncate(target, size // 2)
    elif fault == "delete_param":
        target.unlink()
    else:
        shutil.rmtree(nvme)
    with pytest.raises(Exception) as info:
        _step(engine, 2)
    with contextlib.suppress(Exception):
        engine.close()
    err = _aio_error(info.value)
    assert err is not None, repr(info.value)
    assert "\n" not in str(err)
    if fault == "delete_dir":
        assert str(err.filename).startswith(str(nvme)), err
        return
    assert err.filename == str(target) and str(target) in str(err)
    if fault.startswith("flip"):
        assert isinstance(err, ChecksumMismatchError), err
        assert err.offset == (size // 2) // CHUNK_BYTES * CHUNK_BYTES
        assert f"CRC-32C of bytes [{err.offset}, {min(size, err.offset + CHUNK_BYTES)})" in str(err)
    elif fault.startswith("truncate"):
        assert isinstance(err, StaleSwapFileError) and f"has {size // 2} bytes, expected {size}" in str(err)
    else:
        assert isinstance(err, StaleSwapFileError) and "is missing" in str(err)
    # nothing was updated: every other file (weights, moments) holds the bytes it held before
    after = {p: p.read_bytes() for p in before if p != target}
    assert after == {p: b for p, b in before.items() if p != target}


def test_stage3_checksums_off_reads_flipped_bytes_silently(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    torch.manual_seed(0)
    engine, *_ = zeroinf.initialize(model=TinyLM(), config=_stage3_config(nvme, verify_checksums=False))
    assert not engine.sub_optimizer._swapper.checksum and not engine.params.manager._swapper.checksum
    _step(engine, 1)
    _settle(engine)
    assert all(e["crc32c"] is None for e in engine.sub_optimizer._swapper.manifest().values())
    _flip(_optimizer_file(engine), 10)
    _step(engine, 2)  # no verification: the step runs on the changed moments
    engine.close()


@pytest.mark.parametrize("stage", [0, 2])
def test_stage012_optimizer_on_nvme_flip_raises_and_keeps_the_weights(tmp_path, stage):
    X, Y = batches(2)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))
    engine, *_ = zeroinf.initialize(model=model, config=config_012(stage, "nvme", tmp_path))
    train(engine, X, Y, 1)
    engine.sub_optimizer._settle()
    weights = [p.detach().clone() for p in engine.module.parameters()]
    target = _optimizer_file(engine)
    _flip(target, target.stat().st_size // 2)
    with pytest.raises(ChecksumMismatchError) as info:
        train(engine, X[1:], Y[1:], 1)
    assert info.value.filename == str(target) and "\n" not in str(info.value)
    assert all(torch.equal(p, w) for p, w in zip(engine.module.parameters(), weights))
    with contextlib.suppress(Exception):
        engine.close()


def test_multi_chunk_flip_names_the_chunk_offset(tmp_path):
    s = TensorSwapper(tmp_path, AsyncIOHandle(block_size=256 << 10))
    n = 3 * CHUNK_BYTES // 4 + 11  # 3 MiB + 44 bytes of fp32: four chunks, the last one short
    s.register("k", n, torch.float32)
    src = torch.randn(n)
    s.swap_out([("k", src)], async_op=False)
    _flip(s.path_for("k"), 2 * CHUNK_BYTES + 12345)
    dst = torch.zeros(n)
    with pytest.raises(ChecksumMismatchError, match=rf"CRC-32C of bytes \[{2 * CHUNK_BYTES}, {3 * CHUNK_BYTES}\)") as info:
        s.swap_in([("k", dst)], async_op=False)
    assert info.value.offset == 2 * CHUNK_BYTES and info.value.filename == str(s.path_for("k"))
    _flip(s.path_for("k"), 2 * CHUNK_BYTES + 12345)  # flipped back: the same bytes verify again
    s.swap_in([("k", dst)], async_op=False)
    assert torch.equal(dst, src)
    s.close()


@pytest.mark.parametrize("fault,cls", [("enospc:8192", DiskFullError), ("eio:8192", DeviceIOError)])
def test_disk_full_and_io_error_are_one_line_naming_the_file(tmp_path, monkeypatch, fault, cls):
    monkeypatch.setenv("ZEROINF_AIO_FAULT", fault)
    s = TensorSwapper(tmp_path, AsyncIOHandle())
    s.register("k", 5000, torch.float32)
    with pytest.raises(cls) as info:
        s.swap_out([("k", torch.randn(5000))], async_op=False)
    assert info.value.filename == str(s.path_for("k")) and info.value.offset == 8192
    assert "\n" not in str(info.value) and str(s.path_for("k")) in str(info.value)
    with pytest.raises(StaleSwapFileError, match="holds no swapped-out data"):  # the failed write is never read
        s.swap_in([("k", torch.zeros(5000))])
    s.close()


def test_removed_swap_folder_is_one_line_naming_the_file(tmp_path):
    s = TensorSwapper(tmp_path)
    s.register("k", 5000, torch.float32)
    s.swap_out([("k", torch.randn(5000))], async_op=False)
    shutil.rmtree(s.directory)
    with pytest.raises(StaleSwapFileError, match="is missing") as info:
        s.swap_in([("k", torch.zeros(5000))])
    assert info.value.filename == str(s.path_for("k")) and info.value.errno == errno.ENOENT
    with pytest.raises(AIOError) as info:
        s.swap_out([("k", torch.randn(5000))], async_op=False)
    assert str(s.directory) in str(info.value) and "\n" not in str(info.value)
    s.close()


def test_verify_checksums_key_is_validated_and_reaches_the_handle():
    from zeroinf.config import ConfigError, parse_config

    base = {"train_micro_batch_size_per_gpu": 1}
    assert parse_config(base).aio.verify_checksums is True
    assert parse_config({**base, "aio": {"verify_checksums": False}}).aio.as_dict()["verify_checksums"] is False
    with pytest.raises(ConfigError, match="aio.verify_checksums"):
        parse_config({**base, "aio": {"verify_checksums": "no"}})
    with pytest.raises(ValueError, match="aio.verify_checksums"):
        AsyncIOHandle.from_config({"verify_checksums": 1})
    h = AsyncIOHandle.from_config({"verify_checksums": False})
    assert h.verify_checksums is False
    h.close()


@pytest.mark.parametrize("stage", [0, 2])
def test_a_fault_after_some_sub_groups_stepped_refuses_the_torn_state_until_a_load(tmp_path, stage):
    """The last sub-group's state is corrupt: the step has stepped the earlier sub-groups when its
    read fails. Weights and state then belong to two steps, so the engine, the model's own
    forward and state_dict refuse them, naming the error, until a checkpoint load restores one
    step; training from there equals an engine that loaded the same checkpoint."""
    X, Y = batches(4)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))
    engine, *_ = zeroinf.initialize(model=model, config=config_012(stage, "nvme", tmp_path / "a"))
    assert len(engine.sub_optimizer.specs) > 2
    train(engine, X, Y, 1)
    engine.save_checkpoint(str(tmp_path / "ckpt"), tag="s1")
    engine.sub_optimizer._settle()
    opt = engine.sub_optimizer
    last = opt._swapper.path_for(opt._file_key(opt.specs[-1]))
    _flip(last, last.stat().st_size // 2)
    with pytest.raises(ChecksumMismatchError):
        train(engine, X[1:], Y[1:], 1)
    for use in (lambda: engine(X[0]), lambda: model(X[0]), lambda: model.state_dict(), lambda: engine.step()):
        with pytest.raises(RuntimeError, match=r"an optimizer step failed part-way \(ChecksumMismatchError"):
            use()
    engine.load_checkpoint(str(tmp_path / "ckpt"), tag="s1")
    got = train(engine, X[1:], Y[1:], 2)
    torch.manual_seed(1)
    ref_model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))
    ref, *_ = zeroinf.initialize(model=ref_model, config=config_012(stage, "nvme", tmp_path / "b"))
    ref.load_checkpoint(str(tmp_path / "ckpt"), tag="s1")
    assert got == train(ref, X[1:], Y[1:], 2)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))
    engine.close()
    ref.close()


def test_a_fault_in_the_first_sub_group_leaves_the_engine_usable(tmp_path):
    """Nothing was stepped when the first sub-group's read fails: the weights are the last
    step's and the engine still answers (a forward runs)."""
    X, Y = batches(2)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))
    engine, *_ = zeroinf.initialize(model=model, config=config_012(2, "nvme", tmp_path))
    train(engine, X, Y, 1)
    engine.sub_optimizer._settle()
    _flip(_optimizer_file(engine), 10)
    with pytest.raises(ChecksumMismatchError):
        train(engine, X[1:], Y[1:], 1)
    engine(X[0])
    model.state_dict()
    engine.close()
