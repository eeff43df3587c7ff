"""Two ranks (gloo, spawned here) against one process on the combined batch.

One spawn runs every scenario, to pay the process start-up once. Each rank checks its own
numbers against a plain-PyTorch reference it computes itself; an assertion in a rank fails the test
with that rank's traceback.
"""
import math
import os
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import zeroinf
from engine_helpers import batches, config, make_mlp, max_diff, reference
from zeroinf.runtime.engine import destroy_process_group

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_shard(engine, X, Y, steps, rank, gas=1):
    """Rank ``rank`` trains on its half of every batch (micro-batch 2 of 4)."""
    for s in range(steps):
        for k in range(gas):
            i = s * gas + k
            engine.backward(F.mse_loss(engine(X[i][2 * rank:2 * rank + 2]), Y[i][2 * rank:2 * rank + 2]))
            engine.step()


def _same_on_all_ranks(model) -> bool:
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    others = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(others, flat)
    return all(torch.equal(o, others[0]) for o in others)


def _cfg(stage, device, tmp, **extra):
    cfg = config(stage, device, tmp, **extra)
    cfg["train_micro_batch_size_per_gpu"] = 2
    return cfg


def _worker(rank: int, port: int, tmp: str) -> None:
    # as torchrun would set them: zeroinf.initialize creates the (gloo) process group itself
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        X, Y = batches(4)
        # 1. stages 0/1/2 with CPU or NVMe optimizer state equal one process on the combined batch
        ref = make_mlp()
        ref_norms, _ = reference(ref, X, Y, 3)
        for stage, device, rs in ((0, "cpu", True), (1, "cpu", True), (2, "cpu", True), (2, "nvme", True),
                                  (2, "cpu", False)):
            model = make_mlp()
            nvme = os.path.join(tmp, f"nvme_{stage}")
            os.makedirs(nvme, exist_ok=True)
            cfg = _cfg(stage, device, nvme)
            cfg["zero_optimization"]["reduce_scatter"] = rs
            engine, *_ = zeroinf.initialize(model, config=cfg)
            assert dist.is_initialized() and dist.get_backend() == "gloo"
            assert engine.config.train_batch_size == 4 and (engine.rank, engine.world_size) == (rank, WORLD)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                _train_shard(engine, X, Y, 3, rank)
            # torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor, warning at each call
            ours = [str(w.message) for w in caught if issubclass(w.category, FutureWarning) and "zeroinf" in w.filename]
            assert not ours, ours
            assert max_diff(model, ref) <= 1e-6, (stage, device, rank, max_diff(model, ref))
            assert engine.get_global_grad_norm() == pytest.approx(ref_norms[-1], rel=1e-6), (stage, device)
            assert _same_on_all_ranks(model)
            engine.close()

        # 2. clipping with the global norm over both partitions, for norm 2 and inf
        for norm_type in (2.0, math.inf):
            ref = make_mlp()
            ref_norms, _ = reference(ref, X, Y, 3, clip=0.05, norm_type=norm_type)
            model = make_mlp()
            extra = {"gradient_clipping": 0.05, "zeroinf": {"grad_norm_type": "inf" if norm_type == math.inf else 2}}
            engine, *_ = zeroinf.initialize(model, config=_cfg(2, "cpu", tmp, **extra))
            norms = []
            for s in range(3):
                _train_shard(engine, X[s:s + 1], Y[s:s + 1], 1, rank)
                norms.append(engine.get_global_grad_norm())
            assert norms == pytest.approx(ref_norms, rel=1e-6), (norm_type, norms, ref_norms)
            assert max_diff(model, ref) <= 1e-6 and _same_on_all_ranks(model)

        # 3. fp16: an inf gradient on rank 1 only skips the step on both ranks and lowers the scale
        model = make_mlp()
        fp16 = {"enabled": True, "initial_scale_power": 6, "hysteresis": 1}
        engine, *_ = zeroinf.initialize(model, config=_cfg(1, "cpu", tmp, fp16=fp16))
        before = [p.detach().clone() for p in model.parameters()]
        x = X[0][2 * rank:2 * rank + 2].half().clone()
        if rank == 1:
            x[0, 0] = float("inf")
        engine.backward(F.mse_loss(engine(x), Y[0][2 * rank:2 * rank + 2].half()))
        engine.step()
        assert engine.skipped_steps == 1 and engine.loss_scale == 32.0 and engine.optimizer_steps == 0
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

        # 4. both ranks save the same tag at once (twice), then resume bit-exactly
        ckdir = os.path.join(tmp, "ckpt")
        model = make_mlp()
        engine, *_ = zeroinf.initialize(model, config=_cfg(2, "cpu", tmp))
        _train_shard(engine, X, Y, 2, rank)
        engine.save_checkpoint(ckdir, "two")
        engine.save_checkpoint(ckdir, "two")
        _train_shard(engine, X[2:], Y[2:], 2, rank)
        want = [p.detach().clone() for p in model.parameters()]
        model2 = make_mlp(seed=9)
        engine2, *_ = zeroinf.initialize(model2, config=_cfg(2, "cpu", tmp))
        _, client = engine2.load_checkpoint(ckdir)  # via the "latest" file
        assert engine2.optimizer_steps == 2 and client == {}
        _train_shard(engine2, X[2:], Y[2:], 2, rank)
        assert all(torch.equal(a, b) for a, b in zip(want, model2.parameters()))
        if rank == 0:
            sd = zeroinf.checkpoint.consolidate(ckdir, "two", os.path.join(tmp, "full.pt"))
            ref = make_mlp()
            reference(ref, X, Y, 2)
            plain = make_mlp(seed=5)
            plain.load_state_dict(torch.load(os.path.join(tmp, "full.pt"), weights_only=True))
            assert max_diff(plain, ref) <= 1e-6 and set(sd) == set(ref.state_dict())
        # the weights alone (DeepSpeed's load_module_only) into a stage-3 engine: every rank reads every rank's files
        model4 = make_mlp(seed=9)
        engine4, *_ = zeroinf.initialize(model4, config=_cfg(3, "cpu", tmp))
        engine4.load_checkpoint(ckdir, "two", load_module_only=True)
        full = zeroinf.checkpoint.consolidate(ckdir, "two", os.path.join(tmp, f"full{rank}.pt"))
        assert engine4.global_steps == 0 and all(torch.equal(v, full[k]) for k, v in model4.state_dict().items())

        # 5. no_sync: the micro-batches inside keep their gradients local; the backward after the
        # block (or the step, when every micro-batch was inside) reduces their sum once
        X6, Y6 = batches(6, seed=4)
        ref = make_mlp()
        reference(ref, X6, Y6, 3, gas=2)
        for stage, inside in ((0, "first"), (1, "first"), (2, "first"), (2, "both")):
            model = make_mlp()
            engine, *_ = zeroinf.initialize(model, config=_cfg(stage, "cpu", tmp, gradient_accumulation_steps=2))
            comm = []
            for s in range(3):
                for k in range(2):
                    i = s * 2 + k
                    loss = F.mse_loss(engine(X6[i][2 * rank:2 * rank + 2]), Y6[i][2 * rank:2 * rank + 2])
                    if k == 0 or inside == "both":
                        with engine.no_sync():
                            engine.backward(loss)
                    else:
                        engine.backward(loss)
                    engine.step()
                comm.append(engine.stats()["comm_elements"])
            assert max_diff(model, ref) <= 1e-6, (stage, inside, max_diff(model, ref))
            assert _same_on_all_ranks(model)
            # one reduction per step, not two: the flat buffer (padded to the ranks) once
            assert comm == [sum(g.part_numel for g in engine.params.groups) * engine.params.nparts] * 3, (stage, comm)
            engine.close()

        # 6. different tags on the ranks: "warn" (the default) saves and loads rank 0's tag on
        # every rank; "fail" raises on both before anything is written
        ckdir = os.path.join(tmp, "tags")
        model = make_mlp()
        engine, *_ = zeroinf.initialize(model, config=_cfg(1, "cpu", tmp))
        _train_shard(engine, X, Y, 1, rank)
        engine.save_checkpoint(ckdir, f"t{rank}")
        dist.barrier()
        assert sorted(os.listdir(ckdir)) == ["latest", "t0"], os.listdir(ckdir)
        want = [p.detach().clone() for p in model.parameters()]
        model2 = make_mlp(seed=9)
        engine2, *_ = zeroinf.initialize(model2, config=_cfg(1, "cpu", tmp))
        engine2.load_checkpoint(ckdir, "t0" if rank == 0 else "elsewhere")
        assert all(torch.equal(a, b) for a, b in zip(want, model2.parameters()))
        model3 = make_mlp()
        engine3, *_ = zeroinf.initialize(model3, config=_cfg(1, "cpu", tmp, checkpoint={"tag_validation": "Fail"}))
        with pytest.raises(ValueError, match="different tags.*rank 0: 'f0', rank 1: 'f1'"):
            engine3.save_checkpoint(ckdir, f"f{rank}")
        with pytest.raises(ValueError, match="different tags"):
            engine3.load_checkpoint(ckdir, "t0" if rank == 0 else "t1")
        dist.barrier()
        assert sorted(os.listdir(ckdir)) == ["latest", "t0"], os.listdir(ckdir)
        destroy_process_group()  # with its closing barrier (see its docstring)
    finally:
        destroy_process_group(barrier=False)


def test_two_ranks_equal_one_rank(tmp_path):
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    # the two ranks' checkpoint on one rank: the whole state is refused (its partitions are two
    # ranks'), the weights alone load
    engine, *_ = zeroinf.initialize(make_mlp(seed=9), config=config(2, "cpu", tmp_path))
    with pytest.raises(zeroinf.checkpoint.CheckpointError, match="saved with world size 2"):
        engine.load_checkpoint(str(tmp_path / "ckpt"), "two")
    engine.load_checkpoint(str(tmp_path / "ckpt"), "two", load_module_only=True)
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert all(torch.equal(v, full[k]) for k, v in engine.module.state_dict().items())
    engine.close()
