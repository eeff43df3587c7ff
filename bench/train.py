"""The yardstick: ``zeroinf train`` on the peers' model, with and without offload, vs its peers.

Model and data as in ``/work/shared/peers/deepspeed_train.py``: Llama from a transformers config
(hidden 768, 12 layers, 12 heads, intermediate 2048, vocabulary 256: 85,347,072 parameters), random
init, sequence 256, micro-batch 4, AdamW lr 1e-4, weight decay 0.01, clipping 1.0, on the bytes of
the Python standard library. Each row is one ``zeroinf train`` subprocess (so peak RSS is its own);
its median step time over steps 2..N is read from the run's ``summary.json``.

Rows: ``zeroinf-<offload>`` for each ``--offloads`` entry, ``torch`` (plain PyTorch +
torch.optim.AdamW, ``--engine torch``), and ``deepspeed-<a|d>`` through the peers script when
``import deepspeed`` works in this interpreter (skipped otherwise; never installed here). The table
prints each row's throughput relative to ``zeroinf-none`` measured in the same run.

    python bench/train.py --steps 8 --dtype bf16 --json /tmp/train.json
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import Row, bench_parser, machine_line, print_table, write_json  # noqa: E402

PEERS = Path(os.environ.get("ZEROINF_PEERS", "/work/shared/peers")) / "deepspeed_train.py"


def _zeroinf_row(name, extra_args, args, workdir) -> Row:
    out = Path(workdir) / name
    cmd = [sys.executable, "-m", "zeroinf", "train", "--size", "yardstick", "--seq-len", str(args.seq_len),
           "--micro-batch", str(args.micro_batch), "--steps", str(args.steps), "--lr", "1e-4",
           "--dtype", args.dtype, "--seed", "0", "--out", str(out), "--no-plot", *extra_args]
    if args.nvme_path:
        cmd += ["--nvme-path", str(Path(args.nvme_path) / name)] if "--offload" in extra_args and \
            extra_args[extra_args.index("--offload") + 1] in ("nvme-optimizer", "infinity") else []
    print("$", " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"  {name}: failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}", flush=True)
        return None
    s = json.loads((out / "summary.json").read_text())
    recs = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    moved = [r["engine"].get("nvme_read_bytes", 0) + r["engine"].get("nvme_write_bytes", 0) for r in recs[1:]]
    io_gbps = (sum(moved) / len(moved)) / s["median_step_s"] / 1e9 if moved else 0.0
    return Row(name=name, workload=args.dtype, layout=f"s{args.seq_len} mb{args.micro_batch}",
               ms=1e3 * s["median_step_s"], gbps=io_gbps,
               extra={"tokens_per_s": s["tokens_per_s"], "peak_rss_gib": s["peak_rss_bytes"] / 2**30,
                      "loss_last": recs[-1]["loss"], "io_wait_s": s["io_wait_s"], "optimizer_s": s["optimizer_s"]})


def _deepspeed_row(config, args, workdir) -> Row:
    out = Path(workdir) / f"ds_{config}.json"
    cmd = [sys.executable, str(PEERS), "--config", config, "--dtype", args.dtype, "--steps", str(args.steps),
           "--mb", str(args.micro_batch), "--seq", str(args.seq_len), "--out", str(out),
           "--nvme-path", str(Path(args.nvme_path or workdir) / "ds-nvme")]
    print("$", " ".join(cmd[1:]), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"  deepspeed-{config}: failed (exit {proc.returncode})", flush=True)
        return None
    r = json.loads(out.read_text())
    return Row(name=f"deepspeed-{config}", workload=args.dtype, layout=f"s{args.seq_len} mb{args.micro_batch}",
               ms=1e3 * r["median_step_s_5_to_N"], gbps=0.0,
               extra={"tokens_per_s": r["tokens_per_s"], "peak_rss_gib": r["peak_rss_bytes"] / 2**30,
                      "loss_last": r["loss_N"]})


def main() -> int:
    p = bench_parser("zeroinf train on the yardstick model vs no offload, plain PyTorch and DeepSpeed",
                     repeat=1, warmup=0)
    p.add_argument("--steps", type=int, default=8, help="training steps per row (median over 2..N)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--offloads", default="none,infinity", help="comma-separated --offload presets to run")
    p.add_argument("--nvme-path", default=None, help="swap directory for the NVMe rows (default: a temp dir)")
    p.add_argument("--no-torch", action="store_true", help="skip the plain PyTorch row")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every row this many times, interleaved, and keep each row's fastest round "
                        "(shared machines drift between rows)")
    args = p.parse_args()
    print(machine_line())
    best = {}
    have_ds = importlib.util.find_spec("deepspeed") is not None and PEERS.is_file()
    if not have_ds:
        print("deepspeed: not importable here; its rows are skipped")
    for _ in range(args.rounds):
        got = []
        with tempfile.TemporaryDirectory(prefix="zeroinf-bench-train-", dir=os.getcwd()) as work:
            for off in [o for o in args.offloads.split(",") if o]:
                got.append(_zeroinf_row(f"zeroinf-{off}", ["--offload", off], args, work))
            if not args.no_torch:
                got.append(_zeroinf_row("torch", ["--engine", "torch"], args, work))
            if have_ds:
                for config in ("a", "d"):
                    got.append(_deepspeed_row(config, args, work))
        for r in got:
            if r is not None and (r.name not in best or r.ms < best[r.name].ms):
                best[r.name] = r
    rows = list(best.values())
    print_table(rows, peer="zeroinf-none")
    print(f"{'name':<22} {'tokens/s':>9} {'peak RSS GiB':>13} {'last loss':>10}")
    for r in rows:
        print(f"{r.name:<22} {r.extra['tokens_per_s']:9.1f} {r.extra['peak_rss_gib']:13.2f} {r.extra['loss_last']:10.4f}")
    write_json(args.json, {"model": "yardstick", "params": 85347072, "steps": args.steps, "dtype": args.dtype}, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
