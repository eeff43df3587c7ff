"""CPU Adam step: zeroinf against torch's fused and foreach AdamW (and DeepSpeedCPUAdam if importable).

Two workloads, each as one tensor and as many equal tensors (default 100M parameters as 1x100M
and 100x1M):

* ``fp32``: fp32 params, fp32 grads, fp32 moments. zeroinf runs CPUAdam.
* ``offload-bf16``: the step an offload engine runs: fp32 master + moments, bf16 gradients in,
  bf16 parameters out. zeroinf runs CPUAdam on bf16 parameters (fp32 master in its state: one
  fused pass); the peers cast the grads to fp32, step, and cast the params back, as separate
  passes.

Every row reports the median ms/step (after warm-up), params/s and the effective bandwidth over
the 28 bytes per parameter a single pass must move (fp32: read g,p,m,v + write p,m,v;
offload: read g16,p,m,v + write p,m,v,p16). ``roof-rmw`` is a STREAM-style read-modify-write
with those same loads and stores per parameter over ONE flat buffer of each kind holding all n
parameters, in one parallel region (zeroinf.optim.stream_rmw): the bandwidth ceiling of the
layout-free pass, measured in the same run; no per-tensor cost enters it. Within a workload and layout the implementations are timed
in round-robin rounds (bench/_util.time_interleaved), so a shared machine's drift falls on all
alike; before every call a 256 MiB buffer is rewritten (untimed), so each starts with its
data out of cache whatever ran before it (at 1M parameters, 28 MB, the data fits a 32 MiB L3,
and a step found the parameters and gradients its predecessor had left there). Ratios (``x torch-fused``, ``x roof``, and the summary's zeroinf over the
fastest peer) are same-run ratios; only those are comparable across machines.

    python bench/cpu_adam.py [--n 100000000] [--tensors 100] [--json out.json]
"""
from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import Row, bench_parser, evict_caches, machine_line, print_table, time_interleaved, write_json  # noqa: E402

import zeroinf.optim as zo  # noqa: E402

BYTES_PER_PARAM = 28
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


def _deepspeed_cls():
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as exc:  # not installed, or its op fails to build: the rows are skipped
        print(f"DeepSpeedCPUAdam rows skipped: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return None
    return DeepSpeedCPUAdam


def _make_params(sizes, dtype):
    params = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in sizes]
    for p in params:
        p.grad = (torch.randn(p.shape) * 1e-2).to(dtype)
    return params


def _peer_makers(ds_cls):
    peers = [("torch-fused", lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)),
             ("torch-foreach", lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=True))]
    if ds_cls is not None:
        peers.append(("deepspeed", lambda ps: ds_cls(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)))
    return peers


def _rows(fns, workload, layout, n, args):
    secs = time_interleaved(fns, repeat=args.repeat, warmup=args.warmup, before=evict_caches)
    return [Row(name, workload, layout, 1e3 * s, BYTES_PER_PARAM * n / s / 1e9, {"params_per_s": n / s})
            for name, s in secs.items()]


def bench_fp32(sizes, layout, args, ds_cls):
    """fp32 params and grads; every implementation steps the same parameter tensors."""
    n = sum(sizes)
    params = _make_params(sizes, torch.float32)
    ms = [torch.zeros(s) for s in sizes]
    vs = [torch.zeros(s) for s in sizes]
    flat = [torch.randn(n), torch.randn(n) * 1e-2, torch.zeros(n), torch.zeros(n)]
    fns = {"roof-rmw": lambda: zo.stream_rmw(*flat),
           "zeroinf": zo.CPUAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD).step}
    for name, make in _peer_makers(ds_cls):
        fns[name] = make(params).step
    return _rows(fns, "fp32", layout, n, args)


