"""``zeroinf.gathered_parameters``: full parameters of a stage-3 model for inspection and init."""
from __future__ import annotations

import contextlib
import json
import os
from typing import ContextManager, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from zeroinf.waits import collective
from .init import held_values
from .common import views_its_slot
from .registry import managers
from .units import UnitState, exact_values

__all__ = ["gathered_parameters", "load_safetensors"]


def gathered_parameters(params, modifier_rank: Optional[int] = None) -> ContextManager[None]:
    """Gather the units that own ``params`` so they hold their full values inside the block.

    Args:
        params: a parameter or an iterable of parameters (``model.parameters()`` works);
            parameters of a model built under ``zeroinf.Init`` and not yet given to
            ``zeroinf.initialize`` get their held values (changes kept as below); other
            parameters no stage-3 manager owns are ignored.
        modifier_rank: the rank whose in-place changes are kept: on exit its values are
            broadcast (``world_size > 1``) and written into every rank's partition on its home
            tier (and the engine's fp32 master weights follow). ``None``: read-only; changes
            are discarded.

    Collective when ``world_size > 1``: every rank must enter with the same parameters.
    Gathers whole units, so memory grows with the units touched.

    Raises:
        RuntimeError: called while the model's forward or backward is running, for parameters
            whose engine was closed, or after a ``load_checkpoint`` of their engine failed
            part-way; on exit, when a partitioned parameter was given ``.data`` of another shape
            in the block (a resized embedding: not kept). A same-shape ``.data`` replacement
            counts as an in-place change.
    """
    return _gathered(params, modifier_rank)


@contextlib.contextmanager
def _gathered(params, modifier_rank: Optional[int], loading: bool = False) -> Iterator[None]:
    """:func:`gathered_parameters`; ``loading``: for a ``load_state_dict`` (which may mend a
    failed ``load_checkpoint``), so the load guard is not checked."""
    if isinstance(params, torch.Tensor):
        params = [params]
    wanted = list(params)
    plan = []  # (manager, unit, was_gathered)
    for m in managers(include_closed=True):
        units = []
        for p in wanted:
            s = m.slot_of(p)
            if s is not None and s.unit not in units:
                units.append(s.unit)
        if units:
            m._check_open()  # its engine was closed: the partitions are gone
            if m.state_guard is not None and not loading:
                m.state_guard.check("zeroinf.gathered_parameters")
            # between a forward that returned and its backward (which may never come: the output
            # may be gone) it gathers as at any other time; a weight written in the block, which
            # the forward saved, fails that backward as in plain PyTorch (the version check in
            # the saved-tensor hooks)
            if m._ctx is not None or m._in_backward:
                raise RuntimeError("zeroinf.gathered_parameters: not available while the model's forward or "
                                   "backward is running")
            units.sort(key=lambda u: u.index)  # the same order, hence the same collectives, on every rank
            for u in units:
                plan.append((m, u, u.state is UnitState.GATHERED))
    held = []  # units this block holds gathered (user_holds), released again on the way out
    try:
        for m, u, was in plan:
            if not was:
                with m.busy():
                    with collective("zeroinf.gathered_parameters (it all-gathers the partitions)", m.rank, m.world_size):
                        m._make_room(u, for_block=True)  # [Note: the live limit and gathered_parameters]
                        m._complete(u)
            u.user_holds += 1
            held.append(u)
        try:
            with held_values(wanted, modifier_rank):  # before initialize: values zeroinf.Init holds
                yield
        finally:
            reshaped = _adopt_replaced_data(plan, keep=modifier_rank is not None)
            if modifier_rank is not None:
                for m, u, _ in plan:
                    for g in u.groups:
                        if m.world_size > 1:
                            dist.broadcast(g.full, src=modifier_rank, group=m.group)
                        m.write_group_values(g, [(s, g.full[s.offset:s.offset + s.numel]) for s in g.slots])
            for m, u, _ in plan:  # the block's changes are settled: no forward keeps them later
                for g in u.groups:
                    for s in g.slots:
                        s.version = s.param._version
    finally:  # also when a gather failed: nothing stays gathered for a block that never ran
        for u in held:
            u.user_holds -= 1
        for m, u, was in plan:
            if not was:
                m.release(u)
    if reshaped:
        raise RuntimeError(f"zeroinf.gathered_parameters: {reshaped} inside the block; a stage-3 parameter keeps "
                           "the shape it was partitioned with, so that change was not kept, but whatever else the "
                           "block changed stays (transformers' resize_token_embeddings also swaps modules and sets "
                           "config.vocab_size): build the model again and resize before zeroinf.initialize (for a "
                           "model built under zeroinf.Init, inside the with block, or inside "
                           "zeroinf.gathered_parameters(..., modifier_rank=0) then)")


