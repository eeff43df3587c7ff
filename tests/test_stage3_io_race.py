"""Stage 3 with NVMe partitions: a parameter read outside its unit's forward (a foreign gather)
is saved for backward; in backward the unit is prefetched (its NVMe read in flight on the I/O
thread) when the saved tensor is unpacked. The unpack must wait for the read, not use the
half-filled buffer. ``ZEROINF_STAGE3_IO_DELAY_S`` delays every background read so the race
happens on every run instead of only on a loaded machine."""
import torch
import torch.nn as nn

import zeroinf


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.l(x))


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x * self.blocks[2].l.bias  # foreign read of a block's parameter


def _make():
    torch.manual_seed(0)
    return _Model()


def test_foreign_saved_param_waits_for_inflight_prefetch(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROINF_STAGE3_IO_DELAY_S", "0.02")
    x = torch.randn(4, 16)
    steps = 4
    ref = _make()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    want = []
    for _ in range(steps):
        loss = (ref(x) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    off = {"device": "nvme", "nvme_path": str(tmp_path)}
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "offload_param": off, "offload_optimizer": {"device": "cpu"},
                                 "stage3_param_persistence_threshold": 0}}
    eng, *_ = zeroinf.initialize(model=_make(), config=cfg)
    got = []
    for _ in range(steps):
        loss = (eng(x) ** 2).mean()
        eng.backward(loss)
        eng.step()
        got.append(loss.item())
    assert max(abs(a - b) for a, b in zip(want, got)) < 1e-6, (want, got)
