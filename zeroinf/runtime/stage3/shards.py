"""Stage 3 optimizer side: partitions and gradient shards read and written by the step."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .units import FlatGroup, ParamSlot, UnitState
from ..grad_norm import norm_part
from .common import _finished
from .reads import _Staged


class ShardsMixin:
    """Access to parameter partitions and gradient shards for the optimizer."""

    # ------------------------------------------------------------------------ optimizer side
    def groups(self) -> List[FlatGroup]:
        """Every flat group of every unit (persistent first, then root, then blocks)."""
        return [g for u in self.units for g in u.groups]

    def read_param_shard(self, g: FlatGroup, dst: torch.Tensor) -> None:
        """Copy this rank's partition of ``g`` (``shard_numel`` elements) into ``dst``."""
        self.step_gate.wait()
        t0 = self.tracer.now()
        n = self._run_io(g.store.read_into, dst)
        self._optimizer_read("param", g, n, t0)  # counted like the forward's reads (a cache hit counts itself, n = 0)

    @torch.inference_mode(False)  # [Note: outside inference mode]
    def param_shard(self, g: FlatGroup) -> torch.Tensor:
        """This rank's partition of ``g`` (``shard_numel`` elements of ``g.dtype``): the resident
        tensor itself on the device/cpu tiers (writes to it are writes to the partition), a fresh
        copy read from NVMe otherwise."""
        local = g.store.local()
        if local is not None:
            self.step_gate.wait()
            self._host_reads_done()  # the caller may write it
            return local
        t = torch.empty(g.shard_numel, dtype=g.dtype)
        self.read_param_shard(g, t)
        return t

    def read_param_raw(self, g: FlatGroup, dst: torch.Tensor) -> None:
        """Read this rank's NVMe partition of ``g`` straight into ``dst`` (a 4096-aligned host
        tensor of ``shard_numel`` elements, e.g. from ``self.host``), counted as a parameter
        read; no waits, for the I/O thread (see :meth:`submit_io`) on behalf of a background
        optimizer step, whose group is pending in the step gate."""
        t0 = self.tracer.now()
        self._optimizer_read("param", g, g.store.read_raw(dst), t0)

    def partition_copy(self, g: FlatGroup) -> Optional[torch.Tensor]:
        """This rank's partition of ``g`` as its tier read it when the unit was gathered for the
        backward (``shard_numel`` elements of ``g.dtype``, from ``self.host``; the caller
        owns it now), or None when no such copy was kept (:attr:`snapshot_partitions` off, a
        unit gathered since the forward, a CUDA device). Not a copy of ``g.full``: forward code
        and backward hooks may edit gathered weights in place, and stage 3 discards such edits,
        as it does gathered writes outside ``gathered_parameters(modifier_rank=...)``. For the
        optimizer in backward, at a hand-over on the compute thread."""
        t, g.partition_snapshot = g.partition_snapshot, None
        return t

    def write_param_shard(self, g: FlatGroup, src: torch.Tensor) -> None:
        """Store ``src`` as this rank's partition of ``g`` on its home tier (synchronously)."""
        t0 = self.tracer.now()
        self.step_gate.wait()  # a no-op on the background step's own thread
        self._host_reads_done()
        # a staged read of the old values is stale now (none exist for a group a background step
        # updates: stage() skips pending groups)
        self.drop_staged([g.unit])
        n = self._run_io(g.store.write_from, src)
        key = "bytes_nvme_written" if g.store.tier == "nvme" else "bytes_host_written"
        self.stats.add(key, n)
        self.tracer.span(f"write {g.key}", "transfer", t0, self.tracer.now(), thread="io" if self._io else "compute")

    def write_param_shard_and_stage(self, g: FlatGroup, src: torch.Tensor) -> None:
        """:meth:`write_param_shard`, keeping the new values in a staging buffer as the staged
        read of ``g``'s unit when one is spare (NVMe, a one-group unit, two buffers beyond the
        on-demand reserve): the next gather then copies them instead of reading them back.
        The background optimizer step stores its partitions through this."""
        unit = g.unit
        reserve = max(len(u.groups) for u in self.units)
        bufs = None
        if (self.unit_tier(unit) == "nvme" and len(unit.groups) == 1 and unit.index not in self._staged
                and unit.state is UnitState.RELEASED):
            bufs = self._pool.acquire_leaving(1, keep_free=reserve + 1)
        if bufs is None:
            self.write_param_shard(g, src)
            return
        t0 = self.tracer.now()
        buf = bufs[0]
        try:
            view = buf.view(torch.uint8)[: g.store.nbytes].view(g.dtype)
            view.copy_(src)
            n = self._run_io(g.store.write_raw, view)
        except BaseException:
            self._pool.release(buf)
            raise
        self.stats.add("bytes_nvme_written", n)
        self.tracer.span(f"write {g.key}", "transfer", t0, self.tracer.now(), thread="io")
        st = _Staged([buf], [view])
        st.future = _finished(None)
        self._staged[unit.index] = st

    def params_updated(self, groups: Optional[List[FlatGroup]] = None) -> None:
        """Partitions changed outside a forward (optimizer step): gather the persistent unit
        afresh before the next forward; staged reads are stale; a saved weight of a forward
        before this refuses its backward (``_unpack``)."""
        self._param_epoch += 1
        self.drop_staged()
        self.persistent_updated()

    def persistent_updated(self) -> None:
        """The persistent unit's partitions are being updated outside a forward: release its
        gathered copy; the next forward gathers it afresh, after its groups' updates (the step
        gate). The optimizer in backward calls it alone: its staged reads are fresh (it stages
        the new values itself)."""
        self._persistent_stale = True
        if self.units[0].state is not UnitState.RELEASED:
            self.release(self.units[0])

    def zero_grad(self) -> None:
        """Zero every gradient partition (after an optimizer step)."""
        self.step_gate.wait()
        self._land_grads(wait=True)
        if self.options.grads_on_nvme:
            self.check_grad_io(wait=True)
            for g in self.groups():
                g.grad_on_nvme = False
                g.grad_norm_part = None
        for g in self.groups():
            g.drop_grad_shard()

    # [Note: gradients on NVMe] With grads_on_nvme, each unit's reduced gradient partition is
    # added into its swap file on the I/O thread, in submission order, so host memory holds only
    # the partitions in flight. The first micro-batch's partition is written as it is, in the
    # training dtype (``grad_nvme_dtype``; lossless, half the bytes of fp32 in bf16/fp16, and no
    # cast on the compute thread); a later micro-batch reads it back, adds in fp32 and writes
    # the fp32 file, so accumulation never rounds to bf16/fp16. The optimizer step reads the
    # file in whichever dtype it holds (CPU Adam takes bf16/fp16 gradients); readers that want
    # fp32 get it converted. read_grad_shard / write_grad_shard run on the I/O thread too,
    # hence after the accumulations.
    def check_grad_io(self, wait: bool = False) -> None:
        """Raise the first failed gradient write (an ``OSError`` naming the file); with
        ``wait``, wait for all of them first."""
        keep = []
        for f in self._grad_io:
            if wait or f.done():
                f.result()
            else:
                keep.append(f)
        self._grad_io = keep

    # [Note: norm while reducing] With gradients on NVMe, the global gradient norm at the step
    # would re-read every gradient partition. Each accumulation into a swap file has the new
    # accumulated value in memory anyway, so it also records that value's norm part
    # (``grad_norm.norm_part``: ``sum |g|^p``, or ``max |g|`` for inf) in
    # ``group.grad_norm_part``; a write from outside (``write_grad_shard``) or ``zero_grad``
    # clears it. The engine sets ``grad_norm_type`` to its configured norm.
    def grad_norm_parts(self) -> Optional[List[float]]:
        """Norm parts of every group's accumulated gradient recorded while reducing (0.0 for
        a group with no gradient), or None when one is missing (then read the partitions).
        Waits for the gradient writes in flight; raises their I/O error."""
        if not self.options.grads_on_nvme or self.grad_norm_type is None:
            return None
        self.check_grad_io(wait=True)
        out = []
        for g in self.groups():
            if not g.grad_on_nvme:
                out.append(0.0)
            elif g.grad_norm_part is None:
                return None
            else:
                out.append(g.grad_norm_part)
        return out

    @staticmethod
    def _grad_key(g: FlatGroup, dtype: torch.dtype = torch.float32) -> str:
        return f"grad/{g.key}" if dtype == torch.float32 else f"grad/{g.key}/{str(dtype).split('.')[-1]}"

    def _accumulate_grad_on_nvme(self, g: FlatGroup, part: torch.Tensor,
                                 recycle: Optional[torch.Tensor] = None) -> None:
        """Add ``part`` (this rank's reduced partition, ``shard_numel`` CPU elements in the
        training dtype or fp32) into the group's gradient swap file; see [Note: gradients on NVMe].
        ``recycle``: the scratch tensor ``part`` lies in, given back to ``self.host`` once done."""
        t0 = self.tracer.now()
        part = part.contiguous()
        acc = None
        if g.grad_on_nvme:
            acc = self.host.take(part.numel(), torch.float32)
            t1 = self.tracer.now()
            self._optimizer_read("grad", g, self._read_grad_file(g, acc), t1)
            acc.add_(part)
            part = acc
        if self.grad_norm_type is not None:
            g.grad_norm_part = norm_part(part, self.grad_norm_type)
        self._swapper.swap_out([(self._grad_key(g, part.dtype), part)], async_op=False)
        g.grad_on_nvme, g.grad_nvme_dtype = True, part.dtype
        self.stats.add("bytes_nvme_written", part.numel() * part.element_size())
        self.tracer.span(f"grad {g.key}", "transfer", t0, self.tracer.now(), thread="io")
        for t in (acc, recycle):
            if t is not None:
                self.host.give(t)

    def _read_grad_file(self, g: FlatGroup, dst: torch.Tensor) -> int:
        """Read the group's accumulated gradient (``grad_on_nvme``) into ``dst``, converting
        from the file's dtype when ``dst``'s differs; returns the bytes read."""
        src = dst if dst.dtype == g.grad_nvme_dtype else torch.empty(dst.numel(), dtype=g.grad_nvme_dtype)
        self._swapper.swap_in([(self._grad_key(g, g.grad_nvme_dtype), src)], async_op=False)
        if src is not dst:
            dst.copy_(src)
        return src.numel() * src.element_size()

    def grad_file_dtype(self, g: FlatGroup) -> torch.dtype:
        """The dtype the group's gradient partition is held in on NVMe (after the gradient
        writes completed: :meth:`check_grad_io` with ``wait``); reading it in that dtype moves
        the fewest bytes."""
        return g.grad_nvme_dtype if g.grad_on_nvme else torch.float32

    def read_grad_shard(self, g: FlatGroup, dst: torch.Tensor) -> None:
        """Copy this rank's accumulated fp32 gradient partition of ``g`` into ``dst``."""
        self.step_gate.wait()
        self._land_grads(wait=True)
        if not self.options.grads_on_nvme:
            if g.grad_shard is None:
                dst.zero_()
            else:
                dst.copy_(g.grad_shard)
            return
        self.check_grad_io(wait=True)
        self._run_io(self.read_grad_raw, g, dst)

    def read_grad_raw(self, g: FlatGroup, dst: torch.Tensor) -> None:
        """The swap-file read of :meth:`read_grad_shard` alone, for the I/O thread (see
        :meth:`submit_io`): no waits; the caller has completed the gradient writes first."""
        if g.grad_on_nvme:
            t0 = self.tracer.now()
            self._optimizer_read("grad", g, self._read_grad_file(g, dst), t0)
        else:
            dst.zero_()

    def write_grad_shard(self, g: FlatGroup, src: torch.Tensor) -> None:
        """Replace this rank's gradient partition of ``g`` by ``src`` (fp32, ``shard_numel``)."""
        self.step_gate.wait()
        self._land_grads(wait=True)
        if not self.options.grads_on_nvme:
            (g.grad_shard if g.grad_shard is not None else g.new_grad_shard()).copy_(src)
            return

        def write():
            g.grad_norm_part = None
            t = src.to(torch.float32).contiguous()
            self._swapper.swap_out([(self._grad_key(g), t)], async_op=False)
            g.grad_on_nvme, g.grad_nvme_dtype = True, torch.float32
            self.stats.add("bytes_nvme_written", t.numel() * t.element_size())
        self._run_io(write)

    @torch.inference_mode(False)  # [Note: outside inference mode]
    def gather_group_copy(self, g: FlatGroup) -> torch.Tensor:
        """A new full flat tensor (``padded_numel`` elements, on the compute device) of group
        ``g`` read from every rank's partition; the module's parameters are not touched.
        Collective when ``world_size > 1``."""
        self.step_gate.wait()
        if g.unit.state is UnitState.GATHERED:  # FETCHING: g.full not filled yet
            return g.full.clone()
        full = torch.empty(g.padded_numel, dtype=g.dtype, device=self.device)
        lo, hi = self._shard_range(g)
        self._run_io(g.store.read_into, full[lo:hi])
        if self.world_size > 1:
            mine = full[lo:hi].clone()
            dist.all_gather(list(full.chunk(self.world_size)), mine, group=self.group)
        return full

    def write_group_values(self, g: FlatGroup, values: Sequence[Tuple[ParamSlot, torch.Tensor]],
                           exact: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Write full values of some of ``g``'s parameters into this rank's partition (each rank
        keeps the part that falls in its shard), refresh a gathered copy, and notify listeners.

        Args:
            values: ``(slot, tensor)`` pairs; each tensor holds the slot's ``numel`` elements
                (any shape), in ``g.dtype`` (on any device).
            exact: for a bf16/fp16 group, the same values in fp32 (CPU), one per pair (a file's
                or a state dict's fp32 weights: :func:`~.units.exact_values`): the listeners'
                fp32 masters take them, not their rounding.
        """
        self._write_partition(g, [(s.offset, v.reshape(-1)) for s, v in values], full=True)
        lo, hi = self._shard_range(g)
        spans = [(max(lo, s.offset) - lo, min(hi, s.offset + s.numel) - lo) for s, _ in values]
        written = {g.key: [(a, b) for a, b in spans if a < b]}
        exact_shards: Dict[str, torch.Tensor] = {}
        if exact is not None and g.dtype != torch.float32 and self._listeners:
            # only the written ranges are read (the listeners' refreshed_master): no read of the
            # partition back from its tier for the rest
            src = torch.empty(g.shard_numel, dtype=torch.float32)
            for (s, _), v in zip(values, exact):
                a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
                if a < b:
                    src[a - lo:b - lo] = v.reshape(-1)[a - s.offset:b - s.offset]
            exact_shards[g.key] = src
        for fn in self._listeners:
            fn([g], written, exact_shards)

    def write_partition_slice(self, g: FlatGroup, lo: int, values: torch.Tensor) -> None:
        """Write ``values`` (1-D) into this rank's partition of ``g`` at ``[lo, lo + numel)``
        (partition coordinates) and into a gathered copy; listeners are not told (the
        optimizer's master weights write through this: [Note: master in the partitions]).

        Raises:
            ValueError: the slice runs past the partition's ``shard_numel``.
        """
        if lo < 0 or lo + values.numel() > g.shard_numel:
            raise ValueError(f"write_partition_slice: [{lo}, {lo + values.numel()}) is outside the partition of "
                             f"flat group {g.key} ({g.shard_numel} elements)")
        self._write_partition(g, [(self._shard_range(g)[0] + lo, values.reshape(-1))], full=False)

    @torch.inference_mode(False)  # [Note: outside inference mode]
    @torch.no_grad()
    def _write_partition(self, g: FlatGroup, values: Sequence[Tuple[int, torch.Tensor]], full: bool) -> None:
        """Write 1-D ``values`` at flat offsets into this rank's partition of ``g`` (only what
        falls in it) and, while gathered, into ``g.full`` (the whole value when ``full``). Under
        ``no_grad``: values that require grad (``dict(other.named_parameters())`` loaded) made
        the partitions autograd tensors holding ``other`` alive."""
        self.step_gate.wait()
        lo, hi = self._shard_range(g)
        local = g.store.local()
        shard = local if local is not None else torch.empty(g.shard_numel, dtype=g.dtype, device=self.device)
        if local is None:
            self._run_io(g.store.read_into, shard)
        unit = g.unit
        if unit.future is not None:  # a read of the old partition into g.full must not land after the new values
            self.transfers.stream_wait(unit.future.result())
            unit.future = None
        self._host_reads_done()
        for off, v in values:
            a, b = max(lo, off), min(hi, off + v.numel())
            if a < b:
                shard[a - lo:b - lo].copy_(v[a - off:b - off])
            if g.full is not None:
                if full:
                    g.full[off:off + v.numel()].copy_(v)
                elif a < b:
                    g.full[a:b].copy_(v[a - off:b - off])
        self._drop_snapshot(g)  # it holds the old values: partition_copy must not hand them over
        if local is None:
            self.write_param_shard(g, shard)

    def add_write_listener(self, fn: Callable[[List[FlatGroup], Dict[str, List[Tuple[int, int]]],
                                                Dict[str, torch.Tensor]], None]) -> None:
        """``fn(groups, written, exact)`` runs after new values were written into partitions
        outside the optimizer (``gathered_parameters``, a load, a forward's change): ``written``
        maps each group's key to the element ranges ``[a, b)`` of this rank's partition that were
        written (an engine re-reads those parts of its fp32 master weights:
        :func:`refreshed_master`); ``exact`` maps a bf16/fp16 group's key to fp32 values for those
        ranges (``shard_numel`` elements, valid on the written ranges only) to take instead of
        the partition's rounding (see :meth:`write_group_values`)."""
        self._listeners.append(fn)
