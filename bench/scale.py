"""A model of ``--params`` parameters trained with everything on NVMe, next to its floors, same run.

A GPT-style decoder (learned positions, pre-norm blocks of causal self-attention and a 4x GELU
MLP, untied head, vocabulary 256) of about ``--params`` parameters is built under
``zeroinf.Init`` in bf16 straight onto NVMe (its values never sit in memory all at once), then
trained by stage 3 in bf16 (bf16 parameters and gradients, fp32 master weights from the bf16
values, Adam moments in fp32 or with ``--state-dtype bf16`` in bf16) with ``offload_param`` and
``offload_optimizer`` both on ``nvme``: ``--steps`` steps of one micro-batch of
``--micro-batch`` x ``--seq`` tokens, the first a warm-up (it records the prefetch trace) that is
not counted. Shape: width
``d`` = (16/3 N)^(1/3) rounded to a multiple of 64 (a depth of about d/64 blocks, as GPT-3's
1.3B), heads of 64, then the number of blocks that brings the count nearest to N.

Reported, all measured in this process:

* ``step_s``: wall seconds from the end of the warm-up step to the return of the last
  ``engine.step()``, divided by the steps timed. Each optimizer step runs in the background behind
  the next forward (``zeroinf.overlap_step``), so the window holds the optimizer steps of the
  warm-up to the last but one, as a long run's steps do; ``drain_s``, printed apart, is the wait
  for the last one (``engine.synchronize()``). With ``--optimizer-in-backward`` each step's
  optimizer runs inside its own backward instead;
* ``cpu_s``: CPU seconds of the process (user + system, all threads) per timed step, over the
  same window: on a box whose cores the compute fills, work moved off the critical path shows
  here when the wall time hides it;
* ``read_bytes`` / ``write_bytes``: NVMe bytes per step from the engine's own counters
  (optimizer swaps, ``engine.stats()["nvme_*_bytes"]``, plus stage 3's parameter and gradient
  partitions, ``engine.stats()["stage3"]["bytes_nvme_*"]``), the mean over the timed steps (a
  step's counters hold the previous step's optimizer I/O: the same window); ``proc_read_bytes`` /
  ``proc_write_bytes``: the kernel's count for this process (``/proc/self/io``) over the timed
  window, per step, as a check;
* ``disk_read_gbps`` / ``disk_write_gbps``: sequential O_DIRECT bandwidth of the project's
  ``AsyncIOHandle`` on the same folder (files of ``--disk-bytes`` in all, requests of 256 MiB or
  ``--disk-bytes`` if less), measured before and after the training steps, the faster of the two
  kept per direction; ``disk_gbps`` is the combined rate the floor implies,
  (read_bytes + write_bytes) / io_floor_s;
* ``io_floor_s`` = read_bytes / read_gbps + write_bytes / write_gbps: reads and writes do not
  overlap, because on the VMs measured they share one device bandwidth (docs/performance.md);
``--dtype fp32`` builds and trains the model in fp32 instead (fp32 partitions, which are the
master weights, and fp32 gradients): for CPUs whose bf16 matmuls run through torch's scalar
fallback (no AVX-512), where a bf16 step of 1B parameters takes over ten minutes.

* ``compute_floor_s``: forward + backward of the same blocks held resident in the model's dtype (plain
  PyTorch, same batch), timed with 0 and with ``--floor-blocks`` blocks (the fastest of
  ``--floor-repeat`` interleaved rounds each, after the steps with the engine open and idle: a
  floor, so the rounds other jobs slowed are dropped) and scaled: t(0) + L * (t(k) - t(0)) / k
  for L blocks;
* ``ratio`` = step_s / max(io_floor_s, compute_floor_s);
* with ``--paired-floor``, the floor is timed after every timed step instead (one
  ``--floor-repeat`` set of rounds each, the model's resident blocks built for it and freed after),
  each step first synchronized (``engine.synchronize()``: its optimizer work ends inside its own
  window, so a step's time holds all of its work and none of the next one's), and: ``step_s``,
  ``cpu_s`` and the bytes count the steps' windows only; ``compute_floor_s`` is the median of the
  per-step floors and ``ratio`` the median of the per-step ratios (``per_step_compute_floor_s``,
  ``per_step_ratio``), so a step and its floor share the machine's state: on a shared VM the
  floor timed once after the steps moved 10-15 s at 1B between runs of the same build;
* ``peak_rss_bytes``: the process's peak resident set (``ru_maxrss``) read right after the steps,
  before the resident blocks are timed (``--paired-floor``: the peak ``VmHWM`` of the build and
  warm-up and of each timed step, reset after each floor's blocks are freed).

Also printed per timed step, to show where the time goes: the engine's backward, optimizer
(Adam compute, I/O wait) and stage-3 gather-wait and I/O-busy seconds, and the last step's
trace summed per thread and kind (:func:`trace_summary`); ``--trace FILE`` keeps that
Chrome/Perfetto trace (``engine.trace``).

    python bench/scale.py --params 1B [--json FILE] [--nvme-path DIR] [--steps 3] [--seq 256]
                          [--micro-batch 1] [--disk-bytes 2GiB] [--trace FILE] [--optimizer-in-backward]
                          [--state-dtype bf16] [--dtype fp32] [--no-checksums]

Needs about 20 bytes per parameter of free disk under ``--nvme-path`` (bf16 partitions 2,
gradient partitions 6, fp32 masters and moments 12; Init's bf16 copy, 2, is removed before the
optimizer's files are made), 4 fewer with ``--state-dtype bf16`` and 6 fewer with
``--optimizer-in-backward`` (:func:`disk_bytes_per_param`), plus ``--disk-bytes``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _util import machine_line  # noqa: E402
from step import io_bandwidth  # noqa: E402

import zeroinf  # noqa: E402

VOCAB = 256
ADAMW = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
AIO = {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
       "overlap_events": True}


def disk_bytes_per_param(state_dtype: str, optimizer_in_backward: bool, dtype: str = "bf16") -> int:
    """Bytes per parameter on disk at the run's peak. The bf16 partition (2) stays; the gradient
    partitions (fp32 accumulated 4 + bf16 2) exist unless the optimizer steps in the backward;
    zeroinf.Init's bf16 copy (2) is there while initialize writes those and is gone before the
    optimizer's files are made (fp32 master and two moments: 12, or 8 with bf16 moments). In fp32
    (``dtype``) the partition (4) and the gradient (4) are fp32, counted here beside a full
    optimizer file as an upper bound."""
    optimizer = {"fp32": 12, "bf16": 8}[state_dtype]
    if dtype == "fp32":
        return 4 + (0 if optimizer_in_backward else 4) + optimizer
    grads = 0 if optimizer_in_backward else 4 + 2
    return max(2 + 2 + grads, 2 + grads + optimizer)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention (``width // 64`` heads) and a 4x GELU
    MLP; 12 d^2 + 13 d parameters. Input and output ``[batch, seq, width]``."""

    def __init__(self, width: int):
        super().__init__()
        self.heads = width // 64
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, ``blocks`` blocks, final norm, untied head. Input token ids
    ``[batch, seq]`` (int64, < 256), output logits ``[batch, seq, 256]``."""

    def __init__(self, blocks: int, width: int, seq: int):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def parse_count(text: str) -> int:
    """``"1e9"``, ``"1B"``, ``"300M"``, ``"500k"``, ``"2GiB"`` -> an int (k/M/B/G decimal,
    KiB/MiB/GiB binary). Raises ``argparse.ArgumentTypeError`` naming the text otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*(k|m|b|g|t|kib|mib|gib)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: not a count (e.g. 1e9, 1B, 300M, 2GiB)")
    scale = {None: 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30}[m.group(2)]
    value = int(float(m.group(1)) * scale)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be positive")
    return value


