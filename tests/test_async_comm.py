"""Stage 3's asynchronous collectives ([Note: all-gather ahead], [Note: asynchronous reductions]
in stage3/fetch.py and stage3/reduce.py).

* ``CudaTransfers.d2h`` with a collective's work (stand-in streams, one process): the D2H stream
  waits for the compute stream, then for the work with itself current, divides, copies, records.
* Two ranks (gloo, one spawn for every scenario; each rank checks its own numbers):
  1. with prefetch, all-gathers are launched ahead of use (``allgathers_ahead`` > 0) and the
     gradient partitions are bit-equal to the same manager without prefetch (every all-gather
     at use) and to plain PyTorch's per-rank gradients averaged with a synchronous all-reduce;
  2. a trace divergence leaves a unit with its all-gather in flight that is never used: it is
     released after waiting for the work (traced as unused), and the gradients stay right;
  3. the CUDA branch with stand-in streams: each reduction's work is waited for with the D2H
     stream current (never the compute stream), before the shard's copy; the numbers are
     bit-equal to the CPU branch;
  4. stages 1 and 2 (``FlatParamManager``, [Note: stage 1/2 transfers]): the CUDA branch with
     stand-in streams waits for every bucket's collective on the D2H stream and gives the CPU
     branch's gradients bit for bit (a copied and two accumulated micro-batches).
"""
from __future__ import annotations

import copy
import json
import os
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from stage3_models import TinyLM, batch, loss_fn
from test_stage3_cuda import _FakeCuda, _RecordingTransfers
from zeroinf.runtime import collectives
from zeroinf.runtime.engine import destroy_process_group
from zeroinf.runtime.stage3 import Stage3Options, Stage3ParameterManager

WORLD = 2


class _LoggedWork:
    """A collective's work handle that logs the stream current when it is waited for."""

    def __init__(self, work, fake: _FakeCuda, what: str):
        self.work, self.fake, self.what = work, fake, what

    def wait(self):
        self.fake.log.append(("work_wait", self.fake.current_stream().name, self))
        return self.work.wait()


class _LoggedCollectives:
    """Replaces ``dist.all_reduce`` and ``collectives.reduce_scatter_single`` by versions whose
    work handles log where they are waited for (``works``: every handle made)."""

    def __init__(self, fake: _FakeCuda):
        self.fake, self.works, self.saved = fake, [], {}

    def __enter__(self):
        for mod, name in ((dist, "all_reduce"), (collectives, "reduce_scatter_single")):
            fn = self.saved[mod, name] = getattr(mod, name)

            def logged(*a, fn=fn, name=name, **k):
                w = fn(*a, **k)
                if k.get("async_op"):
                    w = _LoggedWork(w, self.fake, name)
                    self.works.append(w)
                return w
            setattr(mod, name, logged)
        return self

    def __exit__(self, *exc):
        for (mod, name), fn in self.saved.items():
            setattr(mod, name, fn)

    def waited_on_d2h(self) -> bool:
        """Every work was waited for exactly once, with the D2H stream current, right after that
        stream waited for the compute stream."""
        log = self.fake.log
        waits = [(i, e) for i, e in enumerate(log) if e[0] == "work_wait"]
        return (bool(waits) and sorted(id(e[2]) for _, e in waits) == sorted(id(w) for w in self.works)
                and all(e[1] == "d2h" and log[i - 1] == ("wait_stream", "d2h", "compute") for i, e in waits))


def test_d2h_waits_for_the_collective_on_the_d2h_stream():
    t = _RecordingTransfers()
    log = t.fake.log

    class Work:
        def wait(self):
            log.append(("work_wait", t.fake.current_stream().name))

    src = torch.tensor([2.0, 4.0, 6.0], dtype=torch.bfloat16)
    full = torch.zeros(6)
    dst = torch.empty(3)
    ready = t.d2h(dst, src, work=Work(), divisor=2, keep=(full,))
    assert torch.equal(dst, torch.tensor([1.0, 2.0, 3.0]))
    assert log == [("wait_stream", "d2h", "compute"), ("work_wait", "d2h"), ("record", "d2h", ready)]
    assert t.kept == [("d2h", "d2h"), ("d2h", "d2h")]  # the shard and the collective's input
    assert t.fake.current_stream().name == "compute"  # the caller's stream is current again


