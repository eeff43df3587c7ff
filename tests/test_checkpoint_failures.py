"""A save or load that fails part-way leaves things whole: a load failing part-way blocks the model,
a truncated or bit-flipped file is named and nothing loads, a failed write is an OSError naming the
file and keeps the earlier save, writes go through write-then-rename, and a full disk gets its space
back."""
import copy
import errno
import os
import re
import shutil
import subprocess

import pytest
import torch

import zeroinf
from zeroinf.checkpoint import CheckpointError
from checkpoint_helpers import _engine_state, _small_engine, _stage3_nvme_engine, _train


def test_a_load_that_fails_part_way_blocks_the_model_itself_at_stage_1(tmp_path):
    """After a load that failed part-way, the model's own forward and state_dict refuse the mixed
    state as the engine does (stage 1/2 models hold plain parameters: the engine's hooks on the
    model check it); a completed load restores the saved values; close() takes the hooks off."""
    engine, model = _small_engine(offload_optimizer={"device": "cpu"})
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 1, "sub_group_size": 50, "offload_optimizer": {"device": "cpu"}}}
    x = torch.randn(4, 7)
    engine.backward(engine(x).square().mean())
    engine.step()
    engine.save_checkpoint(str(tmp_path), "t")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    engine.backward(engine(x).square().mean())
    engine.step()
    load_state = engine.sub_optimizer.load_state

    def failing(i, *a):
        if i == 1:
            raise OSError(5, "injected EIO")
        return load_state(i, *a)
    engine.sub_optimizer.load_state = failing
    with pytest.raises(OSError, match="injected"):
        engine.load_checkpoint(str(tmp_path), "t")
    for call in (lambda: model(x), model.state_dict, lambda: engine(x), engine.step):
        with pytest.raises(RuntimeError, match="load_checkpoint failed part-way .*OSError.*injected EIO"):
            call()
    engine.sub_optimizer.load_state = load_state
    engine.load_checkpoint(str(tmp_path), "t")
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    engine.sub_optimizer.load_state = failing
    with pytest.raises(OSError, match="injected"):
        engine.load_checkpoint(str(tmp_path), "t")
    # a copy of the model has no engine that could clear a guard: its copy is clear
    copy.deepcopy(model)(x)
    engine.close()
    model(x)  # the closed engine no longer guards the model
    assert len(model._forward_pre_hooks) == 0
    # an engine never closed after a failed load: a new engine on the model takes over (the
    # old guard refused it for good), and the old engine is freed (the guard kept the failure's
    # traceback, whose frames held it)
    import gc
    import weakref
    old = zeroinf.initialize(model, config=cfg)[0]
    old.sub_optimizer.load_state = lambda i, *a: (_ for _ in ()).throw(OSError(5, "injected EIO"))
    with pytest.raises(OSError, match="injected"):
        old.load_checkpoint(str(tmp_path), "t")
    with pytest.raises(RuntimeError, match="failed part-way"):
        model(x)
    gone = weakref.ref(old)
    del old
    gc.collect()
    assert gone() is None
    new = zeroinf.initialize(model, config=cfg)[0]
    new.backward(new(x).square().mean())
    new.step()
    new.close()


@pytest.mark.parametrize("victim", ["optim_last", "rng", "model_states", "module_key", "extra_state", "rng_keys",
                                    "rng_numpy", "rng_value", "meta_counter", "hyper_key"])
