"""Decoder-only transformers for ``zeroinf train``, defined through Hugging Face transformers.

``--model llama`` (default) or ``gpt2`` with a size preset (:data:`PRESETS`), or
``--model path/to/config.json`` (any causal-LM config transformers knows). Random init from
``--seed``, or ``--init`` a local ``.safetensors`` file or a Hugging Face model folder (never a
download).

Preset parameter counts depend on the vocabulary (256 for byte tokens); :func:`count_params`
gives the exact number. ``yardstick`` is the model of the benchmark in ``/work/shared/peers``:
Llama, hidden 768, 12 layers, 12 heads, intermediate 2048, vocabulary 256, untied head:
85,347,072 parameters.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import torch

__all__ = ["ModelError", "PRESETS", "build_config", "build_model", "count_params"]


class ModelError(ValueError):
    """The model cannot be built as asked; the message starts with the offending name or path."""


#: (family, size) -> shape. Llama: hidden, layers, heads, intermediate. GPT-2: hidden, layers, heads.
PRESETS = {
    "llama": {
        "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=176),
        "yardstick": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                          intermediate_size=2048),
        "125m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
        "350m": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=2816),
        "1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, intermediate_size=5632),
        "3b": dict(hidden_size=2560, num_hidden_layers=42, num_attention_heads=20, intermediate_size=6912),
    },
    "gpt2": {
        "tiny": dict(n_embd=64, n_layer=2, n_head=4),
        "yardstick": dict(n_embd=768, n_layer=12, n_head=12),
        "125m": dict(n_embd=768, n_layer=12, n_head=12),
        "350m": dict(n_embd=1024, n_layer=24, n_head=16),
        "1b": dict(n_embd=1536, n_layer=32, n_head=16),
        "3b": dict(n_embd=2560, n_layer=36, n_head=20),
    },
}


def build_config(model: str = "llama", size: str = "tiny", vocab_size: int = 256, max_positions: int = 512,
                 init: Optional[str] = None):
    """A transformers ``PretrainedConfig`` for the model asked for.

    Args:
        model: ``"llama"``, ``"gpt2"`` or a path to a ``config.json``.
        size: a key of ``PRESETS[model]`` (ignored for a config file or an ``init`` folder).
        vocab_size: the tokenizer's vocabulary; presets take it, a config file must be at least it.
        max_positions: longest sequence the model must accept (tokens).
        init: a Hugging Face model folder whose ``config.json`` is used instead, or ``None``.

    Raises:
        ModelError: unknown family or size, unreadable config, or a vocabulary smaller than the
            tokenizer's.
    """
    import transformers
    from transformers import AutoConfig

    if init is not None and os.path.isdir(init):
        path = Path(init) / "config.json"
        if not path.is_file():
            raise ModelError(f"{init}: --init folder has no config.json")
        model = str(path)
    if model in PRESETS:
        if size not in PRESETS[model]:
            raise ModelError(f"--size {size}: unknown for {model}; choose from {', '.join(PRESETS[model])}")
        shape = PRESETS[model][size]
        if model == "llama":
            cfg = transformers.LlamaConfig(vocab_size=vocab_size, num_key_value_heads=shape["num_attention_heads"],
                                           max_position_embeddings=max(512, max_positions), **shape)
        else:
            cfg = transformers.GPT2Config(vocab_size=vocab_size, n_positions=max(512, max_positions),
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **shape)
    else:
        path = Path(model)
        if not path.is_file():
            raise ModelError(f"--model {model}: neither llama, gpt2 nor an existing config.json")
        try:
            raw = json.loads(path.read_text())
            model_type = raw.pop("model_type")
        except (json.JSONDecodeError, KeyError, ValueError) as exc:
            raise ModelError(f"{model}: not a transformers model config ({exc})") from exc
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
        if model_type not in CONFIG_MAPPING_NAMES:  # transformers' own error lists every known type: 12 KB
            raise ModelError(f"{model}: model_type {model_type!r} is not known to transformers "
                             f"{transformers.__version__}")
        try:
            cfg = AutoConfig.for_model(model_type, **raw)
        except (KeyError, ValueError, TypeError) as exc:
            raise ModelError(f"{model}: not a transformers model config ({exc})") from exc
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:  # an encoder or encoder-decoder
            raise ModelError(f"{model}: model_type {model_type!r} has no causal-LM class in transformers; "
                             "zeroinf train trains decoder-only language models (llama, gpt2, mistral, qwen2, ...)")
        if getattr(cfg, "vocab_size", 0) < vocab_size:
            raise ModelError(f"{model}: vocab_size {cfg.vocab_size} is smaller than the tokenizer's {vocab_size}")
        limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        if limit is not None and limit < max_positions:
            raise ModelError(f"{model}: accepts {limit} positions, fewer than --seq-len {max_positions}")
    cfg.use_cache = False
    return cfg


def build_model(cfg, seed: int = 0, init: Optional[str] = None) -> torch.nn.Module:
    """Instantiate a causal LM from ``cfg`` in fp32 on the CPU, randomly initialised from ``seed``
    (``torch.manual_seed``), or with weights from ``init``.

    Args:
        init: a ``.safetensors`` file holding this model's full state dict, or a Hugging Face model
            folder (``config.json`` + weights). Loaded with ``local_files_only``.

    Raises:
        ModelError: ``init`` missing, or its tensors do not match the model (names the keys).
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if init is not None and os.path.isdir(init):
        try:
            model = AutoModelForCausalLM.from_pretrained(init, config=cfg, local_files_only=True,
                                                         dtype=torch.float32, attn_implementation="sdpa")
        except (OSError, ValueError) as exc:
            raise ModelError(f"{init}: cannot load weights ({exc})") from exc
        return model
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    if init is not None:
        from safetensors.torch import load_file
        if not os.path.isfile(init):
            raise ModelError(f"{init}: --init path does not exist")
        try:
            state = load_file(init)
        except Exception as exc:  # safetensors raises its own SafetensorError for a bad header
            raise ModelError(f"{init}: not a safetensors file ({exc})") from exc
        own = model.state_dict()
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        if unexpected or (missing and not all(_is_tied(model, k) for k in missing)):
            raise ModelError(f"{init}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
        for name, t in state.items():
            if t.shape != own[name].shape:
                raise ModelError(f"{init}: tensor {name} has shape {tuple(t.shape)}, "
                                 f"the model expects {tuple(own[name].shape)}")
        model.load_state_dict(state, strict=False)
    return model


def _is_tied(model, key: str) -> bool:
    return key.endswith("lm_head.weight") and getattr(model.config, "tie_word_embeddings", False)


def count_params(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
