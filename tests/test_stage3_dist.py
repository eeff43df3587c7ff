"""Stage 3 through the engine on 2 ranks (gloo, spawned here) equals plain PyTorch on the
combined batch: losses, global gradient norm, parameters (1e-6), one reduction per unit."""
import copy
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stage3_models import TinyLM, batch, loss_fn
from zeroinf.runtime.engine import destroy_process_group

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.01


def _clamp_before_forward(module, args):
    """A max-norm style constraint: the forward clamps the module's weight in place."""
    with torch.no_grad():
        module.weight.clamp_(-0.1, 0.1)


def _worker(rank, world, tmp, param_tier, in_backward=False, clamp=False):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world)
    try:
        import zeroinf

        torch.manual_seed(0)
        ref = TinyLM(tied=True)
        model = copy.deepcopy(ref)
        if clamp:  # the same change on every rank: each keeps its shard's part of it
            for m in (ref, model):
                m.blocks[1].ff[0].register_forward_pre_hook(_clamp_before_forward)
                m.norm.register_forward_pre_hook(_clamp_before_forward)  # persistent (20 elements)
        off = {"device": param_tier}
        if param_tier == "nvme":
            off.update(nvme_path=tmp, buffer_size=4096, buffer_count=4, max_in_cpu=0)
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
               "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}},
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 20, "sub_group_size": 700,
                                     "stage3_prefetch_bucket_size": 2200, "stage3_max_reuse_distance": 0,
                                     "offload_param": off, "offload_optimizer": {"device": "cpu"}},
               "zeroinf": {"optimizer_in_backward": in_backward}}
        engine, *_ = zeroinf.initialize(model=model, config=cfg)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
        loss_err, norm_err = 0.0, 0.0
        for step in range(1, 4):
            x, y = batch(step, b=4)
            half = slice(rank * 2, rank * 2 + 2)
            loss = loss_fn(engine(x[half]), y[half])
            engine.backward(loss)
            engine.step()
            ref_loss = loss_fn(ref(x), y)
            ref_loss.backward()
            both = torch.tensor([loss.item()])
            dist.all_reduce(both)
            loss_err = max(loss_err, abs(both.item() / world - ref_loss.item()))
            ref_norm = torch.norm(torch.stack([p.grad.norm() for p in ref.parameters()])).item()
            norm_err = max(norm_err, abs(engine.get_global_grad_norm() - ref_norm))
            ref_opt.step()
            ref_opt.zero_grad()
        sd = engine.module.state_dict()  # collective: gathers every partition
        param_err = max((sd[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())
        mgr = engine.params.manager
        if rank == 0:
            with open(os.path.join(tmp, "result.json"), "w") as f:
                json.dump({"loss": loss_err, "norm": norm_err, "param": param_err,
                           "reduces": mgr.last_reduce_counts, "bytes_allgather": mgr.stats_dict()["bytes_allgather"]}, f)
        engine.close()
        destroy_process_group()  # with its closing barrier (see its docstring)
    finally:
        destroy_process_group(barrier=False)


@pytest.mark.parametrize("param_tier,in_backward,clamp", [("nvme", False, False), ("nvme", True, False),
                                                          ("cpu", True, True)])
def test_two_ranks_equal_plain_pytorch(tmp_path, param_tier, in_backward, clamp):
    """``in_backward``: zeroinf.optimizer_in_backward (each rank steps its partitions as the
    reductions land; the global norm is all-reduced at engine.step()); ``clamp``: forwards clamp
    a block's and the final norm's weights in place, which is kept on both ranks."""
    mp.spawn(_worker, args=(2, str(tmp_path), param_tier, in_backward, clamp), nprocs=2, join=True)
    res = json.loads((tmp_path / "result.json").read_text())
    # the mean of two half-batch means vs one mean of the batch: a few float32 ulps of a loss of ~3.6
    assert res["loss"] <= 4e-6 and res["norm"] <= 1e-5, res
    assert res["param"] <= 1e-6, res
    assert set(res["reduces"].values()) == {1}, res
    assert res["bytes_allgather"] > 0


def _late_rank_worker(rank, world, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world)
    try:
        import time
        import warnings

        import zeroinf
        from zeroinf import waits

        waits.WARN_AFTER_S = 1.0
        torch.manual_seed(0)
        model = TinyLM(tied=True)
        cfg = {"train_micro_batch_size_per_gpu": 2,
               "optimizer": {"type": "AdamW", "params": {"lr": LR}},
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 20,
                                     "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}
        engine, *_ = zeroinf.initialize(model=model, config=cfg)

        def gathered():
            with zeroinf.gathered_parameters(model.parameters()):
                pass
        calls = {"state_dict": lambda: model.state_dict(), "gathered_parameters": gathered,
                 "save_checkpoint": lambda: engine.save_checkpoint(os.path.join(tmp, "ckpt"), tag="t")}
        seen = {}
        for name, call in calls.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if rank == 1:
                    time.sleep(2.5)  # rank 0 waits for it inside the collective
                call()
            seen[name] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        with open(os.path.join(tmp, f"late{rank}.json"), "w") as f:
            json.dump(seen, f)
        engine.close()
        destroy_process_group()
    finally:
        destroy_process_group(barrier=False)


def test_a_rank_waiting_in_a_collective_the_others_are_late_to_says_so(tmp_path):
    """``if rank == 0: torch.save(model.state_dict(), ...)`` waits until the process group's
    timeout with nothing on the screen; zeroinf warns after ``waits.WARN_AFTER_S`` that the
    call is a collective (here 1 s, with rank 1 2.5 s late to each call), and the call still
    completes once the late rank arrives. The rank that was not kept waiting warns nothing."""
    mp.spawn(_late_rank_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    early = json.loads((tmp_path / "late0.json").read_text())
    late = json.loads((tmp_path / "late1.json").read_text())
    for name in ("state_dict", "gathered_parameters", "save_checkpoint"):
        assert len(early[name]) == 1, (name, early)
        assert "rank 0 has waited 1 s in" in early[name][0] and "every rank must make this call" in early[name][0]
        assert late[name] == [], (name, late)
    assert "TinyLM.state_dict()" in early["state_dict"][0]
    assert "zeroinf.gathered_parameters" in early["gathered_parameters"][0]
    assert early["save_checkpoint"][0].split(" in ")[1].startswith("save_checkpoint")
    assert (tmp_path / "ckpt" / "t").is_dir()
