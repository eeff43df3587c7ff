"""transformers' ``from_pretrained`` under a ZeRO-3 config, streamed into zeroinf's partitions.

transformers builds the model under ``deepspeed.zero.Init`` (zeroinf's :class:`zeroinf.Init`
through :mod:`zeroinf.integrations.hf`), then reads every checkpoint file whole into one state
dict on rank 0 and loads it module by module inside ``deepspeed.zero.GatheredParameters(...,
modifier_rank=0)`` (``transformers.integrations.deepspeed._load_state_dict_into_zero3_model``,
which also takes ``model.state_dict()``: with :class:`zeroinf.Init` a copy of every held value).
Host memory then peaks at about three times the checkpoint. Here, while zeroinf stands in for
DeepSpeed:

- :func:`load_state_dict` answers a ``.safetensors`` file with shape-only (meta) tensors that
  remember their file and name, on every rank;
- :func:`load_into_zero3_model` loads module by module as transformers does, but reads each
  module's tensors from the file only when that module is loaded, on every rank (so no rank
  waits for rank 0's values and buffers need no broadcast).

Host memory then holds about one module's weights at a time (twice: the file's tensor and the
gathered parameter), plus what :class:`zeroinf.Init` keeps (nothing with ``offload_param``
on NVMe). A checkpoint whose names transformers converts as it loads (``weight_mapping``: MoE
experts fused from per-expert tensors) is read whole first and loaded by transformers' own
function, as without zeroinf; one whose names are only renamed is streamed.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from typing import Callable, Dict, Iterator, List, Tuple

import torch
from torch import nn

#: attribute of a meta tensor from :func:`lazy_state_dict`: ``(file path, name in the file)``
SOURCE = "_zeroinf_file_slice"


def _active() -> bool:
    """zeroinf stands in for DeepSpeed right now and transformers' ZeRO-3 config is set."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    return getattr(sys.modules.get("deepspeed"), "__zeroinf_shim__", False) and is_deepspeed_zero3_enabled()


def lazy_state_dict(path: str) -> Dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``path`` as meta tensors of their shapes and dtypes,
    each with :data:`SOURCE` set; nothing is read but the header.

    Raises:
        ValueError: a tensor of a safetensors dtype not in :data:`_DTYPES` (named, with the file).
    """
    from safetensors import safe_open
    out = {}
    with safe_open(path, framework="pt") as f:
        for k in f.keys():
            sl = f.get_slice(k)
            dtype = _DTYPES.get(sl.get_dtype())
            if dtype is None:
                raise ValueError(f"{path}: tensor {k!r} has safetensors dtype {sl.get_dtype()}, which the streamed "
                                 "ZeRO-3 load (zeroinf.integrations.hf_load) does not read")
            t = torch.empty(sl.get_shape(), dtype=dtype, device="meta")
            setattr(t, SOURCE, (path, k))
            out[k] = t
    return out


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def read(values: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``values`` with every tensor from :func:`lazy_state_dict` read from its file (CPU tensors
    of their stored dtype); others as they are. Each file is opened once per call."""
    from safetensors import safe_open
    by_file: Dict[str, List[Tuple[str, str]]] = {}
    out = {}
    for key, v in values.items():
        src = getattr(v, SOURCE, None)
        if src is None:
            out[key] = v
        else:
            by_file.setdefault(src[0], []).append((key, src[1]))
    for path, keys in by_file.items():
        with safe_open(path, framework="pt") as f:
            for key, name in keys:
                out[key] = f.get_tensor(name)
    return out


def patched_load_state_dict(original: Callable) -> Callable:
    """transformers' ``modeling_utils.load_state_dict`` that answers :func:`lazy_state_dict` for a
    ``.safetensors`` file while :func:`_active`; otherwise ``original``."""

    @functools.wraps(original)
    def load_state_dict(checkpoint_file, map_location="cpu", *args, **kwargs):
        path = str(checkpoint_file)
        if path.endswith(".safetensors") and _active():
            return lazy_state_dict(path)
        return original(checkpoint_file, map_location, *args, **kwargs)
    load_state_dict.__zeroinf_wrapped__ = original
    return load_state_dict


def patched_zero3_load(original: Callable) -> Callable:
    """transformers' ``_load_state_dict_into_zero3_model(model, state_dict, load_config)`` →
    ``(error_msgs, missing_keys)``: :func:`load_into_zero3_model` for a state dict holding
    :func:`lazy_state_dict` tensors, ``original`` for any other."""

    @functools.wraps(original)
    def _load_state_dict_into_zero3_model(model_to_load, state_dict, load_config=None):
        if not any(getattr(v, SOURCE, None) is not None for v in state_dict.values()):
            return original(model_to_load, state_dict, load_config)
        from transformers.core_model_loading import WeightConverter
        from transformers.integrations.deepspeed import _apply_weight_conversions_to_state_dict
        mapping = list(getattr(load_config, "weight_mapping", None) or [])
        if any(isinstance(m, WeightConverter) for m in mapping):  # fusing tensors needs them whole
            whole = read(state_dict)
            if getattr(state_dict, "_metadata", None) is not None:
                whole._metadata = state_dict._metadata
            return original(model_to_load, whole, load_config)
        if mapping:  # renamings only: the values pass through unread
            with _shapes_only(model_to_load):
                state_dict = next(_apply_weight_conversions_to_state_dict(model_to_load, state_dict, mapping))
            model_to_load._weight_conversions = mapping  # as transformers keeps it, for save_pretrained
        return load_into_zero3_model(model_to_load, state_dict)
    _load_state_dict_into_zero3_model.__zeroinf_wrapped__ = original
    return _load_state_dict_into_zero3_model