def test_host_d2h_waits_divides_and_copies():
    from zeroinf.runtime.streams import HostTransfers

    waited = []

    class Work:
        def wait(self):
            waited.append(True)

    src, dst = torch.tensor([3.0, 5.0]), torch.empty(2)
    assert HostTransfers().d2h(dst, src, work=Work(), divisor=2) is None
    assert waited == [True] and torch.equal(dst, torch.tensor([1.5, 2.5]))


# ---- two ranks -----------------------------------------------------------------------------------

def _opts(tmp, bucket, tier="nvme"):
    kw = dict(param_persistence_threshold=0, prefetch_bucket_size=bucket, max_reuse_distance=0)
    if tier == "nvme":
        os.makedirs(tmp, exist_ok=True)
        kw.update(nvme_path=tmp, buffer_count=4, buffer_size=4096, max_in_cpu=0)
    return Stage3Options(offload_param_device=tier, **kw)


def _shards(mgr):
    """{group key: this rank's accumulated fp32 gradient partition}."""
    out = {}
    for g in mgr.groups():
        out[g.key] = torch.empty(g.shard_numel)
        mgr.read_grad_shard(g, out[g.key])
    return out


def _expected_shards(mgr, grads):
    """This rank's partitions of the plain model's gradients ``{name: tensor}``."""
    out = {}
    for g in mgr.groups():
        flat = torch.zeros(g.padded_numel)
        for s in g.slots:
            flat[s.offset:s.offset + s.numel] = grads[s.name].reshape(-1)
        out[g.key] = flat[mgr.rank * g.shard_numel:(mgr.rank + 1) * g.shard_numel]
    return out


def _run(model, mgr, rank, its, ref=None):
    """``its`` micro-batches on this rank's half of each batch (gradients accumulated); with
    ``ref``, the same on the plain model, whose gradients are averaged over ranks by a
    synchronous all-reduce per parameter and micro-batch and summed over micro-batches in fp32,
    in the manager's order (returned as ``{name: tensor}``)."""
    out = {}
    for it in its:
        x, y = batch(it, b=4)
        half = slice(2 * rank, 2 * rank + 2)
        loss_fn(model(x[half]), y[half]).backward()
        if ref is None:
            continue
        loss_fn(ref(x[half]), y[half]).backward()
        for n, p in ref.named_parameters():
            gsum = p.grad if p.grad is not None else torch.zeros_like(p)  # a skipped block
            dist.all_reduce(gsum)
            gsum /= WORLD
            out[n] = out[n] + gsum if n in out else gsum
            p.grad = None
    return out if ref is not None else None


