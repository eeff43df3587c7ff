"""The optimizer step of stage 3: part 1's :class:`~zeroinf.runtime.optimizer.SubGroupOptimizer`
over this rank's unit partitions.

Each flat group's partition (``shard_numel`` elements) is cut into sub-groups of at most
``sub_group_size`` elements; the fp32 master weights and Adam moments of each sub-group live on
CPU or NVMe as part 1 decides. After a group's sub-groups are stepped, the updated parameters
are stored back on the partition's home tier (directly for device/CPU partitions, through one
staging tensor and a swap-file write for NVMe partitions).
"""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .manager import Stage3ParameterManager, refreshed_master
from .units import FlatGroup

__all__ = ["Stage3Optimizer"]


class Stage3Optimizer:
    """Adam over stage-3 partitions (one param group).

    Args:
        manager: the :class:`Stage3ParameterManager` whose partitions are trained.
        sub_group_size: elements per sub-group (``zero_optimization.sub_group_size``).
        device, swap_dir, buffer_count, pipeline_read, pipeline_write, pin_memory, aio: passed
            to ``SubGroupOptimizer`` (``zero_optimization.offload_optimizer``).

    Raises:
        RuntimeError: a flat group mixes trainable and frozen parameters: ``requires_grad``
            changed after the manager laid out its flat groups (which splits them).
    """

    def __init__(self, manager: Stage3ParameterManager, *, sub_group_size: int = 1_000_000_000,
                 device: str = "cpu", swap_dir: Optional[str] = None, buffer_count: int = 4,
                 pipeline_read: bool = False, pipeline_write: bool = False, pin_memory: bool = False, aio=None):
        from zeroinf.runtime.optimizer import SubGroupOptimizer, SubGroupSpec

        self.manager = manager
        self.chunks: List[Tuple[FlatGroup, int, int]] = []
        self._by_group: Dict[str, List[int]] = {}
        for g in manager.groups():
            flags = {s.param.requires_grad for s in g.slots}
            if flags == {False} or g.shard_numel == 0:
                continue
            if len(flags) > 1:
                names = [s.name for s in g.slots if not s.param.requires_grad]
                raise RuntimeError(f"stage 3: flat group {g.key} mixes frozen parameters {names} with trainable "
                                   "ones: requires_grad changed after the manager was built; set it before")
            for lo in range(0, g.shard_numel, sub_group_size):
                self._by_group.setdefault(g.key, []).append(len(self.chunks))
                self.chunks.append((g, lo, min(g.shard_numel, lo + sub_group_size)))
        specs = [SubGroupSpec(f"rank{manager.rank}/{g.key}/{lo}", hi - lo) for g, lo, hi in self.chunks]
        self.opt = SubGroupOptimizer(specs, device=device, swap_dir=swap_dir, buffer_count=buffer_count,
                                     pipeline_read=pipeline_read, pipeline_write=pipeline_write,
                                     pin_memory=pin_memory, aio=aio)
        self.reload_master()
        manager.add_write_listener(self.reload_master)

    def _groups(self, only: Optional[Sequence[FlatGroup]] = None) -> List[FlatGroup]:
        keys = None if only is None else {g.key for g in only}
        seen, out = set(), []
        for g, _, _ in self.chunks:
            if g.key not in seen and (keys is None or g.key in keys):
                seen.add(g.key)
                out.append(g)
        return out

    def reload_master(self, groups: Optional[Sequence[FlatGroup]] = None,
                      written: Optional[Dict[str, List[Tuple[int, int]]]] = None,
                      exact: Optional[Dict[str, torch.Tensor]] = None) -> None:
        """Set the master weights of ``groups`` (default all) from their partitions, only at
        the ranges ``written`` names for a group (partition coordinates; absent: all of it), or
        from ``exact``'s fp32 values for a group it names (see
        :meth:`Stage3ParameterManager.add_write_listener`); moments of those groups restart at
        zero only at construction (later calls keep them)."""
        first = not hasattr(self, "_initialised")
        exact = exact or {}
        for g in self._groups(groups):
            shard = exact[g.key] if g.key in exact else self.manager.param_shard(g)
            for i in self._by_group[g.key]:
                _, lo, hi = self.chunks[i]
                if first:  # zeroinf.Init's fp32 values when the partition holds them rounded
                    init = self.manager.take_init_master(g, lo, hi)
                    self.opt.init_master(i, init if init is not None else shard[lo:hi].float())
                else:
                    with self.opt.state(i) as (master, m, v):
                        master = refreshed_master(master, shard, lo, hi, (written or {}).get(g.key))
                        m, v = m.clone(), v.clone()
                    self.opt.load_state(i, master, m, v)
        self._initialised = True
        self.manager.drop_init_masters()

    def grad_norm(self, norm_type: float = 2.0) -> float:
        """Norm of the whole (all ranks) fp32 gradient in the partitions' ``grad_shard``."""
        dev = torch.device("cpu")
        if math.isinf(norm_type):
            v = max((g.grad_shard.abs().max().item() for g, _, _ in self.chunks if g.grad_shard is not None), default=0.0)
            t = torch.tensor([v], dtype=torch.float64)
            if self.manager.world_size > 1:
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.manager.group)
            return float(t.item())
        total = torch.zeros(1, dtype=torch.float64, device=dev)
        for g in self._groups():
            if g.grad_shard is not None:
                total += g.grad_shard.double().abs().pow(norm_type).sum()
        if self.manager.world_size > 1:
            dist.all_reduce(total, group=self.manager.group)
        return float(total.item() ** (1.0 / norm_type))

    def step(self, *, step: int, hyper: Sequence[Mapping], grad_scale: float = 1.0) -> None:
        """One Adam step over every partition (see ``SubGroupOptimizer.step`` for ``hyper``),
        then the updated partitions go home and the persistent unit is gathered afresh."""
        m = self.manager
        for g in self._groups():
            idx = self._by_group[g.key]
            local = g.store.local()
            target = local if local is not None else torch.empty(g.shard_numel, dtype=g.dtype)
            grad = g.grad_shard if g.grad_shard is not None else torch.zeros(g.shard_numel, dtype=torch.float32)
            pos = {i: self.chunks[i][1:] for i in idx}
            self.opt.step(step=step, hyper=hyper, grad_scale=grad_scale, indices=idx,
                          grad=lambda i: grad[pos[i][0]:pos[i][1]],
                          out=lambda i: target[pos[i][0]:pos[i][1]])
            if local is None:
                m.write_param_shard(g, target)
        m.params_updated()

    def close(self) -> None:
        self.opt.close()
