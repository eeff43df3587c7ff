"""Stage 3 training step with parameters and optimizer on NVMe, next to its floors and DeepSpeed, same run.

A transformer of ``--blocks`` blocks of width ``--width`` (default 12 x 1024: ~101M parameters),
one process, fp32, micro-batch 2 x ``--seq`` tokens, AdamW (lr 1e-4, weight decay 0.01). Rows
(median wall seconds of a whole step: forward, backward, optimizer step, over ``--steps`` steps
after the first):

* ``resident``: stage 3 with offload_param and offload_optimizer ``none``;
* ``nvme``: offload_param and offload_optimizer ``nvme`` (read-ahead, pipelined optimizer swaps,
  ``--optimizer-buffers`` swap buffers, default 8: the first sub-groups' state is read during
  the backward, and the more buffers, the more of it; 3 gave 1.26 and 1.35 for the two goal
  ratios below where 8 gave 1.20 and 1.25, same host, one run after the other);
* ``io-floor``: the NVMe bytes the nvme step moved (parameter partitions read and written, the
  optimizer's 12 bytes/param in and out) divided by the sequential read/write bandwidth of an
  ``AsyncIOHandle`` on the same directory (bench/step.py's measurement);
* ``resident-in-bwd`` / ``nvme-in-bwd`` / ``io-floor-in-bwd``: the same with
  ``zeroinf.optimizer_in_backward`` (each flat group stepped inside the backward as soon as its
  gradient is reduced: no gradient partitions on NVMe);
* ``nvme-nocrc``: the nvme row with ``aio.verify_checksums: false`` (no CRC-32C recorded at swap
  out nor verified at swap in); the nvme / nvme-nocrc ratio, per round and its median, is the
  cost of verified swaps (goal <= 1.03). ``--checksum-ratio`` runs only these two rows;
* ``serial``: resident + io-floor, the step with its compute and its I/O one after the other;
* ``deepspeed-resident`` / ``deepspeed-nvme``: the same model, data and optimizer under DeepSpeed
  ZeRO-3 (CPU accelerator, gloo, one process), without offload and with parameters and optimizer
  on NVMe, each in a subprocess; skipped when ``deepspeed`` is not importable. DeepSpeed 0.19.8
  runs this model's NVMe case only with ``stage3_prefetch_bucket_size`` 0 (any prefetch fails
  with "param ... already assigned swap buffer id": ``nn.MultiheadAttention`` reads
  ``out_proj.weight`` outside ``out_proj``'s forward), ``offload_param.buffer_size`` 5e6 (the
  largest parameter has 4.2M elements) and ``offload_optimizer.buffer_count`` 12 (4 fails in
  its swapper, see ../shared/peers/README.md).

The four zeroinf rows and the disk bandwidth are measured in ``--rounds`` rounds (default 3), the
rows' order rotated each round: this VM's speed drifts by a third within minutes, so each round's
goal ratios (rows measured next to each other) are printed, and every zeroinf row shows the
median over rounds.

Every row prints its loss after the last step (same seed and batch: the rows must agree) and the
bytes the process read from and wrote to disk meanwhile (``psutil``, all engines counted alike).

Goal: nvme within 1.25x of max(resident, io-floor); for nvme-in-bwd, of max(the faster resident
row, io-floor-in-bwd). Also printed: the share of the parameter
reads' I/O time that compute did not wait for (``engine.stats()["stage3"]["io_hidden_fraction"]``),
the share of the whole step's I/O time hidden (1 - (nvme - resident) / io-floor: 1 when the
nvme step costs no more than the resident one, 0 when it costs the whole floor on top), and
each engine's nvme / resident ratio.

    python bench/stage3_step.py [--blocks 12] [--width 1024] [--nvme-path DIR] [--optimizer-buffers 8] [--steps 3]
                                [--rounds 3] [--no-peers] [--checksum-ratio] [--param-ratio R [R ...]]

``--param-ratio 1 0.5 0`` runs only the nvme row at each ``offload_param.ratio`` (the fraction of
the parameters offloaded; the rest stay on the compute device) and prints seconds per step and the
engine's NVMe bytes per step for each.
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


ADAMW = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}


def _timed_steps(engine, args) -> dict:
    """``args.steps + 1`` training steps on one fixed batch; the first is not timed (it records
    the trace and pays page faults). Returns the median step seconds, the last loss, and the
    disk bytes this process read and wrote during the timed steps (psutil)."""
    import psutil

    proc = psutil.Process()
    torch.manual_seed(1)
    x = torch.randint(0, 256, (2, args.seq))
    times, loss = [], None
    for i in range(args.steps + 1):
        if i == 1:
            io0 = proc.io_counters()
        t0 = time.perf_counter()
        logits = engine(x)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), x.flatten())
        engine.backward(loss)
        engine.step()
        if i:
            times.append(time.perf_counter() - t0)
    io1 = proc.io_counters()
    return {"step_s": statistics.median(times), "loss": loss.item(),
            "disk_read": (io1.read_bytes - io0.read_bytes) / args.steps,
            "disk_written": (io1.write_bytes - io0.write_bytes) / args.steps}


def run(args, tier: str, nvme: str, in_backward: bool = False, checksums: bool = True,
        param_ratio: float = 1.0) -> dict:
    """zeroinf stage 3, parameters and optimizer on ``tier`` ("none" or "nvme"); with
    ``in_backward``, ``zeroinf.optimizer_in_backward`` (each group stepped inside the backward);
    ``checksums``: the ``aio.verify_checksums`` key; ``param_ratio``: ``offload_param.ratio``
    (NVMe only)."""
    z = {"stage": 3, "sub_group_size": 20_000_000, "stage3_max_reuse_distance": 0,
         "stage3_prefetch_bucket_size": 3 * args.width * args.width * 8,
         "offload_param": {"device": tier}, "offload_optimizer": {"device": tier}}
    if tier == "nvme":
        z["offload_param"].update(nvme_path=nvme, buffer_count=6, buffer_size=9 * args.width * args.width, max_in_cpu=0)
        if param_ratio < 1.0:
            z["offload_param"]["ratio"] = param_ratio
        z["offload_optimizer"].update(nvme_path=nvme, buffer_count=args.optimizer_buffers, pipeline_read=True,
                                      pipeline_write=True)
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": ADAMW},
           "zero_optimization": z, "zeroinf": {"optimizer_in_backward": in_backward},
           "aio": {"verify_checksums": checksums}}
    torch.manual_seed(0)
    with zeroinf.Init(config=cfg, enabled=tier == "nvme"):
        model = LM(args.blocks, args.width)
    engine, *_ = zeroinf.initialize(model=model, config=cfg)
    out = _timed_steps(engine, args)
    st = engine.stats()  # the last step's counters
    engine.close()
    s3 = st.get("stage3", {})
    out.update(read_bytes=st.get("nvme_read_bytes", 0) + s3.get("bytes_nvme_read", 0),
               write_bytes=st.get("nvme_write_bytes", 0) + s3.get("bytes_nvme_written", 0),
               hidden=s3.get("io_hidden_fraction"), optimizer_io_wait_s=st.get("io_wait_s"))
    return out


def deepspeed_row(args, tier: str, nvme: str) -> dict:
    """DeepSpeed ZeRO-3 on the same model, batch and optimizer (run in a subprocess by
    :func:`run_peer`: DeepSpeed wants its own process group and accelerator set-up)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    z = {"stage": 3, "sub_group_size": 20_000_000, "stage3_max_reuse_distance": 0, "overlap_comm": False,
         "stage3_prefetch_bucket_size": 3 * args.width * args.width * 8, "stage3_max_live_parameters": 3e7}
    if tier == "nvme":  # the settings it runs with: see the module docstring
        z["stage3_prefetch_bucket_size"] = 0
        z["offload_param"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 32, "buffer_size": 5e6,
                              "max_in_cpu": 0}
        z["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 12,
                                  "pipeline_read": True, "pipeline_write": True}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": ADAMW}, "zero_optimization": z,
           "aio": {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 1, "single_submit": False,
                   "overlap_events": True}}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = LM(args.blocks, args.width)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return _timed_steps(engine, args)