def _equal(a, b):
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _worker(rank, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=WORLD)
    res = {}
    try:
        torch.manual_seed(0)
        base = TinyLM()
        # 1. all-gathers launched ahead; numbers as without prefetch and as plain PyTorch
        ref, model, sync_model = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
        mgr = Stage3ParameterManager(model, _opts(f"{tmp}/a{rank}", 5000), device="cpu")
        sync = Stage3ParameterManager(sync_model, _opts(f"{tmp}/b{rank}", 0), device="cpu")
        _run(model, mgr, rank, [0])  # records the trace
        mgr.zero_grad()
        _run(sync_model, sync, rank, [0])
        sync.zero_grad()
        want = _run(model, mgr, rank, [1, 2], ref=ref)  # two micro-batches: accumulation order
        _run(sync_model, sync, rank, [1, 2])
        got = _shards(mgr)
        res["ahead"] = mgr.stats_dict()["allgathers_ahead"]
        res["sync_ahead"] = sync.stats_dict()["totals"].get("allgathers_ahead", 0)
        res["equal_sync"] = _equal(got, _shards(sync))
        res["equal_plain"] = _equal(got, _expected_shards(mgr, want))
        res["prefetch_hits"] = mgr.stats_dict()["prefetch_hits"]
        sync.close()

        # 2. divergence: block 1 is all-gathered ahead, then skipped; released after its work
        mgr.zero_grad()
        model.order = ref.order = [0, 2, 3]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            want = _run(model, mgr, rank, [3], ref=ref)
        spans = [e for e in mgr.tracer.last if e["name"].startswith("all_gather blocks.")]
        res["unused"] = sorted(e["name"] for e in spans if not e["args"]["used"])
        res["invalidations"] = mgr.stats_dict()["invalidations"]
        res["equal_diverged"] = _equal(_shards(mgr), _expected_shards(mgr, want))
        res["live_after"] = mgr.live_numel
        mgr.close()

        # 3. the CUDA branch with stand-in streams: reductions waited for on the D2H stream
        ref, model, plain_model = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
        plain = Stage3ParameterManager(plain_model, _opts(None, 5000, "cpu"), device="cpu")
        mgr = Stage3ParameterManager(model, _opts(None, 5000, "cpu"), device="cpu")
        rec = mgr.transfers = _RecordingTransfers()
        with _LoggedCollectives(rec.fake) as coll:
            _run(model, mgr, rank, [4, 5])
        _run(plain_model, plain, rank, [4, 5])
        log = rec.fake.log
        res["reductions"] = len(coll.works)
        res["waited_on_d2h"] = coll.waited_on_d2h()
        # the next event each wait is followed by is its copy's, on the D2H stream
        res["wait_before_copy"] = all(
            next(x for x in log[i:] if x[0] == "record")[2] in rec.d2h_calls
            for i, e in enumerate(log) if e[0] == "work_wait")
        res["landed"] = all(ev.synced for ev in rec.d2h_calls)
        res["equal_cuda_branch"] = _equal(_shards(mgr), _shards(plain))
        mgr.close()
        plain.close()

        # 4. stages 1/2: the CUDA branch with stand-in streams against the CPU branch
        from engine_helpers import batches, make_mlp
        from zeroinf.runtime.flat import FlatParamManager

        X, Y = batches(3)
        for stage in (1, 2):
            models = [make_mlp(), make_mlp()]
            kw = dict(stage=stage, sub_group_size=33, reduce_bucket_size=30, rank=rank, world_size=WORLD)
            cpu = FlatParamManager([list(models[0].parameters())], **kw)
            rec = _RecordingTransfers()
            fm = FlatParamManager([list(models[1].parameters())], transfers=rec, **kw)
            cpu.zero_grad_acc()
            fm.zero_grad_acc()
            coll = _LoggedCollectives(rec.fake)
            for k in range(3):
                for model in models:
                    F.mse_loss(model(X[k][2 * rank:2 * rank + 2]), Y[k][2 * rank:2 * rank + 2]).backward()
                cpu.reduce_gradients()
                with coll:
                    fm.reduce_gradients()
            n = len(fm.sub_group_specs())
            res[f"flat{stage}_equal"] = torch.equal(torch.cat([fm.grad(i) for i in range(n)]),
                                                    torch.cat([cpu.grad(i) for i in range(n)]))
            res[f"flat{stage}_works"] = len(coll.works)
            res[f"flat{stage}_waited_on_d2h"] = coll.waited_on_d2h()
        with open(os.path.join(tmp, f"result{rank}.json"), "w") as f:
            json.dump(res, f)
        destroy_process_group()  # with its closing barrier (see its docstring)
    finally:
        destroy_process_group(barrier=False)


def test_two_ranks_collectives_ahead_and_async(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        res = json.loads((tmp_path / f"result{rank}.json").read_text())
        # 1.
        assert res["ahead"] > 0 and res["prefetch_hits"] > 0 and res["sync_ahead"] == 0, res
        assert res["equal_sync"] and res["equal_plain"], res
        # 2.
        assert res["invalidations"] >= 1 and res["unused"] == ["all_gather blocks.1"], res
        assert res["equal_diverged"] and res["live_after"] == 0, res
        # 3.
        assert res["reductions"] > 0 and res["waited_on_d2h"], res
        assert res["wait_before_copy"] and res["landed"] and res["equal_cuda_branch"], res
        # 4. (3 micro-batches x at least 2 buckets)
        for stage in (1, 2):
            assert res[f"flat{stage}_equal"] and res[f"flat{stage}_works"] >= 6, res
            assert res[f"flat{stage}_waited_on_d2h"], res
