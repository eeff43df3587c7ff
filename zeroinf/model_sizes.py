"""What the memory model knows of a model: its parameter count, built on the meta device from a
preset, a Hugging Face config.json or a dict (no memory, no download), and its stage-3 units and
working set, grouped as the stage-3 runtime groups them."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

from zeroinf.working_set import GatherLimits, working_set

__all__ = ["PRESETS", "ModelInfo", "load_model_config", "model_info", "count_params", "resident_units",
           "stage3_unit_sizes", "stage3_units", "PERSISTENCE_THRESHOLD"]

def _llama(hidden: int, intermediate: int, layers: int, heads: int, positions: int, rms_norm_eps: float,
           kv_heads: Optional[int] = None) -> dict:
    """A Llama-architecture Hugging Face config dict (vocabulary 32000, untied embeddings)."""
    cfg = dict(model_type="llama", vocab_size=32000, hidden_size=hidden, intermediate_size=intermediate,
               num_hidden_layers=layers, num_attention_heads=heads)
    if kv_heads is not None:
        cfg["num_key_value_heads"] = kv_heads
    cfg.update(max_position_embeddings=positions, rms_norm_eps=rms_norm_eps, tie_word_embeddings=False)
    return cfg


#: Model presets: explicit Hugging Face config dicts (no download). Sizes as published by their
#: authors (LLaMA: Touvron et al. 2023, Table 2; Llama 2: Touvron et al. 2023b; GPT-2 small).
PRESETS: Dict[str, dict] = {
    "llama-7b": _llama(4096, 11008, 32, 32, 2048, 1e-6),
    "llama-13b": _llama(5120, 13824, 40, 40, 2048, 1e-6),
    "llama-33b": _llama(6656, 17920, 60, 52, 2048, 1e-6),
    "llama-65b": _llama(8192, 22016, 80, 64, 2048, 1e-5),
    "llama2-7b": _llama(4096, 11008, 32, 32, 4096, 1e-5),
    "llama2-70b": _llama(8192, 28672, 80, 64, 4096, 1e-5, kv_heads=8),
    "gpt2": dict(model_type="gpt2", vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024),
}


@dataclass(frozen=True)
class ModelInfo:
    """What the estimates need to know about a model.

    Attributes:
        name: preset name, config path, or ``"P=<count>"``.
        params: P, unique parameters (tied weights once, embeddings included).
        largest_unit: elements of the largest stage-3 unit (see :func:`stage3_units`); an
            ``offload_param.buffer_size`` must hold its partition. None when unknown.
        live_params: parameters a stage-3 rank holds gathered at once, its working set (see
            :func:`stage3_units`); None when unknown.
        live_formula: how ``live_params`` was computed, with its numbers; None when unknown.
        unit_sizes: elements of each stage-3 unit that has parameters (persistent, root, then the
            blocks, as :func:`stage3_unit_sizes` groups them); the engine cuts the optimizer's
            sub-groups per unit, so they size its NVMe swap buffers. None when unknown.
        hidden, layers, heads, vocab: shape, for activation memory; None when unknown.
    """

    name: str
    params: int
    largest_unit: Optional[int] = None
    live_params: Optional[int] = None
    live_formula: Optional[str] = None
    unit_sizes: Optional[Tuple[int, ...]] = None
    hidden: Optional[int] = None
    layers: Optional[int] = None
    heads: Optional[int] = None
    vocab: Optional[int] = None


def load_model_config(model: Union[str, os.PathLike, Mapping]) -> dict:
    """A Hugging Face config dict from a preset name, a config.json path (or its folder), or a dict.

    Raises:
        ValueError: unknown preset name, unreadable or invalid JSON, or no ``model_type`` key.
    """
    if isinstance(model, Mapping):
        cfg = dict(model)
        where = "config dict"
    elif str(model) in PRESETS:
        return dict(PRESETS[str(model)])
    else:
        path = Path(model)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"model {str(model)!r}: neither a preset ({', '.join(sorted(PRESETS))}) "
                             f"nor an existing config.json")
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"model config {str(path)!r}: cannot read JSON: {exc}") from exc
        where = str(path)
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise ValueError(f"model config {where}: no 'model_type' key (a Hugging Face config.json has one)")
    return cfg


def _build_meta(cfg: dict):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    rest = {k: v for k, v in cfg.items() if k != "model_type"}
    try:
        hf_config = AutoConfig.for_model(cfg["model_type"], **rest)
    except (ValueError, KeyError) as exc:
        raise ValueError(f"model config: model_type {cfg['model_type']!r} is not known to transformers: {exc}") from exc
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    except ValueError as exc:  # e.g. an encoder-only model_type with no causal-LM class
        raise ValueError(f"model config: transformers cannot build a causal LM for model_type "
                         f"{cfg['model_type']!r}: {exc}") from exc
    return hf_config, model


#: ``zero_optimization.stage3_param_persistence_threshold`` default: smaller parameters stay gathered.
PERSISTENCE_THRESHOLD = 100_000


def stage3_unit_sizes(model, persistence_threshold: int = PERSISTENCE_THRESHOLD
                      ) -> Optional[Tuple[int, int, Tuple[int, ...]]]:
    """``(persistent, root, blocks)``: elements of each stage-3 unit, as
    ``zeroinf.runtime.stage3.units.build_units`` groups them (``blocks`` in module order).

    Units: one per outermost transformer block (classes of the model's ``_no_split_modules``); the
    root unit holds every parameter outside the blocks (or shared by two), gathered for the whole
    forward and backward; the persistent unit holds every parameter with fewer than
    ``persistence_threshold`` elements, gathered once and kept. Returns None when the model names
    no block classes.
    """
    classes = set(getattr(model, "_no_split_modules", None) or ())
    if not classes:
        return None
    blocks, taken = [], []
    for name, m in model.named_modules():
        if m is model or type(m).__name__ not in classes or any(name.startswith(t + ".") for t in taken):
            continue
        taken.append(name)
        blocks.append(m)
    owner: Dict[int, List[int]] = {}
    for i, b in enumerate(blocks):
        for p in b.parameters():
            owner.setdefault(id(p), []).append(i)
    persistent = root = 0
    sizes = [0] * len(blocks)
    for p in model.parameters():
        n = p.numel()
        if n < persistence_threshold:
            persistent += n
        elif len(owner.get(id(p), ())) == 1:
            sizes[owner[id(p)][0]] += n
        else:
            root += n
    return persistent, root, tuple(sizes)


def stage3_units(model, persistence_threshold: int = PERSISTENCE_THRESHOLD,
                 limits: GatherLimits = GatherLimits()) -> Optional[Tuple[int, int]]:
    """``(largest unit, live parameters)`` in elements, from :func:`stage3_unit_sizes`: the live
    parameters are the working set under ``limits`` (:func:`zeroinf.working_set.working_set`), at
    least ``persistent + root + the largest block``. Returns None when the model names no block
    classes.
    """
    units = stage3_unit_sizes(model, persistence_threshold)
    return None if units is None else _largest_and_live(*units, limits)[:2]


def _largest_and_live(persistent: int, root: int, blocks: Tuple[int, ...],
                      limits: GatherLimits) -> Tuple[int, int, str]:
    live, formula = working_set(persistent, root, blocks, limits)
    return max(persistent, root, max(blocks, default=0)), live, formula


def model_info(model: Union[str, os.PathLike, Mapping], *,
               persistence_threshold: int = PERSISTENCE_THRESHOLD, limits: GatherLimits = GatherLimits()) -> ModelInfo:
    """Count a model's parameters by building it on the meta device (no memory, no download).

    Args:
        model: a preset name (:data:`PRESETS`), a Hugging Face config.json path or folder, or a dict.

    Returns:
        :class:`ModelInfo` with P = unique parameters of ``AutoModelForCausalLM.from_config`` (tied
        input/output embeddings counted once) and the stage-3 unit sizes and working set of
        :func:`stage3_units` under ``limits``.

    Raises:
        ValueError: see :func:`load_model_config`, or a config transformers cannot build.
    """
    cfg = load_model_config(model)
    hf_config, built = _build_meta(cfg)
    params = sum(p.numel() for p in built.parameters())  # parameters() yields a tied tensor once
    name = str(model) if not isinstance(model, Mapping) else cfg["model_type"]

    def attr(key):
        try:
            value = getattr(hf_config, key)
        except AttributeError:
            return None
        return value if isinstance(value, int) else None

    units = stage3_unit_sizes(built, persistence_threshold)
    largest, live, formula = _largest_and_live(*units, limits) if units else (None, None, None)
    return ModelInfo(name=name, params=params, largest_unit=largest, live_params=live, live_formula=formula,
                     unit_sizes=tuple(n for n in (units[0], units[1], *units[2]) if n) if units else None,
                     hidden=attr("hidden_size"), layers=attr("num_hidden_layers"),
                     heads=attr("num_attention_heads"), vocab=attr("vocab_size"))


def count_params(model: Union[str, os.PathLike, Mapping]) -> int:
    """Unique parameters of a model built on the meta device; see :func:`model_info`."""
    return model_info(model).params


def resident_units(sizes: Sequence[int], ratio: float) -> int:
    """How many leading units keep their partitions on the compute device under
    ``offload_param.ratio`` = ``ratio`` (the fraction of parameter elements offloaded, 0 to 1):
    the shortest prefix of ``sizes`` (elements per unit, in unit order: persistent, root, then the
    blocks in forward order) whose sum comes closest to ``(1 - ratio) x sum(sizes)``. 0 at ratio
    1, ``len(sizes)`` at ratio 0. Both the engine (``zeroinf/runtime/stage3/swap_plan.py``,
    ``unit_tiers``) and the estimator count resident parameters with it.

    Raises:
        ValueError: ``ratio`` outside [0, 1].
    """
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"zero_optimization.offload_param.ratio: must be in [0, 1], got {ratio!r}")
    target = (1.0 - ratio) * sum(sizes)
    best, best_gap, acc = 0, target, 0
    for k, n in enumerate(sizes, start=1):
        acc += n
        if abs(acc - target) < best_gap:
            best, best_gap = k, abs(acc - target)
    return best
