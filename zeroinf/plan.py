"""``zeroinf plan``: the cheapest placement that fits, why, and a ready DeepSpeed-format config.

Placements are tried cheapest first (:data:`LADDER`): no offload (ZeRO stage 0, 1, 2, 3: more
communication, less memory), then the optimizer state on the CPU, then the parameters on the CPU as
well, then NVMe (optimizer first, parameters last). The first whose accelerator, host and NVMe bytes
(:mod:`zeroinf.estimate`) fit the usable memory wins; every rejected one is reported with the tier
that overflowed. The config written passes :func:`zeroinf.config.parse_config` (checked before it
is written), so ``zeroinf train --config`` and ``zeroinf.initialize`` accept it.

With bandwidths (flags — e.g. the GB/s that ``zeroinf tune-io`` prints — or the ``--json`` files of
``bench/aio.py`` and ``bench/cpu_adam.py``) it also prints lower bounds on the step time, per node:

* optimizer: ``params stepped on the node's CPU / Adam rate`` (params/s for the whole host), when the
  optimizer is offloaded;
* NVMe: ``bytes read / read bandwidth + bytes written / write bandwidth`` of the node's swap traffic
  (reads and writes share the device): optimizer on NVMe reads and writes ``K x ceil(P/N)`` per rank;
  parameters on NVMe are read in forward and in backward and written after the step,
  ``Ψp x ceil(P/N)`` each time.

Units: bytes in the API; GB = 1e9 bytes and GB/s = 1e9 bytes/s on the command line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from zeroinf.config import ZeroConfig
from zeroinf.io.atomic import write_text_then_rename
from zeroinf.estimate import (GB, OPTIMIZERS, format_size, PLAN_SWAP, swap_for, PRECISIONS, Estimate, ModelInfo, Placement, SwapBuffers,
                              add_model_arguments, estimate, flag_type, parse_bytes, resolve_model)

__all__ = ["LADDER", "ADAM_BYTES_PER_PARAM", "Limits", "Attempt", "Plan", "check_fit", "choose", "make_config",
           "swap_for", "step_time_bounds", "read_adam_json", "read_nvme_json", "out_target", "add_arguments",
           "main"]

#: Placements from cheapest to most offloaded.
LADDER: Tuple[Placement, ...] = (
    Placement(0), Placement(1), Placement(2), Placement(3),
    Placement(2, "none", "cpu"), Placement(3, "none", "cpu"),
    Placement(3, "cpu", "cpu"),
    Placement(2, "none", "nvme"), Placement(3, "none", "nvme"), Placement(3, "cpu", "nvme"),
    Placement(3, "nvme", "nvme"),
)

#: Bytes one Adam step reads and writes per parameter, as bench/cpu_adam.py counts its GB/s: fp32
#: grads read p, g, m, v (16 B) and write p, m, v (12 B); the offload step reads fp32 master, m, v
#: and a 16-bit grad (14 B) and writes them back with a 16-bit param (14 B). 28 B either way.
ADAM_BYTES_PER_PARAM = 28
#: the engine's default stage3_max_live_parameters (DeepSpeed's too)
MAX_LIVE_PARAMETERS = ZeroConfig.stage3_max_live_parameters
#: without the model's units plan assumes a unit holds at least P / MAX_UNITS parameters, as in a
#: model of 100 equal blocks; real ones gather more at once (the embedding, the persistent unit)
MAX_UNITS = 100


@dataclass(frozen=True)
class Limits:
    """Memory available to training.

    Attributes:
        gpu_mem: bytes per accelerator.
        cpu_mem: bytes of host memory per node.
        nvme: bytes of NVMe swap space per node (0: no NVMe).
        reserve: fraction of each held back (CUDA context, fragmentation, the OS), 0 <= reserve < 1.
        device_is_host: the compute device is the CPU (no accelerator): device and host bytes
            share ``cpu_mem``, and a placement fits only when their sum over the node's ranks does.
    """

    gpu_mem: int
    cpu_mem: int
    nvme: int = 0
    reserve: float = 0.1
    device_is_host: bool = False

    def usable(self, tier: str) -> int:
        total = {"device": self.gpu_mem, "host": self.cpu_mem, "nvme": self.nvme}[tier]
        return int(total * (1.0 - self.reserve))


@dataclass(frozen=True)
class Attempt:
    """One placement tried: its estimate and why it does not fit (empty when it fits)."""

    estimate: Estimate
    reasons: Tuple[str, ...]

    @property
    def fits(self) -> bool:
        return not self.reasons


@dataclass(frozen=True)
class Plan:
    """The outcome: every attempt in ladder order up to the first that fits (``chosen``, or None)."""

    attempts: Tuple[Attempt, ...]
    chosen: Optional[Estimate]
    #: stage 3 without the model's own live-parameter figure: the most parameters the chosen
    #: placement gathers on a device at once, which its config must then cap
    #: (``stage3_max_live_parameters``); None otherwise
    live_params: Optional[int] = None


def check_fit(est: Estimate, limits: Limits) -> Tuple[str, ...]:
    """Reasons ``est`` does not fit ``limits`` (GB = 1e9 bytes in the messages); empty if it fits."""
    reasons = []
    for tier, used, what in (("device", est.per_device_bytes, "per device"),
                             ("host", est.per_host_bytes, "per host"),
                             ("nvme", est.nvme_bytes, "NVMe per node")):
        cap = limits.usable(tier)
        if used > cap:
            if tier == "nvme" and limits.nvme == 0:
                reasons.append(f"needs {format_size(used)} GB of NVMe and --nvme gives none")
            else:
                reasons.append(f"{what} {format_size(used)} GB > {format_size(cap)} GB usable")
    both = est.per_device_bytes * est.gpus_per_node + est.per_host_bytes  # per node
    if limits.device_is_host and not reasons and both > limits.usable("host"):
        reasons.append(f"device + host (one memory: the device is the CPU) {format_size(both)} GB > "
                       f"{format_size(limits.usable('host'))} GB usable")
    return tuple(reasons)


def choose(info: ModelInfo, limits: Limits, *, world_size: int, gpus_per_node: int, precision: str = "bf16",
           optimizer: str = "adam", activations: int = 0, activations_formula: str = "",
           swap: Optional[SwapBuffers] = None) -> Plan:
    """Try :data:`LADDER` in order; stop at the first placement that fits.

    Args:
        info: the model (P, the largest stage-3 unit and the unit sizes, which size the NVMe swap buffers).
        limits: memory per accelerator, per host and NVMe per node.
        world_size, gpus_per_node, precision, optimizer, activations, activations_formula: as
            :func:`zeroinf.estimate.estimate`.
        swap: pinned swap settings (default :func:`swap_for`).

    Returns:
        :class:`Plan`; ``chosen`` is None when nothing fits.

    Without ``info.live_params`` (``--params`` alone: the units are unknown) a stage-3 placement
    counts the parameters it may gather on a device at once as the device memory left over
    allows, at most ``min(P, stage3_max_live_parameters default)`` and at least ``ceil(P /
    MAX_UNITS)`` (a device with less room does not fit); :attr:`Plan.live_params` then says what
    the config must cap. Counting none, parameters on the CPU "fit" in 1 byte of device memory;
    with no floor, in 72 bytes (tester-33 M4).
    """
    swap = swap or swap_for(info, world_size)
    attempts = []
    for pl in LADDER:
        def est_with(live):
            return estimate(info.params, pl, world_size=world_size, gpus_per_node=gpus_per_node, precision=precision,
                            optimizer=optimizer, live_params=live, activations=activations,
                            activations_formula=activations_formula, swap=swap, unit_sizes=info.unit_sizes)
        live = info.live_params
        if live is None and pl.stage == 3:
            prec = PRECISIONS[precision]
            room = (limits.usable("device") - est_with(None).per_device_bytes) // (prec.param_bytes + prec.grad_bytes)
            live = max(-(-info.params // MAX_UNITS), min(info.params, MAX_LIVE_PARAMETERS, room))
        est = est_with(live)
        attempt = Attempt(est, check_fit(est, limits))
        attempts.append(attempt)
        if attempt.fits:
            return Plan(tuple(attempts), est, live if info.live_params is None and pl.stage == 3 else None)
    return Plan(tuple(attempts), None)


def make_config(placement: Placement, *, precision: str = "bf16", micro_batch: int = 1, nvme_path: str = "/local_nvme",
                swap: SwapBuffers = PLAN_SWAP, lr: float = 1e-4, optimizer: str = "adamw",
                max_live_parameters: Optional[int] = None) -> dict:
    """A DeepSpeed-format config dict for ``placement``.

    Holds ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps`` 1, the precision block,
    an ``optimizer`` block (Adam/AdamW), and ``zero_optimization`` with the stage, the offload blocks
    (pinned; NVMe with ``nvme_path``, the swap buffers of ``swap``, and pipelined reads and writes)
    and ``sub_group_size``; at stage 3 with ``max_live_parameters``, ``stage3_max_live_parameters``
    (the engine refuses at start-up a model whose root and largest unit together need more).

    Raises:
        ValueError: an optimizer other than adam/adamw (the engine steps only those).
    """
    if optimizer not in ("adam", "adamw"):
        raise ValueError(f"optimizer: {optimizer!r}: the engine supports only adam and adamw")
    cfg: Dict = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1}
    if precision in ("bf16", "fp16"):
        cfg[precision] = {"enabled": True}
    cfg["optimizer"] = {"type": "AdamW" if optimizer == "adamw" else "Adam",
                        "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}}
    zero: Dict = {"stage": placement.stage, "sub_group_size": swap.sub_group_size}
    if placement.stage == 3 and max_live_parameters is not None:
        zero["stage3_max_live_parameters"] = int(max_live_parameters)
    if placement.offload_optimizer != "none":
        block = {"device": placement.offload_optimizer, "pin_memory": True}
        if placement.offload_optimizer == "nvme":
            block.update(nvme_path=nvme_path, buffer_count=swap.optimizer_buffer_count,
                         pipeline_read=swap.optimizer_pipeline_read, pipeline_write=swap.optimizer_pipeline_write)
        zero["offload_optimizer"] = block
    if placement.offload_param != "none":
        block = {"device": placement.offload_param, "pin_memory": True}
        if placement.offload_param == "nvme":
            block.update(nvme_path=nvme_path, buffer_count=swap.param_buffer_count,
                         buffer_size=swap.param_buffer_size, max_in_cpu=swap.param_max_in_cpu)
        zero["offload_param"] = block
    cfg["zero_optimization"] = zero
    return cfg


def step_time_bounds(est: Estimate, *, adam_params_per_s: Optional[float] = None,
                     nvme_read_gbps: Optional[float] = None, nvme_write_gbps: Optional[float] = None,
                     precision: str = "bf16", optimizer: str = "adam") -> Dict[str, Tuple[float, str]]:
    """Lower bounds on one optimizer step's time, seconds, per node, with their formulas.

    Args:
        est: the placement's estimate (P, N, gpus per node).
        adam_params_per_s: CPU Adam rate of the whole host, parameters per second.
        nvme_read_gbps, nvme_write_gbps: NVMe bandwidth of the node, GB/s (1e9 bytes/s).

    Returns:
        ``{"optimizer": (seconds, formula), "nvme": (seconds, formula)}``, each present only when it
        applies to the placement and its rate is known.
    """
    out: Dict[str, Tuple[float, str]] = {}
    pl = est.placement
    n, gpn = est.world_size, est.gpus_per_node
    shard = -(-est.params // n)
    part = shard if pl.stage >= 1 else est.params
    if pl.offload_optimizer != "none" and adam_params_per_s:
        stepped = part * gpn
        out["optimizer"] = (stepped / adam_params_per_s,
                            f"{gpn} ranks x {part:,} params / {adam_params_per_s:.3g} params/s")
    read = write = 0
    k = 4 + OPTIMIZERS[optimizer]
    psize = PRECISIONS[precision].param_bytes
    if pl.offload_optimizer == "nvme":
        read += k * part
        write += k * part
    if pl.offload_param == "nvme":
        read += 2 * psize * shard
        write += psize * shard
    if (read or write) and nvme_read_gbps and nvme_write_gbps:
        read, write = read * gpn, write * gpn
        secs = read / (nvme_read_gbps * GB) + write / (nvme_write_gbps * GB)
        out["nvme"] = (secs, f"read {format_size(read)} GB / {nvme_read_gbps:.3g} GB/s + "
                             f"write {format_size(write)} GB / {nvme_write_gbps:.3g} GB/s")
    return out


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
    path = Path(out).absolute()  # "." has no name to add ".tmp" to (a traceback: helper-46 t06)
    # the rename failed and left OUT.tmp behind; "newdir/" wrote a file named newdir (helper-48 P9)
    if not str(out).strip():
        raise ValueError(f"--out {out!r}: is empty; give a file name")
    if path.is_dir() or str(out).endswith(("/", os.sep)):
        raise ValueError(f"--out {out!r}: is a folder; give a file name")
    # /dev/stdout, /dev/fd/1, /proc/self/fd/1: the rename replaced the shell's redirect target and
    # the report went to the deleted copy (tester-33 H1, tester-34 N1); /proc holds no config files
    hop, seen = str(path), 0
    while seen < 40:
        if os.path.abspath(hop).startswith("/proc/") or os.path.realpath(os.path.dirname(hop)).startswith("/proc/"):
            raise ValueError(f"--out {out!r}: is under /proc ({hop}: a process's open file or a kernel file); "
                             "give a file path")
        if not os.path.islink(hop):
            break
        hop, seen = os.path.join(os.path.dirname(hop), os.readlink(hop)), seen + 1
    if path.is_symlink():  # it was replaced by a regular file (tester-32 r09)
        target = Path(os.path.realpath(path))
        if target.is_symlink():
            raise ValueError(f"--out {out!r}: is a symbolic link loop")
        if not target.parent.is_dir():
            raise ValueError(f"--out {out!r}: is a symbolic link to {os.readlink(path)}, whose folder "
                             f"{target.parent} {'is not a directory' if os.path.lexists(target.parent) else 'does not exist'}")
        _check_regular(out, target)
        return target
    # a file on the way made mkdir say "[Errno 17] File exists" (tester-32 r09)
    parent = next(p for p in path.parents if os.path.lexists(p))
    if not parent.is_dir():
        raise ValueError(f"--out {out!r}: {parent} is not a directory")
    _check_regular(out, path)
    return path


def _check_regular(out: str, target: Path) -> None:
    """Refuse an existing ``target`` that is not a regular file: the config is written next to it
    and renamed over it, which replaced /dev/null (run as root), a FIFO or the file behind
    /dev/stdout with a regular file (tester-33 H1)."""
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
            if size <= 0 and flag != "--nvme":  # --gpu-mem 0 "fit" a 7B model at 0.00 GB per device (tester-30 t13)
                raise ValueError(f"{flag}: must be more than 0 bytes, got {size}: nothing runs in no memory")
            if 0 < size < 2**20:  # "--gpu-mem 80" is 80 bytes: nothing fitted, and nothing said why (tester-41 F6)
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
                  optimizer=args.optimizer, activations=act, activations_formula=act_formula, swap=swap)
    # the live parameters counted are the config's cap: plan's own figure (--params alone) or the
    # user's --live-params (counted and not written, 1 "fit" in 72 bytes: tester-34 N3)
    written_live = plan.live_params
    if written_live is None and args.live_params is not None and plan.chosen is not None \
            and plan.chosen.placement.stage == 3:
        written_live = args.live_params
    if plan.chosen is not None:  # written before anything is printed: a reader of stdout that goes
        # away (zeroinf plan | head -1) ends the output, not the file
        cfg = make_config(plan.chosen.placement, precision=precision, micro_batch=args.micro_batch,
                          nvme_path=args.nvme_path, swap=swap, lr=args.lr, optimizer=args.optimizer,
                          max_live_parameters=written_live)
        parse_config(cfg, world_size=n)  # the engine's own validation; a failure here is a bug in make_config
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            write_text_then_rename(out, json.dumps(cfg, indent=2) + "\n")  # keeps a replaced file's mode (tester-34)
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
          f"params -> CPU, NVMe)")
    for t in plan.chosen.terms:
        print(f"  {t.tier:<6} {format_size(t.bytes):>12} GB per rank  {t.name}: {t.formula}")
    if plan.live_params is not None:
        print(f"(stage 3 without the model's units: a device gathers at most {plan.live_params:,} parameters at once, "
              f"what its memory leaves room for (at most min(P, {MAX_LIVE_PARAMETERS:,}), at least "
              f"P/{MAX_UNITS}, as if the model had {MAX_UNITS} equal blocks), written as "
              "stage3_max_live_parameters; the engine refuses at start-up a model whose root and largest unit "
              "together need more (persistent parameters are not counted). "
              "Give --model or --live-params to count the model's own)")
    if plan.live_params is None and written_live is not None:
        print(f"(stage 3: --live-params {written_live:,} written as stage3_max_live_parameters; the engine refuses at "
              "start-up a model whose root and largest unit together need more)")
    for note in notes:
        print(note)
    if "nvme" in (pl.offload_param, pl.offload_optimizer) and not os.path.isdir(args.nvme_path):
        print(f"note: nvme_path {args.nvme_path} (--nvme-path) does not exist on this machine; the engine creates "
              "it, so point it at a fast local disk with room, or give --nvme-path DIR")
    bounds = step_time_bounds(plan.chosen, adam_params_per_s=adam, nvme_read_gbps=rd, nvme_write_gbps=wr,
                              precision=precision, optimizer=args.optimizer)
    for what, (secs, formula) in bounds.items():
        print(f"step time >= {secs:.3g} s set by {what}: {formula}")
    if pl.offload_optimizer != "none" and "optimizer" not in bounds:
        print("(give --adam-gbps, --adam-params-per-s or --adam-json for the optimizer's lower bound)")
    if "nvme" in (pl.offload_optimizer, pl.offload_param) and "nvme" not in bounds:
        print("(give --nvme-bw or --nvme-json for the NVMe lower bound)")
    link = Path(args.out).absolute()
    print(f"wrote {out}" if link == out else f"wrote {out} (through the link {link})")
    return 0
