"""``zeroinf plan``: the cheapest placement that fits (:mod:`zeroinf.placement`), why, and a ready
DeepSpeed-format config. The config written passes :func:`zeroinf.config.parse_config` (checked
before it is written), so ``zeroinf train --config`` and ``zeroinf.initialize`` accept it.

Bandwidths (flags — e.g. the GB/s that ``zeroinf tune-io`` prints — or the ``--json`` files of
``bench/aio.py`` and ``bench/cpu_adam.py``) add lower bounds on the step time
(:func:`zeroinf.placement.step_time_bounds`).

Units: GB = 1e9 bytes and GB/s = 1e9 bytes/s on the command line.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import stat
import sys
from pathlib import Path
from typing import List, Optional, Tuple

from zeroinf.cli.estimate import add_model_arguments, flag_type, resolve_model
from zeroinf.estimate import GB, format_size, parse_bytes, swap_for
from zeroinf.io.atomic import write_text_then_rename
from zeroinf.placement import ADAM_BYTES_PER_PARAM, MAX_LIVE_PARAMETERS, MAX_UNITS, Limits, choose, make_config, \
    step_time_bounds

__all__ = ["read_adam_json", "read_nvme_json", "out_target", "add_arguments", "main"]


def _load_json(path: str, what: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{what} {path}: cannot read JSON: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list) or not data["rows"]:
        raise ValueError(f"{what} {path}: expected an object with a non-empty 'rows' list "
                         f"(bench/_util.py's JSON layout)")
    for i, row in enumerate(data["rows"]):
        if not isinstance(row, dict) or not all(k in row for k in ("name", "workload", "gbps", "ms")):
            raise ValueError(f"{what} {path}: rows[{i}] lacks name/workload/ms/gbps")
    return data


def _ours_first(rows: List[dict]) -> List[dict]:
    ours = [r for r in rows if str(r["name"]).startswith("zeroinf")]
    return ours or rows


def read_nvme_json(path: str) -> Tuple[float, float, str]:
    """Best read and write GB/s in a ``bench/aio.py --json`` file (bench/_util.py's layout).

    zeroinf's own rows (``name`` starting with "zeroinf") are used when present, else all rows.

    Returns:
        ``(read_gbps, write_gbps, note)``.

    Raises:
        ValueError: unreadable file, wrong layout, or no "read" / "write" rows.
    """
    rows = _ours_first(_load_json(path, "--nvme-json")["rows"])
    best = {}
    for workload in ("read", "write"):
        sel = [r for r in rows if r["workload"] == workload]
        if not sel:
            raise ValueError(f"--nvme-json {path}: no row with workload {workload!r}")
        best[workload] = max(sel, key=lambda r: float(r["gbps"]))
    note = "; ".join(f"{w} {r['gbps']:.3g} GB/s ({r['name']}, {r.get('layout', '')})" for w, r in best.items())
    return float(best["read"]["gbps"]), float(best["write"]["gbps"]), note


def read_adam_json(path: str) -> Tuple[float, str]:
    """CPU Adam rate in params/s from a ``bench/cpu_adam.py --json`` file.

    Uses zeroinf's rows when present, the offload workload (name containing "offload") when present,
    and the fastest of those: a row's ``params_per_s`` if given, else ``n / (ms / 1000)`` with
    ``n`` the file's parameter count.

    Raises:
        ValueError: unreadable file, wrong layout, or no ``n`` and no ``params_per_s``.
    """
    data = _load_json(path, "--adam-json")
    rows = _ours_first(data["rows"])
    rows = [r for r in rows if "offload" in str(r["workload"])] or rows

    def rate(r):
        if "params_per_s" in r:
            return float(r["params_per_s"])
        if not isinstance(data.get("n"), int) or float(r["ms"]) <= 0:
            raise ValueError(f"--adam-json {path}: needs 'n' (params per step) and ms > 0, or params_per_s per row")
        return data["n"] / (float(r["ms"]) / 1e3)

    best = max(rows, key=rate)
    return rate(best), f"{best['name']} {best['workload']} {best.get('layout', '')}: {rate(best):.3g} params/s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``zeroinf plan``."""
    add_model_arguments(parser)
    parser.add_argument("--optimizer", choices=["adam", "adamw"], default="adamw", help="default adamw")
    mem = parser.add_argument_group("memory (1G = 1GB = 1e9 bytes, 1GiB = 2**30 bytes; also K, M, T)")
    mem.add_argument("--gpu-mem", type=flag_type(parse_bytes), required=True, help="per accelerator, e.g. 80GB")
    mem.add_argument("--cpu-mem", type=flag_type(parse_bytes), required=True, help="host memory per node, e.g. 1TB")
    mem.add_argument("--nvme", type=flag_type(parse_bytes), default=0, help="NVMe space per node, e.g. 8TB (default: none)")
    mem.add_argument("--reserve", type=float, default=0.1,
                     help="fraction of each memory held back for the CUDA context, fragmentation and the OS "
                          "(default 0.1)")
    bw = parser.add_argument_group("bandwidths, for step-time lower bounds")
    bw.add_argument("--nvme-bw", type=float, help="NVMe GB/s per node, read and write (e.g. from zeroinf tune-io)")
    bw.add_argument("--nvme-json", help="bench/aio.py --json file: its best zeroinf read and write GB/s")
    bw.add_argument("--adam-gbps", type=float,
                    help=f"CPU Adam effective GB/s of the host ({ADAM_BYTES_PER_PARAM} B per param, as bench/cpu_adam.py)")
    bw.add_argument("--adam-params-per-s", type=float, help="CPU Adam params/s of the host")
    bw.add_argument("--adam-json", help="bench/cpu_adam.py JSON")
    out = parser.add_argument_group("config written")
    out.add_argument("--out", default="zeroinf_plan.json",
                     help="path of the config (default zeroinf_plan.json); missing folders are made; a symbolic "
                          "link is written through to its target, whose folder must exist")
    out.add_argument("--nvme-path", default="/local_nvme", help="nvme_path in the config (default /local_nvme)")
    out.add_argument("--lr", type=float, default=1e-4, help="optimizer lr in the config (default 1e-4)")


def out_target(out: str) -> Path:
    """The file ``zeroinf plan --out OUT`` writes: ``OUT`` made absolute, or, when ``OUT`` is a
    symbolic link (dangling or not), the file it points to, so the link stays a link (as shell
    redirection writes through one; GNU cp refuses a dangling one). Nothing is created here.

    Raises:
        ValueError: naming ``--out``: ``OUT`` is empty, ends in a separator or is a folder; a link
            loops or points into a folder that does not exist; a folder on the way is a file.
    """
    # absolute: "." has no name to add ".tmp" to. An empty OUT or a folder is refused before any
    # write: the rename would fail and leave OUT.tmp behind, and "newdir/" would become a file
    path = Path(out).absolute()
    if not str(out).strip():
        raise ValueError(f"--out {out!r}: is empty; give a file name")
    if path.is_dir() or str(out).endswith(("/", os.sep)):
        raise ValueError(f"--out {out!r}: is a folder; give a file name")
    # /dev/stdout, /dev/fd/1, /proc/self/fd/1: the rename would replace the shell's redirect target
    # and the report would go to the deleted copy; /proc holds no config files
    hop, seen = str(path), 0
    while seen < 40:
        if os.path.abspath(hop).startswith("/proc/") or os.path.realpath(os.path.dirname(hop)).startswith("/proc/"):
            raise ValueError(f"--out {out!r}: is under /proc ({hop}: a process's open file or a kernel file); "
                             "give a file path")
        if not os.path.islink(hop):
            break
        hop, seen = os.path.join(os.path.dirname(hop), os.readlink(hop)), seen + 1
    if path.is_symlink():  # written through, so the link stays a link
        target = Path(os.path.realpath(path))
        if target.is_symlink():
            raise ValueError(f"--out {out!r}: is a symbolic link loop")
        if not target.parent.is_dir():
            raise ValueError(f"--out {out!r}: is a symbolic link to {os.readlink(path)}, whose folder "
                             f"{target.parent} {'is not a directory' if os.path.lexists(target.parent) else 'does not exist'}")
        _check_regular(out, target)
        return target
    # a file on the way is named here, not left to mkdir's bare "[Errno 17] File exists"
    parent = next(p for p in path.parents if os.path.lexists(p))
    if not parent.is_dir():
        raise ValueError(f"--out {out!r}: {parent} is not a directory")
    _check_regular(out, path)
    return path


def _check_regular(out: str, target: Path) -> None:
    """Refuse an existing ``target`` that is not a regular file: the config is written next to it
    and renamed over it, which would replace /dev/null (run as root), a FIFO or the file behind
    /dev/stdout with a regular file."""
    mode = os.stat(target).st_mode if os.path.lexists(target) else None
    if mode is not None and not stat.S_ISREG(mode):
        kind = next((k for test, k in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                                      (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")) if test(mode)),
                    "not a regular file")
        shown = "" if str(target) == str(Path(out).absolute()) else f" (through the link to {target})"
        raise ValueError(f"--out {out!r}: is {kind}{shown}; the config is written to a regular file, "
                         "give a file path")


def _bandwidths(args) -> Tuple[Optional[float], Optional[float], Optional[float], List[str]]:
    notes = []
    rd = wr = adam = None
    if args.nvme_bw is not None and args.nvme_json:
        raise ValueError("--nvme-bw and --nvme-json: give one")
    if args.nvme_bw is not None:
        if args.nvme_bw <= 0:
            raise ValueError(f"--nvme-bw: must be positive, got {args.nvme_bw}")
        rd = wr = args.nvme_bw
    elif args.nvme_json:
        rd, wr, note = read_nvme_json(args.nvme_json)
        notes.append(f"NVMe from {args.nvme_json}: {note}")
    given = [a for a in ("adam_gbps", "adam_params_per_s", "adam_json") if getattr(args, a) is not None]
    if len(given) > 1:
        raise ValueError(f"{', '.join('--' + g.replace('_', '-') for g in given)}: give one")
    if args.adam_gbps is not None:
        if args.adam_gbps <= 0:
            raise ValueError(f"--adam-gbps: must be positive, got {args.adam_gbps}")
        adam = args.adam_gbps * GB / ADAM_BYTES_PER_PARAM
    elif args.adam_params_per_s is not None:
        if args.adam_params_per_s <= 0:
            raise ValueError(f"--adam-params-per-s: must be positive, got {args.adam_params_per_s}")
        adam = args.adam_params_per_s
    elif args.adam_json:
        adam, note = read_adam_json(args.adam_json)
        notes.append(f"CPU Adam from {args.adam_json}: {note}")
    return rd, wr, adam, notes


def main(args: argparse.Namespace) -> int:
    """Run ``zeroinf plan``: 0 when a placement fits and its config was written, 1 when none fits,
    2 on a usage error."""
    from zeroinf.config import parse_config

    try:
        if not 0 <= args.reserve < 1:
            raise ValueError(f"--reserve: must be in [0, 1), got {args.reserve}")
        if not (math.isfinite(args.lr) and args.lr >= 0):
            raise ValueError(f"--lr: must be a finite number >= 0, got {args.lr}")
        for flag, size in (("--gpu-mem", args.gpu_mem), ("--cpu-mem", args.cpu_mem), ("--nvme", args.nvme)):
            if size <= 0 and flag != "--nvme":  # with 0 bytes a 7B model would "fit" at 0.00 GB
                raise ValueError(f"{flag}: must be more than 0 bytes, got {size}: nothing runs in no memory")
            if 0 < size < 2**20:  # "--gpu-mem 80" is 80 bytes: a forgotten unit
                hint = f"{size}GB or {size}GiB" if size < 10**4 else "80GB or 512GiB"
                raise ValueError(f"{flag}: {size} bytes is less than 1 MiB; give a unit (e.g. {hint})")
        info, act, act_formula = resolve_model(args)
        rd, wr, adam, notes = _bandwidths(args)
        out = out_target(args.out)
    except (ValueError, OSError) as exc:
        print(f"zeroinf plan: error: {exc}", file=sys.stderr)
        return 2
    precision = args.precision or "bf16"
    n = args.gpus * args.nodes
    limits = Limits(gpu_mem=args.gpu_mem, cpu_mem=args.cpu_mem, nvme=args.nvme, reserve=args.reserve)
    swap = swap_for(info, n)
    plan = choose(info, limits, world_size=n, gpus_per_node=args.gpus, precision=precision,
                  optimizer=args.optimizer, activations=act, activations_formula=act_formula, swap=swap,
                  state_dtype=args.state_dtype or "fp32")
    # the live parameters counted are the config's cap: plan's own figure (--params alone) or the
    # user's --live-params, which is written too (counted and not written, the engine would gather
    # more than the estimate counted)
    written_live = plan.live_params
    if written_live is None and args.live_params is not None and plan.chosen is not None \
            and plan.chosen.placement.stage == 3:
        written_live = args.live_params
    if plan.chosen is not None:  # written before anything is printed: a reader of stdout that goes
        # away (zeroinf plan | head -1) ends the output, not the file
        cfg = make_config(plan.chosen.placement, precision=precision, micro_batch=args.micro_batch,
                          nvme_path=args.nvme_path, swap=swap, lr=args.lr, optimizer=args.optimizer,
                          max_live_parameters=written_live, state_dtype=args.state_dtype or "fp32")
        parse_config(cfg, world_size=n)  # the engine's own validation; a failure here is a bug in make_config
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            write_text_then_rename(out, json.dumps(cfg, indent=2) + "\n")  # keeps a replaced file's mode
        except OSError as exc:
            print(f"zeroinf plan: error: cannot write {out}: {exc}", file=sys.stderr)
            return 2
    print(f"model {info.name}: P = {info.params:,}; N = {n} ({args.gpus} per node x {args.nodes} nodes); {precision}")
    print(f"usable (after reserving {args.reserve:.0%}): {format_size(limits.usable('device'))} GB per device, "
          f"{format_size(limits.usable('host'))} GB per host, {format_size(limits.usable('nvme'))} GB NVMe per node "
          f"(GB = 1e9 bytes)" + (f"; activations {format_size(act)} GB per device" if act else ""))
    for a in plan.attempts:
        verdict = "fits" if a.fits else "no: " + "; ".join(a.reasons)
        e = a.estimate
        print(f"  {e.placement.label()}: device {format_size(e.per_device_bytes)}, host "
              f"{format_size(e.per_host_bytes)}, NVMe {format_size(e.nvme_bytes)} GB -> {verdict}")
    if plan.chosen is None:
        print("nothing fits: give more accelerators, host memory or NVMe, a smaller micro-batch or sequence, "
              "or activation checkpointing; no config written")
        return 1
    pl = plan.chosen.placement
    print(f"chosen: {pl.label()} (the first that fits, in order: no offload, optimizer -> CPU, "
          f"params -> CPU, NVMe; with parameters offloaded, the smallest offload_param.ratio that fits)")
    for t in plan.chosen.terms:
        print(f"  {t.tier:<6} {format_size(t.bytes):>12} GB per rank  {t.name}: {t.formula}")
    if plan.live_params is not None:
        print(f"(stage 3 without the model's units: a device gathers at most {plan.live_params:,} parameters at once, "
              f"what its memory leaves room for (at most min(P, {MAX_LIVE_PARAMETERS:,}), at least "
              f"P/{MAX_UNITS}, as if the model had {MAX_UNITS} equal blocks), written as "
              "stage3_max_live_parameters; a model whose root and largest unit together need more runs at "
              "that sum, which the engine takes with a warning (persistent parameters are not counted). "
              "Give --model or --live-params to count the model's own)")
    if plan.live_params is None and written_live is not None:
        print(f"(stage 3: --live-params {written_live:,} written as stage3_max_live_parameters; a model whose root "
              "and largest unit together need more runs at that sum, which the engine takes with a warning)")
    for note in notes:
        print(note)
    if "nvme" in (pl.offload_param, pl.offload_optimizer) and not os.path.isdir(args.nvme_path):
        print(f"note: nvme_path {args.nvme_path} (--nvme-path) does not exist on this machine; the engine creates "
              "it, so point it at a fast local disk with room, or give --nvme-path DIR")
    bounds = step_time_bounds(plan.chosen, adam_params_per_s=adam, nvme_read_gbps=rd, nvme_write_gbps=wr,
                              precision=precision, optimizer=args.optimizer, state_dtype=args.state_dtype or "fp32")
    for what, (secs, formula) in bounds.items():
        print(f"step time >= {secs:.3g} s set by {what}: {formula}")
    if pl.offload_optimizer != "none" and "optimizer" not in bounds:
        print("(give --adam-gbps, --adam-params-per-s or --adam-json for the optimizer's lower bound)")
    if "nvme" in (pl.offload_optimizer, pl.offload_param) and "nvme" not in bounds:
        print("(give --nvme-bw or --nvme-json for the NVMe lower bound)")
    link = Path(args.out).absolute()
    print(f"wrote {out}" if link == out else f"wrote {out} (through the link {link})")
    return 0
