"""Stages 0, 1 and 2: parameters stay whole on the compute device; gradients and optimizer state
are partitioned over the data-parallel ranks (stages 1, 2) or replicated (stage 0).

Layout. Each param group's trainable parameters become views into one flat buffer (model dtype,
compute device), padded to a multiple of the world size; rank ``r`` owns the slice
``[r * P, (r + 1) * P)`` (stage 0: every rank owns the whole buffer). The owned slice is cut into
sub-groups of at most ``sub_group_size`` elements, stepped by :class:`SubGroupOptimizer`.

Gradients, once per micro-batch (after ``loss.backward()``; autograd has already summed the
contributions of a module called twice or a weight tied to another): the flat gradient is cut
into buckets of ``reduce_bucket_size`` elements; bucket ``k`` holds chunk ``k`` of every rank's
slice, so stage 2 reduce-scatters it (each rank receives exactly its chunk), stage 1 all-reduces it
and keeps its chunk, stage 0 all-reduces the whole range (one rank: no buckets, each gradient is
added in place). The result, averaged over ranks and
upcast to fp32, is added into a CPU fp32 accumulation buffer (pinned when CUDA is present) that
holds this rank's slice: each micro-batch is added exactly once, and ``.grad`` is then released.

After the optimizer step the updated slices are all-gathered into the flat buffers (stages 1, 2),
so every rank holds the whole model again.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .optimizer import SubGroupSpec

__all__ = ["FlatGroup", "FlatParamManager"]


@dataclass
class FlatGroup:
    """One param group's flat layout on this rank."""

    params: List[torch.nn.Parameter]
    offsets: List[int]          #: start of each param in the flat buffer
    numel: int                  #: elements used (without padding)
    padded: int                 #: buffer length: multiple of the partition count
    flat: torch.Tensor          #: model dtype, compute device; params are views into it
    part_start: int             #: this rank's slice [part_start, part_start + part_numel)
    part_numel: int
    grad_acc: torch.Tensor      #: fp32 CPU, part_numel
    sub_ranges: List[Tuple[int, int]]   #: (start, numel) of each sub-group, relative to part_start


