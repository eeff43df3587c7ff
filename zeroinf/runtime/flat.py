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

[Note: stage 1/2 transfers] Each bucket's collective is launched with ``async_op=True`` before the
previous bucket is landed, so the reduction of bucket k+1 runs while bucket k is averaged and
copied. Landing goes through ``self.transfers`` (``zeroinf/runtime/streams.py``):

* CPU (``HostTransfers``): the previous bucket's work is waited for, divided and copied/added into
  ``grad_acc`` on the calling thread: the same operations in the same order as a synchronous
  reduction, so the numbers are the same bit for bit. One rank adds each gradient in place.
* CUDA (``CudaTransfers``, also with one rank, in buckets): the D2H stream waits for the compute
  stream and for the bucket's collective, divides, and copies ``non_blocking`` as fp32 into
  pinned memory: straight into the pinned ``grad_acc`` slice for the first micro-batch after a
  step, else into one of two pinned staging buffers (pieces of at most ``STAGING_NUMEL``
  elements) that the host adds into ``grad_acc`` after the copy's event; a staging buffer is
  reused only after that add. The copies land (host waits on their events; the device never
  stalls) before anything reads ``grad_acc`` (``grad``, ``local_grad_norm_parts``) and before
  the next ``reduce_gradients`` or ``zero_grad_acc``.
* CUDA parameters: the optimizer writes each sub-group's new values into a pinned host copy of
  this rank's slice (``param_target``), after waiting (host) for the previous H2D copy out of it;
  ``gather_params`` copies it ``non_blocking`` on the H2D stream, after the compute stream's work
  so far (kernels still reading the old values), and the compute stream waits for it before the
  all-gather and the next forward.
