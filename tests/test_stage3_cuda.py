"""Stage 3's host<->device copies on side streams ([Note: CUDA streams] in stage3/reads.py).

* On the CPU (always run): the manager takes the no-op path (no ``torch.cuda`` stream or event
  call), and the CUDA path's hand-off protocol runs with stand-in streams and events (plain
  copies), so its order of waits, copies and buffer releases is checked without a GPU. Without
  a GPU the GPU tests' engine run (``_train_engine``) runs on the CPU against AdamW too.
* On a GPU (skipped without one; bench/gpu_check.sh runs them): 3 engine steps with parameters
  and optimizer on NVMe equal torch.optim.AdamW on the GPU within fp32 1e-5; steps 2-3 under
  ``torch.cuda.set_sync_debug_mode("error")``; the copies run on the manager's named streams.
"""
from __future__ import annotations

import copy
import threading

import pytest
import torch

from zeroinf.runtime.stage3 import Stage3Options, Stage3ParameterManager
from zeroinf.runtime.streams import CudaTransfers, HostTransfers, transfers_for

from stage3_models import TinyLM, batch, full_params, loss_fn

HAS_CUDA = torch.version.cuda is not None and torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA,
    reason=f"needs a CUDA GPU and a CUDA build of torch (torch {torch.__version__}, "
           f"torch.version.cuda={torch.version.cuda}, cuda available={torch.cuda.is_available()})")

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.01


def _opts(tier, tmp_path, **kw):
    kw.setdefault("param_persistence_threshold", 0)
    if tier == "nvme":
        kw.update(nvme_path=str(tmp_path), buffer_count=4, buffer_size=4096, max_in_cpu=0)
    return Stage3Options(offload_param_device=tier, **kw)


def _grads_of(mgr):
    out = {}
    for g in mgr.groups():
        gs = torch.empty(g.shard_numel)
        mgr.read_grad_shard(g, gs)
        for s in g.slots:
            out[s.name] = gs[s.offset:s.offset + s.numel].view(s.shape).clone()
    return out


def _max_err(got, want):
    return max((got[n].cpu() - w.detach().cpu()).abs().max().item() for n, w in want.items())


# ---- CPU: the no-op path ------------------------------------------------------------------------

def test_transfers_for_picks_the_host_implementation_on_cpu():
    t = transfers_for(torch.device("cpu"))
    assert isinstance(t, HostTransfers) and not t.side_streams
    assert t.h2d_stream is None and t.d2h_stream is None
    with pytest.raises(ValueError, match="must be a CUDA device, got cpu"):
        CudaTransfers(torch.device("cpu"))


@pytest.mark.parametrize("tier", ["none", "cpu", "nvme"])
def test_cpu_manager_calls_no_cuda_stream_or_event(tier, tmp_path, monkeypatch):
    def forbidden(name):
        def fail(*a, **k):
            raise AssertionError(f"torch.cuda.{name} called on a CPU run")
        return fail

    for name in ("Stream", "Event", "stream", "current_stream", "synchronize", "set_sync_debug_mode"):
        monkeypatch.setattr(torch.cuda, name, forbidden(name))
    monkeypatch.setattr(torch.Tensor, "record_stream", forbidden("Tensor.record_stream"))
    ref = TinyLM()
    model = copy.deepcopy(ref)
    mgr = Stage3ParameterManager(model, _opts(tier, tmp_path, grads_on_nvme=tier == "nvme"), device="cpu")
    assert isinstance(mgr.transfers, HostTransfers)
    assert mgr.h2d_stream is None and mgr.d2h_stream is None
    for it in range(2):
        x, y = batch(it)
        loss_fn(model(x), y).backward()
        loss_fn(ref(x), y).backward()
    assert _max_err(_grads_of(mgr), {n: p.grad for n, p in ref.named_parameters()}) <= 1e-6
    mgr.close()


# ---- CPU: the CUDA path with stand-in streams and events ----------------------------------------

class _FakeEvent:
    def __init__(self, log):
        self.log, self.stream, self.synced, self.stream_waited = log, None, False, False

    def record(self, stream=None):
        self.stream = stream
        self.log.append(("record", stream.name, self))

    def synchronize(self):
        self.synced = True
        self.log.append(("host_wait", None, self))

    def query(self):
        return self.synced


class _FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, ev):
        assert ev.stream is not None, "a stream waits on an event that was never recorded"
        if self.name == "compute":
            ev.stream_waited = True
        self.log.append(("wait_event", self.name, ev))

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))