class FlatParamManager:
    """Owns the flat parameter buffers, gradient reduction and accumulation for stages 0–2.

    Args:
        param_groups: lists of parameters (each a param group; all on one device, one dtype).
        stage: 0, 1 or 2.
        sub_group_size, reduce_bucket_size, allgather_bucket_size: elements (``zero_optimization``).
        reduce_scatter: stage 2 reduce-scatters each bucket; False all-reduces it instead (as
            DeepSpeed's ``reduce_scatter: false``).
        rank, world_size: data-parallel coordinates (world size 1 needs no process group).
        group: the torch.distributed process group (None: default).

    Raises:
        ValueError: no trainable parameter, mixed devices/dtypes, a parameter in two groups.
    """

    def __init__(self, param_groups: Sequence[Sequence[torch.nn.Parameter]], *, stage: int, sub_group_size: int,
                 reduce_bucket_size: int, allgather_bucket_size: int = 500_000_000, reduce_scatter: bool = True,
                 rank: int = 0, world_size: int = 1, group=None):
        if stage not in (0, 1, 2):
            raise ValueError(f"FlatParamManager handles stages 0-2, got {stage}")
        self.stage, self.rank, self.world_size, self.pg = stage, rank, world_size, group
        self.nparts = 1 if stage == 0 else world_size
        seen: Dict[int, int] = {}
        all_params = [p for ps in param_groups for p in ps]
        if not all_params:
            raise ValueError("no trainable parameters (requires_grad=True) were given")
        for gi, ps in enumerate(param_groups):
            for p in ps:
                if id(p) in seen:
                    raise ValueError(f"a parameter of shape {tuple(p.shape)} appears in param groups "
                                     f"{seen[id(p)]} and {gi}")
                seen[id(p)] = gi
        devices = {p.device for p in all_params}
        dtypes = {p.dtype for p in all_params}
        if len(devices) != 1 or len(dtypes) != 1:
            raise ValueError(f"all trainable parameters must share one device and dtype, got {devices} / {dtypes}")
        self.device, self.dtype = devices.pop(), dtypes.pop()
        self.bucket = max(1, int(reduce_bucket_size) // self.nparts)
        self.gather_bucket = max(1, int(allgather_bucket_size) // self.nparts)
        self.reduce_scatter = bool(reduce_scatter)
        pin = torch.cuda.is_available()
        self.groups: List[FlatGroup] = []
        self._fresh = False  # True: grad_acc holds stale values that count as zero
        for ps in param_groups:
            ps = list(ps)
            offsets, n = [], 0
            for p in ps:
                offsets.append(n)
                n += p.numel()
            padded = -(-max(n, 1) // self.nparts) * self.nparts
            flat = torch.zeros(padded, dtype=self.dtype, device=self.device)
            with torch.no_grad():
                for p, off in zip(ps, offsets):
                    flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
                    p.data = flat[off:off + p.numel()].view_as(p)
            part_numel = padded // self.nparts
            part_start = 0 if stage == 0 else rank * part_numel
            subs = [(s, min(sub_group_size, part_numel - s)) for s in range(0, part_numel, sub_group_size)]
            self.groups.append(FlatGroup(ps, offsets, n, padded, flat, part_start, part_numel,
                                         torch.zeros(part_numel, dtype=torch.float32, pin_memory=pin), subs))

    # ------------------------------------------------------------------------------------------

    def sub_group_specs(self) -> List[SubGroupSpec]:
        """One :class:`SubGroupSpec` per sub-group, keys ``g{group}/s{index}``."""
        return [SubGroupSpec(f"g{gi}/s{si}", numel, gi)
                for gi, g in enumerate(self.groups) for si, (_, numel) in enumerate(g.sub_ranges)]

    def _sub_index(self) -> List[Tuple[FlatGroup, int, int]]:
        return [(g, s, n) for g in self.groups for (s, n) in g.sub_ranges]

    def master_init(self, i: int, fp32_params: Optional[Dict[int, torch.Tensor]] = None) -> torch.Tensor:
        """fp32 initial values of sub-group ``i`` (from ``fp32_params``: id(param) → fp32 copy taken
        before a cast to bf16/fp16, else from the flat buffer). Padding is zero."""
        g, s, n = self._sub_index()[i]
        a = g.part_start + s
        out = g.flat[a:a + n].to(device="cpu", dtype=torch.float32, copy=True)
        if fp32_params:
            for p, off in self._overlaps(g, a, a + n):
                src = fp32_params.get(id(p))
                if src is not None:
                    lo, hi = max(a, off), min(a + n, off + p.numel())
                    out[lo - a:hi - a].copy_(src.reshape(-1)[lo - off:hi - off])
        return out

    def grad(self, i: int) -> torch.Tensor:
        """This rank's accumulated fp32 gradient of sub-group ``i`` (a view; CPU)."""
        self._materialize()
        g, s, n = self._sub_index()[i]
        return g.grad_acc[s:s + n]

    def param_target(self, i: int) -> torch.Tensor:
        """The flat slice of the model's parameters that sub-group ``i`` updates (device, model dtype)."""
        g, s, n = self._sub_index()[i]
        a = g.part_start + s
        return g.flat[a:a + n]

    def _overlaps(self, g: FlatGroup, a: int, b: int):
        """Params of ``g`` overlapping flat range [a, b), with their offsets."""
        k = max(0, bisect.bisect_right(g.offsets, a) - 1)
        while k < len(g.params) and g.offsets[k] < b:
            p, off = g.params[k], g.offsets[k]
            if off + p.numel() > a:
                yield p, off
            k += 1

    # ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def reduce_gradients(self) -> int:
        """Average this micro-batch's ``.grad`` over ranks, add this rank's slice into the fp32 CPU
        accumulation buffer, and release ``.grad``. Returns the elements communicated.

        Raises:
            RuntimeError: a trainable parameter's gradient has the wrong shape or dtype.
        """
        comm = 0
        for g in self.groups:
            for p in g.params:
                if p.grad is not None and p.grad.shape != p.shape:
                    raise RuntimeError(f"gradient of shape {tuple(p.grad.shape)} for a parameter of shape {tuple(p.shape)}")
            first = self._fresh  # first micro-batch since the last step: copy, no zeroing pass
            if self.world_size == 1:  # nothing to communicate: add each gradient in place
                for p, off in zip(g.params, g.offsets):
                    dst = g.grad_acc[off:off + p.numel()]
                    if p.grad is not None:
                        src = p.grad.reshape(-1).to("cpu", torch.float32)
                        dst.copy_(src) if first else dst.add_(src)
                    elif first:
                        dst.zero_()
                    p.grad = None
                continue
            P = g.part_numel
            for start in range(0, P, self.bucket):
                b = min(self.bucket, P - start)
                buf = torch.zeros(self.nparts, b, dtype=torch.float32, device=self.device)
                for r in range(self.nparts):
                    a = r * P + start
                    for p, off in self._overlaps(g, a, a + b):
                        if p.grad is None:
                            continue
                        lo, hi = max(a, off), min(a + b, off + p.numel())
                        buf[r, lo - a:hi - a].copy_(p.grad.reshape(-1)[lo - off:hi - off])
                mine = buf[self.rank] if self.stage != 0 else buf[0]
                if self.world_size > 1:
                    if self.stage == 2 and self.reduce_scatter:
                        out = torch.empty(b, dtype=torch.float32, device=self.device)
                        dist.reduce_scatter_tensor(out, buf.reshape(-1), group=self.pg)
                        mine = out
                    else:
                        dist.all_reduce(buf, group=self.pg)
                    comm += buf.numel()
                    mine.div_(self.world_size)
                dst = g.grad_acc[start:start + b]
                src = mine.to("cpu", non_blocking=False)
                dst.copy_(src) if first else dst.add_(src)
            for p in g.params:
                p.grad = None
        self._fresh = False
        return comm

    def zero_grad_acc(self) -> None:
        """Clear the accumulation buffers (after a step or a skipped step). Lazy: the next
        micro-batch copies instead of adding, and a read before that sees zeros."""
        self._fresh = True

    def _materialize(self) -> None:
        if self._fresh:  # read with no micro-batch since the last clear: really zero
            for g in self.groups:
                g.grad_acc.zero_()
            self._fresh = False

    @torch.no_grad()
    def gather_params(self) -> int:
        """All-gather the updated slices so every rank holds the whole flat buffer (stages 1, 2).
        Returns the elements received."""
        if self.world_size == 1 or self.stage == 0:
            return 0
        n = 0
        for g in self.groups:
            P = g.part_numel
            rows = g.flat.view(self.nparts, P)
            for start in range(0, P, self.gather_bucket):  # chunk k of every rank's slice at once
                b = min(self.gather_bucket, P - start)
                out = torch.empty(self.nparts, b, dtype=g.flat.dtype, device=g.flat.device)
                dist.all_gather_into_tensor(out.view(-1), rows[self.rank, start:start + b].contiguous(), group=self.pg)
                rows[:, start:start + b].copy_(out)
                n += out.numel()
        return n

    def local_grad_norm_parts(self, norm_type: float) -> Tuple[float, bool]:
        """(sum of |g|^p, or max |g| for inf) over this rank's slice, and whether it is the
        rank's share of a partitioned sum (True) or a replicated value (stage 0: False)."""
        self._materialize()
        vals = []
        for g in self.groups:
            t = g.grad_acc
            if norm_type == float("inf"):
                vals.append(float(t.abs().max()) if t.numel() else 0.0)
            else:
                vals.append(float(torch.linalg.vector_norm(t, norm_type, dtype=torch.float32).double() ** norm_type))
        if norm_type == float("inf"):
            return (max(vals) if vals else 0.0), self.stage != 0
        return sum(vals), self.stage != 0
