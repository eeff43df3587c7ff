"""``zeroinf estimate``: memory per device, host and NVMe for every placement (or a config's), as a
table or JSON; the model is :mod:`zeroinf.estimate`. Also the model options it shares with
``zeroinf plan`` (:func:`add_model_arguments`, :func:`resolve_model`).

Units: the table prints decimal GB (10**9 bytes) by default, or GiB (2**30 bytes) with ``--unit GiB``,
and says which in its header; ``--json`` prints bytes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Tuple

from zeroinf.estimate import (OPTIMIZERS, PERSISTENCE_THRESHOLD, PLACEMENTS, PLAN_SWAP, PRECISIONS, PRESETS, ModelInfo,
                              activation_bytes, estimate, format_count, format_size, format_table, model_info,
                              parse_count, placement_from_config, swap_buffers_from_config, swap_for)
from zeroinf.working_set import GatherLimits

__all__ = ["add_arguments", "add_model_arguments", "flag_type", "main", "resolve_model", "world_size"]


def flag_type(parse):
    """``parse`` (:func:`parse_count`, :func:`parse_bytes`) as an argparse ``type``: its ValueError
    becomes argparse's message for the flag, so the error says why ("argument --params: parameter
    count '1.5': 1.5 is not a whole number ..."), not "invalid parse_count value"."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
    convert.__name__ = parse.__name__
    return convert



def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``zeroinf estimate`` and ``zeroinf plan``: model, ranks, precision, activations."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=flag_type(parse_count), help="parameter count, e.g. 7e9, 7B, 350M")
    src.add_argument("--model", help=f"a Hugging Face config.json (or its folder) or a preset: "
                                     f"{', '.join(PRESETS)}; parameters counted on the meta device")
    parser.add_argument("--gpus", type=int, default=1, help="accelerators per node (default 1)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes (default 1); N = gpus x nodes")
    parser.add_argument("--precision", choices=list(PRECISIONS), default=None,
                        help="bf16/fp16 (fp32 master weights) or fp32 (default bf16, or the --config's)")
    parser.add_argument("--state-dtype", choices=["fp32", "bf16"], default=None,
                        help="offloaded Adam moments in fp32 or bf16 (offload_optimizer.state_dtype; default fp32, "
                             "or the --config's)")
    parser.add_argument("--live-params", type=flag_type(parse_count), default=None,
                        help="parameters a stage-3 rank holds gathered at once (default: from --model: "
                             "persistent + root + largest block; zeroinf plan with --params only: "
                             "min(P, stage3_max_live_parameters))")
    act = parser.add_argument_group("activations (Korthikanti et al. 2022); counted when --seq-len is given")
    act.add_argument("--seq-len", type=int, help="sequence length, tokens")
    act.add_argument("--micro-batch", type=int, default=1, help="micro-batch per accelerator (default 1)")
    act.add_argument("--checkpointing", choices=["none", "selective", "full"], default="none",
                     help="activation checkpointing (default none)")
    act.add_argument("--fused-attention", action="store_true",
                     help="attention never stores the s x s scores (SDPA/flash)")
    act.add_argument("--hidden", type=int, help="hidden size (default: from --model)")
    act.add_argument("--layers", type=int, help="transformer layers (default: from --model)")
    act.add_argument("--heads", type=int, help="attention heads (default: from --model)")


def world_size(args: argparse.Namespace) -> int:
    """N = ``--gpus`` x ``--nodes``.

    Raises:
        ValueError: either is below 1.
    """
    for key in ("gpus", "nodes"):
        if getattr(args, key) < 1:
            raise ValueError(f"--{key}: must be at least 1, got {getattr(args, key)}")
    return args.gpus * args.nodes


