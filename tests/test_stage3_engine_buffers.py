"""Stage 3 through ``zeroinf.initialize``: host memory, staging buffers, swap files and the disk
check, and what ``close`` and ``empty_partition_cache`` free."""
import copy
import functools
import os
import time

import pytest
import torch

import zeroinf
from zeroinf.config import ConfigError
from stage3_models import TinyLM, batch, loss_fn
from stage3_engine_helpers import _assert_like_reference, _config, _reference, _run, _state


def test_host_memory_does_not_grow_with_model_size_on_nvme(tmp_path):
    """Peak RSS for P and ~4P parameters (params + optimizer + gradients on NVMe) differs by less
    than the configured pinned buffers. Subprocesses, so each peak is its own."""
    import json
    import os
    import subprocess
    import sys

    buf = 600_000  # elements: offload_param.buffer_size and sub_group_size
    here = os.path.dirname(os.path.abspath(__file__))
    # a fixed mmap threshold: glibc's dynamic one keeps freed blocks resident on the heap
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    res = []
    for blocks in (2, 8):
        out = subprocess.run([sys.executable, os.path.join(here, "stage3_mem_probe.py"), "256", str(blocks),
                              str(tmp_path), str(buf)], capture_output=True, text=True, timeout=300, env=env, cwd=here)
        assert out.returncode == 0, out.stderr
        res.append(json.loads(out.stdout.strip().splitlines()[-1]))
    buffers = 2 * buf * 4 + 3 * 12 * buf  # parameter staging buffers + optimizer swap buffers, bytes
    extra_state = (res[1]["params"] - res[0]["params"]) * 20  # fp32 param, grad, master, m, v
    assert res[1]["params"] > 3.5 * res[0]["params"]
    assert res[1]["growth"] - res[0]["growth"] < buffers < extra_state, (res, buffers)


def test_buffer_size_and_count_checked_at_initialize(tmp_path):
    from zeroinf.config import ConfigError

    cfg = _config("nvme", "cpu", tmp_path)
    cfg["zero_optimization"]["offload_param"]["buffer_size"] = 1000
    with pytest.raises(ConfigError, match=r"^zero_optimization.offload_param.buffer_size: 1000 elements .*unit "
                                          r"'blocks.0'.*minimum is 2080"):  # persistence threshold 20: biases and norms stay out
        zeroinf.initialize(model=TinyLM(), config=cfg)
    cfg = _config("nvme", "cpu", tmp_path)
    cfg["zero_optimization"]["offload_param"]["buffer_count"] = 1
    with pytest.raises(ConfigError, match=r"^zero_optimization.offload_param.buffer_count: 1 .*minimum is 2"):
        zeroinf.initialize(model=TinyLM(), config=cfg)


def test_two_engines_on_one_nvme_path_keep_their_own_swap_files(tmp_path):
    """An actor and a reference model with one config: the second initialize wrote into the
    first engine's parameter swap files, 0.66 off (helper-39, t02_two_engines_same_nvme.py)."""
    cfg = _config("nvme", "nvme", tmp_path)
    a_ref, b_ref = TinyLM(), TinyLM()
    with torch.no_grad():
        for p in b_ref.parameters():
            p.add_(1.0)
    a, *_ = zeroinf.initialize(model=copy.deepcopy(a_ref), config=cfg)
    b, *_ = zeroinf.initialize(model=copy.deepcopy(b_ref), config=cfg)
    for engine, ref in ((a, a_ref), (b, b_ref)):
        sd = _state(engine)
        for name, p in ref.named_parameters():
            assert torch.equal(sd[name], p.detach()), name
    _run(b, 1)  # b's step writes its partitions and optimizer state: a's stay
    sd = _state(a)
    assert all(torch.equal(sd[n], p.detach()) for n, p in a_ref.named_parameters())
    a.close()
    b.close()


def test_buffer_count_below_the_minimum_is_carved_from_the_configured_bytes(tmp_path):
    """Units of several partitions (frozen and trainable) need more staging buffers than a
    DeepSpeed config's buffer_count (helper-36: 5 refused, 6 needed); when buffer_count x
    buffer_size holds the needed buffers of the largest partition, the pool has that many,
    within the same pinned bytes, and training is exact."""
    ref = TinyLM()
    for b in ref.blocks:
        b.ln.requires_grad_(False)
    cfg = _config("nvme", "cpu", tmp_path, stage3_param_persistence_threshold=0)
    cfg["zero_optimization"]["offload_param"].update(buffer_count=2, buffer_size=100_000)
    model = copy.deepcopy(ref)
    engine, *_ = zeroinf.initialize(model=model, config=cfg)
    m = engine.params.manager
    assert m.min_buffer_count() == 4 and m.param_buffer_count() == 4
    assert m.host.nbytes <= 2 * 100_000 * 4
    _assert_like_reference(engine, ref, _run(engine, 3), _reference(ref, 3, [p for p in ref.parameters() if p.requires_grad]))
    engine.close()
    per = m.staging_buffer_bytes() // 4
    cfg["zero_optimization"]["offload_param"]["buffer_size"] = per  # 2 buffers' bytes: too few
    with pytest.raises(zeroinf.config.ConfigError, match=rf"buffer_count: 2 is too few .*the minimum is 4, or a "
                       rf"buffer_size of at least {2 * per} elements"):
        zeroinf.initialize(model=copy.deepcopy(ref), config=cfg)
    cfg["zero_optimization"]["offload_param"]["buffer_size"] = 2 * per  # what the message names: enough
    zeroinf.initialize(model=copy.deepcopy(ref), config=cfg)[0].close()