def test_truncated_checkpoint_file_is_named_and_nothing_is_loaded(tmp_path, victim):
    """A truncated file fails the load before anything changes (the tester's case: the last of 14
    optimizer files truncated left the weights and 13 sub-groups at the saved step, the 14th half
    loaded, and torch's error named no file)."""
    (tmp_path / "nv").mkdir()
    engine = _stage3_nvme_engine(tmp_path / "nv")
    _train(engine, 2)
    ckpt = engine.save_checkpoint(str(tmp_path / "ck"), "a")
    _train(engine, 2, seed=10)
    before = _engine_state(engine)
    files = {"optim_last": sorted(f for f in os.listdir(ckpt) if f.startswith("optim_rank0_"))[-1],
             "rng": "rng_rank0.pt", "model_states": "model_states.pt", "module_key": "model_states.pt",
             "extra_state": "model_states.pt", "rng_keys": "rng_rank0.pt", "rng_numpy": "rng_rank0.pt", "rng_value": "rng_rank0.pt",
             "meta_counter": "model_states.pt", "hyper_key": "model_states.pt"}
    path = os.path.join(ckpt, files[victim])
    if victim in ("module_key", "extra_state"):  # readable, but load_state_dict would stop half-way
        meta = torch.load(path, weights_only=True)
        if victim == "module_key":  # a weight missing
            meta["module"].pop(sorted(meta["module"])[-1])
        else:  # extra state of a module that has none here
            meta["module"]["head._extra_state"] = {"v": 1}
        torch.save(meta, path)
        problem = "the module state does not match this model"
    elif victim == "rng_keys":  # a torch file, but not RNG states
        torch.save({"torch": torch.get_rng_state()}, path)
        problem = "holds no usable RNG states"
    elif victim == "rng_numpy":  # RNG states that numpy refuses (the tester: applied after the weights)
        rng = torch.load(path, weights_only=True)
        rng["numpy"]["keys"] = rng["numpy"]["keys"][:623]
        torch.save(rng, path)
        problem = "holds no usable RNG states"
    elif victim == "rng_value":  # a valid but different Python RNG state: only the CRC tells
        rng = torch.load(path, weights_only=True)
        version, state, gauss = rng["python"]
        rng["python"] = (version, (state[0] ^ 1,) + tuple(state[1:]), gauss)
        torch.save(rng, path)
        problem = "holds no usable RNG states (ValueError: the states do not match their CRC-32"
    elif victim in ("meta_counter", "hyper_key"):  # entries read after the weights were loaded
        meta = torch.load(path, weights_only=True)
        if victim == "meta_counter":
            del meta["global_steps"]
            problem = "global_steps is None"
        else:
            meta["param_groups"][0]["bias_correstion"] = True
            problem = "param group 0 has hyper-parameters this optimizer does not"
        torch.save(meta, path)
    else:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        problem = "unreadable"
    with pytest.raises(CheckpointError, match=re.escape(files[victim] + ": " + problem)):
        engine.load_checkpoint(str(tmp_path / "ck"), "a")
    after = _engine_state(engine)
    assert after[2] == before[2]
    assert after[0].keys() == before[0].keys()
    for k in before[0]:
        assert torch.equal(after[0][k], before[0][k]), k
    for a, b in zip(after[1], before[1]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    _train(engine, 1, seed=20)  # and the engine trains on
    engine.close()


def test_checkpoint_write_failure_is_an_oserror_naming_the_file(tmp_path):
    """A write that fails part-way (here the file-size limit; the tester's case was a full disk)
    raises OSError naming the file, leaves no temporary file and no 'latest'; torch's own error
    says only 'unexpected pos 704 vs 598'."""
    import resource
    import signal

    engine, _ = _small_engine()
    old_sig = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write(), not a killed process
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (600, old[1]))
    try:
        with pytest.raises(OSError, match=r"optim_rank0_.*\.pt: writing the file failed"):
            engine.save_checkpoint(str(tmp_path), "full")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, old_sig)
    # the unfinished folder is gone too: on a full disk it kept the room the next save needed
    assert not (tmp_path / "full.saving").exists()
    assert not (tmp_path / "full").exists() and not (tmp_path / "latest").exists()
    # save_16bit_model, both formats: EFBIG (it said EIO), and safetensors' own error type, which is
    # no OSError and named no file (tester-35 F07); the file saved before stays whole
    from safetensors.torch import load_file
    for name, load in (("pytorch_model.bin", lambda f: torch.load(f, weights_only=True)), ("model.safetensors", load_file)):
        engine.save_16bit_model(str(tmp_path / "16"), name)
        path = tmp_path / "16" / name
        good = path.read_bytes()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (len(good) // 2, old[1]))
        try:
            with pytest.raises(OSError, match=rf"\[Errno {errno.EFBIG}\] {re.escape(str(path))}: writing the file failed"):
                engine.save_16bit_model(str(tmp_path / "16"), name)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, old)
            signal.signal(signal.SIGXFSZ, old_sig)
        assert path.read_bytes() == good and not [f for f in os.listdir(tmp_path / "16") if ".tmp" in f]
        assert set(load(str(path))) == set(engine.module.state_dict())


def test_a_failed_resave_of_a_tag_leaves_the_earlier_save_whole(tmp_path, monkeypatch):
    """Saving a tag again and failing at the last file used to leave the new optimizer files
    beside the old model_states.pt: a mix that loaded without error (step-2 weights and
    counters, step-4 masters; found by the tester). The earlier save now stays whole."""
    engine, _ = _small_engine()
    x = torch.randn(4, 7)

    def train(n):
        for _ in range(n):
            engine.backward(engine(x).square().mean())
            engine.step()

    def state():
        opt = engine.sub_optimizer
        optim = [[t.clone() for t in opt._records[i].state] for i in range(len(opt.specs))]
        return [p.detach().clone() for p in engine.module.parameters()], optim, engine.global_steps

    train(2)
    engine.save_checkpoint(str(tmp_path), "last")
    saved = state()
    train(2)
    save = torch.save

    def failing_save(obj, path, *a, **k):
        if "model_states" in str(path):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return save(obj, path, *a, **k)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="model_states.pt"):
        engine.save_checkpoint(str(tmp_path), "last")
    monkeypatch.setattr(torch, "save", save)
    engine.load_checkpoint(str(tmp_path))  # 'latest' still names the earlier save, which is whole
    loaded = state()
    assert loaded[2] == saved[2] == 2
    assert all(torch.equal(a, b) for a, b in zip(loaded[0], saved[0]))
    assert all(torch.equal(a, b) for la, lb in zip(loaded[1], saved[1]) for a, b in zip(la, lb))
    train(2)
    engine.save_checkpoint(str(tmp_path), "last")  # and saving again works, over the earlier one
    assert sorted(os.listdir(tmp_path)) == ["last", "latest"]