def run_peer(args, tier: str, nvme: str) -> dict:
    """:func:`deepspeed_row` in a subprocess of this script (CPU accelerator, one rank);
    returns its result, or ``{"error": last lines of its output}`` when it fails."""
    import json
    import socket
    import subprocess

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    env = dict(os.environ, DS_ACCELERATOR="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cmd = [sys.executable, os.path.abspath(__file__), "--blocks", str(args.blocks), "--width", str(args.width),
           "--seq", str(args.seq), "--steps", str(args.steps), "--peer-row", tier, "--nvme-path", nvme]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("PEER-ROW "):
            return json.loads(line[len("PEER-ROW "):])
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


def ratio_sweep(args, nvme: str) -> int:
    """``--param-ratio``: the nvme row at each ratio, ``--rounds`` rounds with the order rotated;
    median seconds per step over rounds, and the last round's engine NVMe bytes per step."""
    ratios = list(args.param_ratio)
    rounds = []
    for k in range(max(1, args.rounds)):
        order = ratios[k % len(ratios):] + ratios[:k % len(ratios)]
        # a folder per ratio, as per row in main(): each ratio's rounds reuse their own swap files
        rounds.append({r: run(args, "nvme", os.path.join(nvme, f"ratio{r:g}"), param_ratio=r) for r in order})
    params = sum(p.numel() for p in LM(args.blocks, args.width).parameters())
    print(f"model {params / 1e6:.1f}M params, fp32, 2x{args.seq} tokens; parameters and optimizer on NVMe; "
          f"median seconds per step over {len(rounds)} rounds ({args.steps} steps each after the first)")
    print(f"{'ratio':>6} {'seconds':>8} {'loss':>9} {'NVMe read GB':>13} {'NVMe write GB':>14}  rounds")
    for r in ratios:
        last = rounds[-1][r]
        secs = [g[r]["step_s"] for g in rounds]
        print(f"{r:6.2f} {statistics.median(secs):8.3f} {last['loss']:9.5f} {last['read_bytes'] / 1e9:13.3f} "
              f"{last['write_bytes'] / 1e9:14.3f}  {', '.join(f'{s:.3f}' for s in secs)}")
    return 0