def block_params(width: int) -> int:
    return 12 * width * width + 13 * width


def other_params(width: int, seq: int) -> int:
    """Embeddings, final norm and head."""
    return 2 * VOCAB * width + seq * width + 2 * width


def shape_for(params: int, seq: int) -> tuple:
    """(blocks, width) of the model nearest ``params`` parameters (see the module docstring)."""
    width = max(64, 64 * round((16 / 3 * params) ** (1 / 3) / 64))
    blocks = max(1, round((params - other_params(width, seq)) / block_params(width)))
    return blocks, width


def proc_io() -> tuple:
    """(read_bytes, write_bytes) the kernel counted for this process's block I/O (/proc/self/io)."""
    with open("/proc/self/io") as f:
        fields = dict(line.split(":") for line in f.read().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def engine_config(args, width: int, nvme: str) -> dict:
    unit = block_params(width)  # the largest unit's partition, elements
    return {
        "train_micro_batch_size_per_gpu": args.micro_batch, "optimizer": {"type": "AdamW", "params": ADAMW},
        "bf16": {"enabled": args.dtype == "bf16"}, "aio": {**AIO, "verify_checksums": not args.no_checksums},
        "zeroinf": {"optimizer_in_backward": args.optimizer_in_backward},
        "zero_optimization": {
            "stage": 3, "sub_group_size": 20_000_000, "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 2 * unit,
            "offload_param": {"device": "nvme", "nvme_path": nvme, "buffer_count": 6, "buffer_size": unit,
                              "max_in_cpu": 0},
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": args.optimizer_buffers,
                                  "pipeline_read": True, "pipeline_write": True,
                                  "state_dtype": args.state_dtype}}}