@pytest.mark.parametrize("victim", ["optim", "model_states"])
def test_a_flipped_bit_in_tensor_data_is_refused(tmp_path, victim):
    """torch.load does not verify its zip CRCs: a flipped bit in a tensor loaded silently (the
    tester: ~55 of 60 positions). The CRC-32s written at save catch it, before anything loads."""
    engine, _ = _small_engine()
    x = torch.randn(4, 7)
    engine.backward(engine(x).square().mean())
    engine.step()
    ckpt = engine.save_checkpoint(str(tmp_path), "t")
    name = sorted(f for f in os.listdir(ckpt) if f.startswith("optim_"))[0] if victim == "optim" else "model_states.pt"
    path = os.path.join(ckpt, name)
    # flip one bit in the middle of the first tensor's data (torch zip entries are stored, not compressed)
    sd = torch.load(path, weights_only=True)
    t = sd["master"] if victim == "optim" else sd["module"]["0.weight"]
    raw = bytearray(open(path, "rb").read())
    at = bytes(raw).find(t.numpy().tobytes()[:64]) + 8
    assert at >= 8
    raw[at] ^= 0x10
    open(path, "wb").write(bytes(raw))
    weights = [p.detach().clone() for p in engine.module.parameters()]
    with pytest.raises(CheckpointError, match=name + ": .* does not match its CRC-32"):
        engine.load_checkpoint(str(tmp_path), "t")
    assert all(torch.equal(p, w) for p, w in zip(engine.module.parameters(), weights))
    # consolidate (the way to other world sizes and stages) checks them too: it wrote wrong weights
    with pytest.raises(CheckpointError, match=name + ": .* does not match its CRC-32"):
        zeroinf.checkpoint.consolidate(str(tmp_path), "t", str(tmp_path / "fp32.pt"))
    assert not (tmp_path / "fp32.pt").exists()


def test_write_then_rename_leaves_the_old_file_or_the_new_one(tmp_path):
    """The one writer behind checkpoint files, ``latest``, train's summaries, traces and plan's
    config: a write that fails, Ctrl-C included, leaves the old bytes and no temporary file; a
    finished one replaces the file and keeps its permission bits."""
    from zeroinf.io.atomic import write_text_then_rename, write_then_rename

    path = tmp_path / "f.json"
    path.write_text("old")
    os.chmod(path, 0o600)

    def interrupted(tmp):
        with open(tmp, "w") as f:
            f.write("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_then_rename(path, interrupted)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["f.json"]
    write_text_then_rename(path, "new")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["f.json"]
    assert os.stat(path).st_mode & 0o777 == 0o600
    # a legal name near the file system's limit: the temporary name is cut to fit (ENAMETOOLONG: tester-45 F5)
    long = tmp_path / ("x" * (os.pathconf(tmp_path, "PC_NAME_MAX") - 5) + ".json")
    write_text_then_rename(long, "long")
    assert long.read_text() == "long" and sorted(os.listdir(tmp_path)) == sorted(["f.json", long.name])


def test_a_save_that_fills_the_disk_gives_its_space_back(tmp_path):
    """A checkpoint file that ran out of space was unlinked, but torch's writer stayed open in the
    frames the error kept (until a garbage collection), so the full disk stayed full: other writes
    and umount failed (tester-45 F4). The space is back when the error is raised, and the error
    number is still ENOSPC."""
    import gc

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.decode().strip()}")
    model = torch.nn.Linear(256, 256)  # 0.8 MB of optimizer state
    engine, *_ = zeroinf.initialize(model, config={"train_micro_batch_size_per_gpu": 1, "optimizer": {
        "type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 1}})
    gc.disable()  # the fault hid behind a collection
    try:
        with pytest.raises(OSError) as ei:
            engine.save_checkpoint(str(mnt), "t")
        assert ei.value.errno == errno.ENOSPC and str(mnt) in str(ei.value)
        del ei
        assert shutil.disk_usage(mnt).used <= 8192
        assert not [f for f in os.listdir("/proc/self/fd") if str(mnt) in os.path.realpath(f"/proc/self/fd/{f}")]
        engine.close()
    finally:
        gc.enable()
        gc.collect()
        subprocess.run(["umount", str(mnt)], check=True)