"""
from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import collectives
from .grad_norm import combine, norm_part
from .optimizer import SubGroupSpec
from .host_memory import HostMemory
from .stage_api import StageParamsBase
from .streams import transfers_for
from .weight_changes import WeightWatch

__all__ = ["FlatGroup", "FlatParamManager", "STAGING_NUMEL"]

#: fp32 elements per pinned staging buffer for gradient accumulation on CUDA (16 MiB; two are kept)
STAGING_NUMEL = 1 << 22


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
    host_part: Optional[torch.Tensor] = None  #: CUDA: pinned host copy of this rank's slice (model dtype)


class FlatParamManager(StageParamsBase):
    """Owns the flat parameter buffers, gradient reduction and accumulation for stages 0–2.

    Args:
        param_groups: lists of parameters (each a param group; all on one device, one dtype).
        stage: 0, 1 or 2.
        sub_group_size, reduce_bucket_size, allgather_bucket_size: elements (``zero_optimization``).
        reduce_scatter: stage 2 reduce-scatters each bucket; False all-reduces it instead (as
            DeepSpeed's ``reduce_scatter: false``).
        rank, world_size: data-parallel coordinates (world size 1 needs no process group).
        group: the torch.distributed process group (None: default).
        transfers: device<->host copies (default ``transfers_for(device)``: CUDA side streams, or
            plain copies on the CPU); see [Note: stage 1/2 transfers].
        host: the :class:`~zeroinf.runtime.host_memory.HostMemory` the host buffers come from (the
            engine's, shared with its optimizer); None: a new one.

    The engine's interface to it is :class:`zeroinf.runtime.stage_api.StageParams`; what a stage
    without partitioned parameters does not do comes from :class:`StageParamsBase`.

    Raises:
        ValueError: mixed devices/dtypes, a parameter in two groups.
    """

    def __init__(self, param_groups: Sequence[Sequence[torch.nn.Parameter]], *, stage: int, sub_group_size: int,
                 reduce_bucket_size: int, allgather_bucket_size: int = 500_000_000, reduce_scatter: bool = True,
                 rank: int = 0, world_size: int = 1, group=None, transfers=None,
                 host: Optional[HostMemory] = None):
        if stage not in (0, 1, 2):
            raise ValueError(f"FlatParamManager handles stages 0-2, got {stage}")
        self.stage, self.rank, self.world_size, self.pg = stage, rank, world_size, group
        self.nparts = 1 if stage == 0 else world_size
        seen: Dict[int, int] = {}
        all_params = [p for ps in param_groups for p in ps]
        for gi, ps in enumerate(param_groups):
            for p in ps:
                if id(p) in seen:
                    raise ValueError(f"a parameter of shape {tuple(p.shape)} appears in param groups "
                                     f"{seen[id(p)]} and {gi}")
                seen[id(p)] = gi
        # a frozen model (a reference, a teacher) has none: nothing to flatten or reduce
        devices = {p.device for p in all_params} or {torch.device("cpu")}
        dtypes = {p.dtype for p in all_params} or {torch.float32}
        if len(devices) != 1 or len(dtypes) != 1:
            raise ValueError(f"all trainable parameters must share one device and dtype, got {devices} / {dtypes}")
        self.device, self.dtype = devices.pop(), dtypes.pop()
        self.bucket = max(1, int(reduce_bucket_size) // self.nparts)
        self.gather_bucket = max(1, int(allgather_bucket_size) // self.nparts)
        self.reduce_scatter = bool(reduce_scatter)
        self.transfers = transfers if transfers is not None else transfers_for(self.device)
        self._landing: Deque[Tuple[Any, Optional[torch.Tensor], Optional[torch.Tensor]]] = collections.deque()
        self._staging: List[torch.Tensor] = []  # two pinned fp32 buffers, used in turn
        self._staged = 0  # staging buffers handed out so far (the next is _staging[_staged % 2])
        self._param_ready: Any = None  # event of the last H2D copy out of the host_part buffers
        # grad_acc (fp32, part_numel), host_part (model dtype) and the two staging buffers (fp32,
        # STAGING_NUMEL at most) come from it: pinned only with CUDA
        self.host = host if host is not None else HostMemory()
        self.groups: List[FlatGroup] = []
        self._fresh = False  # True: grad_acc holds stale values that count as zero
        self.weights: Optional[WeightWatch] = None  # [Note: weights changed between steps], from watch_weights
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
                                         self.host.zeros(part_numel, torch.float32), subs))

    # ------------------------------------------------------------------------------------------

    def watch_weights(self, model: torch.nn.Module, names: Dict[torch.nn.Parameter, str]) -> list:
        """Take the parameters as they are now (after the masters were made) for
        :meth:`adopt_replaced_data` and :meth:`adopt_changed_weights` ([Note: weights changed
        between steps] in weight_changes.py); ``names``: parameter -> name, for errors. Returns
        the load hooks registered on ``model``'s modules."""
        self.weights = WeightWatch(self, names)
        return self.weights.load_hooks(model)

    def adopt_replaced_data(self) -> None:
        """Put parameters given new data (``p.data = t``) back into their flat buffers
        (:meth:`WeightWatch.adopt_replaced_data`; RuntimeError for data that cannot go there)."""
        self.weights.adopt_replaced_data()

    def adopt_changed_weights(self, sub_optimizer) -> None:
        """Take weights changed since the last step into ``sub_optimizer``'s masters
        (:meth:`WeightWatch.adopt_changed_weights`)."""
        self.weights.adopt_changed_weights(sub_optimizer)

    def mark_weights_current(self) -> None:
        """Take the weights as they are now for the masters' values (after a checkpoint load)."""
        self.weights.mark_current()

    def sub_group_specs(self) -> List[SubGroupSpec]:
        """One :class:`SubGroupSpec` per sub-group, keys ``g{group}/s{index}``."""
        return [SubGroupSpec(f"g{gi}/s{si}", numel, gi)
                for gi, g in enumerate(self.groups) for si, (_, numel) in enumerate(g.sub_ranges)]

    def sub_index(self) -> List[Tuple[FlatGroup, int, int]]:
        """(flat group, start relative to ``part_start``, numel) of every sub-group, in spec order."""
        return [(g, s, n) for g in self.groups for (s, n) in g.sub_ranges]

    def master_init(self, i: int, fp32_params: Optional[Dict[int, torch.Tensor]] = None) -> torch.Tensor:
        """fp32 initial values of sub-group ``i`` (from ``fp32_params``: id(param) → fp32 copy taken
        before a cast to bf16/fp16, else from the flat buffer). Padding is zero."""
        g, s, n = self.sub_index()[i]
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
        g, s, n = self.sub_index()[i]
        return g.grad_acc[s:s + n]

    def param_target(self, i: int) -> torch.Tensor:
        """Where sub-group ``i``'s updated parameters go (model dtype, ``numel`` of the sub-group):
        the flat slice of the model's parameters on the CPU; on CUDA its pinned host copy, moved
        to the device by :meth:`gather_params` ([Note: stage 1/2 transfers])."""
        g, s, n = self.sub_index()[i]
        a = g.part_start + s
        if not self.transfers.side_streams:
            return g.flat[a:a + n]
        if g.host_part is None:
            g.host_part = self.host.empty(g.part_numel, g.flat.dtype)
            g.host_part.copy_(g.flat[g.part_start:g.part_start + g.part_numel])  # once; the sub-group's padding too
        self.transfers.host_wait(self._param_ready)  # the last H2D copy out of it is done
        return g.host_part[s:s + n]

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
        accumulation buffer, and release ``.grad``. Returns the elements communicated. On CUDA the
        copies may still be in flight on return ([Note: stage 1/2 transfers]).

        Raises:
            RuntimeError: a trainable parameter's gradient has the wrong shape or dtype.
        """
        self._land()
        side = self.transfers.side_streams
        comm = 0
        for g in self.groups:
            for p in g.params:
                if p.grad is not None and p.grad.shape != p.shape:
                    raise RuntimeError(f"gradient of shape {tuple(p.grad.shape)} for a parameter of shape {tuple(p.shape)}")
            first = self._fresh  # first micro-batch since the last step: copy, no zeroing pass
            if self.world_size == 1 and not side:  # nothing to communicate: add each gradient in place
                for p, off in zip(g.params, g.offsets):
                    dst = g.grad_acc[off:off + p.numel()]
                    if p.grad is not None:
                        src = p.grad.reshape(-1).to("cpu", torch.float32)
                        dst.copy_(src) if first else dst.add_(src)
                    elif first:
                        dst.zero_()
                    p.grad = None
                continue
            prev = None
            for start in range(0, g.part_numel, self.bucket):
                b = min(self.bucket, g.part_numel - start)
                buf = self._fill_bucket(g, start, b)
                mine, work = self._launch_bucket(buf, b)
                if self.world_size > 1:
                    comm += buf.numel()
                if prev is not None:  # this bucket's collective runs while the previous one lands
                    self._land_bucket(g, first, *prev)
                prev = (start, b, buf, mine, work)
            self._land_bucket(g, first, *prev)
            for p in g.params:
                p.grad = None
        self._fresh = False
        return comm

    def _fill_bucket(self, g: FlatGroup, start: int, b: int) -> torch.Tensor:
        """Bucket ``start`` of ``g``: ``[nparts, b]`` fp32 on the device, row ``r`` holding the
        gradients of rank ``r``'s slice elements ``[start, start + b)`` (zero where none)."""
        P = g.part_numel
        buf = torch.zeros(self.nparts, b, dtype=torch.float32, device=self.device)
        for r in range(self.nparts):
            a = r * P + start
            for p, off in self._overlaps(g, a, a + b):
                if p.grad is None:
                    continue
                lo, hi = max(a, off), min(a + b, off + p.numel())
                buf[r, lo - a:hi - a].copy_(p.grad.reshape(-1)[lo - off:hi - off])
        return buf

    def _launch_bucket(self, buf: torch.Tensor, b: int) -> Tuple[torch.Tensor, Any]:
        """Start summing ``buf`` over ranks (``async_op=True``). Returns (the tensor that holds
        this rank's ``b`` summed elements once the work is done, the work; None with one rank)."""
        mine = buf[self.rank] if self.stage != 0 else buf[0]
        if self.world_size == 1:
            return mine, None
        if self.stage == 2 and self.reduce_scatter:
            out = torch.empty(b, dtype=torch.float32, device=self.device)
            return out, collectives.reduce_scatter_single(out, buf.reshape(-1), group=self.pg, async_op=True)
        return mine, dist.all_reduce(buf, group=self.pg, async_op=True)

    def _land_bucket(self, g: FlatGroup, first: bool, start: int, b: int, buf: torch.Tensor,
                     mine: torch.Tensor, work: Any) -> None:
        """Average ``mine`` (once ``work`` is done) into ``g.grad_acc[start:start + b]``: copied
        for the first micro-batch, else added; see [Note: stage 1/2 transfers]."""
        dst = g.grad_acc[start:start + b]
        if not self.transfers.side_streams:
            if work is not None:
                work.wait()
                mine.div_(self.world_size)
            src = mine.to("cpu", non_blocking=False)
            dst.copy_(src) if first else dst.add_(src)
            return
        t = self.transfers
        if first:
            self._landing.append((t.d2h(dst, mine, work=work, divisor=self.world_size, keep=(buf,)), None, None))
            return
        for a in range(0, b, STAGING_NUMEL):  # pieces through the rotating staging buffers
            n = min(STAGING_NUMEL, b - a)
            stage = self._staging_buffer()[:n]
            ready = t.d2h(stage, mine[a:a + n], work=work if a == 0 else None, divisor=self.world_size, keep=(buf,))
            self._landing.append((ready, stage, dst[a:a + n]))

    def _staging_buffer(self) -> torch.Tensor:
        """The next of the two pinned fp32 staging buffers (``STAGING_NUMEL`` elements at most),
        after the bucket piece that used it last has been added into ``grad_acc``."""
        if len(self._staging) < 2:
            n = min(STAGING_NUMEL, max(g.part_numel for g in self.groups))
            self._staging.append(self.host.empty(n, torch.float32))
            buf = self._staging[-1]
        else:
            buf = self._staging[self._staged % 2]
            while any(stage is not None and stage.data_ptr() == buf.data_ptr() for _, stage, _ in self._landing):
                self._land_one()
        self._staged += 1
        return buf

    def _land_one(self) -> None:
        """Land the oldest gradient copy in flight: host wait for its event, then the add."""
        ready, stage, dst = self._landing.popleft()
        self.transfers.host_wait(ready)
        if stage is not None:
            dst.add_(stage)

    def _land(self) -> None:
        """Wait (host) for every gradient copy in flight and add the staged ones, in order."""
        while self._landing:
            self._land_one()

    def settle_host_copies(self) -> None:
        """Wait (host) until no copy still reads or writes this manager's host buffers: the
        gradient copies in flight are landed and the last H2D copy out of the pinned parameter
        copies (which may hold the optimizer's master weights) is done. Call it before writing
        those buffers outside the step (a checkpoint load). A no-op on the CPU."""
        self._land()
        self.transfers.host_wait(self._param_ready)

    def zero_grad_acc(self) -> None:
        """Clear the accumulation buffers (after a step or a skipped step). Lazy: the next
        micro-batch copies instead of adding, and a read before that sees zeros."""
        self._land()
        self._fresh = True

    def _materialize(self) -> None:
        self._land()
        if self._fresh:  # read with no micro-batch since the last clear: really zero
            for g in self.groups:
                g.grad_acc.zero_()
            self._fresh = False

    @torch.no_grad()
    def gather_params(self) -> int:
        """After the optimizer step: on CUDA copy the updated slice from its pinned host copy to
        the device ([Note: stage 1/2 transfers]); then all-gather the updated slices so every rank
        holds the whole flat buffer (stages 1, 2). Returns the elements received."""
        if self.transfers.side_streams:
            copies = [(g.flat[g.part_start:g.part_start + g.part_numel], g.host_part)
                      for g in self.groups if g.host_part is not None]
            if copies:
                self._param_ready = self.transfers.h2d(copies, self.transfers.mark())
                self.transfers.stream_wait(self._param_ready)
        if self.world_size == 1 or self.stage == 0:
            return 0
        n = 0
        for g in self.groups:
            P = g.part_numel
            rows = g.flat.view(self.nparts, P)
            for start in range(0, P, self.gather_bucket):  # chunk k of every rank's slice at once
                b = min(self.gather_bucket, P - start)
                out = torch.empty(self.nparts, b, dtype=g.flat.dtype, device=g.flat.device)
                collectives.all_gather_single(out.view(-1), rows[self.rank, start:start + b].contiguous(), group=self.pg)
                rows[:, start:start + b].copy_(out)
                n += out.numel()
        return n

    def local_grad_norm_parts(self, norm_type: float) -> Tuple[float, bool]:
        """(sum of |g|^p, or max |g| for inf) over this rank's slice, and whether it is the
        rank's share of a partitioned sum (True) or a replicated value (stage 0: False)."""
        self._materialize()
        return combine((norm_part(g.grad_acc, norm_type) for g in self.groups), norm_type), self.stage != 0