def train(args, blocks: int, width: int, nvme: str) -> dict:
    """Build under Init, run ``args.steps`` steps; the timings, bytes, per-step breakdown, peak RSS
    and :func:`block_times` measured after the steps with the engine still open."""
    cfg = engine_config(args, width, nvme)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    default = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[args.dtype])  # built in its dtype, as from_pretrained(torch_dtype=...)
    try:
        with zeroinf.Init(config=cfg):
            model = GPT(blocks, width, args.seq)
    finally:
        torch.set_default_dtype(default)
    engine, *_ = zeroinf.initialize(model=model, config=cfg)
    build_s = time.perf_counter() - t0
    print(f"built under zeroinf.Init and initialized in {build_s:.1f} s", flush=True)
    x = torch.randint(0, VOCAB, (args.micro_batch, args.seq), generator=torch.Generator().manual_seed(1))
    per_step, losses, paired = [], [], []
    window = {"s": 0.0, "cpu": 0.0, "read": 0, "write": 0}  # --paired-floor: the steps' own time
    try:
        for i in range(args.steps):
            if i == 1:  # the warm-up's optimizer step runs behind this forward, as every step's does
                io0, t_start, cpu0 = proc_io(), time.perf_counter(), os.times()
            io_a, cpu_a = proc_io(), os.times()
            t1 = time.perf_counter()
            logits = engine(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), x.flatten())
            t2 = time.perf_counter()
            engine.backward(loss)
            t3 = time.perf_counter()
            engine.step()
            t4 = time.perf_counter()
            losses.append(loss.item())
            st = engine.stats()
            s3 = st["stage3"]
            per_step.append({
                "forward_s": t2 - t1, "backward_call_s": t3 - t2, "step_call_s": t4 - t3,
                "read_bytes": st["nvme_read_bytes"] + s3["bytes_nvme_read"],
                "write_bytes": st["nvme_write_bytes"] + s3["bytes_nvme_written"],
                "optimizer_read_bytes": st["nvme_read_bytes"], "optimizer_write_bytes": st["nvme_write_bytes"],
                "gather_wait_s": s3["wait_io_s"], "param_io_busy_s": s3["io_busy_s"],
                "backward_s": st["backward_s"], "optimizer_s": st["optimizer_s"], "adam_s": st["adam_s"],
                "optimizer_io_wait_s": st["io_wait_s"], "pinned_bytes": st["pinned_bytes"]})
            if args.paired_floor:
                engine.synchronize()  # this step's optimizer work ends inside its own window
                t5, io_b, cpu_b = time.perf_counter(), proc_io(), os.times()
                per_step[-1]["synchronize_s"] = t5 - t4
                if i == 0:
                    first_peak = vm_hwm()
                    reset_vm_hwm()
                else:
                    window["s"] += t5 - t1
                    window["cpu"] += cpu_b.user + cpu_b.system - cpu_a.user - cpu_a.system
                    window["read"] += io_b[0] - io_a[0]
                    window["write"] += io_b[1] - io_a[1]
                    paired.append({"step_s": t5 - t1, "peak_rss": vm_hwm(),
                                   "block_times": block_times(args, blocks, width)})
                    reset_vm_hwm()  # the resident blocks are freed: their pages count in no step
            print(f"step {i}{' (warm-up)' if i == 0 else ''}: {t4 - t1:.2f} s, loss {losses[-1]:.4f}", flush=True)
        t_end, io1, cpu1 = time.perf_counter(), proc_io(), os.times()
        engine.synchronize()  # the last step's optimizer step, which no next forward hides
        drain_s = time.perf_counter() - t_end
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        if paired:  # the build and warm-up's peak (ru_maxrss is not reset), then each timed step's
            peak_rss = max([first_peak] + [p["peak_rss"] for p in paired])
        trace = args.trace or os.path.join(nvme, "trace.json")
        engine.trace(trace)
        trace_s = trace_summary(trace)
        # the resident blocks are timed while the engine is open and idle, in the process state
        # the steps ran in: on a loaded 2-core VM the same blocks took 5x the time and the CPU
        # time in this process before an engine was opened or after it closed as while one was
        # open, and as with OMP_WAIT_POLICY=PASSIVE (OpenMP workers spin-waiting for a
        # descheduled peer, unless an open engine's threads make them sleep instead)
        times = None if paired else block_times(args, blocks, width)
    finally:
        engine.close()
    timed = args.steps - 1
    if paired:  # the steps' own windows, without the resident blocks timed between them
        step_s, cpu_s = window["s"] / timed, window["cpu"] / timed
        io0, io1 = (0, 0), (window["read"], window["write"])
    else:
        step_s = (t_end - t_start) / timed
        cpu_s = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / timed
    return {"build_s": build_s, "step_s": step_s, "cpu_s": cpu_s, "drain_s": drain_s,
            "peak_rss": peak_rss,
            "block_times": times, "paired": paired, "losses": losses, "per_step": per_step, "trace_s": trace_s,
            "read_bytes": statistics.mean(s["read_bytes"] for s in per_step[1:]),
            "write_bytes": statistics.mean(s["write_bytes"] for s in per_step[1:]),
            "proc_read_bytes": (io1[0] - io0[0]) / timed, "proc_write_bytes": (io1[1] - io0[1]) / timed}


