"""Stages 1/2 (``FlatParamManager``) with CUDA side streams ([Note: stage 1/2 transfers] in
runtime/flat.py).

* On the CPU (always run): the engine calls no ``torch.cuda`` stream or event function; the CUDA
  branch runs with stand-in streams and events (plain copies on CPU tensors): gradients bit-equal
  to the CPU branch over a copied and two accumulated micro-batches (small buckets and staging
  pieces, so every path splits), each copy on the D2H stream after it waited for the compute
  stream, the first micro-batch copied straight into ``grad_acc``, a staging buffer reused only
  after its previous copy landed, nothing read before it landed; parameters written to the pinned
  host copy go to the device on the H2D stream after the compute stream's event, the compute
  stream waits for them, and the next step waits (host) for that copy before writing again.
* On a GPU (skipped without one; bench/gpu_check.sh runs them): stage 2 with the optimizer on the
  CPU equals torch.optim.AdamW on the GPU over 3 steps of 2 micro-batches, and steps 2-3 run
  under ``torch.cuda.set_sync_debug_mode("error")``.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import zeroinf
from engine_helpers import batches, config, make_mlp, train
from test_stage3_cuda import _RecordingTransfers, needs_cuda
from zeroinf.runtime import flat
from zeroinf.runtime.flat import FlatParamManager
from zeroinf.runtime.streams import HostTransfers


def test_cpu_engine_calls_no_cuda_stream_or_event(tmp_path, monkeypatch):
    def forbidden(name):
        def fail(*a, **k):
            raise AssertionError(f"torch.cuda.{name} called on a CPU run")
        return fail

    for name in ("Stream", "Event", "stream", "current_stream", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, forbidden(name))
    monkeypatch.setattr(torch.Tensor, "record_stream", forbidden("Tensor.record_stream"))
    X, Y = batches(4)
    engine, *_ = zeroinf.initialize(make_mlp(), config=config(2, "cpu", tmp_path, gas=2))
    assert isinstance(engine.params.transfers, HostTransfers)
    train(engine, X, Y, 2, gas=2)
    engine.close()


class _Recorder(_RecordingTransfers):
    """Also logs each D2H copy's destination and whether earlier copies into it had landed."""

    def __init__(self):
        super().__init__()
        self.d2h_dsts = []  # (data_ptr, numel, ready)
        self.reuse_ok = True

    def d2h(self, dst, src, **kw):
        lo, hi = dst.data_ptr(), dst.data_ptr() + dst.numel() * dst.element_size()
        for p, n, ev in self.d2h_dsts:
            if p < hi and lo < p + n and not ev.synced:
                self.reuse_ok = False  # written again before the host took the previous copy
        ready = super().d2h(dst, src, **kw)
        self.d2h_dsts.append((lo, hi - lo, ready))
        return ready


def _in(t, base):
    return base.data_ptr() <= t < base.data_ptr() + base.numel() * base.element_size()


def test_flat_cuda_branch_with_stand_in_streams(monkeypatch):
    monkeypatch.setattr(flat, "STAGING_NUMEL", 7)  # buckets of 30 go through 7-element pieces
    X, Y = batches(3)
    models = [make_mlp(), make_mlp()]
    kw = dict(stage=2, sub_group_size=33, reduce_bucket_size=30)
    plain = FlatParamManager([list(models[0].parameters())], **kw)
    rec = _Recorder()
    fm = FlatParamManager([list(models[1].parameters())], transfers=rec, **kw)
    g = fm.groups[0]
    for m in (plain, fm):
        m.zero_grad_acc()
    for k in range(3):
        for model, m in zip(models, (plain, fm)):
            F.mse_loss(model(X[k]), Y[k]).backward()
            m.reduce_gradients()
        if k == 0:  # the first micro-batch is copied straight into the (pinned) accumulation buffer
            assert rec.d2h_dsts and all(_in(p, g.grad_acc) for p, _, _ in rec.d2h_dsts)
            first = len(rec.d2h_dsts)
        assert fm._landing and not all(ev.synced for _, _, ev in rec.d2h_dsts), "landed before anyone read"
    assert all(not _in(p, g.grad_acc) for p, _, _ in rec.d2h_dsts[first:])  # later ones through staging
    assert len({p for p, _, _ in rec.d2h_dsts[first:]}) >= 2 and rec.reuse_ok
    got = torch.cat([fm.grad(i) for i in range(len(fm.sub_group_specs()))])
    want = torch.cat([plain.grad(i) for i in range(len(plain.sub_group_specs()))])
    assert torch.equal(got, want)
    assert all(ev.synced for _, _, ev in rec.d2h_dsts) and not fm._landing
    log = rec.fake.log
    for _, _, ev in rec.d2h_dsts:  # each copy: the D2H stream waited for the compute stream first
        i = log.index(("record", "d2h", ev))
        assert log[i - 1] == ("wait_stream", "d2h", "compute")
    assert set(rec.kept) == {("d2h", "d2h")}

    # parameters: written to the host copy, moved on the H2D stream after the compute stream's event
    n_sub = len(fm.sub_group_specs())
    for i in range(n_sub):
        t = fm.param_target(i)
        assert t.device.type == "cpu" and _in(t.data_ptr(), g.host_part)
        t.fill_(float(i + 1))
    fm.gather_params()
    (call,) = rec.h2d_calls
    assert call["after"].stream.name == "compute" and call["ready"].stream.name == "h2d"
    assert call["ready"].stream_waited and not call["ready"].synced
    assert torch.equal(g.flat[:g.part_numel], g.host_part)
    fm.param_target(0)  # the next step's write waits (host) for that copy first
    assert call["ready"].synced
    fm.gather_params()  # a checkpoint load writes the host copies (the masters) too: it settles first
    (_, call) = rec.h2d_calls
    assert not call["ready"].synced
    fm.settle_host_copies()
    assert call["ready"].synced


def _engine_vs_adamw(tmp_path, sync_check: bool):
    X, Y = (t.cuda() for t in batches(6))
    ref = make_mlp().cuda()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    model = copy.deepcopy(ref)
    engine, *_ = zeroinf.initialize(model, config=config(2, "cpu", tmp_path, gas=2))
    assert engine.params.transfers.side_streams
    losses, ref_losses = [], []
    for s in range(3):
        torch.cuda.synchronize()
        if sync_check and s > 0:  # step 1 pins the staging and parameter buffers
            torch.cuda.set_sync_debug_mode("error")
        try:
            for k in range(2):
                loss = F.mse_loss(engine(X[2 * s + k]), Y[2 * s + k])
                engine.backward(loss)
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        losses.append(loss.item())
        opt.zero_grad()
        for k in range(2):
            ref_loss = F.mse_loss(ref(X[2 * s + k]), Y[2 * s + k])
            (ref_loss / 2).backward()
        opt.step()
        ref_losses.append(ref_loss.item())
    torch.cuda.synchronize()
    err = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    engine.close()
    return losses, ref_losses, err


@needs_cuda
def test_stage2_on_cuda_equals_adamw(tmp_path):
    losses, ref_losses, err = _engine_vs_adamw(tmp_path, sync_check=False)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5 and err <= 1e-5, (losses, ref_losses, err)


@needs_cuda
def test_stage2_steps_two_and_three_do_not_synchronise_the_device(tmp_path):
    losses, ref_losses, err = _engine_vs_adamw(tmp_path, sync_check=True)
    assert err <= 1e-5, err