def _adopt_replaced_data(plan, keep: bool) -> str:
    """A parameter whose ``.data`` was replaced inside the block (``p.data = t``) no longer views
    its gathered buffer: with ``keep`` copy a same-shape replacement into the buffer (so it is
    written like an in-place change) and view the buffer again. Returns the replacements of
    another shape, described, or ``""``."""
    reshaped = []
    for _m, u, _was in plan:
        for g in u.groups:
            if g.full is None:
                continue
            for s in g.slots:
                if views_its_slot(s.param, s, g.full.data_ptr(), g.full.element_size()):
                    continue
                view = g.full[s.offset:s.offset + s.numel]
                d = s.param.data
                if tuple(d.shape) != tuple(s.shape):
                    reshaped.append(f"parameter '{s.name}' (partitioned as {tuple(s.shape)}) was given data of "
                                    f"shape {tuple(d.shape)}")
                elif keep:  # a re-view of the buffer (p.data = p.data.t()) overlaps the copy's target
                    same = d.untyped_storage().data_ptr() == g.full.untyped_storage().data_ptr()
                    view.copy_((d.clone() if same else d).reshape(-1))
                s.param.data = view.view(s.shape)
    return ", ".join(reshaped)


def _safetensors_files(path) -> List[str]:
    path = os.fspath(path)
    if os.path.isfile(path):
        return [path]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"{path}: neither a .safetensors file nor a folder with model.safetensors "
                            "or model.safetensors.index.json")


def _conversion_hint(model: nn.Module, file_keys) -> str:
    """When the file's keys are in a layout that transformers converts as it loads this model
    (transformers 5 writes MoE experts one tensor per expert and fuses them into
    ``experts.gate_up_proj``; GPT-NeoX's ``embed_out`` is renamed ``lm_head``), a sentence saying
    so and what to do instead (a bare KeyError would name only the model's keys); else ""."""
    import re
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        rules = get_model_conversion_mapping(model)
    except Exception:  # no transformers, another version, or not a transformers model: no hint
        return ""
    found = sorted({src for r in rules for src in getattr(r, "source_patterns", ())
                    if any(re.search(src, k) for k in file_keys)})
    if not found:
        return ""
    return (f". The file's keys are in a layout transformers converts when it loads this model (they match "
            f"{', '.join(repr(f) for f in found[:4])}: renamed or per-expert tensors fused into one parameter), "
            "which load_safetensors does not do: load it with from_pretrained under zeroinf.Init (whole in "
            "memory until initialize), or save the weights once under the model's own names "
            "(safetensors.torch.save_file(model.state_dict(), ...)) and stream those")


def _names_in_file(name: str) -> List[str]:
    """The names a parameter ``name`` may have in a checkpoint saved before peft wrapped the
    model: itself, without peft's ``base_model.model.`` prefix, and without what peft puts
    between a wrapped layer and its weights: ``.base_layer`` (LoRA), and
    ``.original_module`` or ``.modules_to_save.<adapter>`` (``modules_to_save``: the frozen
    original and its trained copy both start from the file's weights)."""
    import re
    out = [name]
    if name.startswith("base_model.model."):
        out.append(name[len("base_model.model."):])
    for pattern in (r"\.base_layer\.", r"\.original_module\.", r"\.modules_to_save\.[^.]+\."):
        out += [re.sub(pattern, ".", n) for n in out if re.search(pattern, n)]
    return out


