"""Checkpoints on two ranks (gloo, spawned here): stage-3 save and load without hanging, a bad file
on one rank refused on both, and one rank's failing write stopping both."""
import json
import os
import sys
import time

import pytest
import torch

import zeroinf
from zeroinf.checkpoint import CheckpointError
from zeroinf.runtime.engine import destroy_process_group
from checkpoint_helpers import _small_engine


def _stage3_worker(rank, world, tmp):
    """2 steps, save, 2 more steps (the reference); then a fresh engine on another init loads the
    save and takes the same 2 steps: its losses and module state must equal the reference's."""
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from stage3_models import TinyLM, batch, loss_fn

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world)
    try:
        cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 20, "sub_group_size": 700,
                                     "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}

        def steps(engine, a, b):
            out = []
            for s in range(a, b):
                x, y = batch(s, b=4)
                loss = loss_fn(engine(x[rank * 2:rank * 2 + 2]), y[rank * 2:rank * 2 + 2])
                engine.backward(loss)
                engine.step()
                out.append(loss.item())
            return out

        torch.manual_seed(0)
        engine, *_ = zeroinf.initialize(model=TinyLM(tied=True), config=cfg)
        steps(engine, 0, 2)
        engine.save_checkpoint(os.path.join(tmp, "ck"), "s2")
        ref_losses = steps(engine, 2, 4)
        ref_sd = engine.module.state_dict()
        engine.close()
        torch.manual_seed(7)  # another init: everything must come from the checkpoint
        engine, *_ = zeroinf.initialize(model=TinyLM(tied=True), config=cfg)
        engine.load_checkpoint(os.path.join(tmp, "ck"))
        losses = steps(engine, 2, 4)
        sd = engine.module.state_dict()
        # one rank's file is bad: every rank refuses the load and nothing changes on any of them
        if rank == 1:
            rng = os.path.join(tmp, "ck", "s2", "rng_rank1.pt")
            os.truncate(rng, os.path.getsize(rng) // 2)
        dist.barrier()
        try:
            engine.load_checkpoint(os.path.join(tmp, "ck"))
            err = None
        except CheckpointError as exc:
            err = str(exc)
        after = engine.module.state_dict()
        with open(os.path.join(tmp, f"refused_rank{rank}.json"), "w") as f:
            json.dump({"err": err, "steps": engine.global_steps,
                       "unchanged": all(torch.equal(after[k], sd[k]) for k in sd)}, f)
        engine.close()
        if rank == 0:
            with open(os.path.join(tmp, "result.json"), "w") as f:
                json.dump({"losses": losses, "ref": ref_losses, "keys": sorted(sd) == sorted(ref_sd),
                           "equal": all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)}, f)
        destroy_process_group()  # with its closing barrier (see its docstring)
    finally:
        destroy_process_group(barrier=False)


def _run_two_ranks(worker, tmp_path, what: str, timeout_s: float = 90) -> None:
    """``worker(rank, 2, str(tmp_path))`` in 2 spawned processes; fails the test on a hang (past
    ``timeout_s``) or a worker's error, and kills what is left."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(worker, args=(2, str(tmp_path)), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"{what} did not finish in {timeout_s:.0f} s (hang)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def test_stage3_two_ranks_save_and_load_without_hanging(tmp_path):
    """Under stage 3 the module state dict is a collective; rank 0 building it alone deadlocked."""
    _run_two_ranks(_stage3_worker, tmp_path, "stage-3 save/load on 2 ranks")
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["keys"] and res["equal"], res
    assert res["losses"] == res["ref"], res
    ck = tmp_path / "ck" / "s2"
    assert {"model_states.pt", "rng_rank0.pt", "rng_rank1.pt"} <= set(os.listdir(ck))
    # rank 1's truncated file: rank 1 names it, rank 0 (whose files are fine) refuses as well
    # (it used to load everything and then fail in the barrier)
    refused = [json.loads((tmp_path / f"refused_rank{r}.json").read_text()) for r in (0, 1)]
    assert "rank(s) [1]" in refused[0]["err"] and "rng_rank1.pt: unreadable" in refused[1]["err"], refused
    assert all(r["unchanged"] and r["steps"] == 4 for r in refused), refused


def _failing_write_worker(rank, world, tmp):
    """Save tag 'a', then save it again with rank 1's writes failing (its file-size limit)."""
    import resource
    import signal

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world)
    try:
        engine, _ = _small_engine()
        x = torch.randn(4, 7)
        engine.backward(engine(x).square().mean())
        engine.step()
        engine.save_checkpoint(os.path.join(tmp, "ck"), "a")
        saved = [p.detach().clone() for p in engine.module.parameters()]
        engine.backward(engine(x).square().mean())
        engine.step()
        if rank == 1:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (600, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            engine.save_checkpoint(os.path.join(tmp, "ck"), "a")
            err = None
        except OSError as exc:
            err = str(exc)
        if rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        engine.load_checkpoint(os.path.join(tmp, "ck"))  # the earlier save, whole
        with open(os.path.join(tmp, f"write_rank{rank}.json"), "w") as f:
            json.dump({"err": err, "steps": engine.global_steps,
                       "equal": all(torch.equal(p, s) for p, s in zip(engine.module.parameters(), saved))}, f)
        destroy_process_group()
    finally:
        destroy_process_group(barrier=False)


def test_two_ranks_one_failing_write_stops_both_without_hanging(tmp_path):
    """Rank 1's failed write used to leave rank 0 waiting in the save's barrier until the
    process-group timeout; now both raise, and the earlier save of the tag stays whole."""
    _run_two_ranks(_failing_write_worker, tmp_path, "a save with one rank's write failing")
    res = [json.loads((tmp_path / f"write_rank{r}.json").read_text()) for r in (0, 1)]
    assert "rank(s) [1]" in res[0]["err"] and "writing the file failed" in res[1]["err"], res
    assert all(r["steps"] == 1 and r["equal"] for r in res), res