def bench_offload(sizes, layout, args, ds_cls):
    """fp32 master, bf16 grads in, bf16 params out.

    zeroinf: CPUAdam over bf16 parameters with bf16 grads (fp32 master in its state, one pass).
    Peers: fp32 master parameters; cast the grads in, step, cast the params out (three passes).
    The roof reads and writes the same bytes per parameter as zeroinf's single pass.
    """
    n = sum(sizes)
    grads16 = [(torch.randn(s) * 1e-2).to(torch.bfloat16) for s in sizes]
    out16 = [torch.zeros(s, dtype=torch.bfloat16) for s in sizes]
    master = [torch.randn(s) for s in sizes]
    ms = [torch.zeros(s) for s in sizes]
    vs = [torch.zeros(s) for s in sizes]
    p16 = [torch.nn.Parameter(torch.randn(s).to(torch.bfloat16)) for s in sizes]
    for p, g in zip(p16, grads16):
        p.grad = g
    fp32_params = [torch.nn.Parameter(m) for m in master]
    for p in fp32_params:
        p.grad = torch.zeros(p.shape)

    def casting_step(opt):
        def step():
            for p, g in zip(fp32_params, grads16):
                p.grad.copy_(g)
            opt.step()
            for p, o in zip(fp32_params, out16):
                o.copy_(p.detach())
        return step

    flat = [torch.randn(n), (torch.randn(n) * 1e-2).to(torch.bfloat16), torch.zeros(n), torch.zeros(n)]
    flat_out = torch.zeros(n, dtype=torch.bfloat16)
    fns = {"roof-rmw": lambda: zo.stream_rmw(*flat, params_out=flat_out),
           "zeroinf": zo.CPUAdam(p16, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD).step}
    for name, make in _peer_makers(ds_cls):
        fns[name] = casting_step(make(fp32_params))
    return _rows(fns, "offload-bf16", layout, n, args)


def main() -> int:
    parser = bench_parser(__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000_000, help="parameters in all (default 100M)")
    parser.add_argument("--tensors", type=int, default=100, help="tensors in the split layout (default 100)")
    parser.add_argument("--workload", choices=["fp32", "offload-bf16", "both"], default="both")
    args = parser.parse_args()
    threads = torch.get_num_threads()
    info = zo.isa_info()
    print(machine_line())
    print(f"torch {torch.__version__}, {threads} threads, zeroinf Adam path: {info['chosen']}, "
          f"n={args.n:,}, median of {args.repeat} interleaved rounds after {args.warmup} warm-up")
    ds_cls = _deepspeed_cls()
    layouts = [([args.n], f"1x{_human(args.n)}")]
    if args.tensors > 1:
        each = args.n // args.tensors
        layouts.append(([each] * args.tensors, f"{args.tensors}x{_human(each)}"))
    rows = []
    for sizes, layout in layouts:
        if args.workload in ("fp32", "both"):
            rows += bench_fp32(sizes, layout, args, ds_cls)
            gc.collect()
        if args.workload in ("offload-bf16", "both"):
            rows += bench_offload(sizes, layout, args, ds_cls)
            gc.collect()
    print()
    print_table(rows, peer="torch-fused", roof="roof-rmw", extra_columns=("params_per_s",))
    print()
    _print_summary(rows)
    roof = next(r for r in rows if r.name == "roof-rmw")
    write_json(args.json, {"n": args.n, "threads": threads, "roof_gbps": roof.gbps}, rows)
    return 0


def _print_summary(rows) -> None:
    """Per workload and layout: zeroinf's speed over the fastest peer's and over the roof's."""
    groups = {}
    for r in rows:
        groups.setdefault((r.workload, r.layout), {})[r.name] = r.ms
    for (workload, layout), ms in groups.items():
        best = min((name for name in ms if name not in ("zeroinf", "roof-rmw")), key=ms.get)
        print(f"{workload:<14} {layout:<10} zeroinf x {best} (fastest peer) {ms[best] / ms['zeroinf']:.3f}, "
              f"x roof {ms['roof-rmw'] / ms['zeroinf']:.3f}")


def _human(n: int) -> str:
    for unit, scale in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


if __name__ == "__main__":
    sys.exit(main())
