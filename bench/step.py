"""Optimizer-step time of the ZeRO engine with the optimizer state in memory, on CPU, or on NVMe,
next to its floors measured in the same run.

For a model of ``--params`` parameters (default 100M; a stack of square Linear layers), one
process, stage 2, fp32: the engine's optimizer step (``engine.stats()["optimizer_s"]``: norm, Adam
over every sub-group, swap I/O, write-back) for ``offload_optimizer.device`` none / cpu / nvme.
Floors, measured here in the same process:

* ``cpu-adam``: one ``zeroinf.optim.adam_step`` over all parameters as one flat buffer (the Adam
  work any offload must do; what bench/cpu_adam.py measures);
* ``io-floor``: the NVMe bytes one step moves (12 bytes/param in, 12 out) divided by the
  sequential write and read bandwidth of an ``AsyncIOHandle`` on the same directory (what
  bench/aio.py measures).

The goal: the nvme step within 1.2x of max(cpu-adam, io-floor), i.e. swap I/O and Adam overlapped.

    python bench/step.py [--params 100e6] [--nvme-path DIR] [--sub-group-size 1e7]
                         [--block-size 1048576] [--queue-depth 8] [--json out.json]
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import Row, bench_parser, machine_line, print_table, write_json  # noqa: E402

import zeroinf  # noqa: E402
from zeroinf.optim import adam_step  # noqa: E402


def build_model(params: int) -> nn.Module:
    width = 2048
    layers = max(1, round(params / (width * width + width)))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def engine_step_times(model: nn.Module, device: str, nvme: str, sub_group: int, steps: int, aio: dict) -> dict:
    off = {"device": device}
    if device == "nvme":
        off.update(nvme_path=nvme, pipeline_read=True, pipeline_write=True, buffer_count=3)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 2, "sub_group_size": sub_group, "offload_optimizer": off}, "aio": aio}
    engine, *_ = zeroinf.initialize(model, config=cfg)
    x = torch.randn(2, model[0].in_features)
    keys = ("optimizer_s", "adam_s", "io_wait_s", "nvme_read_bytes", "nvme_write_bytes")
    samples = {k: [] for k in keys + ("iteration_s",)}
    for i in range(steps + 1):
        t0 = time.perf_counter()
        engine.backward(engine(x).square().mean())
        engine.step()
        if i:  # the first step pays page faults
            samples["iteration_s"].append(time.perf_counter() - t0)
            for k in keys:
                samples[k].append(engine.stats()[k])
    engine.close()
    return {k: statistics.median(v) for k, v in samples.items()}


def io_bandwidth(path: str, nbytes: int, aio: dict, chunk: int = 256 << 20) -> tuple:
    """(write GB/s, read GB/s) overwriting then reading ``max(1, nbytes // chunk)`` files of
    ``chunk`` bytes (one request each) through AsyncIOHandle."""
    from zeroinf.io import AsyncIOHandle, PinnedBufferPool

    n = max(1, nbytes // chunk)
    files = [os.path.join(path, f"bench_step_bw{i}.bin") for i in range(n)]  # one file per chunk
    with PinnedBufferPool(1, chunk) as pool:
        buf = pool.acquire()
        buf.fill_(7)
        h = AsyncIOHandle.from_config(aio)
        for i in range(n):  # allocate the files first: swap files are preallocated and overwritten
            h.sync_pwrite(buf, files[i])
        t0 = time.perf_counter()
        for i in range(n):
            h.async_pwrite(buf, files[i])
            h.wait()
        tw = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(n):
            h.async_pread(buf, files[i])
            h.wait()
        tr = time.perf_counter() - t0
        h.close()
        pool.release(buf)
    for f in files:
        os.unlink(f)
    return n * chunk / tw / 1e9, n * chunk / tr / 1e9


def main() -> int:
    p = bench_parser("ZeRO engine optimizer step: offload none/cpu/nvme vs CPU-Adam and I/O floors", repeat=3, warmup=1)
    p.add_argument("--params", type=float, default=100e6, help="model parameters (default 100e6)")
    p.add_argument("--sub-group-size", type=float, default=1e7, help="zero_optimization.sub_group_size (elements)")
    p.add_argument("--nvme-path", default=None, help="directory for swap files (default: a temp dir under cwd)")
    p.add_argument("--block-size", type=int, default=1 << 20, help="aio.block_size in bytes (default 1 MiB)")
    p.add_argument("--queue-depth", type=int, default=8, help="aio.queue_depth (default 8)")
    args = p.parse_args()
    nvme = args.nvme_path or tempfile.mkdtemp(prefix="zeroinf-bench-step-", dir=os.getcwd())
    own_dir = args.nvme_path is None
    aio = {"block_size": args.block_size, "queue_depth": args.queue_depth}
    try:
        torch.manual_seed(0)
        model = build_model(int(args.params))
        n = sum(q.numel() for q in model.parameters())
        print(machine_line())
        print(f"model: {n / 1e6:.1f}M parameters, threads {torch.get_num_threads()}, swap dir {nvme}, aio {aio}")

        rows = []
        master, grad = torch.randn(n) * 0.01, torch.randn(n) * 1e-3
        m, v = torch.zeros(n), torch.zeros(n)
        times = []
        for t in range(1, args.warmup + args.repeat + 1):
            t0 = time.perf_counter()
            adam_step(master, grad, m, v, step=t, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
            if t > args.warmup:
                times.append(time.perf_counter() - t0)
        adam_s = statistics.median(times)
        rows.append(Row("cpu-adam", "opt-step", f"{n / 1e6:.0f}M", 1e3 * adam_s, 28 * n / adam_s / 1e9))
        del master, grad, m, v

        w_gbps, r_gbps = io_bandwidth(nvme, 1 << 30, aio)
        io_floor = 12 * n / (w_gbps * 1e9) + 12 * n / (r_gbps * 1e9)
        rows.append(Row("io-floor", "opt-step", f"{n / 1e6:.0f}M", 1e3 * io_floor, 24 * n / io_floor / 1e9,
                        {"write_gbps": w_gbps, "read_gbps": r_gbps}))

        for device in ("none", "cpu", "nvme"):
            model = build_model(int(args.params))
            st = engine_step_times(model, device, nvme, int(args.sub_group_size), args.repeat, aio)
            moved = st["nvme_read_bytes"] + st["nvme_write_bytes"]
            gbps = moved / st["optimizer_s"] / 1e9 if moved else 28 * n / st["optimizer_s"] / 1e9
            rows.append(Row(f"zeroinf-{device}", "opt-step", f"{n / 1e6:.0f}M", 1e3 * st["optimizer_s"], gbps,
                            {"adam_ms": 1e3 * st["adam_s"], "io_wait_ms": 1e3 * st["io_wait_s"],
                             "iteration_ms": 1e3 * st["iteration_s"]}))
            del model

        print_table(rows, peer="cpu-adam")
        floor = max(adam_s, io_floor)
        nv = next(r for r in rows if r.name == "zeroinf-nvme")
        print(f"\nI/O: write {w_gbps:.2f} GB/s, read {r_gbps:.2f} GB/s; floor = max(cpu-adam {1e3 * adam_s:.1f} ms, "
              f"io {1e3 * io_floor:.1f} ms) = {1e3 * floor:.1f} ms")
        print(f"nvme step / floor = {nv.ms / 1e3 / floor:.2f} (goal <= 1.2); of which Adam {nv.extra['adam_ms']:.1f} ms, "
              f"waiting on I/O {nv.extra['io_wait_ms']:.1f} ms")
        none = next(r for r in rows if r.name == "zeroinf-none")
        extra = nv.extra["iteration_ms"] - none.extra["iteration_ms"] + none.ms
        print(f"whole iteration (forward, backward, step): none {none.extra['iteration_ms']:.1f} ms, nvme "
              f"{nv.extra['iteration_ms']:.1f} ms; the nvme step including what hid behind the backward "
              f"(iteration difference + the none step) = {extra:.1f} ms = {extra / 1e3 / floor:.2f} x floor")
        write_json(args.json, {"n": n, "threads": torch.get_num_threads(), "floor_ms": 1e3 * floor}, rows)
    finally:
        if own_dir:
            shutil.rmtree(nvme, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
