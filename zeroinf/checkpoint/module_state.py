"""What a checkpoint records of the module: its state dict, its frozen parameters, and the flat
layout of the parameters in the optimizer's partitions."""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Sequence

import torch


def _names_of(module: torch.nn.Module) -> Dict[int, list]:
    names: Dict[int, list] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _layout(engine) -> list:
    """Per param group: padded length, partition count/length, and each param's names/shape/offset."""
    names = _names_of(engine.module)
    out = []
    for g in engine.params.groups:
        # stage 3 groups also give the true shapes (parameters are empty placeholders there) and
        # the keys of their sub-groups (their param_group index is the optimizer's, not the layout's)
        shapes = getattr(g, "shapes", None) or [list(p.shape) for p in g.params]
        out.append({"padded": g.padded, "part_numel": g.part_numel, "nparts": engine.params.nparts,
                    "sub_keys": getattr(g, "sub_keys", None),
                    "params": [{"names": names[id(p)], "shape": list(shape), "offset": off}
                               for p, off, shape in zip(g.params, g.offsets, shapes)]})
    return out


def _module_state(module: torch.nn.Module, skip: Sequence[str] = ()) -> Dict[str, Any]:
    """A detached copy of the module's state dict (extra states, which may be any object,
    deep-copied), without the keys ``skip`` (not copied first: a LoRA base is most of the model)."""
    skip = set(skip)
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in module.state_dict().items() if k not in skip}


def frozen_names(module: torch.nn.Module) -> List[str]:
    """State-dict names of ``module``'s parameters with ``requires_grad=False`` (a tied one under
    each of its names), sorted."""
    return sorted({n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad})


def _load_module(module: torch.nn.Module, sd: dict, excluded: List[str], strict: bool = True) -> None:
    """``module.load_state_dict(sd, strict)``, where the frozen parameters a save excluded
    (``excluded``) may be missing: they keep the values the module holds.

    Raises:
        RuntimeError: ``strict`` and keys other than those differ (torch's wording)."""
    if not excluded:
        module.load_state_dict(sd, strict=strict)
        return
    res = module.load_state_dict(sd, strict=False)
    missing = sorted(set(res.missing_keys) - set(excluded))
    if strict and (missing or res.unexpected_keys):
        raise RuntimeError(f"Error(s) in loading state_dict for {type(module).__name__}: missing keys {missing[:5]}, "
                           f"unexpected keys {sorted(res.unexpected_keys)[:5]} (the frozen parameters the save "
                           "excluded may be missing)")