class _FakeCuda:
    """The ``torch.cuda`` names CudaTransfers uses; current streams are per thread, as in torch."""

    def __init__(self):
        self.log = []
        self.compute = _FakeStream("compute", self.log)
        self._made = iter(["h2d", "d2h"])
        self._tls = threading.local()

    def Stream(self, device=None):  # noqa: N802 - torch's name
        return _FakeStream(next(self._made), self.log)

    def Event(self):  # noqa: N802
        return _FakeEvent(self.log)

    def current_stream(self, device=None):
        return getattr(self._tls, "stream", self.compute)

    def stream(self, s):
        fake = self

        class _Ctx:
            def __enter__(self):
                self.prev = fake.current_stream()
                fake._tls.stream = s

            def __exit__(self, *exc):
                fake._tls.stream = self.prev

        return _Ctx()

    def device(self, d):
        import contextlib
        return contextlib.nullcontext()


class _RecordingTransfers(CudaTransfers):
    """CudaTransfers over _FakeCuda; logs each copy with the stream current when it ran."""

    def __init__(self):
        self.fake = _FakeCuda()
        super().__init__(torch.device("cuda"), api=self.fake)
        self.h2d_calls, self.d2h_calls, self.kept = [], [], []

    def _keep_alive(self, t, stream):
        self.kept.append((stream.name, self.fake.current_stream().name))

    def h2d(self, copies, after):
        ready = super().h2d(copies, after)
        self.h2d_calls.append(dict(after=after, ready=ready, thread=threading.current_thread().name,
                                   srcs=[src.data_ptr() for _, src in copies]))
        return ready

    def d2h(self, dst, src, **kw):
        assert dst.dtype == torch.float32 and dst.device.type == "cpu"
        ready = super().d2h(dst, src, **kw)
        self.d2h_calls.append(ready)
        return ready


@pytest.mark.parametrize("tier,grads_on_nvme", [("nvme", False), ("nvme", True), ("cpu", False)],
                         ids=["nvme", "nvme-grads-on-nvme", "cpu"])
def test_cuda_path_hand_offs_with_stand_in_streams(tier, grads_on_nvme, tmp_path):
    """The CUDA branch on CPU tensors: same numbers as the CPU path, and the protocol of
    [Note: CUDA streams]: the H2D stream waits for the allocation event; staging buffers go back
    to the pool only after their copy's event; the compute stream waits for every gather's copy;
    every gradient copy runs on the D2H stream and has landed by the end of the backward."""
    ref = TinyLM()
    model = copy.deepcopy(ref)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = Stage3ParameterManager(copy.deepcopy(ref), _opts(tier, tmp_path / "a", grads_on_nvme=grads_on_nvme),
                                   device="cpu")
    mgr = Stage3ParameterManager(model, _opts(tier, tmp_path / "b", grads_on_nvme=grads_on_nvme), device="cpu")
    rec = mgr.transfers = _RecordingTransfers()
    assert mgr.h2d_stream.name == "h2d" and mgr.d2h_stream.name == "d2h"
    if tier == "nvme":
        release = mgr._pool.release

        def checked_release(buf):
            lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
            for call in rec.h2d_calls:
                if any(lo <= p < hi for p in call["srcs"]):
                    assert call["ready"].synced, "a staging buffer went back to the pool before its H2D copy"
            release(buf)
        mgr._pool.release = checked_release
    for it in range(2):
        x, y = batch(it)
        loss_fn(model(x), y).backward()
        loss_fn(plain.module(x), y).backward()
        assert all(ev.synced for ev in rec.d2h_calls) or grads_on_nvme
    mgr.check_grad_io(wait=True)
    assert torch.equal(torch.cat([t.reshape(-1) for t in _grads_of(mgr).values()]),
                       torch.cat([t.reshape(-1) for t in _grads_of(plain).values()]))
    assert rec.h2d_calls and rec.d2h_calls
    for call in rec.h2d_calls:
        assert call["after"] is not None and call["after"].stream.name == "compute"
        assert call["ready"].stream.name == "h2d"
        # every gather here is used (no prefetch is dropped), so the compute stream waited for each
        assert call["ready"].stream_waited, "the compute stream did not wait for a gather's copy"
        if tier == "nvme":
            assert call["thread"].startswith("zeroinf-stage3-io")
    log = rec.fake.log
    for call in rec.h2d_calls:  # the H2D stream waited for the allocation before the copy's event
        i = log.index(("record", "h2d", call["ready"]))
        assert ("wait_event", "h2d", call["after"]) in log[:i]
    assert all(ev.synced for ev in rec.d2h_calls), "a gradient shard was used before its D2H copy landed"
    assert ("wait_stream", "d2h", "compute") in log
    assert set(rec.kept) == {("h2d", "h2d"), ("d2h", "d2h")}  # record_stream'ed on the copy's stream
    mgr.close()
    plain.close()


# ---- on a GPU -----------------------------------------------------------------------------------

