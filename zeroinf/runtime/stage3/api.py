"""``zeroinf.gathered_parameters``: full parameters of a stage-3 model for inspection and init."""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from .manager import managers
from .units import UnitState

__all__ = ["gathered_parameters"]


@contextlib.contextmanager
def gathered_parameters(params, modifier_rank: Optional[int] = None) -> Iterator[None]:
    """Gather the units that own ``params`` so they hold their full values inside the block.

    Args:
        params: a parameter or an iterable of parameters (``model.parameters()`` works);
            parameters no stage-3 manager owns are ignored.
        modifier_rank: the rank whose in-place changes are kept: on exit its values are
            broadcast (``world_size > 1``) and written into every rank's partition on its home
            tier (and the engine's fp32 master weights follow). ``None``: read-only; changes
            are discarded.

    Collective when ``world_size > 1``: every rank must enter with the same parameters.
    Gathers whole units, so memory grows with the units touched.

    Raises:
        RuntimeError: called while the model's forward or backward is running.
    """
    if isinstance(params, torch.Tensor):
        params = [params]
    wanted = list(params)
    plan = []  # (manager, unit, was_gathered)
    for m in managers():
        units = []
        for p in wanted:
            rec = m._slot_of.get(p)
            if rec is not None and rec[0] not in units:
                units.append(rec[0])
        if units:
            if m._in_iteration:
                raise RuntimeError("zeroinf.gathered_parameters: not available while the model's forward or "
                                   "backward is running")
            units.sort(key=lambda u: u.index)  # the same order, hence the same collectives, on every rank
            for u in units:
                plan.append((m, u, u.state is UnitState.GATHERED))
    for m, u, was in plan:
        if not was:
            m._busy += 1
            try:
                m._make_room(u)
                m._complete(u)
            finally:
                m._busy -= 1
    try:
        yield
    finally:
        try:
            if modifier_rank is not None:
                for m, u, _ in plan:
                    for g in u.groups:
                        if m.world_size > 1:
                            dist.broadcast(g.full, src=modifier_rank, group=m.group)
                        m.write_group_values(g, [(s, g.full[s.offset:s.offset + s.numel]) for s in g.slots])
        finally:
            for m, u, was in plan:
                if not was:
                    m.release(u)