def trace_summary(path: str) -> dict:
    """Seconds per kind of span in an ``engine.trace`` file (the last iteration): on the compute
    thread the whole ``forward`` and ``backward`` and the gather ``wait``s; on the I/O thread its
    parameter ``read``s, ``copy``s into staging, partition ``write``s and ``grad`` handling (norm
    part, swap-out of the reduced gradient). Keys ``"<thread> <kind>"``."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"}
    out: dict = {}
    for e in events:
        kind = e["name"].split(" ")[0]
        if e.get("ph") != "X" or kind in ("fwd", "bwd", "reduce"):  # per-unit spans nest in forward/backward
            continue
        key = f"{threads.get(e['tid'], e['tid'])} {kind}"
        out[key] = out.get(key, 0.0) + e["dur"] / 1e6  # microseconds
    return out


def vm_hwm() -> int:
    """The process's peak resident set since start or the last :func:`reset_vm_hwm`, bytes
    (``VmHWM`` of /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("/proc/self/status has no VmHWM line")


def reset_vm_hwm() -> None:
    """Set ``VmHWM`` to the current resident set (writing 5 to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def block_times(args, blocks: int, width: int) -> dict:
    """Fastest forward + backward seconds, over ``args.floor_repeat`` interleaved rounds, of the
    model held resident in the model's dtype with 0 and with k = min(``--floor-blocks``, blocks) blocks:
    ``{0: seconds, k: seconds}``."""
    k = max(1, min(args.floor_blocks, blocks))
    x = torch.randint(0, VOCAB, (args.micro_batch, args.seq), generator=torch.Generator().manual_seed(1))
    models = {n: GPT(n, width, args.seq).to(DTYPES[args.dtype]) for n in (0, k)}

    def fwd_bwd(m):
        m.zero_grad(set_to_none=True)
        F.cross_entropy(m(x).flatten(0, 1).float(), x.flatten()).backward()
    for m in models.values():  # warm-up: first-call allocations
        fwd_bwd(m)
    t = {n: math.inf for n in models}
    for _ in range(args.floor_repeat):
        for n, m in models.items():
            t1 = time.perf_counter()
            fwd_bwd(m)
            t[n] = min(t[n], time.perf_counter() - t1)
    return t


def compute_floor(times: dict, blocks: int) -> float:
    """t(0) + blocks * (t(k) - t(0)) / k from :func:`block_times`' ``{0: t0, k: tk}`` (seconds);
    a difference within noise (tk <= t0, tiny widths) counts as 0 per block."""
    (_, t0), (k, tk) = sorted(times.items())
    return t0 + blocks * max(0.0, tk - t0) / k


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=parse_count, required=True, help="model size: 1e9, 1B, 300M, ...")
    p.add_argument("--json", metavar="FILE", default=None, help="write the results as JSON to FILE")
    p.add_argument("--nvme-path", default=tempfile.gettempdir(),
                   help="folder for the swap files (a fresh subfolder is made and removed)")
    p.add_argument("--steps", type=int, default=3, help="training steps, the first not timed (>= 2; default 3)")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per step (default 1)")
    p.add_argument("--optimizer-buffers", type=int, default=8, help="offload_optimizer.buffer_count (default 8)")
    p.add_argument("--optimizer-in-backward", action="store_true",
                   help="zeroinf.optimizer_in_backward: each group stepped in the backward, no gradients on NVMe")
    p.add_argument("--state-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="offload_optimizer.state_dtype: bf16 Adam moments (8 bytes of optimizer state "
                        "per parameter instead of 12; default fp32)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="model and training dtype (default bf16; fp32 where bf16 matmuls are slow on this CPU)")
    p.add_argument("--no-checksums", action="store_true",
                   help="aio.verify_checksums false: no CRC-32C of the swap files (to measure what they cost)")
    p.add_argument("--disk-bytes", type=parse_count, default=2 << 30,
                   help="bytes written then read to measure the disk (default 2GiB)")
    p.add_argument("--floor-blocks", type=int, default=2, help="resident blocks timed for the compute floor")
    p.add_argument("--floor-repeat", type=int, default=3,
                   help="timed rounds of the compute floor (fastest kept; default 3)")
    p.add_argument("--paired-floor", action="store_true",
                   help="time the compute floor after every timed step (each step synchronized first) "
                        "and report the median of the per-step ratios")
    p.add_argument("--trace", metavar="FILE", default=None, help="keep the last step's Perfetto trace in FILE")
    args = p.parse_args()
    if args.steps < 2:
        p.error(f"--steps {args.steps}: needs at least 2 (the first is a warm-up)")
    if args.disk_bytes < 1 << 20:
        p.error(f"--disk-bytes {args.disk_bytes}: needs at least 1 MiB")
    blocks, width = shape_for(args.params, args.seq)
    n = blocks * block_params(width) + other_params(width, args.seq)
    os.makedirs(args.nvme_path, exist_ok=True)
    need = disk_bytes_per_param(args.state_dtype, args.optimizer_in_backward, args.dtype) * n + args.disk_bytes
    free = shutil.disk_usage(args.nvme_path).free
    if free < need:
        p.error(f"--nvme-path {args.nvme_path}: {free / 1e9:.1f} GB free, the run needs about {need / 1e9:.1f} GB")
    print(machine_line())
    print(f"model: {n:,} parameters ({blocks} blocks x width {width}, {width // 64} heads), {args.dtype}, "
          f"{args.micro_batch} x {args.seq} tokens; torch threads {torch.get_num_threads()}", flush=True)
    # the disk is measured before and after training and the faster of each direction kept: on a
    # shared machine either moment can be slowed by other jobs, and a floor is a best case
    chunk = min(256 << 20, args.disk_bytes) >> 20 << 20  # whole MiB: O_DIRECT alignment
    nvme = tempfile.mkdtemp(prefix="zeroinf_bench_scale_", dir=args.nvme_path)
    try:
        bandwidths = [io_bandwidth(nvme, args.disk_bytes, AIO, chunk)]  # (write, read) GB/s
        run = train(args, blocks, width, nvme)
        bandwidths.append(io_bandwidth(nvme, args.disk_bytes, AIO, chunk))
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
    peak_rss = run["peak_rss"]
    write_gbps, read_gbps = (max(b[i] for b in bandwidths) for i in (0, 1))
    # reads and writes share the device, so their times add (see the module docstring)
    io_floor = run["read_bytes"] / (read_gbps * 1e9) + run["write_bytes"] / (write_gbps * 1e9)
    if run["paired"]:  # each step against the floor timed right after it; the medians reported
        floors = [compute_floor(p["block_times"], blocks) for p in run["paired"]]
        ratios = [p["step_s"] / max(io_floor, f) for p, f in zip(run["paired"], floors)]
        floor_c, ratio = statistics.median(floors), statistics.median(ratios)
        k = max(run["paired"][0]["block_times"])
        t0, tk = (statistics.median(p["block_times"][n] for p in run["paired"]) for n in (0, k))
    else:
        floor_c = compute_floor(run["block_times"], blocks)
        (_, t0), (k, tk) = sorted(run["block_times"].items())
        floors, ratios, ratio = [], [], run["step_s"] / max(io_floor, floor_c)
    out = {"step_s": run["step_s"], "cpu_s": run["cpu_s"], "io_floor_s": io_floor, "compute_floor_s": floor_c,
           "ratio": ratio, "paired_floor": bool(run["paired"]),
           "per_step_compute_floor_s": floors, "per_step_ratio": ratios,
           "per_step_s": [p["step_s"] for p in run["paired"]],
           "read_bytes": run["read_bytes"], "write_bytes": run["write_bytes"],
           "disk_gbps": (run["read_bytes"] + run["write_bytes"]) / io_floor / 1e9,
           "peak_rss_bytes": peak_rss,
           "params": n, "blocks": blocks, "width": width, "seq": args.seq, "micro_batch": args.micro_batch,
           "steps_timed": args.steps - 1, "optimizer_in_backward": args.optimizer_in_backward,
           "state_dtype": args.state_dtype, "dtype": args.dtype, "checksums": not args.no_checksums,
           "disk_read_gbps": read_gbps, "disk_write_gbps": write_gbps,
           "disk_method": f"AsyncIOHandle O_DIRECT, {args.disk_bytes // chunk * chunk} bytes, "
                          f"{chunk >> 20} MiB requests",
           "proc_read_bytes": run["proc_read_bytes"], "proc_write_bytes": run["proc_write_bytes"],
           "compute_floor_parts_s": {"no_blocks": t0, f"{k}_blocks": tk},
           "disk_write_read_gbps_before_after": bandwidths,
           "drain_s": run["drain_s"], "last_step_trace_s": run["trace_s"], "build_s": run["build_s"],
           "losses": run["losses"], "per_step": run["per_step"],
           "load_average": os.getloadavg()}
    print(f"{'':<16} {'seconds':>9} {'read GB':>8} {'write GB':>8}  note")
    print(f"{'step':<16} {out['step_s']:9.3f} {out['read_bytes'] / 1e9:8.2f} {out['write_bytes'] / 1e9:8.2f}  "
          f"engine counters, per step ({out['steps_timed']} timed; then {run['drain_s']:.2f} s for the last "
          f"optimizer step; {out['cpu_s']:.1f} CPU s per step, all threads)")
    print(f"{'  /proc/self/io':<16} {'':>9} {out['proc_read_bytes'] / 1e9:8.2f} {out['proc_write_bytes'] / 1e9:8.2f}  "
          "the kernel's count, per step")
    print(f"{'io floor':<16} {io_floor:9.3f} {'':>8} {'':>8}  disk read {read_gbps:.2f} GB/s, write "
          f"{write_gbps:.2f} GB/s ({out['disk_method']}; before/after training, write/read: "
          + ", ".join(f"{w:.2f}/{r:.2f}" for w, r in bandwidths) + ")")
    print(f"{'compute floor':<16} {floor_c:9.3f} {'':>8} {'':>8}  resident {args.dtype}: 0 blocks {t0:.3f} s, "
          f"{k} blocks {tk:.3f} s, scaled to {blocks}")
    if run["paired"]:
        print("paired, per timed step: step s / compute floor s / ratio: " + ", ".join(
            f"{p['step_s']:.2f} / {f:.2f} / {r:.2f}" for p, f, r in zip(run["paired"], floors, ratios)))
    print(f"ratio {out['ratio']:.2f} ({'median of the per-step ' if run['paired'] else ''}step / max(floors)); peak RSS {peak_rss / 2**30:.2f} GiB; "
          f"build {run['build_s']:.1f} s; losses {', '.join(f'{v:.4f}' for v in run['losses'])}")
    print("per step: forward / backward / step() call s | gather wait, param I/O busy | optimizer, Adam, "
          "optimizer I/O wait s (the previous step's, overlapped)")
    for i, s in enumerate(run["per_step"]):
        print(f"  {i}{' (warm-up)' if i == 0 else ''}: {s['forward_s']:.2f} / {s['backward_call_s']:.2f} / "
              f"{s['step_call_s']:.2f} | {s['gather_wait_s']:.2f}, {s['param_io_busy_s']:.2f} | "
              f"{s['optimizer_s']:.2f}, {s['adam_s']:.2f}, {s['optimizer_io_wait_s']:.2f}")
    print("last step's trace, seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(run["trace_s"].items())))
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")
        os.replace(tmp, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