def test_default_buffer_size_pins_only_the_largest_partition(tmp_path):
    """offload_param.buffer_size 1e8 (DeepSpeed's default) × 5 buffers must not pin ~2 GB for a
    tiny model: each buffer is capped at the largest unit partition; stats() counts the pool."""
    from zeroinf.io import pinned_pool_bytes

    torch.manual_seed(0)
    cfg = _config("nvme", "cpu", tmp_path)
    cfg["zero_optimization"]["offload_param"].update(buffer_size=100_000_000, buffer_count=5)
    engine, *_ = zeroinf.initialize(model=TinyLM(), config=cfg)
    m = engine.params.manager
    largest = max(g.shard_numel * 4 for g in m.groups())  # fp32 partitions, bytes
    want = pinned_pool_bytes(5, -(-largest // 4096) * 4096)
    assert want < 5 * 1024 * 1024  # the independent bound: a few pages per buffer, not 400 MB
    assert m._pool.pinned_bytes == want
    assert m.host is engine.host and engine.sub_optimizer._pool is None  # the optimizer's state is in memory
    if not torch.cuda.is_available():  # no tensor is pinned: the pool is all the engine locks
        assert engine.host.nbytes == want
    _run(engine, 1)
    st = engine.stats()
    assert st["pinned_bytes"] == engine.host.nbytes
    if not torch.cuda.is_available():
        assert st["pinned_bytes"] == want
    engine.close()


def test_disk_check_counts_parameter_gradient_and_optimizer_swap_files(tmp_path, monkeypatch):
    """Stage 3 fp32 with both offloads on NVMe writes 4 (parameters, also the optimizer's
    masters) + 4 (fp32 gradients) + 8 (Adam moments) bytes per partition element; initialize
    must refuse a disk one byte short: the memory check first (zeroinf.memcheck), and the
    engine's own check of the swap files behind it."""
    import collections

    import zeroinf.runtime.engine as eng_mod
    from zeroinf.memcheck import InsufficientMemoryError

    def unchecked(cfg):  # the engine's own disk check, without the memory check in front of it
        return {**cfg, "zeroinf": {"check_memory": False}}

    (tmp_path / "a").mkdir()
    torch.manual_seed(0)
    engine, *_ = zeroinf.initialize(model=TinyLM(), config=_config("nvme", "nvme", tmp_path / "a"))
    parts = sum(g.shard_numel for g in engine.params.manager.groups())
    assert parts == sum(p.numel() for p in TinyLM().parameters())  # one rank: the whole model, unpadded
    engine.close()
    need = (4 + 4 + 8) * parts
    on_disk = sum(f.stat().st_size for f in (tmp_path / "a").rglob("*") if f.is_file() and not f.name.endswith(".json"))
    assert on_disk == need, (on_disk, need)
    Usage = collections.namedtuple("Usage", "total used free")
    for free, ok in ((need - 1, False), (need, True)):
        d = tmp_path / f"free{free}"
        d.mkdir()
        monkeypatch.setattr(eng_mod.shutil, "disk_usage", lambda p, free=free: Usage(10**12, 10**12 - free, free))
        if ok:
            zeroinf.initialize(model=TinyLM(), config=_config("nvme", "nvme", d))[0].close()
            continue
        with pytest.raises(InsufficientMemoryError, match=f"needs {need / 1e9:.3g} GB, .*: SHORT"):
            zeroinf.initialize(model=TinyLM(), config=_config("nvme", "nvme", d))
        with pytest.raises(zeroinf.config.ConfigError) as ei:
            zeroinf.initialize(model=TinyLM(), config=unchecked(_config("nvme", "nvme", d)))
        assert f"need {need} bytes (" in str(ei.value) and "gradient partitions" in str(ei.value), ei.value
        assert not list(d.iterdir())  # refused before any swap file was written
    # a rerun on "a" overwrites its own files: they count as free. With an engine still live on
    # "a", a second one takes other folders (zeroinf-swap.1), and the first's files are not free
    monkeypatch.setattr(eng_mod.shutil, "disk_usage", lambda p: Usage(10**12, 10**12, 0))
    live = zeroinf.initialize(model=TinyLM(), config=_config("nvme", "nvme", tmp_path / "a"))[0]
    with pytest.raises(InsufficientMemoryError, match="SHORT"):
        zeroinf.initialize(model=TinyLM(), config=_config("nvme", "nvme", tmp_path / "a"))
    with pytest.raises(zeroinf.config.ConfigError, match=r"has 0 bytes \(0 GB\) free"):
        zeroinf.initialize(model=TinyLM(), config=unchecked(_config("nvme", "nvme", tmp_path / "a")))
    live.close()


def test_bf16_gradients_on_nvme_kept_in_bf16_for_one_micro_batch_and_summed_in_fp32(tmp_path):
    """bf16 training with gradients on NVMe: after one micro-batch each partition's swap file is
    the bf16 gradient itself (half the bytes, lossless); a second micro-batch is added in fp32, not
    rounded to bf16. Reference: the same bf16 model's gradients from plain autograd, per micro-batch."""
    torch.manual_seed(0)
    ref = TinyLM().to(torch.bfloat16)
    model = copy.deepcopy(ref)
    cfg = _config("nvme", "nvme", tmp_path)
    cfg["bf16"] = {"enabled": True}
    cfg["gradient_accumulation_steps"] = 2
    engine, *_ = zeroinf.initialize(model=model, config=cfg)
    m = engine.params.manager
    names = {p: n for n, p in ref.named_parameters()}
    ref_grads = []
    for k in range(2):
        x, y = batch(30 + k)
        engine.backward(loss_fn(engine(x), y))
        ref_params = list(ref.parameters())
        gs = torch.autograd.grad(loss_fn(ref(x), y).float() / 2, ref_params)
        ref_grads.append({names[p]: g.float() for p, g in zip(ref_params, gs)})
        m.check_grad_io(wait=True)
        want_dtype = torch.bfloat16 if k == 0 else torch.float32
        checked = 0
        for g in m.groups():
            assert g.grad_on_nvme and m.grad_file_dtype(g) == want_dtype, (g.key, m.grad_file_dtype(g))
            got = torch.empty(g.shard_numel, dtype=torch.float32)
            m.read_grad_shard(g, got)
            for s in g.slots:
                name = next(n for n, p in model.named_parameters() if p is s.param)
                want = sum(r[name] for r in ref_grads).reshape(-1)  # fp32 sum of bf16 gradients
                assert torch.equal(got[s.offset:s.offset + s.numel], want), (k, name)
                checked += 1
        assert checked == len(names)
        if k == 0:
            engine.step()  # not a boundary: nothing happens
    # the summed values are not representable in bf16 everywhere: the fp32 file kept them
    total = torch.cat([sum(r[n] for r in ref_grads).reshape(-1) for n in names.values()])
    assert not torch.equal(total, total.to(torch.bfloat16).float())
    engine.step()
    engine.close()


@pytest.mark.parametrize("tiers", [("cpu", "cpu"), ("nvme", "nvme")])
def test_an_engine_dropped_without_close_is_collected(tmp_path, tiers):
    """The parameters' gradient hooks held the manager: torch keeps a tensor's hooks out of the
    cycle collector's sight, so an engine dropped without close() was never freed, with its
    partitions, I/O thread and locked buffers (helper-41, /tmp/tester25/t03_del_rss.py: 80 MB
    per dropped 3.2M-parameter engine, a thread and a descriptor each)."""
    import gc
    import threading
    import weakref

    def io_threads():
        return sum(t.name.startswith("zeroinf-stage3-io") for t in threading.enumerate())

    def train_and_drop():
        engine, *_ = zeroinf.initialize(model=TinyLM(), config=_config(*tiers, tmp_path))
        _run(engine, 2)
        engine.synchronize()  # a background step still running holds it until it ends
        return [weakref.ref(o) for o in (engine, engine.params.manager, engine.module)]
    gc.collect()
    threads0 = io_threads()
    for _ in range(3):
        refs = train_and_drop()
        gc.collect()
        assert [r() is None for r in refs] == [True] * 3
    deadline = time.monotonic() + 10  # an executor's worker leaves once its executor is gone, soon after
    while io_threads() != threads0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert io_threads() == threads0


def _locked_bytes() -> int:
    """VmLck of this process (bytes), read from /proc: the kernel's count, not the pool's."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmLck:"))


def test_close_releases_the_parameter_side(tmp_path):
    """engine.close() releases stage 3's own resources too: the locked staging buffers, the I/O
    thread and the manager (it once closed only the optimizer's, so every engine built in a
    process kept ~45 KB locked and a thread alive; found by the tester)."""
    import functools
    import gc
    import threading

    from zeroinf.runtime.stage3.manager import managers

    def io_threads():
        return sum(t.name.startswith("zeroinf-stage3-io") for t in threading.enumerate())

    gc.collect()
    locked0, threads0, managers0 = _locked_bytes(), io_threads(), len(managers())
    for k in range(3):
        engine, *_ = zeroinf.initialize(model=copy.deepcopy(TinyLM()), config=_config("nvme", "nvme", tmp_path))
        x, y = batch(k)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
        model, mgr = engine.module, engine.params.manager
        assert mgr.host.nbytes > 0 and io_threads() == threads0 + 1
        engine.close()
        engine.close()  # idempotent
        assert mgr not in managers() and io_threads() == threads0 and mgr.host.nbytes == 0
        with pytest.raises(RuntimeError, match="closed"):
            model(x)
        with pytest.raises(RuntimeError, match="closed"):  # gathers read the (gone) tiers too
            model.state_dict()
        with pytest.raises(RuntimeError, match="closed"):  # it yielded empty tensors
            with zeroinf.gathered_parameters(model.parameters()):
                pass
        calls = [functools.partial(engine, x), engine.step, functools.partial(engine.save_checkpoint, str(tmp_path / "ck")),
                 functools.partial(engine.load_checkpoint, str(tmp_path / "ck"))]
        for call in calls:
            with pytest.raises(RuntimeError, match="engine was closed"):
                call()
        assert not (tmp_path / "ck").exists()
        del engine, model, mgr, calls, call
        gc.collect()
    assert len(managers()) == managers0
    assert _locked_bytes() <= locked0


@pytest.mark.filterwarnings("ignore:zeroinf stage 3. unit order differs")  # the forward the hook broke off
@pytest.mark.parametrize("in_backward", [False, True])
def test_empty_partition_cache_frees_read_ahead_and_scratch_and_training_goes_on(tmp_path, in_backward):
    """DeepSpeed's engine.empty_partition_cache(): between steps it frees the read-ahead NVMe
    partitions and the recycled scratch buffers; the steps after it still equal AdamW. Inside a
    forward, or with a forward's graph waiting for its backward, it raises and changes nothing."""
    ref = TinyLM()
    model = copy.deepcopy(ref)
    cfg = _config("nvme", "cpu", tmp_path)
    cfg["zero_optimization"]["offload_param"]["buffer_count"] = 8
    cfg["zeroinf"] = {"optimizer_in_backward": in_backward}
    engine, *_ = zeroinf.initialize(model=model, config=cfg)
    manager = engine.params.manager
    got = _run(engine, 2)
    engine.synchronize()
    staged, scratch = len(manager._staged), manager.host.free_bytes
    assert staged > 0 and scratch > 0, (staged, scratch)  # else this test shows nothing
    x, y = batch(3)
    out = engine(x)
    with pytest.raises(RuntimeError, match="graph alive"):
        engine.empty_partition_cache()
    engine.backward(loss_fn(out, y))
    engine.step()
    got.append(loss_fn(out, y).item())

    hook = model.blocks[0].register_forward_hook(lambda *_: engine.empty_partition_cache())
    with pytest.raises(RuntimeError, match="during a forward"):
        engine(x)
    hook.remove()
    engine.synchronize()
    freed = engine.empty_partition_cache()
    assert freed > 0 and not manager._staged and manager.host.free_bytes == 0
    assert manager.stats_dict()["live_now"] == 0
    got += _run(engine, 2, start=4)
    _assert_like_reference(engine, ref, got, _reference(ref, 5))
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.empty_partition_cache()


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_a_frozen_model_runs_at_stage_3_with_or_without_an_optimizer(tmp_path, with_optimizer):
    """A model with no trainable parameter (an RLHF reference, a distillation teacher) runs
    partitioned on NVMe: with the optimizer on NVMe too, initialize raised "max() arg is an
    empty sequence", and a config without an optimizer was refused, where DeepSpeed takes both
    (tester-40 F4). Stages 0-2 run it too (tester-46 F4a; test_engine_setup.py's
    test_a_frozen_model_runs_at_stages_0_to_2)."""
    torch.manual_seed(0)
    ref = TinyLM().requires_grad_(False)
    cfg = _config("nvme", "nvme", tmp_path)
    if not with_optimizer:
        del cfg["optimizer"]
    engine, *_ = zeroinf.initialize(model=copy.deepcopy(ref), config=cfg)
    x = batch(0)[0]
    with torch.no_grad():
        for _ in range(2):
            assert (engine(x) - ref(x)).abs().max().item() <= 1e-6
    engine.close()