def load_safetensors(model: nn.Module, path, *, strict: bool = True) -> List[str]:
    """Stream pretrained weights into a stage-3 model's partitions, one flat group at a time
    (each tensor is read from the file only when its group is written; the whole model is never
    in memory). Each rank keeps the part of each tensor that falls in its partition.

    Args:
        model: a module managed by a ``Stage3ParameterManager`` (after ``zeroinf.initialize``),
            or a submodule of one (a peft model's ``base_model.model``): then only its own
            parameters are loaded, under names relative to it. A parameter is found in the
            files under its own name or, for a model wrapped by peft after the file was saved,
            without peft's ``base_model.model.`` prefix, ``.base_layer``, ``.original_module``
            and ``.modules_to_save.<adapter>`` (the adapters' own weights are then missing:
            ``strict=False``).
        path: a ``.safetensors`` file, or a Hugging Face model folder (``model.safetensors`` or
            ``model.safetensors.index.json`` with its shards).
        strict: every managed parameter must be in the files (checked before anything is written).

    Returns:
        Names of managed parameters not found in the files (empty when ``strict``).

    Raises:
        KeyError: ``strict`` and some parameters are missing (all are named), or none of the
            model's parameters is in the files (also without ``strict``); nothing written.
        ValueError: ``model`` is in no stage-3 model; or a tensor's shape differs from its
            parameter's; nothing written.
        FileNotFoundError: ``path`` holds no safetensors weights.
    """
    from safetensors import safe_open

    mgr = next((m for m in managers(include_closed=True) if m.module is model), None) or next(
        (m for m in managers(include_closed=True) if any(sub is model for sub in m.module.modules())), None)
    if mgr is None:
        raise ValueError(f"load_safetensors: this {type(model).__name__} is not a stage-3 model nor part of one "
                         "(run zeroinf.initialize with stage 3 on it, or on the model that contains it)")
    files = _safetensors_files(path)
    where = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            for k in st.keys():
                where[k] = (f, st.get_slice(k).get_shape())
    names = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(n)
    whole = mgr.module is model
    plan, missing = [], []
    for g in mgr.groups():
        items = []
        for s in g.slots:
            if not whole and s.param not in names:
                continue  # outside the submodule being loaded
            found = next((c for n in names.get(s.param, [s.name]) for c in _names_in_file(n) if c in where), None)
            if found is None:
                missing.append(names.get(s.param, [s.name])[0])
                continue
            f, shape = where[found]
            if tuple(shape) != tuple(s.shape):
                raise ValueError(f"load_safetensors: {found} in {f} has shape {tuple(shape)}, the model's "
                                 f"parameter has {tuple(s.shape)}; nothing was written")
            items.append((s, found, f))
        plan.append((g, items))
    if not any(items for _g, items in plan):
        # the file saved from a submodule: the model's names behind one leading component match
        # (peft's LoraModel, ``peft_model.base_model``, names its model's weights ``model.<...>``)
        lead = sorted({n.split(".", 1)[0] for n in missing
                       if "." in n and any(c in where for c in _names_in_file(n.split(".", 1)[1]))})
        hint = (f"; its names without their leading {lead[0]!r} are the file's: load into that submodule "
                f"(model.{lead[0]})" if lead else "")
        raise KeyError(f"load_safetensors: none of the {type(model).__name__}'s {len(missing)} parameters is in "
                       f"{os.fspath(path)} (the model's names look like {missing[:3]}, the file's like "
                       f"{sorted(where)[:3]}){hint}; nothing was written{_conversion_hint(model, where)}")
    if missing and strict:
        adapters = any(".lora_" in n for n in missing)
        raise KeyError(f"load_safetensors: {len(missing)} parameters are not in {os.fspath(path)}: {missing[:8]}"
                       f"{'...' if len(missing) > 8 else ''}; nothing was written (strict=False loads the rest"
                       f"{': a base checkpoint holds no peft adapter weights, which keep their init' if adapters else ''})"
                       f"{_conversion_hint(model, where)}")
    for g, items in plan:
        if not items:
            continue
        raw = []
        for s, key, f in items:
            with safe_open(f, framework="pt") as st:
                raw.append((s, st.get_tensor(key)))
        mgr.write_group_values(g, [(s, t.to(g.dtype)) for s, t in raw], exact=exact_values(g, raw))
        # new values, as load_state_dict's copy_ makes them: a backward of a forward that ran
        # before raises (its saved weights changed), as in plain PyTorch
        for s, _ in raw:
            torch.autograd.graph.increment_version(s.param)
        del raw
    mgr.params_updated()
    return missing