def main() -> int:
    import importlib.util
    import json

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--nvme-path", default=None)
    p.add_argument("--optimizer-buffers", type=int, default=8,
                   help="zeroinf rows' offload_optimizer.buffer_count (each one sub-group's moments, pinned)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the zeroinf rows, order rotated")
    p.add_argument("--no-peers", action="store_true", help="skip the DeepSpeed rows")
    p.add_argument("--checksum-ratio", action="store_true",
                   help="run only the nvme and nvme-nocrc rows and print their ratio (the checksums' cost)")
    p.add_argument("--param-ratio", type=float, nargs="+", metavar="R",
                   help="run only the nvme row at each offload_param.ratio R (0 to 1) and print seconds per step "
                        "and the engine's NVMe bytes per step")
    p.add_argument("--peer-row", choices=["none", "nvme"], help=argparse.SUPPRESS)  # run_peer's subprocess
    args = p.parse_args()
    if args.peer_row:
        print("PEER-ROW " + json.dumps(deepspeed_row(args, args.peer_row, args.nvme_path)), flush=True)
        return 0
    peers = not args.no_peers and importlib.util.find_spec("deepspeed") is not None
    os.makedirs(args.nvme_path, exist_ok=True)  # as the engine makes a missing nvme_path (it raised here)
    nvme = tempfile.mkdtemp(prefix="zeroinf_bench_s3_", dir=args.nvme_path)
    if args.param_ratio:
        try:
            return ratio_sweep(args, nvme)
        finally:
            shutil.rmtree(nvme, ignore_errors=True)
    kinds = {"resident": ("none", False, True), "nvme": ("nvme", False, True), "resident-in-bwd": ("none", True, True),
             "nvme-in-bwd": ("nvme", True, True), "nvme-nocrc": ("nvme", False, False)}
    if args.checksum_ratio:
        kinds = {n: kinds[n] for n in ("nvme", "nvme-nocrc")}
    rounds = []
    try:
        for k in range(max(1, args.rounds)):
            names = list(kinds)[k % len(kinds):] + list(kinds)[:k % len(kinds)]
            # a folder per row: rows with and without checksums would take each other's files as stale
            got = {n: run(args, kinds[n][0], os.path.join(nvme, n), in_backward=kinds[n][1], checksums=kinds[n][2])
                   for n in names}
            if not args.checksum_ratio:
                got["bw"] = io_bandwidth(nvme, 1 << 30, {})  # the default aio block, as the runs above
            rounds.append(got)
        ds_res = run_peer(args, "none", nvme) if peers and not args.checksum_ratio else None
        ds_off = run_peer(args, "nvme", os.path.join(nvme, "deepspeed")) if peers and not args.checksum_ratio else None
    finally:
        shutil.rmtree(nvme, ignore_errors=True)

    crc = [g["nvme"]["step_s"] / g["nvme-nocrc"]["step_s"] for g in rounds]
    crc_line = (f"nvme / nvme-nocrc (verified swaps' cost) = {statistics.median(crc):.3f} "
                f"(rounds {', '.join(f'{c:.3f}' for c in crc)}; goal <= 1.03)")
    if args.checksum_ratio:
        for k, g in enumerate(rounds):
            print(f"round {k + 1}: nvme {g['nvme']['step_s']:.3f} s (loss {g['nvme']['loss']:.5f}), "
                  f"nvme-nocrc {g['nvme-nocrc']['step_s']:.3f} s (loss {g['nvme-nocrc']['loss']:.5f})")
        print(crc_line)
        return 0

    def floor_of(r: dict, bw) -> float:  # seconds to move the row's bytes at the round's bandwidth
        return r["read_bytes"] / (bw[1] * 1e9) + r["write_bytes"] / (bw[0] * 1e9)

    def goals(g: dict):  # this round's goal ratios: nvme, nvme-in-bwd
        fl, fl_ib = floor_of(g["nvme"], g["bw"]), floor_of(g["nvme-in-bwd"], g["bw"])
        res_s = min(g["resident"]["step_s"], g["resident-in-bwd"]["step_s"])
        return (g["nvme"]["step_s"] / max(g["resident"]["step_s"], fl),
                g["nvme-in-bwd"]["step_s"] / max(res_s, fl_ib))

    def median_row(name: str) -> dict:
        out = dict(rounds[-1][name])
        out["step_s"] = statistics.median(g[name]["step_s"] for g in rounds)
        return out
    res, off, res_ib, off_ib, off_nocrc = (median_row(n) for n in kinds)
    w_bw = statistics.median(g["bw"][0] for g in rounds)
    r_bw = statistics.median(g["bw"][1] for g in rounds)
    floor = statistics.median(floor_of(g["nvme"], g["bw"]) for g in rounds)
    floor_ib = statistics.median(floor_of(g["nvme-in-bwd"], g["bw"]) for g in rounds)
    params = sum(p.numel() for p in LM(args.blocks, args.width).parameters())
    print(f"model {params / 1e6:.1f}M params, fp32, 2x{args.seq} tokens; disk write {w_bw:.2f} GB/s, read {r_bw:.2f} GB/s "
          f"(medians of {len(rounds)} rounds; zeroinf rows: median seconds over rounds)")
    print(f"{'row':<19} {'seconds':>8} {'loss':>9} {'disk r/w GB':>12}  note")

    def row(name: str, r: dict, note: str = "") -> None:
        if "error" in r:
            print(f"{name:<19} {'failed':>8}  {r['error']}")
            return
        io = f"{r['disk_read'] / 1e9:.2f}/{r['disk_written'] / 1e9:.2f}"
        print(f"{name:<19} {r['step_s']:8.3f} {r['loss']:9.5f} {io:>12}  {note}")

    def engine_note(r: dict) -> str:
        return (f"engine stats: read {r['read_bytes'] / 1e9:.2f} GB, write {r['write_bytes'] / 1e9:.2f} GB; "
                f"param reads hidden {r['hidden'] if r['hidden'] is None else round(r['hidden'], 2)}, "
                f"optimizer I/O wait {r['optimizer_io_wait_s']:.3f} s")

    row("resident", res)
    row("nvme", off, engine_note(off))
    row("nvme-nocrc", off_nocrc, "aio.verify_checksums: false")
    print(f"{'io-floor':<19} {floor:8.3f}")
    row("resident-in-bwd", res_ib, "zeroinf.optimizer_in_backward")
    row("nvme-in-bwd", off_ib, engine_note(off_ib))
    print(f"{'io-floor-in-bwd':<19} {floor_ib:8.3f}")
    serial = res["step_s"] + floor
    print(f"{'serial':<19} {serial:8.3f}  resident + io-floor: no overlap at all; nvme saves "
          f"{100 * (1 - off['step_s'] / serial):.0f}% of it (bench/io_overlap.py: what this machine allows)")
    if peers:
        row("deepspeed-resident", ds_res)
        row("deepspeed-nvme", ds_off)
    else:
        print("deepspeed rows skipped (" + ("--no-peers" if args.no_peers else "deepspeed not importable") + ")")
    if off["step_s"] >= res["step_s"]:
        print(f"I/O hidden behind compute, whole step: 1 - (nvme - resident) / io-floor = "
              f"{max(0.0, 1 - (off['step_s'] - res['step_s']) / floor):.2f}")
    else:  # a share above 1 means only that the two timings are within noise of each other
        print("I/O hidden behind compute, whole step: n/a (the nvme step timed faster than the resident one: "
              "noise larger than the I/O; use a larger model)")
    per_round = [goals(g) for g in rounds]
    for k, (a, b) in enumerate(per_round):
        r = rounds[k]
        print(f"round {k + 1}: resident {r['resident']['step_s']:.3f} s, nvme {r['nvme']['step_s']:.3f} s, "
              f"resident-in-bwd {r['resident-in-bwd']['step_s']:.3f} s, nvme-in-bwd {r['nvme-in-bwd']['step_s']:.3f} s, "
              f"write/read {r['bw'][0]:.2f}/{r['bw'][1]:.2f} GB/s; goal ratios {a:.2f}, {b:.2f}")
    # in-bwd: the faster resident step and this row's own bytes, the stricter yardstick
    print(f"nvme / max(resident, io-floor) = {statistics.median(a for a, _ in per_round):.2f} "
          f"(rounds {', '.join(f'{a:.2f}' for a, _ in per_round)}; goal <= 1.25)")
    print(f"nvme-in-bwd / max(min(resident, resident-in-bwd), io-floor-in-bwd) = "
          f"{statistics.median(b for _, b in per_round):.2f} (rounds {', '.join(f'{b:.2f}' for _, b in per_round)}; "
          "goal <= 1.25)")
    print(crc_line)
    print(f"nvme / resident: zeroinf {off['step_s'] / res['step_s']:.2f}", end="")
    if peers and "error" not in ds_res and "error" not in ds_off:
        print(f", deepspeed {ds_off['step_s'] / ds_res['step_s']:.2f}; "
              f"deepspeed-nvme / zeroinf-nvme = {ds_off['step_s'] / off['step_s']:.2f}, "
              f"/ zeroinf-nvme-in-bwd = {ds_off['step_s'] / off_ib['step_s']:.2f}")
    else:
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
