"""Stage 3 training step with parameters and optimizer on NVMe, next to its floors, same run.

A transformer of ``--blocks`` blocks of width ``--width`` (default 12 x 1024: ~101M parameters),
one process, fp32, micro-batch 2 x ``--seq`` tokens. Rows (median wall seconds of a whole step:
forward, backward, optimizer step):

* ``resident``: stage 3 with offload_param and offload_optimizer ``none``;
* ``nvme``: offload_param and offload_optimizer ``nvme`` (read-ahead, pipelined optimizer swaps);
* ``io-floor``: the NVMe bytes the nvme step moved (parameter partitions read and written, the
  optimizer's 12 bytes/param in and out) divided by the sequential read/write bandwidth of an
  ``AsyncIOHandle`` on the same directory (bench/step.py's measurement).

Goal: nvme within 1.25x of max(resident, io-floor). Also printed: the share of the parameter
reads' I/O time that compute did not wait for (``engine.stats()["stage3"]["io_hidden_fraction"]``).

    python bench/stage3_step.py [--blocks 12] [--width 1024] [--nvme-path DIR] [--steps 3]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from step import io_bandwidth  # noqa: E402

import zeroinf  # noqa: E402
from stage3_models import Block  # noqa: E402


class LM(nn.Module):
    def __init__(self, blocks: int, width: int, vocab: int = 256):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def run(args, tier: str, nvme: str) -> dict:
    z = {"stage": 3, "sub_group_size": 20_000_000, "stage3_max_reuse_distance": 0,
         "stage3_prefetch_bucket_size": 3 * args.width * args.width * 8,
         "offload_param": {"device": tier}, "offload_optimizer": {"device": tier}}
    if tier == "nvme":
        z["offload_param"].update(nvme_path=nvme, buffer_count=6, buffer_size=9 * args.width * args.width, max_in_cpu=0)
        z["offload_optimizer"].update(nvme_path=nvme, buffer_count=3, pipeline_read=True, pipeline_write=True)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": z}
    torch.manual_seed(0)
    with zeroinf.Init(config=cfg, enabled=tier == "nvme"):
        model = LM(args.blocks, args.width)
    engine, *_ = zeroinf.initialize(model=model, config=cfg)
    x = torch.randint(0, 256, (2, args.seq))
    times, stats = [], []
    for i in range(args.steps + 1):
        t0 = time.perf_counter()
        logits = engine(x)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten())
        engine.backward(loss)
        engine.step()
        if i:  # the first step records the trace and pays page faults
            times.append(time.perf_counter() - t0)
            stats.append(engine.stats())
    engine.close()
    st = stats[-1]
    s3 = st.get("stage3", {})
    return {"step_s": statistics.median(times),
            "read_bytes": st.get("nvme_read_bytes", 0) + s3.get("bytes_nvme_read", 0),
            "write_bytes": st.get("nvme_write_bytes", 0) + s3.get("bytes_nvme_written", 0),
            "hidden": s3.get("io_hidden_fraction"), "param_wait_s": s3.get("wait_io_s"),
            "optimizer_io_wait_s": st.get("io_wait_s"), "live_high_water": s3.get("live_high_water")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--nvme-path", default=None)
    args = p.parse_args()
    nvme = tempfile.mkdtemp(prefix="zeroinf_bench_s3_", dir=args.nvme_path)
    try:
        res = run(args, "none", nvme)
        off = run(args, "nvme", nvme)
        w_bw, r_bw = io_bandwidth(nvme, 1 << 30, {})  # the default aio block, as the runs above
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
    floor = off["read_bytes"] / (r_bw * 1e9) + off["write_bytes"] / (w_bw * 1e9)
    params = sum(p.numel() for p in LM(args.blocks, args.width).parameters())
    print(f"model {params / 1e6:.1f}M params, fp32, 2x{args.seq} tokens; disk write {w_bw:.2f} GB/s, read {r_bw:.2f} GB/s")
    print(f"{'row':<10} {'seconds':>9}  note")
    print(f"{'resident':<10} {res['step_s']:9.3f}")
    print(f"{'nvme':<10} {off['step_s']:9.3f}  read {off['read_bytes'] / 1e9:.2f} GB, write {off['write_bytes'] / 1e9:.2f} GB; "
          f"param reads hidden {off['hidden'] if off['hidden'] is None else round(off['hidden'], 2)}, "
          f"optimizer I/O wait {off['optimizer_io_wait_s']:.3f} s")
    print(f"{'io-floor':<10} {floor:9.3f}")
    goal = max(res["step_s"], floor)
    print(f"nvme / max(resident, io-floor) = {off['step_s'] / goal:.2f}  (goal <= 1.25)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