def resolve_model(args: argparse.Namespace, *, persistence_threshold: int = PERSISTENCE_THRESHOLD,
                  limits: GatherLimits = GatherLimits()) -> Tuple[ModelInfo, int, str]:
    """The model, the activation bytes per device and their formula, as the shared options describe;
    the stage-3 working set under ``limits`` (``--live-params`` replaces it).

    Raises:
        ValueError: a bad model, a count below 1 (``--gpus``, ``--nodes``, ``--micro-batch``,
            ``--seq-len``, ``--hidden``, ``--layers``, ``--heads``, named), or activation flags
            missing a shape.
    """
    world_size(args)
    for key in ("micro_batch", "seq_len", "hidden", "layers", "heads"):
        # estimate took --micro-batch -3 without --seq-len; the others were named by their keyword
        if getattr(args, key) is not None and getattr(args, key) < 1:
            raise ValueError(f"--{key.replace('_', '-')}: must be >= 1, got {getattr(args, key)}")
    if args.model:
        info = model_info(args.model, persistence_threshold=persistence_threshold, limits=limits)
    else:
        info = ModelInfo(name=f"P={format_count(args.params)}", params=args.params)
    if args.live_params is not None:
        info = dataclasses.replace(info, live_params=args.live_params, live_formula="--live-params")
    act, formula = 0, ""
    if args.seq_len is not None:
        shape = {k: getattr(args, k) if getattr(args, k) is not None else getattr(info, k)
                 for k in ("hidden", "layers", "heads")}
        missing = [k for k, v in shape.items() if v is None]
        if missing:
            raise ValueError(f"--seq-len: activation memory needs {', '.join('--' + m for m in missing)} "
                             f"(or a --model that has them)")
        act = activation_bytes(args.seq_len, args.micro_batch, checkpointing=args.checkpointing,
                               attention_scores=not args.fused_attention, **shape)
        formula = (f"Korthikanti et al. 2022 with s={args.seq_len} b={args.micro_batch} h={shape['hidden']} "
                   f"L={shape['layers']} a={shape['heads']}, checkpointing {args.checkpointing}"
                   + (", fused attention" if args.fused_attention else ""))
    return info, act, formula


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``zeroinf estimate``."""
    add_model_arguments(parser)
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adam",
                        help="optimizer whose state is counted (default adam: K = 12 B/param with fp32 master)")
    parser.add_argument("--config", help="a DeepSpeed config JSON (validated by zeroinf.config.parse_config "
                                         "with N ranks): show only its placement, with its precision and "
                                         "pinned swap buffers")
    parser.add_argument("--stage", type=int, choices=[0, 1, 2, 3], help="show only this stage")
    parser.add_argument("--param-ratio", type=float, default=None,
                        help="offload_param.ratio for the rows that offload parameters: the fraction offloaded, "
                             "0 to 1, the rest kept on the device (default 1.0, or the --config's)"),
    parser.add_argument("--unit", choices=["GB", "GiB"], default="GB",
                        help="GB = 1e9 bytes (default) or GiB = 2**30 bytes")
    parser.add_argument("--terms", action="store_true", help="print every term with its formula")
    parser.add_argument("--json", action="store_true", help="print JSON (bytes) instead of the table")


def main(args: argparse.Namespace) -> int:
    """Run ``zeroinf estimate``; returns 0, or 2 after printing a usage error to stderr."""
    try:
        precision = args.precision or "bf16"
        swap = PLAN_SWAP
        pins = {"state_dtype": args.state_dtype or "fp32"}  # without --config: pin_memory false, the config default
        placements = list(PLACEMENTS)
        threshold = PERSISTENCE_THRESHOLD
        limits = GatherLimits()
        n = world_size(args)
        if args.config:
            from zeroinf.config import parse_config

            cfg = parse_config(args.config, world_size=n)
            placements = [placement_from_config(cfg)]
            swap = swap_buffers_from_config(cfg)
            precision = args.precision or cfg.precision
            threshold = cfg.zero_optimization.stage3_param_persistence_threshold
            limits = GatherLimits.from_zero_config(cfg.zero_optimization)
            pins = dict(optimizer_pin_memory=cfg.zero_optimization.offload_optimizer.pin_memory,
                        param_pin_memory=cfg.zero_optimization.offload_param.pin_memory,
                        state_dtype=args.state_dtype or cfg.zero_optimization.offload_optimizer.state_dtype,
                        optimizer_in_backward=cfg.zeroinf.optimizer_in_backward)
        info, act, act_formula = resolve_model(args, persistence_threshold=threshold, limits=limits)
        live, live_formula = info.live_params, info.live_formula
        if live is None:  # units unknown: the engine gathers at most stage3_max_live_parameters
            live = min(info.params, limits.max_live_parameters)
            live_formula = (f"units unknown: min(P, stage3_max_live_parameters {format_count(limits.max_live_parameters)}), "
                            "the most the engine gathers")
        if not args.config:  # the parameter buffers zeroinf plan would write for this model
            swap = swap_for(info, n)
        if args.stage is not None:
            placements = [p for p in placements if p.stage == args.stage]
        if args.param_ratio is not None:
            placements = [dataclasses.replace(p, param_ratio=args.param_ratio) if p.offload_param != "none" else p
                          for p in placements]
        rows = [estimate(info.params, pl, world_size=n, gpus_per_node=args.gpus, precision=precision,
                         optimizer=args.optimizer, live_params=live, live_params_formula=live_formula,
                         activations=act, activations_formula=act_formula, swap=swap, unit_sizes=info.unit_sizes,
                         **pins)
                for pl in placements]
    except (ValueError, OSError) as exc:  # ConfigError is a ValueError
        print(f"zeroinf estimate: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"params": info.params, "world_size": n, "rows": [r.row() for r in rows]}, indent=1))
        return 0
    k = PRECISIONS[precision].master_bytes + OPTIMIZERS[args.optimizer]
    k_off = 4 + OPTIMIZERS[args.optimizer] // (2 if pins["state_dtype"] == "bf16" else 1)
    print(f"model {info.name}: P = {format_count(info.params)} parameters"
          + (f"; stage 3 gathers {format_count(info.live_params)} at once (largest unit {format_count(info.largest_unit)})"
             if info.live_params and info.largest_unit else ""))
    print(f"N = {n} ranks ({args.gpus} per node x {args.nodes} nodes); {precision}"
          + (" with fp32 master weights" if PRECISIONS[precision].master_bytes else "")
          + f"; {args.optimizer}: K = {k} B/param of optimizer state"
          + (f" ({k_off} when offloaded: it keeps its own fp32 master"
             + (", moments in bf16" if pins["state_dtype"] == "bf16" else "") + ")" if k_off != k else ""))
    if act:
        print(f"activations: {format_size(act)} GB per device (seq {args.seq_len}, micro-batch {args.micro_batch}, "
              f"checkpointing {args.checkpointing})")
    if not args.config:
        print(f"NVMe rows: sub_group_size {swap.sub_group_size:,}, offload_optimizer.buffer_count "
              f"{swap.optimizer_buffer_count} with pipelined reads and writes, "
              f"offload_param buffer_count {swap.param_buffer_count} x buffer_size "
              f"{swap.param_buffer_size:,}, max_in_cpu {swap.param_max_in_cpu} (as zeroinf plan writes; "
              f"--config for others)")
    print(f"sizes in {args.unit} ({'1e9' if args.unit == 'GB' else '2**30'} bytes); "
          f"per device = each accelerator; per host and NVMe = per node")
    print(format_table(rows, args.unit, args.terms))
    return 0