def _train_engine(tmp_path, steps, sync_check=False, device="cuda"):
    """TinyLM through ``zeroinf.initialize`` on ``device`` (the manager's compute device: CUDA
    when available), parameters and optimizer state on NVMe, beside torch.optim.AdamW on a plain
    copy on ``device``; returns (engine, losses, reference model, reference losses). Under
    ``sync_check`` steps 2.. run under sync debug mode "error" up to the end of their optimizer
    step (``engine.synchronize()``: the step overlaps the next forward by default)."""
    import zeroinf

    model = TinyLM()
    ref = copy.deepcopy(model).to(device)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                        "weight_decay": WD}},
              "zero_optimization": {
                  "stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 1000,
                  "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "param"), "buffer_count": 4,
                                    "buffer_size": 4096, "max_in_cpu": 0},
                  "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "opt")}}}
    engine, *_ = zeroinf.initialize(model=model, config=config)
    assert engine.params.manager.device.type == torch.device(device).type
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    on_cuda = torch.device(device).type == "cuda"
    losses, ref_losses = [], []
    for step in range(1, steps + 1):
        x, y = (t.to(device) for t in batch(100 + step))
        if on_cuda:
            torch.cuda.synchronize()
        if sync_check and step > 1:  # step 1 records the trace, pins buffers, builds the Adam op
            torch.cuda.set_sync_debug_mode("error")
        try:
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            if sync_check:
                engine.synchronize()
        finally:
            if on_cuda:
                torch.cuda.set_sync_debug_mode("default")
        losses.append(loss.item())
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    engine.synchronize()
    return engine, losses, ref, ref_losses


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(),
                                                 reason="the engine computes on the GPU when there is one")),
    pytest.param("cuda", marks=needs_cuda)])
def test_three_steps_nvme_equal_adamw_on_the_same_device(tmp_path, device):
    engine, losses, ref, ref_losses = _train_engine(tmp_path, 3, device=device)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    assert _max_err(full_params(engine.params.manager), dict(ref.named_parameters())) <= 1e-5
    engine.close()


@needs_cuda
def test_steps_two_and_three_do_not_synchronise_the_device(tmp_path):
    """Forward, backward and the engine's step (CPU Adam over the NVMe sub-groups) under sync
    debug mode "error" (any synchronising CUDA call raises, on any thread). The batch is 10 tokens:
    an embedding backward over more than 3072 indices takes torch's sort-based kernel, which reads
    a count to the host."""
    engine, losses, ref, ref_losses = _train_engine(tmp_path, 3, sync_check=True)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    engine.close()


@needs_cuda
@pytest.mark.parametrize("grads_on_nvme", [False, True], ids=["grad-shard", "grads-on-nvme"])
def test_copies_run_on_the_managers_named_streams(grads_on_nvme, tmp_path, monkeypatch):
    model = TinyLM().cuda()
    mgr = Stage3ParameterManager(model, _opts("nvme", tmp_path, grads_on_nvme=grads_on_nvme),
                                 device=torch.device("cuda"))
    assert isinstance(mgr.h2d_stream, torch.cuda.Stream) and isinstance(mgr.d2h_stream, torch.cuda.Stream)
    assert mgr.h2d_stream != mgr.d2h_stream != torch.cuda.current_stream()
    seen = []
    original = torch.Tensor.copy_

    def spy(dst, src, non_blocking=False):
        if dst.device.type != src.device.type:
            seen.append(("h2d" if dst.is_cuda else "d2h", torch.cuda.current_stream(), non_blocking,
                         (src if dst.is_cuda else dst).is_pinned(), threading.current_thread().name))
        return original(dst, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    x, y = (t.cuda() for t in batch(0))
    loss_fn(model(x), y).backward()
    mgr.check_grad_io(wait=True)
    monkeypatch.undo()
    h2d = [s for s in seen if s[0] == "h2d"]
    d2h = [s for s in seen if s[0] == "d2h"]
    assert h2d and d2h
    assert all(s[1] == mgr.h2d_stream and s[2] and s[3] and s[4].startswith("zeroinf-stage3-io") for s in h2d), h2d
    assert all(s[1] == mgr.d2h_stream and s[2] and s[3] for s in d2h), d2h
    mgr.close()


@needs_cuda
def test_h2d_waits_for_the_compute_stream_event():
    """The H2D stream waits for ``after``: while the compute stream sleeps, the copy has not run."""
    t = transfers_for(torch.device("cuda"))
    src = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    dst = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles on the compute stream
    after = t.mark()
    ready = t.h2d([(dst, src)], after)
    assert not ready.query(), "the copy completed before the compute stream reached its event"
    t.host_wait(ready)
    assert torch.equal(dst.cpu(), src)
    out = torch.empty(1 << 20, dtype=torch.float32).pin_memory()
    t.host_wait(t.d2h(out, dst.to(torch.bfloat16)))
    assert torch.equal(out, src.to(torch.bfloat16).float())