@contextlib.contextmanager
def _shapes_only(model: nn.Module) -> Iterator[None]:
    """Inside the block ``model.state_dict()`` gives meta tensors of the true shapes:
    transformers reads only names and shapes from it while it loads, and the real one copies
    every value zeroinf.Init holds (the whole model in host memory). ``state_dict(keep_vars=True)``
    and calls with arguments stay the real ones (they give the parameters themselves). Nests."""
    real = model.state_dict
    own = "state_dict" in model.__dict__

    def state_dict(*args, keep_vars=False, **kwargs):
        if keep_vars or args or kwargs:
            return real(*args, keep_vars=keep_vars, **kwargs)
        return {k: torch.empty(getattr(t, "ds_shape", t.shape), dtype=t.dtype, device="meta")
                for k, t in real(keep_vars=True).items()}
    model.state_dict = state_dict
    try:
        yield
    finally:
        if own:
            model.state_dict = real
        else:
            del model.state_dict


def patched_load_pretrained(original: Callable) -> Callable:
    """transformers' ``PreTrainedModel._load_pretrained_model(model, ...)`` with ``model``'s
    ``state_dict()`` shapes only (:func:`_shapes_only`) while :func:`_active`; it takes the
    expected names from it."""

    @functools.wraps(original)
    def _load_pretrained_model(model, *args, **kwargs):
        if not _active():
            return original(model, *args, **kwargs)
        with _shapes_only(model):
            return original(model, *args, **kwargs)
    _load_pretrained_model.__zeroinf_wrapped__ = original
    return _load_pretrained_model


def load_into_zero3_model(model: nn.Module, state_dict: Dict[str, torch.Tensor]) -> Tuple[List[str], set]:
    """Load ``state_dict`` (values from :func:`lazy_state_dict` or tensors) into ``model``, built
    under zeroinf.Init, one module at a time: its direct parameters gathered with
    ``modifier_rank=0`` (:func:`zeroinf.gathered_parameters`), its values read then, torch's
    ``_load_from_state_dict`` copying them (shape mismatches are reported as torch reports them).
    Loaded parameters and buffers get ``_is_hf_initialized`` (transformers then leaves them
    alone). Names lacking the model's ``base_model_prefix`` are matched with it, as transformers
    does. Collective when ``world_size > 1`` (every rank visits the same modules).

    Returns:
        ``(error_msgs, missing_keys)``: torch's messages, and the model's state-dict names not
        in ``state_dict``.
    """
    from zeroinf.deepspeed_compat import zero
    metadata = getattr(state_dict, "_metadata", None)
    known = model.state_dict(keep_vars=True)  # names only: the tensors themselves, no copies of held values
    missing = set(known)
    prefix_model = getattr(model, "base_model_prefix", None)
    named = {(f"{prefix_model}.{k}" if known.get(f"{prefix_model}.{k}") is not None else k): v
             for k, v in state_dict.items()}
    error_msgs: List[str] = []

    def load(module: nn.Module, prefix: str) -> None:
        params = [(prefix + n, p) for n, p in module._parameters.items() if p is not None and prefix + n in named]
        buffers = [(prefix + n, b) for n, b in module._buffers.items() if b is not None and prefix + n in named]
        if params or buffers:
            local_metadata = {} if metadata is None else dict(metadata.get(prefix[:-1], {}))
            local_metadata["assign_to_params_buffers"] = False
            values = read({k: named[k] for k, _ in params + buffers})
            for _, t in params + buffers:
                t._is_hf_initialized = True
            with zero.GatheredParameters([p for _, p in params], modifier_rank=0):
                module._load_from_state_dict(values, prefix, local_metadata, True, [], [], error_msgs)
            missing.difference_update(k for k, _ in params + buffers)
            del values
        for name, child in module._modules.items():
            if child is not None:
                load(child, prefix + name + ".")

    with torch.no_grad():
        load(model, "")
    return error_msgs, missing


def install() -> None:
    """Route transformers' ZeRO-3 weight loading through this module (idempotent)."""
    import transformers.modeling_utils as mu
    for name, patch in (("load_state_dict", patched_load_state_dict),
                        ("_load_state_dict_into_zero3_model", patched_zero3_load)):
        current = getattr(mu, name)
        if getattr(current, "__zeroinf_wrapped__", None) is None:
            setattr(mu, name, patch(current))
    current = mu.PreTrainedModel.__dict__["_load_pretrained_model"].__func__
    if getattr(current, "__zeroinf_wrapped__", None) is None:
        mu.PreTrainedModel._load_pretrained_model = staticmethod(patched_load_pretrained(current))
